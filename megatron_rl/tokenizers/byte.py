"""A byte-level tokenizer that needs no files: ids 0-255 are bytes, then <pad>, <bos>, <eos>.

Used by the `tiny` model and the default job, which run without downloads.
"""

from __future__ import annotations

from typing import Optional, Sequence

from megatron_rl.tokenizers.base import Tokenizer


class ByteTokenizer(Tokenizer):
    PAD, BOS, EOS = 256, 257, 258

    @property
    def vocab_size(self) -> int:
        return 259

    @property
    def bos_id(self) -> Optional[int]:
        return self.BOS

    @property
    def eos_id(self) -> int:
        return self.EOS

    @property
    def pad_id(self) -> int:
        return self.PAD

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        names = {self.PAD: "<pad>", self.BOS: "<bos>", self.EOS: "<eos>"}
        for i in ids:
            i = int(i)
            if i < 256:
                out += bytes([i])
            elif not skip_special_tokens and i in names:
                out += names[i].encode()
        return out.decode("utf-8", errors="replace")

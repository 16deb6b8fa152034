"""Parallel layouts: how one executor's ranks split into tensor, pipeline and data parallel groups."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelLayout:
    """TP x PP x DP over `size` ranks. Rank order inside an executor is Megatron-Core's default "tp-cp-ep-dp-pp":
    TP fastest, then DP, then PP (local rank = tp_rank + tp * (dp_rank + dp * pp_rank))."""

    tp: int = 1
    pp: int = 1
    dp: int = 1

    @property
    def size(self) -> int:
        return self.tp * self.pp * self.dp

    def coords(self, local_rank: int) -> tuple[int, int, int]:
        """(tp_rank, pp_rank, dp_rank) of a rank local to the executor."""
        if not 0 <= local_rank < self.size:
            raise ValueError(f"local rank {local_rank} outside a layout of {self.size} ranks")
        tp_rank = local_rank % self.tp
        dp_rank = (local_rank // self.tp) % self.dp
        pp_rank = local_rank // (self.tp * self.dp)
        return tp_rank, pp_rank, dp_rank

    def local_rank(self, tp_rank: int, pp_rank: int, dp_rank: int) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def __str__(self) -> str:
        return f"tp={self.tp},pp={self.pp},dp={self.dp}"

    @classmethod
    def parse(cls, text: str) -> "ParallelLayout":
        """Parse "tp=2,pp=2,dp=1" (missing keys default to 1)."""
        values = {"tp": 1, "pp": 1, "dp": 1}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or key not in values:
                raise ValueError(f"bad layout {text!r}: expected comma-separated tp=N,pp=N,dp=N")
            try:
                values[key] = int(value)
            except ValueError:
                raise ValueError(f"bad layout {text!r}: {key} must be an integer, got {value!r}") from None
            if values[key] < 1:
                raise ValueError(f"bad layout {text!r}: {key} must be >= 1")
        return cls(**values)

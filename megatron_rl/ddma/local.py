"""Execute a whole reshard plan inside one process, where every (virtual) rank's tensors are local.

For a single GPU holding both layouts (benchmarks, single-device colocated jobs) there are no messages: every copy
of the plan is a device-to-device copy. The views of all copies are bound once, and each run issues them with
`torch._foreach_copy_`. Measured on an H100 (benchmarks/ddma.py): 1.9-2.0 TB/s counting reads and writes, about
0.65 of one plain copy of the same bytes. Launches are not the cost (a Python loop of `copy_` or foreach over only
the contiguous slices time the same); the column slices of row-parallel weights (`linear_proj`, `linear_fc2`,
a third of the bytes) are strided copies, which PyTorch's copy kernel runs well below its contiguous speed.
"""

from __future__ import annotations

from typing import Mapping

import torch

from megatron_rl.ddma.planner import Box, ReshardPlan


def _view(t: torch.Tensor, box: Box) -> torch.Tensor:
    return t[tuple(slice(a, b) for a, b in box)]


class InProcessReshard:
    """All copies and zero-fills of `plan`, bound to tensors held by this process.

    `src` / `dst` map a global rank of the plan to that rank's {local name: tensor}; the tensors must keep their
    storage between runs (parameters do).
    """

    def __init__(self, plan: ReshardPlan, src: Mapping[int, Mapping[str, torch.Tensor]],
                 dst: Mapping[int, Mapping[str, torch.Tensor]]):
        self.plan = plan
        self._dst = [_view(dst[c.dst_rank][c.dst_param], c.dst_box) for c in plan.copies]
        self._src = [_view(src[c.src_rank][c.src_param], c.src_box) for c in plan.copies]
        self._zero = [_view(dst[z.rank][z.param], z.box) for z in plan.zero_fills]
        self.bytes = sum(v.numel() * v.element_size() for v in self._dst)

    @torch.no_grad()
    def run(self) -> None:
        torch._foreach_copy_(self._dst, self._src)
        if self._zero:
            torch._foreach_zero_(self._zero)

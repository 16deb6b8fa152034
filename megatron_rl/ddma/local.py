"""Execute a whole reshard plan inside one process, where every (virtual) rank's tensors are local.

For a single GPU holding both layouts (benchmarks, single-device colocated jobs) there are no messages: every copy
of the plan is a device-to-device copy. The views of all copies are bound once, and each run issues them with
`torch._foreach_copy_`. Measured on an H100 (benchmarks/ddma.py) with copies in the parameters' own dtype:
1.9-2.0 TB/s counting reads and writes, about 0.65 of one plain copy of the same bytes. Launches are not the cost
(a Python loop of `copy_` or foreach over only the contiguous slices time the same); the column slices of
row-parallel weights (`linear_proj`, `linear_fc2`, a third of the bytes) are strided copies, which PyTorch's copy
kernel runs well below its contiguous speed. The views are therefore bound as wide elements (`wide_copy`).
"""

from __future__ import annotations

from typing import Mapping

import torch

from megatron_rl.ddma.planner import ReshardPlan, box_view
from megatron_rl.ddma.wide_copy import wide_views


class InProcessReshard:
    """All copies and zero-fills of `plan`, bound to tensors held by this process.

    `src` / `dst` map a global rank of the plan to that rank's {local name: tensor}; the tensors must keep their
    storage between runs (parameters do).
    """

    def __init__(self, plan: ReshardPlan, src: Mapping[int, Mapping[str, torch.Tensor]],
                 dst: Mapping[int, Mapping[str, torch.Tensor]], wide: bool = True):
        self.plan = plan
        pairs = [(box_view(dst[c.dst_rank][c.dst_param], c.dst_box),
                  box_view(src[c.src_rank][c.src_param], c.src_box))
                 for c in plan.copies]
        self.bytes = sum(d.numel() * d.element_size() for d, _ in pairs)
        if wide:  # wide=False: copies in the parameters' dtype (benchmarks/ddma.py compares the two)
            widened = [wide_views(d, s) for d, s in pairs]
            self.wide_copies = sum(1 for (d, _), (w, _) in zip(pairs, widened) if w.dtype != d.dtype)
            pairs = widened
        else:
            self.wide_copies = 0
        self._dst = [d for d, _ in pairs]
        self._src = [s for _, s in pairs]
        self._zero = [box_view(dst[z.rank][z.param], z.box) for z in plan.zero_fills]

    @torch.no_grad()
    def run(self) -> None:
        torch._foreach_copy_(self._dst, self._src)
        if self._zero:
            torch._foreach_zero_(self._zero)

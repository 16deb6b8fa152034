"""DDMA handshake: phase 1 of a sync (`ddma.transport`), before any weight moves.

One small message (`Handshake`) goes each way between every pair of ranks that exchange weights. It carries
readiness (a rank whose parameters do not fit the plan says so, and its peers raise `PeerCheckFailed` instead of
waiting for slices that will never come), the trainer step (generator ranks learn it here), and the dtypes of the
parameters at both ends of every slice, which decide how each slice travels (`slice_dtypes`).

check_and_agree  check this rank's parameters against the plan, exchange handshakes, agree on the step
slice_dtypes     both dtypes of every slice this rank sends or receives, once the handshakes are in
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from megatron_rl.ddma.planner import RankPlan, ReshardPlan
from megatron_rl.ddma.quant import QuantizedWeight

# dtype codes exchanged in the handshake (index in this tuple); the order is part of the wire format.
WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8,
               torch.int32, torch.int64)


def _check_params(rp: RankPlan, src_params: Optional[Mapping[str, torch.Tensor]],
                  dst_params: Optional[Mapping[str, torch.Tensor]], quantized: frozenset[str] = frozenset(),
                  fmt: Optional[type[QuantizedWeight]] = None) -> None:
    """Every parameter the plan touches on this rank must exist and be large enough (before any message); the
    `quantized` ones must be `fmt` weights, the others tensors."""

    def need(params, role, name, box):
        if params is None:
            raise ValueError(f"rank {rp.rank}: the plan uses this rank as {role} but no {role} parameters "
                             f"were given")
        if name not in params:
            raise ValueError(f"rank {rp.rank}: {role} model has no parameter {name!r} (a different model "
                             f"or layout than the plan's?)")
        shape = tuple(params[name].shape)
        if len(shape) != len(box) or any(b > s for (_, b), s in zip(box, shape)):
            raise ValueError(f"rank {rp.rank}: {role} parameter {name!r} has shape {shape}, too small for "
                             f"slice {box} (a different model or layout than the plan's?)")

    for c in rp.sends + rp.local:
        need(src_params, "source", c.src_param, c.src_box)
        if src_params[c.src_param].dtype not in WIRE_DTYPES:
            raise ValueError(f"rank {rp.rank}: source parameter {c.src_param!r} has dtype "
                             f"{src_params[c.src_param].dtype}, which DDMA cannot send")
    for c in rp.recvs + rp.local:
        need(dst_params, "destination", c.dst_param, c.dst_box)
        target = dst_params[c.dst_param]
        if (c.name in quantized) != isinstance(target, QuantizedWeight) or (c.name in quantized
                                                                            and type(target) is not fmt):
            want = f"a {fmt.__name__} (quantize={fmt.FORMAT!r})" if c.name in quantized else "a tensor"
            raise ValueError(f"rank {rp.rank}: destination parameter {c.dst_param!r} must be {want}")
    for z in rp.zero_fills:
        need(dst_params, "destination", z.param, z.box)


class PeerCheckFailed(RuntimeError):
    """A peer rank reported that its parameters do not match the plan; nothing was transferred."""


_NOT_A_TENSOR = -2  # dtype code of a destination that is not a plain tensor (a QuantizedWeight)
_UNKNOWN = -1  # dtype code sent by a rank whose parameters failed the check, and the step code of "no step"


@dataclass(frozen=True)
class Handshake:
    """What a rank tells one peer before any weight moves.

    ok: this rank's parameters fit the plan (if not, the peer raises PeerCheckFailed instead of waiting for
        slices that will never come).
    step: the trainer step being synced (None on generator ranks, which learn it from this message).
    src_dtypes: the dtype code (index in WIRE_DTYPES) of each distinct source parameter this rank sends to the
        peer, in plan order (`_params_to`).
    dst_dtypes: the dtype code of each distinct destination parameter this rank receives from the peer, in plan
        order (`_params_from`); `_NOT_A_TENSOR` for a QuantizedWeight.

    With both messages of a pair, each end knows the dtypes at both ends of every slice the pair moves, which
    decides how the slice travels. On the wire: one int64 tensor [ok, step or -1, *src_dtypes, *dst_dtypes]; the
    receiver knows both lengths from the plan.
    """

    ok: bool
    step: Optional[int]
    src_dtypes: tuple[int, ...]
    dst_dtypes: tuple[int, ...]

    @staticmethod
    def numel(n_src: int, n_dst: int) -> int:
        return 2 + n_src + n_dst

    def to_tensor(self, device) -> torch.Tensor:
        step = _UNKNOWN if self.step is None else int(self.step)
        return torch.tensor([int(self.ok), step, *self.src_dtypes, *self.dst_dtypes], dtype=torch.int64,
                            device=device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor, n_src: int, n_dst: int) -> "Handshake":
        v = t.tolist()
        if len(v) != cls.numel(n_src, n_dst):
            raise ValueError(f"a handshake of {len(v)} values, expected {cls.numel(n_src, n_dst)}")
        return cls(ok=v[0] == 1, step=None if v[1] == _UNKNOWN else v[1], src_dtypes=tuple(v[2:2 + n_src]),
                   dst_dtypes=tuple(v[2 + n_src:]))


def _dtype_code(target) -> int:
    if not isinstance(target, torch.Tensor) or target.dtype not in WIRE_DTYPES:
        return _NOT_A_TENSOR
    return WIRE_DTYPES.index(target.dtype)


def _params_to(rp: RankPlan, peer: int, attr: str = "src_param") -> list[str]:
    """Distinct parameters (source names, or destination names) of the copies this rank sends to `peer`."""
    return list(dict.fromkeys(getattr(c, attr) for c in rp.sends if c.dst_rank == peer))


def _params_from(rp: RankPlan, peer: int, attr: str) -> list[str]:
    """Distinct parameters of the copies this rank receives from `peer` (the peer's `_params_to`, same order)."""
    return list(dict.fromkeys(getattr(c, attr) for c in rp.recvs if c.src_rank == peer))


def _handshake(rp: RankPlan, ok: bool, step: Optional[int], src_params, dst_params,
               device) -> dict[int, Handshake]:
    """Send this rank's Handshake to every peer and return theirs (all messages in one batch)."""
    ops, theirs = [], {}
    for p in rp.peers:
        mine = Handshake(ok, step,
                         tuple(_dtype_code(src_params[n]) if ok else _UNKNOWN for n in _params_to(rp, p)),
                         tuple(_dtype_code(dst_params[n]) if ok else _UNKNOWN
                               for n in _params_from(rp, p, "dst_param")))
        # The peer's message lists what it sends to us, then what it receives from us.
        n_src, n_dst = len(_params_from(rp, p, "src_param")), len(_params_to(rp, p, "dst_param"))
        theirs[p] = (torch.empty(Handshake.numel(n_src, n_dst), dtype=torch.int64, device=device), n_src, n_dst)
        ops += [dist.P2POp(dist.isend, mine.to_tensor(device), p), dist.P2POp(dist.irecv, theirs[p][0], p)]
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return {p: Handshake.from_tensor(t, n_src, n_dst) for p, (t, n_src, n_dst) in theirs.items()}


def check_and_agree(plan: ReshardPlan, rp: RankPlan, step: Optional[int], src_params, dst_params,
                     quantized: frozenset[str], device,
                     fmt: Optional[type[QuantizedWeight]] = None) -> tuple[dict[int, Handshake], Optional[int]]:
    """Phase 1: check this rank's parameters against the plan, exchange handshakes, and agree on the step.

    The check's verdict travels in the handshake before this rank raises it, so a mismatch anywhere stops every
    rank it concerns (ValueError here, PeerCheckFailed at its peers) instead of leaving a peer waiting. Returns the
    peers' handshakes and the trainer step (this rank's, or the one its trainer peers sent).
    """
    error: Optional[ValueError] = None
    try:
        _check_params(rp, src_params, dst_params, quantized, fmt)
    except ValueError as e:
        error = e
    received = _handshake(rp, error is None, step, src_params, dst_params, device)
    if error is not None:
        raise error
    failed = [p for p, h in received.items() if not h.ok]
    if failed:
        raise PeerCheckFailed(f"rank {rp.rank}: peer ranks {failed} failed their pre-transfer check; no weights "
                              f"were moved")
    steps = {h.step for p, h in received.items() if p in plan.src.ranks} | ({step} if step is not None else set())
    if len(steps) > 1:
        raise RuntimeError(f"rank {rp.rank}: trainer ranks disagree on the step being synced: "
                           f"{sorted(steps, key=lambda s: -1 if s is None else s)}")
    return received, (steps.pop() if steps else None)


def slice_dtypes(rp: RankPlan, received: Mapping[int, Handshake], src_params, dst_params):
    """Both dtypes of every slice this rank sends or receives: {(src rank, src param): dtype} and
    {(dst rank, dst param): dtype or None (a QuantizedWeight)}, from the peers' handshakes and this rank's own
    parameters."""
    src_dtype: dict[tuple[int, str], Optional[torch.dtype]] = {}
    dst_dtype: dict[tuple[int, str], Optional[torch.dtype]] = {}
    for p, h in received.items():
        for name, code in zip(_params_from(rp, p, "src_param"), h.src_dtypes):
            src_dtype[p, name] = WIRE_DTYPES[code]
        for name, code in zip(_params_to(rp, p, "dst_param"), h.dst_dtypes):
            dst_dtype[p, name] = None if code == _NOT_A_TENSOR else WIRE_DTYPES[code]
    for name, t in (src_params or {}).items():
        src_dtype[rp.rank, name] = t.dtype
    for name, t in (dst_params or {}).items():
        dst_dtype[rp.rank, name] = t.dtype if _dtype_code(t) != _NOT_A_TENSOR else None
    return src_dtype, dst_dtype

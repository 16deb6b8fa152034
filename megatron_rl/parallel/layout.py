"""Parallel layouts: how one executor's ranks split into tensor, pipeline and data parallel groups, and whether a
layout can hold a model (`layout_problems`, the one rule every caller applies: the job's configuration, DDMA,
the converter, `eval` and the reward model)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol


@dataclass(frozen=True)
class ParallelLayout:
    """TP x PP x DP over `size` ranks. Rank order inside an executor is Megatron-Core's default "tp-cp-ep-dp-pp":
    TP fastest, then DP, then PP (local rank = tp_rank + tp * (dp_rank + dp * pp_rank)).

    Mixture-of-experts models lay their experts out on the same ranks by Megatron-Core's expert grid
    "tp-ep-dp-pp": the tp x dp ranks of a stage are `etp` (expert tensor parallelism, default `tp`: each expert's
    weights split as a dense MLP's) x `ep` (expert parallelism: each layer's experts split in `ep` shares) x the
    expert-data-parallel rest, which hold the same experts. With the default `etp` EP runs over DP ranks, as a
    trainer does (DP rank r holds EP share r % ep); `etp=1, ep=tp` keeps the experts within a TP group (each TP
    rank holds whole experts), so DP replicas stay independent, as a generator's must. They add no ranks."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    etp: Optional[int] = None

    def __post_init__(self):
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)

    def expert_coords(self, tp_rank: int, dp_rank: int) -> tuple[int, int]:
        """(expert TP rank, EP rank) of a rank: which slice of which share of the experts it holds."""
        r = tp_rank + self.tp * dp_rank
        return r % self.etp, (r // self.etp) % self.ep

    def expert_grid_problem(self) -> Optional[str]:
        """Why the expert grid does not fit this layout (None when it does): its etp x ep ranks must tile each
        stage's tp x dp ranks, the rest being expert-data-parallel. The one home of that rule (`layout_problems`
        reports it with the model's; the process groups check it before they are built)."""
        if (self.tp * self.dp) % (self.etp * self.ep):
            return (f"etp x ep = {self.etp} x {self.ep} does not divide the {self.tp * self.dp} ranks of a stage "
                    f"(tp x dp = {self.tp} x {self.dp})")
        return None

    @property
    def expert_dp(self) -> int:
        """The expert-data-parallel size: a stage's tp x dp ranks over etp x ep (the ranks that hold the same
        experts, over which their gradients are reduced and their optimizer state sharded)."""
        return self.tp * self.dp // (self.etp * self.ep)

    def expert_dp_rank(self, tp_rank: int, dp_rank: int) -> int:
        """A rank's place in its expert-data-parallel group (Megatron-Core's grid "tp-ep-dp-pp")."""
        return (tp_rank + self.tp * dp_rank) // (self.etp * self.ep) % self.expert_dp

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
        return (f"tp={self.tp},pp={self.pp},dp={self.dp}" + (f",ep={self.ep}" if self.ep != 1 else "")
                + (f",etp={self.etp}" if self.etp != self.tp else ""))

    @classmethod
    def parse(cls, text: str) -> "ParallelLayout":
        """Parse "tp=2,pp=2,dp=1" or "tp=2,dp=2,ep=2" (missing keys default to 1, etp to tp)."""
        values = {"tp": 1, "pp": 1, "dp": 1, "ep": 1, "etp": None}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or key not in values:
                raise ValueError(f"bad layout {text!r}: expected comma-separated tp=N,pp=N,dp=N[,ep=N,etp=N]")
            try:
                values[key] = int(value)
            except ValueError:
                raise ValueError(f"bad layout {text!r}: {key} must be an integer, got {value!r}") from None
            if values[key] < 1:
                raise ValueError(f"bad layout {text!r}: {key} must be >= 1")
        return cls(**values)


class ModelDims(Protocol):
    """The dimensions of a model that a layout splits (`ModelConfig` and `ddma.descriptors.ModelShape` have them)."""

    num_attention_heads: int
    num_query_groups: int
    ffn_hidden_size: int
    num_layers: int
    num_moe_experts: Optional[int]
    moe_ffn_hidden_size: Optional[int]


# The model dimensions each parallel size must divide: Megatron-Core gives every TP rank the same number of
# attention heads, query groups and MLP channels, every pipeline stage the same number of layers, every EP rank the
# same number of experts and every expert-TP rank the same share of an expert (a dense model's None dimensions are
# not split).
SPLIT_DIMS = {"tp": ("num_attention_heads", "num_query_groups", "ffn_hidden_size"), "pp": ("num_layers",),
              "ep": ("num_moe_experts",), "etp": ("moe_ffn_hidden_size",)}


@dataclass(frozen=True)
class LayoutProblem:
    """One reason a layout cannot hold a model: `dim` ("tp", "pp", "dp" or "ep") is `size`, which is below 1
    (`field` None) or does not divide the model's `field` (`count`; "dp" for EP's own rule: it must divide DP).
    `str()` is a plain wording; each caller may word it for its own users from the fields."""

    dim: str
    size: int
    field: Optional[str] = None
    count: int = 0

    def __str__(self) -> str:
        if self.field is None:
            return f"{self.dim}={self.size} must be >= 1"
        if self.field == "dense":
            return f"{self.dim}={self.size} needs a mixture-of-experts model (this one is dense)"
        return f"{self.dim}={self.size} does not divide {self.field}={self.count}"


def layout_problems(model: ModelDims, layout: ParallelLayout) -> list[LayoutProblem]:
    """Why `layout` cannot hold `model` (empty when it can): every size below 1, else every model dimension of
    `SPLIT_DIMS` that TP or PP does not divide, in that order. Pure; the model's own shape (heads per query group,
    positive sizes) is the model's rule, not checked here."""
    dims = ("tp", "pp", "dp", "ep") + (("etp",) if layout.etp != layout.tp else ())  # etp defaults to tp
    low = [LayoutProblem(dim, getattr(layout, dim)) for dim in dims if getattr(layout, dim) < 1]
    if low:
        return low
    if (layout.ep, layout.etp) != (1, layout.tp) and getattr(model, "num_moe_experts", None) is None:
        return [LayoutProblem("ep" if layout.ep > 1 else "etp", getattr(layout, "ep" if layout.ep > 1 else "etp"),
                              "dense")]
    out = [LayoutProblem(dim, getattr(layout, dim), name, getattr(model, name))
           for dim, names in SPLIT_DIMS.items() for name in names
           if getattr(model, name, None) is not None and getattr(model, name) % getattr(layout, dim)]
    if layout.expert_grid_problem():
        out.append(LayoutProblem("etp x ep", layout.ep * layout.etp, "tp x dp", layout.tp * layout.dp))
    return out

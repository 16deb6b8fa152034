"""A job's configuration fitted to where it runs, where nobody chose: the layout to the machine's GPUs
(`fit_to_devices`) and an episode's token budget to the model's positions (`fit_episode_budget`). Both are pure:
the caller (`cli.py`) counts the devices and knows which keys the user set (`config.given_keys`); what still does
not fit is left to `config.validate` to name.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Collection

if TYPE_CHECKING:
    from megatron_rl.config import JobConfig

LAYOUT_KEYS = ("trainer.tp", "trainer.pp", "trainer.dp", "trainer.ep", "generator.tp", "generator.pp",
               "generator.dp", "generator.ep", "generator.colocated")


def _plural(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def fit_to_devices(cfg: JobConfig, devices: int, given: Collection[str] = ()) -> tuple[JobConfig, str]:
    """The job's layout fitted to the `devices` GPUs it will have, and the reason in a few words ("" when nothing
    was fitted). Pure: the caller counts the devices.

    Only a layout nobody chose is fitted: when `given` (the keys the user set, `given_keys`) names any of
    `LAYOUT_KEYS`, the configuration is returned as it is, and a layout that does not fit the machine stays an
    error. Without GPUs (0) the layout is the one configured, which the CPU runs as it is. Where the configured
    layout fits, it is kept. Otherwise the largest of these that fits: trainer and generator at TP1 on a GPU each
    (two ranks: the generator runs ahead while the trainer trains), then both colocated at TP1 on one GPU. A
    reward-model executor keeps its own ranks in every case."""
    if devices <= 0 or any(k in LAYOUT_KEYS for k in given):
        return cfg, ""
    need = cfg.world_size_needed
    if need <= devices:
        return cfg, f"the configured layout uses {need} of {_plural(devices, 'GPU')}"
    reward_ranks = need - cfg.reward_first_rank
    single = {"tp": 1, "pp": 1, "dp": 1, "ep": 1}
    for ranks, colocated, words in ((2, False, "trainer and generator at TP1, a GPU each"),
                                    (1, True, "trainer and generator colocated at TP1")):
        if ranks + reward_ranks <= devices:
            fitted = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, **single),
                                         generator=dataclasses.replace(cfg.generator, **single, colocated=colocated))
            return fitted, (f"fitted to {_plural(devices, 'GPU')}: {words}, as the configured layout needs "
                            f"{_plural(need, 'GPU')}; set trainer.tp/pp/dp and generator.tp/pp/dp/colocated to "
                            f"choose")
    return cfg, ""


def fit_episode_budget(cfg: JobConfig, given: Collection[str] = ()) -> JobConfig:
    """An episode's token budget fitted to the model when nobody chose it: with `env.cls` and `env.max_tokens` not
    in `given`, the budget is at most what the model's positions leave after `rollout.max_prompt_length` (the tiny
    model's 512 positions hold no 512-token episode after a prompt). Pure; a model that does not resolve, or leaves
    no room at all, is left to `validate` to name."""
    if not cfg.env.episodic or "env.max_tokens" in given:
        return cfg
    try:
        room = cfg.model.resolve().max_position_embeddings - cfg.rollout.max_prompt_length
    except ValueError:
        return cfg
    if 1 <= room < cfg.env.max_tokens:
        return dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, max_tokens=room))
    return cfg

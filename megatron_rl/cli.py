"""The `megatron-rl` command."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from megatron_rl.config import ConfigError, load_config, validate


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", help="YAML config file (defaults are built in)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value",
                   help="dotted overrides applied after the file, e.g. trainer.tp=2 rollout.staleness=2")


def _load(args) -> tuple:
    cfg = load_config(args.config, args.overrides)
    model = validate(cfg, world_size=cfg.run.world_size)
    return cfg, model


def cmd_train(args) -> int:
    cfg, model = _load(args)
    print(f"megatron-rl train: model {cfg.model.preset} ({model.num_parameters() / 1e6:.1f}M parameters), "
          f"trainer tp={cfg.trainer.tp} pp={cfg.trainer.pp} dp={cfg.trainer.dp}, generator tp={cfg.generator.tp} "
          f"dp={cfg.generator.dp}{' (colocated)' if cfg.generator.colocated else ''}, "
          f"{cfg.rollout.mode} rollouts, {cfg.world_size_needed} ranks")
    print("not yet available: the controller that runs the RL job has not landed yet "
          "(configuration checked and valid)")
    return 0


def cmd_config(args) -> int:
    cfg, _ = _load(args)
    import yaml

    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    return 0


def cmd_presets(args) -> int:
    from megatron_rl.models.presets import PRESETS

    for name, m in PRESETS.items():
        print(json.dumps({"preset": name, "parameters": m.num_parameters(), "layers": m.num_layers,
                          "hidden": m.hidden_size, "heads": m.num_attention_heads, "kv_heads": m.num_query_groups,
                          "vocab": m.vocab_size, "tied": m.tie_word_embeddings}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-rl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="run the RL job (built-in default when given no arguments)")
    _add_config_args(p)
    p.set_defaults(func=cmd_train)
    p = sub.add_parser("config", help="print the resolved, validated configuration as YAML")
    _add_config_args(p)
    p.set_defaults(func=cmd_config)
    p = sub.add_parser("presets", help="list the model presets")
    p.set_defaults(func=cmd_presets)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as e:
        print(f"megatron-rl: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

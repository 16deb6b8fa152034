"""Evaluation of checkpoints: GSM8K / MATH-500 accuracy with greedy decoding (`megatron-rl eval`)."""

from megatron_rl.evaluation.eval import DATASETS, EvalError, EvalSettings, evaluate, resolve_checkpoint

__all__ = ["DATASETS", "EvalError", "EvalSettings", "evaluate", "resolve_checkpoint"]

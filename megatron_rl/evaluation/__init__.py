"""A checkpoint used without training: its accuracy on GSM8K / MATH-500 or in episodes with greedy decoding
(`megatron-rl eval`, `eval.py`), and the OpenAI-compatible endpoint over it (`megatron-rl serve`, `serve.py`)."""

from megatron_rl.evaluation.eval import DATASETS, EvalError, EvalSettings, evaluate, resolve_checkpoint

__all__ = ["DATASETS", "EvalError", "EvalSettings", "evaluate", "resolve_checkpoint"]

"""Shared helpers for the benchmarks: device peak numbers, model FLOPs, timing."""

from __future__ import annotations

import json
import time

import torch

# Dense bf16 tensor-core peaks (vendor datasheets), keyed by a substring of torch.cuda.get_device_name().
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


def peak_tflops() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in name:
            return value
    return None


def training_flops_per_token(model_cfg, seq_len: int) -> float:
    """Model FLOPs of one training token (forward + backward = 3 x forward), as in Megatron's MFU accounting:
    2 x (every matmul weight, the output layer included, not the embedding lookup) + causal attention
    (QK^T and AV over on average s/2 keys: 2 x 2 x s/2 x h per layer)."""
    h, f, L = model_cfg.hidden_size, model_cfg.ffn_hidden_size, model_cfg.num_layers
    kv = model_cfg.num_query_groups * model_cfg.kv_channels
    matmul_params = L * (h * (h + 2 * kv) + h * h + 3 * h * f) + model_cfg.vocab_size * h
    attention = L * 2 * seq_len * h
    return 3 * (2 * matmul_params + attention)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, steps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return times


def emit(result: dict) -> None:
    """The one JSON line a benchmark ends with."""
    print(json.dumps(result, sort_keys=True), flush=True)

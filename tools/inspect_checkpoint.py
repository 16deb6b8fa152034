"""What a megatron-rl checkpoint (or a run's checkpoint root) holds, from its metadata only.

    python tools/inspect_checkpoint.py CKPT [--json]

The same as `megatron-rl inspect CKPT [--json]` (megatron_rl/checkpointing/inspect.py).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    from megatron_rl.cli import main

    sys.exit(main(["inspect", *sys.argv[1:]]))

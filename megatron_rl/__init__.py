"""megatron-rl: asynchronous RL post-training for Llama-family models on Megatron-Core (the LlamaRL design)."""

__version__ = "0.1.0"

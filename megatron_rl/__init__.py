"""megatron-rl: asynchronous RL post-training of Llama, Qwen2.5, Qwen3 and Mistral models on Megatron-Core (LlamaRL)."""

__version__ = "0.1.0"

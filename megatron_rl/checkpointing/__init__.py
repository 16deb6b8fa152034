"""Checkpoints: conversion between Hugging Face Llama and Megatron-Core distributed checkpoints."""

from megatron_rl.checkpointing.tokenizer import load_checkpoint_tokenizer

__all__ = ["load_checkpoint_tokenizer"]

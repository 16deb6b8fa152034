"""Trainer executor: Megatron-Core DDP, optimizer and schedules on the executor's own process groups."""

"""Clocks, step windows, metrics and the loggers (JSONL, wandb)."""

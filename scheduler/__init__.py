"""Continuous batching and KV page accounting. Pure Python: nothing here imports torch."""

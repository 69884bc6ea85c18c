"""The Triton path: every layer through worker/kernels (forward), on CUDA with pinned staging and a copy
stream (staging) and decode graphs per batch bucket (cuda_graphs); path.py is the ExecutionPath.
Rule: imports the reference model's weights, kernels/ and sampling/; nothing outside paths/ imports it."""

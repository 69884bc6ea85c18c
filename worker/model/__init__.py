"""The reference model: the llama-family decoder in plain torch (llama), its config, RoPE variants, attention
over the paged KV cache and the cache itself, and the mixture-of-experts feed-forward (moe). It is the oracle
every faster path is tested against, with no switches: a path that runs it faster has its own forward over
these weights (worker.paths).

Rule: model/ imports only the leaf module step_batch (and torch); never paths/, linears/, sampling/ or the
process files. Its linears are plain nn.Linear: loaders and paths swap in other formats from worker.linears (a MoE
layer's experts are stacked parameters, which they leave alone).
"""

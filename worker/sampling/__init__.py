"""Drawing tokens from logits: the torch sampler (seeded, per row), repetition / frequency / presence
penalties, structured output (grammar bitmasks), and the verification of speculative decoding's draft
tokens (speculative.py: greedy acceptance and the rejection sampler). The Triton path's device-side sampling kernel lives
in worker/kernels and follows the same semantics.

Rule: sampling/ imports neither paths/ nor model/ (nor linears/ or the process files).
"""

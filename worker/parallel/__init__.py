"""Tensor parallelism (issue 37): one model split over N ranks of a torch.distributed group.

- group: the ranks' process group (gloo on CPU, NCCL on CUDA) and the two collectives a step needs.
- shard: which ranks a model can be split over (the errors name the sizes), and one rank's share of a loaded
  model: q/k/v and gate/up split by heads and columns, o and down by rows (one all-reduce each), the
  vocabulary split for the embedding and lm_head (gathered for sampling), KV heads split (or, past their
  count, each shared by N / KVH ranks).
- shard_weights: a quantized weight's share (group-quantized codes, a GGUF file's blocks), cut along its quant
  groups: rows as views of the mapped file, input columns by whole groups.
- layers: the modules a rank's share swaps in around the plain reference modules, which stay unchanged.

Imports model/ and the leaf modules; model/ never imports it.
"""

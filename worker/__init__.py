"""The worker: one process per accelerator that executes the scheduler's step plans.

Layout (arrows point down; nothing here imports scheduler/, gateway/ or the roof):

- service.py, main.py: the gRPC servicer (protobuf in, one ModelRunner call, protobuf out) and the
  process (flags, model load, warm-up before readiness); step_order.py runs steps in step-id order
  however their RPCs arrive; step_telemetry.py records a span and the timings of each step.
- build.py: model + KV cache + runner from plain settings (the worker process and the in-process engine);
  kv_sizing.py: how many pages (--kv-cache-mb, or a fraction of the memory free after the weights and a
  profile pass).
- model_runner.py: ModelRunner, the device-independent half of a step: the requests' tokens and block
  tables, packing a plan into one flat StepBatch, placeholder rows under async scheduling, the result.
- execution_path.py: the seam. ExecutionPath (prepare / forward / sample / warm_up) and StepBatch;
  build_execution_path() picks the implementation once, from backends.py's resolved options:
    - torch_path.py: plain torch over model.py and attention.py, the float32 reference and the CPU
      path (cpu_linear.py: oneDNN-packed linears); samples with sampler.py + penalties.py.
      batch_invariant.py: its --deterministic kernels (row-kernel / fixed-tile linears, every query
      token through the decode attention), so a token's sums do not depend on what else the step holds.
    - triton_path.py: triton_forward.py over kernels/; on CUDA step_staging.py (pinned staging, copy
      stream, token readback) and cuda_graphs.py (decode graphs); samples on the device with the
      sampling kernel, falling back to sampler.py for penalties and logprobs.
  ModelRunner calls only the protocol: a new path (another CPU format, another accelerator) is one
  more implementation and one more line in build_execution_path().
- model.py, config.py, loader/, quantization.py, kv_cache.py: the Llama-family network, its config,
  GGUF / Hugging Face loading, INT8 weights, the paged KV cache tensors and the host swap tier.
- kernels/: one Triton kernel per module with its checking wrapper. The bottom of the worker: a kernel
  imports torch, triton, core and other kernels, nothing above (tests/worker/kernels/test_kernel_imports.py).
"""

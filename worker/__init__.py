"""The worker: one process per accelerator that executes the scheduler's step plans.

Rooms, arrows pointing down (nothing here imports scheduler/, gateway/ or the roof):

- the process (this folder's own modules): main and service (flags into WorkerOptions, the gRPC servicer,
  warm-up before readiness), build (model + KV cache + runner from the options), step_order and
  step_telemetry, model_runner (the device-independent half of a step), draft_model (--speculative draft's
  draft model beside the target, its KV cache over the same page ids), kv_sizing (how many pages).
  Nothing below imports main, service or build.
- leaf modules any room may import (they import no other worker module): options (WorkerOptions, every
  flag and its choices, torch-free), step_batch (StepBatch and RequestSpan, the rows drawn once),
  memory (the /proc readers).
- paths/: the ExecutionPath seam and its implementations (torch, Triton), chosen once by
  build_execution_path; a path chooses its forward and its linears' kernels when it is built. Imports
  model/, linears/, sampling/, kernels/, never the process.
- model/: the plain reference decoder (config, rope, attention, kv_cache), with no switches. Imports only
  step_batch.
- linears/: every weight format a linear runs on (group-quantized, dense copies, int8, packed), each with
  its kernel chosen once. Imports kernels/ and the leaf modules; never paths/ or model/.
- sampling/: sampler, penalties, structured output. Imports neither paths/ nor model/.
- loader/: GGUF and Hugging Face files into a model (imports model/ and linears/).
- parallel/: tensor parallelism: a rank's share of a loaded model (heads, columns, vocabulary rows) with the
  collectives swapped in around the plain modules (quantized weights cut along their groups), pipeline
  stages, the step mirror and the rank processes. Imports model/ and linears/; neither imports it.
- kernels/, native_ops, csrc/, _ops: the bottom. A Triton kernel imports torch, triton, core and other
  kernels, nothing above (tests/worker/kernels/test_kernel_imports.py); native_ops loads the compiled CPU
  ops built from csrc/ into _ops/.
"""

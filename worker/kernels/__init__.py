"""Triton kernels for the GPU worker path; each module holds one kernel and the wrapper that checks its
inputs (shapes, dtypes, strides), allocates the output and launches it.

On a machine without CUDA the same kernels run under the Triton interpreter (TRITON_INTERPRET=1, set
before triton is imported), which is how the tests check them against torch references on CPU.
"""

"""Every weight format a linear runs on: group-quantized codes (group_quant, with the GEMM on a dense copy in
dense_linear and the copies themselves in dense_weights), per-channel int8 (int8), oneDNN-packed float32
(packed), and the in-place module swap they share (swap). A linear's kernel is chosen once, when a path
builds (worker.paths), never by a flag tested inside forward.

Rule: linears/ imports kernels/, native_ops and the leaf modules (options, memory); never paths/, model/,
sampling/ or the process files.
"""

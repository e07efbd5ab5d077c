"""Triton kernels for CUDA: paged attention, the KV-cache write, the fused norm / rotary / activation ops and
the weight-only int8 GEMM.

On a machine without a GPU the same kernels run in Triton's interpreter (``TRITON_INTERPRET=1``,
set by the test suite before anything imports Triton), so CI tests them on CPU tensors.
"""

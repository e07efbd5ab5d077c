"""Triton kernels for CUDA: paged attention, the KV-cache write and the fused norm / rotary / activation ops.

On a machine without a GPU the same kernels run in Triton's interpreter (``TRITON_INTERPRET=1``,
set by the test suite before anything imports Triton), so CI tests them on CPU tensors.
"""

"""Every hot op of the model step, with its plain-torch reference and its platform versions.

    reference.py   the oracles: plain torch, obvious, slow (attention one request at a time, in fp32)
    native.py      torch's own fused kernels on any device (SDPA attention, F.rms_norm): the fallback
    int8.py        int8 weights: per-channel quantization, the weight-only and W8A8 references, a torch-ops product
    cpu.py         the C++ CPU ops (csrc/: paged attention, bf16 and int8 GEMMs, fused norm/rotary/activation)
    cuda.py        the CUDA ops: Triton kernels (triton/) for paged attention, KV write, norm, rotary, SiLU,
                   the weight-only int8 GEMM
    table.py       ``Ops``, the table of op functions, and ``select_ops``: the one place that chooses
                   an implementation, once per platform and ``attention_backend``

Models call ``ops.<name>`` from the table they were built with; they never learn which one runs.
This module imports no torch, so the configuration can read the backend names from it.
"""

# The names ``override_backend_config={"attention_backend": ...}`` accepts. 'auto' is the platform's
# fast path; 'reference' runs the plain-torch oracles everywhere (no C++ or Triton, no packed weights).
ATTENTION_BACKENDS = ("auto", "reference", "native", "cpu", "triton")

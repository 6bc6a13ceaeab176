"""`backend="auto"`: the fastest backend that can run here, and a sentence saying why."""

from __future__ import annotations

import importlib.util

from pagedkv._device import compute_capability, dtype_supported, nvcc_available
from pagedkv.attention._flashinfer import FLASHINFER_DTYPES, PREBUILT_HEAD_DIMS
from pagedkv.attention._spec import AttentionSpec
from pagedkv.attention._triton import MAX_HEAD_DIM, TRITON_DTYPES

# Order of preference for `auto`.
PREFERENCE = ("flashinfer", "triton", "torch")


def unfit_reason(backend: str, spec: AttentionSpec) -> str | None:
    """Why `backend` cannot serve `spec` on this machine, or None when it looks able to.

    Checks what can be known without building the backend; building it may still fail (a
    FlashInfer built for another torch or CUDA), and `auto` then falls back as well.
    """
    if backend == "torch":
        return None
    dev = spec.device
    if dev.type != "cuda":
        return f"{backend} needs a CUDA device, got {dev}"
    if not dtype_supported(dev, spec.dtype):
        major, minor = compute_capability(dev)
        return f"{backend}: {spec.dtype} needs compute capability 8.0+, the GPU has {major}.{minor}"
    if backend == "flashinfer":
        if spec.dtype not in FLASHINFER_DTYPES:
            return f"flashinfer supports float16 and bfloat16, not {spec.dtype}"
        if importlib.util.find_spec("flashinfer") is None:
            return "flashinfer is not installed"
        if spec.head_dim not in PREBUILT_HEAD_DIMS and not nvcc_available():
            return (
                f"flashinfer has no prebuilt kernels for head_dim {spec.head_dim} and nvcc, "
                "which would compile them, is not installed"
            )
        return None
    if spec.dtype not in TRITON_DTYPES:
        return f"triton supports float16, bfloat16 and float32, not {spec.dtype}"
    if spec.head_dim > MAX_HEAD_DIM:
        return f"triton supports head_dim <= {MAX_HEAD_DIM}, not {spec.head_dim}"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return None

"""`backend="auto"`: the fastest backend that can run here, and a sentence saying why."""

from __future__ import annotations

import importlib.util

from pagedkv._device import compute_capability, dtype_supported, nvcc_available
from pagedkv.attention import _flashinfer, _triton
from pagedkv.attention._spec import AttentionSpec

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
    module = _flashinfer if backend == "flashinfer" else _triton
    why = module.unsupported(spec)
    if why is not None:
        return f"{backend} cannot run the {spec.describe()}: {why}"
    if importlib.util.find_spec(backend) is None:
        return f"{backend} is not installed"
    dims = _flashinfer.PREBUILT_SINK_HEAD_DIMS if spec.sinks else _flashinfer.PREBUILT_HEAD_DIMS
    prebuilt = spec.layout.is_mla or spec.head_dim in dims
    if backend == "flashinfer" and not prebuilt and not nvcc_available():
        kernels = "attention-sink kernels" if spec.sinks else "kernels"
        return (
            f"flashinfer has no prebuilt {kernels} for head_dim {spec.head_dim} and nvcc, "
            "which would compile them, is not installed"
        )
    return None

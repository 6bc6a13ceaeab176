"""Devices: naming them, uploading host ints to them without a sync, and what they can run."""

from __future__ import annotations

import os
import shutil

import numpy as np
import torch


def resolve_device(device: torch.device | str) -> torch.device:
    """`device` with the current CUDA index filled in, so equal devices compare equal."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def upload_ints(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """`array` as a tensor on `device`; to CUDA through pinned memory, without a device sync.

    The pinned copy comes from torch's caching host allocator, which keeps it until the copy
    has landed, so the caller may reuse `array` at once.
    """
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def compute_capability(device: torch.device) -> tuple[int, int]:
    """`(major, minor)` of a CUDA device; `(0, 0)` for any other device."""
    if device.type != "cuda":
        return (0, 0)
    major, minor = torch.cuda.get_device_capability(device)
    return (int(major), int(minor))


def dtype_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """False for bfloat16 below sm80, where neither FlashInfer nor Triton has kernels for it."""
    return dtype != torch.bfloat16 or compute_capability(device) >= (8, 0)


def nvcc_available() -> bool:
    """True when a CUDA compiler is on PATH or under `CUDA_HOME` (JIT compilation needs it)."""
    if shutil.which("nvcc"):
        return True
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    return bool(home) and os.path.exists(os.path.join(str(home), "bin", "nvcc"))


def triton_interpreter() -> bool:
    """True when `TRITON_INTERPRET=1`: Triton kernels then run on the CPU through numpy."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

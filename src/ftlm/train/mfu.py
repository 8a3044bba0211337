"""Model FLOPs utilisation: achieved training FLOPs over the device's peak.

On CUDA the peak is the dense bf16 figure of known GPUs (or measured when unknown); on CPU it is
measured: the best sustained float32 matmul rate over a short burst, so MFU on a laptop means
"fraction of what this machine's matmul can do".
"""

from __future__ import annotations

import time

import torch

# Dense (non-sparse) bf16 tensor-core peaks, FLOP/s.
_GPU_PEAKS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}

_measured: dict[tuple[str, str], float] = {}


def measure_matmul_peak(device: str = "cpu", dtype: torch.dtype = torch.float32,
                        size: int = 1024, seconds: float = 0.5) -> float:
    """Best observed FLOP/s of square matmuls of ``size`` on ``device`` over about ``seconds``."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    flops = 2 * size**3
    best = 0.0
    deadline = time.perf_counter() + seconds
    torch.mm(a, b)  # warm-up: first call pays for allocation and kernel selection
    while time.perf_counter() < deadline:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = max(best, 4 * flops / (time.perf_counter() - t0))
    return best


def peak_flops(device: str, dtype: torch.dtype) -> float:
    """Peak FLOP/s used as the MFU denominator (cached per device and dtype)."""
    key = (device, str(dtype))
    if key not in _measured:
        peak = None
        if device.startswith("cuda"):
            name = torch.cuda.get_device_name(torch.device(device))
            peak = next((v for k, v in _GPU_PEAKS.items() if k in name), None)
        _measured[key] = peak or measure_matmul_peak(device, dtype)
    return _measured[key]

"""GPU health from NVML: utilisation, power, temperature and device memory of one GPU.

``NvmlSampler`` reads one device through ``pynvml`` (package ``nvidia-ml-py``, the ``gpu`` extra
of ftlm). Both are optional: ``gpu_sampler`` returns None without a CUDA device in use or without
``pynvml``, and the GPU families are then simply not exported (``ftlm.observe.metrics`` creates
their series only once a value exists).

Not responsible for: the CUDA caching allocator's figures (``torch.cuda``, read in
``ftlm.observe.metrics``), or several GPUs per process (a rank drives one).
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Any

log = logging.getLogger(__name__)

NVML_TEMPERATURE_GPU = 0
"""``pynvml.NVML_TEMPERATURE_GPU``: the GPU die sensor."""


class NvmlSampler:
    """One GPU through NVML; ``sample()`` returns the metric families it could read, by name."""

    def __init__(self, index: int, nvml: Any = None) -> None:
        self.nvml = nvml if nvml is not None else importlib.import_module("pynvml")
        self.nvml.nvmlInit()
        self.index = index
        self.handle = self.nvml.nvmlDeviceGetHandleByIndex(index)

    def sample(self) -> dict[str, float]:
        """Utilisation (0..1), power (W), temperature (degrees C) and device memory in use (bytes);
        a reading NVML refuses on this device (no power sensor on some boards) is left out."""
        n, h = self.nvml, self.handle
        readers = {
            "ftlm_gpu_utilization_ratio": lambda: n.nvmlDeviceGetUtilizationRates(h).gpu / 100.0,
            "ftlm_gpu_power_watts": lambda: n.nvmlDeviceGetPowerUsage(h) / 1000.0,  # mW
            "ftlm_gpu_temperature_celsius": lambda: float(
                n.nvmlDeviceGetTemperature(h, NVML_TEMPERATURE_GPU)),
            "ftlm_gpu_memory_used_bytes": lambda: float(n.nvmlDeviceGetMemoryInfo(h).used),
        }
        got: dict[str, float] = {}
        for name, read in readers.items():
            try:
                got[name] = float(read())
            except Exception:  # noqa: BLE001 - NVMLError_NotSupported and kin: not on this board
                continue
        return got

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutting down a library that failed is not an error
            pass


def nvml_index(torch: Any, device: int) -> int:
    """NVML's index of CUDA device ``device`` (they differ under ``CUDA_VISIBLE_DEVICES``)."""
    mapper = getattr(torch.cuda, "_get_nvml_device_index", None)
    try:
        return int(mapper(device)) if mapper is not None else device
    except Exception:  # noqa: BLE001 - UUID lists torch cannot map: the CUDA index is the best guess
        return device


def cuda_device() -> tuple[Any, int] | None:
    """``(torch, device)`` when this process uses a CUDA device, else None (torch not imported,
    no device, or CUDA not initialised yet: ask again later)."""
    torch = sys.modules.get("torch")  # never import torch just for metrics
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch, torch.cuda.current_device()


def gpu_sampler(torch: Any, device: int) -> NvmlSampler | None:
    """A sampler of CUDA device ``device``, or None when NVML is unavailable (logged)."""
    try:
        return NvmlSampler(nvml_index(torch, device))
    except Exception as e:  # noqa: BLE001 - ModuleNotFoundError, NVMLError: both mean "not here"
        log.info("GPU utilisation, power and temperature not exported (install nvidia-ml-py "
                 "for them): %s", e)
        return None

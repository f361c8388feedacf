"""Attention backends behind one seam (`AttentionBackend`), chosen by name."""

from pdserve.kernels.attention import cpu_kernels
from pdserve.kernels.attention.base import AttentionBackend, AttentionBatch, LayerPlans
from pdserve.kernels.attention.cpu_backend import CpuKernelAttentionBackend
from pdserve.kernels.attention.torch_backend import TorchAttentionBackend

_BACKENDS: dict[str, type[AttentionBackend]] = {
    TorchAttentionBackend.name: TorchAttentionBackend,
    CpuKernelAttentionBackend.name: CpuKernelAttentionBackend,
}


def register_backend(cls: type[AttentionBackend]) -> None:
    _BACKENDS[cls.name] = cls


def get_backend(name: str) -> AttentionBackend:
    """"auto" picks the C kernel backend where it is built, else plain torch."""
    if name == "auto":
        name = CpuKernelAttentionBackend.name if cpu_kernels.available() else TorchAttentionBackend.name
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(_BACKENDS)}")
    return _BACKENDS[name]()


__all__ = ["AttentionBackend", "AttentionBatch", "LayerPlans", "get_backend", "register_backend"]

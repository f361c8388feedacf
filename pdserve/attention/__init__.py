"""Attention backends behind one seam (`AttentionBackend`), chosen by name."""

from pdserve.attention.base import AttentionBackend, AttentionBatch
from pdserve.attention.torch_backend import TorchAttentionBackend

_BACKENDS: dict[str, type[AttentionBackend]] = {TorchAttentionBackend.name: TorchAttentionBackend}


def register_backend(cls: type[AttentionBackend]) -> None:
    _BACKENDS[cls.name] = cls


def get_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(_BACKENDS)}")
    return _BACKENDS[name]()


__all__ = ["AttentionBackend", "AttentionBatch", "get_backend", "register_backend"]

"""Reading a checkpoint's tensors into our modules: every parameter found, every tensor used.

A model's `load_weights` walks its own parameters and asks a `CheckpointReader` for the
checkpoint tensor of each (Hugging Face names, without the leading "model."). `finish` raises one
ValueError listing everything missing or unexpected, so a wrong checkpoint fails with the whole
picture instead of the first mismatch.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class CheckpointReader:
    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._ckpt = {name.removeprefix("model."): t for name, t in weights}
        self._used: set[str] = set()
        self._missing: list[str] = []

    def take(self, name: str, required: bool = True) -> torch.Tensor | None:
        """The tensor called `name` (marked used); None, noted as missing when required, if absent."""
        t = self._ckpt.get(name)
        if t is not None:
            self._used.add(name)
        elif required:
            self._missing.append(name)
        return t

    def copy(self, param: torch.Tensor, name: str) -> None:
        """Copy tensor `name` into `param` (same shape, or a ValueError naming both shapes)."""
        t = self.take(name)
        if t is not None:
            if t.shape != param.shape:
                raise ValueError(f"{name}: expected shape {tuple(param.shape)}, got {tuple(t.shape)}")
            param.data.copy_(t)

    def finish(self, model_type: str) -> None:
        """Raise if a parameter was missing or a checkpoint tensor was never used (rotary caches aside)."""
        unexpected = sorted(n for n in set(self._ckpt) - self._used if "rotary_emb" not in n)
        if self._missing or unexpected:
            raise ValueError(
                f"checkpoint does not match model_type {model_type!r}: {len(self._missing)} missing "
                f"(e.g. {self._missing[:4]}), {len(unexpected)} unexpected (e.g. {unexpected[:4]})"
            )

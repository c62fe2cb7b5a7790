"""How the DiT runs inside a stream: `eager` PyTorch, or `compile` (torch.compile/Inductor: fused elementwise
work around the GEMMs). Measured at turbo-2B shapes on an H200 (README, "Stream ticks"): 1.35-1.7x fewer ms per
tick than eager, after compiling for 90-120 s once per process (and on the first tick of each new row count)."""

from __future__ import annotations

from collections.abc import Callable
from weakref import WeakKeyDictionary

import torch

from ..models.dit import DiTDecoder

BACKENDS = ("eager", "compile")
_compiled: WeakKeyDictionary[DiTDecoder, Callable] = WeakKeyDictionary()


def decoder_forward(decoder: DiTDecoder, backend: str = "eager") -> Callable:
    """The callable a StreamPipeline uses for its batched forward (`DiTDecoder.forward_rows` signature).

    Compiled callables are shared per decoder, so every stream of a session reuses one compilation."""
    if backend == "eager":
        return decoder.forward_rows
    if backend == "compile":
        if decoder not in _compiled:
            _compiled[decoder] = torch.compile(decoder.forward_rows)
        return _compiled[decoder]
    raise ValueError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")

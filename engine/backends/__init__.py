"""How the DiT runs inside a stream: `eager` PyTorch; `compile` (torch.compile/Inductor over one DiT layer, the
same compiled graph for all layers: fused elementwise work around the GEMMs); `graph` (the whole tick, eager
kernels, replayed as one CUDA graph per tick plan, see tick_graph.py); `compile-graph` (compiled layers inside the
graph). README, "Stream ticks", has the measured table."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..models.dit import DiTDecoder, DiTLayer
from ..params import BACKENDS


def _run_layer(layer: DiTLayer, *inputs) -> torch.Tensor:
    return layer(*inputs)


_compiled_layer = torch.compile(_run_layer)
LAYER_VARIANTS = 64  # compiled variants of the layer kept (group layouts x sliding or not x precision; row counts
# become dynamic after the second one)


def decoder_forward(decoder: DiTDecoder, backend: str = "eager") -> Callable:
    """The callable a StreamPipeline uses for its batched forward (`DiTDecoder.forward_rows` signature).

    The compiled layer is one module-level compilation (regional: parameters are its inputs), shared by every
    layer of every decoder, so compiling costs one layer's worth per tick layout (row counts turn dynamic after
    the second one); nothing here holds the decoder."""
    if backend in ("eager", "graph"):
        return decoder.forward_rows
    if backend in ("compile", "compile-graph"):
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, LAYER_VARIANTS)
        return functools.partial(decoder.forward_rows, run_layer=_compiled_layer)
    raise ValueError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")


def uses_graphs(backend: str) -> bool:
    """Whether a stream on this backend runs its ticks as CUDA-graph replays (static tensors, see tick_graph.py)."""
    return backend in ("graph", "compile-graph")

"""How the DiT runs inside a stream: `eager` PyTorch; `compile` (torch.compile/Inductor over one DiT layer, the
same compiled graph for all layers: fused elementwise work around the GEMMs); `graph` (the whole tick, eager
kernels, replayed as one CUDA graph per tick plan, see tick_graph.py); `compile-graph` (compiled layers inside the
graph, with the fused GEMMs of engine/kernels where the GPU runs them). docs/benchmarks.md, "Stream ticks" and
"Fused kernels", has the measured tables."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..kernels import fused_kernels_available
from ..kernels.fused_ops import FUSED_OPS
from ..kernels.ops import pair_mlp_weights, stack_qkv_weights
from ..models.dit import DiTDecoder, DiTLayer, LayerStages, Pending
from ..params import BACKENDS


def _attend_self(layer: DiTLayer, *inputs) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.attend_self(*inputs)


def _finish(layer: DiTLayer, *inputs) -> tuple[torch.Tensor, Pending]:
    return layer.finish(*inputs)


def _attend_self_fused(layer: DiTLayer, *inputs) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.attend_self(*inputs, ops=FUSED_OPS)


def _finish_fused(layer: DiTLayer, *inputs) -> tuple[torch.Tensor, Pending]:
    return layer.finish(*inputs, ops=FUSED_OPS)


def _rows_dynamic(compiled: Callable) -> Callable:
    """`compiled` with its inputs' row dimension dynamic from the first call: a stream's row count changes as
    slots come and go, guidance turns on or a prompt blend adds rows, and a recompile in the middle of a
    performance stalls it for seconds."""

    def run(layer: DiTLayer, *inputs):
        for tensor in _tensors(inputs):
            if tensor.dim() >= 3:  # rows first: x, the pending MLP output and gate, modulation, cross heads
                torch._dynamo.maybe_mark_dynamic(tensor, 0)
        return compiled(layer, *inputs)

    return run


def _tensors(inputs: tuple) -> list[torch.Tensor]:
    """The tensors among `inputs`, those inside tuples included."""
    found = []
    for value in inputs:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, tuple):
            found.extend(_tensors(value))
    return found


@functools.cache
def compiled_stages(fused: bool) -> LayerStages:
    """The compiled layer halves, made at first use (torch.compile imports Dynamo and Inductor: seconds that a process
    which never compiles does not pay). `fused`: halves whose GEMMs carry their SwiGLU (and their gate and residual,
    or their q/k norms and RoPE, where that was measured faster) and whose norms and modulation run in one pass with
    the residual before them (engine/kernels/fused_ops.py): `compile-graph` on GPUs that run the fused kernels. Only
    under CUDA graphs: the custom ops' launches cost host time that a replay does not pay."""
    attend_self, finish = (_attend_self_fused, _finish_fused) if fused else (_attend_self, _finish)
    return LayerStages(_rows_dynamic(torch.compile(attend_self)), _rows_dynamic(torch.compile(finish)))


LAYER_VARIANTS = 32  # compiled variants of a layer half kept (sliding or not x precision x one row or several x
# the first layer's first half, with no MLP output pending, or the others')


def decoder_forward(decoder: DiTDecoder, backend: str = "eager") -> Callable:
    """The callable a StreamPipeline uses for its batched forward (`DiTDecoder.forward_rows` signature).

    The compiled layer halves are module-level compilations (regional: parameters are their inputs), shared by
    every layer of every decoder, so compiling costs one layer's worth; the cross-attention between the halves
    runs uncompiled, so no prompt length or condition grouping ever recompiles (row counts turn dynamic after
    the second one). Nothing here holds the decoder."""
    if backend in ("eager", "graph"):
        return decoder.forward_rows
    if backend in ("compile", "compile-graph"):
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, LAYER_VARIANTS)
        fused = backend == "compile-graph" and fused_kernels_available(decoder.proj_in[1].weight.device)
        if fused:
            pair_mlp_weights(decoder)
            stack_qkv_weights(decoder)
        return functools.partial(decoder.forward_rows, stages=compiled_stages(fused))
    raise ValueError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")


def uses_graphs(backend: str) -> bool:
    """Whether a stream on this backend runs its ticks as CUDA-graph replays (static tensors, see tick_graph.py)."""
    return backend in ("graph", "compile-graph")

"""LoRAs folded into the weights with their strengths still live: a layer's weight is rewritten as the weight it
rests at plus each folded LoRA's delta at its current strength, once on the tick after a strength changes (one
addmm a layer, replayed as one CUDA graph). Ticks run the plain layers: what a merge costs, with a knob. The price:
a copy of each folded layer's resting weight, and one fold on the tick after a change."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from .deltas import DeltaStack
from .fold_kernel import fold_low_rank, fused_fold_available

FOLDABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class FoldedLayer(DeltaStack):
    """One linear layer's folded LoRAs and the weight it rests at (restored to the bit when the last one goes)."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear.in_features, linear.out_features, linear.weight.device)
        self.__dict__["linear"] = linear  # not a submodule: the decoder owns it
        self.register_buffer("rest", linear.weight.detach().clone(), persistent=False)

    def fold(self, strengths: torch.Tensor) -> None:
        """weight = rest + sum of strength x scale x delta, each low-rank GEMM rounded once onto the weight."""
        weight = self.linear.weight
        if self.rank and fused_fold_available(weight):
            fold_low_rank(self.rest, self.up, self.down, self.column_scale, self.column_slot, strengths, weight)
        else:
            weight.copy_(self.rest)
            if self.rank:
                weight.addmm_(self.up * self.column_strengths(strengths, weight.dtype), self.down)
        for slot, scale, w1, w2 in self.kron_factors():
            weight.add_(torch.kron(w1, w2) * (strengths[slot] * scale).to(weight.dtype))

    def restore(self) -> None:
        self.linear.weight.copy_(self.rest)


class FoldRunner:
    """Runs every folded layer's fold: eagerly on a CPU, as one CUDA-graph replay on a GPU (a fold is a few hundred
    small launches; captured once per set of folded deltas)."""

    def __init__(self) -> None:
        self._graph: torch.cuda.CUDAGraph | None = None
        self._eager_only = False
        self.captures = 0

    def forget(self) -> None:
        """The folded deltas changed: capture afresh at the next fold."""
        self._graph = None

    @torch.no_grad()
    def run(self, layers: list[FoldedLayer], strengths: torch.Tensor) -> None:
        if strengths.device.type != "cuda" or self._eager_only:
            return _fold_all(layers, strengths)
        if self._graph is None:
            try:
                self._graph = self._capture(layers, strengths)
            except RuntimeError:  # capture refused (another capture under way, say): fold eagerly from now on
                self._eager_only = True
                return _fold_all(layers, strengths)
        self._graph.replay()

    def _capture(self, layers: list[FoldedLayer], strengths: torch.Tensor) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _fold_all(layers, strengths)  # compiles the fold kernels before the capture
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                _fold_all(layers, strengths)
            except BaseException:
                with contextlib.suppress(RuntimeError):  # ending an invalidated capture raises too
                    graph.capture_end()
                raise
            graph.capture_end()
        torch.cuda.current_stream().wait_stream(side)
        self.captures += 1
        return graph


def _fold_all(layers: list[FoldedLayer], strengths: torch.Tensor) -> None:
    for layer in layers:
        layer.fold(strengths)


def foldable_linear(module: nn.Module, path: str) -> nn.Linear:
    """The plain linear layer a LoRA folds into, or an error naming the fix."""
    base = getattr(module, "base", module)  # under an unmerged LoRA's wrapper
    dtype = getattr(getattr(base, "weight", None), "dtype", None)
    if not isinstance(base, nn.Linear) or dtype not in FOLDABLE_DTYPES:
        raise ValueError(
            f"{path}: folding needs a bf16/fp16/fp32 linear layer, not {type(base).__name__} ({dtype}); "
            "load this LoRA live (unmerged), as FP8 runs them"
        )
    return base

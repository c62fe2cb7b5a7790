"""LoRAs applied unmerged: each targeted linear layer becomes a LoraLinear that adds its LoRAs' deltas to the base
output, every strength read from one small device tensor per decoder inside the forward. Changing a strength is
one write to that tensor: compiled layers do not recompile and captured tick graphs replay unchanged."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .deltas import DeltaStack, kron_apply


class Strengths(Protocol):
    """Where a LoraLinear reads its strengths (the decoder's LoraSet): shared ones, and per-row ones while set."""

    strengths: torch.Tensor  # [MAX_LORAS]
    row_strengths: torch.Tensor | None  # [rows, MAX_LORAS] around a batched forward of several sessions, else None


class LoraLinear(DeltaStack):
    """base(x) + sum over attached LoRAs of strength * scale * delta(x). Low-rank deltas are stacked along the
    rank: x @ down.T (all LoRAs in one GEMM), times each column's scale x its LoRA's strength, @ up.T."""

    def __init__(self, base: nn.Module, owner: Strengths):
        super().__init__(base.in_features, base.out_features, owner.strengths.device)
        self.base = base
        self.owner = owner  # holds the strengths: not a buffer, so moving the module never splits the shared tensor
        self.register_state_dict_post_hook(_base_keys_out)  # the model's keys stay what they were without LoRAs
        self.register_load_state_dict_pre_hook(_base_keys_in)

    @property
    def weight(self) -> torch.Tensor:
        """The base layer's weight (code that reads a linear layer's weight or dtype reads it through the LoRAs)."""
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        strengths = self._strengths(x)
        # Compiled, the add below fuses into the layer's next elementwise kernel; an addmm onto the base output
        # measured slower (cuBLAS copies that output first).
        if self.rank:
            out = out + F.linear(F.linear(x, self.down) * self.column_strengths(strengths, x.dtype), self.up)
        for slot, scale, w1, w2 in self.kron_factors():
            out = out + kron_apply(x, w1, w2) * (strengths[..., slot, None] * scale).to(x.dtype)
        return out

    def _strengths(self, x: torch.Tensor) -> torch.Tensor:
        """The shared strengths [MAX_LORAS], or per-row ones shaped to broadcast over x's rows: [rows, 1.., MAX]."""
        rows = self.owner.row_strengths
        if rows is None:
            return self.owner.strengths
        if rows.shape[0] not in (1, x.shape[0]):
            raise RuntimeError(
                f"per-row LoRA strengths for {rows.shape[0]} rows reached a layer run on {x.shape[0]}: set them "
                "only around the batched forward whose rows they describe"
            )
        return rows.view(rows.shape[0], *([1] * (x.dim() - 2)), rows.shape[1])


def _base_keys_out(module: nn.Module, state: dict, prefix: str, _metadata) -> None:
    """`q_proj.base.weight` saved as `q_proj.weight`: a checkpoint written with LoRAs attached is the base model's."""
    for key in [k for k in state if k.startswith(prefix + "base.")]:
        state[prefix + key[len(prefix) + len("base.") :]] = state.pop(key)


def _base_keys_in(module: nn.Module, state: dict, prefix: str, *_args) -> None:
    for key in [k for k in state if k.startswith(prefix) and "." not in k[len(prefix) :]]:
        state[prefix + "base." + key[len(prefix) :]] = state.pop(key)

"""The LoRA deltas one linear layer carries, stacked so that every LoRA on it costs one pair of GEMMs: low-rank
deltas along the rank (each column with its scale and its LoRA's strength slot), Kronecker deltas listed."""

from __future__ import annotations

import torch
from torch import nn

from .adapter import Kronecker, LowRank


def kron_apply(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """x @ kron(w1, w2).T without forming the product: each token's [in_a * in_b] vector as an [in_a, in_b] matrix X
    gives w1 @ X @ w2.T, flattened."""
    tokens = x.unflatten(-1, (w1.shape[1], w2.shape[1]))
    return (w1 @ tokens @ w2.transpose(0, 1)).flatten(-2)


class DeltaStack(nn.Module):
    """Low-rank deltas stacked: `down` [R, in] and `up` [out, R] of every LoRA, `column_scale` [R] its scale
    (alpha / r) and `column_slot` [R] its strength slot; Kronecker factors in kron_w1_i / kron_w2_i."""

    def __init__(self, in_features: int, out_features: int, device: torch.device):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("down", torch.zeros(0, in_features, device=device), persistent=False)
        self.register_buffer("up", torch.zeros(out_features, 0, device=device), persistent=False)
        self.register_buffer("column_scale", torch.zeros(0, device=device), persistent=False)
        self.register_buffer("column_slot", torch.zeros(0, dtype=torch.long, device=device), persistent=False)
        self.kron: list[tuple[int, float]] = []  # (slot, scale) of each Kronecker delta

    @property
    def slots(self) -> set[int]:
        return set(self.column_slot.tolist()) | {slot for slot, _ in self.kron}

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    def kron_factors(self) -> list[tuple[int, float, torch.Tensor, torch.Tensor]]:
        """(slot, scale, w1, w2) of each Kronecker delta."""
        return [
            (slot, scale, getattr(self, f"kron_w1_{i}"), getattr(self, f"kron_w2_{i}"))
            for i, (slot, scale) in enumerate(self.kron)
        ]

    def column_strengths(self, strengths: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[..., R]: each low-rank column's scale x its LoRA's strength, from strengths [..., MAX_LORAS] (read from
        the device tensor, no host sync)."""
        return (self.column_scale * strengths[..., self.column_slot]).to(dtype)

    def add(self, slot: int, delta: LowRank | Kronecker, dtype: torch.dtype) -> None:
        device = self.down.device
        if isinstance(delta, LowRank):
            rank = delta.down.shape[0]
            self.down = torch.cat([self.down.to(dtype), delta.down.to(device, dtype)])
            self.up = torch.cat([self.up.to(dtype), delta.up.to(device, dtype)], dim=1)
            self.column_scale = torch.cat([self.column_scale, torch.full((rank,), delta.scale, device=device)])
            self.column_slot = torch.cat([self.column_slot, torch.full((rank,), slot, device=device)])
        else:
            index = len(self.kron)
            self.register_buffer(f"kron_w1_{index}", delta.w1.to(device, dtype), persistent=False)
            self.register_buffer(f"kron_w2_{index}", delta.w2.to(device, dtype), persistent=False)
            self.kron.append((slot, delta.scale))

    def remove(self, slot: int) -> None:
        keep = self.column_slot != slot
        self.down, self.up = self.down[keep], self.up[:, keep]
        self.column_scale, self.column_slot = self.column_scale[keep], self.column_slot[keep]
        kept = [term for term in self.kron_factors() if term[0] != slot]
        for i in range(len(self.kron)):
            delattr(self, f"kron_w1_{i}")
            delattr(self, f"kron_w2_{i}")
        self.kron = [(term_slot, scale) for term_slot, scale, _, _ in kept]
        for i, (_, _, w1, w2) in enumerate(kept):
            self.register_buffer(f"kron_w1_{i}", w1, persistent=False)
            self.register_buffer(f"kron_w2_{i}", w2, persistent=False)

"""LoRAs merged into the weights (a LoRA that will not change: the tick costs what it did without it), reversibly
to the bit: what a merge changed is kept as the integer difference of each weight's bit patterns, so unmerging
subtracts it and returns the very weights there were, whatever the rounding on the way in."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .adapter import LoraAdapter, check_fits
from .attached import check_strength, lora_set, structure_lock
from .unmerged import LoraLinear

_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@dataclass
class MergedLora:
    """A merge that can be undone: per weight, the change of its bit patterns (kept on the host)."""

    adapter: LoraAdapter
    strength: float
    bit_changes: dict[str, torch.Tensor]


def merge(decoder: nn.Module, adapter: LoraAdapter, strength: float = 1.0) -> MergedLora:
    """Add strength x each delta to its layer's weight (in fp32, rounded once to the weight's dtype)."""
    check_strength(adapter.name, strength)
    check_fits(decoder, adapter)
    weights = {path: _weight(decoder, path) for path in adapter.deltas}
    changes = {}
    with torch.no_grad(), structure_lock(decoder):
        for path, delta in adapter.deltas.items():
            weight = weights[path]
            bits = weight.view(_BITS[weight.dtype])
            before = bits.clone()
            merged = weight.float() + delta.dense().to(weight.device) * strength
            weight.copy_(merged.to(weight.dtype))
            changes[path] = (bits - before).cpu()
    _weights_changed(decoder)
    return MergedLora(adapter, strength, changes)


def unmerge(decoder: nn.Module, merged: MergedLora) -> None:
    """Return every weight the merge touched to its exact bits before it."""
    with torch.no_grad(), structure_lock(decoder):
        for path, change in merged.bit_changes.items():
            weight = _weight(decoder, path)
            weight.view(_BITS[weight.dtype]).sub_(change.to(weight.device))
    _weights_changed(decoder)


def _weight(decoder: nn.Module, path: str) -> torch.Tensor:
    """The weight a merge changes: a folded layer's resting weight (the next fold carries the change), else the
    layer's own."""
    resting = lora_set(decoder).resting_weight(path)
    if resting is not None:
        return resting
    module = decoder.get_submodule(path)
    base = module.base if isinstance(module, LoraLinear) else module
    if not isinstance(base, nn.Linear) or base.weight.dtype not in _BITS:
        raise ValueError(
            f"{path}: merging needs a bf16/fp16/fp32 linear layer, not {type(base).__name__} "
            f"({getattr(getattr(base, 'weight', None), 'dtype', '?')}); load this LoRA unmerged (FP8 runs them so)"
        )
    return base.weight


def _weights_changed(decoder: nn.Module) -> None:
    lora_set(decoder).resting_weights_changed()
    decoder.cross_kv_version += 1
    decoder.clear_folded_constants()

"""LoRAs applied unmerged: each targeted linear layer becomes a LoraLinear that adds its LoRAs' deltas to the base
output, every strength read from one small device tensor per decoder inside the forward. Changing a strength is
one write to that tensor: compiled layers do not recompile and captured tick graphs replay unchanged."""

from __future__ import annotations

import math
import threading
from weakref import WeakKeyDictionary

import torch
import torch.nn.functional as F
from torch import nn

from .adapter import Kronecker, LoraAdapter, LowRank, check_fits

MAX_LORAS = 8  # attached at once per decoder (slots of the strengths tensor)
STRENGTH_RANGE = (0.0, 2.0)


def kron_apply(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """x @ kron(w1, w2).T without forming the product: each token's [in_a * in_b] vector as an [in_a, in_b] matrix X
    gives w1 @ X @ w2.T, flattened."""
    tokens = x.unflatten(-1, (w1.shape[1], w2.shape[1]))
    return (w1 @ tokens @ w2.transpose(0, 1)).flatten(-2)


class LoraLinear(nn.Module):
    """base(x) + sum over attached LoRAs of strength * scale * delta(x). Low-rank deltas are stacked along the
    rank: x @ down.T (all LoRAs in one GEMM), times each column's scale x its LoRA's strength, @ up.T."""

    def __init__(self, base: nn.Module, owner: LoraSet):
        super().__init__()
        self.base = base
        self.owner = owner  # holds the strengths: not a buffer, so moving the module never splits the shared tensor
        out_features, in_features = base.out_features, base.in_features
        self.in_features, self.out_features = in_features, out_features
        like = dict(device=owner.strengths.device)
        self.register_buffer("down", torch.zeros(0, in_features, **like), persistent=False)
        self.register_buffer("up", torch.zeros(out_features, 0, **like), persistent=False)
        self.register_buffer("column_scale", torch.zeros(0, **like), persistent=False)
        self.register_buffer("column_slot", torch.zeros(0, dtype=torch.long, **like), persistent=False)
        self.kron: list[tuple[int, float]] = []  # (slot, scale) of each Kronecker delta, factors in kron_w1_i/w2_i
        self.register_state_dict_post_hook(_base_keys_out)  # the model's keys stay what they were without LoRAs
        self.register_load_state_dict_pre_hook(_base_keys_in)

    @property
    def slots(self) -> set[int]:
        return set(self.column_slot.tolist()) | {slot for slot, _ in self.kron}

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
        factors = [(getattr(self, f"kron_w1_{i}"), getattr(self, f"kron_w2_{i}")) for i in range(len(self.kron))]
        for i in range(len(self.kron)):
            delattr(self, f"kron_w1_{i}")
            delattr(self, f"kron_w2_{i}")
        kept = [(term, pair) for term, pair in zip(self.kron, factors) if term[0] != slot]
        self.kron = [term for term, _ in kept]
        for i, (_, (w1, w2)) in enumerate(kept):
            self.register_buffer(f"kron_w1_{i}", w1, persistent=False)
            self.register_buffer(f"kron_w2_{i}", w2, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        strengths = self.owner.strengths
        # Compiled, the add below fuses into the layer's next elementwise kernel; an addmm onto the base output
        # measured slower (cuBLAS copies that output first).
        if self.down.shape[0]:
            scale = (self.column_scale * strengths[self.column_slot]).to(x.dtype)
            out = out + F.linear(F.linear(x, self.down) * scale, self.up)
        for index, (slot, scale) in enumerate(self.kron):
            w1, w2 = getattr(self, f"kron_w1_{index}"), getattr(self, f"kron_w2_{index}")
            out = out + kron_apply(x, w1, w2) * (strengths[slot] * scale).to(x.dtype)
        return out


def _base_keys_out(module: nn.Module, state: dict, prefix: str, _metadata) -> None:
    """`q_proj.base.weight` saved as `q_proj.weight`: a checkpoint written with LoRAs attached is the base model's."""
    for key in [k for k in state if k.startswith(prefix + "base.")]:
        state[prefix + key[len(prefix) + len("base.") :]] = state.pop(key)


def _base_keys_in(module: nn.Module, state: dict, prefix: str, *_args) -> None:
    for key in [k for k in state if k.startswith(prefix) and "." not in k[len(prefix) :]]:
        state[prefix + "base." + key[len(prefix) :]] = state.pop(key)


class LoraSet:
    """The LoRAs attached unmerged to one decoder: names, strength slots, and the layers that carry them."""

    def __init__(self, decoder: nn.Module):
        weight = decoder.proj_in[1].weight
        self.decoder = decoder
        self.dtype = weight.dtype
        self.strengths = torch.zeros(MAX_LORAS, device=weight.device)
        self.attached: dict[str, tuple[int, LoraAdapter]] = {}

    def attach(self, adapter: LoraAdapter, strength: float = 1.0) -> None:
        """Wrap the adapter's layers (or add to their LoRAs) at `strength`; checked first, so a bad file changes
        nothing."""
        if adapter.name in self.attached:
            raise ValueError(f"a LoRA named {adapter.name!r} is already loaded: unload it first or pick another name")
        used = {slot for slot, _ in self.attached.values()}
        free = [slot for slot in range(MAX_LORAS) if slot not in used]
        if not free:
            raise ValueError(f"{MAX_LORAS} LoRAs are loaded already: unload one (or merge one that stays)")
        check_strength(adapter.name, strength)
        check_fits(self.decoder, adapter)
        slot = free[0]
        with structure_lock(self.decoder):
            for path, delta in adapter.deltas.items():
                self._carrier(path).add(slot, delta, self.dtype)
            self.strengths[slot] = strength
            self.attached[adapter.name] = (slot, adapter)
            self.decoder.structure_version += 1
            self._changed(adapter)

    def detach(self, name: str) -> None:
        slot, adapter = self._get(name)
        modules = dict(self.decoder.named_modules())
        with structure_lock(self.decoder):
            for path in adapter.deltas:
                carrier = modules[path]
                carrier.remove(slot)
                if not carrier.slots:
                    self._replace(path, carrier.base)
            self.strengths[slot] = 0.0
            del self.attached[name]
            self.decoder.structure_version += 1
            self._changed(adapter)

    def set_strength(self, name: str, strength: float) -> None:
        """One write to the strengths tensor, in stream order on the current CUDA stream: ticks queued before it
        use the old value, the next one the new."""
        slot, adapter = self._get(name)
        check_strength(name, strength)
        self.strengths[slot].fill_(float(strength))
        self._changed(adapter)

    def strength(self, name: str) -> float:
        return float(self.strengths[self._get(name)[0]])

    def _get(self, name: str) -> tuple[int, LoraAdapter]:
        if name not in self.attached:
            loaded = ", ".join(self.attached) or "none"
            raise ValueError(f"no LoRA named {name!r} is loaded (loaded: {loaded})")
        return self.attached[name]

    def _changed(self, adapter: LoraAdapter) -> None:
        if adapter.touches_cross_kv():  # conditions rebuild their K/V at their next use
            self.decoder.cross_kv_version += 1

    def _carrier(self, path: str) -> LoraLinear:
        module = self.decoder.get_submodule(path)
        if not isinstance(module, LoraLinear):
            module = LoraLinear(module, self)
            self._replace(path, module)
        return module

    def _replace(self, path: str, module: nn.Module) -> None:
        parent_path, _, name = path.rpartition(".")
        setattr(self.decoder.get_submodule(parent_path), name, module)


def check_strength(name: str, strength: float) -> None:
    low, high = STRENGTH_RANGE
    if not isinstance(strength, (int, float)) or not math.isfinite(strength) or not low <= strength <= high:
        raise ValueError(f"LoRA {name!r}: strength must be a number in [{low:g}, {high:g}], got {strength!r}")


_locks: WeakKeyDictionary = WeakKeyDictionary()


def structure_lock(decoder: nn.Module) -> threading.RLock:
    """Held by a stream's tick and by every LoRA change of the decoder: a tick sees all of a change or none."""
    lock = _locks.get(decoder)
    if lock is None:
        lock = _locks.setdefault(decoder, threading.RLock())
    return lock


def lora_set(decoder: nn.Module) -> LoraSet:
    """The decoder's LoraSet, made on first use."""
    existing = decoder.__dict__.get("_lora_set")
    if existing is None:
        existing = LoraSet(decoder)
        decoder.__dict__["_lora_set"] = existing
    return existing

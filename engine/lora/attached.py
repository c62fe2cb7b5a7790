"""The LoRAs attached to one decoder with live strengths: names, strength slots (one small device tensor), and the
layers that carry them, unmerged (LoraLinear wrappers, unmerged.py) or folded into the weights (folded.py)."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from weakref import WeakKeyDictionary

import torch
from torch import nn

from ..params import LORA_STRENGTH_RANGE as STRENGTH_RANGE
from .adapter import LoraAdapter, check_fits
from .folded import FoldedLayer, FoldRunner, foldable_linear
from .unmerged import LoraLinear

MAX_LORAS = 8  # attached at once per decoder (slots of the strengths tensor)
LIVE_MODES = ("live", "folded")  # unmerged low-rank GEMMs in every tick, or folded on the tick after a change


class LoraSet:
    """The live-strength LoRAs of one decoder. A strength change is one write to `strengths`; unmerged layers
    read it inside the tick, folded layers are refolded by `refresh` at the start of the next tick."""

    def __init__(self, decoder: nn.Module):
        weight = decoder.proj_in[1].weight
        self.decoder = decoder
        self.dtype = weight.dtype
        self.strengths = torch.zeros(MAX_LORAS, device=weight.device)
        self.host_strengths = [0.0] * MAX_LORAS  # the same values on the host: per-row strengths start from them
        self.row_strengths: torch.Tensor | None = None  # [rows or 1, MAX_LORAS] while a forward runs per row
        self.version = 0  # bumped by every attach, detach and strength change
        self.attached: dict[str, tuple[int, LoraAdapter]] = {}
        self.folded_names: set[str] = set()
        self.folds: dict[str, FoldedLayer] = {}  # layer path -> its folded LoRAs
        self.fold_runner = FoldRunner()
        self.folds_run = 0
        self._fold_stale = False
        decoder.register_forward_pre_hook(_refresh_before_forward)  # a direct decoder(...) call sees current folds
        decoder.register_state_dict_post_hook(_resting_weights_out)  # a checkpoint saved now is the base model's

    def attach(self, adapter: LoraAdapter, strength: float = 1.0, mode: str = "live") -> None:
        """Add the adapter's deltas to its layers at `strength`, unmerged (`live`) or `folded`; checked first, so a
        bad file changes nothing."""
        if mode not in LIVE_MODES:
            raise ValueError(f"unknown LoRA mode {mode!r}: choose one of {', '.join(LIVE_MODES)}")
        if adapter.name in self.attached:
            raise ValueError(f"a LoRA named {adapter.name!r} is already loaded: unload it first or pick another name")
        used = {slot for slot, _ in self.attached.values()}
        free = [slot for slot in range(MAX_LORAS) if slot not in used]
        if not free:
            raise ValueError(f"{MAX_LORAS} LoRAs are loaded already: unload one (or merge one that stays)")
        check_strength(adapter.name, strength)
        check_fits(self.decoder, adapter)
        if mode == "folded":
            for path in adapter.deltas:
                foldable_linear(self.decoder.get_submodule(path), path)
        slot = free[0]
        with structure_lock(self.decoder), torch.no_grad():
            self._write(slot, strength)
            self.attached[adapter.name] = (slot, adapter)
            if mode == "folded":
                for path, delta in adapter.deltas.items():
                    self._fold_layer(path).add(slot, delta, self.dtype)
                self.folded_names.add(adapter.name)
                self.fold_runner.forget()
                self._fold_stale = True
            else:
                for path, delta in adapter.deltas.items():
                    self._carrier(path).add(slot, delta, self.dtype)
                self.decoder.structure_version += 1
                self._changed(adapter)

    def detach(self, name: str) -> None:
        slot, adapter = self._get(name)
        with structure_lock(self.decoder), torch.no_grad():
            if name in self.folded_names:
                for path in adapter.deltas:
                    layer = self.folds[path]
                    layer.remove(slot)
                    if not layer.slots:
                        layer.restore()
                        del self.folds[path]
                self.folded_names.discard(name)
                self.fold_runner.forget()
                self._fold_stale = True
            else:
                modules = dict(self.decoder.named_modules())
                for path in adapter.deltas:
                    carrier = modules[path]
                    carrier.remove(slot)
                    if not carrier.slots:
                        self._replace(path, carrier.base)
                self.decoder.structure_version += 1
                self._changed(adapter)
            self._write(slot, 0.0)
            del self.attached[name]

    def set_strength(self, name: str, strength: float) -> None:
        """One write to the strengths tensor, in stream order on the current CUDA stream: ticks queued before it
        use the old value, the next one the new (folded LoRAs: refolded at its start)."""
        slot, adapter = self._get(name)
        check_strength(name, strength)
        with structure_lock(self.decoder):
            self._write(slot, strength)
            if name in self.folded_names:
                self._fold_stale = True
            else:
                self._changed(adapter)

    def strength(self, name: str) -> float:
        return self.host_strengths[self._get(name)[0]]

    def slot(self, name: str) -> int:
        return self._get(name)[0]

    def live_adapters(self) -> list[LoraAdapter]:
        """The LoRAs attached unmerged (their strengths can differ row by row)."""
        return [adapter for name, (_, adapter) in self.attached.items() if name not in self.folded_names]

    def strengths_with(self, own: dict[str, float]) -> tuple[float, ...]:
        """Every slot's strength with a session's `own` ones in place of the shared (names no longer attached, or
        folded since, keep the shared value)."""
        values = list(self.host_strengths)
        for name, strength in own.items():
            if name in self.attached and name not in self.folded_names:
                values[self.attached[name][0]] = strength
        return tuple(values)

    def check_own_strength(self, name: str, strength: float) -> None:
        """Raise ValueError unless `name` is a live LoRA a session can play at its own `strength`."""
        self._get(name)
        check_strength(name, strength)
        if name in self.folded_names:
            raise ValueError(
                f"LoRA {name!r} is folded into the shared weights, so every session hears one strength: load it "
                "with mode 'live' to give each session of a shared ring its own"
            )

    @contextmanager
    def rows_at(self, strengths: torch.Tensor) -> Iterator[None]:
        """Run the decoder's live LoRAs at per-row strengths, [rows, MAX_LORAS] (or [1, MAX_LORAS] for every row)
        in place of the shared ones: several sessions in one batch, each at its own. Folded LoRAs keep theirs."""
        previous, self.row_strengths = self.row_strengths, strengths
        try:
            yield
        finally:
            self.row_strengths = previous

    def mode(self, name: str) -> str:
        self._get(name)
        return "folded" if name in self.folded_names else "live"

    def refresh(self) -> None:
        """Refold the folded layers if a strength, a folded LoRA or a resting weight changed since the last fold;
        the tick calls it first, under the structure lock, so the fold runs in stream order before the tick."""
        if not self._fold_stale:
            return
        self._fold_stale = False
        if self.folds:
            self.fold_runner.run(list(self.folds.values()), self.strengths)
            self.folds_run += 1
        folded = [self.attached[name][1] for name in self.folded_names]
        if any(adapter.touches_cross_kv() for adapter in folded):
            self.decoder.cross_kv_version += 1
        if any(adapter.touches_constant_time_embedding() for adapter in folded):
            self.decoder.clear_folded_constants()

    def resting_weight(self, path: str) -> torch.Tensor | None:
        """The weight a folded layer rests at (what a merge changes while LoRAs are folded there), else None."""
        layer = self.folds.get(path)
        return None if layer is None else layer.rest

    def resting_weights_changed(self) -> None:
        self._fold_stale = True

    def _write(self, slot: int, strength: float) -> None:
        self.strengths[slot].fill_(float(strength))
        self.host_strengths[slot] = float(strength)
        self.version += 1

    def _get(self, name: str) -> tuple[int, LoraAdapter]:
        if name not in self.attached:
            loaded = ", ".join(self.attached) or "none"
            raise ValueError(f"no LoRA named {name!r} is loaded (loaded: {loaded})")
        return self.attached[name]

    def _changed(self, adapter: LoraAdapter) -> None:
        if adapter.touches_cross_kv():  # conditions rebuild their K/V at their next use
            self.decoder.cross_kv_version += 1
        if adapter.touches_constant_time_embedding():
            self.decoder.clear_folded_constants()

    def _fold_layer(self, path: str) -> FoldedLayer:
        layer = self.folds.get(path)
        if layer is None:
            layer = FoldedLayer(foldable_linear(self.decoder.get_submodule(path), path))
            self.folds[path] = layer
        return layer

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


def _refresh_before_forward(decoder: nn.Module, _args) -> None:
    refresh_folds(decoder)


def _resting_weights_out(decoder: nn.Module, state: dict, prefix: str, _metadata) -> None:
    for path, layer in decoder.__dict__["_lora_set"].folds.items():
        state[f"{prefix}{path}.weight"] = layer.rest.detach()


def refresh_folds(decoder: nn.Module) -> None:
    """Bring folded LoRAs to their current strengths (a tick's first step; nothing to do without any)."""
    existing = decoder.__dict__.get("_lora_set")
    if existing is not None:
        existing.refresh()

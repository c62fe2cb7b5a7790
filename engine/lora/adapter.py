"""What a LoRA file holds once read: per DiT linear layer, a weight delta (low rank, or LoKr's Kronecker product)
with the scale its training library defines, checked strictly against the decoder it is for."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

MAX_LISTED = 12  # mismatches named in one error; the rest are counted


@dataclass(frozen=True)
class LowRank:
    """delta W = scale * up @ down (PEFT's lora_B @ lora_A; kohya's lora_up @ lora_down)."""

    down: torch.Tensor  # [rank, in]
    up: torch.Tensor  # [out, rank]
    scale: float  # alpha / rank, or alpha / sqrt(rank) for rsLoRA

    @property
    def shape(self) -> tuple[int, int]:
        return self.up.shape[0], self.down.shape[1]

    def dense(self) -> torch.Tensor:
        """The full delta [out, in] in fp32."""
        return (self.up.float() @ self.down.float()) * self.scale


@dataclass(frozen=True)
class Kronecker:
    """LoKr (LyCORIS): delta W = scale * kron(w1, w2), each factor already multiplied out from its own low-rank
    pair where the file stores one."""

    w1: torch.Tensor  # [out_a, in_a]
    w2: torch.Tensor  # [out_b, in_b]
    scale: float

    @property
    def shape(self) -> tuple[int, int]:
        return self.w1.shape[0] * self.w2.shape[0], self.w1.shape[1] * self.w2.shape[1]

    def dense(self) -> torch.Tensor:
        return torch.kron(self.w1.float(), self.w2.float()) * self.scale


Delta = LowRank | Kronecker


@dataclass(frozen=True)
class LoraAdapter:
    """One LoRA file: a name (its knob is `lora/<name>`), where it came from, and its deltas keyed by the module
    path inside the DiT decoder (`layers.3.self_attn.q_proj`)."""

    name: str
    source: str
    format: str  # "peft", "comfyui", "kohya", "lokr"
    deltas: dict[str, Delta]

    def touches_cross_kv(self) -> bool:
        """Whether it changes what the decoder's cross-attention K/V are built from (cached per condition)."""
        return any(
            path == "condition_embedder" or path.endswith(("cross_attn.k_proj", "cross_attn.v_proj"))
            for path in self.deltas
        )

    def touches_time_embedding(self) -> bool:
        """Whether it changes the timestep embedders (whose output a stream computes once per t and keeps)."""
        return any(path.startswith("time_embed") for path in self.deltas)

    def touches_constant_time_embedding(self) -> bool:
        """Whether it changes `time_embed_r`, whose output at r = t the decoder computes once and keeps."""
        return any(path.startswith("time_embed_r.") for path in self.deltas)


def linear_shape(module: nn.Module) -> tuple[int, int] | None:
    """(out, in) of a linear layer (plain, FP8, or one already carrying LoRAs); None for anything else."""
    base = getattr(module, "base", module)
    if isinstance(base, nn.Linear):
        return base.out_features, base.in_features
    if hasattr(base, "in_features") and hasattr(base, "out_features"):
        return base.out_features, base.in_features
    return None


def check_fits(decoder: nn.Module, adapter: LoraAdapter) -> None:
    """Refuse, with one error that lists what does not match, an adapter whose modules the decoder lacks or whose
    shapes do not fit them (a LoRA for another model or another size)."""
    modules = dict(decoder.named_modules())
    problems = []
    for path, delta in adapter.deltas.items():
        module = modules.get(path)
        shape = None if module is None else linear_shape(module)
        if module is None:
            problems.append(f"{path}: no such layer in the DiT decoder")
        elif shape is None:
            problems.append(f"{path}: not a linear layer ({type(module).__name__})")
        elif tuple(delta.shape) != shape:
            problems.append(f"{path}: delta is {tuple(delta.shape)} (out, in) but the layer is {shape}")
        elif not all(torch.isfinite(t).all() for t in _tensors(delta)):
            problems.append(f"{path}: contains NaN or infinite values")
    if problems:
        listed = "\n  ".join(problems[:MAX_LISTED])
        more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
        raise ValueError(
            f"LoRA {adapter.name!r} ({adapter.source}) does not fit this ACE-Step 1.5 DiT decoder "
            f"({len(problems)} of {len(adapter.deltas)} layers):\n  {listed}{more}\n"
            "Is it a LoRA for this model (turbo 2B / XL) and this release? Nothing was loaded."
        )


def _tensors(delta: Delta) -> tuple[torch.Tensor, ...]:
    return (delta.down, delta.up) if isinstance(delta, LowRank) else (delta.w1, delta.w2)

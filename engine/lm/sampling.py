"""LM sampling math on the device, as pure functions: CFG on logits, counter-based per-sequence random numbers,
temperature → top-k → top-p → sample (nano-vLLM order, spec §5.6).

Randomness is a hash of (sequence seed, step), not a stateful generator: a sequence draws the same number at
step s whatever batch it sits in and whichever rows left before it, every call is a fixed-shape tensor op
(CUDA-graph safe), and no host sync is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B1


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy; top_k 0 = off; top_p 1 = off; cfg 1 = no unconditional rows."""

    temperature: float = 0.85
    top_k: int = 0
    top_p: float = 0.9
    cfg: float = 2.0

    def validate(self) -> None:
        if not self.cfg >= 1.0:
            raise ValueError(f"LM cfg must be >= 1 (1 = off, 2 = the official default), got {self.cfg}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")

    @property
    def guided(self) -> bool:
        return self.cfg != 1.0


def cfg_logits(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """l_u + g·(l_c − l_u), in fp32."""
    cond, uncond = cond.float(), uncond.float()
    return uncond + scale * (cond - uncond)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser on int64 lanes (values stay below 2^59, so nothing overflows)."""
    x = x ^ (x >> 16)
    x = (x * 0x045D9F3B) & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x045D9F3B) & _MASK32
    return x ^ (x >> 16)


def uniforms(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One number in (0, 1) per row from (seed, step), int64 tensors of the same shape -> float32."""
    h = _mix32(seeds & _MASK32)
    h = _mix32(h ^ ((seeds >> 32) & _MASK32))
    h = _mix32(h ^ ((steps * _GOLDEN32) & _MASK32))
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def blocked_cumsum(x: torch.Tensor, block: int = 256) -> torch.Tensor:
    """cumsum over the last dim of [R, V] as sums within blocks plus block offsets: the same numbers up to float
    rounding, but many short scans instead of a few 64,000-long ones (a GPU scan over few rows is slow)."""
    rows, length = x.shape
    padded = torch.nn.functional.pad(x, (0, -length % block)).view(rows, -1, block)
    within = padded.cumsum(dim=-1)
    offsets = within[:, :, -1].cumsum(dim=-1) - within[:, :, -1]
    out = (within + offsets[:, :, None]).view(rows, -1)
    return out if out.shape[1] == length else out[:, :length].contiguous()


def sample(logits: torch.Tensor, params: SamplingParams, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """Indices [R] drawn from logits [R, V]: divide by T, keep the top k, keep the smallest set of mass ≥ top_p,
    then invert the CDF of what is left at `uniforms(seeds, steps)`. Greedy (argmax) when temperature is 0;
    top_k 1 or top_p → 0 also give the argmax (ties go to the lowest index, as argmax does)."""
    if params.temperature == 0.0:
        return logits.argmax(dim=-1)
    scaled = logits.float() / params.temperature
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    cdf = blocked_cumsum(probs)
    # Both filters keep a prefix of the sorted order, so the kept tokens' CDF is a prefix of `cdf`: count them.
    kept = (probs > 0).sum(dim=-1, keepdim=True)
    if params.top_k > 0:
        kept = kept.clamp(max=params.top_k)
    if params.top_p < 1.0:
        kept = torch.minimum(kept, ((cdf - probs) < params.top_p).sum(dim=-1, keepdim=True))
    kept = kept.clamp(min=1)
    target = uniforms(seeds, steps)[:, None] * cdf.gather(-1, kept - 1)
    # How many CDF entries are <= target: searchsorted(right=True) as a reduction, which a compiled step fuses
    # (Inductor cannot lower searchsorted on this CDF on CUDA).
    index = (cdf <= target).sum(dim=-1, keepdim=True).clamp(max=kept - 1)
    return order.gather(-1, index)[:, 0]

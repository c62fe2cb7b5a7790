"""The fused layer kernels as PyTorch custom ops (`torch.ops.flowjam.*`), opaque to torch.compile: the CUDA graph
records them like any kernel. Where the kernels do not run (the CPU, older GPUs), the ops are the eager layer's math
in plain PyTorch. The SwiGLU op takes its kernel by measurement per GEMM shape band (`MEASURED`: the fused kernel
against cuBLAS and one SiLU-mul pass, what Inductor makes of it); `forced_path` forces either path for tests and
benches. The residual + norm + modulation pass replaces Inductor's two kernels for the same math (a row-statistics
pass, then an elementwise pass reading everything again) wherever the kernels run; before FP8 projections it writes
their input quantised (e4m3 rows and scales), so no separate pass quantises it. Which ops a layer takes:
fused_ops.py; docs/benchmarks.md, "Fused kernels", has the profile."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..models.dit import DiTDecoder, gated_add, modulated
from ..models.fp8 import FP8, Fp8Linear, quantize_rows, stack_fp8, stacked_fp8
from ..models.layers import Attention, SwiGLU, stack_weights, stacked_rows
from . import fused_kernels_available, row_band, supports

TIMING_REPEATS = 10
QUEUE_CYCLES = 10_000_000  # ~5 ms of GPU clock, far longer than the host takes to launch the timed calls


@dataclass(frozen=True)
class Measured:
    """One GEMM shape's two paths, timed side by side on its GPU (ms per call)."""

    fused_ms: float
    unfused_ms: float

    @property
    def fused_wins(self) -> bool:
        return self.fused_ms < self.unfused_ms


MEASURED: dict[tuple, Measured] = {}
"""By (op, rows rounded up to a power of two, N, K, dtype, device): what the first call of that shape measured."""


_FORCED: list[bool] = []  # a path forced by `forced_path` (innermost last)


@contextlib.contextmanager
def forced_path(fused: bool) -> Iterator[None]:
    """Take the fused kernels (True) or the unfused path (False) wherever they fit, unmeasured: for tests and
    benches that compare the two."""
    _FORCED.append(fused)
    try:
        yield
    finally:
        _FORCED.pop()


def forced() -> bool | None:
    """The path `forced_path` forces now (the innermost), or None."""
    return _FORCED[-1] if _FORCED else None


def time_ms(run: Callable[[], object]) -> float:
    """Milliseconds per call of `run` on the GPU alone, as a tick graph's replay runs it: the calls are queued
    behind a GPU-side wait, so the host's launch cost (a Triton kernel's is tens of microseconds, as long as the
    kernel itself at a 10 s window's rows) does not count. No graph capture: a live stream's other threads (the
    writer's decodes) keep using the GPU undisturbed. The first call, plain, tunes a kernel's tiles."""
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(QUEUE_CYCLES)
    start.record()
    for _ in range(TIMING_REPEATS):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / TIMING_REPEATS


def takes_fused(key: tuple, m: int, n: int, k: int, fused, unfused) -> bool:
    """Whether this call takes the fused kernel: measured once per shape band; never timed inside a CUDA-graph
    capture (a plan is captured only after its shapes ran plain, so a capture finds its shapes measured)."""
    if not supports(m, n, k):
        return False
    if (choice := forced()) is not None:
        return choice
    found = MEASURED.get(key)
    if found is None:
        if torch.cuda.is_current_stream_capturing():
            return False
        found = MEASURED[key] = Measured(time_ms(fused), time_ms(unfused))
    return found.fused_wins


def paired(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor | None:
    """The [2, N, K] tensor whose halves are these gate and up weights (`pair_mlp_weights` made them so), else None."""
    rows = stacked_rows(w_gate, w_up) if w_gate.shape == w_up.shape else None
    return None if rows is None else rows.view(2, *w_gate.shape)


def _stack_linears(linears: tuple[nn.Module, ...]) -> bool:
    """Store these plain linears' weights as consecutive rows of one tensor (`stack_weights`: no extra memory, the
    parameters become views of it) unless they are already; whether it moved them."""
    if not plain_linears(*linears) or stacked_rows(*(linear.weight for linear in linears)) is not None:
        return False
    stack_weights(linears)
    return True


def pair_mlp(mlp: SwiGLU) -> bool:
    """The MLP's gate and up weights as the two halves of one [2, N, K] tensor, what the fused SwiGLU GEMM reads.
    Whether it moved them."""
    return mlp.gate_proj.weight.shape == mlp.up_proj.weight.shape and _stack_linears((mlp.gate_proj, mlp.up_proj))


def stack_qkv(attn: Attention) -> bool:
    """The attention's q, k and v weights as consecutive rows of one tensor, what the fused q/k/v GEMM reads (FP8
    ones with their scales, `stack_fp8`). Whether it moved them."""
    linears = (attn.q_proj, attn.k_proj, attn.v_proj)
    if not all(type(linear) is Fp8Linear for linear in linears):
        return _stack_linears(linears)
    if stacked_fp8(*zip(*((linear.weight, linear.weight_scale) for linear in linears))) is not None:
        return False
    stack_fp8(linears)
    return True


def pair_mlp_weights(decoder: DiTDecoder) -> int:
    """`pair_mlp` every DiT layer; returns how many layers it paired."""
    return _restacked(decoder, [pair_mlp(layer.mlp) for layer in decoder.layers])


def stack_qkv_weights(decoder: DiTDecoder) -> int:
    """`stack_qkv` every DiT layer's self-attention; returns how many it stacked."""
    return _restacked(decoder, [stack_qkv(layer.self_attn) for layer in decoder.layers])


def _restacked(decoder: DiTDecoder, moved: list[bool]) -> int:
    """Bump the decoder's structure version when any layer's weights moved, so tick graphs captured before (which
    read the old addresses) are never replayed; -> how many moved."""
    if any(moved):
        decoder.structure_version += 1
    return sum(moved)


@torch.library.custom_op("flowjam::swiglu", mutates_args=())
def swiglu(h: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    """silu(h @ w_gate^T) * (h @ w_up^T) for h [..., K] and weights [N, K] -> [..., N]. The fused kernel needs the
    weights paired (`pair_mlp_weights`)."""
    rows = h.reshape(-1, h.shape[-1])
    pair = paired(w_gate, w_up)
    if pair is None or not fused_kernels_available(h.device):
        return (F.silu(F.linear(h, w_gate)) * F.linear(h, w_up)).reshape(*h.shape[:-1], w_gate.shape[0])
    from . import gemm_epilogue

    def fused() -> torch.Tensor:
        return gemm_epilogue.swiglu(rows, pair)

    def unfused() -> torch.Tensor:
        return gemm_epilogue.paired_gemm_silu_mul(rows, pair)

    (m, k), n = rows.shape, w_gate.shape[0]
    key = ("swiglu", row_band(m), n, k, h.dtype, h.device)
    out = fused() if takes_fused(key, m, n, k, fused, unfused) else unfused()
    return out.reshape(*h.shape[:-1], n)


@swiglu.register_fake
def _(h: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    return h.new_empty(*h.shape[:-1], w_gate.shape[0])


def _vectors(x: torch.Tensor, *vectors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Per-batch-row vectors [B or 1, 1, N] as [B or 1, N] with unit column stride (views where they can be), what
    the norm kernel reads."""
    rows = [None if v is None else v.reshape(v.shape[0], x.shape[-1]) for v in vectors]
    return [v if v is None or v.stride(1) == 1 else v.contiguous() for v in rows]


def _eager_modulated(x: torch.Tensor, weight: torch.Tensor, scale, shift, eps: float) -> torch.Tensor:
    return modulated(F.rms_norm(x, (x.shape[-1],), weight, eps), x, scale, shift).contiguous()


@torch.library.custom_op("flowjam::norm_modulate", mutates_args=())
def norm_modulate(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, shift: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """rmsnorm(x) * weight * (1 + scale) + shift for x [B, S, N], scale and shift [B or 1, 1, N] (None: the norm
    alone), in one pass where the kernel runs."""
    if not fused_kernels_available(x.device):
        return _eager_modulated(x, weight, scale, shift, eps)
    from . import norm_modulate as kernel

    return kernel.add_norm_modulate(x, None, None, weight, *_vectors(x, scale, shift), eps)[1]


@norm_modulate.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scale, shift, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape)


@torch.library.custom_op("flowjam::add_norm_modulate", mutates_args=())
def add_norm_modulate(
    x: torch.Tensor,
    delta: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x', h): x' = x + delta * gate, h = rmsnorm(x') * weight * (1 + scale) + shift, for x and delta [B, S, N],
    gate, scale and shift [B or 1, 1, N] (None: no gate / the norm alone), in one pass where the kernel runs."""
    if not fused_kernels_available(x.device):
        added = gated_add(x, delta, gate).contiguous()
        return added, _eager_modulated(added, weight, scale, shift, eps)
    from . import norm_modulate as kernel

    return kernel.add_norm_modulate(x, delta, *_vectors(x, gate), weight, *_vectors(x, scale, shift), eps)


@add_norm_modulate.register_fake
def _(x: torch.Tensor, delta: torch.Tensor, gate, weight: torch.Tensor, scale, shift, eps: float):
    return x.new_empty(x.shape), x.new_empty(x.shape)


def _eager_quantized(x: torch.Tensor, weight: torch.Tensor, scale, shift, eps: float):
    return quantize_rows(_eager_modulated(x, weight, scale, shift, eps).reshape(-1, x.shape[-1]))


@torch.library.custom_op("flowjam::norm_quantize", mutates_args=())
def norm_quantize(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, shift: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm_modulate`'s h as FP8 projections read it: (e4m3 values [B * S, N], row scales [B * S, 1] fp32), what
    `quantize_rows` makes of h, in the same one pass where the kernel runs."""
    if not fused_kernels_available(x.device):
        return _eager_quantized(x, weight, scale, shift, eps)
    from . import norm_modulate as kernel

    return kernel.add_norm_quantize(x, None, None, weight, *_vectors(x, scale, shift), eps)[1:]


@norm_quantize.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scale, shift, eps: float):
    return _fake_quantized(x)


@torch.library.custom_op("flowjam::add_norm_quantize", mutates_args=())
def add_norm_quantize(
    x: torch.Tensor,
    delta: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`add_norm_modulate` with h quantised as `norm_quantize` writes it: (x', e4m3 values, row scales)."""
    if not fused_kernels_available(x.device):
        added = gated_add(x, delta, gate).contiguous()
        return added, *_eager_quantized(added, weight, scale, shift, eps)
    from . import norm_modulate as kernel

    return kernel.add_norm_quantize(x, delta, *_vectors(x, gate), weight, *_vectors(x, scale, shift), eps)


@add_norm_quantize.register_fake
def _(x: torch.Tensor, delta: torch.Tensor, gate, weight: torch.Tensor, scale, shift, eps: float):
    return x.new_empty(x.shape), *_fake_quantized(x)


def _fake_quantized(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = x.shape[0] * x.shape[1]
    return x.new_empty(rows, x.shape[2], dtype=FP8), x.new_empty(rows, 1, dtype=torch.float32)


@torch.library.custom_op("flowjam::quantize_input", mutates_args=())
def quantize_input(x: torch.Tensor, up: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 projection's input [B, S, N] quantised by rows, `quantize_rows`' (e4m3 values [B * S, N], fp32 row
    scales [B * S, 1]): of x, or of the MLP's silu(x) * up where `up` is given; one pass where the kernel runs."""
    if not fused_kernels_available(x.device):
        return quantize_rows((x if up is None else F.silu(x) * up).reshape(-1, x.shape[-1]))
    from . import quantize

    return quantize.quantize_rows(x.reshape(-1, x.shape[-1]), None if up is None else up.reshape(-1, x.shape[-1]))


@quantize_input.register_fake
def _(x: torch.Tensor, up: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return _fake_quantized(x)


def plain_linears(*linears: nn.Module) -> bool:
    """Bias-free nn.Linear layers (not FP8, not wrapped by a LoRA): what the fused ops take."""
    return all(type(linear) is nn.Linear and linear.bias is None for linear in linears)

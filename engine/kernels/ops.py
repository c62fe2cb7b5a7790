"""The fused layer kernels as PyTorch custom ops (`torch.ops.flowjam.*`), opaque to torch.compile: the CUDA graph
records them like any kernel. Where the kernels do not run (the CPU, older GPUs), the ops are the eager layer's math
in plain PyTorch. The GEMM fusions are taken by measurement: the SwiGLU op per GEMM shape band (`MEASURED`: the fused
kernel against cuBLAS and one SiLU-mul pass, what Inductor makes of it), the gated residual per projection shape
before tracing (`RESIDUAL_FUSED`: the kernel against cuBLAS alone). The residual + norm + modulation pass replaces
Inductor's two kernels for the same math (a row-statistics pass, then an elementwise pass reading everything again)
wherever the kernels run (docs/benchmarks.md, "Fused kernels", has the profile); before FP8 projections it writes
their input quantised (e4m3 rows and scales), so no separate pass quantises it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..models.dit import DiTDecoder, LayerOps, gated_add, modulated
from ..models.fp8 import FP8, Fp8Linear, Fp8Rows, quantize_rows
from ..models.layers import Attention, RMSNorm, SwiGLU, rope_cos_sin
from . import fused_kernels_available, row_band, supports
from .qkv_ops import qkv_norm_rope, split_heads, stacked

TIMING_REPEATS = 10


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


def _time_ms(run) -> float:
    run()  # the fused kernel's first call tunes its tile shapes
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(TIMING_REPEATS):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / TIMING_REPEATS


def _use_fused(key: tuple, m: int, n: int, k: int, fused, unfused) -> bool:
    """Whether this call takes the fused kernel: measured once per shape band; never timed inside a CUDA-graph
    capture (a plan is captured only after its shapes ran plain, so a capture finds its shapes measured)."""
    if not supports(m, n, k):
        return False
    if _FORCED:
        return _FORCED[-1]
    found = MEASURED.get(key)
    if found is None:
        if torch.cuda.is_current_stream_capturing():
            return False
        found = MEASURED[key] = Measured(_time_ms(fused), _time_ms(unfused))
    return found.fused_wins


def paired(w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor | None:
    """The [2, N, K] tensor whose halves are these gate and up weights (`pair_mlp_weights` made them so), else None."""
    if not (w_gate.is_contiguous() and w_up.is_contiguous() and w_gate.shape == w_up.shape):
        return None
    if w_gate.untyped_storage().data_ptr() != w_up.untyped_storage().data_ptr():
        return None  # separate tensors, however close the allocator put them
    if w_up.storage_offset() != w_gate.storage_offset() + w_gate.numel():
        return None
    n, k = w_gate.shape
    return w_gate.as_strided((2, n, k), (n * k, k, 1))


def pair_mlp(mlp: SwiGLU) -> bool:
    """Store the MLP's gate and up weights as the two halves of one [2, N, K] tensor, what the fused SwiGLU GEMM
    reads (no extra memory: the parameters become views of it). Whether it moved them."""
    gate, up = mlp.gate_proj, mlp.up_proj
    if not _plain(gate, up) or gate.weight.shape != up.weight.shape or paired(gate.weight, up.weight) is not None:
        return False
    pair = torch.stack([gate.weight.detach(), up.weight.detach()])
    gate.weight = nn.Parameter(pair[0], requires_grad=gate.weight.requires_grad)
    up.weight = nn.Parameter(pair[1], requires_grad=up.weight.requires_grad)
    return True


def pair_mlp_weights(decoder: DiTDecoder) -> int:
    """`pair_mlp` every DiT layer; bumps the decoder's structure version when any moved, so tick graphs captured
    before (which read the old addresses) are never replayed. Returns how many layers it paired."""
    moved = sum(pair_mlp(layer.mlp) for layer in decoder.layers)
    if moved:
        decoder.structure_version += 1
    return moved


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
        return gemm_epilogue.silu_mul(rows @ w_gate.t(), rows @ w_up.t())

    (m, k), n = rows.shape, w_gate.shape[0]
    key = ("swiglu", row_band(m), n, k, h.dtype, h.device)
    out = fused() if _use_fused(key, m, n, k, fused, unfused) else unfused()
    return out.reshape(*h.shape[:-1], n)


@swiglu.register_fake
def _(h: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    return h.new_empty(*h.shape[:-1], w_gate.shape[0])


@torch.library.custom_op("flowjam::gated_residual", mutates_args=())
def gated_residual(
    x: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None
) -> torch.Tensor:
    """x + (inputs @ weight^T) * gate for x [B, S, N], inputs [B, S, K], weight [N, K] and gate [B or 1, 1, N]
    (None: no gate) -> a new [B, S, N], in one kernel where it runs."""
    batch, tokens, n = x.shape
    rows = inputs.reshape(-1, inputs.shape[-1])
    m, k = rows.shape
    if not fused_kernels_available(x.device) or not supports(m, n, k):
        return gated_add(x, F.linear(inputs, weight), gate).contiguous()
    from . import gemm_epilogue

    gate_rows = None if gate is None else gate.reshape(gate.shape[0], n)
    per_gate = tokens if gate is None or gate.shape[0] == batch else m
    return gemm_epilogue.gated_residual(rows, weight, x.reshape(m, n), gate_rows, per_gate).view(batch, tokens, n)


@gated_residual.register_fake
def _(x: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape)


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


RESIDUAL_ROWS = 4096  # rows the gated-residual kernel is timed at against cuBLAS
RESIDUAL_FUSED: dict[tuple, bool] = {}
"""By (N, K, dtype, device): whether the gated-residual kernel beat cuBLAS's GEMM alone (`choose_residuals`)."""


def choose_residuals(decoder: DiTDecoder) -> dict[tuple, bool]:
    """Time the gated-residual kernel against cuBLAS's bare GEMM at each of the decoder's projection shapes (o_proj,
    down_proj), once per shape and device: where the kernel is not faster, `FusedOps` runs cuBLAS's GEMM and leaves
    the gate and residual to the pass after it (o_proj's to the norm pass, down_proj's to Inductor's next kernel).
    Decided before the layers are traced, so compiled code never re-decides. Returns the decisions for this
    decoder's shapes."""
    layer = decoder.layers[0]
    weights = [layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight]
    for weight in weights:
        key = _weight_key(weight)
        if key not in RESIDUAL_FUSED:
            RESIDUAL_FUSED[key] = _residual_kernel_wins(weight)
    return {_weight_key(weight): RESIDUAL_FUSED[_weight_key(weight)] for weight in weights}


def _residual_kernel_wins(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    if weight.dtype not in (torch.bfloat16, torch.float16) or not supports(RESIDUAL_ROWS, n, k):
        return False
    batch, like = 8, dict(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        inputs = torch.randn(batch, RESIDUAL_ROWS // batch, k, **like)
        x = torch.randn(batch, RESIDUAL_ROWS // batch, n, **like)
        gate = torch.randn(batch, 1, n, **like)
        fused_ms = _time_ms(lambda: gated_residual(x, inputs, weight, gate))
        bare_ms = _time_ms(lambda: inputs @ weight.t())
    return fused_ms < bare_ms


QKV_FUSED: dict[tuple, bool] = {}
"""By (N, K, dtype, device) of the stacked q/k/v weights: whether the q/k/v kernel beat cuBLAS (`choose_qkv`)."""


def choose_qkv(decoder: DiTDecoder) -> dict[tuple, bool]:
    """Time the q/k/v kernel (one GEMM with the q/k norms and RoPE in its epilogue) against cuBLAS's GEMM of the
    same stacked weights plus one copy of the q and k columns, the least any separate norm + RoPE pass costs; once
    per shape and device, before the layers are traced (`stack_qkv_weights` first). Where the kernel is not
    faster, `FusedOps` runs the projections as LayerOps does. Returns the decision for this decoder's shape."""
    attn = decoder.layers[0].self_attn
    rows = stacked(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
    if rows is None:
        return {}
    key = _qkv_key(attn)
    if key not in QKV_FUSED:
        QKV_FUSED[key] = _qkv_kernel_wins(attn, rows, decoder.config.rope_theta)
    return {key: QKV_FUSED[key]}


def _qkv_kernel_wins(attn: Attention, rows: torch.Tensor, theta: float) -> bool:
    n, k = rows.shape
    if rows.dtype not in (torch.bfloat16, torch.float16) or not supports(RESIDUAL_ROWS, n, k):
        return False
    batch, like = 8, dict(device=rows.device, dtype=rows.dtype)
    tokens = RESIDUAL_ROWS // batch
    with torch.no_grad():
        h = torch.randn(batch, tokens, k, **like)
        cos, sin = rope_cos_sin(torch.arange(tokens, device=rows.device), attn.head_dim, theta, rows.dtype)
        weights = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.q_norm.weight, attn.k_norm.weight)
        fused_ms = _time_ms(lambda: qkv_norm_rope(h, *weights, cos, sin, attn.q_norm.eps))
        q_and_k = h.new_empty(2, batch * tokens, n - attn.v_proj.weight.shape[0])
        bare_ms = _time_ms(lambda: h @ rows.t()) + _time_ms(lambda: q_and_k[1].copy_(q_and_k[0]))
    return fused_ms < bare_ms


def _qkv_kernel_taken(attn: Attention) -> bool:
    """Whether this self-attention runs its q/k/v through the kernel op (forced, or chosen by `choose_qkv`); the op
    itself checks that the weights are stacked (compiled code never reads addresses)."""
    if not _plain(attn.q_proj, attn.k_proj, attn.v_proj):
        return False
    return bool(_FORCED[-1] if _FORCED else QKV_FUSED.get(_qkv_key(attn)))


def _qkv_key(attn: Attention) -> tuple:
    weights = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
    first = weights[0]
    return (sum(w.shape[0] for w in weights), first.shape[1], first.dtype, first.device)


def _weight_key(weight: torch.Tensor) -> tuple:
    return (*weight.shape, weight.dtype, weight.device)


def _plain(*linears: nn.Module) -> bool:
    """Bias-free nn.Linear layers (not FP8, not wrapped by a LoRA): what the fused ops take."""
    return all(type(linear) is nn.Linear and linear.bias is None for linear in linears)


def _residual_kernel_taken(linear: nn.Module) -> bool:
    """Whether this projection runs as the gated-residual GEMM (forced, or chosen by `choose_residuals`)."""
    return _plain(linear) and bool(_FORCED[-1] if _FORCED else RESIDUAL_FUSED.get(_weight_key(linear.weight)))


class FusedOps(LayerOps):
    """A DiT layer through the fused ops: the SwiGLU always (each shape's faster path measured inside the op), a gated
    residual where `choose_residuals` found the kernel faster, the self-attention's q/k/v with their norms and RoPE
    in one GEMM where `choose_qkv` did, every norm and modulation in one pass with the residual before it. GEMMs the
    ops do not take (FP8, LoRA-wrapped linears) run as LayerOps' (the norm pass after them still runs, quantising
    for FP8)."""

    @staticmethod
    def residual(x: torch.Tensor, linear: nn.Module, inputs: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        if not _residual_kernel_taken(linear):
            return LayerOps.residual(x, linear, inputs, gate)
        return torch.ops.flowjam.gated_residual(x, inputs, linear.weight, gate)

    @staticmethod
    def self_attention(
        attn: Attention, h: torch.Tensor | Fp8Rows, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None
    ) -> torch.Tensor:
        if not _qkv_kernel_taken(attn):
            return LayerOps.self_attention(attn, h, rope, mask)
        weights = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.q_norm.weight, attn.k_norm.weight)
        joined = torch.ops.flowjam.qkv_norm_rope(h, *weights, *rope, attn.q_norm.eps)
        return attn.heads_attention(*split_heads(attn, joined), mask)

    @staticmethod
    def swiglu(mlp: SwiGLU, h: torch.Tensor) -> torch.Tensor:
        if not _plain(mlp.gate_proj, mlp.up_proj):
            return LayerOps.swiglu(mlp, h)
        return torch.ops.flowjam.swiglu(h, mlp.gate_proj.weight, mlp.up_proj.weight)

    @staticmethod
    def modulated_norm(
        norm: RMSNorm,
        x: torch.Tensor,
        scale: torch.Tensor | None,
        shift: torch.Tensor | None,
        into: tuple[nn.Module, ...] = (),
    ) -> torch.Tensor | Fp8Rows:
        if _reads_fp8_rows(into):
            values, row_scale = torch.ops.flowjam.norm_quantize(x, norm.weight, scale, shift, norm.eps)
            return Fp8Rows(values, row_scale, tuple(x.shape))
        return torch.ops.flowjam.norm_modulate(x, norm.weight, scale, shift, norm.eps)

    def residual_norm(
        self,
        x: torch.Tensor,
        linear: nn.Module,
        inputs: torch.Tensor,
        gate: torch.Tensor | None,
        norm: RMSNorm,
        scale: torch.Tensor | None,
        shift: torch.Tensor | None,
        into: tuple[nn.Module, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | Fp8Rows]:
        """The projection alone (cuBLAS, or FP8 / LoRA-wrapped as it comes), then the gate, residual, norm and
        modulation in one pass (quantising where every projection `into` is FP8); with the gated-residual GEMM
        where that was chosen."""
        if _residual_kernel_taken(linear):
            x = torch.ops.flowjam.gated_residual(x, inputs, linear.weight, gate)
            return x, self.modulated_norm(norm, x, scale, shift, into)
        if _reads_fp8_rows(into):
            x, values, row_scale = torch.ops.flowjam.add_norm_quantize(
                x, linear(inputs), gate, norm.weight, scale, shift, norm.eps
            )
            return x, Fp8Rows(values, row_scale, tuple(x.shape))
        return torch.ops.flowjam.add_norm_modulate(x, linear(inputs), gate, norm.weight, scale, shift, norm.eps)


def _reads_fp8_rows(into: tuple[nn.Module, ...]) -> bool:
    """Whether every projection `into` is a bare Fp8Linear (a LoRA-wrapped one reads the unquantised input too)."""
    return bool(into) and all(type(linear) is Fp8Linear for linear in into)


FUSED_OPS = FusedOps()

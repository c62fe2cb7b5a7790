"""`bench kernels`: each fused op's paths timed side by side at a preset's layer shapes, every call replayed from a
CUDA graph (as a tick runs them: no launch cost counted) with random bf16 inputs. What the per-row-band choices in
`engine.kernels` pick between, and what Inductor would run instead."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..models.fp8 import quantize_rows
from ..models.layers import rope_cos_sin
from ..models.presets import AceStepConfig, get_preset
from ..params import LATENT_RATE_HZ

GRAPH_CALLS = 20  # calls captured in one graph; the graph is replayed 5 times


@dataclass(frozen=True)
class KernelTiming:
    op: str
    rows: int  # GEMM rows: batch rows x tokens
    paths_us: dict[str, float]  # microseconds per call, by path


def graph_us(run: Callable[[], object]) -> float:
    """Microseconds per call of `run`, captured `GRAPH_CALLS` times in a CUDA graph (after two plain calls, which
    also tune any kernel) and replayed."""
    run(), run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            run()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / (5 * GRAPH_CALLS)


def bench_kernels(preset: str, song_seconds: list[float], batch_rows: int, device: str) -> list[KernelTiming]:
    """The q/k/v op's, the SwiGLU op's and the FP8 quantising pass's paths at `batch_rows` rows of each song
    length's tokens."""
    from ..kernels import fused_kernels_available

    dev = torch.device(device)
    if not fused_kernels_available(dev):
        raise ValueError(
            "bench kernels needs a CUDA GPU of compute capability 9.0+ with Triton: pip install 'flowjam[kernels]' "
            "and pass --device cuda"
        )
    config = get_preset(preset).dit
    generator = torch.Generator(dev).manual_seed(0)
    weights = _LayerWeights.random(config, dev, generator)
    timings = []
    for seconds in song_seconds:
        tokens = -(-round(seconds * LATENT_RATE_HZ) // config.patch_size)
        h = torch.randn(batch_rows, tokens, config.hidden_size, device=dev, generator=generator).bfloat16()
        cos, sin = rope_cos_sin(torch.arange(tokens, device=dev), config.head_dim, config.rope_theta, torch.bfloat16)
        timings += _timings_at(weights, h, cos, sin)
    return timings


@dataclass(frozen=True)
class _LayerWeights:
    """One layer's stacked q/k/v rows [q; k; v], head-norm weights and paired gate/up weights [2, N, K]."""

    qkv: torch.Tensor
    widths: tuple[int, int, int]
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    gate_up: torch.Tensor

    @staticmethod
    def random(config: AceStepConfig, device: torch.device, generator: torch.Generator) -> _LayerWeights:
        k, d = config.hidden_size, config.head_dim
        widths = (config.num_attention_heads * d, config.num_key_value_heads * d, config.num_key_value_heads * d)

        def random(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device=device, generator=generator).bfloat16() / shape[-1] ** 0.5

        ones = torch.ones(d, device=device, dtype=torch.bfloat16)
        return _LayerWeights(random(sum(widths), k), widths, ones, ones, random(2, config.intermediate_size, k))


def _timings_at(w: _LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> list[KernelTiming]:
    from ..kernels import gemm_epilogue, qkv_rope, quantize
    from ..kernels.qkv_ops import _eager_qkv

    a = h.reshape(-1, h.shape[-1])
    m = a.shape[0]
    tables = (w.q_norm, w.k_norm, cos, sin, w.widths[0], w.widths[1], 1e-6)
    w_q, w_k, w_v = w.qkv.split(w.widths)
    inductor_qkv = torch.compile(_eager_qkv)
    gate, up = a @ w.gate_up[0].t(), a @ w.gate_up[1].t()
    inductor_silu_mul = torch.compile(lambda gate, up: F.silu(gate) * up)
    inductor_quantize = torch.compile(lambda gate, up: quantize_rows(F.silu(gate) * up))
    return [
        KernelTiming(
            "q/k/v + head norms + RoPE",
            m,
            {
                "GEMM with epilogue": graph_us(lambda: qkv_rope.qkv_norm_rope(a, w.qkv, *tables)),
                "cuBLAS GEMM + pass": graph_us(lambda: qkv_rope.norm_rope_columns(a @ w.qkv.t(), *tables)),
                "Inductor": graph_us(lambda: inductor_qkv(h, w_q, w_k, w_v, w.q_norm, w.k_norm, cos, sin, 1e-6)),
            },
        ),
        KernelTiming(
            "SwiGLU (gate|up GEMM + SiLU-mul)",
            m,
            {
                "GEMM with epilogue": graph_us(lambda: gemm_epilogue.swiglu(a, w.gate_up)),
                "cuBLAS GEMM + pass": graph_us(lambda: gemm_epilogue.paired_gemm_silu_mul(a, w.gate_up)),
                "Inductor": graph_us(lambda: inductor_silu_mul(a @ w.gate_up[0].t(), a @ w.gate_up[1].t())),
            },
        ),
        KernelTiming(
            "FP8 input of the down projection",
            m,
            {
                "pass": graph_us(lambda: quantize.quantize_rows(gate, up)),
                "Inductor": graph_us(lambda: inductor_quantize(gate, up)),
            },
        ),
    ]

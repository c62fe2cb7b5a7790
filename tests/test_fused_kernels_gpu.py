"""The fused kernels (engine/kernels) against the eager layer, on a Hopper GPU (skipped elsewhere, the reason
printed): the GEMM-epilogue kernels (the q/k/v one included) and the residual + norm + modulation pass (plain and
quantising) at the DiT's real shapes and at row counts that are not a multiple of any tile, the custom ops' fake
kernels against their outputs, a whole layer through the fused ops (FP8 too), and compile-graph ticks that take
them, replayed without host syncs."""

import copy
import sys

import pytest
import torch
import torch.nn.functional as F
from flowjam.engine.kernels import fused_kernels_available
from flowjam.engine.models.dit import EAGER_OPS, DiTLayer
from flowjam.engine.models.layers import rope_cos_sin
from flowjam.engine.models.presets import get_preset
from helpers import (
    HALVES,
    assert_a_tick_replays_without_host_sync,
    assert_close_latents,
    both_halves,
    check_fused_op_fakes,
    stream_latents,
)

RUNS = torch.cuda.is_available() and fused_kernels_available("cuda")
if not RUNS:
    print(
        "\nSKIPPED tests/test_fused_kernels_gpu.py: needs a CUDA GPU of compute capability 9.0+ with Triton",
        file=sys.stderr,
    )
hopper = pytest.mark.skipif(not RUNS, reason="needs a CUDA GPU of compute capability 9.0+ with Triton")

HIDDEN, INTERMEDIATE = 2048, 6144  # turbo-2b
ROWS = [6000, 1500, 6001, 1001, 97, 1]  # 8 x 750 tokens (60 s, depth 4, cfg full), 2 x 750, odd counts


def _relative(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value.float() - reference).norm() / reference.norm()).item()


def _weights(n: int, k: int, seed: int) -> torch.Tensor:
    generator = torch.Generator("cuda").manual_seed(seed)
    return (torch.randn(n, k, generator=generator, device="cuda") / k**0.5).bfloat16()


def _within_bf16_of_eager(fused: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor, what: str) -> None:
    """The fused result is as close to the fp32 result as the eager bf16 one is (one rounding apart at most)."""
    fused_error, eager_error = _relative(fused, exact), _relative(eager, exact)
    assert fused_error <= max(2 * eager_error, 4e-3), f"{what}: fused {fused_error:.2e} vs eager {eager_error:.2e}"
    assert _relative(fused, eager.float()) < 1e-2, (
        f"{what}: fused and eager differ by {_relative(fused, eager.float()):.2e}"
    )


@hopper
@pytest.mark.parametrize("rows", ROWS)
def test_swiglu_kernel_equals_the_eager_mlp_activations(rows):
    from flowjam.engine.kernels import gemm_epilogue

    pair = torch.stack([_weights(INTERMEDIATE, HIDDEN, 1), _weights(INTERMEDIATE, HIDDEN, 2)])
    w_gate, w_up = pair
    x = torch.randn(rows, HIDDEN, device="cuda").bfloat16()
    exact = F.silu(x.float() @ w_gate.float().t()) * (x.float() @ w_up.float().t())
    eager = F.silu(x @ w_gate.t()) * (x @ w_up.t())
    fused = gemm_epilogue.swiglu(x, pair)
    assert fused.shape == (rows, INTERMEDIATE)
    _within_bf16_of_eager(fused, eager, exact, f"swiglu at {rows} rows")


@hopper
@pytest.mark.parametrize("batch, tokens", [(8, 750), (3, 251), (1, 1), (2, 97)])
@pytest.mark.parametrize("head_dim, heads, kv_heads", [(128, 16, 8), (16, 4, 2)])
@pytest.mark.parametrize("in_epilogue", [True, False])
def test_qkv_op_equals_the_eager_projections_head_norms_and_rope(batch, tokens, head_dim, heads, kv_heads, in_epilogue):
    """q, k and v in one GEMM with the q/k RMSNorm and RoPE in its epilogue, or in a pass after cuBLAS's GEMM (the
    op's two paths): turbo-2b's heads and the tiny preset's, row counts no tile divides; each part as close to the
    fp32 result as the eager bf16 layer's."""
    from flowjam.engine.kernels.ops import forced_path
    from flowjam.engine.kernels.qkv_ops import _eager_qkv, qkv_norm_rope
    from flowjam.engine.models.layers import stacked_rows

    k = heads * head_dim
    rows = _weights((heads + 2 * kv_heads) * head_dim, k, 3)
    w_q, w_k, w_v = rows.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
    assert stacked_rows(w_q, w_k, w_v) is not None
    q_norm, k_norm = ((1 + 0.1 * torch.randn(head_dim, device="cuda")).bfloat16() for _ in range(2))
    h = torch.randn(batch, tokens, k, device="cuda").bfloat16()
    cos, sin = rope_cos_sin(torch.arange(tokens, device="cuda"), head_dim, 1_000_000.0, torch.bfloat16)
    with forced_path(fused=in_epilogue):
        fused = qkv_norm_rope(h, w_q, w_k, w_v, q_norm, k_norm, cos, sin, 1e-6)
    eager = _eager_qkv(h, w_q, w_k, w_v, q_norm, k_norm, cos, sin, 1e-6)
    as_fp32 = [t.float() for t in (h, w_q, w_k, w_v, q_norm, k_norm, cos, sin)]
    exact = _eager_qkv(*as_fp32, 1e-6)
    widths = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    for name, a, b, c in zip("qkv", fused.split(widths, -1), eager.split(widths, -1), exact.split(widths, -1)):
        _within_bf16_of_eager(a, b, c, f"{name}: {batch}x{tokens}, heads of {head_dim}")


@hopper
@pytest.mark.parametrize(
    "batch, tokens, n", [(8, 750, HIDDEN), (2, 750, HIDDEN), (3, 251, HIDDEN), (1, 1, HIDDEN), (5, 7, 1000)]
)
@pytest.mark.parametrize(
    "add, gate, modulate",
    [(True, True, True), (True, False, True), (True, True, False), (False, False, True), (False, False, False)],
)
def test_norm_kernel_equals_the_eager_residual_norm_and_modulation(batch, tokens, n, add, gate, modulate):
    """x + delta * gate, RMSNorm, AdaLN's (1 + scale) and shift, per batch row; a width that is no power of two."""
    from flowjam.engine.kernels import norm_modulate

    def vector(scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(batch, 1, n, device="cuda") * scale).bfloat16()

    x = torch.randn(batch, tokens, n, device="cuda").bfloat16()
    delta = torch.randn(batch, tokens, n, device="cuda").bfloat16() if add else None
    gates = vector() if gate else None
    weight = (1 + 0.1 * torch.randn(n, device="cuda")).bfloat16()
    scale, shift = (vector(0.3), vector(0.3)) if modulate else (None, None)
    exact_x = x.float() + (0 if delta is None else delta.float() * (1 if gates is None else gates.float()))
    eager_x = x if delta is None else (x + delta if gates is None else (x + delta * gates).type_as(x))
    exact = F.rms_norm(exact_x, (n,), weight.float(), 1e-6)
    eager = F.rms_norm(eager_x, (n,), weight, 1e-6)
    if modulate:
        exact = exact * (1 + scale.float()) + shift.float()
        eager = (eager * (1 + scale) + shift).type_as(x)
    vectors = [None if v is None else v.view(batch, n) for v in (gates, scale, shift)]
    before = x.clone()
    fused_x, fused = norm_modulate.add_norm_modulate(x, delta, vectors[0], weight, *vectors[1:], 1e-6)
    what = f"{batch}x{tokens}x{n}, add {add}, gate {gate}, modulate {modulate}"
    _within_bf16_of_eager(fused, eager, exact, what)
    assert torch.equal(x, before), "the input x was written"
    if add:
        _within_bf16_of_eager(fused_x, eager_x, exact_x, what + " (x')")


@hopper
@pytest.mark.parametrize("layout", ["shared", "chunked"])
def test_norm_kernel_reads_shared_and_chunked_modulation_vectors(layout):
    """One vector for every batch row (stride 0), and the layer's own layout: gate, scale and shift as chunks of one
    [B, 3, N] tensor (row stride 3N); a vector of another batch is refused, naming the shapes."""
    from flowjam.engine.kernels import norm_modulate

    batch, tokens = 4, 33
    x = torch.randn(batch, tokens, HIDDEN, device="cuda").bfloat16()
    delta = torch.randn(batch, tokens, HIDDEN, device="cuda").bfloat16()
    weight = (1 + 0.1 * torch.randn(HIDDEN, device="cuda")).bfloat16()
    rows = 1 if layout == "shared" else batch
    shift, scale, gate = (torch.randn(rows, 3, HIDDEN, device="cuda") * 0.3).bfloat16().chunk(3, dim=1)
    added = (x.float() + delta.float() * gate.float()).bfloat16()
    eager = (F.rms_norm(added, (HIDDEN,), weight, 1e-6) * (1 + scale) + shift).type_as(x)
    exact = F.rms_norm(x.float() + delta.float() * gate.float(), (HIDDEN,), weight.float(), 1e-6)
    exact = exact * (1 + scale.float()) + shift.float()
    vectors = [v.reshape(rows, HIDDEN) for v in (gate, scale, shift)]
    _, fused = norm_modulate.add_norm_modulate(x, delta, vectors[0], weight, *vectors[1:], 1e-6)
    _within_bf16_of_eager(fused, eager, exact, f"{layout} vectors")
    wrong = torch.zeros(batch - 1, HIDDEN, device="cuda").bfloat16()
    with pytest.raises(ValueError, match=r"\[4 or 1, 2048\]"):
        norm_modulate.add_norm_modulate(x, delta, wrong, weight, *vectors[1:], 1e-6)


@hopper
@pytest.mark.parametrize("batch, tokens, n", [(8, 750, HIDDEN), (3, 251, HIDDEN), (1, 1, HIDDEN), (5, 7, 1000)])
@pytest.mark.parametrize("add, modulate", [(True, True), (False, True), (True, False)])
def test_the_quantising_norm_pass_writes_what_fp8_linears_make_of_its_h(batch, tokens, n, add, modulate):
    """The pass that feeds FP8 projections: x' as the plain pass writes it, and h as `quantize_rows` quantises the
    h the plain pass writes (the row's scale to fp32 precision; e4m3 values equal but for a rare tie at one step)."""
    from flowjam.engine.kernels import norm_modulate
    from flowjam.engine.models.fp8 import FP8, quantize_rows

    x = torch.randn(batch, tokens, n, device="cuda").bfloat16()
    delta = torch.randn(batch, tokens, n, device="cuda").bfloat16() if add else None
    gate = torch.randn(batch, n, device="cuda").bfloat16() if add else None
    weight = (1 + 0.1 * torch.randn(n, device="cuda")).bfloat16()
    scale, shift = ((torch.randn(batch, n, device="cuda") * 0.3).bfloat16() for _ in range(2))
    scale, shift = (scale, shift) if modulate else (None, None)
    plain_x, h = norm_modulate.add_norm_modulate(x, delta, gate, weight, scale, shift, 1e-6)
    quant_x, values, row_scale = norm_modulate.add_norm_quantize(x, delta, gate, weight, scale, shift, 1e-6)
    expected_values, expected_scale = quantize_rows(h.reshape(-1, n))
    what = f"{batch}x{tokens}x{n}, add {add}, modulate {modulate}"
    assert torch.equal(quant_x, plain_x), what
    assert values.dtype == FP8 and values.shape == (batch * tokens, n) and row_scale.shape == (batch * tokens, 1)
    torch.testing.assert_close(row_scale, expected_scale, rtol=1e-6, atol=0, msg=what)
    got, want = values.float(), expected_values.float()
    assert (got == want).float().mean() > 0.999, what
    assert ((got - want).abs() <= want.abs() / 8 + 2**-9).all(), f"{what}: a value more than one e4m3 step off"


@hopper
@pytest.mark.parametrize("rows, n, gated", [(6000, 6144, True), (753, 6144, True), (1, 6144, True), (35, 1000, True),
                                            (6000, 2048, False), (251, 2048, False)])  # fmt: skip
def test_the_quantising_pass_writes_what_fp8_linears_make_of_the_stored_activation(rows, n, gated):
    """Before the FP8 down projection, silu(gate) * up as the eager layer stores it (before an output projection, the
    heads as they are), quantised as `quantize_rows` quantises it (scales equal but where the silu's last bit rounds
    the other way in a row's largest value; e4m3 values equal but for a rare tie at one step)."""
    from flowjam.engine.kernels import quantize
    from flowjam.engine.models.fp8 import FP8, quantize_rows

    x, up = (torch.randn(rows, n, device="cuda") * 3).bfloat16(), torch.randn(rows, n, device="cuda").bfloat16()
    stored = F.silu(x) * up if gated else x
    values, row_scale = quantize.quantize_rows(x, up if gated else None)
    expected_values, expected_scale = quantize_rows(stored)
    what = f"{rows}x{n}, gated {gated}"
    assert values.dtype == FP8 and values.shape == (rows, n) and row_scale.shape == (rows, 1)
    torch.testing.assert_close(row_scale, expected_scale, rtol=2**-7, atol=0, msg=what)
    assert (row_scale == expected_scale).float().mean() > 0.99, what
    same_scale = (row_scale == expected_scale).flatten()
    got, want = values[same_scale].float(), expected_values[same_scale].float()
    assert (got == want).float().mean() > 0.999, what
    assert ((got - want).abs() <= want.abs() / 8 + 2**-9).all(), f"{what}: a value more than one e4m3 step off"


@hopper
@pytest.mark.parametrize("tokens", [750, 251])
def test_an_fp8_layer_through_the_fused_ops_reads_quantised_rows_and_equals_the_eager_fp8_layer(tokens):
    """A turbo-2b layer in FP8: the norm passes hand q/k/v, the cross-attention query and gate/up their inputs
    quantised, the quantising pass the output and down projections theirs, q/k/v run as one FP8 GEMM of the stacked
    weights with the norm + RoPE pass after it (every kernel runs), and the layer's outputs are the eager FP8 layer's
    within FP8 error."""
    from flowjam.engine.kernels.fused_ops import FUSED_OPS
    from flowjam.engine.kernels.ops import stack_qkv
    from flowjam.engine.models.fp8 import Fp8Linear, Fp8Rows

    config = get_preset("turbo-2b").dit
    torch.manual_seed(0)
    layer = DiTLayer(config, 0).cuda().bfloat16().eval()
    for parent, name in [(layer.self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")] + [
        (layer.cross_attn, "q_proj"), (layer.cross_attn, "o_proj"),
        (layer.mlp, "gate_proj"), (layer.mlp, "up_proj"), (layer.mlp, "down_proj"),
    ]:  # fmt: skip
        setattr(parent, name, Fp8Linear(getattr(parent, name)))
    eager_layer = copy.deepcopy(layer)  # q/k/v as three FP8 GEMMs, as the eager layer runs them
    assert stack_qkv(layer.self_attn)
    x = torch.randn(4, tokens, HIDDEN, device="cuda").bfloat16()
    modulation = (torch.randn(4, 6, HIDDEN, device="cuda") * 0.1).bfloat16()
    rope = rope_cos_sin(torch.arange(tokens, device="cuda"), config.head_dim, config.rope_theta, torch.bfloat16)
    heads = torch.randn(4, config.num_attention_heads, tokens, config.head_dim, device="cuda").bfloat16()
    mlp = layer.mlp
    with torch.no_grad():
        handed = FUSED_OPS.modulated_norm(layer.mlp_norm, x, None, None, (mlp.gate_proj, mlp.up_proj))
        eager = both_halves(eager_layer, EAGER_OPS, x, modulation, rope, heads)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiled:
            fused = both_halves(layer, FUSED_OPS, x, modulation, rope, heads)
    assert isinstance(handed, Fp8Rows)
    kernels = {event.key for event in profiled.key_averages()}
    assert {"_add_norm_modulate", "_quantize_rows", "_norm_rope_columns"} <= kernels, kernels
    for name, a, b in zip(HALVES, fused, eager):
        error = _relative(a, b.float())
        assert error < 2e-2, f"{name} at {tokens} tokens: relative error {error:.2e}"


@hopper
def test_the_fused_ops_fake_kernels_give_the_kernels_shapes_and_strides():
    check_fused_op_fakes("cuda")


@hopper
@pytest.mark.parametrize("forced", [True, False])
@pytest.mark.parametrize("tokens", [750, 251])
def test_a_dit_layer_through_the_fused_ops_equals_the_eager_layer(tokens, forced):
    """Both halves of a turbo-2b layer (random weights), 4 rows with their own modulation; with the GEMM kernels
    (SwiGLU, gated residual, q/k/v with norms and RoPE) forced on, the norm kernels after them, and off (cuBLAS,
    then the one-pass residual, norm and modulation)."""
    from flowjam.engine.kernels.fused_ops import FUSED_OPS
    from flowjam.engine.kernels.ops import forced_path, pair_mlp, stack_qkv

    config = get_preset("turbo-2b").dit
    torch.manual_seed(0)
    layer = DiTLayer(config, 0).cuda().bfloat16().eval()
    assert pair_mlp(layer.mlp), "the MLP weights were not paired"
    assert stack_qkv(layer.self_attn), "the q/k/v weights were not stacked"
    x = torch.randn(4, tokens, HIDDEN, device="cuda").bfloat16()
    modulation = (torch.randn(4, 6, HIDDEN, device="cuda") * 0.1).bfloat16()
    rope = rope_cos_sin(torch.arange(tokens, device="cuda"), config.head_dim, config.rope_theta, torch.bfloat16)
    heads = torch.randn(4, config.num_attention_heads, tokens, config.head_dim, device="cuda").bfloat16()
    with torch.no_grad():
        eager = both_halves(layer, EAGER_OPS, x, modulation, rope, heads)
        with forced_path(fused=forced):
            fused = both_halves(layer, FUSED_OPS, x, modulation, rope, heads)
    for name, a, b in zip(HALVES, fused, eager):
        error = _relative(a, b.float())
        assert error < 1e-2, f"{name} at {tokens} tokens: relative error {error:.2e}"


@hopper
def test_compile_graph_ticks_take_the_fused_kernels_replay_without_syncs_and_match_eager():
    from flowjam.engine.kernels import ops
    from flowjam.engine.session import Session

    session = Session.load(preset="tiny", device="cuda", dtype=torch.bfloat16)
    a = session.encode_text("fused kernels")
    null = session.null_conditioning(a)
    _, eager = stream_latents(session, "eager", a, null)
    with ops.forced_path(fused=True):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiled:
            pipeline, fused = stream_latents(session, "compile-graph", a, null)
        kernels = {event.key for event in profiled.key_averages()}
        for kernel in ("_swiglu_gemm", "_add_norm_modulate", "_qkv_norm_rope_gemm"):
            assert any(kernel in name for name in kernels), f"the compiled layers did not run {kernel}"
        assert pipeline.stats()["graphs"]["replays"] > 0
        assert_close_latents(fused, eager)
        request = session.make_request(a, 10.0, seed=99, cfg_mode="full", negative=null, guidance=2.0)
        assert_a_tick_replays_without_host_sync(pipeline, request)

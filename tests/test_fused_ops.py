"""The fused layer ops where the kernels do not run (the CPU, which CI has): they are the eager layer's math to the
bit, pairing the MLP weights changes nothing a forward computes, and only compile-graph on a capable GPU fuses.
The kernels themselves are checked on the GPU (tests/test_fused_kernels_gpu.py)."""

import contextlib
from types import SimpleNamespace

import pytest
import torch
from flowjam.engine.kernels.fused_ops import FUSED_OPS
from flowjam.engine.kernels.ops import forced_path, pair_mlp_weights, paired
from flowjam.engine.models.dit import EAGER_OPS, DiTDecoder
from flowjam.engine.models.layers import rope_cos_sin
from flowjam.engine.models.presets import get_preset
from flowjam.engine.stream.backends import decoder_forward
from helpers import HALVES, both_halves, check_fused_op_fakes


def _decoder() -> DiTDecoder:
    """The tiny DiT with every norm weight made distinct (they start at one), so a swapped weight shows."""
    torch.manual_seed(0)
    decoder = DiTDecoder(get_preset("tiny").dit).eval()
    with torch.no_grad():
        for name, parameter in decoder.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    return decoder


@pytest.mark.parametrize("forced", [False, True])
def test_fused_ops_equal_the_eager_layer_bit_for_bit_where_the_kernels_do_not_run(forced):
    """As measured (nothing fused on the CPU) and forced through the custom ops (their CPU implementation)."""
    decoder = _decoder()
    config = decoder.config
    layer = decoder.layers[0]
    tokens = 37
    x = torch.randn(3, tokens, config.hidden_size)
    modulation = torch.randn(3, 6, config.hidden_size) * 0.1
    rope = rope_cos_sin(torch.arange(tokens), config.head_dim, config.rope_theta, torch.float32)
    heads = torch.randn(3, config.num_attention_heads, tokens, config.head_dim)
    with torch.no_grad():
        eager = both_halves(layer, EAGER_OPS, x, modulation, rope, heads)
        with forced_path(True) if forced else contextlib.nullcontext():
            fused = both_halves(layer, FUSED_OPS, x, modulation, rope, heads)
    for name, a, b in zip(HALVES, fused, eager):
        assert torch.equal(a, b), f"{name}: the fused ops' fallback differs from the eager layer"
    assert not torch.equal(eager[0], x), "the pending MLP output was not added"
    assert not torch.equal(eager[4], x), "the layer did not move x"


def _moving_keeps_the_velocity(decoder: DiTDecoder, move, what: str) -> int:
    """`move(decoder)` (weights into a fused layout) between two forwards of two rows: the velocity is unchanged and
    the structure version bumped once (captured tick graphs would read the old weight addresses); -> the version."""
    x, t = torch.randn(2, 50, 64), torch.tensor([0.9, 0.4])
    inputs = (
        x,
        t,
        torch.randn(2, 50, decoder.config.in_channels - 64),
        torch.randn(1, 9, decoder.config.condition_width),
    )
    with torch.no_grad():
        before = decoder(*inputs)
        version = decoder.structure_version
        assert move(decoder) == len(decoder.layers)
        after = decoder(*inputs)
    assert torch.equal(before, after), f"{what} changed the velocity"
    assert decoder.structure_version == version + 1, "captured tick graphs would read the old weight addresses"
    return version + 1


def test_pairing_the_mlp_weights_keeps_every_output_and_renews_tick_graphs():
    decoder = _decoder()
    version = _moving_keeps_the_velocity(decoder, pair_mlp_weights, "pairing the MLP weights")
    for layer in decoder.layers:
        pair = paired(layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight)
        assert pair is not None and torch.equal(pair[1], layer.mlp.up_proj.weight)
    assert pair_mlp_weights(decoder) == 0 and decoder.structure_version == version, "pairing twice moved them"


def test_stacking_the_qkv_weights_keeps_every_output_and_the_fused_self_attention_equals_the_eager_one():
    """The q, k and v weights as rows of one tensor (what the q/k/v kernel reads): the velocity is unchanged, tick
    graphs renew, and the self-attention through the fused op (its CPU implementation) is the eager one to the bit."""
    from flowjam.engine.kernels.ops import stack_qkv_weights
    from flowjam.engine.models.layers import stacked_rows

    decoder = _decoder()
    version = _moving_keeps_the_velocity(decoder, stack_qkv_weights, "stacking the q/k/v weights")
    attn, config = decoder.layers[0].self_attn, decoder.config
    rows = stacked_rows(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
    assert rows is not None and torch.equal(rows[-attn.v_proj.weight.shape[0] :], attn.v_proj.weight)
    assert stack_qkv_weights(decoder) == 0 and decoder.structure_version == version, "stacking twice moved them"
    h = torch.randn(3, 21, config.hidden_size)
    rope = rope_cos_sin(torch.arange(21), config.head_dim, config.rope_theta, torch.float32)
    with torch.no_grad(), forced_path(True):
        fused = FUSED_OPS.self_attention(attn, h, rope, None)
    assert torch.equal(fused, EAGER_OPS.self_attention(attn, h, rope, None))


def test_compile_graph_on_the_cpu_leaves_the_weights_and_the_layer_path_as_they_were():
    decoder = _decoder()
    decoder_forward(decoder, "compile-graph")
    layer = decoder.layers[0]
    assert paired(layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight) is None
    assert decoder.structure_version == 0


@pytest.mark.parametrize("forced", [False, True])
def test_fp8_layers_through_the_fused_ops_read_their_input_quantised_by_the_norm_and_equal_the_eager_layer(forced):
    """The norm before FP8 projections hands them e4m3 rows and scales, as the SwiGLU does its activations to the
    down projection, and the q/k/v weights stacked with their scales run as one op (kernels on the GPU; here the ops'
    CPU implementation): the same numbers the FP8 linears make of a bf16 input, so the layer is the eager one."""
    from flowjam.engine.kernels.ops import stack_qkv
    from flowjam.engine.lora.unmerged import LoraLinear
    from flowjam.engine.models.fp8 import Fp8Rows, stacked_fp8, to_fp8

    decoder = _decoder()
    to_fp8(decoder)
    layer, config = decoder.layers[0], decoder.config
    assert stack_qkv(layer.self_attn) and not stack_qkv(layer.self_attn)  # q/k/v in one e4m3 tensor, scales too
    attn = layer.self_attn
    assert (
        stacked_fp8(
            (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight),
            (attn.q_proj.weight_scale, attn.k_proj.weight_scale, attn.v_proj.weight_scale),
        )
        is not None
    )
    tokens = 24
    x = torch.randn(2, tokens, config.hidden_size)
    modulation = torch.randn(2, 6, config.hidden_size) * 0.1
    rope = rope_cos_sin(torch.arange(tokens), config.head_dim, config.rope_theta, torch.float32)
    heads = torch.randn(2, config.num_attention_heads, tokens, config.head_dim)
    with torch.no_grad():
        eager = both_halves(layer, EAGER_OPS, x, modulation, rope, heads)
        with forced_path(True) if forced else contextlib.nullcontext():
            fused = both_halves(layer, FUSED_OPS, x, modulation, rope, heads)
        mlp, scale, shift = layer.mlp, modulation[:, None, 3], modulation[:, None, 4]
        handed = FUSED_OPS.modulated_norm(layer.mlp_norm, x, scale, shift, (mlp.gate_proj, mlp.up_proj))
        lora = LoraLinear(mlp.up_proj, SimpleNamespace(strengths=torch.ones(4), row_strengths=None))
        kept = FUSED_OPS.modulated_norm(layer.mlp_norm, x, scale, shift, (mlp.gate_proj, lora))
        activations = FUSED_OPS.swiglu(mlp, handed)
        down, eager_down = mlp.down_proj(activations), mlp.down_proj(EAGER_OPS.swiglu(mlp, handed))
    for name, a, b in zip(HALVES, fused, eager):
        assert torch.equal(a, b), f"{name}: the FP8 layer through the fused ops differs from the eager one"
    assert isinstance(handed, Fp8Rows) and handed.values.dtype == torch.float8_e4m3fn
    assert handed.values.shape == (2 * tokens, config.hidden_size) and handed.shape == tuple(x.shape)
    assert torch.equal(mlp.up_proj(handed), mlp.up_proj(EAGER_OPS.modulated_norm(layer.mlp_norm, x, scale, shift)))
    assert isinstance(kept, torch.Tensor), "a LoRA-wrapped projection reads the bf16 input, not quantised rows"
    assert isinstance(activations, Fp8Rows) and torch.equal(down, eager_down)


def test_the_fused_ops_fake_kernels_give_their_outputs_shapes_and_strides():
    check_fused_op_fakes("cpu")

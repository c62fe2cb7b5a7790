"""DiT decoder: official key set at full size, shapes, the ±128-token sliding window, batching rows at different t."""

from dataclasses import replace

import pytest
import torch
from flowjam.engine.conditioning import Conditioning
from flowjam.engine.models.acestep import AceStepModel
from flowjam.engine.models.dit import DiTDecoder
from flowjam.engine.models.layers import band_mask
from flowjam.engine.models.presets import TINY, TURBO_2B, XL
from spec_keys import official_keys


@pytest.mark.parametrize(
    "config, count, params", [(TURBO_2B, 677, 2_393_872_518), (XL, 829, 4_987_310_726)], ids=["turbo-2b", "xl"]
)
def test_full_configs_have_exactly_the_official_keys_and_shapes(config, count, params):
    with torch.device("meta"):
        model = AceStepModel(config)
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    expected = official_keys(config)
    assert len(expected) == count
    assert ours.keys() == expected.keys(), sorted(ours.keys() ^ expected.keys())[:10]
    wrong = {k: (ours[k], expected[k]) for k in ours if ours[k] != expected[k]}
    assert not wrong, wrong
    assert sum(p.numel() for p in model.parameters()) == params


def test_full_size_state_dict_loads_strictly_without_memory():
    with torch.device("meta"):
        model = AceStepModel(TURBO_2B)
        state = {k: torch.empty(shape) for k, shape in official_keys(TURBO_2B).items()}
    model.load_state_dict(state, strict=True, assign=True)


def tiny_inputs(batch: int, frames: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, frames, 64, generator=g)
    context = torch.cat([torch.randn(batch, frames, 64, generator=g), torch.ones(batch, frames, 64)], dim=-1)
    cond = torch.randn(batch, 7, TINY.condition_width, generator=g)
    return x, context, cond


@pytest.mark.parametrize("frames", [1, 2, 37, 40, 251])
def test_forward_shapes_for_odd_and_even_lengths(frames):
    torch.manual_seed(0)
    dit = DiTDecoder(TINY).eval()
    x, context, cond = tiny_inputs(2, frames)
    with torch.no_grad():
        v = dit(x, torch.tensor([1.0, 0.3]), context, encoder_hidden_states=cond)
    assert v.shape == (2, frames, 64)
    assert torch.isfinite(v).all()


def test_sliding_mask_is_plus_minus_128_tokens():
    mask = band_mask(400, 128, "cpu")
    assert mask[200, 72] and mask[200, 328] and not mask[200, 71] and not mask[200, 329]
    assert mask.sum(dim=1)[200] == 257


def test_sliding_layer_sees_exactly_128_tokens_each_side():
    """A one-layer (sliding) DiT: a token 129 tokens away cannot change the output, one 128 away does."""
    torch.manual_seed(0)
    config = replace(TINY, num_hidden_layers=1, sliding_window=128)
    dit = DiTDecoder(config).eval()
    x, context, cond = tiny_inputs(1, 1200)
    poked = x.clone()
    poked[:, 2 * 300] += 5.0  # latent frame 600 = token 300
    with torch.no_grad():
        base = dit(x, torch.tensor([0.7]), context, encoder_hidden_states=cond)
        moved = dit(poked, torch.tensor([0.7]), context, encoder_hidden_states=cond)
    changed_tokens = ((base - moved).abs().amax(dim=-1)[0].reshape(600, 2).amax(dim=-1) > 0).nonzero().flatten()
    assert changed_tokens.min() == 300 - 128 and changed_tokens.max() == 300 + 128


def test_rows_at_different_t_batch_like_single_rows():
    torch.manual_seed(0)
    dit = DiTDecoder(TINY).eval()
    x, context, cond = tiny_inputs(3, 41)
    t = torch.tensor([1.0, 0.642857, 0.3])
    with torch.no_grad():
        batched = dit(x, t, context, encoder_hidden_states=cond)
        single = torch.cat(
            [
                dit(x[i : i + 1], t[i : i + 1], context[i : i + 1], encoder_hidden_states=cond[i : i + 1])
                for i in range(3)
            ]
        )
    torch.testing.assert_close(batched, single, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(batched[0], batched[1])


def test_prebuilt_cross_kv_equals_passing_the_condition():
    torch.manual_seed(0)
    dit = DiTDecoder(TINY).eval()
    x, context, cond = tiny_inputs(2, 20)
    t = torch.tensor([0.9, 0.5])
    with torch.no_grad():
        direct = dit(x, t, context, encoder_hidden_states=cond)
        cached = dit(x, t, context, cross_kv=dit.build_cross_kv(cond))
    torch.testing.assert_close(direct, cached, atol=0, rtol=0)


def test_a_condition_rebuilds_its_cross_kv_for_a_new_decoder_at_a_freed_decoders_address():
    """CPython often gives a new decoder the address (the `id`) of one just freed: its K/V must still be its own."""
    condition = Conditioning(tiny_inputs(1, 10)[2])
    torch.manual_seed(0)  # once: every decoder below draws its own weights from the one stream
    same_address = 0
    for attempt in range(20):
        old = DiTDecoder(TINY).eval()
        condition.cross_kv(old)
        freed_address = id(old)
        del old  # no reference cycle: freed here, and nothing allocated before the next decoder
        new = DiTDecoder(TINY).eval()
        same_address += id(new) == freed_address
        got = condition.cross_kv(new)
        with torch.no_grad():
            expected = new.build_cross_kv(condition.encoder_hidden_states)
        for layer, (k, v, k_new, v_new) in enumerate(
            zip(got.keys, got.values, expected.keys, expected.values, strict=True)
        ):
            assert torch.equal(k, k_new) and torch.equal(v, v_new), (
                f"attempt {attempt}, layer {layer}: K/V of the freed decoder"
            )
    assert same_address, "setup: no new decoder took a freed decoder's address, so the collision was not exercised"


def test_folded_time_embed_r_equals_explicit_r_equal_t():
    torch.manual_seed(0)
    dit = DiTDecoder(TINY).eval()
    x, context, cond = tiny_inputs(2, 10)
    t = torch.tensor([0.9, 0.5])
    with torch.no_grad():
        folded = dit(x, t, context, encoder_hidden_states=cond)
        explicit = dit(x, t, context, encoder_hidden_states=cond, timestep_r=t)
        dit.load_state_dict({k: v * 1.01 for k, v in dit.state_dict().items()})
        after_reload = dit(x, t, context, encoder_hidden_states=cond)
        explicit_reload = dit(x, t, context, encoder_hidden_states=cond, timestep_r=t)
    torch.testing.assert_close(folded, explicit, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(after_reload, explicit_reload, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("counts", [(3, 3), (2, 2, 2), (3, 1)])
def test_each_row_of_a_condition_group_cross_attends_bit_for_bit_as_it_would_alone(counts):
    """Groups of equal row counts attend as one folded sequence each (one call, K/V stacked once per condition),
    unequal ones with K/V stacked per row: either way every row's heads equal that row attending alone."""
    from flowjam.engine.models.dit import _foldable, _group_attention
    from flowjam.engine.models.layers import Attention

    torch.manual_seed(0)
    attn = Attention(64, 4, 2, 16, 1e-6)
    rows, tokens = sum(counts), 9
    q = torch.randn(rows, tokens, 4, 16).transpose(1, 2)  # token-major, as the layer makes its queries
    kvs = [(torch.randn(1, 2, 7, 16), torch.randn(1, 2, 7, 16)) for _ in counts]
    starts = [sum(counts[:g]) for g in range(len(counts))]
    cross = tuple((k, v, start, count) for (k, v), start, count in zip(kvs, starts, counts))
    heads = _group_attention(attn, q, cross)
    assert _foldable(q, cross) == (len(set(counts)) == 1)
    for (k, v), start, count in zip(kvs, starts, counts):
        for row in range(start, start + count):
            assert torch.equal(heads[row : row + 1], attn.heads_attention(q[row : row + 1], k, v, None))

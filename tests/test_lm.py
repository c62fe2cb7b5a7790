"""Our 5 Hz LM (Qwen3ForCausalLM, tied) equals transformers' with identical random weights; cache, code head, shapes."""

import pytest
import torch
from flowjam.engine.models.lm import AUDIO_CODE_BASE, LM_PRESETS, NUM_CODES, Qwen3LM
from qwen_reference import greedy, hf_qwen3_config, random_state
from transformers import Qwen3ForCausalLM

TINY = LM_PRESETS["tiny"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def reference_model(config) -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM(hf_qwen3_config(config, tie_word_embeddings=True)).eval()


def pair(seed: int):
    """(ours, transformers') holding the same seeded state dict."""
    ours = Qwen3LM(TINY).eval()
    state = random_state(ours, seed)
    ours.load_state_dict(state, strict=True)
    reference = reference_model(TINY)
    missing, unexpected = reference.load_state_dict(state, strict=False)
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}
    assert reference.lm_head.weight.data_ptr() == reference.model.embed_tokens.weight.data_ptr()  # tied
    return ours, reference


def prompt(seed: int, batch: int, length: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + seed)
    return torch.randint(0, TINY.vocab_size, (batch, length), generator=g)


def test_state_dict_keys_are_the_checkpoint_names():
    keys = set(Qwen3LM(TINY).state_dict())
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in range(TINY.num_hidden_layers):
        p = f"model.layers.{i}."
        expected |= {
            p + n + ".weight"
            for n in (
                "input_layernorm",
                "post_attention_layernorm",
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.o_proj",
                "self_attn.q_norm",
                "self_attn.k_norm",
                "mlp.gate_proj",
                "mlp.up_proj",
                "mlp.down_proj",
            )
        }
    assert keys == expected
    assert set(reference_model(TINY).state_dict()) - keys <= {"lm_head.weight"}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_prefill_and_forward_logits_match_transformers(seed):
    ours, reference = pair(seed)
    ids = prompt(seed, 3, 17)
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        all_logits = ours(ids)
        ours.setup_cache(3, 32)
        last = ours.prefill(ids)
    assert last.shape == (3, TINY.vocab_size)
    torch.testing.assert_close(all_logits, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(last, expected[:, -1], atol=1e-5, rtol=1e-5)


def test_chunked_prefill_and_decode_steps_match_one_pass():
    """Prefill at start > 0 and per-row decode positions reproduce the one-pass logits."""
    ours, reference = pair(3)
    ids = prompt(3, 2, 20)
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        ours.setup_cache(2, 24)
        ours.prefill(ids[:, :8])
        chunk = ours.prefill(ids[:, 8:15], start=8)
        torch.testing.assert_close(chunk, expected[:, 14], atol=1e-5, rtol=1e-5)
        for pos in range(15, 20):
            step = ours.decode_step(ids[:, pos], torch.tensor([pos, pos]))
            torch.testing.assert_close(step, expected[:, pos], atol=1e-5, rtol=1e-5)


def test_decode_rows_at_different_positions():
    """Row 0 one token behind row 1: each row sees only its own cache prefix."""
    ours, reference = pair(4)
    ids = prompt(4, 2, 12)
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        ours.setup_cache(2, 16)
        ours.prefill(ids[:, :10])
        step = ours.decode_step(torch.stack([ids[0, 9], ids[1, 10]]), torch.tensor([9, 10]))
    torch.testing.assert_close(step[0], expected[0, 9], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step[1], expected[1, 10], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_equals_transformers_generate(seed, batch):
    ours, reference = pair(seed)
    ids = prompt(seed, batch, 9)
    new = 12
    with torch.no_grad():
        expected = reference.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new,
            min_new_tokens=new,
            eos_token_id=None,
            pad_token_id=0,
        )[:, ids.shape[1] :]
    got = greedy(ours, ids, new)
    assert got.shape == (batch, new)
    assert torch.equal(got, expected), (got, expected)
    assert len(set(got.flatten().tolist())) > 1  # not a degenerate constant sequence


def test_code_logits_are_the_code_rows_of_the_full_vocabulary():
    ours, _ = pair(5)
    assert (AUDIO_CODE_BASE, NUM_CODES) == (151_669, 64_000)  # spec §5.2, not our own constants
    hidden = torch.randn(3, TINY.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = ours.logits(hidden)
        codes = ours.code_logits(hidden)
    assert codes.shape == (3, NUM_CODES)
    for index, vocab_id in ((0, 151_669), (NUM_CODES - 1, 215_668)):  # code 0, code 63,999
        torch.testing.assert_close(codes[:, index], full[:, vocab_id], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(codes, full[:, AUDIO_CODE_BASE : AUDIO_CODE_BASE + NUM_CODES], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    "name, params",
    [("lm-0.6b", 662_884_352), ("lm-1.7b", 1_854_243_840), ("lm-4b", 4_189_554_176), ("tiny", 6_969_152)],
)
def test_presets_have_the_spec_parameter_counts(name, params):
    with torch.device("meta"):
        model = Qwen3LM(LM_PRESETS[name])
    assert sum(p.numel() for p in model.parameters()) == params  # tied: embedding counted once
    config = LM_PRESETS[name]
    assert config.vocab_size == 217_204 and config.max_position_embeddings == 40_960 and config.rope_theta == 1e6
    assert len(model.state_dict()) == 11 * config.num_hidden_layers + 2


def test_fused_decode_weights_keep_the_checkpoint_tensors_and_follow_a_dtype_change():
    ours, reference = pair(6)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    ids = prompt(6, 2, 10)
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
        ours.setup_cache(2, 12)
        ours.prefill(ids[:, :9])
        torch.testing.assert_close(
            ours.decode_step(ids[:, 9], torch.tensor([9, 9])), expected[:, 9], atol=1e-5, rtol=1e-5
        )
        after = ours.state_dict()
        assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
        ours.to(torch.float64)  # replaces every parameter: the fused tensors must be rebuilt from the new ones
        ours.setup_cache(2, 12)
        ours.prefill(ids[:, :9])
        step = ours.decode_step(ids[:, 9], torch.tensor([9, 9]))
    assert step.dtype == torch.float64
    torch.testing.assert_close(step.float(), expected[:, 9], atol=1e-5, rtol=1e-5)

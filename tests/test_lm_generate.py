"""Batched audio-code generation: CFG on code logits, sampling, exact lengths, compaction, against transformers."""

import dataclasses

import pytest
import torch
from flowjam.engine.lm.generate import CodeGenerator, CodeRequest
from flowjam.engine.lm.sampling import SamplingParams, cfg_logits, sample, uniforms
from flowjam.engine.models.lm import AUDIO_CODE_BASE, LM_PRESETS, NUM_CODES, Qwen3LM, compiled_layer_step
from qwen_reference import EOS_ID, greedy, hf_qwen3_config, random_state
from transformers import Qwen3ForCausalLM

TINY = LM_PRESETS["tiny"]
SAMPLED = SamplingParams(temperature=0.85, top_k=0, top_p=0.9, cfg=2.0)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def models():
    """(ours, transformers') with the same seeded weights."""
    ours = Qwen3LM(TINY).eval()
    state = random_state(ours, 11)
    ours.load_state_dict(state)
    reference = Qwen3ForCausalLM(hf_qwen3_config(TINY, tie_word_embeddings=True)).eval()
    reference.load_state_dict(state, strict=False)
    return ours, reference


def ids(start: int, length: int) -> tuple[int, ...]:
    return tuple(range(start, start + length))


def reference_codes(reference, request: CodeRequest, params: SamplingParams) -> list[int]:
    """Independent path: transformers over the whole sequence each step (no cache), CFG on the full vocabulary,
    then restricted to the code tokens; the same sampling function draws the token."""
    cond, uncond, codes = list(request.prompt_ids), list(request.uncond_ids), []
    with torch.no_grad():
        for step in range(request.num_codes):
            full = reference(input_ids=torch.tensor([cond])).logits[:, -1].float()
            if params.guided:
                unguided = reference(input_ids=torch.tensor([uncond])).logits[:, -1].float()
                full = unguided + params.cfg * (full - unguided)  # written out: the check must not share cfg_logits
            logits = full[:, AUDIO_CODE_BASE : AUDIO_CODE_BASE + NUM_CODES]
            code = sample(logits, params, torch.tensor([request.seed]), torch.tensor([step])).item()
            codes.append(code)
            cond.append(AUDIO_CODE_BASE + code)
            uncond.append(AUDIO_CODE_BASE + code)
    return codes


MIXED_REQUESTS = [  # shared and distinct prompts, cond/uncond of different lengths, lengths that end at different steps
    CodeRequest(ids(100, 14), num_codes=4, seed=1, uncond_ids=ids(100, 9)),
    CodeRequest(ids(100, 14), num_codes=9, seed=2, uncond_ids=ids(100, 9)),
    CodeRequest(ids(500, 6), num_codes=7, seed=3, uncond_ids=ids(100, 9)),
]


@pytest.mark.parametrize("cfg", [1.0, 2.0, 3.5])
def test_greedy_codes_equal_transformers_with_cfg_on_the_full_vocabulary(models, cfg):
    ours, reference = models
    params = SamplingParams(temperature=0.0, cfg=cfg)
    got = CodeGenerator(ours, params).generate(MIXED_REQUESTS)
    for request, codes in zip(MIXED_REQUESTS, got):
        assert codes.tolist() == reference_codes(reference, request, params)
    assert len({c for codes in got for c in codes.tolist()}) > 3, "degenerate model: every step picks one code"


def test_sampled_codes_equal_transformers_with_top_k_and_top_p(models):
    ours, reference = models
    params = SamplingParams(temperature=1.3, top_k=50, top_p=0.95, cfg=2.0)
    got = CodeGenerator(ours, params).generate(MIXED_REQUESTS)
    for request, codes in zip(MIXED_REQUESTS, got):
        assert codes.tolist() == reference_codes(reference, request, params)


def test_sequences_leaving_the_batch_give_the_same_codes_as_each_run_alone(models):
    ours, _ = models
    requests = [
        CodeRequest(ids(100, 14), num_codes=length, seed=seed, uncond_ids=ids(100, 9))
        for seed, length in ((5, 3), (6, 11), (7, 6), (8, 11), (9, 1))
    ]
    generator = CodeGenerator(ours, SAMPLED)
    together = generator.generate(requests)
    assert [c.tolist() for c in generator.generate(requests)] == [c.tolist() for c in together], (
        "reused buffers changed the codes"
    )
    for request, codes in zip(requests, together):
        alone = CodeGenerator(ours, SAMPLED).generate([request])[0]
        assert torch.equal(codes, alone), f"seed {request.seed}: {codes.tolist()} != alone {alone.tolist()}"
    assert together[1].tolist() != together[3].tolist(), "same prompt, other seed: the codes should differ"


def test_lengths_are_exact_and_codes_valid_even_when_eos_and_unused_slots_dominate():
    """Make EOS and the 1,535 unused code slots the model's favourites: we still get exactly N codes in 0..63,999."""
    lm = Qwen3LM(TINY).eval()
    lm.load_state_dict(random_state(lm, 3))
    with torch.no_grad():
        hidden_direction = torch.randn(TINY.hidden_size, generator=torch.Generator().manual_seed(0))
        lm.model.norm.weight.fill_(1.0)
        lm.model.embed_tokens.weight[EOS_ID] = 50 * hidden_direction
        lm.model.embed_tokens.weight[AUDIO_CODE_BASE + NUM_CODES :] = 50 * hidden_direction
    with torch.no_grad():
        free_choice = greedy(lm, torch.tensor([ids(300, 8)]), 20)[0]
    unwanted = (free_choice == EOS_ID) | (free_choice >= AUDIO_CODE_BASE + NUM_CODES)
    assert unwanted.float().mean() > 0.8, "setup: unconstrained greedy decoding should mostly pick EOS or unused slots"
    requests = [CodeRequest(ids(300, 8), num_codes=n, seed=n, uncond_ids=ids(300, 5)) for n in (1, 17, 50)]
    for params in (SAMPLED, SamplingParams(temperature=0.0, cfg=1.0)):
        got = CodeGenerator(lm, params).generate(requests)
        assert [len(codes) for codes in got] == [1, 17, 50]
        for codes in got:
            assert codes.dtype == torch.int64 and 0 <= codes.min() and codes.max() < NUM_CODES


def test_cfg_on_code_logits_equals_cfg_on_full_logits_restricted_to_the_codes(models):
    ours, _ = models
    g = torch.Generator().manual_seed(4)
    cond, uncond = torch.randn(2, 5, TINY.hidden_size, generator=g)
    with torch.no_grad():
        on_codes = cfg_logits(ours.code_logits(cond), ours.code_logits(uncond), 2.5)
        full_cond, full_uncond = ours.logits(cond), ours.logits(uncond)
        full = full_uncond + 2.5 * (full_cond - full_uncond)
    torch.testing.assert_close(on_codes, full[:, AUDIO_CODE_BASE : AUDIO_CODE_BASE + NUM_CODES], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, top_k=1, top_p=1.0),
        SamplingParams(temperature=1.5, top_k=0, top_p=1e-6),
        SamplingParams(temperature=0.0, top_k=0, top_p=1.0),
    ],
)
def test_top_k_one_and_vanishing_top_p_are_argmax(params):
    logits = torch.randn(64, 3000, generator=torch.Generator().manual_seed(1))
    logits[:8, 7] = logits[:8, 1900] = 40.0  # ties: argmax takes the lower index
    got = sample(logits, params, torch.arange(64), torch.full((64,), 3))
    assert torch.equal(got, logits.argmax(dim=-1))


def expected_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Written out independently: softmax(l/T), keep the k largest, then the smallest prefix with mass >= p."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = probs.argsort(descending=True)
    kept, mass = [], 0.0
    for index in order.tolist()[: top_k or None]:
        if mass >= top_p:
            break
        kept.append(index)
        mass += probs[index].item()
    out = torch.zeros_like(probs)
    out[kept] = probs[kept] / probs[kept].sum()
    return out


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 0.8), (1.3, 5, 1.0), (0.9, 6, 0.7)])
def test_sampling_frequencies_follow_the_filtered_softmax(temperature, top_k, top_p):
    draws = 200_000
    logits = torch.randn(12, generator=torch.Generator().manual_seed(top_k + 7))
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    tokens = sample(logits.expand(draws, -1), params, torch.full((draws,), 42), torch.arange(draws))
    frequencies = torch.bincount(tokens, minlength=12).double() / draws
    expected = expected_distribution(logits, temperature, top_k, top_p)
    assert (frequencies[expected == 0] == 0).all(), "a filtered-out token was drawn"
    # 200k draws: one standard deviation is <= 0.0011, so 0.006 is more than 5 sigma
    assert (frequencies - expected).abs().max() < 0.006, (frequencies, expected)


def test_random_numbers_depend_only_on_seed_and_step():
    seeds = torch.tensor([0, 1, 2**40 + 1, 2**40 + 1])
    steps = torch.tensor([5, 5, 5, 6])
    u = uniforms(seeds, steps)
    assert ((0 < u) & (u < 1)).all() and len(set(u.tolist())) == 4
    assert torch.equal(uniforms(seeds[2:3], steps[2:3]), u[2:3])  # batch position does not matter
    many = uniforms(torch.full((100_000,), 9), torch.arange(100_000))
    assert abs(many.mean().item() - 0.5) < 0.005 and abs(many.var().item() - 1 / 12) < 0.002


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"cfg": 0.5}, "cfg must be >= 1"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
    ],
)
def test_bad_sampling_settings_are_refused(models, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("]", r"\]")):
        CodeGenerator(models[0], SamplingParams(**kwargs))


@pytest.mark.parametrize(
    "request_, message",
    [
        (CodeRequest((), num_codes=5, uncond_ids=(1,)), "non-empty prompt"),
        (CodeRequest((1, 2), num_codes=0, uncond_ids=(1,)), "num_codes must be >= 1"),
        (CodeRequest((1, 2), num_codes=5), "unconditional prompt"),
    ],
)
def test_bad_requests_are_refused(models, request_, message):
    with pytest.raises(ValueError, match=message):
        CodeGenerator(models[0], SAMPLED).generate([request_])


def test_new_sampling_settings_apply_to_the_next_call(models):
    ours, _ = models
    generator = CodeGenerator(ours, SAMPLED)
    generator.generate(MIXED_REQUESTS)
    greedy_unguided = SamplingParams(temperature=0.0, cfg=1.0)
    generator.set_sampling(greedy_unguided)
    got = generator.generate(MIXED_REQUESTS)
    expected = CodeGenerator(ours, greedy_unguided).generate(MIXED_REQUESTS)
    assert [c.tolist() for c in got] == [c.tolist() for c in expected]
    with pytest.raises(ValueError, match="cfg must be >= 1"):
        generator.set_sampling(SamplingParams(cfg=0.0))


def test_compiled_layer_step_compiles_once_per_shape_and_gives_the_eager_codes(models):
    """The first decode step stacks the q/k/v and gate/up weights; the next must reach the compiled step with the
    same tensors, else it recompiles, and on CUDA that second step is the graph capture, where compiling fails."""
    ours, _ = models
    fresh = Qwen3LM(TINY).eval()
    fresh.load_state_dict({k: v.clone() for k, v in ours.state_dict().items()})
    same_length = [CodeRequest(ids(100, 14), num_codes=6, seed=1, uncond_ids=ids(100, 9))] * 2
    expected = CodeGenerator(ours, SAMPLED).generate(same_length)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = CodeGenerator(fresh, SAMPLED, compile_layers=True).generate(same_length)
    assert [c.tolist() for c in got] == [c.tolist() for c in expected]


def test_compiled_step_reads_a_growing_key_range_without_compiling_again(models):
    """The keys read grow by KEY_BLOCK as the codes come, up to the last position written (here 128, then 134):
    the compiled step takes each range as it is (on CUDA a recompile there would cost seconds mid-generation) and
    still gives the eager codes."""
    ours, _ = models
    crossing = [CodeRequest(ids(100, 124), num_codes=10, seed=3, uncond_ids=ids(100, 60))]
    expected = CodeGenerator(ours, SAMPLED).generate(crossing)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = CodeGenerator(ours, SAMPLED, compile_layers=True).generate(crossing)
    assert [c.tolist() for c in got] == [c.tolist() for c in expected]


def test_one_compiled_step_serves_lms_of_different_head_counts():
    """A process that loads a second LM size reuses the compiled step, its head counts then symbolic: GQA must
    stay a constant (SDPA takes no symbolic bool), and each model's step must equal its eager one."""
    torch._dynamo.reset()
    step = compiled_layer_step()
    for config in (TINY, dataclasses.replace(TINY, num_attention_heads=2 * TINY.num_attention_heads)):
        lm = Qwen3LM(config).eval()
        lm.setup_cache(2, 32)
        with torch.no_grad():
            lm.prefill(torch.tensor([ids(100, 5), ids(200, 5)]))
            tokens, positions = torch.tensor([7, 9]), torch.tensor([5, 5])
            torch.testing.assert_close(
                lm.decode_hidden(tokens, positions, 16, step), lm.decode_hidden(tokens, positions, 16)
            )

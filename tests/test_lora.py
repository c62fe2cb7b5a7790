"""LoRAs on the DiT: parity with PEFT itself (unmerged, folded and merged, LoRA and rsLoRA, several strengths),
exact unmerge and unfold, every file format to the same effect, strength as a live knob in both live modes (next
tick, back bit for bit, no recompile), and bad files refused with the stream playing on."""

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from flowjam.engine.lora import LIVE_MODES, MAX_LORAS, LoraLinear, lora_set, merge, read_lora, unmerge
from flowjam.engine.lora.formats import PEFT_CONFIG, PEFT_WEIGHTS, check_lora_path
from flowjam.engine.params import lora_knob, parse_lora_option
from flowjam.engine.session import Session
from flowjam.engine.stream import StreamPipeline
from flowjam.live.knobs import KnobRegistry
from safetensors.torch import save_file
from test_checkpoints import bad_safetensors

peft = pytest.importorskip("peft", reason="peft is a test dependency (pip install -e .[test])")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FRAMES = 50


@pytest.fixture
def fresh_session():
    """A fresh tiny session per test: LoRAs change its decoder."""
    return Session.load(preset="tiny")


@pytest.fixture
def inputs(fresh_session):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, FRAMES, 64, generator=g)
    t = torch.tensor([0.9, 0.4])
    context = fresh_session.context_latents(FRAMES, None).expand(2, -1, -1)
    prompt = fresh_session.encode_text("lora test: bright plucked strings")
    return x, t, context, prompt.encoder_hidden_states


def forward(decoder, inputs):
    x, t, context, states = inputs
    with torch.no_grad():
        return decoder(x, t, context, encoder_hidden_states=states)


def peft_reference(decoder, rank=4, alpha=6, rslora=False, seed=1):
    """PEFT's own LoRA layers over a copy of our decoder, with random A and B (B is zero at PEFT's init)."""
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=TARGETS)
    reference = peft.inject_adapter_in_model(config, copy.deepcopy(decoder))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=g) * 0.05)
    return reference, config


def save_peft_folder(reference, config, folder):
    """What PeftModel.save_pretrained writes: the config and the adapter tensors under base_model.model."""
    folder.mkdir()
    state = peft.get_peft_model_state_dict(reference)
    save_file({f"base_model.model.{k}": v.contiguous() for k, v in state.items()}, str(folder / PEFT_WEIGHTS))
    (folder / PEFT_CONFIG).write_text(json.dumps(config.to_dict(), default=list))
    return state


def set_peft_strength(reference, strength, base_scaling):
    for module in reference.modules():
        if hasattr(module, "scaling") and "default" in getattr(module, "scaling", {}):
            module.scaling["default"] = base_scaling * strength


def module_paths(decoder):
    return {name for name, _ in decoder.named_modules()}


@pytest.mark.parametrize("rslora", [False, True], ids=["lora", "rslora"])
def test_unmerged_and_merged_equal_peft_at_several_strengths_and_unmerge_is_exact(
    fresh_session, inputs, tmp_path, rslora
):
    decoder = fresh_session.models.acestep.decoder
    reference, config = peft_reference(decoder, rank=4, alpha=6, rslora=rslora)
    save_peft_folder(reference, config, tmp_path / "style")
    adapter = read_lora(tmp_path / "style", module_paths(decoder))
    scale = 6 / (2.0 if rslora else 4)
    assert {d.scale for d in adapter.deltas.values()} == {scale}
    base = forward(decoder, inputs)
    original = {k: v.clone() for k, v in decoder.state_dict().items()}
    for strength in (1.0, 0.5, 1.7):
        set_peft_strength(reference, strength, scale)
        expected = forward(reference, inputs)
        assert not torch.allclose(expected, base, atol=1e-3), "the LoRA changes nothing: the test would prove nothing"
        attached = lora_set(decoder)
        attached.attach(adapter, strength)
        torch.testing.assert_close(forward(decoder, inputs), expected, rtol=1e-5, atol=1e-6)
        attached.detach(adapter.name)
        assert torch.equal(forward(decoder, inputs), base), "detaching did not restore the exact output"
        attached.attach(adapter, strength, mode="folded")
        torch.testing.assert_close(forward(decoder, inputs), expected, rtol=1e-4, atol=1e-5)
        attached.detach(adapter.name)
        assert all(torch.equal(original[k], v) for k, v in decoder.state_dict().items()), "unfolding is not exact"
        merged = merge(decoder, adapter, strength)
        torch.testing.assert_close(forward(decoder, inputs), expected, rtol=1e-4, atol=1e-5)
        unmerge(decoder, merged)
        assert all(torch.equal(original[k], v) for k, v in decoder.state_dict().items()), "unmerge is not exact"


def test_merge_then_unmerge_returns_the_exact_bf16_weights():
    session = Session.load(preset="tiny", dtype=torch.bfloat16)
    decoder = session.models.acestep.decoder
    reference, config = peft_reference(decoder.float(), rank=8, alpha=16)
    decoder.to(torch.bfloat16)
    state = peft.get_peft_model_state_dict(reference)
    path = "/tmp/flowjam-test-bf16-lora.safetensors"
    save_file({f"diffusion_model.{k}": v.contiguous() for k, v in state.items()}, path)
    adapter = read_lora(path, module_paths(decoder))
    original = {k: v.clone() for k, v in decoder.state_dict().items()}
    merged = merge(decoder, adapter, 1.3)
    changed = sum(not torch.equal(original[k], v) for k, v in decoder.state_dict().items())
    assert changed == len(adapter.deltas)
    unmerge(decoder, merged)
    assert all(torch.equal(original[k], v) for k, v in decoder.state_dict().items())


def low_rank_tensors(decoder, rank=3, seed=2):
    """Known down/up/alpha per targeted layer of the tiny decoder: {path: (down, up, alpha)}."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for path, module in decoder.named_modules():
        if isinstance(module, torch.nn.Linear) and path.rsplit(".", 1)[-1] in TARGETS and path.startswith("layers."):
            down = torch.randn(rank, module.in_features, generator=g) * 0.1
            up = torch.randn(module.out_features, rank, generator=g) * 0.1
            tensors[path] = (down, up, 5.0)
    return tensors


def expected_output(session, inputs, dense_deltas, strength):
    """The decoder with each weight + strength x its dense delta, built here by hand."""
    decoder = copy.deepcopy(session.models.acestep.decoder)
    with torch.no_grad():
        for path, delta in dense_deltas.items():
            decoder.get_submodule(path).weight += strength * delta
    return forward(decoder, inputs)


def write_formats(tensors, folder):
    """The same LoRA as a PEFT folder, a ComfyUI single file and a kohya (underscored) single file."""
    rank = next(iter(tensors.values()))[0].shape[0]
    peft_folder = folder / "peft"
    peft_folder.mkdir()
    save_file(
        {
            f"base_model.model.{path}.lora_{side}.weight": t.contiguous()
            for path, (down, up, _) in tensors.items()
            for side, t in (("A", down), ("B", up))
        },
        str(peft_folder / PEFT_WEIGHTS),
    )
    (peft_folder / PEFT_CONFIG).write_text(json.dumps({"r": rank, "lora_alpha": 5.0, "target_modules": TARGETS}))
    comfy = {}
    kohya = {}
    for path, (down, up, alpha) in tensors.items():
        comfy |= {
            f"diffusion_model.{path}.lora_A.weight": down,
            f"diffusion_model.{path}.lora_B.weight": up,
            f"diffusion_model.{path}.alpha": torch.tensor(alpha),
        }
        flat = "lora_unet_" + path.replace(".", "_")
        kohya |= {
            f"{flat}.lora_down.weight": down,
            f"{flat}.lora_up.weight": up,
            f"{flat}.alpha": torch.tensor(alpha),
        }
    save_file(comfy, str(folder / "comfy.safetensors"))
    save_file(kohya, str(folder / "kohya.safetensors"))
    return [peft_folder, folder / "comfy.safetensors", folder / "kohya.safetensors"]


def test_every_file_format_loads_to_the_same_effect(fresh_session, inputs, tmp_path):
    decoder = fresh_session.models.acestep.decoder
    tensors = low_rank_tensors(decoder)
    rank = 3
    dense = {path: (up @ down) * (alpha / rank) for path, (down, up, alpha) in tensors.items()}
    expected = expected_output(fresh_session, inputs, dense, 0.8)
    for path in write_formats(tensors, tmp_path):
        name = fresh_session.load_lora(path, strength=0.8, name="style")
        torch.testing.assert_close(forward(decoder, inputs), expected, rtol=1e-4, atol=1e-5, msg=str(path))
        fresh_session.unload_lora(name)


def test_lokr_file_applies_the_kronecker_delta_in_every_mode(fresh_session, inputs, tmp_path):
    decoder = fresh_session.models.acestep.decoder
    g = torch.Generator().manual_seed(3)
    tensors, dense = {}, {}
    for path in ("layers.0.self_attn.q_proj", "layers.1.mlp.down_proj"):
        out_features, in_features = decoder.get_submodule(path).weight.shape
        w1 = torch.randn(4, 8, generator=g) * 0.1  # full factor
        w2_a = torch.randn(out_features // 4, 2, generator=g) * 0.1  # low-rank factor, rank 2
        w2_b = torch.randn(2, in_features // 8, generator=g) * 0.1
        flat = "lycoris_" + path.replace(".", "_")
        tensors |= {f"{flat}.lokr_w1": w1, f"{flat}.lokr_w2_a": w2_a, f"{flat}.lokr_w2_b": w2_b}
        tensors[f"{flat}.alpha"] = torch.tensor(1.0)
        dense[path] = torch.kron(w1, w2_a @ w2_b) * (1.0 / 2)
    save_file(tensors, str(tmp_path / "lokr.safetensors"))
    expected = expected_output(fresh_session, inputs, dense, 1.5)
    for mode in ("live", "folded", "merged"):
        name = fresh_session.load_lora(tmp_path / "lokr.safetensors", strength=1.5, mode=mode)
        torch.testing.assert_close(forward(decoder, inputs), expected, rtol=1e-4, atol=1e-5)
        fresh_session.unload_lora(name)


def stream_latent(session, prompt, ticks=6, backend="eager"):
    pipeline = StreamPipeline(session.models.acestep.decoder, depth=2, backend=backend)
    finished = []
    for seed in range(ticks):
        pipeline.submit(session.make_request(prompt, 2.0, seed=seed, steps=4))
        finished += pipeline.tick()
    return torch.stack([f.latent for f in finished])


@pytest.mark.parametrize("mode", LIVE_MODES)
def test_strength_knob_changes_the_stream_and_returns_bit_for_bit_without_recompiling(fresh_session, tmp_path, mode):
    """The lora/<name> knob through the live runner's path: the next tick hears it; set back, the stream is the
    same to the bit; on compiled layers a strength change compiles nothing."""
    from torch._dynamo.utils import counters

    decoder = fresh_session.models.acestep.decoder
    reference, config = peft_reference(decoder, rank=4, alpha=8)
    save_peft_folder(reference, config, tmp_path / "style")
    prompt = fresh_session.encode_text("strength knob")
    name = fresh_session.load_lora(tmp_path / "style", mode=mode)
    assert fresh_session.loras[name][1] == mode
    registry = KnobRegistry()
    registry.add(lora_knob(name))
    assert registry.get(f"lora/{name}") == 1.0
    at_one = stream_latent(fresh_session, prompt)
    fresh_session.set_lora_strength(name, registry.set(f"lora/{name}", 0.3).value)
    at_low = stream_latent(fresh_session, prompt)
    assert (at_low - at_one).abs().max() > 1e-3, "the strength knob did not change the stream"
    fresh_session.set_lora_strength(name, registry.set(f"lora/{name}", 1.0).value)
    assert torch.equal(stream_latent(fresh_session, prompt), at_one), "strength back at 1 is not the same stream"
    stream_latent(fresh_session, prompt, backend="compile")
    compiled = counters["frames"]["ok"]
    fresh_session.set_lora_strength(name, 1.8)
    stream_latent(fresh_session, prompt, backend="compile")
    assert counters["frames"]["ok"] == compiled, "a strength change recompiled the layers"


@pytest.mark.parametrize("mode", LIVE_MODES)
def test_strength_on_cross_attention_kv_reaches_cached_conditions(fresh_session, tmp_path, mode):
    """K/V of a condition are cached; a LoRA on cross_attn.k_proj/v_proj changes them: a strength change rebuilds
    them for the next tick."""
    decoder = fresh_session.models.acestep.decoder
    tensors = {p: t for p, t in low_rank_tensors(decoder).items() if p.endswith(("cross_attn.k_proj", "v_proj"))}
    save_file(
        {
            f"diffusion_model.{p}.lora_{s}.weight": t
            for p, (d, u, _) in tensors.items()
            for s, t in (("A", d), ("B", u))
        },
        str(tmp_path / "kv.safetensors"),
    )
    prompt = fresh_session.encode_text("cross kv")
    name = fresh_session.load_lora(tmp_path / "kv.safetensors", strength=0.0, mode=mode)
    silent = stream_latent(fresh_session, prompt)
    fresh_session.set_lora_strength(name, 2.0)
    loud = stream_latent(fresh_session, prompt)
    assert (loud - silent).abs().max() > 1e-3
    fresh_session.set_lora_strength(name, 0.0)
    assert torch.equal(stream_latent(fresh_session, prompt), silent)


def bad_file(tmp_path, kind):
    """One broken LoRA file per kind of mistake a user can bring."""
    good = {
        "diffusion_model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 64),
        "diffusion_model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(64, 4),
    }
    if kind == "wrong model":
        tensors = {
            "model.layers.30.self_attn.q_proj.lora_A.weight": torch.randn(4, 1024),
            "model.layers.30.self_attn.q_proj.lora_B.weight": torch.randn(2048, 4),
        }
    elif kind == "wrong rank":
        tensors = {**good, "diffusion_model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(64, 5)}
    elif kind == "nan":
        tensors = {**good, "diffusion_model.layers.0.self_attn.q_proj.lora_A.weight": torch.full((4, 64), float("nan"))}
    else:
        tensors = {k: v for k, v in good.items() if "lora_B" not in k}
    path = tmp_path / f"{kind.replace(' ', '_')}.safetensors"
    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize(
    "kind, message",
    [
        ("wrong model", "no such layer in the DiT decoder"),
        ("wrong rank", "rank 4 but lora_B has 5"),
        ("nan", "NaN"),
        ("missing lora_B", "lora_B / lora_up is missing"),
    ],
)
def test_bad_files_are_refused_clearly_and_the_loaded_loras_stay(fresh_session, inputs, tmp_path, kind, message):
    decoder = fresh_session.models.acestep.decoder
    reference, config = peft_reference(decoder)
    save_peft_folder(reference, config, tmp_path / "style")
    fresh_session.load_lora(tmp_path / "style", strength=0.7)
    fresh_session.load_lora(tmp_path / "style", strength=0.4, name="folded style", mode="folded")
    before = forward(decoder, inputs)
    with pytest.raises(ValueError, match=message):
        fresh_session.load_lora(bad_file(tmp_path, kind), mode="folded")
    assert torch.equal(forward(decoder, inputs), before), "a refused file changed the model"
    assert fresh_session.loras == {
        "style": (pytest.approx(0.7), "live"),
        "folded style": (pytest.approx(0.4), "folded"),
    }


def test_a_model_saved_with_loras_attached_has_the_base_keys_and_weights(fresh_session, tmp_path):
    decoder = fresh_session.models.acestep.decoder
    before = {k: v.clone() for k, v in decoder.state_dict().items()}
    reference, config = peft_reference(decoder)
    save_peft_folder(reference, config, tmp_path / "style")
    fresh_session.load_lora(tmp_path / "style")
    fresh_session.load_lora(tmp_path / "style", name="folded", mode="folded")
    state = decoder.state_dict()
    assert set(state) == set(before), "LoRA layers changed the checkpoint keys"
    assert all(torch.equal(state[k], v) for k, v in before.items())
    decoder.load_state_dict(before)  # loads into the wrapped layers' base weights
    assert isinstance(decoder.layers[0].self_attn.q_proj, LoraLinear)


def test_folding_over_a_merge_and_unwinding_both_returns_the_exact_weights(fresh_session, inputs, tmp_path):
    """A merge while LoRAs are folded changes the weights they rest at: folded + merged give the sum of both,
    and undoing both, in either order, leaves the weights there were."""
    decoder = fresh_session.models.acestep.decoder
    original = {k: v.clone() for k, v in decoder.state_dict().items()}
    tensors = low_rank_tensors(decoder)
    dense = {path: (up @ down) * (alpha / 3) for path, (down, up, alpha) in tensors.items()}
    paths = write_formats(tensors, tmp_path)
    expected = expected_output(fresh_session, inputs, dense, 0.5 + 0.7)
    for unwind in ("folded first", "merged first"):
        fresh_session.load_lora(paths[1], strength=0.5, name="folded", mode="folded")
        fresh_session.load_lora(paths[2], strength=0.7, name="merged", mode="merged")
        torch.testing.assert_close(forward(decoder, inputs), expected, rtol=1e-4, atol=1e-5)
        order = ("folded", "merged") if unwind == "folded first" else ("merged", "folded")
        for name in order:
            fresh_session.unload_lora(name)
        assert all(torch.equal(original[k], v) for k, v in decoder.state_dict().items()), unwind


def test_folding_into_fp8_layers_is_refused_with_the_fix(fresh_session, tmp_path):
    from flowjam.engine.models.fp8 import to_fp8

    decoder = fresh_session.models.acestep.decoder
    reference, config = peft_reference(decoder)
    save_peft_folder(reference, config, tmp_path / "style")
    to_fp8(decoder)
    with pytest.raises(ValueError, match="load this LoRA live"):
        fresh_session.load_lora(tmp_path / "style", mode="folded")
    assert fresh_session.loras == {}
    assert fresh_session.lora_mode("auto") == "live"


def test_out_of_range_strength_and_unknown_names_are_refused(fresh_session, tmp_path):
    decoder = fresh_session.models.acestep.decoder
    reference, config = peft_reference(decoder)
    save_peft_folder(reference, config, tmp_path / "style")
    fresh_session.load_lora(tmp_path / "style")
    for strength in (float("nan"), -0.1, 2.5):
        with pytest.raises(ValueError, match="strength must be a number in"):
            fresh_session.set_lora_strength("style", strength)
    with pytest.raises(ValueError, match="no LoRA named 'other'"):
        fresh_session.set_lora_strength("other", 1.0)
    with pytest.raises(ValueError, match="loaded already"):
        fresh_session.load_lora(tmp_path / "style")
    with pytest.raises(ValueError, match="unknown LoRA mode 'baked'"):
        fresh_session.load_lora(tmp_path / "style", name="other", mode="baked")
    assert len(lora_set(decoder).attached) == 1 and MAX_LORAS >= 2
    fresh_session.unload_lora("style")
    assert not any(isinstance(m, LoraLinear) for m in decoder.modules()), "unloading left LoRA layers behind"


def test_a_broken_lora_file_is_named_with_the_fix_and_the_loaded_loras_stay(fresh_session, tmp_path):
    """A LoRA cut short by a download, or a web page saved under its name, gets one line naming the file, the same
    from the header check a command runs before its model loads and from Session.load_lora (what a node calls),
    never safetensors' own "header too large"."""
    decoder = fresh_session.models.acestep.decoder
    reference, config = peft_reference(decoder)
    save_peft_folder(reference, config, tmp_path / "style")
    fresh_session.load_lora(tmp_path / "style", strength=0.7)
    cut_folder = Path(shutil.copytree(tmp_path / "style", tmp_path / "cut style"))
    weights = cut_folder / PEFT_WEIGHTS
    weights.write_bytes(weights.read_bytes()[:-100])
    broken = [*bad_safetensors(tmp_path).values(), (cut_folder, "is truncated")]
    for path, expected in broken:
        for refuse in (check_lora_path, fresh_session.load_lora):
            with pytest.raises(ValueError) as error:
                refuse(path)
            message = str(error.value)
            assert str(path) in message and expected in message, f"{refuse.__name__}({path.name}): {message}"
            assert message.endswith("; download or export it again") and "\n" not in message, message
    assert fresh_session.loras == {"style": (pytest.approx(0.7), "live")}


def test_a_lora_option_reads_its_strength_or_says_what_is_wrong_with_it(tmp_path):
    named_with_a_colon = tmp_path / "style:v2.safetensors"
    named_with_a_colon.touch()
    assert parse_lora_option("style.safetensors:0.7") == (Path("style.safetensors"), 0.7)
    assert parse_lora_option("style.safetensors") == (Path("style.safetensors"), 1.0)
    assert parse_lora_option("C:\\loras\\style.safetensors") == (Path("C:\\loras\\style.safetensors"), 1.0)
    assert parse_lora_option("C:\\loras\\style.safetensors:0.5") == (Path("C:\\loras\\style.safetensors"), 0.5)
    assert parse_lora_option(str(named_with_a_colon)) == (named_with_a_colon, 1.0)
    for spec, expected in [
        ("style.safetensors:abc", "strength 'abc' is not a number; write PATH:0.8"),
        ("style.safetensors:", "strength '' is not a number"),
        ("style.safetensors:2.5", "strength 2.5 is outside 0..2"),
        ("style.safetensors:nan", "strength nan is outside 0..2"),
    ]:
        with pytest.raises(ValueError) as error:
            parse_lora_option(spec)
        assert expected in str(error.value), f"{spec}: {error.value}"

"""The LoRA node with ComfyUI absent: a chain changes what Generate and Stream make, taking it away restores the
exact audio, a re-queued strength changes a running stream in place through its lora/<name> knob, and a bad file
is refused while the stream plays on with the LoRAs it had."""

import pytest
import torch
from flowjam.live import performances
from flowjam.nodes.spec import NodeInputError
from helpers import generate, node, stream, text, wait_for
from safetensors.torch import save_file

TAGS = "lora node test, warm keys"


@pytest.fixture(scope="module")
def prompt(model):
    return text(model, TAGS)


@pytest.fixture(autouse=True)
def stop_streams_and_unload_loras(model):
    """Streams stop and LoRAs go after each test: Load model shares its session with every test module."""
    yield
    performances.stop_all()
    for name in list(model.loras):
        model.unload_lora(name)


def lora_file(model, path, seed=0, rank=4):
    """A ComfyUI-style LoRA on every self-attention and MLP projection of the tiny DiT."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in model.models.acestep.decoder.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith(("self_attn.q_proj", "self_attn.v_proj", "up_proj")):
            tensors[f"diffusion_model.{name}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=g) * 0.2
            tensors[f"diffusion_model.{name}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=g) * 0.2
            tensors[f"diffusion_model.{name}.alpha"] = torch.tensor(float(rank))
    save_file(tensors, str(path))
    return str(path)


def with_lora(model, path, strength=1.0, mode="live"):
    return node("FlowjamLora").run(model=model, lora=path, strength=strength, mode=mode)[0]


def audio(model, prompt):
    return generate(model, prompt)[1]["samples"]


def test_a_lora_chain_changes_generate_and_taking_it_away_restores_the_exact_latent(model, prompt, tmp_path):
    plain = audio(model, prompt)
    style = lora_file(model, tmp_path / "style.safetensors")
    other = lora_file(model, tmp_path / "other.safetensors", seed=1)
    styled = audio(with_lora(model, style), prompt)
    assert (styled - plain).abs().max() > 1e-3, "the LoRA node changed nothing"
    assert torch.equal(audio(with_lora(model, style, strength=0.0), prompt), plain), "strength 0 is not the model"
    for mode in ("folded", "merged"):
        other_mode = audio(with_lora(model, style, mode=mode), prompt)
        torch.testing.assert_close(other_mode, styled, rtol=1e-3, atol=1e-4, msg=mode)
        assert model.loras["style"][1] == mode
    chained = with_lora(with_lora(model, style), other, strength=0.5)
    assert (audio(chained, prompt) - styled).abs().max() > 1e-3, "the second LoRA of the chain changed nothing"
    assert set(model.loras) == {"style", "other"}
    assert torch.equal(audio(model, prompt), plain), "without the LoRA node the model is not back to itself"
    assert model.loras == {}
    assert node("FlowjamLora").run(model=model, lora="none", strength=1.0, mode="live") == (model,)


def run_stream(model, prompt, name):
    stream(model, prompt, name, depth=1, denoise=1.0)
    return performances.get(name)


def settled_latent(app):
    """The newest latent once three generations that started after now have finished (depth 1, denoise 1: every
    generation is the same render while nothing changes)."""
    finished = app.runner.stats.latents
    wait_for(lambda: app.runner.stats.latents >= finished + 3, 30, "three more latents (has the stream stopped?)")
    return app.runner.latest.clone()


def test_requeued_strength_changes_the_running_stream_in_place_and_back_bit_for_bit(model, prompt, tmp_path):
    style = lora_file(model, tmp_path / "style.safetensors")
    app = run_stream(with_lora(model, style, strength=0.0), prompt, "lora-live")
    assert app.registry.get("lora/style") == 0.0
    off = settled_latent(app)
    assert run_stream(with_lora(model, style, strength=1.5), prompt, "lora-live") is app
    assert app.registry.get("lora/style") == 1.5
    on = settled_latent(app)
    assert (on - off).abs().max() > 1e-3, "the re-queued strength did not reach the stream"
    run_stream(with_lora(model, style, strength=0.0), prompt, "lora-live")
    assert torch.equal(settled_latent(app), off), "strength back at 0 is not the stream it was"
    assert app.runner.stats.errors == 0, app.runner.stats.last_error


def test_a_bad_lora_file_is_refused_and_the_stream_keeps_its_loras(model, prompt, tmp_path):
    style = lora_file(model, tmp_path / "style.safetensors")
    app = run_stream(with_lora(model, style, strength=0.8), prompt, "lora-bad")
    broken = tmp_path / "broken.safetensors"
    save_file({"diffusion_model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 64)}, str(broken))
    ticks = app.runner.stats.ticks
    with pytest.raises(NodeInputError, match="lora_B / lora_up is missing"):
        run_stream(with_lora(with_lora(model, style, strength=0.8), str(broken)), prompt, "lora-bad")
    assert model.loras["style"] == (pytest.approx(0.8), "live")
    wait_for(lambda: app.runner.stats.ticks >= ticks + 3, 10, "three more ticks (has the stream stopped?)")
    assert app.runner.alive and app.runner.stats.errors == 0
    with pytest.raises(NodeInputError, match="not a file in ComfyUI/models/loras"):
        with_lora(model, str(tmp_path / "missing.safetensors"))


def test_a_bad_lora_in_a_generate_graph_names_no_lora_of_an_earlier_graph(model, prompt, tmp_path):
    """The session is shared: a Generate graph that asks for a broken LoRA used to be told "LoRAs loaded: style",
    a LoRA only an earlier graph had asked for."""
    generate(with_lora(model, lora_file(model, tmp_path / "style.safetensors")), prompt)
    broken = tmp_path / "broken.safetensors"
    save_file({"diffusion_model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 64)}, str(broken))
    with pytest.raises(NodeInputError) as refused:
        generate(with_lora(model, str(broken)), prompt)
    message = str(refused.value)
    assert message.startswith("Generate: LoRA 'broken.safetensors': ") and "lora_B / lora_up is missing" in message
    assert message.endswith("; nothing was generated") and "style" not in message, message


def test_a_failed_swap_leaves_the_stream_the_loras_and_the_sound_it_had(model, prompt, tmp_path):
    """A re-queue that replaced a stream's LoRA with a bad file used to unload the old one first: the stream lost
    it, while its knob stayed listed and moving it only counted errors. Now every file is read and checked before
    anything changes, and a swap that still fails (a ninth LoRA: a decoder holds eight) is undone."""
    style = lora_file(model, tmp_path / "style.safetensors")
    nine = model
    for index in range(9):
        nine = with_lora(nine, lora_file(model, tmp_path / f"extra{index}.safetensors", seed=10 + index))
    broken = tmp_path / "broken.safetensors"
    save_file({"diffusion_model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 64)}, str(broken))
    app = run_stream(with_lora(model, style, strength=0.8), prompt, "lora-swap")
    styled = settled_latent(app)
    for chain, failure in ((with_lora(model, str(broken)), "lora_B / lora_up is missing"), (nine, "8 LoRAs are")):
        with pytest.raises(NodeInputError, match=failure) as refused:
            run_stream(chain, prompt, "lora-swap")
        assert "\n" not in str(refused.value) and str(refused.value).endswith("nothing changed (LoRAs loaded: style)")
        assert model.loras == {"style": (pytest.approx(0.8), "live")}
        assert torch.equal(settled_latent(app), styled), f"after {failure!r} the stream no longer sounds as it did"
    app.registry.set("lora/style", 0.0)
    assert (settled_latent(app) - styled).abs().max() > 1e-3, "its lora/style knob no longer plays the LoRA"
    assert app.runner.stats.errors == 0, app.runner.stats.last_error


def test_nodes_make_their_state_outside_comfyuis_inference_mode(tmp_path):
    """ComfyUI runs nodes under torch.inference_mode; a model loaded there, a LoRA attached there and the strengths
    the live threads then write in place must be ordinary tensors (an inference tensor refuses in-place writes
    outside inference mode, and keeps no version counter)."""
    with torch.inference_mode():
        (session,) = node("FlowjamLoadModel").run(  # bf16: not the float32 session the other tests cached
            preset="tiny", checkpoint="none", device="cpu", dtype="bfloat16", backend="eager"
        )
        model = with_lora(session, lora_file(session, tmp_path / "style.safetensors"))
        audio(model, text(session, TAGS))
    decoder = session.models.acestep.decoder
    assert not any(t.is_inference() for t in (*decoder.parameters(), *decoder.buffers()))
    session.set_lora_strength("style", 0.5)  # what the runner thread does, outside inference mode

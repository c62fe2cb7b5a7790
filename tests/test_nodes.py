"""The ComfyUI nodes without ComfyUI: declarations, classic adapters, AUDIO/LATENT interop with ComfyUI's own nodes,
live-stream re-queue semantics, capture, and bad inputs (a NodeInputError naming the input; a running stream plays
on). Tiny preset on the CPU; streams play into a silent clock (audio_device "none")."""

import gc
import inspect
import math
import re
import socket
import subprocess
import sys
import time
import types
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flowjam.live import performances
from flowjam.live.app import NO_AUDIO_DEVICE
from flowjam.nodes import NODE_SPECS, web_routes
from flowjam.nodes.comfy_v1 import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
from flowjam.nodes.spec import CATEGORY, SOCKET_TYPES, WIDGET_TYPES, NodeInputError
from helpers import STREAM_DEFAULTS, TEXT_DEFAULTS, free_udp_port, generate, node, stream, text, wait_for, wait_ticks

RATE = 48_000
HOP = 1920  # audio samples per latent frame (25 frames per second)
NUMERIC = ("INT", "FLOAT")


pytestmark = pytest.mark.usefixtures("stop_streams")


@pytest.fixture(scope="module")
def prompt_a(model):
    return text(model, "slow ambient pads, warm analog synth")


@pytest.fixture(scope="module")
def prompt_b(model):
    return text(model, "breakbeat drums, fast, distorted guitar", lyrics="[Verse]\n" + "la la la hey " * 40)


def wait_played(app, seconds: float, timeout: float = 20.0) -> None:
    """Until `seconds` more have played (the playback clock runs in real time)."""
    target = app.buffer.playhead_frames + int(seconds * RATE)
    wait_for(lambda: app.buffer.playhead_frames >= target, timeout, f"{seconds} s of playback")


# ---- declarations --------------------------------------------------------------------------------------------------


def test_node_ids_are_unique_and_every_spec_is_exposed():
    ids = [spec.node_id for spec in NODE_SPECS]
    assert len(ids) == len(set(ids)) and len(ids) >= 15
    assert list(NODE_CLASS_MAPPINGS) == ids and list(NODE_DISPLAY_NAME_MAPPINGS) == ids
    assert len({spec.display_name for spec in NODE_SPECS}) == len(ids)


@pytest.mark.parametrize("spec", NODE_SPECS, ids=lambda spec: spec.node_id)
def test_declaration_is_complete_and_consistent(spec):
    assert spec.node_id.startswith("Flowjam") and spec.display_name.startswith("flowjam ")
    assert spec.category == CATEGORY or spec.category.startswith(CATEGORY + "/")
    assert spec.description.strip()
    names = [p.name for p in spec.inputs]
    assert len(names) == len(set(names)) and all(n.isidentifier() for n in names)
    hidden = ["unique_id"] if spec.hidden_unique_id else []
    assert list(inspect.signature(spec.function).parameters) == names + hidden, "spec.call passes the declared inputs"
    seen_optional = False
    for param in spec.inputs:
        where = f"{spec.node_id}.{param.name}"
        assert param.tooltip.strip(), f"{where} needs a tooltip"
        assert param.type in WIDGET_TYPES + SOCKET_TYPES, where
        assert not (seen_optional and not param.optional), (
            f"{where}: required inputs come first (the frontend's widget order)"
        )
        seen_optional |= param.optional
        if param.type in SOCKET_TYPES:
            assert param.default is None and param.minimum is None and param.maximum is None and not param.choices(), (
                where
            )
            continue
        assert not param.optional, f"{where}: widgets are required (workflows store every value)"
        if param.type in NUMERIC:
            assert param.minimum is not None and param.maximum is not None and param.minimum < param.maximum, where
            assert param.minimum <= param.default <= param.maximum, (
                f"{where}: default {param.default} outside its range"
            )
            assert param.step is not None and param.step > 0, where
            if param.type == "INT":
                assert all(
                    isinstance(v, int) and not isinstance(v, bool)
                    for v in (param.default, param.minimum, param.maximum, param.step)
                ), where
        elif param.type == "COMBO":
            choices = param.choices()
            assert choices and len(set(choices)) == len(choices) and all(isinstance(c, str) for c in choices), where
            assert param.default in choices, f"{where}: default {param.default!r} is not an option"
        elif param.type == "STRING":
            assert isinstance(param.default, str), where
        elif param.type == "BOOLEAN":
            assert isinstance(param.default, bool), where
    outputs = [o.name for o in spec.outputs]
    assert outputs and len(outputs) == len(set(outputs)) and all(outputs)
    assert all(o.type in SOCKET_TYPES + ("STRING",) for o in spec.outputs), [o.type for o in spec.outputs]


@pytest.mark.parametrize("node_id", list(NODE_CLASS_MAPPINGS))
def test_classic_class_is_well_formed(node_id):
    cls = NODE_CLASS_MAPPINGS[node_id]
    spec = cls.SPEC
    types = cls.INPUT_TYPES()
    assert types.pop("hidden", None) == ({"unique_id": "UNIQUE_ID"} if spec.hidden_unique_id else None)
    assert set(types) == {"required", "optional"}
    assert list(types["required"]) + list(types["optional"]) == [p.name for p in spec.inputs]
    for param in spec.inputs:
        section = types["optional" if param.optional else "required"]
        kind, options = section[param.name]
        assert options["tooltip"] == param.tooltip
        if param.type == "COMBO":
            assert isinstance(kind, list) and kind == list(param.choices()) and options["default"] == param.default
        else:
            assert kind == param.type
        if param.type in NUMERIC:
            assert (options["default"], options["min"], options["max"], options["step"]) == (
                param.default,
                param.minimum,
                param.maximum,
                param.step,
            )
        if param.type == "STRING":
            assert options["default"] == param.default and options["multiline"] is param.multiline
        if param.type in SOCKET_TYPES:
            assert "default" not in options
    assert cls.RETURN_TYPES == tuple(o.type for o in spec.outputs)
    assert len(cls.RETURN_NAMES) == len(cls.RETURN_TYPES) == len(cls.OUTPUT_TOOLTIPS)
    assert cls.FUNCTION == "run" and callable(cls().run)
    assert cls.CATEGORY == spec.category and cls.DESCRIPTION == spec.description and cls.OUTPUT_NODE is spec.output_node
    assert NODE_DISPLAY_NAME_MAPPINGS[node_id] == spec.display_name
    if spec.always_run:
        changed = cls.IS_CHANGED()
        assert changed != changed, "IS_CHANGED must return NaN so that every queue re-runs a live node"
    else:
        assert not hasattr(cls, "IS_CHANGED")


def test_nodes_run_with_comfyui_absent():
    """ComfyUI's modules made unimportable: the package falls back to the classic classes and the nodes still run."""
    code = r"""
import importlib.abc, sys
class NoComfy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("comfy", "comfy_api", "comfy_extras", "folder_paths", "server", "comfy_execution"):
            raise ImportError(f"{name} blocked: ComfyUI is absent")
sys.meta_path.insert(0, NoComfy())
import flowjam
from flowjam.nodes import comfy_v1
assert flowjam.NODE_CLASS_MAPPINGS is comfy_v1.NODE_CLASS_MAPPINGS
try:
    import flowjam.nodes.comfy_v3
except ImportError:
    pass
else:
    raise SystemExit("comfy_v3 imported without ComfyUI")
M = flowjam.NODE_CLASS_MAPPINGS
assert M["FlowjamLoadModel"].INPUT_TYPES()["required"]["checkpoint"][0] == ["none"]
model, = M["FlowjamLoadModel"]().run(preset="tiny", checkpoint="none", device="cpu", dtype="float32", backend="eager")
cond, = M["FlowjamTextConditioning"]().run(model=model, tags="no comfy", lyrics="", bpm=0, key="", time_signature="",
                                           duration=0.0, task="text2music", language="")
audio, latent = M["FlowjamGenerate"]().run(model=model, conditioning=cond, seconds=0.4, seed=1, steps=2, shift=3.0, denoise=1.0)
curve, = M["FlowjamCurveRamp"]().run(start=0.0, end=1.0, seconds=0.4)
print(tuple(audio["waveform"].shape), audio["sample_rate"], tuple(latent["samples"].shape), tuple(curve.shape))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "(1, 2, 19200) 48000 (1, 64, 10) (10,)"


def test_node_input_error_prints_as_flowjam_node_input_error():
    """ComfyUI reports an error's type as module + "." + qualname (execution.full_type_name), and imports the pack
    under its folder's full path: the type must not read '/home/.../custom_nodes/flowjam.nodes.spec.NodeInputError'."""
    with pytest.raises(NodeInputError) as raised:
        node("FlowjamCurvePoints").run(points="", seconds=1.0)
    assert f"{type(raised.value).__module__}.{type(raised.value).__qualname__}" == "flowjam.NodeInputError"
    assert isinstance(raised.value, ValueError)


# ---- presets: no full-size random weights in ComfyUI ------------------------------------------------------------


def load(preset: str, checkpoint: str = "none", dtype: str = "float32"):
    return node("FlowjamLoadModel").run(
        preset=preset, checkpoint=checkpoint, device="cpu", dtype=dtype, backend="eager"
    )[0]


def test_full_size_presets_are_not_offered_and_old_graphs_get_the_fix(model, tmp_path):
    """A full-size preset with random weights took 22 minutes for 2 s at one step and only made noise: the nodes
    offer tiny alone. An old graph that names a full-size preset still validates in ComfyUI; with a checkpoint it
    loads the checkpoint (whose shape wins), without one the error says where to pick weights."""
    load_model, lm = NODE_CLASS_MAPPINGS["FlowjamLoadModel"], NODE_CLASS_MAPPINGS["FlowjamLMStructure"]
    assert load_model.INPUT_TYPES()["required"]["preset"][0] == ["tiny"]
    assert lm.INPUT_TYPES()["required"]["lm_preset"][0] == ["tiny"]
    assert inspect.getfullargspec(load_model.VALIDATE_INPUTS).args == ["cls", "preset"], "ComfyUI checks the rest"
    assert load_model.VALIDATE_INPUTS(preset="turbo-2b") is True and lm.VALIDATE_INPUTS(lm_preset="lm-4b") is True
    assert "must be one of tiny" in load_model.VALIDATE_INPUTS(preset="huge")
    for preset in ("turbo-2b", "xl"):
        with pytest.raises(NodeInputError, match=f"input 'preset' '{preset}' has no weights without a checkpoint") as e:
            load(preset)
        assert all(fix in str(e.value) for fix in ("'checkpoint'", "diffusion_models/", "checkpoints/", "tiny"))
    with pytest.raises(NodeInputError, match="input 'lm_preset' 'lm-1.7b' has no weights.*text_encoders/"):
        lm_structure(model, lm_preset="lm-1.7b")
    from flowjam.engine.checkpoints.loading import save_flowjam_file

    saved = save_flowjam_file(model.models, tmp_path / "acestep_tiny.safetensors")
    started = time.monotonic()
    loaded = load("turbo-2b", str(saved))
    assert time.monotonic() - started < 30 and loaded.models.config == model.models.config, "the checkpoint's shape"
    with pytest.raises(NodeInputError, match="input 'checkpoint'"):
        load("tiny", str(tmp_path / "no_such_acestep.safetensors"))


# ---- model lifetime: ComfyUI's /free drops its node-output cache, and what nothing else holds must go ---------------


def test_a_loaded_model_is_reused_while_held_and_freed_once_nothing_holds_it():
    held = load("tiny", dtype="bfloat16")  # the module's float32 model stays held by its fixture
    assert load("tiny", dtype="bfloat16") is held, "a re-queued graph must reuse the model it holds"
    freed = weakref.ref(held)
    del held
    gc.collect()
    assert freed() is None, "Load model kept a model nothing else holds: /free could never give its memory back"
    again = load("tiny", dtype="bfloat16")
    assert again is not None and text(again, "loaded again on demand").encoder_hidden_states.dtype == torch.bfloat16


def test_a_running_stream_keeps_its_model_and_lets_it_go_when_stopped():
    model = load("tiny", dtype="bfloat16")
    stream(model, text(model, "held by the stream"), "held", steps=1, depth=1)
    app = performances.get("held")
    kept = weakref.ref(model)
    del model
    gc.collect()
    assert kept() is not None, "the graph let go of the model and the running stream lost it"
    wait_ticks(app)
    assert app.runner.alive and app.runner.stats.errors == 0, "the stream must keep playing"
    assert node("FlowjamStreamStop").run(stream="held")["result"] == ("stopped held",)
    del app
    gc.collect()
    assert kept() is None, "a stopped stream still holds its model"


# ---- AUDIO / LATENT interop ----------------------------------------------------------------------------------------


def test_generate_returns_comfyui_audio_and_audio_latent(model, prompt_a):
    audio, latent = generate(model, prompt_a, seconds=2.0)
    assert (
        set(audio) == {"waveform", "sample_rate"} and audio["sample_rate"] == RATE and type(audio["sample_rate"]) is int
    )
    waveform = audio["waveform"]
    assert waveform.shape == (1, 2, 2 * RATE) and waveform.dtype == torch.float32 and waveform.device.type == "cpu"
    assert torch.isfinite(waveform).all() and waveform.abs().max() <= 1.0 and waveform.square().mean() > 1e-4
    assert set(latent) == {"samples", "type"} and latent["type"] == "audio"
    assert latent["samples"].shape == (1, 64, 50) and latent["samples"].dtype == torch.float32
    decoded = model.decode(latent["samples"].transpose(1, 2))
    decoded = decoded / max(1.0, decoded.abs().max().item())
    torch.testing.assert_close(decoded[None], waveform, atol=1e-5, rtol=0)  # the AUDIO is the LATENT, decoded
    again, _ = generate(model, prompt_a, seconds=2.0)
    other, _ = generate(model, prompt_a, seconds=2.0, seed=43)
    assert torch.equal(again["waveform"], waveform) and not torch.allclose(other["waveform"], waveform)


def test_a_comfyui_latent_feeds_prepare_source_and_a_cover(model, prompt_a):
    audio, latent = generate(model, prompt_a, seconds=1.2)
    (from_latent,) = node("FlowjamPrepareSource").run(model=model, latent=latent)
    assert from_latent.frames == 30 and from_latent.hints.shape == (1, 30, 64) and from_latent.codes.shape == (1, 6)
    torch.testing.assert_close(from_latent.latents, latent["samples"].transpose(1, 2))
    (from_audio,) = node("FlowjamPrepareSource").run(model=model, audio=audio)
    assert from_audio.frames == 30
    # what ComfyUI's own ACE-Step 1.5 nodes hand over: [batch, 64, T] latents, "type" audio; the first item is used
    comfy_latent = {"samples": torch.cat([latent["samples"], torch.zeros_like(latent["samples"])]), "type": "audio"}
    (first_item,) = node("FlowjamPrepareSource").run(model=model, latent=comfy_latent)
    torch.testing.assert_close(first_item.latents, from_latent.latents)
    cover, cover_latent = generate(model, prompt_a, seconds=30.0, denoise=0.5, source=from_latent)
    assert cover["waveform"].shape == (1, 2, 30 * HOP) and cover_latent["samples"].shape == (1, 64, 30)
    with pytest.raises(NodeInputError, match="'latent'"):
        node("FlowjamPrepareSource").run(model=model, latent={"samples": torch.zeros(1, 8, 30), "type": "audio"})
    for both_or_neither in ({"audio": audio, "latent": latent}, {}):
        with pytest.raises(NodeInputError, match="'audio' or 'latent'"):
            node("FlowjamPrepareSource").run(model=model, **both_or_neither)


# ---- live streams --------------------------------------------------------------------------------------------------


def test_requeued_stream_updates_the_running_session_in_place(model, prompt_a):
    assert stream(model, prompt_a, "requeue") == "requeue"
    app = performances.get("requeue")
    wait_ticks(app, 5)
    ticks = app.runner.stats.ticks
    assert stream(model, prompt_a, "requeue", denoise=0.4, seed=7, depth=3, steps=3, prompt_blend=0.25) == "requeue"
    node("FlowjamSharedCurve").run(stream="requeue", knob="velocity_scale", value=1.3)
    assert performances.get("requeue") is app and app.runner.alive, "the same session, still running"
    assert app.runner.stats.ticks >= ticks
    wait_ticks(app, 5)
    values = app.registry.values()
    assert (values["denoise"], values["seed"], values["depth"], values["steps"], values["prompt_blend"]) == (
        0.4,
        7,
        3,
        3,
        0.25,
    )
    assert values["velocity_scale"] == 1.3
    wait_for(lambda: app.runner.stream.pipeline.depth == 3, 5, "depth 3 to apply")
    assert app.runner.stream.pipeline.shared_curves()["velocity_scale"].flatten().tolist() == [pytest.approx(1.3)]
    assert app.runner.stats.errors == 0
    assert node("FlowjamStreamStop").run(stream="requeue")["result"] == ("stopped requeue",)
    assert performances.get("requeue") is None and not app.runner.alive
    assert node("FlowjamStreamStop").run(stream="requeue")["result"] == (
        "no running stream named 'requeue'; queue a flowjam Stream node with session_id 'requeue' first",
    )


def guided_latent(model, conditioning, session_id: str, **values) -> torch.Tensor:
    """The newest latent of a stream (depth 1, denoise 1: every generation is the same render) with guidance 4 on the
    Shared curve, once generations that started after the curve have finished; the stream is stopped."""
    stream(model, conditioning, session_id, depth=1, denoise=1.0, **values)
    app = performances.get(session_id)
    node("FlowjamSharedCurve").run(stream=session_id, knob="guidance", value=4.0)
    finished = app.runner.stats.latents
    wait_for(lambda: app.runner.stats.latents >= finished + 3, 30, f"three more generations of {session_id!r}")
    assert app.runner.stats.errors == 0, app.runner.stats.last_error
    latest = app.runner.latest.clone()
    node("FlowjamStreamStop").run(stream=session_id)
    return latest


def test_cfg_mode_and_the_negative_change_what_the_stream_generates(model, prompt_a, prompt_b):
    render = generate(model, prompt_a)[1]["samples"].transpose(1, 2)  # the stream's settings, turbo's own way
    off = guided_latent(model, prompt_a, "cfg-off", cfg_mode="off")
    full = guided_latent(model, prompt_a, "cfg-full", cfg_mode="full")
    away_from_b = guided_latent(model, prompt_a, "cfg-negative", cfg_mode="full", negative=prompt_b)
    torch.testing.assert_close(off, render, msg="cfg_mode off must generate turbo's own render: guidance has no say")
    assert (full - off).abs().mean() > 0.05, "cfg_mode full with guidance 4 generated what cfg_mode off does"
    assert (away_from_b - full).abs().mean() > 0.05, "a connected negative did not change what full guidance generates"


def test_a_connected_negative_reaches_the_runner_and_a_disconnected_one_goes_back_to_none(model, prompt_a, prompt_b):
    stream(model, prompt_a, "negative", cfg_mode="full", negative=prompt_b)
    app = performances.get("negative")
    wait_ticks(app, 2)
    assert app.runner._prompts["negative"] is prompt_b, "the connected negative is not the runner's negative"
    assert app.runner.status()["cfg_mode"] == "full", "a new stream starts in the node's cfg_mode"
    stream(model, prompt_a, "negative", cfg_mode="initialize")
    wait_for(
        lambda: app.runner._prompts["negative"] is None,
        10,
        "the disconnected negative to go back to the null condition",
    )
    assert app.runner.status()["cfg_mode"] == "initialize", "a re-queue sets cfg_mode"
    assert performances.get("negative") is app and app.runner.stats.errors == 0
    node("FlowjamStreamStop").run(stream="negative")


def loop_audio(model, latent: dict) -> np.ndarray:
    """What a stream loops for this latent: the cyclic decode (the seam sees the loop's other end)."""
    frames = latent["samples"].transpose(1, 2)
    tiled = model.decode(torch.cat([frames] * 3, dim=1))
    return tiled[:, frames.shape[1] * HOP : 2 * frames.shape[1] * HOP].numpy()


def distance(capture: np.ndarray, loop: np.ndarray, block: int = 32, candidates: int = 16) -> float:
    """How far a capture is from some stretch of a loop (position unknown): the median relative residual of short
    blocks after a per-block gain fit (volume and the runner's crossfades scale blocks), over blocks at the common
    gain, at the best of the offsets that correlate best."""
    mono, ref = capture.mean(0).astype(np.float64), loop.mean(0).astype(np.float64)
    padded = np.zeros_like(ref)
    padded[: mono.size] = mono
    correlation = np.fft.irfft(np.fft.rfft(ref) * np.conj(np.fft.rfft(padded)), ref.size)
    best = math.inf
    n = capture.shape[1] // block * block
    got = capture[:, :n].astype(np.float64).reshape(2, -1, block).transpose(1, 0, 2).reshape(-1, 2 * block)
    for offset in np.argsort(correlation)[-candidates:]:
        want = (
            np.roll(loop, -int(offset), axis=1)[:, :n]
            .astype(np.float64)
            .reshape(2, -1, block)
            .transpose(1, 0, 2)
            .reshape(-1, 2 * block)
        )
        gain = (got * want).sum(1) / ((want * want).sum(1) + 1e-20)
        steady = np.abs(gain / np.median(gain) - 1) < 1e-3
        if steady.mean() < 0.3:
            continue
        residual = np.linalg.norm(got - gain[:, None] * want, axis=1) / (np.linalg.norm(got, axis=1) + 1e-20)
        best = min(best, float(np.median(residual[steady])))
    return best


def test_a_changed_prompt_is_heard(model, prompt_a, prompt_b):
    """denoise 1 and a fixed seed: the loop settles on one generation, so a capture is a stretch of that render."""
    song = dict(song_seconds=2.0, depth=2, steps=4, denoise=1.0, seed=42)
    loop_a = loop_audio(model, generate(model, prompt_a, seconds=2.0, seed=42, steps=4)[1])
    loop_b = loop_audio(model, generate(model, prompt_b, seconds=2.0, seed=42, steps=4)[1])
    assert distance(loop_a[:, :RATE], loop_b) > 1e-4, "the two prompts must render differently"
    stream(model, prompt_a, "heard", **song)
    app = performances.get("heard")
    before = heard(app, loop_a, "prompt A's render")
    stream(model, prompt_b, "heard", **song)
    after = heard(app, loop_b, "prompt B's render after the re-queue")
    assert performances.get("heard") is app
    assert distance(before, loop_b) > 1e-4, "before the re-queue prompt B must not be playing"
    assert distance(after, loop_a) > 1e-4, "after the re-queue prompt A must be gone"


def heard(app, loop: np.ndarray, what: str, timeout: float = 30.0) -> np.ndarray:
    """The last second played once it is a stretch of `loop`: how long the stream takes to settle on a new
    generation depends on the machine's load, so poll the output instead of waiting a fixed time."""
    captures = []

    def settled() -> bool:
        wait_played(app, 1.0)
        captures.append(
            node("FlowjamStreamCapture").run(stream=app.config.session_name, seconds=1.0)[0]["waveform"][0].numpy()
        )
        return captures[-1].shape == (2, RATE) and distance(captures[-1], loop) < 1e-5

    wait_for(settled, timeout, f"the output to be {what}")
    # a capture that straddles the change matches both loops in part: take the next whole second after it settles
    assert settled(), f"the output stopped being {what}"
    return captures[-1]


def test_stream_capture_returns_the_requested_length(model, prompt_a):
    stream(model, prompt_a, "capture", song_seconds=4.0)
    app = performances.get("capture")
    early = node("FlowjamStreamCapture").run(stream="capture", seconds=2.0)[0]  # queued with its Stream: it waits
    assert early["waveform"].shape == (1, 2, 2 * RATE), "the first queue's capture was cut short by the start"
    first_block = early["waveform"][..., : RATE // 20]
    assert first_block.square().mean() > 1e-6, "the capture holds the silence before the first generation"
    wait_played(app, 2.3)
    for seconds in (2.0, 0.5, 0.1):
        audio, passed_on = node("FlowjamStreamCapture").run(stream="capture", seconds=seconds)
        assert passed_on == "capture", "Stream capture passes its stream on (a Stream stop can follow it)"
        assert audio["sample_rate"] == RATE and audio["waveform"].shape == (1, 2, round(seconds * RATE))
        assert audio["waveform"].dtype == torch.float32 and torch.isfinite(audio["waveform"]).all()
        assert audio["waveform"].square().mean() > 1e-6, "the stream is playing sound"
    wait_played(app, 2.0)
    capped, _ = node("FlowjamStreamCapture").run(stream="capture", seconds=30.0)
    assert 3.0 * RATE <= capped["waveform"].shape[2] < 4.0 * RATE, "capped at the loop minus the window being written"


def test_a_requeue_that_cannot_apply_in_place_is_refused_and_the_stream_plays_on(model, prompt_a, prompt_b):
    """A re-queue used to drop a new song_seconds or audio_device silently, and a second Stream node with the same
    session_id "succeeded" and mixed its settings into the first one's stream. Each is now refused, naming the fix,
    before anything changes; the node that started the stream still updates it, and once stopped the name is free."""
    stream(model, prompt_a, "owned", unique_id="5")
    app = performances.get("owned")
    wait_ticks(app)
    knobs = app.registry.values()
    refusals = {
        "song_seconds 3 cannot apply to the running stream 'owned', which loops 2 s; stop it (Stream stop)": dict(
            unique_id="5", song_seconds=3.0
        ),
        "audio_device 'jack' cannot apply to the running stream 'owned', which plays on null (no audio device)": dict(
            unique_id="5", audio_device="jack"
        ),
        "session_id 'owned' is already used by node #5; give this node another session_id": dict(unique_id="9"),
    }
    for message, values in refusals.items():
        with pytest.raises(NodeInputError, match=re.escape(f"Stream: {message}")):
            stream(model, prompt_b, "owned", seed=1, **values)
    wait_ticks(app)
    assert performances.get("owned") is app and app.runner.alive and app.runner.stats.errors == 0
    assert app.registry.values() == knobs and app.runner._prompts["a"] is prompt_a, "a refused re-queue changed it"
    stream(model, prompt_b, "owned", unique_id="5", seed=1, audio_device=" none ")
    assert performances.get("owned") is app and app.registry.get("seed") == 1, "its own node updates it in place"
    node("FlowjamStreamStop").run(stream="owned")
    stream(model, prompt_a, "owned", unique_id="9", song_seconds=3.0)
    assert performances.get("owned").runner.frames == 75, "a stopped stream's name is free for another node"


def test_a_stream_node_walks_a_window_or_plays_endless_and_refuses_what_cannot_apply(model, prompt_a):
    """window_seconds and endless reach the running stream (its requests cover the window, not the loop); a window
    that cannot apply to the running stream, an endless cover, and a window under the minimum are refused."""
    stream(model, prompt_a, "walking", song_seconds=12.0, window_seconds=4.0)
    app = performances.get("walking")
    wait_for(lambda: app.runner.latest is not None, 60, "the first window")
    assert app.runner.request_frames == 100 and app.runner.frames == 300
    assert app.status()["window_s"] == 4.0
    with pytest.raises(NodeInputError, match=re.escape("Stream: window_seconds/endless 6/False cannot apply")):
        stream(model, prompt_a, "walking", song_seconds=12.0, window_seconds=6.0)
    node("FlowjamStreamStop").run(stream="walking")
    stream(model, prompt_a, "endless", window_seconds=4.0, endless=True)
    endless = performances.get("endless")
    wait_for(lambda: endless.runner.latest is not None, 60, "the first endless window")
    assert endless.status()["endless"] and endless.runner.request_frames == 100
    node("FlowjamStreamStop").run(stream="endless")
    with pytest.raises(NodeInputError, match="input 'window_seconds' 2 is outside 4"):
        stream(model, prompt_a, "short", window_seconds=2.0)


def test_a_stream_node_on_a_grid_loops_whole_bars_and_keeps_its_grid(model, prompt_a):
    """bpm, time_signature, bars and click make the loop whole bars (not whole latent frames), clicking on its bar
    starts; a requeue with another grid is refused and the stream plays on; grid inputs that cannot work are refused
    before anything starts."""
    stream(model, prompt_a, "grid", bpm=123.0, time_signature="3", bars=2, click=True)
    app = performances.get("grid")
    wait_for(lambda: app.runner.stats.writes > 0, 60, "the first write")
    assert app.buffer.frames == round(2 * 3 * 60 / 123 * 48_000) and app.runner.frames == 74
    assert app.buffer.click_bar_frames == pytest.approx(3 * 60 / 123 * 48_000)
    assert app.status()["bpm"] == 123.0 and app.status()["beats_per_bar"] == 3
    with pytest.raises(NodeInputError, match="bpm/time_signature/bars/sync/click cannot apply"):
        stream(model, prompt_a, "grid", bpm=124.0, time_signature="3", bars=2, click=True)
    assert performances.get("grid") is app and app.runner.alive
    node("FlowjamStreamStop").run(stream="grid")
    for values, message in (
        (dict(bars=2), "inputs 'bars' and 'click' need a tempo"),
        (dict(bpm=400.0), "input 'bpm' = 400.0 is outside 30 .. 300"),
        (dict(bpm=120.0, bars=2, endless=True, window_seconds=4.0), "endless play has none"),
        (dict(sync="midi"), "input 'sync' 'midi'"),
    ):
        with pytest.raises(NodeInputError, match=re.escape(message)):
            stream(model, prompt_a, "bad-grid", **values)
    assert performances.get("bad-grid") is None


def test_a_stream_with_no_audio_device_says_so_on_its_panel_and_keeps_generating(model, prompt_a, monkeypatch):
    """With no output to open, a Stream with audio_device empty plays into a silent clock. It used to look as if it
    played: the only hint was a server log line naming command-line flags that ComfyUI does not have."""
    monkeypatch.setenv("JACK_DEFAULT_SERVER", "flowjam-no-such-server")  # a JACK server another test started
    monkeypatch.setenv("JACK_NO_START_SERVER", "1")
    probe = "import sounddevice as sd; print(sum(d['max_output_channels'] > 0 for d in sd.query_devices()))"
    outputs = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60).stdout
    if outputs.strip() not in ("", "0"):
        pytest.skip(f"this machine has {outputs.strip()} audio outputs: a Stream plays on them")
    stream(model, prompt_a, "no-device", audio_device="")
    app = performances.get("no-device")
    wait_ticks(app)
    _, status = web_routes.status_for("no-device")  # what the Stream node's live panel shows
    assert status["output_warning"] == NO_AUDIO_DEVICE and NO_AUDIO_DEVICE.startswith("no audio device: playing")
    assert "--" not in NO_AUDIO_DEVICE, "a ComfyUI user has no command-line flags"
    audio, _ = node("FlowjamStreamCapture").run(stream="no-device", seconds=0.5)
    assert audio["waveform"].shape == (1, 2, RATE // 2) and audio["waveform"].square().mean() > 1e-6
    stream(model, prompt_a, "silent-on-purpose")
    assert web_routes.status_for("silent-on-purpose")[1]["output_warning"] is None, "audio_device none is no warning"


NO_PORTAUDIO = 'raise OSError("PortAudio library not found")  # what sounddevice raises where libportaudio is absent\n'


def test_a_machine_without_portaudio_says_to_install_it_not_to_connect_an_output(
    model, prompt_a, monkeypatch, tmp_path
):
    """sounddevice cannot load PortAudio (a fresh Debian box without libportaudio2): the panel said "no audio device:
    connect an output" while the server log named the real cause. The status now names it, with each platform's fix."""
    (tmp_path / "sounddevice.py").write_text(NO_PORTAUDIO)  # found first, by this process and the output process
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "sounddevice", raising=False)
    stream(model, prompt_a, "no-portaudio", audio_device="")
    wait_ticks(performances.get("no-portaudio"))
    warning = web_routes.status_for("no-portaudio")[1]["output_warning"]
    assert warning.startswith("no audio: the PortAudio library is not installed; playing silently"), warning
    for fix in ("sudo apt install libportaudio2", "brew install portaudio", "then restart the stream"):
        assert fix in warning, f"the warning lacks {fix!r}: {warning}"
    assert "connect an output" not in warning and "--" not in warning, warning


def test_a_wrong_audio_device_is_one_line_listing_the_outputs_there_are(model, prompt_a, jack_server):
    """A misspelt audio_device used to show PlaybackError's type with the full file path of the pack's module."""
    with pytest.raises(NodeInputError) as refused:
        stream(model, prompt_a, "wrong-device", audio_device="no-such-output")
    message = str(refused.value)
    assert message.startswith("Stream: input 'audio_device' 'no-such-output': ") and "\n" not in message, message
    assert re.search(r"Available outputs: \d+: [^;]+ \(JACK", message), f"the JACK outputs are not listed: {message}"
    assert "--list-devices" not in message and "--no-audio" not in message, "a ComfyUI user has no command line"
    assert performances.get("wrong-device") is None


UNKNOWN_STREAM = "no running stream named 'stedy'; queue a flowjam Stream node with "
# id -> (what the error says, the node, its inputs made from the test's fixtures `f`)
BAD_INPUTS = {
    "LoadModel missing checkpoint": (
        "input 'checkpoint'",
        "FlowjamLoadModel",
        lambda f: dict(
            preset="tiny",
            checkpoint=str(f.tmp_path / "missing" / "ace_step_1.5.safetensors"),
            device="cpu",
            dtype="float32",
            backend="eager",
        ),
    ),
    "LoadModel unknown preset": (
        "input 'preset'",
        "FlowjamLoadModel",
        lambda f: dict(preset="huge", checkpoint="none", device="cpu", dtype="float32", backend="eager"),
    ),
    "PrepareSource 3 Hz": (
        "input 'audio'",
        "FlowjamPrepareSource",
        lambda f: dict(model=f.model, audio={"waveform": torch.randn(1, 2, 300), "sample_rate": 3}),
    ),
    "PrepareSource 5 channels": (
        "input 'audio'",
        "FlowjamPrepareSource",
        lambda f: dict(model=f.model, audio={"waveform": torch.randn(1, 5, RATE), "sample_rate": RATE}),
    ),
    "PrepareSource no batch": (
        "input 'audio'",
        "FlowjamPrepareSource",
        lambda f: dict(model=f.model, audio={"waveform": torch.randn(2, RATE), "sample_rate": RATE}),
    ),
    "PrepareSource NaN": (
        "input 'audio'",
        "FlowjamPrepareSource",
        lambda f: dict(model=f.model, audio={"waveform": torch.full((1, 2, RATE), math.nan), "sample_rate": RATE}),
    ),
    "Generate negative seconds": (
        "input 'seconds'",
        "FlowjamGenerate",
        lambda f: dict(model=f.model, conditioning=f.prompt_a, seconds=-1.0, seed=1, steps=2, shift=3.0, denoise=1.0),
    ),
    "Generate denoise without source": (
        "input 'denoise'",
        "FlowjamGenerate",
        lambda f: dict(model=f.model, conditioning=f.prompt_a, seconds=1.0, seed=1, steps=2, shift=3.0, denoise=0.5),
    ),
    "StreamCapture negative seconds": (
        "input 'seconds'",
        "FlowjamStreamCapture",
        lambda f: dict(stream="steady", seconds=-2.0),
    ),
    "CurveWave negative seconds": (
        "input 'seconds'",
        "FlowjamCurveWave",
        lambda f: dict(kind="sine", cycles=1.0, low=0.0, high=1.0, seconds=-1.0),
    ),
    "CurvePoints words": ("input 'points'", "FlowjamCurvePoints", lambda f: dict(points="loud, quiet", seconds=1.0)),
    "TextConditioning blank tags": (
        "input 'tags'",
        "FlowjamTextConditioning",
        lambda f: dict(TEXT_DEFAULTS, model=f.model, tags="  \n"),
    ),
    "TextConditioning unknown task": (
        "input 'task'",
        "FlowjamTextConditioning",
        lambda f: dict(TEXT_DEFAULTS, model=f.model, tags="pads", task="remix"),
    ),
    "ConditioningBlend amount 1.5": (
        "input 'amount'",
        "FlowjamConditioningBlend",
        lambda f: dict(model=f.model, a=f.prompt_a, b=f.prompt_b, amount=1.5),
    ),
    "SharedCurve misspelt knob": (
        "input 'knob'",
        "FlowjamSharedCurve",
        lambda f: dict(
            stream="steady",
            knob="velocity_scael",
            value=1.2,
            curve=node("FlowjamCurveConstant").run(value=1.0, seconds=1.0)[0],
        ),
    ),
    "SharedCurve infinite value": (
        "input 'value'",
        "FlowjamSharedCurve",
        lambda f: dict(stream="steady", knob="velocity_scale", value=math.inf),
    ),
    "Stream blank session_id": (
        "input 'session_id'",
        "FlowjamStream",
        lambda f: dict(f.good_stream, session_id="  "),
    ),
    "Stream negative song_seconds": (
        "input 'song_seconds'",
        "FlowjamStream",
        lambda f: dict(f.good_stream, session_id="steady", song_seconds=-4.0),
    ),
    "Stream unknown cfg_mode": (
        "input 'cfg_mode'",
        "FlowjamStream",
        lambda f: dict(f.good_stream, session_id="steady", cfg_mode="fullest"),
    ),
    "OscBridge port 0": (
        "input 'port'",
        "FlowjamOscBridge",
        lambda f: dict(stream="steady", port=0, feedback="", host="127.0.0.1"),
    ),
    "OscBridge feedback without port": (
        "input 'feedback'",
        "FlowjamOscBridge",
        lambda f: dict(stream="steady", port=free_udp_port(), feedback="localhost", host="127.0.0.1"),
    ),
    "StreamCapture unknown stream": (
        UNKNOWN_STREAM,
        "FlowjamStreamCapture",
        lambda f: dict(stream="stedy", seconds=1.0),
    ),
    "SharedCurve unknown stream": (
        UNKNOWN_STREAM,
        "FlowjamSharedCurve",
        lambda f: dict(stream="stedy", knob="velocity_scale", value=1.0),
    ),
    "OscBridge unknown stream": (
        UNKNOWN_STREAM,
        "FlowjamOscBridge",
        lambda f: dict(stream="stedy", port=free_udp_port(), feedback="", host="127.0.0.1"),
    ),
    "MidiMap unknown stream": (
        UNKNOWN_STREAM,
        "FlowjamMidiMap",
        lambda f: dict(stream="stedy", port="", map_file="", learn=""),
    ),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_inputs_name_the_input_and_leave_a_running_stream_alone(model, prompt_a, prompt_b, tmp_path, case):
    stream(model, prompt_a, "steady", seed=5, denoise=0.6)
    app = performances.get("steady")
    wait_ticks(app, 3)
    knobs, prompts, ticks = app.registry.values(), dict(app.runner._prompts), app.runner.stats.ticks
    good_stream = dict(STREAM_DEFAULTS, model=model, conditioning=prompt_b, seed=9, denoise=0.2)
    fixtures = SimpleNamespace(
        model=model, prompt_a=prompt_a, prompt_b=prompt_b, tmp_path=tmp_path, good_stream=good_stream
    )
    message, node_id, inputs = BAD_INPUTS[case]
    with pytest.raises(NodeInputError, match=message):
        node(node_id).run(**inputs(fixtures))
    wait_ticks(app, 3)
    assert performances.get("steady") is app and app.runner.alive and app.runner.stats.ticks > ticks
    assert app.registry.values() == knobs, "a rejected input changes no knob"
    assert performances.names() == ["steady"] and app.osc is None and app.runner.stats.errors == 0
    assert app.runner._prompts == prompts, "a rejected input changes no prompt"


# ---- regressions: bugs these tests found in nodes/stream_nodes.py and live/app.py -----------------------


def test_a_connected_curve_steers_the_shared_curve(model, prompt_a):
    """Shared curve used to write the scalar knob too; the runner applied it after the curve in the same tick."""
    stream(model, prompt_a, "curve")
    app = performances.get("curve")
    (curve,) = node("FlowjamCurveRamp").run(start=0.5, end=1.5, seconds=2.0)
    node("FlowjamSharedCurve").run(stream="curve", knob="velocity_scale", value=1.0, curve=curve)
    wait_ticks(app, 5)
    applied = app.runner.stream.pipeline.shared_curves()["velocity_scale"].flatten()
    torch.testing.assert_close(applied, curve.flatten().to(applied.dtype))


def test_the_first_generation_uses_the_node_values(model, prompt_a, monkeypatch):
    """Stream used to set its knob values after starting the runner: the first generation had the defaults."""
    requests = []
    make_request = model.make_request

    def spy(*args, **kwargs):
        request = make_request(*args, **kwargs)
        requests.append((request.seed, request.steps))
        return request

    monkeypatch.setattr(model, "make_request", spy)
    stream(model, prompt_a, "first", seed=7, steps=2)
    wait_ticks(performances.get("first"), 3)
    assert requests[0] == (7, 2)


def test_a_rejected_source_leaves_the_prompts_alone(model, prompt_a, prompt_b):
    """Stream used to queue the new prompts before a source of the wrong length was refused."""
    stream(model, prompt_a, "cover", song_seconds=2.0)
    app = performances.get("cover")
    (short,) = node("FlowjamPrepareSource").run(
        model=model, audio={"waveform": 0.1 * torch.randn(1, 2, RATE), "sample_rate": RATE}
    )
    with pytest.raises(NodeInputError, match="input 'source'"):
        stream(model, prompt_b, "cover", source=short)
    wait_ticks(app, 3)
    assert app.runner._prompts["a"] is prompt_a


def test_a_busy_osc_port_is_a_node_input_error_and_the_bridge_recovers(model, prompt_a):
    """A busy port used to raise OSError after the old bridge had been stopped; later queues then failed."""
    stream(model, prompt_a, "osc")
    port = free_udp_port()
    node("FlowjamOscBridge").run(stream="osc", port=port, feedback="", host="127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as busy:
        busy.bind(("127.0.0.1", 0))
        with pytest.raises(NodeInputError, match="input 'port'"):
            node("FlowjamOscBridge").run(stream="osc", port=busy.getsockname()[1], feedback="", host="127.0.0.1")
    node("FlowjamOscBridge").run(stream="osc", port=port, feedback="", host="127.0.0.1")
    assert performances.get("osc").osc.address == ("127.0.0.1", port)


def test_a_requeued_osc_feedback_address_applies(model, prompt_a):
    """OSC bridge used to rebuild the bridge only when the port changed: a new feedback address was ignored."""
    stream(model, prompt_a, "feedback")
    port = free_udp_port()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.settimeout(2)
        node("FlowjamOscBridge").run(stream="feedback", port=port, feedback="127.0.0.1:9", host="127.0.0.1")
        node("FlowjamOscBridge").run(
            stream="feedback", port=port, feedback=f"127.0.0.1:{listener.getsockname()[1]}", host="127.0.0.1"
        )
        performances.get("feedback").registry.set("volume", 0.5)
        assert b"/flowjam/feedback/knob/volume" in listener.recvfrom(4096)[0]


def lm_structure(model, **values):
    defaults = dict(
        caption="dark techno, rolling bass",
        seconds=10.0,
        lyrics="",
        bpm=0,
        key="",
        time_signature="",
        seed=0,
        cfg=2.0,
        temperature=0.85,
        top_p=0.9,
        lm_checkpoint="none",
        lm_preset="tiny",
    )
    return node("FlowjamLMStructure").run(model=model, **{**defaults, **values})


def test_lm_structure_keeps_given_fields_and_lets_the_lm_fill_the_rest(model):
    structure, metadata = lm_structure(model, bpm=100, seconds=10.0)
    assert len(structure.codes) == 50 and structure.seconds == 10.0
    assert (
        "bpm: 100" in metadata
        and "keyscale: " in metadata
        and "timesignature: " in metadata
        and "duration: 10" in metadata
    )
    again, _ = lm_structure(model, bpm=100, seconds=10.0)
    assert torch.equal(again.codes, structure.codes), "same seed, same structure"


@pytest.fixture(scope="module")
def ten_second_structure(model):
    return lm_structure(model, seconds=10.0)[0]


def one_second_source(model):
    return node("FlowjamPrepareSource").run(
        model=model, audio={"waveform": torch.randn(1, 2, RATE), "sample_rate": RATE}
    )[0]


# id -> (a call that must be refused, given the test's fixtures `f`; what the error says)
BAD_LM_INPUTS = {
    "empty caption": (lambda f: lm_structure(f.model, caption="  "), "the prompt is empty"),
    "5 s": (lambda f: lm_structure(f.model, seconds=5.0), "'seconds'"),
    "cfg 0.5": (lambda f: lm_structure(f.model, cfg=0.5), "cfg must be >= 1"),
    "key H major": (lambda f: lm_structure(f.model, key="H major"), "key"),
    "lm_preset lm-9b": (lambda f: lm_structure(f.model, lm_preset="lm-9b"), "'lm_preset' must be one of tiny"),
    "missing lm_checkpoint": (
        lambda f: lm_structure(f.model, lm_checkpoint=str(f.tmp_path / "nope.safetensors")),
        "text_encoders",
    ),
    "Generate past the structure": (
        lambda f: generate(f.model, f.prompt_a, seconds=12.0, structure=f.structure),
        "'structure' covers 10 s but 12 s",
    ),
    "Generate with structure and source": (
        lambda f: generate(f.model, f.prompt_a, structure=f.structure, source=one_second_source(f.model)),
        "either 'source'",
    ),
    "Stream past the structure": (
        lambda f: stream(f.model, f.prompt_a, "lm-bad", lm_structure=f.structure, song_seconds=20.0),
        "'structure' covers 10 s",
    ),
}


@pytest.mark.parametrize("case", BAD_LM_INPUTS)
def test_lm_structure_and_its_consumers_name_bad_inputs(model, prompt_a, ten_second_structure, tmp_path, case):
    fixtures = SimpleNamespace(model=model, prompt_a=prompt_a, structure=ten_second_structure, tmp_path=tmp_path)
    call, message = BAD_LM_INPUTS[case]
    with pytest.raises(NodeInputError, match=message):
        call(fixtures)
    assert performances.get("lm-bad") is None, "a rejected structure must not start a stream"


def test_generate_follows_an_lm_structure(model, prompt_a):
    structure, _ = lm_structure(model, seconds=10.0)
    other, _ = lm_structure(model, seconds=10.0, seed=5)
    with_first = generate(model, prompt_a, seconds=4.0, structure=structure)[1]["samples"]
    with_other = generate(model, prompt_a, seconds=4.0, structure=other)[1]["samples"]
    plain = generate(model, prompt_a, seconds=4.0)[1]["samples"]
    assert (with_first - plain).abs().mean() > 1e-3 and (with_first - with_other).abs().mean() > 1e-3


def test_a_stream_follows_an_lm_structure_until_it_is_disconnected(model, prompt_a):
    structure, _ = lm_structure(model, seconds=10.0)
    stream(model, prompt_a, "lm", lm_structure=structure)
    app = performances.get("lm")
    wait_ticks(app, 2)
    assert torch.equal(app.runner._hints_context, model.codes_context(structure.codes, app.runner.frames))
    stream(model, prompt_a, "lm")
    wait_for(lambda: app.runner._hints_context is None, 10, "the disconnected structure to be dropped")
    assert performances.get("lm") is app and app.runner.stats.errors == 0
    node("FlowjamStreamStop").run(stream="lm")


class Cancelled(Exception):
    """What ComfyUI's throw_exception_if_processing_interrupted raises once Cancel was pressed."""


@pytest.fixture
def comfyui_progress(monkeypatch):
    """ComfyUI's progress bar and Cancel as a node reaches them (comfy.utils.ProgressBar and
    comfy.model_management.throw_exception_if_processing_interrupted): each bar keeps its total and its updates;
    with `cancel_after` set, Cancel is pressed once the newest bar has had that many updates."""
    hooks = SimpleNamespace(bars=[], cancel_after=None)

    class ProgressBar:
        def __init__(self, total, node_id=None):
            self.total, self.updates = total, []
            hooks.bars.append(self)

        def update_absolute(self, value, total=None, preview=None):
            self.updates.append((value, total))

    def throw_exception_if_processing_interrupted():
        if hooks.cancel_after is not None and len(hooks.bars[-1].updates) >= hooks.cancel_after:
            raise Cancelled()

    comfy = types.ModuleType("comfy")
    comfy.utils = types.ModuleType("comfy.utils")
    comfy.utils.ProgressBar = ProgressBar
    comfy.model_management = types.ModuleType("comfy.model_management")
    comfy.model_management.throw_exception_if_processing_interrupted = throw_exception_if_processing_interrupted
    for module in (comfy, comfy.utils, comfy.model_management):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    return hooks


def test_cancel_stops_lm_structure_at_its_next_code_and_its_bar_counts_the_codes(model, comfyui_progress):
    """LM structure showed no progress and ran to its end whatever Cancel said (minutes with the real 1.7B/4B LM)."""
    given = dict(bpm=120, key="C major", time_signature="4")  # no metadata to write: the bar is the codes'
    lm_structure(model, seconds=10.0, **given)
    (bar,) = comfyui_progress.bars
    assert bar.total == 50 and bar.updates == [(done, 50) for done in range(1, 51)], "one update per code of 50"
    comfyui_progress.cancel_after = 20
    with pytest.raises(Cancelled):
        lm_structure(model, seconds=120.0, **given)
    bar = comfyui_progress.bars[-1]
    assert bar.total == 600 and bar.updates[-1] == (20, 600) and len(bar.updates) == 20, (
        f"Cancel after code 20 of 600 did not stop the LM there: {bar.updates[-3:]}"
    )


def test_stream_capture_waits_with_a_progress_bar_that_cancel_stops(model, prompt_a, comfyui_progress):
    """The first queue of a live graph used to save a 0.02 s near-silent clip: Stream capture returned as soon as
    the new stream's clock had played one block, before its first generation was even decoded."""
    stream(model, prompt_a, "capture-wait", song_seconds=4.0)
    comfyui_progress.cancel_after = 3
    with pytest.raises(Cancelled):
        node("FlowjamStreamCapture").run(stream="capture-wait", seconds=3.0)
    (bar,) = comfyui_progress.bars
    assert bar.total == 3 * RATE and len(bar.updates) == 3 and bar.updates[-1][0] < 3 * RATE
    comfyui_progress.cancel_after = None
    audio, _ = node("FlowjamStreamCapture").run(stream="capture-wait", seconds=3.0)
    assert audio["waveform"].shape == (1, 2, 3 * RATE) and comfyui_progress.bars[-1].updates[-1] == (3 * RATE,) * 2

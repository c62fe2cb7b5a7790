"""The example workflows in workflows/: they load (node types, links, widgets as ComfyUI's frontend saves them),
convert to ComfyUI's API prompt format, and run on the tiny preset on the CPU without ComfyUI (tests/workflow_runner.py;
ComfyUI's LoadAudio/SaveAudio/PreviewAudio are WAV stand-ins). Live streams run with audio_device "none"."""

import copy
import json
import math
import socket
import time
from pathlib import Path

import pytest
import torch
from flowjam.engine.audio_io import read_wav, write_wav
from flowjam.engine.live import sessions
from pythonosc.osc_message import OscMessage
from pythonosc.udp_client import SimpleUDPClient
from workflow_runner import CONTROL_VALUES, WorkflowRunner, load_workflow, to_api_format, with_widget

WORKFLOWS = Path(__file__).resolve().parent.parent / "workflows"
NAMES = (
    "flowjam_oneshot_render.json",
    "flowjam_text_live_jam.json",
    "flowjam_cover_live.json",
    "flowjam_prompt_blend_osc.json",
    "flowjam_lm_structure_render.json",
)
RATE = 48_000
EXAMPLE = "flowjam_example.wav"
EXAMPLE_SECONDS = 4.0


@pytest.fixture(scope="module")
def comfy_dirs(tmp_path_factory):
    """ComfyUI's input/output/temp folders; the input holds the example song (a 4 s stereo chord at 44.1 kHz)."""
    root = tmp_path_factory.mktemp("comfyui")
    t = torch.arange(int(44_100 * EXAMPLE_SECONDS)) / 44_100
    chord = 0.3 * torch.stack(
        [
            torch.sin(2 * math.pi * 220 * t) + torch.sin(2 * math.pi * 277 * t),
            torch.sin(2 * math.pi * 330 * t) + torch.sin(2 * math.pi * 165 * t),
        ]
    )
    write_wav(root / "input" / EXAMPLE, chord, 44_100)
    return root


@pytest.fixture(scope="module")
def runner(comfy_dirs):
    return WorkflowRunner(comfy_dirs / "input", comfy_dirs / "output", comfy_dirs / "temp")


@pytest.fixture(autouse=True)
def stop_streams():
    yield
    sessions.stop_all()


def workflow(name: str) -> dict:
    return load_workflow(WORKFLOWS / name)


def nodes_of(wf: dict, node_type: str) -> list[dict]:
    return [n for n in wf["nodes"] if n["type"] == node_type]


def widgets(runner: WorkflowRunner, node: dict) -> dict:
    definition = runner.definition(node["type"])
    return {w.name: v for w, v in zip(definition.widgets, node["widgets_values"]) if not w.frontend_only}


def source_of(wf: dict, node: dict, input_name: str) -> dict | None:
    """The node feeding `input_name` of `node`, or None if unconnected."""
    link_id = next(e["link"] for e in node["inputs"] if e["name"] == input_name)
    if link_id is None:
        return None
    link = next(link for link in wf["links"] if link[0] == link_id)
    return next(n for n in wf["nodes"] if n["id"] == link[1])


def disconnect(wf: dict, node: dict, input_name: str) -> None:
    """Remove the link into `input_name` of `node`, everywhere the UI format records it."""
    entry = next(e for e in node["inputs"] if e["name"] == input_name)
    link_id, entry["link"] = entry["link"], None
    wf["links"] = [link for link in wf["links"] if link[0] != link_id]
    for other in wf["nodes"]:
        for output in other["outputs"]:
            if output["links"] and link_id in output["links"]:
                output["links"].remove(link_id)


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def assert_audio(audio, samples: int | None = None, minimum: int | None = None, maximum: int | None = None) -> None:
    """ComfyUI AUDIO at 48 kHz, stereo, finite and audible, of the given length (or within bounds)."""
    assert (
        set(audio) == {"waveform", "sample_rate"} and audio["sample_rate"] == RATE and type(audio["sample_rate"]) is int
    )
    waveform = audio["waveform"]
    assert isinstance(waveform, torch.Tensor) and waveform.dtype == torch.float32 and waveform.shape[:2] == (1, 2)
    if samples is not None:
        assert waveform.shape[2] == samples
    if minimum is not None:
        assert minimum <= waveform.shape[2] <= maximum, waveform.shape
    assert torch.isfinite(waveform).all()
    assert waveform.square().mean().sqrt() > 1e-3, "silent audio"


# ---- structure ---------------------------------------------------------------------------------------------------


def test_the_workflows_ship_and_the_readme_lists_each():
    shipped = sorted(p.name for p in WORKFLOWS.glob("*.json"))
    assert shipped == sorted(NAMES)
    readme = (WORKFLOWS / "README.md").read_text()
    for name in NAMES:
        assert sum(line.count(f"`{name}`") for line in readme.splitlines()) == 1, f"README.md needs one line for {name}"


@pytest.mark.parametrize("name", NAMES)
def test_workflow_loads_as_comfyui_would(name, runner):
    wf = workflow(name)
    assert runner.problems(wf) == []
    assert wf["version"] == 0.4 and isinstance(wf["extra"].get("note"), str) and len(wf["extra"]["note"]) > 40
    for node in wf["nodes"]:
        definition = runner.definition(node["type"])
        assert node["mode"] == 0 and node["flags"] == {} and len(node["pos"]) == 2 and len(node["size"]) == 2
        assert [o["slot_index"] for o in node["outputs"]] == list(range(len(definition.outputs)))
        for widget, value in zip(definition.widgets, node["widgets_values"]):
            if widget.name == "control_after_generate":
                assert value == "fixed", "a re-queued graph must keep its seed"
    assert sorted(n["order"] for n in wf["nodes"]) == list(range(len(wf["nodes"])))
    order = {n["id"]: n["order"] for n in wf["nodes"]}
    assert all(order[link[1]] < order[link[3]] for link in wf["links"]), "order must list producers first"
    for model in nodes_of(wf, "FlowjamLoadModel"):
        assert widgets(runner, model) == {
            "preset": "tiny",
            "checkpoint": "none",
            "device": "cpu",
            "dtype": "float32",
            "backend": "eager",
        }


@pytest.mark.parametrize("name", NAMES)
def test_workflow_converts_to_the_api_prompt_format(name, runner):
    wf = workflow(name)
    prompt = to_api_format(wf, runner)
    json.dumps(prompt)  # what gets POSTed
    assert set(prompt) == {str(n["id"]) for n in wf["nodes"]}
    links = {link[0]: link for link in wf["links"]}
    for node in wf["nodes"]:
        entry = prompt[str(node["id"])]
        definition = runner.definition(node["type"])
        assert entry["class_type"] == node["type"] and entry["_meta"]["title"]
        expected = {w.name for w in definition.widgets if not w.frontend_only}
        expected |= {e["name"] for e in node["inputs"] if e["link"] is not None}
        assert set(entry["inputs"]) == expected
        assert "control_after_generate" not in entry["inputs"] and "upload" not in entry["inputs"]
        required = definition.cls.INPUT_TYPES()["required"]
        assert set(required) <= set(entry["inputs"]), "ComfyUI rejects a prompt that misses a required input"
        for input_entry in node["inputs"]:
            if input_entry["link"] is not None:
                link = links[input_entry["link"]]
                assert entry["inputs"][input_entry["name"]] == [str(link[1]), link[2]]
        for widget, value in zip(definition.widgets, node["widgets_values"]):
            if not widget.frontend_only:
                assert entry["inputs"][widget.name] == value


def test_oneshot_render_graph(runner):
    wf = workflow("flowjam_oneshot_render.json")
    (generate,) = nodes_of(wf, "FlowjamGenerate")
    assert 6.0 <= widgets(runner, generate)["seconds"] <= 10.0
    assert source_of(wf, generate, "conditioning")["type"] == "FlowjamTextConditioning"
    assert source_of(wf, generate, "model")["type"] == "FlowjamLoadModel"
    for kind in ("SaveAudio", "PreviewAudio"):
        (node,) = nodes_of(wf, kind)
        assert source_of(wf, node, "audio") is generate


def test_lm_structure_render_graph(runner):
    wf = workflow("flowjam_lm_structure_render.json")
    (generate,) = nodes_of(wf, "FlowjamGenerate")
    (lm,) = nodes_of(wf, "FlowjamLMStructure")
    assert source_of(wf, generate, "structure") is lm
    assert widgets(runner, lm)["seconds"] >= widgets(runner, generate)["seconds"], "the codes must cover the render"
    assert widgets(runner, lm)["lm_preset"] == "tiny" and widgets(runner, lm)["lm_checkpoint"] == "none"


def test_text_live_jam_graph(runner):
    wf = workflow("flowjam_text_live_jam.json")
    (stream,) = nodes_of(wf, "FlowjamStream")
    values = widgets(runner, stream)
    assert (values["session_id"], values["audio_device"], values["song_seconds"], values["depth"]) == (
        "jam",
        "",
        20.0,
        4,
    )
    a, b = source_of(wf, stream, "conditioning"), source_of(wf, stream, "conditioning_b")
    assert a["type"] == b["type"] == "FlowjamTextConditioning" and a is not b
    assert widgets(runner, a)["tags"] != widgets(runner, b)["tags"]
    (shared,) = nodes_of(wf, "FlowjamSharedCurve")
    assert widgets(runner, shared)["knob"] == "velocity_scale" and source_of(wf, shared, "stream") is stream
    assert source_of(wf, shared, "curve")["type"] == "FlowjamCurveWave"
    (capture,) = nodes_of(wf, "FlowjamStreamCapture")
    assert widgets(runner, capture)["seconds"] == 8.0 and source_of(wf, capture, "stream") is shared
    (preview,) = nodes_of(wf, "PreviewAudio")
    assert source_of(wf, preview, "audio") is capture


def test_cover_live_graph(runner):
    wf = workflow("flowjam_cover_live.json")
    (load,) = nodes_of(wf, "LoadAudio")
    assert load["widgets_values"] == [EXAMPLE, ""]
    (prepare,) = nodes_of(wf, "FlowjamPrepareSource")
    assert source_of(wf, prepare, "audio") is load and source_of(wf, prepare, "latent") is None
    (text,) = nodes_of(wf, "FlowjamTextConditioning")
    assert widgets(runner, text)["task"] == "cover"
    (stream,) = nodes_of(wf, "FlowjamStream")
    assert widgets(runner, stream)["session_id"] == "cover"
    assert source_of(wf, stream, "source") is prepare and source_of(wf, stream, "conditioning") is text
    (capture,) = nodes_of(wf, "FlowjamStreamCapture")
    (save,) = nodes_of(wf, "SaveAudio")
    assert source_of(wf, capture, "stream") is stream and source_of(wf, save, "audio") is capture


def test_prompt_blend_osc_graph(runner):
    wf = workflow("flowjam_prompt_blend_osc.json")
    (stream,) = nodes_of(wf, "FlowjamStream")
    assert 0.0 < widgets(runner, stream)["prompt_blend"] < 1.0
    assert source_of(wf, stream, "conditioning_b")["type"] == "FlowjamTextConditioning"
    (osc,) = nodes_of(wf, "FlowjamOscBridge")
    assert widgets(runner, osc) == {"port": 9000, "feedback": "127.0.0.1:9001", "host": "127.0.0.1"}
    (capture,) = nodes_of(wf, "FlowjamStreamCapture")
    (preview,) = nodes_of(wf, "PreviewAudio")
    assert source_of(wf, osc, "stream") is stream and source_of(wf, capture, "stream") is osc
    assert source_of(wf, preview, "audio") is capture


def test_runner_rejects_what_comfyui_would_reject(runner):
    """The checks above would catch a broken graph: each breakage is reported, naming what is wrong."""
    good = workflow("flowjam_text_live_jam.json")
    assert runner.problems(good) == []

    def broken(change) -> list[str]:
        wf = json.loads(json.dumps(good))
        change(wf)
        return runner.problems(wf)

    node = lambda wf, kind: nodes_of(wf, kind)[0]  # noqa: E731
    assert any(
        "unknown node type" in p
        for p in broken(lambda wf: node(wf, "FlowjamCurveWave").update(type="FlowjamCurveWobble"))
    )
    assert any("typed FLOWJAM_STREAM" in p for p in broken(lambda wf: wf["links"][-1].__setitem__(5, "FLOWJAM_STREAM")))
    assert any("has 11 values" in p for p in broken(lambda wf: node(wf, "FlowjamStream")["widgets_values"].pop()))
    assert any(
        "'depth'" in p and "outside" in p
        for p in broken(lambda wf: node(wf, "FlowjamStream")["widgets_values"].__setitem__(2, 9))
    )
    assert any(
        "'kind'" in p
        for p in broken(lambda wf: node(wf, "FlowjamCurveWave")["widgets_values"].__setitem__(0, "wobble"))
    )
    assert any(
        "'session_id'" in p for p in broken(lambda wf: node(wf, "FlowjamStream")["widgets_values"].__setitem__(0, 7))
    )
    assert any(
        "control_after_generate" in p
        for p in broken(lambda wf: node(wf, "FlowjamStream")["widgets_values"].__setitem__(6, 42))
    )
    assert any(
        "required input 'conditioning'" in p
        for p in broken(lambda wf: disconnect(wf, node(wf, "FlowjamStream"), "conditioning"))
    )
    assert any(
        "does not list it" in p for p in broken(lambda wf: node(wf, "FlowjamLoadModel")["outputs"][0]["links"].pop())
    )
    assert any(
        "'checkpoint'" in p
        for p in broken(lambda wf: node(wf, "FlowjamLoadModel")["widgets_values"].__setitem__(1, "ace.safetensors"))
    )
    assert (
        "control_after_generate" in [w.name for w in runner.definition("FlowjamGenerate").widgets]
        and CONTROL_VALUES[0] == "fixed"
    )


@pytest.mark.parametrize("frontend", ["1.27", "1.58", "old"])
def test_runner_accepts_the_layouts_real_frontends_save(frontend, runner):
    """Re-saved from the browser, the cover graph gets a few frontend-only values; it still loads and converts the same."""
    shipped = workflow("flowjam_cover_live.json")
    resaved = json.loads(json.dumps(shipped))
    load, stream, prepare = (
        nodes_of(resaved, kind)[0] for kind in ("LoadAudio", "FlowjamStream", "FlowjamPrepareSource")
    )
    load["widgets_values"] = {"1.27": [EXAMPLE, None, ""], "1.58": [EXAMPLE, ""], "old": [EXAMPLE]}[frontend]
    stream["widgets_values"].append("")  # web/flowjam.js's live panel
    del prepare["widgets_values"]  # a node without widgets saves none
    assert runner.problems(resaved) == []
    assert to_api_format(resaved, runner) == to_api_format(shipped, runner)
    assert widgets(runner, stream)["session_id"] == "cover"
    changed = with_widget(resaved, "FlowjamStream", "audio_device", "none", runner)
    assert to_api_format(changed, runner)[str(stream["id"])]["inputs"]["audio_device"] == "none"
    load["widgets_values"] = [EXAMPLE, "playing", ""]
    assert any("'audioUI'" in p for p in runner.problems(resaved))


# ---- execution (tiny preset, CPU) --------------------------------------------------------------------------------


def live(wf: dict, runner: WorkflowRunner) -> dict:
    """No sound card in CI: the stream plays into a silent real-time clock."""
    return with_widget(wf, "FlowjamStream", "audio_device", "none", runner)


def test_oneshot_render_runs_and_saves_8_seconds(runner, comfy_dirs):
    wf = workflow("flowjam_oneshot_render.json")
    run = runner.execute(wf)
    (save,) = nodes_of(wf, "SaveAudio")
    (preview,) = nodes_of(wf, "PreviewAudio")
    (generate,) = nodes_of(wf, "FlowjamGenerate")
    samples = round(widgets(runner, generate)["seconds"] * 25) * 1920
    for node in (save, preview):
        assert_audio(run.inputs[node["id"]]["audio"], samples=samples)
    latent = run.outputs[generate["id"]][1]
    assert latent["type"] == "audio" and latent["samples"].shape == (1, 64, samples // 1920)
    (saved,) = run.ui[save["id"]]["audio"]
    audio, rate = read_wav(comfy_dirs / "output" / saved["subfolder"] / saved["filename"])
    assert rate == RATE and audio.shape == (2, samples) and saved["type"] == "output"
    (previewed,) = run.ui[preview["id"]]["audio"]
    assert previewed["type"] == "temp"


def test_lm_structure_render_runs_and_the_codes_shape_the_song(runner, comfy_dirs):
    wf = workflow("flowjam_lm_structure_render.json")
    run = runner.execute(wf)
    (generate,) = nodes_of(wf, "FlowjamGenerate")
    (lm,) = nodes_of(wf, "FlowjamLMStructure")
    samples = round(widgets(runner, generate)["seconds"] * 25) * 1920
    assert_audio(captured(wf, run, "SaveAudio"), samples=samples)
    structure, metadata = run.outputs[lm["id"]]
    assert len(structure.codes) == widgets(runner, lm)["seconds"] * 5
    assert metadata.startswith("bpm: ") and "\nkeyscale: " in metadata and "\ntimesignature: " in metadata, metadata
    without = runner.execute(disconnected(wf, "FLOWJAM_STRUCTURE")).outputs[generate["id"]][1]["samples"]
    with_codes = run.outputs[generate["id"]][1]["samples"]
    assert (with_codes - without).abs().mean() > 1e-3, "the LM structure did not change the render"


def disconnected(wf: dict, link_type: str) -> dict:
    """A copy of the graph with every link of `link_type` removed, as a user unplugging those wires would save it."""
    wf = copy.deepcopy(wf)
    gone = {link[0] for link in wf["links"] if link[5] == link_type}
    wf["links"] = [link for link in wf["links"] if link[0] not in gone]
    for node in wf["nodes"]:
        for entry in node["inputs"]:
            entry["link"] = None if entry["link"] in gone else entry["link"]
        for output in node["outputs"]:
            kept = [link for link in output["links"] or () if link not in gone]
            output["links"] = kept or None
    return wf


def run_live(wf: dict, runner: WorkflowRunner, session: str, played_s: float):
    """Queue once (starts the stream), wait until it has played `played_s`, queue again (updates it in place)."""
    first = runner.execute(wf)
    app = sessions.get(session)
    assert app is not None and app.runner.alive
    wait_for(lambda: app.buffer.playhead_frames >= played_s * RATE, 30, f"{played_s} s of '{session}' to play")
    second = runner.execute(wf)
    assert sessions.get(session) is app and app.runner.alive, (
        "a re-queue must update the running stream, not replace it"
    )
    ticks = app.runner.stats.ticks
    wait_for(lambda: app.runner.stats.ticks > ticks + 1, 10, "the stream to keep ticking (and take the new values)")
    return first, second, app


def captured(wf: dict, run, output_type: str):
    (node,) = nodes_of(wf, output_type)
    return run.inputs[node["id"]]["audio"]


def test_text_live_jam_runs_and_captures_8_seconds(runner):
    wf = live(workflow("flowjam_text_live_jam.json"), runner)
    first, second, app = run_live(wf, runner, "jam", played_s=8.3)
    early = captured(wf, first, "PreviewAudio")
    assert early["waveform"].shape[:2] == (1, 2) and early["waveform"].shape[2] < 8 * RATE, (
        "only what has played so far"
    )
    assert_audio(captured(wf, second, "PreviewAudio"), samples=8 * RATE)
    (text_a,) = [n for n in wf["nodes"] if n.get("title", "").endswith("(A)")]
    assert app.registry.get("velocity_scale") == 1.0 and app.registry.get("depth") == 4
    assert app.runner.frames == 20 * 25 and app.runner.stats.errors == 0
    assert app.runner._prompts["a"] is second.outputs[text_a["id"]][0], (
        "the re-queued prompt A is the stream's prompt A"
    )


def test_cover_live_runs_on_the_loaded_song(runner, comfy_dirs):
    wf = live(workflow("flowjam_cover_live.json"), runner)
    first, second, app = run_live(wf, runner, "cover", played_s=EXAMPLE_SECONDS + 0.3)
    (load,) = nodes_of(wf, "LoadAudio")
    loaded = second.outputs[load["id"]][0]
    assert loaded["sample_rate"] == 44_100 and loaded["waveform"].shape == (1, 2, int(44_100 * EXAMPLE_SECONDS))
    assert app.runner.frames == EXAMPLE_SECONDS * 25, "the loop is as long as the source"
    # 8 s asked of a 4 s loop: capped at the loop minus the window the runner is writing (which grows on a slow CPU)
    assert_audio(captured(wf, second, "SaveAudio"), minimum=int(1.5 * RATE), maximum=int(EXAMPLE_SECONDS * RATE) - 1)
    (save,) = nodes_of(wf, "SaveAudio")
    files = [entry["filename"] for run in (first, second) for entry in run.ui[save["id"]]["audio"]]
    assert len(set(files)) == 2 and all((comfy_dirs / "output" / "audio" / f).is_file() for f in files)
    assert app.runner.stats.errors == 0


def test_prompt_blend_osc_runs_and_a_controller_can_play_it(runner):
    port, feedback = free_udp_port(), socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    feedback.bind(("127.0.0.1", 0))
    feedback.settimeout(5)
    wf = live(workflow("flowjam_prompt_blend_osc.json"), runner)
    wf = with_widget(wf, "FlowjamOscBridge", "port", port, runner)  # 9000 may be taken on a CI machine
    wf = with_widget(wf, "FlowjamOscBridge", "feedback", f"127.0.0.1:{feedback.getsockname()[1]}", runner)
    with feedback:
        first, second, app = run_live(wf, runner, "blend", played_s=8.3)
        assert_audio(captured(wf, second, "PreviewAudio"), samples=8 * RATE)
        assert app.registry.get("prompt_blend") == 0.5 and app.osc.address == ("127.0.0.1", port)
        SimpleUDPClient("127.0.0.1", port).send_message("/flowjam/blend/knob/prompt_blend", 0.8)
        wait_for(lambda: app.registry.get("prompt_blend") == pytest.approx(0.8), 5, "the OSC knob to apply")
        received = []
        while not any(m.address.endswith("/knob/prompt_blend") and m.params == [pytest.approx(0.8)] for m in received):
            received.append(OscMessage(feedback.recvfrom(4096)[0]))  # the feedback port hears every applied value
        assert all(m.address.startswith("/flowjam/blend/") for m in received)

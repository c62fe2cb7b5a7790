"""The example workflows in workflows/: they load (node types, links, widgets as ComfyUI's frontend saves them),
convert to ComfyUI's API prompt format, and run on the tiny preset on the CPU without ComfyUI (tests/workflow_runner.py;
ComfyUI's LoadAudio/SaveAudio/PreviewAudio are WAV stand-ins). Live streams run with audio_device "none". Their nodes
do not overlap as the frontend draws them, a Stream stop comes after every node that uses its stream, and each
ships the template thumbnail ComfyUI shows for it."""

import copy
import json
import math
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from flowjam.engine.audio.files import read_audio, write_wav
from flowjam.live import performances
from flowjam.nodes.spec import NodeInputError
from helpers import free_udp_port, wait_for
from pythonosc.osc_message import OscMessage
from pythonosc.udp_client import SimpleUDPClient
from workflow_runner import (
    BADGE_BAND,
    CONTROL_VALUES,
    VIRTUAL_NODES,
    WorkflowRunner,
    draw_thumbnail,
    jpeg_size,
    load_workflow,
    min_body_height,
    overlaps,
    runs,
    template_heading,
    to_api_format,
    with_widget,
)

WORKFLOWS = Path(__file__).resolve().parent.parent / "workflows"
ONESHOT = "flowjam one-shot render.json"  # ComfyUI titles a pack's template by its file name
TEXT_JAM = "flowjam live text jam.json"
COVER = "flowjam live cover.json"
BLEND_OSC = "flowjam prompt blend over OSC.json"
LM_RENDER = "flowjam song structure from the 5 Hz LM.json"
LORA = "flowjam live LoRA jam.json"
NAMES = (ONESHOT, TEXT_JAM, COVER, BLEND_OSC, LM_RENDER, LORA)
RATE = 48_000
EXAMPLE = "flowjam_example.wav"  # a user's own song in ComfyUI/input, for the cover graph with Load Audio
EXAMPLE_SECONDS = 4.0
SONG_SECONDS = 8.0  # the cover graph's Example song: 4 bars at 120 bpm


@pytest.fixture(scope="module")
def comfy_dirs(tmp_path_factory):
    """ComfyUI's input/output/temp folders; the input holds a user's song (a 4 s stereo chord at 44.1 kHz)."""
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


pytestmark = pytest.mark.usefixtures("stop_streams")


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


LIVE_NAMES = tuple(n for n in NAMES if '"FlowjamStream"' in (WORKFLOWS / n).read_text())


def test_the_workflows_ship_and_the_readme_lists_each():
    shipped = sorted(p.name for p in WORKFLOWS.glob("*.json"))
    assert shipped == sorted(NAMES)
    assert sorted(p.name for p in WORKFLOWS.glob("*.jpg")) == sorted(n.replace(".json", ".jpg") for n in NAMES)
    readme = (WORKFLOWS / "README.md").read_text()
    for name in NAMES:
        assert sum(line.count(f"`{name}`") for line in readme.splitlines()) == 1, f"README.md needs one line for {name}"


@pytest.mark.parametrize("name", NAMES)
def test_workflow_loads_as_comfyui_would(name, runner):
    wf = workflow(name)
    assert runner.problems(wf) == []
    assert wf["version"] == 0.4 and isinstance(wf["extra"].get("note"), str) and len(wf["extra"]["note"]) > 40
    (note,) = nodes_of(wf, "MarkdownNote")
    assert wf["extra"]["note"] in note["widgets_values"][0], "the note on the canvas describes the workflow"
    for node in wf["nodes"]:
        assert node["flags"] == {} and len(node["pos"]) == 2 and len(node["size"]) == 2
        assert node["mode"] == (4 if node["type"] == "FlowjamStreamStop" else 0), "only a Stream stop is bypassed"
        if node["type"] in VIRTUAL_NODES:
            continue
        definition = runner.definition(node["type"])
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
    assert set(prompt) == {str(n["id"]) for n in wf["nodes"] if runs(n)}, "notes and bypassed nodes are left out"
    links = {link[0]: link for link in wf["links"]}
    for node in filter(runs, wf["nodes"]):
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
    wf = workflow(ONESHOT)
    (generate,) = nodes_of(wf, "FlowjamGenerate")
    assert 6.0 <= widgets(runner, generate)["seconds"] <= 10.0
    assert source_of(wf, generate, "conditioning")["type"] == "FlowjamTextConditioning"
    assert source_of(wf, generate, "model")["type"] == "FlowjamLoadModel"
    for kind in ("SaveAudio", "PreviewAudio"):
        (node,) = nodes_of(wf, kind)
        assert source_of(wf, node, "audio") is generate


def test_lora_live_graph(runner):
    """Two chained LoRA nodes between Load model and the stream (set to 'none' as shipped: the tests have no LoRA
    files in a loras/ folder; the LoRA nodes' effect is tested in test_lora_nodes.py)."""
    wf = workflow(LORA)
    (stream,) = nodes_of(wf, "FlowjamStream")
    second = source_of(wf, stream, "model")
    assert second["type"] == "FlowjamLora"
    first = source_of(wf, second, "model")
    assert first["type"] == "FlowjamLora" and source_of(wf, first, "model")["type"] == "FlowjamLoadModel"
    assert [widgets(runner, n)["mode"] for n in (first, second)] == ["live", "live"]
    assert widgets(runner, stream)["session_id"] == "lora"


def test_lm_structure_render_graph(runner):
    wf = workflow(LM_RENDER)
    (generate,) = nodes_of(wf, "FlowjamGenerate")
    (lm,) = nodes_of(wf, "FlowjamLMStructure")
    assert source_of(wf, generate, "structure") is lm
    assert widgets(runner, lm)["seconds"] >= widgets(runner, generate)["seconds"], "the codes must cover the render"
    assert widgets(runner, lm)["lm_preset"] == "tiny" and widgets(runner, lm)["lm_checkpoint"] == "none"


def test_text_live_jam_graph(runner):
    wf = workflow(TEXT_JAM)
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
    (stop,) = nodes_of(wf, "FlowjamStreamStop")
    assert source_of(wf, stop, "stream") is capture


def test_cover_live_graph(runner):
    """The song comes from Example song (no file to find); the note says how to cover your own."""
    wf = workflow(COVER)
    (song,) = nodes_of(wf, "FlowjamExampleSong")
    assert widgets(runner, song) == {"bars": 4, "bpm": 120}
    assert "connect a Load Audio instead" in wf["extra"]["note"]
    (prepare,) = nodes_of(wf, "FlowjamPrepareSource")
    assert source_of(wf, prepare, "audio") is song and source_of(wf, prepare, "latent") is None
    (text,) = nodes_of(wf, "FlowjamTextConditioning")
    assert widgets(runner, text)["task"] == "cover"
    (stream,) = nodes_of(wf, "FlowjamStream")
    assert widgets(runner, stream)["session_id"] == "cover"
    assert source_of(wf, stream, "source") is prepare and source_of(wf, stream, "conditioning") is text
    (capture,) = nodes_of(wf, "FlowjamStreamCapture")
    (save,) = nodes_of(wf, "SaveAudio")
    assert source_of(wf, capture, "stream") is stream and source_of(wf, save, "audio") is capture
    (stop,) = nodes_of(wf, "FlowjamStreamStop")
    assert source_of(wf, stop, "stream") is capture


def test_prompt_blend_osc_graph(runner):
    wf = workflow(BLEND_OSC)
    (stream,) = nodes_of(wf, "FlowjamStream")
    assert 0.0 < widgets(runner, stream)["prompt_blend"] < 1.0
    assert source_of(wf, stream, "conditioning_b")["type"] == "FlowjamTextConditioning"
    (osc,) = nodes_of(wf, "FlowjamOscBridge")
    assert widgets(runner, osc) == {"port": 9000, "feedback": "127.0.0.1:9001", "host": "127.0.0.1"}
    (capture,) = nodes_of(wf, "FlowjamStreamCapture")
    (preview,) = nodes_of(wf, "PreviewAudio")
    assert source_of(wf, osc, "stream") is stream and source_of(wf, capture, "stream") is osc
    assert source_of(wf, preview, "audio") is capture
    (stop,) = nodes_of(wf, "FlowjamStreamStop")
    assert source_of(wf, stop, "stream") is capture and stop["mode"] == 4, "a bypassed stop, chained after the bridge"


def ancestors(wf: dict, node: dict) -> set[int]:
    """Ids of every node that `node` takes input from, directly or not: ComfyUI runs all of them before it."""
    sources = {link[3]: set() for link in wf["links"]}
    for link in wf["links"]:
        sources[link[3]].add(link[1])
    found, todo = set(), [node["id"]]
    while todo:
        for source in sources.get(todo.pop(), ()):
            if source not in found:
                found.add(source)
                todo.append(source)
    return found


def users_left_after_the_stop(wf: dict) -> list[str]:
    """Nodes that use a stream but may run after its Stream stop (ComfyUI orders only what the links order)."""
    users = [n for n in wf["nodes"] if any(e["type"] == "FLOWJAM_STREAM" for e in n["inputs"])]
    return [
        f"{user['type']} ({user['id']}) is not upstream of Stream stop ({stop['id']})"
        for stop in nodes_of(wf, "FlowjamStreamStop")
        for user in users
        if user is not stop and user["id"] not in ancestors(wf, stop)
    ]


@pytest.mark.parametrize("name", LIVE_NAMES)
def test_a_stream_stop_comes_after_every_node_that_uses_the_stream(name):
    wf = workflow(name)
    assert nodes_of(wf, "FlowjamStreamStop") and users_left_after_the_stop(wf) == []
    # the shape the bug report had: a stop beside the bridge, which ComfyUI may run first
    sibling = copy.deepcopy(wf)
    (stop,) = nodes_of(sibling, "FlowjamStreamStop")
    (stream,) = nodes_of(sibling, "FlowjamStream")
    link = next(link for link in sibling["links"] if link[0] == stop["inputs"][0]["link"])
    link[1], link[2] = stream["id"], 0
    assert users_left_after_the_stop(sibling), "the check must see a stop that nothing orders after the stream's users"


def connect(wf: dict, source: dict, slot: int, target: dict, input_name: str) -> None:
    """Link output `slot` of `source` to `input_name` of `target` (replacing its link), as the UI format records it."""
    entry = next(e for e in target["inputs"] if e["name"] == input_name)
    if entry["link"] is not None:
        disconnect(wf, target, input_name)
    wf["last_link_id"] += 1
    link_id = wf["last_link_id"]
    wf["links"].append([link_id, source["id"], slot, target["id"], target["inputs"].index(entry), entry["type"]])
    entry["link"] = link_id
    source["outputs"][slot]["links"] = (source["outputs"][slot]["links"] or []) + [link_id]


def test_a_stop_waits_for_a_second_branch_through_after(runner):
    """Two branches off one stream (OSC bridge; Stream capture): `stream` from one and `after` from the other put the
    stop after both."""
    wf = armed(workflow(BLEND_OSC))
    (stream,), (osc,), (capture,), (stop,) = (
        nodes_of(wf, kind)
        for kind in ("FlowjamStream", "FlowjamOscBridge", "FlowjamStreamCapture", "FlowjamStreamStop")
    )
    connect(wf, stream, 0, capture, "stream")
    connect(wf, osc, 0, stop, "stream")
    assert runner.problems(wf) == [] and users_left_after_the_stop(wf) == [
        f"FlowjamStreamCapture ({capture['id']}) is not upstream of Stream stop ({stop['id']})"
    ]
    connect(wf, capture, 1, stop, "after")
    assert runner.problems(wf) == [] and users_left_after_the_stop(wf) == []
    assert to_api_format(wf, runner)[str(stop["id"])]["inputs"] == {
        "stream": [str(osc["id"]), 0],
        "after": [str(capture["id"]), 1],
    }


# ---- layout and template thumbnails ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_no_two_nodes_overlap_and_every_node_shows_its_widgets(name, runner):
    """Boxes as the frontend draws them: the 30 px title bar above `pos`, the body grown to fit its widgets."""
    wf = workflow(name)
    assert overlaps(wf, runner) == []
    for node in wf["nodes"]:
        if node["type"] not in VIRTUAL_NODES:
            needed = min_body_height(runner.definition(node["type"]))
            assert node["size"][1] >= needed, f"node {node['id']} ({node['type']}) is saved {node['size'][1]} px tall"


def test_the_overlap_check_sees_a_node_over_another_one(runner):
    """The layout the LM structure graph shipped with: LM structure's title bar and widgets over Text conditioning."""
    wf = workflow(LM_RENDER)
    (lm,) = nodes_of(wf, "FlowjamLMStructure")
    lm["pos"], lm["size"] = [450, 460], [340, 420]
    (found,) = overlaps(wf, runner)
    assert "FlowjamTextConditioning" in found and "FlowjamLMStructure" in found
    lm["pos"] = [400, 560 + 30]  # just below Text conditioning's 400 px body, title bar included
    assert overlaps(wf, runner) == []
    lm["pos"] = [400, 560 + 29]
    assert overlaps(wf, runner), "the title bar counts"
    (text,) = nodes_of(wf, "FlowjamTextConditioning")
    text["size"], lm["pos"] = [400, 100], [400, 160 + 100 + 30]
    assert overlaps(wf, runner), "a body saved too small for its widgets grows over the node below"


@pytest.mark.parametrize("name", NAMES)
def test_template_thumbnail_is_a_square_jpeg_drawn_from_the_graph(name, tmp_path, runner):
    """ComfyUI's template browser (frontends 1.27 and 1.58) shows `<name>.jpg` beside each workflow of a pack."""
    thumbnail = (WORKFLOWS / name).with_suffix(".jpg")
    data = thumbnail.read_bytes()
    assert jpeg_size(data) == (512, 512) and len(data) < 60_000
    Image = pytest.importorskip("PIL.Image")
    draw_thumbnail(workflow(name), tmp_path / "fresh.jpg", runner)
    shipped, fresh = (
        np.asarray(Image.open(p).convert("L"), dtype=np.float32) for p in (thumbnail, tmp_path / "fresh.jpg")
    )
    blocks = np.abs(shipped - fresh).reshape(64, 8, 64, 8).mean(axis=(1, 3))  # JPEG noise averages out in 8x8 blocks
    assert blocks.max() < 8.0, "stale thumbnail: run `.venv/bin/python tests/workflow_runner.py`"


@pytest.mark.parametrize("name", NAMES)
def test_template_card_title_is_the_file_name_and_reads_as_the_note_heading(name):
    """ComfyUI's template browser titles (and describes) a pack's template by its file name alone: the name is the
    note's heading, with no colon (not in Windows file names) and no underscore."""
    stem = name.removesuffix(".json")
    assert stem == template_heading(workflow(name)).replace(":", "") and "_" not in stem


@pytest.mark.parametrize("name", NAMES)
def test_thumbnail_leaves_its_top_band_to_the_node_graph_badge(name, tmp_path, runner):
    """Frontend 1.58 lays a "Node graph" badge over the top-left corner of a template's card: nothing is drawn there,
    and the title sits in the bottom band."""
    Image = pytest.importorskip("PIL.Image")
    draw_thumbnail(workflow(name), tmp_path / "thumbnail.jpg", runner)
    pixels = np.asarray(Image.open(tmp_path / "thumbnail.jpg").convert("L"), dtype=np.float32)
    band = round(BADGE_BAND * pixels.shape[0])
    background = pixels[band // 2, pixels.shape[1] // 2]
    assert np.abs(pixels[:band] - background).max() < 6, "something is drawn under the badge"
    assert np.abs(pixels[-band:] - background).max() > 100, "the title is not in the bottom band"


def test_the_lora_note_says_how_a_lora_knob_is_named():
    """lora/<name>: the file name without .safetensors, a PEFT folder's name for its adapter_model.safetensors
    (nodes/lora_nodes.py; web/widget_sync.js finds a LoRA node's strength by the same rule)."""
    note = workflow(LORA)["extra"]["note"]
    assert "lora/<name>: the file name without .safetensors" in note
    assert "for a PEFT folder (adapter_model.safetensors) the folder's name" in note


def test_runner_rejects_what_comfyui_would_reject(runner):
    """The checks above would catch a broken graph: each breakage is reported, naming what is wrong."""
    good = workflow(TEXT_JAM)
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
    audio_link = lambda wf: next(link for link in wf["links"] if link[5] == "AUDIO")  # noqa: E731
    assert any("typed FLOWJAM_STREAM" in p for p in broken(lambda wf: audio_link(wf).__setitem__(5, "FLOWJAM_STREAM")))
    assert any("has 18 values" in p for p in broken(lambda wf: node(wf, "FlowjamStream")["widgets_values"].pop()))
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
    assert any(
        "'preset'" in p and "must be one of tiny" in p
        for p in broken(lambda wf: node(wf, "FlowjamLoadModel")["widgets_values"].__setitem__(0, "huge"))
    )
    assert any("mode 3" in p for p in broken(lambda wf: node(wf, "FlowjamCurveWave").update(mode=3)))
    assert any(
        "bypassed node 5 feeds node 6" in p for p in broken(lambda wf: node(wf, "FlowjamCurveWave").update(mode=4))
    )
    assert (
        "control_after_generate" in [w.name for w in runner.definition("FlowjamGenerate").widgets]
        and CONTROL_VALUES[0] == "fixed"
    )


def own_song(wf: dict) -> dict:
    """The cover graph as its note tells a user to make it: a Load Audio of their song instead of Example song."""
    wf = copy.deepcopy(wf)
    (song,) = nodes_of(wf, "FlowjamExampleSong")
    song.update(
        type="LoadAudio",
        outputs=[{**song["outputs"][0], "name": "AUDIO"}],
        properties={"Node name for S&R": "LoadAudio"},
        widgets_values=[EXAMPLE, ""],
    )
    song["size"][1] = 136
    return wf


@pytest.mark.parametrize("frontend", ["1.27", "1.58", "old"])
def test_runner_accepts_the_layouts_real_frontends_save(frontend, runner):
    """Re-saved from the browser, the cover graph gets a few frontend-only values; it still loads and converts the same."""
    shipped = own_song(workflow(COVER))
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
    wf = workflow(ONESHOT)
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
    audio, rate = read_audio(comfy_dirs / "output" / saved["subfolder"] / saved["filename"])
    assert rate == RATE and audio.shape == (2, samples) and saved["type"] == "output"
    (previewed,) = run.ui[preview["id"]]["audio"]
    assert previewed["type"] == "temp"


def test_lm_structure_render_runs_and_the_codes_shape_the_song(runner, comfy_dirs):
    wf = workflow(LM_RENDER)
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
    app = performances.get(session)
    assert app is not None and app.runner.alive
    wait_for(lambda: app.buffer.playhead_frames >= played_s * RATE, 30, f"{played_s} s of '{session}' to play")
    second = runner.execute(wf)
    assert performances.get(session) is app and app.runner.alive, (
        "a re-queue must update the running stream, not replace it"
    )
    ticks = app.runner.stats.ticks
    wait_for(lambda: app.runner.stats.ticks > ticks + 1, 10, "the stream to keep ticking (and take the new values)")
    return first, second, app


def captured(wf: dict, run, output_type: str):
    (node,) = nodes_of(wf, output_type)
    return run.inputs[node["id"]]["audio"]


def test_text_live_jam_runs_and_captures_8_seconds(runner):
    wf = live(workflow(TEXT_JAM), runner)
    first, second, app = run_live(wf, runner, "jam", played_s=8.3)
    assert_audio(captured(wf, first, "PreviewAudio"), samples=8 * RATE)  # the first queue waits for 8 s to play
    assert_audio(captured(wf, second, "PreviewAudio"), samples=8 * RATE)
    (text_a,) = [n for n in wf["nodes"] if n.get("title", "").endswith("(A)")]
    assert app.registry.get("velocity_scale") == 1.0 and app.registry.get("depth") == 4
    assert app.runner.frames == 20 * 25 and app.runner.stats.errors == 0
    assert app.runner._prompts["a"] is second.outputs[text_a["id"]][0], (
        "the re-queued prompt A is the stream's prompt A"
    )


def test_cover_live_runs_on_the_example_song_with_no_file(runner, comfy_dirs):
    wf = live(workflow(COVER), runner)
    first, second, app = run_live(wf, runner, "cover", played_s=SONG_SECONDS + 0.3)
    (song,) = nodes_of(wf, "FlowjamExampleSong")
    assert_audio(second.outputs[song["id"]][0], samples=int(SONG_SECONDS * RATE))
    assert app.runner.frames == SONG_SECONDS * 25, "the loop is as long as the source"
    # 8 s asked of an 8 s loop: capped at the loop minus the window the runner is writing (which grows on a slow CPU)
    assert_audio(captured(wf, second, "SaveAudio"), minimum=int(1.5 * RATE), maximum=int(SONG_SECONDS * RATE) - 1)
    (save,) = nodes_of(wf, "SaveAudio")
    files = [entry["filename"] for run in (first, second) for entry in run.ui[save["id"]]["audio"]]
    assert len(set(files)) == 2 and all((comfy_dirs / "output" / "audio" / f).is_file() for f in files)
    assert app.runner.stats.errors == 0


def test_the_cover_graph_with_a_load_audio_covers_your_own_song(runner):
    wf = live(own_song(workflow(COVER)), runner)
    assert runner.problems(wf) == []
    run = runner.execute(wf)
    (load,) = nodes_of(wf, "LoadAudio")
    loaded = run.outputs[load["id"]][0]
    assert loaded["sample_rate"] == 44_100 and loaded["waveform"].shape == (1, 2, int(44_100 * EXAMPLE_SECONDS))
    assert performances.get("cover").runner.frames == EXAMPLE_SECONDS * 25, "the loop is as long as your song"


def armed(wf: dict) -> dict:
    """The graph with its Stream stop no longer bypassed (Ctrl+B), as a user queues it to stop the stream."""
    wf = copy.deepcopy(wf)
    for stop in nodes_of(wf, "FlowjamStreamStop"):
        stop["mode"] = 0
    return wf


def test_an_armed_stop_runs_after_the_osc_bridge_and_the_capture(runner):
    shipped = live(workflow(BLEND_OSC), runner)
    shipped = with_widget(shipped, "FlowjamOscBridge", "port", free_udp_port(), runner)
    shipped = with_widget(shipped, "FlowjamOscBridge", "feedback", "", runner)
    wf = armed(shipped)
    (osc,), (capture,), (stop,) = (
        nodes_of(wf, kind) for kind in ("FlowjamOscBridge", "FlowjamStreamCapture", "FlowjamStreamStop")
    )
    assert str(stop["id"]) in to_api_format(wf, runner) and str(stop["id"]) not in to_api_format(shipped, runner)
    run = runner.execute(wf)
    assert run.order[-1] == stop["id"] and run.order.index(osc["id"]) < run.order.index(capture["id"])
    assert run.outputs[osc["id"]] == ("blend",) and run.outputs[capture["id"]][1] == "blend"
    assert run.outputs[stop["id"]] == ("stopped blend",) and performances.get("blend") is None
    bypassed = runner.execute(shipped)
    assert stop["id"] not in bypassed.order and performances.get("blend").runner.alive, (
        "bypassed, the stop does nothing"
    )


def test_an_old_graph_with_a_full_size_preset_loads_and_names_the_fix(runner):
    """Saved before full-size presets were withdrawn: it still loads; without weights, Load model says what to pick."""
    wf = with_widget(workflow(ONESHOT), "FlowjamLoadModel", "preset", "turbo-2b", runner)
    assert runner.problems(wf) == []
    assert to_api_format(wf, runner)[str(nodes_of(wf, "FlowjamLoadModel")[0]["id"])]["inputs"]["preset"] == "turbo-2b"
    with pytest.raises(NodeInputError, match="input 'preset' 'turbo-2b' has no weights") as refused:
        runner.execute(wf)
    assert "diffusion_models/" in str(refused.value) and "checkpoints/" in str(refused.value)
    assert "set 'preset' to tiny" in str(refused.value)


def test_prompt_blend_osc_runs_and_a_controller_can_play_it(runner):
    port, feedback = free_udp_port(), socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    feedback.bind(("127.0.0.1", 0))
    feedback.settimeout(5)
    wf = live(workflow(BLEND_OSC), runner)
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

"""What the nodes show a ComfyUI user: errors as one line naming the node, the input and a fix that works inside
ComfyUI (no CLI flags, no pip extras), a Stream stop's result sent to the browser, and the Example song a cover
graph starts from. The nodes run as ComfyUI's classic classes, on the tiny preset with silent streams."""

import math
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from flowjam.engine.audio.example_song import CHORDS
from flowjam.live import performances
from flowjam.live.sync.link import LinkFollower
from flowjam.nodes.prompt_types import refuse_text_booleans
from flowjam.nodes.spec import RESULT_UI_KEY, NodeInputError
from helpers import STREAM_DEFAULTS, TEXT_DEFAULTS, free_udp_port, node, stream, text

FLOWJAM_JS = Path(__file__).resolve().parent.parent / "web" / "flowjam.js"
CLI_HINTS = ("--osc", "--midi", "--sync", "flowjam[midi]", "flowjam[sync]")

pytestmark = pytest.mark.usefixtures("stop_streams")


def refusal(node_id: str, **inputs) -> str:
    """The NodeInputError the node raises for these inputs, checked to be one line with no CLI hint in it."""
    with pytest.raises(NodeInputError) as refused:
        node(node_id).run(**inputs)
    message = str(refused.value)
    assert "\n" not in message and not any(hint in message for hint in CLI_HINTS), message
    return message


# ---- MIDI map: the install hint that works in a custom_nodes folder --------------------------------------------------

MIDI_WITHOUT_MIDO = """
import sys
sys.modules["mido"] = None  # as in a ComfyUI whose Python never installed it
from flowjam.nodes.comfy_v1 import NODE_CLASS_MAPPINGS
try:
    NODE_CLASS_MAPPINGS["FlowjamMidiMap"]().run(stream="jam", port="", map_file="", learn="")
except Exception as error:
    print(type(error).__name__, error)
"""


def test_the_midi_map_without_mido_names_the_requirements_file_to_install():
    result = subprocess.run([sys.executable, "-c", MIDI_WITHOUT_MIDO], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout.strip().splitlines()[-1]
    assert printed.startswith("NodeInputError MIDI map: MIDI needs mido and python-rtmidi"), printed
    assert "pip install -r custom_nodes/flowjam/requirements.txt" in printed, printed
    assert "pip install mido python-rtmidi" in printed and "flowjam[midi]" not in printed, printed


# ---- Stream sync: a clock this machine cannot follow ------------------------------------------------------------

IN_COMFYUI_PYTHON = "install it into ComfyUI's Python (python -m pip install {}, run with the Python that runs ComfyUI)"


@pytest.mark.parametrize(
    "sync, missing, fix",
    [
        ("link", "aalink", "sync 'link' needs aalink: " + IN_COMFYUI_PYTHON.format("aalink")),
        ("jack", "jack", "sync 'jack' needs JACK-Client: " + IN_COMFYUI_PYTHON.format("JACK-Client")),
        ("midi (JACK)", "jack", "sync 'midi (JACK)' needs JACK-Client: " + IN_COMFYUI_PYTHON.format("JACK-Client")),
        ("jack", None, "sync 'jack' needs a running JACK server: start jackd (or PipeWire's JACK), then queue the"),
    ],
    ids=["link_without_aalink", "jack_without_jack_client", "midi_without_jack_client", "jack_without_a_server"],
)
def test_a_clock_that_cannot_be_followed_names_the_sync_widget_and_a_comfyui_fix(
    model, monkeypatch, sync, missing, fix
):
    """In ComfyUI flowjam is a folder, not the package 'flowjam[sync]', and there are no --sync flags: the error
    names the Stream node's sync widget and the package to install into ComfyUI's own Python."""
    if missing is not None:
        monkeypatch.setitem(sys.modules, missing, None)  # as in a ComfyUI whose Python never installed it
    monkeypatch.setenv("JACK_DEFAULT_SERVER", "flowjam-no-such-server")
    monkeypatch.setenv("JACK_NO_START_SERVER", "1")
    inputs = dict(STREAM_DEFAULTS, model=model, conditioning=text(model, "pads"), session_id="sync_ui", sync=sync)
    message = refusal("FlowjamStream", **{**inputs, "bpm": 120.0})
    assert message.startswith(f"Stream: input {fix}"), message
    assert performances.get("sync_ui") is None, "a refused clock leaves no stream behind"


def test_the_cli_is_told_its_own_fix_for_a_missing_clock_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "aalink", None)
    with pytest.raises(RuntimeError) as refused:
        LinkFollower()
    assert str(refused.value) == "--sync link needs aalink: pip install aalink"


# ---- OSC bridge: a busy port and a bad host name the widget --------------------------------------------------------


@pytest.fixture
def osc_stream(model) -> str:
    return stream(model, text(model, "warm analog pads"), "osc_ui")


def osc(stream_name: str, port: int, host: str = "127.0.0.1", feedback: str = "") -> str:
    return refusal("FlowjamOscBridge", stream=stream_name, port=port, feedback=feedback, host=host)


def test_a_busy_osc_port_names_the_port_widget(osc_stream):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as busy:
        busy.bind(("127.0.0.1", 0))
        port = busy.getsockname()[1]
        assert osc(osc_stream, port) == (
            f"OSC bridge: input 'port' {port} is in use (another stream's OSC bridge, or another OSC program); "
            "choose a free port"
        )


@pytest.mark.parametrize(
    "host, feedback, widget",
    [("no-such-host.invalid", "", "host"), ("127.0.0.1", "no-such-host.invalid:9001", "feedback")],
    ids=["bind_host", "feedback_host"],
)
def test_a_host_that_does_not_resolve_names_its_widget_and_an_address_to_use(osc_stream, host, feedback, widget):
    message = osc(osc_stream, free_udp_port(), host=host, feedback=feedback)
    assert message.startswith(f"OSC bridge: input '{widget}' names host 'no-such-host.invalid', which does not resolve")
    assert "127.0.0.1 = this machine only" in message


def test_an_ipv6_feedback_address_for_an_ipv4_bridge_names_the_feedback_widget(osc_stream):
    message = osc(osc_stream, free_udp_port(), feedback="::1:9001")
    assert message.startswith("OSC bridge: input 'feedback' '::1:9001': "), message


def test_a_host_that_is_not_this_machines_names_the_host_widget(osc_stream):
    assert osc(osc_stream, free_udp_port(), host="192.0.2.1") == (  # TEST-NET-1: never a local address
        "OSC bridge: input 'host' '192.0.2.1' is not an address of this machine; use 127.0.0.1 (this machine only) "
        "or 0.0.0.0 (every network)"
    )


# ---- numbers that are not numbers ----------------------------------------------------------------------------------


def test_a_nan_duration_says_it_is_not_a_number_and_gives_the_range(model):
    inputs = dict(TEXT_DEFAULTS, model=model, tags="pads")
    assert refusal("FlowjamTextConditioning", **{**inputs, "duration": math.nan}) == (
        "Text conditioning: input 'duration' is not a number; give seconds between 10 and 600 (0 = 30 s)"
    )
    assert refusal("FlowjamTextConditioning", **{**inputs, "duration": 5.0}) == (
        "Text conditioning: input 'duration' = 5 s is outside 10..600 s; give seconds between 10 and 600 (0 = 30 s)"
    )
    node("FlowjamTextConditioning").run(**{**inputs, "duration": 0.0})  # 0: the 30 s default
    node("FlowjamTextConditioning").run(**{**inputs, "duration": 10.0})


def test_a_nan_number_input_names_the_input_and_its_range():
    assert refusal("FlowjamCurveRamp", start=0.0, end=1.0, seconds=math.nan) == (
        "Curve ramp: input 'seconds' is not a finite number (nan); give one in 0.04 .. 600"
    )


# ---- values of the wrong kind, as a /prompt body can send them ------------------------------------------------------


def test_a_string_for_a_boolean_widget_is_refused_not_read_as_true(model):
    """ "endless": "false" posted to /prompt used to start an endless stream (a non-empty string is true)."""
    inputs = dict(STREAM_DEFAULTS, model=model, conditioning=text(model, "pads"), session_id="typed_ui")
    message = refusal("FlowjamStream", **{**inputs, "endless": "false"})
    assert message == "Stream: input 'endless' takes true or false (a JSON boolean, not a string), got 'false'"
    assert refusal("FlowjamStream", **{**inputs, "steps": "8"}) == (
        "Stream: input 'steps' takes a whole number, got '8'"
    )
    assert performances.get("typed_ui") is None, "a refused input starts no stream"


def test_a_posted_string_for_a_boolean_is_refused_before_comfyuis_conversion_reads_it_as_true():
    """ComfyUI's /prompt validation runs bool(value) on a BOOLEAN widget before the node sees it ("false" -> True):
    the on_prompt handler makes that conversion raise the node's message instead; booleans and links pass."""
    body = {
        "prompt": {
            "1": {"class_type": "FlowjamStream", "inputs": {"endless": "false", "session_id": "x"}},
            "2": {"class_type": "FlowjamStream", "inputs": {"endless": True}},
            "3": {"class_type": "FlowjamStream", "inputs": {"endless": ["9", 0]}},
            "4": {"class_type": "FlowjamStream", "inputs": {"endless": 0}},
            "5": {"class_type": "SaveAudio", "inputs": {"endless": "false"}},  # not ours: left as posted
        }
    }
    prompt = refuse_text_booleans(body)["prompt"]
    refused = prompt["1"]["inputs"]["endless"]
    assert refused == "false" and prompt["1"]["inputs"]["session_id"] == "x"
    with pytest.raises(ValueError) as raised:
        bool(refused)  # what ComfyUI's validate_inputs does with a BOOLEAN widget's value
    assert str(raised.value) == (
        "Stream: input 'endless' takes true or false (a JSON boolean, not a string), got 'false'"
    )
    assert prompt["2"]["inputs"]["endless"] is True and prompt["3"]["inputs"]["endless"] == ["9", 0]
    with pytest.raises(ValueError, match="got 0"):
        bool(prompt["4"]["inputs"]["endless"])
    assert type(prompt["5"]["inputs"]["endless"]) is str
    assert refuse_text_booleans({"no": "prompt"}) == {"no": "prompt"}


def test_a_string_where_a_socket_wants_a_nodes_output_names_the_socket(model):
    """A string wired as conditioning used to fail deep in the engine: AttributeError 'str' object has no attribute
    'cross_kv'."""
    inputs = dict(STREAM_DEFAULTS, model=model, conditioning="warm analog pads", session_id="typed_ui")
    message = refusal("FlowjamStream", **inputs)
    assert message.startswith(
        "Stream: input 'conditioning' takes the FLOWJAM_CONDITIONING output of another node, got the value "
        "'warm analog pads'; connect it to a node's output"
    ), message
    generate_refused = refusal(
        "FlowjamGenerate", model=model, conditioning="pads", seconds=2.0, seed=1, steps=2, shift=3.0, denoise=1.0
    )
    assert "input 'conditioning' takes the FLOWJAM_CONDITIONING output" in generate_refused


# ---- Stream stop: its result reaches the browser ---------------------------------------------------------------------


def test_a_stream_stop_sends_what_it_did_to_the_browser(model):
    """ComfyUI passes a node's "ui" dict to the browser's `executed` event; web/flowjam.js shows the text under
    RESULT_UI_KEY as a toast."""
    stream(model, text(model, "warm analog pads"), "stop_ui")
    stopped = node("FlowjamStreamStop").run(stream="stop_ui")
    assert stopped == {"ui": {RESULT_UI_KEY: ["stopped stop_ui"]}, "result": ("stopped stop_ui",)}
    again = node("FlowjamStreamStop").run(stream="stop_ui")
    assert again["ui"][RESULT_UI_KEY] == [
        "no running stream named 'stop_ui'; queue a flowjam Stream node with session_id 'stop_ui' first"
    ]
    listened = re.search(r'const RESULT_KEY = "([^"]+)";', FLOWJAM_JS.read_text())
    assert listened and listened.group(1) == RESULT_UI_KEY, "web/flowjam.js must read the key the nodes send"


# ---- Example song: music to cover with no file ---------------------------------------------------------------------

NOTE_NAMES = ("C", "C#", "D", "D#", "E", "F", "F#", "G", "G#", "A", "A#", "B")


def loudest_pitch_classes(bar: np.ndarray, rate: int, count: int) -> set[str]:
    """The `count` pitch classes with the most spectral energy between 200 Hz and 2 kHz (above the kick)."""
    spectrum = np.abs(np.fft.rfft(bar.mean(axis=0))) ** 2
    hz = np.fft.rfftfreq(bar.shape[1], 1 / rate)
    band = (hz > 200) & (hz < 2000)
    classes = np.round(12 * np.log2(hz[band] / 440.0) + 69).astype(int) % 12
    energy = np.bincount(classes, weights=spectrum[band], minlength=12)
    return {NOTE_NAMES[i] for i in np.argsort(energy)[-count:]}


def test_the_example_song_plays_c_g_am_f_and_loops_without_a_seam():
    (audio,) = node("FlowjamExampleSong").run(bars=4, bpm=120)
    waveform, rate = audio["waveform"], audio["sample_rate"]
    assert rate == 48_000 and waveform.shape == (1, 2, 8 * 48_000) and waveform.dtype == torch.float32
    song = waveform[0].numpy()
    assert np.abs(song).max() == pytest.approx(0.8, abs=1e-6)
    for index, bar in enumerate(np.split(song, 4, axis=1)):
        triad = {NOTE_NAMES[note % 12] for note in CHORDS[index][1]}
        assert loudest_pitch_classes(bar, rate, 3) == triad, f"bar {index + 1} does not sound its chord {triad}"
    steps = np.abs(np.diff(song, axis=1))
    seam = np.abs(song[:, 0] - song[:, -1]).max()
    assert seam < np.percentile(steps, 99), f"the loop clicks where it wraps round ({seam:.4f})"
    (slower,) = node("FlowjamExampleSong").run(bars=2, bpm=60)
    assert slower["waveform"].shape == (1, 2, 8 * 48_000), "2 bars at 60 bpm last 8 s"
    again = node("FlowjamExampleSong").run(bars=4, bpm=120)[0]["waveform"]
    assert torch.equal(again, waveform), "the same bars and tempo must give the same song"

"""Opt-in: flowjam inside a real ComfyUI server (and, if present, a headless Chromium running ComfyUI's frontend).

Skipped unless FLOWJAM_COMFYUI names a ComfyUI checkout (a V3-capable one, 0.3.6x) whose Python is
$FLOWJAM_COMFYUI/.venv/bin/python or FLOWJAM_COMFYUI_PYTHON, with flowjam's runtime packages installed into it;
also skipped whenever CI is set, so it never runs in CI. ComfyUI's own nodes must all import (SaveAudio, PreviewAudio
and LoadAudio need torchaudio; its model code imports torchvision): on a CPU-only machine, torch 2.9.1 with
torchvision 0.24.1 and torchaudio 2.9.1 in ComfyUI's venv, then ComfyUI's requirements.txt; a ComfyUI that exits for
want of them (not installed, or CUDA-only builds whose operators a CPU torch cannot load) skips the module, saying
which. The websocket checks use
`websockets` from the test venv. Run it as

    FLOWJAM_COMFYUI=/path/to/ComfyUI .venv/bin/pytest -q tests/test_comfyui_real.py

The module starts `main.py --cpu` on a free port with this checkout symlinked as custom_nodes/flowjam (the link is
removed again if this module made it) and private input/output/temp/user folders, so the ComfyUI checkout is left as it
was. The browser test needs `node`, /usr/bin/chromium and playwright-core in /tmp/pw (FLOWJAM_PLAYWRIGHT to change
that); it is skipped, with the reason printed, without them. Its screenshot goes to /tmp/flowjam_live_panel.png and,
if set, to $FLOWJAM_COMFYUI_SCREENSHOT. Streams run with audio_device "none" (no sound card needed)."""

from __future__ import annotations

import os
import sys

import pytest

COMFY_ROOT = os.environ.get("FLOWJAM_COMFYUI", "")
if not COMFY_ROOT:
    pytest.skip(
        "opt-in: set FLOWJAM_COMFYUI to a ComfyUI checkout to run flowjam in a real ComfyUI", allow_module_level=True
    )
if os.environ.get("CI"):
    pytest.skip("the real-ComfyUI test never runs in CI", allow_module_level=True)

import contextlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import urllib.error  # noqa: E402
import urllib.request  # noqa: E402
import uuid  # noqa: E402
import warnings  # noqa: E402
import wave  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from flowjam.engine.params import KNOB_SPECS  # noqa: E402
from flowjam.nodes import NODE_SPECS  # noqa: E402
from helpers import free_tcp_port, free_udp_port, wait_for  # noqa: E402
from workflow_runner import load_workflow, to_api_format  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
WORKFLOWS = REPO / "workflows"
ONESHOT = "flowjam one-shot render.json"
TEXT_JAM = "flowjam live text jam.json"
COVER = "flowjam live cover.json"
LM_WORKFLOW = "flowjam song structure from the 5 Hz LM.json"
BLEND_OSC = "flowjam prompt blend over OSC.json"
LORA_WORKFLOW = "flowjam live LoRA jam.json"
WORKFLOW_NAMES = (
    ONESHOT,
    TEXT_JAM,
    COVER,  # its Example song node makes the song in code: no file in the input folder
    BLEND_OSC,
    LM_WORKFLOW,
)
LORA_FILE = "flowjam_test_style.safetensors"  # written into the fixture's own loras folder
BROKEN_LORA = "flowjam_test_broken.safetensors"  # written, and removed again, by the failed-swap test only
FIVE_CHANNELS = "flowjam_test_5ch.wav"
LOW_RATE = "flowjam_test_4khz.wav"
PLAYWRIGHT = Path(os.environ.get("FLOWJAM_PLAYWRIGHT", "/tmp/pw"))
CHROMIUM = "/usr/bin/chromium"
SCREENSHOT = Path("/tmp/flowjam_live_panel.png")
PROMPT_TIMEOUT_S = 120
POLL_S = 0.2  # how often a test asks the server how a stream is doing


def _missing_torch_extra(log: str) -> str | None:
    """Why ComfyUI's own imports failed for want of torchvision or torchaudio (their CUDA-only builds on a CPU torch
    fail to load their operators), from its log; None if that is not why."""
    for package in ("torchvision", "torchaudio"):
        if f"No module named '{package}'" in log:
            return f"{package} is not installed in ComfyUI's Python (ComfyUI's own nodes import it)"
        if f"operator {package}::" in log or f"{package}/lib/lib{package}" in log or f"{package}/_C.so" in log:
            return f"{package} is installed but its operators do not load (a build for another torch or for CUDA)"
    return None


def _comfy_python(root: Path) -> Path:
    return Path(os.environ.get("FLOWJAM_COMFYUI_PYTHON") or root / ".venv" / "bin" / "python")


def _write_wav(path: Path, channels: int, rate: int, seconds: float) -> None:
    """16-bit PCM: a chord, a different partial per channel."""
    t = np.arange(int(rate * seconds)) / rate
    tones = [0.25 * np.sin(2 * math.pi * f * t) for f in (220.0, 277.2, 329.6, 440.0, 554.4)]
    data = np.stack([tones[c % len(tones)] + 0.1 * tones[(c + 2) % len(tones)] for c in range(channels)], axis=1)
    with wave.open(str(path), "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes((data * 32767).astype("<i2").tobytes())


# FLAC (what SaveAudio / PreviewAudio write) decoded with ComfyUI's own PyAV, in ComfyUI's Python.
_DECODE = r"""
import sys, av, numpy as np
arrays, rates = [], []
for path in sys.argv[2:]:
    with av.open(path) as f:
        stream = f.streams.audio[0]
        channels = stream.channels
        parts = []
        for frame in f.decode(stream):
            a = frame.to_ndarray()
            if a.shape[0] != channels:
                a = a.reshape(-1, channels).T
            parts.append(a)
        a = np.concatenate(parts, axis=1) if parts else np.zeros((channels, 0), np.float32)
        if a.dtype == np.int16:
            a = a / 32768.0
        elif a.dtype == np.int32:
            a = a / 2.0 ** 31
        arrays.append(a.astype(np.float32))
        rates.append(stream.codec_context.sample_rate)
np.savez(sys.argv[1], rates=np.array(rates), **{f"a{i}": a for i, a in enumerate(arrays)})
"""


class Comfy:
    """A running ComfyUI: HTTP helpers, prompt queueing and the folders it reads and writes."""

    def __init__(self, root: Path, python: Path, port: int, dirs: dict[str, Path], log: Path, pid: int):
        self.root, self.python, self.port, self.dirs, self.log, self.pid = root, python, port, dirs, log, pid
        self.base = f"http://127.0.0.1:{port}"
        self.client_id = str(uuid.uuid4())

    def request(self, method: str, path: str, body=None, raw: bytes | None = None, timeout: float = 30):
        """-> (HTTP status, decoded JSON body or the text if it is not JSON)."""
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        request = urllib.request.Request(
            self.base + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                status, payload = response.status, response.read()
        except urllib.error.HTTPError as error:
            status, payload = error.code, error.read()
        try:
            return status, json.loads(payload or b"null")
        except ValueError:
            return status, payload.decode(errors="replace")

    def get(self, path: str):
        status, body = self.request("GET", path)
        assert status == 200, f"GET {path} -> {status}: {body}"
        return body

    def queue(self, prompt: dict):
        """POST /prompt -> (HTTP status, body): 200 with a prompt_id, or 400 with node_errors."""
        return self.request("POST", "/prompt", {"prompt": prompt, "client_id": self.client_id})

    def run(self, prompt: dict, timeout: float = PROMPT_TIMEOUT_S) -> dict:
        """Queue a prompt that validates and wait for its history entry (success or execution error)."""
        status, body = self.queue(prompt)
        assert status == 200, f"/prompt refused the prompt ({status}): {json.dumps(body)[:2000]}"
        prompt_id = body["prompt_id"]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            history = self.get(f"/history/{prompt_id}")
            entry = history.get(prompt_id)
            if entry and entry.get("status", {}).get("status_str") in ("success", "error"):
                return entry
            time.sleep(0.2)
        raise AssertionError(f"prompt {prompt_id} did not finish within {timeout} s; log tail:\n{self.log_tail()}")

    def run_ok(self, prompt: dict) -> dict:
        entry = self.run(prompt)
        error = execution_error(entry)
        assert error is None and entry["status"]["status_str"] == "success", (
            f"execution failed: {json.dumps(error or entry['status'])[:3000]}"
        )
        return entry

    def session(self, name: str = "jam") -> dict:
        return self.get(f"/flowjam/session/{name}")

    def sessions(self) -> list[str]:
        return self.get("/flowjam/sessions")["sessions"]

    def saved_files(self, entry: dict) -> list[Path]:
        """Every audio file the prompt's SaveAudio / PreviewAudio nodes reported, as paths on disk."""
        files = []
        for output in entry.get("outputs", {}).values():
            for item in output.get("audio", []):
                folder = self.dirs["output"] if item["type"] == "output" else self.dirs["temp"]
                files.append(folder / item.get("subfolder", "") / item["filename"])
        return files

    def decode(self, *paths: Path) -> list[tuple[np.ndarray, int]]:
        """FLAC files -> [(float32 [channels, samples], rate)], decoded by ComfyUI's PyAV."""
        out = self.dirs["root"] / f"decoded_{uuid.uuid4().hex}.npz"
        result = subprocess.run(
            [str(self.python), "-c", _DECODE, str(out), *map(str, paths)], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        with np.load(out) as data:
            return [(data[f"a{i}"], int(rate)) for i, rate in enumerate(data["rates"])]

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else "(no log)"

    def log_since(self, offset: int) -> str:
        """What the server logged after `offset` bytes (see `log_size`)."""
        with open(self.log, "rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")

    def log_size(self) -> int:
        return self.log.stat().st_size

    def rss_bytes(self) -> int:
        """The server process's resident memory (VmRSS)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError(f"no VmRSS for the server process {self.pid}")


def execution_error(entry: dict) -> dict | None:
    """The execution_error message of a history entry (node_id, exception_message, ...), or None."""
    for kind, data in entry.get("status", {}).get("messages", []):
        if kind == "execution_error":
            return data
    return None


class Events:
    """ComfyUI's websocket as one client: every JSON message it gets, with the time it came, read by a thread. Queue
    with `self.client_id` to get a prompt's own events (progress, executing); broadcasts come either way."""

    def __init__(self, comfy: Comfy):
        client = pytest.importorskip("websockets.sync.client", reason="the websocket checks need `websockets`")
        self.client_id = str(uuid.uuid4())
        self._stack = contextlib.ExitStack()  # websockets wants its connection used as a context manager
        url = f"ws://127.0.0.1:{comfy.port}/ws?clientId={self.client_id}"
        self.socket = self._stack.enter_context(client.connect(url, max_size=None))
        self.messages: list[tuple[float, str, dict]] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, name="comfyui-events", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for message in self.socket:
                if isinstance(message, str):  # binary frames are previews
                    event = json.loads(message)
                    with self._lock:
                        self.messages.append((time.monotonic(), event.get("type"), event.get("data") or {}))
        except Exception:  # noqa: BLE001 - the socket closed, by us or by the server going down
            pass

    def of(self, kind: str, since: float = 0.0) -> list[tuple[float, dict]]:
        """-> [(arrival time, data)] of every `kind` event that came at or after `since` (time.monotonic)."""
        with self._lock:
            return [(at, data) for at, k, data in self.messages if k == kind and at >= since]

    def close(self) -> None:
        self._stack.close()
        self._thread.join(5)


def api_prompt(name: str, osc_port: int | None = None) -> dict:
    """A shipped workflow as ComfyUI's API prompt, with silent streams (no sound card) and, given one, a free OSC port."""
    prompt = to_api_format(load_workflow(WORKFLOWS / name))
    for node in prompt.values():
        if node["class_type"] == "FlowjamStream":
            node["inputs"]["audio_device"] = "none"
        if node["class_type"] == "FlowjamOscBridge" and osc_port is not None:
            node["inputs"]["port"] = osc_port
            node["inputs"]["feedback"] = f"127.0.0.1:{free_udp_port()}"
    return prompt


def node_id(prompt: dict, class_type: str, title_contains: str = "") -> str:
    matches = [i for i, n in prompt.items() if n["class_type"] == class_type and title_contains in n["_meta"]["title"]]
    assert len(matches) == 1, f"expected one {class_type} {title_contains!r} in the prompt, found {matches}"
    return matches[0]


def capture_prompt(stream: str, seconds: float, prefix: str) -> dict:
    """Stream capture of a running stream (named by a literal) -> Save Audio."""
    return {
        "1": {"class_type": "FlowjamStreamCapture", "inputs": {"stream": stream, "seconds": seconds}},
        "2": {"class_type": "SaveAudio", "inputs": {"audio": ["1", 0], "filename_prefix": prefix}},
    }


def wait_ticks(comfy: Comfy, ticks: int, stream: str = "jam") -> None:
    start = comfy.session(stream)["ticks"]
    wait_for(lambda: comfy.session(stream)["ticks"] >= start + ticks, 15, f"{ticks} ticks of {stream!r}", POLL_S)


def stop_prompt(stream: str) -> dict:
    return {"1": {"class_type": "FlowjamStreamStop", "inputs": {"stream": stream}}}


# ---- the server -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def comfy(tmp_path_factory):
    root = Path(COMFY_ROOT).expanduser().resolve()
    python = _comfy_python(root)
    if not (root / "main.py").is_file() or not (root / "custom_nodes").is_dir():
        pytest.fail(f"FLOWJAM_COMFYUI={COMFY_ROOT} is not a ComfyUI checkout (no main.py / custom_nodes)")
    if not python.exists():
        pytest.fail(f"no Python for ComfyUI at {python}; set FLOWJAM_COMFYUI_PYTHON")
    work = tmp_path_factory.mktemp("comfyui_real")
    dirs = {
        "root": work,
        "input": work / "input",
        "output": work / "output",
        "temp": work / "temp",
        "user": work / "user",
        "models": work / "models" / "diffusion_models",
    }
    for key in ("input", "output", "user", "models"):
        dirs[key].mkdir(parents=True)
    model_paths = work / "extra_model_paths.yaml"  # its own diffusion_models (model-memory test) and loras folders
    model_paths.write_text(
        f"flowjam_test:\n    base_path: {work}\n    diffusion_models: models/diffusion_models\n    loras: models/loras\n"
    )
    _write_lora(work / "models" / "loras" / LORA_FILE)
    _write_wav(dirs["input"] / FIVE_CHANNELS, 5, 44_100, 1.0)
    _write_wav(dirs["input"] / LOW_RATE, 2, 4_000, 1.0)

    link = root / "custom_nodes" / "flowjam"
    made_link = False
    if link.is_symlink() or link.exists():
        if link.resolve() != REPO:
            pytest.fail(f"{link} exists and is not this checkout ({REPO}); move it away to test this one")
    else:
        link.symlink_to(REPO, target_is_directory=True)
        made_link = True

    port = free_tcp_port()
    log = work / "comfyui.log"
    # a headless box: no JACK server another test may have started is an output for a stream with audio_device ""
    env = dict(
        os.environ,
        PYTHONDONTWRITEBYTECODE="1",
        PYTHONUNBUFFERED="1",
        JACK_DEFAULT_SERVER="flowjam-no-such-server",
        JACK_NO_START_SERVER="1",
    )
    command = [
        str(python),
        "main.py",
        "--cpu",
        "--listen",
        "127.0.0.1",
        "--port",
        str(port),
        "--input-directory",
        str(dirs["input"]),
        "--output-directory",
        str(dirs["output"]),
        "--temp-directory",
        str(work),
        "--user-directory",
        str(dirs["user"]),
        "--database-url",
        f"sqlite:///{work / 'comfyui.db'}",
        "--extra-model-paths-config",
        str(model_paths),
    ]
    started = time.monotonic()
    with open(log, "wb") as log_file:
        process = subprocess.Popen(
            command, cwd=root, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
    server = Comfy(root, python, port, dirs, log, process.pid)
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                missing = _missing_torch_extra(server.log_tail(20_000))
                if missing:
                    pytest.skip(f"ComfyUI cannot start here: {missing}")
                pytest.fail(f"ComfyUI exited with {process.returncode}:\n{server.log_tail()}")
            try:
                if server.request("GET", "/object_info/FlowjamStream", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"ComfyUI did not answer /object_info within 120 s:\n{server.log_tail()}")
            time.sleep(0.5)
        text = log.read_text(errors="replace")
        assert "IMPORT FAILED" not in text, f"a custom node failed to import:\n{server.log_tail()}"
        print(f"\nComfyUI up on port {port} in {time.monotonic() - started:.1f} s", file=sys.stderr)
        server.request("POST", "/settings/Comfy.TutorialCompleted", raw=b"true")  # no first-run dialog in the browser
        yield server
    finally:
        try:  # stop streams first: their loop buffers are shared memory that a killed process would leave behind
            if process.poll() is None:
                for name in server.sessions():
                    server.run(stop_prompt(name), timeout=30)
        except Exception as error:  # noqa: BLE001 - shutting down regardless
            print(f"could not stop the streams: {error}", file=sys.stderr)
        for sig, wait in ((signal.SIGINT, 15), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            if process.poll() is not None:
                break
            try:
                os.killpg(process.pid, sig)
                process.wait(wait)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(process.pid, signal.SIGKILL)  # anything the server started and left behind
        except ProcessLookupError:
            pass
        if made_link and link.is_symlink():
            link.unlink()


@pytest.fixture
def jam(comfy):
    """The live jam workflow's stream "jam", running and played for at least 3 s; -> its API prompt."""
    prompt = api_prompt(TEXT_JAM)
    if "jam" not in comfy.sessions():
        comfy.run_ok(prompt)
    wait_for(
        lambda: comfy.session("jam")["playhead_s"] >= 3.0 or comfy.session("jam")["ticks"] > 200,
        30,
        "the jam stream to play 3 s",
        POLL_S,
    )
    return prompt


# ---- 1. node definitions --------------------------------------------------------------------------------------------


def test_object_info_lists_every_flowjam_node_as_declared(comfy):
    info = comfy.get("/object_info")
    for spec in NODE_SPECS:
        assert spec.node_id in info, f"{spec.node_id} is not registered in ComfyUI:\n{comfy.log_tail()}"
        node = info[spec.node_id]
        assert node["category"] == spec.category and node["category"].startswith("audio/flowjam")
        assert node["display_name"] == spec.display_name
        assert node["output"] == [o.type for o in spec.outputs]
        assert node["output_name"] == [o.name for o in spec.outputs]
        assert node["output_node"] == spec.output_node
        inputs = node["input"]
        assert list(inputs.get("required", {})) == [p.name for p in spec.inputs if not p.optional]
        assert list(inputs.get("optional", {})) == [p.name for p in spec.inputs if p.optional]
        for param in spec.inputs:
            kind, options = (inputs["optional"] if param.optional else inputs["required"])[param.name]
            assert kind == param.type, f"{spec.node_id}.{param.name}: {kind} != {param.type}"
            if param.type in ("INT", "FLOAT"):
                assert (options["default"], options["min"], options["max"]) == (
                    param.default,
                    param.minimum,
                    param.maximum,
                )
            if param.type == "COMBO":
                listed = (spec.node_id, param.name) == ("FlowjamLora", "lora")  # the fixture's loras folder
                assert options["options"] == (["none", LORA_FILE] if listed else list(param.choices()))
    assert len([n for n in info if n.startswith("Flowjam")]) == len(NODE_SPECS) == 19  # Example song is the 19th
    generate = info["FlowjamGenerate"]
    assert generate["output"] == ["AUDIO", "LATENT"]
    assert list(generate["input"]["optional"]) == ["source", "velocity_scale", "structure"]
    assert info["FlowjamStreamCapture"]["output"] == ["AUDIO", "FLOWJAM_STREAM"]


# ---- 2. the shipped workflows ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", WORKFLOW_NAMES)
def test_shipped_workflow_runs(comfy, name):
    prompt = api_prompt(name, osc_port=free_udp_port())
    started = time.monotonic()
    entry = comfy.run_ok(prompt)
    print(f"\n{name}: {time.monotonic() - started:.1f} s", file=sys.stderr)
    savers = [i for i, n in prompt.items() if n["class_type"] in ("SaveAudio", "PreviewAudio")]
    assert savers and sorted(entry["outputs"]) == sorted(savers)
    files = comfy.saved_files(entry)
    assert len(files) == len(savers)
    for path in files:
        assert path.is_file() and path.stat().st_size > 0, path
    if name == COVER:  # the song comes from the Example song node, not from a file the user has to find
        kinds = {n["class_type"] for n in prompt.values()}
        assert "FlowjamExampleSong" in kinds and "LoadAudio" not in kinds, kinds
        songs = [p.name for p in comfy.dirs["input"].rglob("*") if p.suffix.lower() in (".wav", ".flac", ".mp3")]
        assert sorted(songs) == sorted((FIVE_CHANNELS, LOW_RATE)), f"an example song file in the input folder: {songs}"
        assert comfy.session("cover")["loop_s"] == pytest.approx(8.0, abs=0.5), "4 bars at 120 bpm: an 8 s loop"
    if name == ONESHOT:
        saved = [p for p in files if comfy.dirs["output"] in p.parents]
        assert saved and saved[0].name.startswith("flowjam_render") and saved[0].parent.name == "audio"
        ((audio, rate),) = comfy.decode(saved[0])
        assert audio.shape[0] == 2 and abs(audio.shape[1] / rate - 8.0) < 0.05 and np.abs(audio).max() > 0.01
    streams = [n["inputs"]["session_id"] for n in prompt.values() if n["class_type"] == "FlowjamStream"]
    for stream in streams:
        assert stream in comfy.sessions()
        status = comfy.session(stream)
        assert status["playing"] and status["errors"] == 0, status
        if stream != "jam":  # jam keeps playing for the next tests
            stopped = comfy.run_ok(stop_prompt(stream))
            assert stream not in comfy.sessions()
            assert stopped["outputs"]["1"] == {"flowjam_result": [f"stopped {stream}"]}, "the browser's toast text"


def _write_lora(path: Path) -> None:
    """A ComfyUI-style LoRA file (diffusion_model.<layer>.lora_A/B + .alpha) for the tiny preset's DiT."""
    import torch
    from flowjam.engine.bench.ticks import random_lora
    from flowjam.engine.session import Session
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True)
    decoder = Session.load(preset="tiny").models.acestep.decoder
    tensors = {}
    for layer, delta in random_lora(decoder, "style", rank=4, seed=0).deltas.items():
        tensors[f"diffusion_model.{layer}.lora_A.weight"] = delta.down.contiguous()
        tensors[f"diffusion_model.{layer}.lora_B.weight"] = (delta.up * 30).contiguous()
        tensors[f"diffusion_model.{layer}.alpha"] = torch.tensor(4.0)
    save_file(tensors, str(path))


def test_the_lora_workflow_plays_a_lora_from_the_loras_folder(comfy):
    """The LoRA node lists ComfyUI's loras folder; the shipped LoRA workflow with a file picked plays, and the
    running stream has the LoRA's knob at the node's strength."""
    combo = comfy.get("/object_info/FlowjamLora")["FlowjamLora"]["input"]["required"]["lora"][1]["options"]
    assert LORA_FILE in combo, combo
    prompt = api_prompt(LORA_WORKFLOW)
    first = sorted(i for i, n in prompt.items() if n["class_type"] == "FlowjamLora")[0]
    prompt[first]["inputs"].update(lora=LORA_FILE, strength=0.7)
    comfy.run_ok(prompt)
    (stream,) = [n["inputs"]["session_id"] for n in prompt.values() if n["class_type"] == "FlowjamStream"]
    status = comfy.session(stream)
    knob = "lora/" + LORA_FILE.removesuffix(".safetensors")
    assert status["playing"] and status["errors"] == 0, status
    assert status["knobs"][knob] == pytest.approx(0.7), status["knobs"]
    comfy.run_ok(stop_prompt(stream))


def test_a_failed_lora_swap_keeps_the_running_streams_loras(comfy):
    """A re-queue of a playing LoRA stream with the LoRA node on a broken file fails with one line naming the file,
    and the stream keeps the LoRA it had: its lora/<name> knob is still listed, at its strength, still turns, and the
    stream plays on."""
    prompt = api_prompt(LORA_WORKFLOW)
    first = sorted(i for i, n in prompt.items() if n["class_type"] == "FlowjamLora")[0]
    prompt[first]["inputs"].update(lora=LORA_FILE, strength=0.7)
    (stream,) = [n["inputs"]["session_id"] for n in prompt.values() if n["class_type"] == "FlowjamStream"]
    knob = "lora/" + LORA_FILE.removesuffix(".safetensors")
    broken = comfy.dirs["root"] / "models" / "loras" / BROKEN_LORA
    comfy.run_ok(prompt)
    try:
        before = comfy.session(stream)
        assert before["playing"] and before["knobs"][knob] == pytest.approx(0.7), before["knobs"]
        broken.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header" + bytes(range(256)) * 4)
        combo = comfy.get("/object_info/FlowjamLora")["FlowjamLora"]["input"]["required"]["lora"][1]["options"]
        assert BROKEN_LORA in combo, combo  # ComfyUI lists it: the failure comes from reading it, not from validation
        swap = json.loads(json.dumps(prompt))
        swap[first]["inputs"]["lora"] = BROKEN_LORA
        entry = comfy.run(swap)
        error = execution_error(entry)
        assert error is not None, f"the swap to a broken LoRA ran: {entry['status']}"
        message = error["exception_message"].strip()
        print(f"\nfailed LoRA swap ({error['node_type']}): {message}", file=sys.stderr)
        assert BROKEN_LORA in message and "\n" not in message, message
        assert "Traceback" not in message and len(message) < 500, message

        ticks = comfy.session(stream)["ticks"]
        wait_for(
            lambda: comfy.session(stream)["ticks"] > ticks + 10, 10, f"the {stream} stream to keep ticking", POLL_S
        )
        after = comfy.session(stream)
        assert after["playing"] and after["running"] and after["errors"] == before["errors"], after
        assert after["knobs"][knob] == pytest.approx(0.7), f"the stream lost its LoRA: {after['knobs']}"
        assert knob in after["specs"] and not [k for k in after["knobs"] if "broken" in k], after["knobs"]
        status, body = comfy.request("POST", f"/flowjam/session/{stream}/knob", {"name": knob, "value": 0.4})
        assert status == 200 and body["value"] == pytest.approx(0.4), body  # the kept LoRA still plays, and turns
        assert comfy.session(stream)["knobs"][knob] == pytest.approx(0.4)
    finally:
        broken.unlink(missing_ok=True)
        comfy.run(stop_prompt(stream), timeout=30)
    assert stream not in comfy.sessions()


def _lora_render_prompt(checkpoint: str, strength: float | None, prefix: str) -> dict:
    """Generate 1 s from `checkpoint` through the LoRA node at `strength` (None: no LoRA node) -> Preview Audio and
    Save Latent (under `prefix`)."""
    prompt = _generate_prompt(seconds=1.0, checkpoint=checkpoint)
    prompt["5"] = {"class_type": "SaveLatent", "inputs": {"samples": ["3", 1], "filename_prefix": prefix}}
    if strength is not None:
        prompt["6"] = {
            "class_type": "FlowjamLora",
            "inputs": {"model": ["1", 0], "lora": LORA_FILE, "strength": strength, "mode": "live"},
        }
        prompt["3"]["inputs"]["model"] = ["6", 0]
    return prompt


def test_a_lora_changes_what_generate_renders_and_strength_0_is_the_bare_model(comfy):
    """Load model -> LoRA (the file from the fixture's loras folder) -> Generate: at strength 1 the audio and the
    latent differ clearly from the same seed without the LoRA; at strength 0 they are exactly the bare model's."""
    from flowjam.engine.checkpoints.loading import save_flowjam_file
    from flowjam.engine.session import Session
    from safetensors.numpy import load_file

    # a checkpoint of its own: no stream of another test plays the session the LoRA goes into
    file = save_flowjam_file(
        Session.load(preset="tiny").models, comfy.dirs["models"] / "acestep_tiny_lora_base.safetensors"
    )
    rendered = {}
    try:
        for label, strength in (("bare", None), ("lora_1", 1.0), ("lora_0", 0.0)):
            started = time.monotonic()
            prompt = _lora_render_prompt(f"diffusion_models/{file.name}", strength, f"flowjam_test/{label}")
            entry = comfy.run_ok(prompt)
            print(f"\nGenerate {label}: {time.monotonic() - started:.1f} s", file=sys.stderr)
            ((audio, rate),) = comfy.decode(*comfy.saved_files(entry))
            (saved,) = entry["outputs"]["5"]["latents"]
            latent = load_file(str(comfy.dirs["output"] / saved["subfolder"] / saved["filename"]))["latent_tensor"]
            rendered[label] = audio, rate, latent
    finally:
        file.unlink()
    bare, lora, off = rendered["bare"], rendered["lora_1"], rendered["lora_0"]
    assert bare[1] == lora[1] == off[1] == 48_000 and bare[0].shape == lora[0].shape == off[0].shape
    assert np.abs(bare[0]).max() > 0.01 and np.abs(lora[0]).max() > 0.01
    audio_change = np.abs(lora[0] - bare[0]).mean() / np.abs(bare[0]).mean()
    latent_change = np.abs(lora[2] - bare[2]).mean() / np.abs(bare[2]).mean()
    print(f"LoRA at 1: audio {audio_change:.0%}, latent {latent_change:.0%} off the bare model", file=sys.stderr)
    assert audio_change > 0.1 and latent_change > 0.1, (audio_change, latent_change)
    assert np.array_equal(off[2], bare[2]) and np.array_equal(off[0], bare[0]), "strength 0 is not the bare model"


# ---- 3. a re-queue updates the running stream -----------------------------------------------------------------------


def test_requeue_updates_the_running_stream_in_place(comfy, jam):
    first = comfy.run_ok(jam)
    before = comfy.session("jam")
    ((capture_1, rate),) = comfy.decode(*comfy.saved_files(first))

    changed = json.loads(json.dumps(jam))
    changed[node_id(changed, "FlowjamTextConditioning", "(A)")]["inputs"]["tags"] = (
        "distorted industrial drums, metallic noise"
    )
    changed[node_id(changed, "FlowjamStream")]["inputs"]["prompt_blend"] = 0.6
    shared = changed[node_id(changed, "FlowjamSharedCurve")]["inputs"]
    shared.pop("curve")  # the curve wave no longer drives velocity_scale: the Shared curve's value does
    shared["value"] = 0.8
    comfy.run_ok(changed)
    after = comfy.session("jam")
    assert after["ticks"] >= before["ticks"] and after["latents"] >= before["latents"], (before, after)
    assert after["knobs"]["prompt_blend"] == pytest.approx(0.6)
    assert after["knobs"]["velocity_scale"] == pytest.approx(0.8)
    assert before["knobs"]["prompt_blend"] == pytest.approx(0.0)

    # let the changed generations reach the speakers, then capture again (same prompt: the live nodes re-run)
    played = after["ticks"]
    wait_for(lambda: comfy.session("jam")["ticks"] >= played + 120, 30, "120 more ticks", POLL_S)
    second = comfy.run_ok(changed)
    later = comfy.session("jam")
    assert later["ticks"] > after["ticks"] and later["errors"] == 0 and comfy.sessions().count("jam") == 1
    ((capture_2, rate_2),) = comfy.decode(*comfy.saved_files(second))
    assert rate == rate_2 == 48_000 and capture_1.shape[0] == capture_2.shape[0] == 2
    # a restarted stream could only capture what it played since the restart (about nothing): this one has seconds
    assert capture_1.shape[1] >= 2 * rate and capture_2.shape[1] >= 2 * rate, (capture_1.shape, capture_2.shape)
    assert np.abs(capture_1).max() > 0.01 and np.abs(capture_2).max() > 0.01
    common = min(capture_1.shape[1], capture_2.shape[1])
    assert np.abs(capture_1[:, -common:] - capture_2[:, -common:]).mean() > 1e-3, "the change is not heard"

    comfy.run_ok(jam)  # back to the shipped values for the next tests
    assert comfy.session("jam")["knobs"]["prompt_blend"] == pytest.approx(0.0)


# ---- 4. the live panel's route --------------------------------------------------------------------------------------


def test_knob_route_changes_the_stream_without_queueing(comfy, jam):
    status, body = comfy.request("POST", "/flowjam/session/jam/knob", {"name": "velocity_scale", "value": 1.3})
    assert status == 200 and body == {"name": "velocity_scale", "value": 1.3, "clamped": False}
    assert comfy.session("jam")["knobs"]["velocity_scale"] == pytest.approx(1.3)
    queue = comfy.get("/queue")
    assert queue["queue_running"] == [] and queue["queue_pending"] == []
    status, body = comfy.request("POST", "/api/flowjam/session/jam/knob", {"name": "velocity_scale", "value": 5})
    assert status == 200 and body["value"] == 2.0 and body["clamped"] is True  # the /api prefix works; clamped to range
    status, body = comfy.request("POST", "/flowjam/session/jam/knob", {"name": "no_such_knob", "value": 1})
    assert status == 400 and "no_such_knob" in body["error"]
    status, body = comfy.request("POST", "/flowjam/session/nope/knob", {"name": "volume", "value": 1})
    assert status == 404

    # heard: the volume knob scales what the stream plays (a capture is what was played, times the volume)
    try:
        status, _ = comfy.request("POST", "/flowjam/session/jam/knob", {"name": "volume", "value": 0.0})
        assert status == 200
        wait_ticks(comfy, 3)  # a knob applies on the stream's next tick
        silent = comfy.run_ok(capture_prompt("jam", 2.0, "flowjam_test/silent"))
        ((audio, _rate),) = comfy.decode(*comfy.saved_files(silent))
        assert audio.shape[1] > 0 and np.abs(audio).max() == 0.0
    finally:
        comfy.request("POST", "/flowjam/session/jam/knob", {"name": "volume", "value": 0.8})
        comfy.request("POST", "/flowjam/session/jam/knob", {"name": "velocity_scale", "value": 1.0})
    wait_ticks(comfy, 3)
    loud = comfy.run_ok(capture_prompt("jam", 2.0, "flowjam_test/loud"))
    ((audio, _rate),) = comfy.decode(*comfy.saved_files(loud))
    assert np.abs(audio).max() > 0.01


def test_a_knob_moved_from_outside_shows_in_the_status_the_panel_receives(comfy, jam):
    """Point 5, the server side of the panel's write-back: a knob moved outside the graph (the knob route, as OSC or a
    script would) is in the `flowjam.status` event the server pushes to every browser within a second, and in the
    status the panel polls; no prompt is queued for it."""
    events = Events(comfy)
    try:
        wait_for(lambda: events.of("flowjam.status"), 5, "a first flowjam.status push", POLL_S)
        moved = time.monotonic()
        status, body = comfy.request("POST", "/flowjam/session/jam/knob", {"name": "prompt_blend", "value": 0.37})
        assert status == 200 and body["value"] == pytest.approx(0.37), body

        def pushed():
            for at, data in events.of("flowjam.status", since=moved):
                knobs = data.get("sessions", {}).get("jam", {}).get("knobs", {})
                if knobs.get("prompt_blend") == pytest.approx(0.37):
                    return at
            return None

        at = wait_for(pushed, 5, "a flowjam.status push with the moved prompt_blend", 0.05)
        print(f"\nthe moved knob was pushed {1000 * (at - moved):.0f} ms after the move", file=sys.stderr)
        assert at - moved < 2.0  # pushed every 0.25 s; a loaded 2-core machine adds to that
        polled = comfy.session("jam")
        assert polled["knobs"]["prompt_blend"] == pytest.approx(0.37) and polled["running"], polled["knobs"]
        assert comfy.get("/queue")["queue_running"] == []
    finally:
        events.close()
        comfy.request("POST", "/flowjam/session/jam/knob", {"name": "prompt_blend", "value": 0.0})


def test_knob_route_refuses_a_malformed_body_with_400(comfy, jam):
    assert comfy.request("POST", "/flowjam/session/jam/knob", raw=b"not json")[0] == 400
    assert comfy.request("POST", "/flowjam/session/jam/knob", [1, 2])[0] == 400


# ---- 5. bad input through the API -----------------------------------------------------------------------------------


def _model(**changes) -> dict:
    inputs = {"preset": "tiny", "checkpoint": "none", "device": "cpu", "dtype": "float32", "backend": "eager"}
    return {"class_type": "FlowjamLoadModel", "inputs": {**inputs, **changes}}


def _generate_prompt(seconds: float = 0.4, **model_changes) -> dict:
    return {
        "1": _model(**model_changes),
        "2": {
            "class_type": "FlowjamTextConditioning",
            "inputs": {
                "model": ["1", 0],
                "tags": "test tone",
                "lyrics": "",
                "bpm": 0,
                "key": "",
                "time_signature": "",
                "duration": 0.0,
                "task": "text2music",
                "language": "",
            },
        },
        "3": {
            "class_type": "FlowjamGenerate",
            "inputs": {
                "model": ["1", 0],
                "conditioning": ["2", 0],
                "seconds": seconds,
                "seed": 1,
                "steps": 1,
                "shift": 3.0,
                "denoise": 1.0,
            },
        },
        "4": {"class_type": "PreviewAudio", "inputs": {"audio": ["3", 0]}},
    }


def _lm_prompt(seconds: float, seed: int) -> dict:
    """LM structure (the tiny LM) over `seconds` -> a short Generate following it -> Preview Audio."""
    prompt = _generate_prompt(seconds=0.4)
    prompt["5"] = {
        "class_type": "FlowjamLMStructure",
        "inputs": {
            "model": ["1", 0],
            "caption": "test tone",
            "seconds": seconds,
            "lyrics": "",
            "bpm": 90,
            "key": "C major",
            "time_signature": "4",
            "seed": seed,
            "cfg": 2.0,
            "temperature": 0.85,
            "top_p": 0.9,
            "lm_checkpoint": "none",
            "lm_preset": "tiny",
        },
    }
    prompt["3"]["inputs"]["structure"] = ["5", 0]
    return prompt


def test_cancel_stops_the_lm_structure_node_within_seconds(comfy):
    """Cancel (POST /interrupt) while LM structure writes 600 s of codes: its progress bar moved before, and the
    prompt ends as interrupted within seconds, long before the whole generation would have. Streams are stopped first
    (the jam fixture starts jam again): on a loaded 2-core CPU a playing stream slows the LM to a code every few
    seconds, and Cancel waits for the code in hand."""
    for name in comfy.sessions():
        comfy.run_ok(stop_prompt(name))
    events = Events(comfy)
    try:
        prompt = _lm_prompt(600.0, seed=int(uuid.uuid4().int % 2**31))  # a seed of its own: no cached result
        status, body = comfy.request("POST", "/prompt", {"prompt": prompt, "client_id": events.client_id})
        assert status == 200, body
        prompt_id = body["prompt_id"]

        def progress() -> list[tuple[float, dict]]:
            return [
                (at, data)
                for at, data in events.of("progress")
                if data.get("prompt_id") == prompt_id and data.get("node") == "5"
            ]

        wait_for(lambda: len(progress()) >= 2, 90, "progress events from LM structure", POLL_S)
        time.sleep(1.0)
        seen = progress()
        interrupted = time.monotonic()
        assert comfy.request("POST", "/interrupt", {"prompt_id": prompt_id})[0] == 200
        deadline = interrupted + 60
        while True:
            entry = comfy.get(f"/history/{prompt_id}").get(prompt_id)
            if entry and entry.get("status", {}).get("status_str") in ("success", "error"):
                break
            assert time.monotonic() < deadline, "the interrupted prompt did not end within 60 s"
            time.sleep(0.05)
        ended = time.monotonic() - interrupted
        (first_at, first), (last_at, last) = seen[0], seen[-1]
        rate = (last["value"] - first["value"]) / max(last_at - first_at, 1e-3)  # codes per second
        left_s = (last["max"] - last["value"]) / max(rate, 1e-3)
        print(
            f"\nLM structure: {len(seen)} progress events up to {last['value']}/{last['max']} codes "
            f"({rate:.0f} codes/s, {left_s:.0f} s left); the prompt ended {ended:.2f} s after Cancel",
            file=sys.stderr,
        )
        kinds = [kind for kind, _ in entry["status"]["messages"]]
        assert entry["status"]["status_str"] == "error" and "execution_interrupted" in kinds, entry["status"]
        stopped = dict(entry["status"]["messages"])["execution_interrupted"]
        assert stopped["node_id"] == "5" and stopped["node_type"] == "FlowjamLMStructure", stopped
        assert execution_error(entry) is None, "Cancel is an interruption, not an error"
        assert ended < 5.0, f"the prompt ended {ended:.1f} s after Cancel"
        assert last["max"] >= 3000 and last["value"] < last["max"] and left_s > 3 * ended, (last, left_s)
        assert [d for _, d in events.of("execution_interrupted") if d.get("prompt_id") == prompt_id]
        assert "3" not in entry.get("outputs", {}) and "4" not in entry.get("outputs", {})
    finally:
        events.close()
    comfy.run_ok(_generate_prompt(seconds=0.4))  # the server runs the next prompt as usual


def _source_prompt(file_name: str) -> dict:
    return {
        "1": _model(),
        "2": {"class_type": "LoadAudio", "inputs": {"audio": file_name}},
        "3": {"class_type": "FlowjamPrepareSource", "inputs": {"model": ["1", 0], "audio": ["2", 0]}},
        "4": {
            "class_type": "FlowjamStream",
            "inputs": {
                "model": ["1", 0],
                "conditioning": ["5", 0],
                "source": ["3", 0],
                "session_id": "bad_source",
                "song_seconds": 4.0,
                "depth": 1,
                "steps": 2,
                "denoise": 0.5,
                "seed": 1,
                "shift": 3.0,
                "prompt_blend": 0.0,
                "structure": 1.0,
                "audio_device": "none",
                "cfg_mode": "off",
                "window_seconds": 20.0,
                "endless": False,
                "bpm": 0.0,
                "time_signature": "4",
                "bars": 0,
                "sync": "off",
                "click": False,
            },
        },
        "5": {
            "class_type": "FlowjamTextConditioning",
            "inputs": {
                "model": ["1", 0],
                "tags": "cover",
                "lyrics": "",
                "bpm": 0,
                "key": "",
                "time_signature": "",
                "duration": 0.0,
                "task": "cover",
                "language": "",
            },
        },
    }


def _error_names(comfy: Comfy, prompt: dict, node: str, name: str) -> str:
    """Queue a bad prompt: it must be refused (400, node_errors naming input `name` of `node`) or fail in execution
    with a message naming the input; -> the message."""
    status, body = comfy.queue(prompt)
    if status == 400:
        errors = body["node_errors"][node]["errors"]
        assert any(e["extra_info"].get("input_name") == name for e in errors), errors
        return json.dumps(errors)
    assert status == 200, body
    entry = comfy.run(prompt)
    error = execution_error(entry)
    assert error is not None, f"the bad prompt ran: {entry['status']}"
    assert error["node_id"] == node and f"'{name}'" in error["exception_message"], error
    assert error["exception_type"].endswith("NodeInputError"), error
    return error["exception_message"]


def test_bad_inputs_are_refused_and_name_the_input_while_the_stream_plays(comfy, jam):
    before = comfy.session("jam")

    status, body = comfy.queue(_generate_prompt(seconds=-1.0))
    assert status == 400, body
    errors = body["node_errors"]["3"]["errors"]
    assert [e["extra_info"]["input_name"] for e in errors] == ["seconds"] and errors[0][
        "type"
    ] == "value_smaller_than_min"

    message = _error_names(comfy, _source_prompt(FIVE_CHANNELS), "3", "audio")
    assert "5 channels" in message
    message = _error_names(comfy, _source_prompt(LOW_RATE), "3", "audio")
    assert "4000" in message
    assert "bad_source" not in comfy.sessions()

    message = _error_names(
        comfy, _generate_prompt(checkpoint="diffusion_models/no_such_acestep.safetensors"), "1", "checkpoint"
    )
    assert "no_such_acestep" in message
    # ComfyUI 0.3.6x does not check V3 combo values in /prompt: flowjam does, naming the input
    message = _error_names(comfy, _generate_prompt(device="tpu"), "1", "device")
    assert "auto, cpu, cuda" in message
    _error_names(comfy, _generate_prompt(dtype="int8"), "1", "dtype")

    # a failing re-queue of the running stream itself (another model) leaves it playing, unchanged
    other_model = json.loads(json.dumps(jam))
    other_model[node_id(other_model, "FlowjamLoadModel")]["inputs"]["dtype"] = "bfloat16"
    other_model[node_id(other_model, "FlowjamStream")]["inputs"]["prompt_blend"] = 0.9
    # loading the tiny preset again in bfloat16 took 12 s alone and 260 s beside the playing stream on a loaded
    # 2-core box (two OpenMP pools on two cores): the refusal comes after that load
    entry = comfy.run(other_model, timeout=480)
    error = execution_error(entry)
    assert error and error["node_type"] == "FlowjamStream" and "another model" in error["exception_message"], error

    ticks = comfy.session("jam")["ticks"]
    wait_for(lambda: comfy.session("jam")["ticks"] > ticks + 10, 10, "the jam stream to keep ticking", POLL_S)
    after = comfy.session("jam")
    assert after["ticks"] > before["ticks"] and after["playing"] and after["errors"] == before["errors"]
    assert after["knobs"]["prompt_blend"] == before["knobs"]["prompt_blend"]
    comfy.run_ok(_generate_prompt(seconds=0.4))  # and the server still runs good prompts


# ---- 6. the live panel in a real browser ----------------------------------------------------------------------------

_PANEL_JS = r"""
const { chromium } = require('playwright-core');
const fs = require('fs');
const [url, workflowPath, out] = process.argv.slice(2);
(async () => {
  const browser = await chromium.launch({ executablePath: process.env.FLOWJAM_CHROMIUM, headless: true,
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking', '--disable-component-update',
           '--disable-sync'] });
  try {
    const page = await browser.newPage({ viewport: { width: 1400, height: 900 } });
    const errors = [];
    page.on('pageerror', (e) => errors.push(String(e)));
    await page.goto(url, { waitUntil: 'networkidle', timeout: 60000 });
    await page.waitForFunction(() => window.app && window.app.graph, null, { timeout: 60000 });
    const workflow = JSON.parse(fs.readFileSync(workflowPath, 'utf8'));
    await page.evaluate(async (wf) => { await window.app.loadGraphData(wf); }, workflow);
    await page.waitForFunction(() => {
      const panel = document.querySelector('.flowjam-panel');
      return panel && /^tick [\d.]+ ms/.test(panel.firstChild.textContent)
        && panel.querySelector('input[data-knob="velocity_scale"]')?.max === '2';
    }, null, { timeout: 30000 });
    await page.evaluate(() => {
      const node = window.app.graph._nodes.find((n) => n.type === 'FlowjamStream');
      window.app.canvas.centerOnNode?.(node);
      window.app.canvas.setDirty(true, true);
    });
    await page.waitForTimeout(1000);
    const before = await page.evaluate(() => {
      const panel = document.querySelector('.flowjam-panel');
      const node = window.app.graph._nodes.find((n) => n.type === 'FlowjamStream');
      const box = panel.getBoundingClientRect();
      return {
        meters: panel.firstChild.textContent,
        sliders: Object.fromEntries([...panel.querySelectorAll('input[type=range]')].map((i) => [i.dataset.knob, [Number(i.value), Number(i.min), Number(i.max)]])),
        knobs: [...panel.querySelectorAll('[data-knob]')].map((control) => control.dataset.knob),
        panel: { width: box.width, height: box.height, scrollHeight: panel.scrollHeight, clientHeight: panel.clientHeight },
        node: { size: [...node.size], min: [...node.computeSize()] },
        overlaps: window.app.graph._nodes.filter((other) => other !== node
          && other.pos[0] < node.pos[0] + node.size[0] && node.pos[0] < other.pos[0] + other.size[0]
          && other.pos[1] < node.pos[1] + node.size[1] && node.pos[1] < other.pos[1] + other.size[1]).map((other) => other.type),
      };
    });
    await page.screenshot({ path: out });
    // turn a knob the way a hand does: the slider posts it to the stream, no queue
    await page.evaluate(() => {
      const input = document.querySelector('.flowjam-panel input[data-knob="velocity_scale"]');
      input.value = '0.9';
      input.dispatchEvent(new Event('input', { bubbles: true }));
    });
    await page.waitForTimeout(800);
    console.log(JSON.stringify({ before, errors }));
  } finally {
    await browser.close();
  }
})().catch((e) => { console.error(e); process.exit(1); });
"""


def _browser_missing() -> str | None:
    if shutil.which("node") is None:
        return "node is not installed"
    if not Path(CHROMIUM).exists():
        return f"{CHROMIUM} is missing (apt-get install chromium)"
    if not (PLAYWRIGHT / "node_modules" / "playwright-core").is_dir():
        return f"playwright-core is not installed in {PLAYWRIGHT} (npm i playwright-core there)"
    return None


def test_live_panel_shows_the_running_stream_in_the_browser(comfy, jam, tmp_path):
    missing = _browser_missing()
    if missing:
        print(f"\nSKIPPED browser test: {missing}", file=sys.stderr)
        pytest.skip(missing)
    comfy.request("POST", "/flowjam/session/jam/knob", {"name": "velocity_scale", "value": 1.25})
    script = tmp_path / "panel.js"
    script.write_text(_PANEL_JS)
    env = dict(os.environ, NODE_PATH=str(PLAYWRIGHT / "node_modules"), FLOWJAM_CHROMIUM=CHROMIUM)
    command = ["node", str(script), comfy.base, str(WORKFLOWS / TEXT_JAM), str(SCREENSHOT)]
    started = time.monotonic()
    process = subprocess.Popen(
        command,
        cwd=PLAYWRIGHT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # node and the Chromium it started
        stdout, stderr = process.communicate()
        pytest.fail(f"the browser script timed out:\n{stdout}\n{stderr}")
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert process.returncode == 0, f"{stdout}\n{stderr}"
    print(f"\nbrowser: {time.monotonic() - started:.1f} s; screenshot {SCREENSHOT}", file=sys.stderr)
    result = json.loads(stdout.strip().splitlines()[-1])
    before = result["before"]
    assert before["meters"].startswith("tick ") and "playhead" in before["meters"] and "lead" in before["meters"]
    sliders = before["sliders"]
    assert set(before["knobs"]) == {spec.name for spec in KNOB_SPECS}, "the panel has a row for every registry knob"
    assert {"velocity_scale", "denoise", "prompt_blend", "ode_noise", "guidance", "volume"} <= set(sliders)
    assert sliders["velocity_scale"] == [pytest.approx(1.25), 0, 2]  # the stream's knob value and range
    assert sliders["denoise"][0] == pytest.approx(0.7) and sliders["volume"][0] == pytest.approx(0.8)
    panel, node = before["panel"], before["node"]
    assert panel["height"] > 100 and panel["scrollHeight"] <= panel["clientHeight"] + 1, (
        panel
    )  # all of it inside the node
    assert node["size"][1] >= node["min"][1] - 1, node
    assert not [e for e in result["errors"] if "flowjam" in e], result["errors"]
    if before["overlaps"]:  # a layout problem of the workflow file, not of the panel: reported, not failed
        warnings.warn(
            f"in {TEXT_JAM} the Stream node (grown to {node['size']} to fit its panel) covers {before['overlaps']}",
            stacklevel=1,
        )
    assert comfy.session("jam")["knobs"]["velocity_scale"] == pytest.approx(0.9)  # the slider reached the stream
    assert comfy.get("/queue")["queue_pending"] == []
    assert SCREENSHOT.is_file() and SCREENSHOT.stat().st_size > 10_000
    copy = os.environ.get("FLOWJAM_COMFYUI_SCREENSHOT")
    if copy:
        shutil.copyfile(SCREENSHOT, copy)


# ---- 7. the live panel follows the graph, and keeps quiet without a stream ------------------------------------------

_BROWSER_HEAD = r"""
const { chromium } = require('playwright-core');
const fs = require('fs');
const [url, workflowPath, ...rest] = process.argv.slice(2);
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
async function openGraph(page, workflowPath) {
  await page.addInitScript(() => {  // helpers for the functions that run in the page
    window.fjMeters = () => document.querySelector('.flowjam-panel')?.firstChild.textContent ?? '';
    window.fjControls = () => [...document.querySelectorAll('.flowjam-panel [data-knob]')];
  });
  await page.goto(url, { waitUntil: 'networkidle', timeout: 60000 });
  await page.waitForFunction(() => window.app && window.app.graph, null, { timeout: 60000 });
  const workflow = JSON.parse(fs.readFileSync(workflowPath, 'utf8'));
  await page.evaluate(async (wf) => {
    await window.app.loadGraphData(wf);
    window.app.canvas.centerOnNode?.(window.app.graph._nodes.find((n) => n.type === 'FlowjamStream'));
  }, workflow);
}
async function waitPanel(page, what, fn, arg = null, timeout = 30000) {  // a timeout says what the panel shows
  try {
    await page.waitForFunction(fn, arg, { timeout });
  } catch (error) {
    throw new Error(`timed out after ${timeout} ms waiting for ${what}; the panel says: ${await page.evaluate(() => fjMeters())}`);
  }
}
async function postPrompt(prompt) {  // another client queues a prompt (the browser gets no execution events for it)
  const response = await fetch(url + '/prompt', { method: 'POST', headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify({ prompt, client_id: 'flowjam-test-other-client' }) });
  if (!response.ok) throw new Error(`/prompt answered ${response.status}: ${await response.text()}`);
}
async function queueIdle() {
  for (;;) {
    const queue = await (await fetch(url + '/queue')).json();
    if (!queue.queue_running.length && !queue.queue_pending.length) return;
    await sleep(200);
  }
}
(async () => {
  const browser = await chromium.launch({ executablePath: process.env.FLOWJAM_CHROMIUM, headless: true,
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking', '--disable-component-update',
           '--disable-sync'] });
  try {
    const page = await browser.newPage({ viewport: { width: 1400, height: 900 } });
    const consoleErrors = [];
    page.on('console', (m) => { if (m.type() === 'error') consoleErrors.push(`${m.text()} @ ${m.location().url ?? ''}`); });
    page.on('pageerror', (e) => consoleErrors.push(String(e)));
    const flowjamRequests = [];
    page.on('response', (r) => { if (r.url().includes('/flowjam/'))
      flowjamRequests.push({ url: r.url(), method: r.request().method(), status: r.status(), at: Date.now() }); });
    const result = await main(page, flowjamRequests);
    console.log(JSON.stringify({ ...result, consoleErrors, flowjamRequests }));
  } finally {
    await browser.close();
  }
})().catch((e) => { console.error(e); process.exit(1); });
"""

_REQUEUE_PANEL_JS = r"""
async function queueFromTheBrowser(page) {  // what the Run button does
  await page.evaluate(async () => { await window.app.queuePrompt(0, 1); });
  await sleep(300);
  await queueIdle();
}
async function panelState(page) {
  return page.evaluate(() => {
    const panel = document.querySelector('.flowjam-panel');
    const stream = window.app.graph._nodes.find((n) => n.type === 'FlowjamStream');
    const shared = window.app.graph._nodes.find((n) => n.type === 'FlowjamSharedCurve');
    const row = (knob) => { const input = panel.querySelector(`[data-knob="${knob}"]`);
      return { value: input.value, disabled: input.disabled, shown: input.nextElementSibling.textContent }; };
    return { meters: panel.firstChild.textContent, velocity_scale: row('velocity_scale'), prompt_blend: row('prompt_blend'),
      streamWidget: stream.widgets.find((w) => w.name === 'prompt_blend').value,
      sharedWidget: shared.widgets.find((w) => w.name === 'value').value };
  });
}
async function main(page) {
  await openGraph(page, workflowPath);
  await page.evaluate(() => {
    const stream = window.app.graph._nodes.find((n) => n.type === 'FlowjamStream');
    stream.widgets.find((w) => w.name === 'audio_device').value = 'none';
  });
  await waitPanel(page, 'the running jam stream', () => /^tick [\d.]+ ms/.test(fjMeters()));
  // as shipped, a wave drives velocity_scale: the panel says "curve" and leaves that knob to the curve
  await queueFromTheBrowser(page);
  await waitPanel(page, 'velocity_scale to be curve-driven',
    () => document.querySelector('.flowjam-panel [data-knob="velocity_scale"]').disabled);
  const curveDriven = await panelState(page);
  await page.screenshot({ path: '/tmp/flowjam_live_panel_curve.png' });
  // the curve disconnected: the Shared curve's value drives it, and the panel plays it
  await page.evaluate(() => {
    const shared = window.app.graph._nodes.find((n) => n.type === 'FlowjamSharedCurve');
    shared.disconnectInput(shared.findInputSlot('curve'));
  });
  await queueFromTheBrowser(page);
  await waitPanel(page, 'velocity_scale to be playable',
    () => !document.querySelector('.flowjam-panel [data-knob="velocity_scale"]').disabled);
  await page.evaluate(() => {
    for (const [knob, value] of [['prompt_blend', '0.77'], ['velocity_scale', '1.3']]) {
      const input = document.querySelector(`.flowjam-panel input[data-knob="${knob}"]`);
      input.value = value;
      input.dispatchEvent(new Event('input', { bubbles: true }));
    }
  });
  await sleep(800);
  const moved = await panelState(page);
  const heardBefore = (await (await fetch(url + '/flowjam/session/jam')).json()).knobs;
  await queueFromTheBrowser(page);  // the re-queue: the graph now carries what the panel set
  await sleep(600);
  const heardAfter = (await (await fetch(url + '/flowjam/session/jam')).json()).knobs;
  return { curveDriven, moved, heardBefore, heardAfter, requeued: await panelState(page) };
}
"""

_QUIET_PANEL_JS = r"""
const [startPath, stopPath, stream] = rest;
const layout = () => {
  const panel = document.querySelector('.flowjam-panel');
  const overflows = (el) => el.scrollWidth > el.clientWidth + 1;
  return { labels: [...panel.querySelectorAll('label > span:first-child')].filter(overflows).map((el) => el.textContent),
    meterLines: [...panel.firstChild.children].map((line) => ({ text: line.textContent, cut: overflows(line) })) };
};
async function main(page, flowjamRequests) {
  await openGraph(page, workflowPath);
  await waitPanel(page, 'the no-stream state', (name) => fjMeters().startsWith(`no stream "${name}"`)
    && fjControls().length > 0, stream);
  const firstSeen = Date.now();
  await page.screenshot({ path: '/tmp/flowjam_live_panel_absent.png' });
  const absent = await page.evaluate(() => ({ meters: fjMeters(), allDisabled: fjControls().every((c) => c.disabled),
    rows: fjControls().map((c) => [c.dataset.knob, c.value, c.nextElementSibling.textContent]) }));
  await page.evaluate(() => {  // a hand on a disabled slider must post nothing
    const input = document.querySelector('.flowjam-panel input[data-knob="volume"]');
    input.value = '0.1';
    input.dispatchEvent(new Event('input', { bubbles: true }));
  });
  await sleep(12000);
  const polls = flowjamRequests.filter((r) => r.method === 'GET' && r.at >= firstSeen && r.at < firstSeen + 12000).length;
  const startedAt = Date.now();
  await postPrompt(JSON.parse(fs.readFileSync(startPath, 'utf8')));
  await waitPanel(page, 'the new stream', () => /^tick [\d.]+ ms/.test(fjMeters()));
  const foundAfterMs = Date.now() - startedAt;
  await sleep(1000);
  const running = await page.evaluate(() => ({ enabled: fjControls().filter((c) => !c.disabled).map((c) => c.dataset.knob) }));
  const runningLayout = await page.evaluate(layout);
  const stoppedAt = Date.now();
  await postPrompt(JSON.parse(fs.readFileSync(stopPath, 'utf8')));
  await waitPanel(page, 'the stopped state', (name) => fjMeters().startsWith(`no stream "${name}"`)
    && fjControls().every((c) => c.disabled), stream, 15000);
  const goneAfterMs = Date.now() - stoppedAt;
  return { absent, polls, foundAfterMs, running, runningLayout, goneAfterMs };
}
"""


def _run_browser(comfy: Comfy, main_js: str, tmp_path: Path, *args: str) -> dict:
    """Run `_BROWSER_HEAD` + `main_js` (which defines `main(page, flowjamRequests)`) in node against the server;
    -> the JSON it prints, with consoleErrors and every /flowjam/ response the page saw."""
    script = tmp_path / "browser.js"
    script.write_text(_BROWSER_HEAD + main_js)
    env = dict(os.environ, NODE_PATH=str(PLAYWRIGHT / "node_modules"), FLOWJAM_CHROMIUM=CHROMIUM)
    process = subprocess.Popen(
        ["node", str(script), comfy.base, *args],
        cwd=PLAYWRIGHT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=170)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # node and the Chromium it started
        stdout, stderr = process.communicate()
        pytest.fail(f"the browser script timed out:\n{stdout}\n{stderr}\n{comfy.log_tail()}")
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert process.returncode == 0, f"{stdout}\n{stderr}\n{comfy.log_tail()}"
    return json.loads(stdout.strip().splitlines()[-1])


def _flowjam_errors(result: dict) -> list[str]:
    return [e for e in result["consoleErrors"] if "flowjam" in e.lower()]


def test_a_panel_move_survives_a_requeue_from_the_browser(comfy, jam, tmp_path):
    """Panel moves used to be lost on re-queue (prompt_blend 0.77 went back to the widget's 0.0): the panel now writes
    the Stream widget, and for a shared knob the value of the Shared curve wired to it."""
    missing = _browser_missing()
    if missing:
        pytest.skip(missing)
    started = time.monotonic()
    result = _run_browser(comfy, _REQUEUE_PANEL_JS, tmp_path, str(WORKFLOWS / TEXT_JAM))
    print(f"\nbrowser re-queue: {time.monotonic() - started:.1f} s", file=sys.stderr)
    try:
        curve = result["curveDriven"]["velocity_scale"]
        assert curve["disabled"] and curve["shown"] == "curve", result["curveDriven"]
        moved = result["moved"]
        assert moved["streamWidget"] == pytest.approx(0.77) and moved["sharedWidget"] == pytest.approx(1.3), moved
        assert result["heardBefore"]["prompt_blend"] == pytest.approx(0.77), "the move reached the stream"
        after = result["heardAfter"]
        assert after["prompt_blend"] == pytest.approx(0.77), f"the re-queue reset prompt_blend: {after}"
        assert after["velocity_scale"] == pytest.approx(1.3), f"the re-queue reset velocity_scale: {after}"
        assert result["requeued"]["prompt_blend"]["shown"] == "0.77"
        assert not _flowjam_errors(result), result["consoleErrors"]
        assert all(r["status"] == 200 for r in result["flowjamRequests"]), result["flowjamRequests"]
    finally:
        comfy.run_ok(jam)  # back to the shipped values
    assert comfy.session("jam")["knobs"]["prompt_blend"] == pytest.approx(0.0)


def _lone_stream_prompt(name: str) -> dict:
    """The jam workflow's model, prompts and Stream only, as stream `name`."""
    prompt = api_prompt(TEXT_JAM)
    keep = {i for i, n in prompt.items() if n["class_type"] in ("FlowjamLoadModel", "FlowjamTextConditioning")}
    keep.add(node_id(prompt, "FlowjamStream"))
    lone = {i: prompt[i] for i in keep}
    for node in lone.values():
        node["inputs"] = {
            k: v for k, v in node["inputs"].items() if not (isinstance(v, list) and len(v) == 2 and v[0] not in keep)
        }
    lone[node_id(lone, "FlowjamStream")]["inputs"]["session_id"] = name
    return lone


def test_the_panel_without_a_stream_is_disabled_backs_off_and_logs_nothing(comfy, tmp_path):
    """No stream used to mean sliders mid-way with no values, 4 polls a second and a red 404 in the console for each."""
    missing = _browser_missing()
    if missing:
        pytest.skip(missing)
    name = f"ghost_{uuid.uuid4().hex[:6]}"
    workflow = json.loads((WORKFLOWS / TEXT_JAM).read_text())
    (stream,) = [n for n in workflow["nodes"] if n["type"] == "FlowjamStream"]
    stream["widgets_values"][stream["widgets_values"].index("jam")] = name
    paths = {"workflow": tmp_path / "ghost.json", "start": tmp_path / "start.json", "stop": tmp_path / "stop.json"}
    paths["workflow"].write_text(json.dumps(workflow))
    paths["start"].write_text(json.dumps(_lone_stream_prompt(name)))
    paths["stop"].write_text(json.dumps(stop_prompt(name)))
    started = time.monotonic()
    result = _run_browser(comfy, _QUIET_PANEL_JS, tmp_path, *map(str, paths.values()), name)
    print(
        f"\nbrowser quiet panel: {time.monotonic() - started:.1f} s; {result['polls']} polls in 12 s without a stream; "
        f"found the stream {result['foundAfterMs']} ms after its prompt, saw it stop after {result['goneAfterMs']} ms",
        file=sys.stderr,
    )
    absent = result["absent"]
    assert absent["meters"].startswith(f'no stream "{name}" — queue the graph') and absent["allDisabled"], absent
    rows = {knob: (value, shown) for knob, value, shown in absent["rows"]}
    assert rows["prompt_blend"] == ("0", "–") and rows["volume"] == ("0.8", "–"), "resting at the start values"
    # another stream's status events reach the panel (they say this one is absent): it need not poll at all
    assert result["polls"] <= 8, f"{result['polls']} polls in 12 s: the poll must back off to one per 2 s or less"
    requests = result["flowjamRequests"]
    assert not [r for r in requests if r["method"] == "POST"], "the panel posted to a stream that is not there"
    assert all(r["status"] == 200 for r in requests), [r for r in requests if r["status"] != 200]
    assert not _flowjam_errors(result), result["consoleErrors"]
    assert result["foundAfterMs"] < 15_000 and result["goneAfterMs"] < 5_000
    assert "velocity_scale" in result["running"]["enabled"] and "cfg_mode" in result["running"]["enabled"]
    layout = result["runningLayout"]
    assert layout["labels"] == [], f"labels cut off: {layout['labels']}"
    assert len(layout["meterLines"]) == 3 and not any(line["cut"] for line in layout["meterLines"]), layout
    assert layout["meterLines"][0]["text"].startswith("tick ") and "playhead" in layout["meterLines"][1]["text"]
    assert re.match(LOOP_FIELD, layout["meterLines"][2]["text"]), "the third line says what plays (point 23)"
    assert name not in comfy.sessions()


# ---- 8. a live graph that stops itself ------------------------------------------------------------------------------


def test_a_graph_with_an_osc_bridge_and_a_stream_stop_runs_clean(comfy):
    """Stream -> OSC bridge, and a Shared curve on another branch; a Stream stop chained after both runs last: the
    graph runs with no error and no traceback, the bridge's port is free again, and the same graph runs twice."""
    port = free_udp_port()
    prompt = api_prompt(BLEND_OSC, osc_port=port)
    stream = node_id(prompt, "FlowjamStream")
    prompt[stream]["inputs"]["session_id"] = "osc_stop"
    for capture in [i for i, n in prompt.items() if n["class_type"] in ("FlowjamStreamCapture", "PreviewAudio")]:
        del prompt[capture]  # a capture at once after the start may hold no audio yet: not what this test is about
    prompt["curve"] = {
        "class_type": "FlowjamSharedCurve",
        "inputs": {"stream": [stream, 0], "knob": "velocity_scale", "value": 1.2},
    }
    prompt["stop"] = {
        "class_type": "FlowjamStreamStop",
        "inputs": {"stream": [node_id(prompt, "FlowjamOscBridge"), 0], "after": ["curve", 0]},
    }
    for _ in range(2):
        logged_from = comfy.log_size()
        started = time.monotonic()
        comfy.run_ok(prompt)  # a bridge or a curve run after the stop would fail: no running stream
        print(f"\nOSC bridge + Stream stop graph: {time.monotonic() - started:.1f} s", file=sys.stderr)
        assert "osc_stop" not in comfy.sessions(), "the Stream stop did not stop the stream"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.bind(("127.0.0.1", port))  # raises if the stopped bridge still holds its port
        time.sleep(0.5)  # the log is written by the server process: let it catch up
        logged = comfy.log_since(logged_from)
        assert "Traceback" not in logged and "Exception" not in logged, logged


# ---- 9. ComfyUI's model management: /free gives a model's memory back, a running stream keeps its own ---------------

MODEL_COPIES = 8


def _tiny_checkpoints(folder: Path) -> tuple[list[str], int]:
    """MODEL_COPIES files of the tiny preset in the server's diffusion_models folder -> (their names as Load model
    lists them, the parameter bytes of one model)."""
    from flowjam.engine.checkpoints.loading import save_flowjam_file
    from flowjam.engine.session import Session

    models = Session.load(preset="tiny").models
    first = save_flowjam_file(models, folder / "acestep_tiny_0.safetensors")
    for copy in range(1, MODEL_COPIES):
        shutil.copyfile(first, folder / f"acestep_tiny_{copy}.safetensors")
    networks = (models.acestep, models.text_encoder, models.vae)
    weights = sum(t.numel() * t.element_size() for net in networks for t in net.state_dict().values())
    return [f"diffusion_models/acestep_tiny_{copy}.safetensors" for copy in range(MODEL_COPIES)], weights


def _generate_with_each(checkpoints: list[str]) -> dict:
    """A short Generate per checkpoint, each with its own Load model: one model per checkpoint, held by the cache."""
    prompt = {}
    for copy, checkpoint in enumerate(checkpoints):
        for key, node in _generate_prompt(checkpoint=checkpoint).items():
            inputs = {k: [f"{copy}_{v[0]}", v[1]] if isinstance(v, list) else v for k, v in node["inputs"].items()}
            prompt[f"{copy}_{key}"] = {**node, "inputs": inputs}
    return prompt


def test_free_gives_the_models_memory_back_and_a_running_stream_plays_on(comfy):
    """ComfyUI's /free drops its cache: flowjam's models go with it and their memory back to the system, while a
    stream playing its own model plays on; the next queue loads them again."""
    checkpoints, weights = _tiny_checkpoints(comfy.dirs["models"])
    expected, mb = MODEL_COPIES * weights, 2**20
    free = {"unload_models": True, "free_memory": True}
    comfy.run_ok(_lone_stream_prompt("kept"))
    try:
        assert comfy.request("POST", "/free", free)[0] == 200  # what earlier tests left goes first
        time.sleep(2.0)
        before = comfy.rss_bytes()
        prompt = _generate_with_each(checkpoints)
        comfy.run_ok(prompt)
        loaded = comfy.rss_bytes()
        ticks = comfy.session("kept")["ticks"]
        started = time.monotonic()
        status, body = comfy.request("POST", "/free", free)
        assert status == 200, body

        def given_back() -> int:
            freed = loaded - comfy.rss_bytes()
            return freed if freed >= expected / 2 else 0  # the running stream's own churn takes back tens of MB

        what = f"the server's memory to go down by half the models' {expected / mb:.0f} MB of weights"
        freed = wait_for(given_back, 20, what, POLL_S)
        print(
            f"\n/free: {MODEL_COPIES} tiny models ({expected / mb:.0f} MB of weights) took {(loaded - before) / mb:.0f} MB;"
            f" {freed / mb:.0f} MB given back after {time.monotonic() - started:.1f} s",
            file=sys.stderr,
        )
        wait_for(lambda: comfy.session("kept")["ticks"] > ticks + 10, 10, "the stream to keep ticking", POLL_S)
        playing = comfy.session("kept")
        assert playing["playing"] and playing["errors"] == 0, playing
        comfy.run_ok(prompt)  # the freed models load again on demand
    finally:
        comfy.run(stop_prompt("kept"), timeout=30)
        for checkpoint in checkpoints:
            (comfy.dirs["models"] / Path(checkpoint).name).unlink()


# ---- 10. issue 43: the fixes of points 16 and 20-24, in a real ComfyUI ----------------------------------------------


def test_a_posted_string_for_endless_is_refused_naming_the_input(comfy):
    """Point 21: ComfyUI's /prompt turns a BOOLEAN widget's "false" into bool("false"), True, before any node sees
    it; an endless stream started. flowjam's on_prompt handler makes that conversion fail: a 400 naming 'endless'."""
    prompt = _lone_stream_prompt("typed_bool")
    stream = node_id(prompt, "FlowjamStream")
    prompt[stream]["inputs"].update(endless="false", audio_device="none")
    status, body = comfy.queue(prompt)
    if status == 200:  # the other acceptable outcome: read as false
        comfy.run_ok(prompt)
        try:
            assert comfy.session("typed_bool")["endless"] is False, "'false' started an endless stream"
        finally:
            comfy.run(stop_prompt("typed_bool"), timeout=30)
        return
    assert status == 400, body
    (error,) = body["node_errors"][stream]["errors"]
    print(f"\n'endless': 'false' refused: {error['details']}", file=sys.stderr)
    assert error["extra_info"]["input_name"] == "endless", error
    assert "takes true or false (a JSON boolean, not a string), got 'false'" in error["extra_info"]["exception_message"]
    assert "typed_bool" not in comfy.sessions()
    prompt[stream]["inputs"]["endless"] = False  # the same prompt with a JSON boolean runs
    comfy.run_ok(prompt)
    try:
        assert comfy.session("typed_bool")["endless"] is False
    finally:
        comfy.run(stop_prompt("typed_bool"), timeout=30)


def test_a_string_wired_as_conditioning_names_the_input_not_an_attribute_error(comfy):
    """Point 21: a text where the Stream and Generate want a conditioning output failed deep in the engine with
    AttributeError 'cross_kv'; now the node's error names the input and says to connect it."""
    prompt = _lone_stream_prompt("typed_socket")
    stream = node_id(prompt, "FlowjamStream")
    prompt[stream]["inputs"].update(conditioning="warm analog pads", audio_device="none")
    message = _error_names(comfy, prompt, stream, "conditioning")
    print(f"\nconditioning as text: {message}", file=sys.stderr)
    assert "FLOWJAM_CONDITIONING output of another node" in message and "AttributeError" not in message, message
    assert "typed_socket" not in comfy.sessions()
    generate = _generate_prompt()
    generate["3"]["inputs"]["conditioning"] = "warm analog pads"
    assert "FLOWJAM_CONDITIONING output" in _error_names(comfy, generate, "3", "conditioning")


def test_a_corrupt_lora_in_a_generate_graph_names_only_this_graphs_loras(comfy):
    """Point 22: Generate graphs share the model's session, so a broken LoRA's error listed 'LoRAs loaded: ...' of an
    earlier graph; now it names the broken file and says nothing was generated."""
    good = _lora_render_prompt("none", 1.0, "flowjam_test/lora_good")
    comfy.run_ok(good)  # this LoRA is now loaded into the tiny model's session
    broken = comfy.dirs["root"] / "models" / "loras" / BROKEN_LORA
    broken.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header" + bytes(range(256)) * 4)
    try:
        bad = json.loads(json.dumps(good))
        bad["6"]["inputs"]["lora"] = BROKEN_LORA
        bad["5"]["inputs"]["filename_prefix"] = "flowjam_test/lora_bad"
        error = execution_error(comfy.run(bad))
    finally:
        broken.unlink(missing_ok=True)
    assert error is not None, "a Generate through a broken LoRA ran"
    message = error["exception_message"].strip()
    print(f"\nbroken LoRA in Generate ({error['node_type']}): {message}", file=sys.stderr)
    assert BROKEN_LORA in message and "nothing was generated" in message, message
    assert LORA_FILE not in message and "LoRAs loaded" not in message, f"another graph's LoRA named: {message}"
    comfy.run_ok(good)  # the good graph still renders


LOOP_FIELD = r"loop \d+\.\d s( · \d+ bars @ \d+(\.\d+)?)? · window"  # bars where the stream has a grid


def test_the_status_says_what_a_stream_plays_loop_bars_and_endless(comfy, jam):
    """Point 23: the status the panel shows says what plays: loop length, bars @ bpm and the window, or endless."""
    looped = comfy.session("jam")
    assert looped["endless"] is False and re.match(LOOP_FIELD, looped["loop"]), looped["loop"]
    assert f"loop {looped['loop_s']:.1f} s" in looped["loop"]
    prompt = _lone_stream_prompt("endless_jam")
    prompt[node_id(prompt, "FlowjamStream")]["inputs"].update(endless=True, audio_device="none")
    comfy.run_ok(prompt)
    try:
        endless = comfy.session("endless_jam")
        print(f"\nstatus lines: {looped['loop']!r}; {endless['loop']!r}", file=sys.stderr)
        assert endless["endless"] is True and endless["loop"].startswith("endless · window "), endless["loop"]
    finally:
        comfy.run(stop_prompt("endless_jam"), timeout=30)


_HEADLESS_PANEL_JS = r"""
async function main(page) {
  const consoleAll = [];  // every console message from the first load on (not only errors)
  page.on('console', (m) => consoleAll.push(`${m.type()}: ${m.text()}`));
  await page.addInitScript(() => {
    window.fjMeters = () => document.querySelector('.flowjam-panel')?.firstChild.textContent ?? '';
  });
  await page.goto(url, { waitUntil: 'networkidle', timeout: 60000 });
  await page.waitForFunction(() => window.app && window.app.graph && window.LiteGraph, null, { timeout: 60000 });
  await page.evaluate(() => {  // every deprecated read, with the code that made it (LiteGraph warns once per message)
    window.fjDeprecations = [];
    window.LiteGraph.alwaysRepeatWarnings = true;
    window.LiteGraph.onDeprecationWarning.push((message) => window.fjDeprecations.push({ message: String(message),
      stack: new Error().stack }));
  });
  const workflow = JSON.parse(fs.readFileSync(workflowPath, 'utf8'));
  await page.evaluate(async (wf) => { await window.app.loadGraphData(wf); }, workflow);
  await waitPanel(page, 'the running stream with its notice', () => {
    const panel = document.querySelector('.flowjam-panel');
    const notice = panel?.children[1];
    return /^tick [\d.]+ ms/.test(fjMeters()) && notice && !notice.hidden && notice.textContent.length > 0
      && panel.querySelectorAll('[data-knob]').length > 0;
  });
  await page.evaluate(() => {  // a hand on velocity_scale: the write-back looks for Shared curves wired for it
    const input = document.querySelector('.flowjam-panel input[data-knob="velocity_scale"]');
    input.value = '1.1';
    input.dispatchEvent(new Event('input', { bubbles: true }));
  });
  await sleep(1500);
  const measured = await page.evaluate(() => {
    const panel = document.querySelector('.flowjam-panel');
    const notice = panel.children[1];
    const box = (el) => { const r = el.getBoundingClientRect(); return { left: r.left, right: r.right, width: r.width, height: r.height }; };
    const style = getComputedStyle(notice);
    const oneLine = notice.cloneNode(true);  // the notice's width unwrapped, to know it had to wrap
    oneLine.style.cssText = 'position: absolute; visibility: hidden; white-space: nowrap; width: auto;';
    document.body.append(oneLine);
    const unwrapped = oneLine.getBoundingClientRect().width;
    oneLine.remove();
    const node = window.app.graph._nodes.find((n) => n.type === 'FlowjamStream');
    return {
      panel: box(panel),
      nodeWidthPx: node.size[0] * (window.app.canvas.ds?.scale ?? 1),
      notice: { ...box(notice), text: notice.textContent, scrollWidth: notice.scrollWidth, clientWidth: notice.clientWidth,
        unwrapped, fontSize: parseFloat(style.fontSize), color: style.color, background: style.backgroundColor },
      rows: [...panel.querySelectorAll('label')].map((row) => ({ knob: row.querySelector('[data-knob]').dataset.knob,
        row: box(row), parts: [...row.children].map(box), cut: [...row.children].some((el) => el.scrollWidth > el.clientWidth + 1) })),
      loopLine: panel.firstChild.children[2].textContent,
      playheadHidden: panel.querySelector('progress').hidden,
    };
  });
  await page.screenshot({ path: '/tmp/flowjam_live_panel_headless.png' });
  const deprecations = await page.evaluate(() => window.fjDeprecations);
  return { measured, consoleAll, deprecations };
}
"""


def _rgb(css: str) -> tuple[float, float, float, float]:
    """A computed CSS colour, rgb(...) or rgba(...) -> (r, g, b, alpha)."""
    found = re.fullmatch(r"rgba?\(([\d.]+),\s*([\d.]+),\s*([\d.]+)(?:,\s*([\d.]+))?\)", css.strip())
    assert found, f"not a computed rgb colour: {css!r}"
    r, g, b, a = found.groups()
    return float(r), float(g), float(b), 1.0 if a is None else float(a)


def _contrast(text: str, background: str) -> float:
    """WCAG 2 contrast ratio of two opaque computed colours."""

    def luminance(colour: str) -> float:
        *channels, alpha = _rgb(colour)
        assert alpha == 1.0, f"{colour} is not opaque: its contrast depends on what lies under it"
        linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in (v / 255 for v in channels)]
        return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]

    high, low = sorted((luminance(text), luminance(background)), reverse=True)
    return (high + 0.05) / (low + 0.05)


_SERVED_STATUS_JS = """
import { readFileSync } from "node:fs";
const { CSS, statusView } = await import(process.argv[2]);
console.log(JSON.stringify({ css: CSS, view: statusView(JSON.parse(readFileSync(0, "utf8"))) }));
"""


def _served_panel_status(comfy: Comfy, status: dict, tmp_path: Path) -> dict:
    """The panel_status.js the server serves (not the checkout's file), run under node on `status`."""
    status_code, source = comfy.request("GET", "/extensions/flowjam/panel_status.js")
    assert status_code == 200 and "statusView" in source, (status_code, str(source)[:300])
    (tmp_path / "served_panel_status.mjs").write_text(source)
    (tmp_path / "view.mjs").write_text(_SERVED_STATUS_JS)
    result = subprocess.run(
        ["node", "view.mjs", str(tmp_path / "served_panel_status.mjs")],
        cwd=tmp_path,
        input=json.dumps(status),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_a_headless_streams_panel_wraps_its_warning_fits_every_row_and_logs_nothing(comfy, tmp_path):
    """Points 16, 20, 23, 24 on a stream with audio_device "" on this box with no sound output: the panel's notice
    says why it is silent and wraps inside the node, every knob row fits the node's width, the notice reads at
    4.5:1 or more as rendered, the status line says what plays, and loading the page while the stream runs logs no
    "Unknown message type flowjam.status" nor frontend 1.58's "input.link is deprecated". Without a browser: the
    served panel_status.js shows the warning in its wrapping notice, and the browser checks are skipped."""
    name = "headless"
    prompt = _lone_stream_prompt(name)
    prompt[node_id(prompt, "FlowjamStream")]["inputs"]["audio_device"] = ""  # the default output: there is none
    comfy.run_ok(prompt)
    try:
        status = comfy.session(name)
        if not status.get("output_warning"):
            pytest.skip(f"this machine has an audio output: the stream plays on it ({status.get('output_warning')!r})")
        warning = status["output_warning"]
        assert warning.startswith(("no audio device: playing silently", "no audio: ")), warning
        served = _served_panel_status(comfy, status, tmp_path)
        assert served["view"]["notice"] == warning and warning not in served["view"]["lines"], served["view"]
        assert served["view"]["lines"][2] == status["loop"] and re.match(LOOP_FIELD, status["loop"]), served["view"]
        notice_css = served["css"]["notice"].replace(" ", "")
        assert "white-space:normal" in notice_css and "min-width:0" in notice_css, served["css"]["notice"]
        assert "grid-template-columns:minmax(0,1fr)" in served["css"]["panel"].replace(" ", "")
        missing = _browser_missing()
        if missing:
            pytest.skip(
                f"the served panel JS shows the warning wrapped; the layout, contrast and console checks: {missing}"
            )
        workflow = json.loads((WORKFLOWS / TEXT_JAM).read_text())
        (node,) = [n for n in workflow["nodes"] if n["type"] == "FlowjamStream"]
        node["widgets_values"][node["widgets_values"].index("jam")] = name
        path = tmp_path / "headless.json"
        path.write_text(json.dumps(workflow))
        result = _run_browser(comfy, _HEADLESS_PANEL_JS, tmp_path, str(path))
    finally:
        comfy.run(stop_prompt(name), timeout=30)
    measured = result["measured"]
    notice, panel = measured["notice"], measured["panel"]
    ratio = _contrast(notice["color"], notice["background"])
    print(
        f"\nheadless panel: notice {notice['width']:.0f} x {notice['height']:.0f} px ({notice['unwrapped']:.0f} px "
        f"unwrapped) in a {panel['width']:.0f} px panel on a {measured['nodeWidthPx']:.0f} px node; contrast "
        f"{ratio:.2f}:1 ({notice['color']} on {notice['background']}); status line {measured['loopLine']!r}; "
        f"screenshot /tmp/flowjam_live_panel_headless.png",
        file=sys.stderr,
    )
    # 16: the notice is the warning, wrapped inside the panel; the panel is the node's width; every row fits it
    assert notice["text"] == warning
    assert notice["unwrapped"] > notice["clientWidth"], "the warning fits on one line here: nothing to wrap"
    assert notice["height"] >= 2 * notice["fontSize"] and notice["scrollWidth"] <= notice["clientWidth"] + 1, notice
    assert notice["right"] <= panel["right"] + 1 and panel["width"] <= measured["nodeWidthPx"] + 2, (panel, measured)
    for row in measured["rows"]:
        assert row["row"]["right"] <= panel["right"] + 1, f"{row['knob']}'s row is wider than the node: {row}"
        assert all(part["right"] <= row["row"]["right"] + 1 and part["width"] > 0 for part in row["parts"]), row
        assert not row["cut"], f"{row['knob']}'s row cuts its text: {row}"
    assert {row["knob"] for row in measured["rows"]} >= {spec.name for spec in KNOB_SPECS}
    # 20: the warning as rendered reads at 4.5:1 or more (WCAG AA for text)
    assert ratio >= 4.5, f"the notice is {notice['color']} on {notice['background']}: {ratio:.2f}:1"
    # 23: the panel says what plays
    assert measured["loopLine"] == status["loop"] and not measured["playheadHidden"], measured["loopLine"]
    # 24: nothing logged about flowjam's event; no deprecated read (input.link) made by flowjam's code
    logged = result["consoleAll"]
    assert not [m for m in logged if "Unknown message type" in m and "flowjam" in m], logged
    links = [d for d in result["deprecations"] if "input.link" in d["message"]]
    ours = [d for d in result["deprecations"] if "/extensions/flowjam/" in d["stack"]]
    print(f"input.link deprecation warnings: {len(links)}, from flowjam's code: {len(ours)}", file=sys.stderr)
    assert not ours, ours
    assert not _flowjam_errors(result), result["consoleErrors"]

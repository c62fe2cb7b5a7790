"""Shared fixtures: a JACK dummy server (real audio and MIDI routing on a machine without a sound card); the tiny
session with two prompts, the null condition and a source that the stream tests share; the tiny model as ComfyUI's
Load model node gives it, and the Qwen3 tokenizer. Helper functions live in helpers.py."""

import faulthandler
import math
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from flowjam.engine.bench.ticks import random_lora
from flowjam.engine.lora import LowRank, lora_set
from flowjam.engine.models.text_tokenizer import Qwen3Tokenizer
from flowjam.engine.session import Session
from flowjam.live import performances
from helpers import node
from safetensors.torch import save_file

JACK_RATE = 48_000
JACK_PERIOD = 1024
TEST_LIMIT_S = 900  # one test's setup, call and teardown; the slowest take ~2 minutes on a loaded CI machine


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A test that hangs ends the run with every thread's stack instead of holding CI to its limit: faulthandler's
    watchdog is a C thread, so it fires even when a deadlock holds the GIL (as closing a MIDI port once did)."""
    faulthandler.dump_traceback_later(TEST_LIMIT_S, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
    if item.nodeid == _plugin_engine_users.get("last"):
        for engine in _plugin_engines:  # its last user is done: it stops generating beside the tests after it
            engine.stop()


_plugin_engine_users: dict[str, str] = {}
_plugin_engines: list = []


def pytest_collection_modifyitems(session, config, items):
    """The last test that uses the plugin tests' shared engine: a generating engine left running took most of a core
    from every later test (ten times as long for some)."""
    users = [item.nodeid for item in items if "plugin_engine" in getattr(item, "fixturenames", ())]
    if users:
        _plugin_engine_users["last"] = users[-1]


def _jack_server_running(env) -> bool:
    result = subprocess.run(["jack_wait", "-c"], env=env, capture_output=True, text=True)
    return result.stdout.strip() == "running"


@pytest.fixture(scope="session")
def jack_server():
    """Start `jackd -R -d dummy -r 48000 -p 1024` under a private server name (JACK_DEFAULT_SERVER); yields that name.

    -R is jackd's default, as users run it: the server and every client's process thread (PortAudio's, the test
    recorders') run SCHED_FIFO, so a busy machine cannot make one late (a late client is an xrun for the whole graph,
    which PortAudio reports to flowjam as an output underflow). Where RT is not allowed jackd says so and runs anyway.

    PortAudio only lists the JACK host API if jackd already runs when it initialises, so sounddevice is
    re-initialised here; at the end PortAudio is terminated BEFORE jackd stops (else it aborts at exit)."""
    if shutil.which("jackd") is None:
        print("\nSKIPPED: jackd not installed (Debian package jackd2); .ci/run installs it", file=sys.stderr)
        pytest.skip("jackd (Debian jackd2) is not installed")
    name = f"flowjam-test-{os.getpid()}"  # private: concurrent test runs never share (or stop) a server
    os.environ["JACK_DEFAULT_SERVER"] = name
    os.environ["JACK_NO_AUDIO_RESERVATION"] = "1"
    env = dict(os.environ)
    process = subprocess.Popen(
        ["jackd", "-R", "-n", name, "-d", "dummy", "-r", str(JACK_RATE), "-p", str(JACK_PERIOD)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while not _jack_server_running(env):
        if time.monotonic() > deadline or process.poll() is not None:
            process.kill()
            pytest.fail("jackd did not start within 10 s")
        time.sleep(0.1)
    import sounddevice

    deadline = time.monotonic() + 10
    while True:  # the server answers jack_wait a moment before it accepts PortAudio's client
        sounddevice._terminate()
        sounddevice._initialize()
        if any(api["name"].startswith("JACK") for api in sounddevice.query_hostapis()):
            break
        if time.monotonic() > deadline:
            pytest.fail("PortAudio does not see the JACK server (is Debian's libportaudio2 installed?)")
        time.sleep(0.2)
    yield name
    sounddevice._terminate()
    process.terminate()
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
    os.environ.pop("JACK_DEFAULT_SERVER", None)


@pytest.fixture(scope="session")
def plugin_engine(tmp_path_factory):
    """`flowjam live --plugin --preset tiny --bpm 123 --bars 2 --click --prompt "ambient pads"` on the plugin tests'
    session, its loop made; shared by the DAW plugin test modules (a test that kills it starts it again; one engine at
    a time: a second one's start starves beside it on a small machine). Its $BROWSER writes down the URLs it opens
    (`engine.browser_log`)."""
    from daw_host import SESSION, Engine
    from plugin_build import build

    build()  # before the engine starts: the compile has both cores
    browser_log = tmp_path_factory.mktemp("browser") / "opened.txt"
    flags = ("--bpm", "123", "--bars", "2", "--click", "--prompt", "ambient pads")
    engine = Engine(SESSION, *flags, browser_log=browser_log)
    _plugin_engines.append(engine)
    try:
        engine.wait_ready()
        yield engine
    finally:
        engine.stop()
        _plugin_engines.remove(engine)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny CPU matmuls run up to ~3000x slower with a second OpenMP thread when another process holds a core of
    this 2-core box; the LM test modules use one thread and restore the setting afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def session():
    return Session.load(preset="tiny")


@pytest.fixture(scope="module")
def prompts(session):
    a = session.encode_text("warm analog synth pads")
    b = session.encode_text("breakbeat drums, fast", lyrics="[Verse]\nla la la")
    return a, b, session.null_conditioning(a)


@pytest.fixture(scope="module")
def source(session):
    t = torch.arange(48_000 * 10) / 48_000
    audio = 0.4 * torch.stack([torch.sin(2 * math.pi * 110 * t), torch.sin(2 * math.pi * 165 * t)])
    return session.prepare_source(audio, 48_000)


@pytest.fixture
def tint_lora(session, request):
    """A live LoRA called "tint" on the tiny session's DiT at strength 1, on every attention and MLP projection and
    on the layers a tick computes once and keeps (the condition embedder feeding the cross K/V, both timestep
    embedders); detached afterwards, so the shared session returns to its plain weights. Parametrized (indirect)
    "per-row only": only on the layers that run per batch row (no cross K/V, no timestep embedders)."""
    decoder = session.models.acestep.decoder
    adapter = random_lora(decoder, "tint", rank=4, seed=3)
    generator = torch.Generator().manual_seed(4)
    per_row_only = getattr(request, "param", "everywhere") == "per-row only"
    if per_row_only:
        for path in [path for path in adapter.deltas if path.endswith(("cross_attn.k_proj", "cross_attn.v_proj"))]:
            del adapter.deltas[path]
    for path in () if per_row_only else ("condition_embedder", "time_embed.linear_1", "time_embed_r.linear_2"):
        linear = decoder.get_submodule(path)
        down = torch.randn(4, linear.in_features, generator=generator) / linear.in_features**0.5
        adapter.deltas[path] = LowRank(down, torch.randn(linear.out_features, 4, generator=generator) * 0.05, 0.25)
    lora_set(decoder).attach(adapter, 1.0, "live")
    yield adapter.name
    lora_set(decoder).detach(adapter.name)


@pytest.fixture(scope="session")
def glow_lora_file(tmp_path_factory):
    """A LoRA file (ComfyUI layout, rank 2) named "glow" for the tiny preset's DiT, on every self-attention query."""
    decoder = Session.load(preset="tiny").models.acestep.decoder
    generator = torch.Generator().manual_seed(5)
    tensors = {}
    for index, layer in enumerate(decoder.layers):
        linear, key = layer.self_attn.q_proj, f"diffusion_model.layers.{index}.self_attn.q_proj"
        tensors[f"{key}.lora_A.weight"] = torch.randn(2, linear.in_features, generator=generator)
        tensors[f"{key}.lora_B.weight"] = torch.randn(linear.out_features, 2, generator=generator)
    path = tmp_path_factory.mktemp("loras") / "glow.safetensors"
    save_file(tensors, str(path))
    return path


@pytest.fixture(scope="module")
def model():
    """The tiny preset as ComfyUI's Load model node gives it (fp32, eager, CPU): the MODEL input of the other nodes.
    The node keeps the session it loaded, so every module gets the same one."""
    (session,) = node("FlowjamLoadModel").run(
        preset="tiny", checkpoint="none", device="cpu", dtype="float32", backend="eager"
    )
    return session


@pytest.fixture
def stop_streams():
    """Every live stream the nodes started is stopped after the test (modules use it through `usefixtures`)."""
    yield
    performances.stop_all()


@pytest.fixture(scope="module")
def tokenizer() -> Qwen3Tokenizer:
    return Qwen3Tokenizer.from_package()

"""What several test modules need: waiting for a condition with a deadline, a free local port, a JACK client that
records what is played, and the ComfyUI nodes driven without ComfyUI (text conditioning, a live stream)."""

import contextlib
import random
import socket
import threading
import time

import numpy as np
import pytest
from flowjam.nodes.comfy_v1 import NODE_CLASS_MAPPINGS

ADMIT_ANY_SPEED_MS = 60_000.0  # a ring's real-time need of a latent a minute: admission never refuses a session for
# speed (tests about access, routing, isolation or knobs, on a 2-core machine the suite keeps busy beside the ring)

# ---- waiting and ports ----------------------------------------------------------------------------------------------


def wait_for(predicate, timeout_s: float, what, poll_s: float = 0.01):
    """Poll `predicate` until it returns something truthy, and return that; after `timeout_s` the test fails with a
    message naming `what` it waited for (a string, or a callable that says it then). A predicate that asks a server
    over HTTP wants a slower `poll_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s:g} s waiting for {what() if callable(what) else what}")
        time.sleep(poll_s)
    return value


@contextlib.contextmanager
def served(host, policy=None):
    """The gateway over `host` (a RingHost) on a free loopback port -> its URL; the host is closed afterwards.
    `policy`: the server's AccessPolicy (default: loopback, no server key)."""
    import uvicorn
    from flowjam.serve.gateway import LocalRouter, listening_socket, make_app

    router = LocalRouter(host)
    sock = listening_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(make_app(router, policy), log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, args=([sock],), name="test-uvicorn", daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 10.0, "uvicorn to start")
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10.0)
        router.close()
        host.close()


QUIET_PORTS = range(20000, 32000)
"""Ports a test hands to a server it starts: below Linux's ephemeral range (32768-60999), where every outgoing
socket on the machine (this test's own OSC client included) is given a port, so none can take it before the
server binds it."""


def _free_port(kind: socket.SocketKind) -> int:
    for port in random.sample(QUIET_PORTS, 200):
        with socket.socket(socket.AF_INET, kind) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {QUIET_PORTS}")


def free_udp_port() -> int:
    """A UDP port on 127.0.0.1 that nothing is bound to now (OSC servers, feedback listeners)."""
    return _free_port(socket.SOCK_DGRAM)


def free_tcp_port() -> int:
    """A TCP port on 127.0.0.1 that nothing is bound to now (HTTP servers started in another process)."""
    return _free_port(socket.SOCK_STREAM)


# ---- JACK -----------------------------------------------------------------------------------------------------------


class JackRecorder:
    """A second JACK client that records, into a preallocated stereo array, what other clients' output ports play
    (the `jack_server` fixture's server). It is active from the start; connect it, then `stop()` for the audio."""

    def __init__(self, seconds: float, name: str = "flowjam-test-recorder", sample_rate: int = 48_000):
        import jack

        self.client = jack.Client(name, no_start_server=True)
        assert self.client.samplerate == sample_rate, (
            f"JACK runs at {self.client.samplerate} Hz, expected {sample_rate}"
        )
        self.inputs = [self.client.inports.register(f"in_{channel}") for channel in range(2)]
        self.audio = np.zeros((int(seconds * sample_rate), 2), np.float32)
        self.written = 0
        self.first_frame_time = None  # JACK's frame time of the first recorded frame
        self.connected_at = None  # the first recorded frame that the connections were there for
        self.xruns = 0  # cycles some JACK client (this one too: a Python callback in a busy process) finished late
        self.client.set_process_callback(self._process)
        self.client.set_xrun_callback(self._xrun)
        self.client.activate()
        self.before = {port.name for port in self.client.get_ports(is_output=True, is_audio=True)}

    def _process(self, frames: int) -> None:
        if self.first_frame_time is None:
            self.first_frame_time = self.client.last_frame_time
        count = min(frames, len(self.audio) - self.written)
        for channel, port in enumerate(self.inputs):
            self.audio[self.written : self.written + count, channel] = port.get_array()[:count]
        self.written += count

    def _xrun(self, delayed_usecs: float) -> None:
        self.xruns += 1

    def _connect(self, sources: list[str]) -> None:
        for source, sink in zip(sources, self.inputs):
            self.client.connect(source, sink)
        self.connected_at = self.written

    def connect_portaudio(self) -> None:
        """Record PortAudio's two output ports (the only audio outputs besides the server's own `system:` ports)."""
        sources = sorted(
            port.name
            for port in self.client.get_ports(is_output=True, is_audio=True)
            if not port.name.startswith("system:")
        )
        assert len(sources) == 2, f"expected PortAudio's two output ports, JACK has {sources}"
        self._connect(sources)

    def connect_new_outputs(self, timeout_s: float) -> list[str]:
        """Record the next client to register output ports after this recorder started (the PortAudio stream of a
        process started meanwhile), as soon as its ports appear; returns their names."""
        deadline = time.monotonic() + timeout_s
        while True:
            ports = self.client.get_ports(is_output=True, is_audio=True)
            sources = sorted(port.name for port in ports if port.name not in self.before)
            if len(sources) >= 2:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"no new JACK output ports within {timeout_s} s (JACK has {[p.name for p in ports]})")
            time.sleep(0.002)  # a process starts playing ~20-60 ms after its ports appear: connect before that
        assert len(sources) == 2, f"expected the two output ports of one stream, JACK has new ones {sources}"
        self._connect(sources)
        return sources

    def stop(self) -> np.ndarray:
        """Close the client; the audio recorded, [frames, 2]."""
        self.client.deactivate()
        self.client.close()
        return self.audio[: self.written]


# ---- ComfyUI nodes without ComfyUI ----------------------------------------------------------------------------------

TEXT_DEFAULTS = dict(lyrics="", bpm=0, key="", time_signature="", duration=0.0, task="text2music", language="")
STREAM_DEFAULTS = dict(
    song_seconds=2.0,
    depth=2,
    steps=4,
    denoise=0.7,
    seed=42,
    shift=3.0,
    prompt_blend=0.0,
    structure=1.0,
    audio_device="none",
)


def node(node_id: str):
    """A classic (V1) instance of the node `node_id`, as ComfyUI makes one per prompt."""
    return NODE_CLASS_MAPPINGS[node_id]()


def text(model, tags: str, **values):
    """CONDITIONING from the Text conditioning node; `values` override its other widgets."""
    return node("FlowjamTextConditioning").run(model=model, tags=tags, **{**TEXT_DEFAULTS, **values})[0]


def stream(model, conditioning, session_id: str, **values) -> str:
    """Start (or re-queue) the Stream node's live stream `session_id`, silent (audio_device "none"); returns its name."""
    (name,) = node("FlowjamStream").run(
        model=model, conditioning=conditioning, session_id=session_id, **{**STREAM_DEFAULTS, **values}
    )
    return name


def generate(model, conditioning, **values):
    """The Generate node's outputs (AUDIO, LATENT) for 2 s at seed 42, 4 steps, denoise 1; `values` override."""
    defaults = dict(seconds=2.0, seed=42, steps=4, shift=3.0, denoise=1.0)
    return node("FlowjamGenerate").run(model=model, conditioning=conditioning, **{**defaults, **values})


def wait_ticks(app, count: int = 3) -> None:
    """Until a running stream's runner has ticked `count` more times."""
    start = app.runner.stats.ticks
    wait_for(lambda: app.runner.stats.ticks >= start + count, 10, f"{count} runner ticks")


# ---- several sessions on one ring ----------------------------------------------------------------------------------


def track_latents(session, prompts, loop_samples: int, ticks: int, backend: str | None = None):
    """Every prompt a session (a runner, `denoise` 1: each generation from the seed's noise, a steady loop) on one
    shared ring stepped `ticks` times -> (the first session's latents by generation, the ring's graph counters)."""
    from flowjam.live.knobs import KnobRegistry
    from flowjam.live.loop_buffer import LoopBuffer
    from flowjam.live.runner import LiveRunner
    from flowjam.live.shared_ticker import SharedTicker

    ticker = SharedTicker(session, backend=backend)
    runners, buffers, made = [], [], {}
    try:
        for index, prompt in enumerate(prompts):
            registry = KnobRegistry()
            registry.set("denoise", 1.0, origin="test")
            buffers.append(LoopBuffer(loop_samples, 2, session.sample_rate))
            runners.append(LiveRunner(session, registry, buffers[-1], prompt, ticker=ticker, name=f"track-{index}"))
            ticker.register(runners[-1])
        for _ in range(ticks):
            ticker.step()
            if runners[0].latest is not None:
                made[runners[0].stats.latents] = runners[0].latest.clone()
    finally:
        for runner in runners:
            runner.stop()
        for buffer in buffers:
            buffer.unlink()
    return made, ticker.pipeline.graph_counters


# ---- graph-replayed streams on a GPU ------------------------------------------------------------------------------


def stream_latents(session, backend: str, conditioning, negative, seeds=range(40)):
    """A depth-4 cfg-full stream on `backend` fed one request per tick (the ring's plans repeat every 8 ticks: seen,
    captured, then replayed) -> (the pipeline, each seed's finished latent in fp32)."""
    from flowjam.engine.stream import StreamPipeline

    pipeline = StreamPipeline(session.models.acestep.decoder, depth=4, backend=backend)
    out = []
    for seed in seeds:
        pipeline.submit(
            session.make_request(conditioning, 10.0, seed=seed, cfg_mode="full", negative=negative, guidance=2.0)
        )
        out += pipeline.tick()
    return pipeline, {f.request.seed: f.latent.float() for f in out}


def assert_close_latents(latents: dict, reference: dict, tolerance: float = 2e-2) -> None:
    for seed, latent in reference.items():
        error = ((latents[seed] - latent).norm() / latent.norm()).item()
        assert error < tolerance, f"seed {seed}: relative error {error:.2e}"


@contextlib.contextmanager
def jack_timebase_master(server: str, name: str, bpm: float, beats_per_bar: int, ticks_per_beat: float = 1920.0):
    """A JACK client that is the timebase master (as a DAW would be): bar/beat/tick at `bpm` in `beats_per_bar`/4,
    from the transport frame. Yields the client; its transport is stopped and the client closed at the end."""
    import jack

    client = jack.Client(name, no_start_server=True, servername=server)

    def timebase(state, blocksize, pos, new_pos):
        beats = pos.frame / pos.frame_rate * bpm / 60.0
        bar, beat = divmod(int(beats), beats_per_bar)
        pos.valid |= jack.POSITION_BBT
        pos.bar, pos.beat = bar + 1, beat + 1
        pos.tick = int((beats - int(beats)) * ticks_per_beat)
        pos.bar_start_tick = bar * beats_per_bar * ticks_per_beat
        pos.beats_per_bar, pos.beat_type = float(beats_per_bar), 4.0
        pos.ticks_per_beat, pos.beats_per_minute = ticks_per_beat, bpm

    client.set_timebase_callback(timebase)
    client.activate()
    try:
        yield client
    finally:
        client.transport_stop()
        client.deactivate()
        client.close()


@contextlib.contextmanager
def no_host_sync():
    """Inside, any CUDA call that synchronises the host with the device raises."""
    import torch

    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def assert_a_tick_replays_without_host_sync(pipeline, request) -> None:
    """The next tick (of a plan captured before) is one graph replay and synchronises nothing with the host."""
    replays = pipeline.stats()["graphs"]["replays"]
    pipeline.submit(request)
    with no_host_sync():
        pipeline.tick()
    assert pipeline.stats()["graphs"]["replays"] == replays + 3  # the gather's, the forward's and the advance's


DEFAULT_OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
OPCHECKS_FP8_INPUTS = DEFAULT_OPCHECKS[1:]


def check_fused_op_fakes(device: str) -> None:
    """torch.library.opcheck of every fused custom op on `device`: the fake kernels torch.compile traces with give
    the real outputs' shapes and strides (a layer's first input arrives transposed, so x is non-contiguous here)."""
    import torch
    from flowjam.engine.kernels.ops import forced_path

    def tensor(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device).bfloat16()

    x, delta, weight = tensor(2, 2048, 5).transpose(1, 2), tensor(2, 5, 2048), tensor(2048)
    shift, scale, gate = tensor(2, 3, 2048).chunk(3, dim=1)
    w_gate, w_up = tensor(2, 192, 128)  # paired, as the SwiGLU kernel reads them
    qkv = tensor(256, 128).split([128, 64, 64])  # stacked, as the q/k/v kernel reads them (heads of 64)
    fp8_rows = (tensor(16, 128).to(torch.float8_e4m3fn), torch.rand(16, 1, device=device) + 0.5)
    fp8_qkv = tensor(256, 128).to(torch.float8_e4m3fn).split([128, 64, 64])  # stacked, with their scales
    fp8_scales = (torch.rand(1, 256, device=device) + 0.5).split([128, 64, 64], dim=1)
    flowjam = torch.ops.flowjam
    with forced_path(fused=True):
        for op, args in (
            (flowjam.norm_modulate, (x, weight, scale, shift, 1e-6)),
            (flowjam.norm_modulate, (x, weight, None, None, 1e-6)),
            (flowjam.add_norm_modulate, (x, delta, gate, weight, scale, shift, 1e-6)),
            (flowjam.add_norm_modulate, (x, delta, None, weight, None, None, 1e-6)),
            (flowjam.norm_quantize, (x, weight, scale, shift, 1e-6)),
            (flowjam.add_norm_quantize, (x, delta, gate, weight, scale, shift, 1e-6)),
            (flowjam.add_norm_quantize, (x, delta, None, weight, None, None, 1e-6)),
            (flowjam.swiglu, (tensor(3, 5, 128), w_gate, w_up)),
            (
                flowjam.qkv_norm_rope,
                (tensor(2, 128, 5).transpose(1, 2), *qkv, tensor(64), tensor(64), *tensor(2, 5, 64), 1e-6),
            ),
            (
                flowjam.fp8_qkv_norm_rope,
                (*fp8_rows, *fp8_qkv, *fp8_scales, tensor(64), tensor(64), *tensor(2, 8, 64), 1e-6),
            ),
            (flowjam.quantize_input, (x, None)),
            (flowjam.quantize_input, (delta, tensor(2, 5, 2048))),
        ):
            fp8_inputs = any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in args)
            # the schema check compares inputs before and after with arithmetic e4m3 tensors do not have
            torch.library.opcheck(op, args, test_utils=OPCHECKS_FP8_INPUTS if fp8_inputs else DEFAULT_OPCHECKS)


HALVES = ("x", "queries", "first layer's x", "first layer's queries", "layer output")


def both_halves(layer, ops, x, modulation, rope, heads) -> tuple:
    """A DiT layer's two halves through `ops` (`HALVES`): after another layer, whose MLP output is pending, and as
    the first layer; the second half's output with its MLP output added, as the next layer adds it."""
    import torch
    from flowjam.engine.models.dit import gated_add

    generator = torch.Generator().manual_seed(1)
    pending = tuple(
        torch.randn(shape, generator=generator).to(x.device, x.dtype) * scale
        for shape, scale in ((x.shape, 1.0), ((x.shape[0], 1, x.shape[2]), 0.1))
    )
    layer_modulation = layer.modulation(modulation)
    x_out, queries = layer.attend_self(x, pending, layer_modulation, rope, None, ops)
    first_layer = layer.attend_self(x, None, layer_modulation, rope, None, ops)
    finished, mlp_pending = layer.finish(x, heads, layer_modulation, ops)
    return x_out, queries, *first_layer, gated_add(finished, *mlp_pending)

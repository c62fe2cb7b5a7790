"""Nodes that play a running stream: shared-curve control, stop, capture, OSC bridge, MIDI map (the stream itself
comes from the Stream node, `stream_nodes.py`)."""

from __future__ import annotations

import errno
import socket
import time
from pathlib import Path

from ..engine.params import MAX_SONG_SECONDS, SHARED_FIELDS
from . import comfy_io, comfy_models
from .spec import AUDIO, CATEGORY, CURVE, STREAM, NodeInputError, NodeSpec, Output, Param, check_range

MIDI_INSTALL = (
    "install them into ComfyUI's Python: pip install -r custom_nodes/flowjam/requirements.txt "
    "(or pip install mido python-rtmidi), then restart ComfyUI"
)
CAPTURE_WAIT_S = 10.0  # how long Stream capture waits, beyond the seconds asked, for a new stream's first audio


def _app(node: str, stream: str):
    from ..live import performances

    app = performances.get(stream)
    if app is None:
        raise NodeInputError(f"{node}: {not_running(stream)}")
    return app


def not_running(stream: str) -> str:
    return f"no running stream named {stream!r}; queue a flowjam Stream node with session_id {stream!r} first"


def shared_curve(stream: str, knob: str, value: float, curve=None) -> tuple:
    """Set a shared-curve knob (every in-flight generation, next tick); a connected curve overrides the value per frame."""
    if knob not in SHARED_FIELDS:
        raise NodeInputError(f"Shared curve: input 'knob' must be one of {', '.join(SHARED_FIELDS)}")
    app = _app("Shared curve", stream)
    check_range("Shared curve", "value", value)
    if curve is None:
        app.registry.set(knob, value, origin="comfyui")
        return (stream,)
    from ..engine.sampling import curves

    frames = app.runner.frames
    app.runner.set_curve(knob, curve if curve.numel() in (1, frames) else curves.resample(curve.flatten(), frames))
    return (stream,)


def stream_stop(stream: str, after: str | None = None) -> tuple:
    """Stop the stream. ComfyUI runs a node after every node it takes input from, and in no set order otherwise:
    `stream` (and `after`, from another branch) chain the stop after the nodes that use the stream."""
    from ..live import performances

    app = performances.get(stream)
    if app is None or not performances.stop(stream):
        return (not_running(stream),)
    comfy_models.use(app.session)  # back on ComfyUI's list (unless another stream plays it)
    return (f"stopped {stream}",)


def stream_capture(stream: str, seconds: float) -> tuple:
    """The last `seconds` the stream played, as ComfyUI AUDIO (Save/Preview Audio), and the stream to chain on. A
    stream that has not played that much of its own audio yet (one queued with this capture) is waited for, with
    ComfyUI's progress bar and Cancel: the clip is never cut short by the start, nor holds the silence before the
    first generation. More than a loop waits for one loop (the clip is capped below it, see LiveApp.capture)."""
    check_range("Stream capture", "seconds", seconds, 0.1, MAX_SONG_SECONDS)
    app = _app("Stream capture", stream)
    rate = app.buffer.sample_rate
    needed = min(int(seconds * rate), app.buffer.frames)
    progress = comfy_io.progress(needed)
    wait_s = CAPTURE_WAIT_S + needed / rate
    deadline = time.monotonic() + wait_s
    while (played := app.played_frames) < needed:
        if time.monotonic() > deadline:
            raise NodeInputError(
                f"Stream capture: stream {stream!r} has played {played / rate:.1f} s of the {needed / rate:g} s asked "
                f"in {wait_s:.0f} s (its first generation comes first); queue Stream capture again in a moment"
            )
        progress(played, needed)
        time.sleep(0.05)
    progress(needed, needed)
    return comfy_io.audio_to_comfy(app.capture(seconds), rate), stream


def osc_bridge(stream: str, port: int, feedback: str, host: str) -> tuple:
    from ..live.app import parse_host_port

    check_range("OSC bridge", "port", port, 1, 65535)
    app = _app("OSC bridge", stream)
    try:
        target = parse_host_port(feedback) if feedback.strip() else None
    except ValueError as error:
        raise NodeInputError(f"OSC bridge: input 'feedback': {error}") from None
    bind_host = host.strip() or "127.0.0.1"
    for name, address in (("host", bind_host), ("feedback", target and target[0])):
        if address and not resolves(address):
            raise NodeInputError(
                f"OSC bridge: input '{name}' names host {address!r}, which does not resolve; give an IP address "
                "(127.0.0.1 = this machine only, 0.0.0.0 = every network) or a host name this machine knows"
            )
    wanted = (int(port), bind_host, target)
    current = app.osc
    if current is None or (current.config.port, current.config.host, current.config.feedback) != wanted:
        try:
            app.enable_osc(*wanted)
        except OSError as error:
            name, problem, fix = OSC_BIND_PROBLEMS.get(
                error.errno, ("port", f"cannot be opened ({error.strerror})", "choose a free port")
            )
            value = port if name == "port" else repr(bind_host)
            raise NodeInputError(f"OSC bridge: input '{name}' {value} {problem}; {fix}") from None
        except ValueError as error:  # a feedback host with no address of the bound one's family (IPv4 or IPv6)
            raise NodeInputError(f"OSC bridge: input 'feedback' {feedback.strip()!r}: {error}") from None
    return (stream,)


OSC_BIND_PROBLEMS = {  # errno of a failed bind -> (the input at fault, what is wrong with it, the fix)
    errno.EADDRINUSE: ("port", "is in use (another stream's OSC bridge, or another OSC program)", "choose a free port"),
    errno.EACCES: ("port", "needs privileges (a port below 1024)", "choose a port from 1024 up"),
    errno.EADDRNOTAVAIL: (
        "host",
        "is not an address of this machine",
        "use 127.0.0.1 (this machine only) or 0.0.0.0 (every network)",
    ),
}


def resolves(host: str) -> bool:
    """Whether `host` names an address (an IP, or a name the resolver knows)."""
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except (socket.gaierror, UnicodeError):  # UnicodeError: a name no resolver takes ("a..b", a 64-letter label)
        return False
    return True


def midi_map(stream: str, port: str, map_file: str, learn: str) -> tuple:
    try:
        import mido  # noqa: F401
        import rtmidi  # noqa: F401  (python-rtmidi)
    except ImportError:
        raise NodeInputError(f"MIDI map: MIDI needs mido and python-rtmidi; {MIDI_INSTALL}") from None
    app = _app("MIDI map", stream)
    knobs = tuple(k.strip() for k in learn.split(",") if k.strip())
    try:
        app.enable_midi(port.strip() or None, Path(map_file).expanduser() if map_file.strip() else None, knobs)
    except (ValueError, ImportError, RuntimeError) as error:
        raise NodeInputError(f"MIDI map: {error}") from None
    return (stream,)


STREAM_PARAM = Param("stream", STREAM, "A running stream (from Stream)")
NODES = (
    NodeSpec(
        "FlowjamSharedCurve",
        "flowjam Shared curve",
        f"{CATEGORY}/live",
        "Steer every in-flight generation of a stream from its next tick (a value, or a per-frame curve).",
        (
            STREAM_PARAM,
            Param("knob", "COMBO", "Which shared curve", "velocity_scale", options=SHARED_FIELDS),
            Param("value", "FLOAT", "Value (clamped to the knob's range)", 1.0, -10.0, 10.0, 0.01),
            Param("curve", CURVE, "Per-frame curve instead of the value", optional=True),
        ),
        (Output(STREAM, "stream"),),
        shared_curve,
        output_node=True,
        always_run=True,
    ),
    NodeSpec(
        "FlowjamStreamStop",
        "flowjam Stream stop",
        f"{CATEGORY}/live",
        "Stop a running stream and free its audio device. Chain it after the nodes that use the stream: a stop in a "
        "live graph stops the stream at the end of every queue (bypass it until you want to stop).",
        (
            Param("stream", STREAM, "The stream to stop: connect it from the last node that uses the stream"),
            Param(
                "after",
                STREAM,
                "Another branch's stream output: the stop also waits for it (only orders the graph; not stopped)",
                optional=True,
            ),
        ),
        (Output("STRING", "status"),),
        stream_stop,
        output_node=True,
        always_run=True,
        shows_result=True,
    ),
    NodeSpec(
        "FlowjamStreamCapture",
        "flowjam Stream capture",
        f"{CATEGORY}/live",
        "The last seconds a stream played, as AUDIO for Save Audio or Preview Audio.",
        (STREAM_PARAM, Param("seconds", "FLOAT", "How much to capture", 8.0, 0.1, MAX_SONG_SECONDS, 0.1)),
        (
            Output(AUDIO, "audio"),
            Output(STREAM, "stream", "The same stream, to chain a Stream stop after the capture"),
        ),
        stream_capture,
        always_run=True,
    ),
    NodeSpec(
        "FlowjamOscBridge",
        "flowjam OSC bridge",
        f"{CATEGORY}/live",
        "Let OSC controllers and DAWs play the stream: /flowjam/<session>/knob/<name>, feedback to a port.",
        (
            STREAM_PARAM,
            Param("port", "INT", "UDP port to listen on", 9000, 1, 65535, 1),
            Param("feedback", "STRING", "HOST:PORT that receives applied values (empty = reply to senders only)", ""),
            Param("host", "STRING", "Address to bind; anything but 127.0.0.1 opens it to the network", "127.0.0.1"),
        ),
        (Output(STREAM, "stream"),),
        osc_bridge,
        output_node=True,
        always_run=True,
    ),
    NodeSpec(
        "FlowjamMidiMap",
        "flowjam MIDI map",
        f"{CATEGORY}/live",
        "Play knobs from a MIDI controller: learn CCs (in order), 14-bit CC, soft takeover, mappings saved to a file.",
        (
            STREAM_PARAM,
            Param("port", "STRING", "MIDI input port name (empty = first)", ""),
            Param("map_file", "STRING", "JSON mapping file (loaded if it exists, saved when the stream stops)", ""),
            Param("learn", "STRING", "Knobs to learn in order, comma-separated (move one control for each)", ""),
        ),
        (Output(STREAM, "stream"),),
        midi_map,
        output_node=True,
        always_run=True,
    ),
)

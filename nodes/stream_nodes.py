"""Live nodes: a named stream that keeps playing across queues, shared-curve control, stop, capture, OSC, MIDI.

A node never IS the stream: streams live in `engine.live.sessions`, keyed by `session_id`, so re-queueing a graph
with new widget values updates the running stream in place."""

from __future__ import annotations

from pathlib import Path

from . import comfy_io
from .lm_nodes import structure_context
from .spec import AUDIO, CATEGORY, CONDITIONING, CURVE, MODEL, SOURCE, STREAM, STRUCTURE, NodeInputError, NodeSpec, Output, Param, check_range

SHARED_KNOBS = ("velocity_scale", "ode_noise", "sde_denoise", "x0_target_strength", "guidance", "cfg_rescale", "apg_momentum")
REQUEST_KNOBS = ("denoise", "seed", "steps", "shift", "prompt_blend", "structure", "depth", "volume")
_structures: dict[str, object] = {}  # stream name -> the LM structure it was last given


def _app(node: str, stream: str):
    from ..engine.live import sessions

    app = sessions.get(stream)
    if app is None:
        raise NodeInputError(f"{node}: no running stream named {stream!r}; queue a Stream node with that session_id first")
    return app


def stream_start(model, conditioning, session_id: str, song_seconds: float, depth: int, steps: int, denoise: float, seed: int,
                 shift: float, prompt_blend: float, structure: float, audio_device: str, conditioning_b=None, source=None,
                 lm_structure=None) -> tuple:
    """Start the named stream, or update it in place: conditions, source, LM structure and knob values apply on its
    next ticks."""
    from ..engine.live import sessions
    from ..engine.live.app import LiveApp, LiveConfig
    from ..engine.live.knobs import KnobRegistry

    name = session_id.strip()
    if not name:
        raise NodeInputError("Stream: input 'session_id' is empty; name the stream (e.g. 'default')")
    check_range("Stream", "song_seconds", song_seconds, 1.0, 600.0)
    values = {"depth": depth, "steps": steps, "denoise": denoise, "seed": seed, "shift": shift, "prompt_blend": prompt_blend, "structure": structure}
    for knob, value in values.items():
        check_range("Stream", knob, value)
    if lm_structure is not None and source is not None:
        raise NodeInputError("Stream: connect either 'source' (a cover) or 'lm_structure', not both")
    device = audio_device.strip()
    mode = "null" if device == "none" else "process"

    def create() -> LiveApp:
        registry = KnobRegistry()
        for knob, value in values.items():  # before the runner starts: its first generation uses these
            registry.set(knob, value, origin="comfyui")
        config = LiveConfig(prompt="", song_seconds=song_seconds if source is None else source.frames / 25, session_name=name,
                            audio_device=None if device in ("", "none", "default") else device, playback_mode=mode, osc_port=None)
        app = LiveApp(model, config, registry, initial_conditionings=(conditioning, conditioning_b or conditioning), source=source)
        if context is not None:
            app.runner.set_structure(context)  # queued before the runner starts: its first generation follows it
        return app

    running = sessions.get(name)
    frames = running.runner.frames if running is not None else max(1, round(song_seconds * 25))
    context = None if lm_structure is None else structure_context("Stream", model, lm_structure, frames)
    app, created = sessions.start_or_get(name, create)
    if created:
        _structures[name] = lm_structure
        return (name,)
    if app.session is not model:
        raise NodeInputError(f"Stream: stream {name!r} runs another model; stop it (Stream stop) before switching models")
    swap = source is not None and source is not app.runner.current_source
    if swap and source.frames != app.runner.frames:
        raise NodeInputError(f"Stream: input 'source' has {source.frames} frames but stream {name!r} loops {app.runner.frames}; "
                             "stop the stream to change its length")
    if lm_structure is not _structures.get(name) and (context is not None or app.runner.current_source is None):
        app.runner.set_structure(context)  # None: the structure was disconnected, back to plain text
    _structures[name] = lm_structure
    app.runner.set_conditioning("a", conditioning)
    app.runner.set_conditioning("b", conditioning_b or conditioning)
    if swap:
        app.runner.swap_source(source)
    for knob, value in values.items():
        app.registry.set(knob, value, origin="comfyui")
    return (name,)


def shared_curve(stream: str, knob: str, value: float, curve=None) -> tuple:
    """Set a shared-curve knob (every in-flight generation, next tick); a connected curve overrides the value per frame."""
    if knob not in SHARED_KNOBS:
        raise NodeInputError(f"Shared curve: input 'knob' must be one of {', '.join(SHARED_KNOBS)}")
    app = _app("Shared curve", stream)
    check_range("Shared curve", "value", value)
    if curve is None:
        app.registry.set(knob, value, origin="comfyui")
        return (stream,)
    from ..engine import curves

    frames = app.runner.frames
    app.runner.set_curve(knob, curve if curve.numel() in (1, frames) else curves.resample(curve.flatten(), frames))
    return (stream,)


def stream_stop(stream: str) -> tuple:
    from ..engine.live import sessions

    return (f"stopped {stream}" if sessions.stop(stream) else f"no stream named {stream}",)


def stream_capture(stream: str, seconds: float) -> tuple:
    """The last `seconds` the stream played, as ComfyUI AUDIO (Save/Preview Audio)."""
    check_range("Stream capture", "seconds", seconds, 0.1, 600.0)
    app = _app("Stream capture", stream)
    return (comfy_io.audio_to_comfy(app.capture(seconds), app.buffer.sample_rate),)


def osc_bridge(stream: str, port: int, feedback: str, host: str) -> tuple:
    from ..engine.live.app import parse_host_port

    check_range("OSC bridge", "port", port, 1, 65535)
    app = _app("OSC bridge", stream)
    try:
        target = parse_host_port(feedback) if feedback.strip() else None
    except ValueError as error:
        raise NodeInputError(f"OSC bridge: input 'feedback': {error}") from None
    wanted = (int(port), host.strip() or "127.0.0.1", target)
    current = app.osc
    if current is None or (current.config.port, current.config.host, current.config.feedback) != wanted:
        try:
            app.enable_osc(*wanted)
        except OSError as error:
            raise NodeInputError(f"OSC bridge: input 'port' {port} cannot be opened ({error}); choose a free port") from None
    return (stream,)


def midi_map(stream: str, port: str, map_file: str, learn: str) -> tuple:
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
        "FlowjamStream", "flowjam Stream", f"{CATEGORY}/live",
        "Start a live stream that keeps playing while you edit and re-queue; a re-queue updates it in place.",
        (
            Param("model", MODEL, "A flowjam model from Load model"),
            Param("conditioning", CONDITIONING, "Prompt A"),
            Param("session_id", "STRING", "Name of the live stream; the same name updates it instead of starting another", "default"),
            Param("song_seconds", "FLOAT", "Loop length for text-only streams (a source sets its own)", 30.0, 1.0, 600.0, 1.0),
            Param("depth", "INT", "Generations in flight (more = smoother, each arrives later)", 4, 1, 8, 1),
            Param("steps", "INT", "Denoising steps per generation", 8, 1, 50, 1),
            Param("denoise", "FLOAT", "How much each regeneration may change the loop", 0.7, 0.0, 1.0, 0.01),
            Param("seed", "INT", "Noise seed", 42, 0, 2**31 - 1, 1),
            Param("shift", "FLOAT", "Timestep shift", 3.0, 1.0, 10.0, 0.1),
            Param("prompt_blend", "FLOAT", "0 = prompt A, 1 = prompt B", 0.0, 0.0, 1.0, 0.01),
            Param("structure", "FLOAT", "How strongly the source's (or LM structure's) structure steers", 1.0, 0.0, 1.0, 0.01),
            Param("audio_device", "STRING", "Output device name or index; empty = system default; none = silent", ""),
            Param("conditioning_b", CONDITIONING, "Prompt B for prompt_blend", optional=True),
            Param("source", SOURCE, "Audio to cover in a loop", optional=True),
            Param("lm_structure", STRUCTURE, "Song structure from LM structure for a text-only loop (the structure knob fades it)", optional=True),
        ),
        (Output(STREAM, "stream"),),
        stream_start,
        output_node=True,
        always_run=True,
    ),
    NodeSpec(
        "FlowjamSharedCurve", "flowjam Shared curve", f"{CATEGORY}/live",
        "Steer every in-flight generation of a stream from its next tick (a value, or a per-frame curve).",
        (STREAM_PARAM, Param("knob", "COMBO", "Which shared curve", "velocity_scale", options=SHARED_KNOBS),
         Param("value", "FLOAT", "Value (clamped to the knob's range)", 1.0, -10.0, 10.0, 0.01),
         Param("curve", CURVE, "Per-frame curve instead of the value", optional=True)),
        (Output(STREAM, "stream"),),
        shared_curve,
        output_node=True,
        always_run=True,
    ),
    NodeSpec("FlowjamStreamStop", "flowjam Stream stop", f"{CATEGORY}/live", "Stop a running stream and free its audio device.",
             (STREAM_PARAM,), (Output("STRING", "status"),), stream_stop, output_node=True, always_run=True),
    NodeSpec("FlowjamStreamCapture", "flowjam Stream capture", f"{CATEGORY}/live",
             "The last seconds a stream played, as AUDIO for Save Audio or Preview Audio.",
             (STREAM_PARAM, Param("seconds", "FLOAT", "How much to capture", 8.0, 0.1, 600.0, 0.1)),
             (Output(AUDIO, "audio"),), stream_capture, always_run=True),
    NodeSpec("FlowjamOscBridge", "flowjam OSC bridge", f"{CATEGORY}/live",
             "Let OSC controllers and DAWs play the stream: /flowjam/<session>/knob/<name>, feedback to a port.",
             (STREAM_PARAM, Param("port", "INT", "UDP port to listen on", 9000, 1, 65535, 1),
              Param("feedback", "STRING", "HOST:PORT that receives applied values (empty = reply to senders only)", ""),
              Param("host", "STRING", "Address to bind; anything but 127.0.0.1 opens it to the network", "127.0.0.1")),
             (Output(STREAM, "stream"),), osc_bridge, output_node=True, always_run=True),
    NodeSpec("FlowjamMidiMap", "flowjam MIDI map", f"{CATEGORY}/live",
             "Play knobs from a MIDI controller: learn CCs (in order), 14-bit CC, soft takeover, mappings saved to a file.",
             (STREAM_PARAM, Param("port", "STRING", "MIDI input port name (empty = first)", ""),
              Param("map_file", "STRING", "JSON mapping file (loaded if it exists, saved when the stream stops)", ""),
              Param("learn", "STRING", "Knobs to learn in order, comma-separated (move one control for each)", "")),
             (Output(STREAM, "stream"),), midi_map, output_node=True, always_run=True),
)

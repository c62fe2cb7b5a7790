"""The Stream node: a named stream that keeps playing across queues (its controls are in `control_nodes.py`).

A node never IS the stream: streams live in `engine.live.sessions`, keyed by `session_id`, so re-queueing a graph
with new widget values updates the running stream in place."""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import partial
from typing import Any

from ..engine.params import (
    CFG_MODES,
    DEFAULT_WINDOW_SECONDS,
    KNOBS_BY_NAME,
    LATENT_RATE_HZ,
    MAX_SONG_SECONDS,
    seconds_to_frames,
)
from . import comfy_models
from .lm_nodes import structure_context
from .lora_nodes import with_loras
from .spec import (
    CATEGORY,
    CONDITIONING,
    MODEL,
    SOURCE,
    STREAM,
    STRUCTURE,
    NodeInputError,
    NodeSpec,
    Output,
    Param,
    check_range,
)

_structures: dict[str, object] = {}  # stream name -> the LM structure it was last given
_owners: dict[str, str | None] = {}  # stream name -> the id of the Stream node that started it (None: outside ComfyUI)
_played: dict[str, dict[str, float]] = {}  # stream name -> knobs the panel, OSC or MIDI set last (kept across stops)
PLAYED_ORIGINS = ("comfyui-panel", "osc", "midi")


@dataclass(frozen=True)
class StreamKnobs:
    """The Stream node's knob widgets, checked. They go through the knob registry (which clamps them to its ranges),
    so OSC, MIDI and the live panel see what the graph set."""

    depth: int
    steps: int
    denoise: float
    seed: int
    shift: float
    prompt_blend: float
    structure: float
    cfg_mode: str

    def __post_init__(self):
        for field in fields(self):
            if field.name != "cfg_mode":
                check_range("Stream", field.name, getattr(self, field.name))
        if self.cfg_mode not in CFG_MODES:
            raise NodeInputError(
                f"Stream: input 'cfg_mode' must be one of {', '.join(CFG_MODES)}, got {self.cfg_mode!r}"
            )

    def apply(self, registry) -> None:
        for field in fields(self):
            registry.set(field.name, getattr(self, field.name), origin="comfyui")


@dataclass(frozen=True)
class StreamSockets:
    """What the Stream node's sockets bring: prompts A and B, the negative (None: the null condition), and either a
    source to cover or an LM structure with its context latents for the loop."""

    prompt_a: Any
    prompt_b: Any
    negative: Any = None
    source: Any = None
    lm_structure: Any = None
    context: Any = None


def stream_start(
    model,
    conditioning,
    session_id: str,
    song_seconds: float,
    depth: int,
    steps: int,
    denoise: float,
    seed: int,
    shift: float,
    prompt_blend: float,
    structure: float,
    audio_device: str,
    cfg_mode: str,
    window_seconds: float = DEFAULT_WINDOW_SECONDS,
    endless: bool = False,
    bpm: float = 0.0,
    time_signature: str = "4",
    bars: int = 0,
    sync: str = "off",
    click: bool = False,
    conditioning_b=None,
    source=None,
    lm_structure=None,
    negative=None,
    unique_id: str | None = None,
) -> tuple:
    """Start the named stream, or update it in place: conditions, source, LM structure and knob values apply on its
    next ticks. Every input is checked before anything changes; what cannot apply in place (the loop's length, the
    output device, another Stream node's settings) is refused. `unique_id`: this node's id in ComfyUI's graph."""
    from ..live import performances
    from ..live.playback import LIST_HINT, PlaybackError
    from ..live.sync.unavailable import COMFYUI, ClockUnavailable

    name = session_id.strip()
    if not name:
        raise NodeInputError("Stream: input 'session_id' is empty; name the stream (e.g. 'default')")
    check_range("Stream", "song_seconds", song_seconds, 1.0, MAX_SONG_SECONDS)
    window = check_window("Stream", window_seconds, endless, source is not None or lm_structure is not None)
    knobs = StreamKnobs(depth, steps, denoise, seed, shift, prompt_blend, structure, cfg_mode)
    grid = stream_grid(bpm, time_signature, bars, sync, click, window[1], source is not None)
    if lm_structure is not None and source is not None:
        raise NodeInputError("Stream: connect either 'source' (a cover) or 'lm_structure', not both")
    if output(audio_device)[1] == "plugin":
        check_plugin_output(name, grid)
    running = performances.get(name)
    if running is not None:
        check_grid_requeue(running, grid)
        check_requeue(running, unique_id, song_seconds, audio_device, source, window)
    model = with_loras("Stream", model, None if running is None else running.registry)
    comfy_models.use(model)
    frames = running.runner.frames if running is not None else seconds_to_frames(song_seconds)
    context = None if lm_structure is None else structure_context("Stream", model, lm_structure, frames)
    sockets = StreamSockets(conditioning, conditioning_b or conditioning, negative, source, lm_structure, context)
    try:
        app, created = performances.start_or_get(
            name, partial(new_stream, model, name, song_seconds, audio_device, knobs, sockets, window, grid)
        )
    except ClockUnavailable as error:  # a clock this machine cannot follow: the fix worded for ComfyUI
        raise NodeInputError(f"Stream: input {error.worded(COMFYUI)}") from None
    except PlaybackError as error:  # a named output that is not there: the message lists those that are
        reason = " ".join(str(error).replace(LIST_HINT, "").split()).rstrip(". ")
        raise NodeInputError(
            f"Stream: input 'audio_device' {audio_device!r}: {reason}; name one of those outputs, or leave it empty "
            "(the default output) or none (silent)"
        ) from None
    if created:
        _owners[name] = unique_id
    else:
        update_stream(app, model, knobs, sockets)
    _structures[name] = lm_structure
    return (name,)


def check_window(node: str, window_seconds: float, endless: bool, has_structure: bool) -> tuple[float, bool]:
    """(window_seconds, endless) of a Stream node, or one line naming the input and the fix."""
    from ..engine.stream.windows import check_window_seconds

    try:
        check_window_seconds(window_seconds, "input 'window_seconds'")
    except ValueError as error:
        raise NodeInputError(f"{node}: {error}") from None
    if endless and window_seconds == 0:
        raise NodeInputError(f"{node}: endless play needs a window: set input 'window_seconds', e.g. 20")
    if endless and has_structure:
        raise NodeInputError(f"{node}: endless play is text-only: disconnect 'source' / 'lm_structure', or loop")
    return float(window_seconds), bool(endless)


SYNC_CHOICES = ("off", "link", "jack", "midi (JACK)")  # midi: connect the clock to flowjam-clock:clock_in


@dataclass(frozen=True)
class StreamGrid:
    """A Stream node's musical grid: LiveConfig's bpm, time_signature, bars, sync, click."""

    bpm: float | None = None
    time_signature: int = 4
    bars: int | None = None
    sync: str | None = None
    click: bool = False


def stream_grid(
    bpm: float, time_signature: str, bars: int, sync: str, click: bool, endless: bool, has_source: bool
) -> StreamGrid:
    """The Stream node's grid inputs, or one line naming the input and the fix."""
    from ..engine.prompts import time_signature_numerator

    if bpm != 0:
        check_range("Stream", "bpm", bpm, 30.0, 300.0)
    if sync not in SYNC_CHOICES:
        raise NodeInputError(f"Stream: input 'sync' {sync!r}: one of {', '.join(SYNC_CHOICES)}")
    try:
        beats = time_signature_numerator(time_signature)
    except ValueError as error:
        raise NodeInputError(f"Stream: input 'time_signature': {error}") from None
    followed = None if sync == "off" else sync.split()[0]
    if (bars or click) and bpm == 0 and followed is None:
        raise NodeInputError("Stream: inputs 'bars' and 'click' need a tempo: set 'bpm', or follow a clock ('sync')")
    if bars and endless:
        raise NodeInputError("Stream: input 'bars' sets a loop's length; endless play has none: set bars to 0")
    if (bars or followed) and has_source:
        raise NodeInputError("Stream: a 'source' sets its own loop: set bars to 0 and sync off, or disconnect it")
    return StreamGrid(float(bpm) or None, beats, int(bars) or None, followed, bool(click))


def check_grid_requeue(app, grid: StreamGrid) -> None:
    """The grid is fixed once the stream plays; refuse another one, naming the way to it."""
    config = app.config
    playing = StreamGrid(config.bpm, config.time_signature or 4, config.bars, config.sync, config.click)
    if grid != playing:
        raise NodeInputError(
            f"Stream: bpm/time_signature/bars/sync/click cannot apply to the running stream "
            f"{config.session_name!r}; stop it (Stream stop), then queue again"
        )


def check_requeue(
    app, unique_id: str | None, song_seconds: float, audio_device: str, source, window: tuple[float, bool]
) -> None:
    """Refuse, before anything changes, a Stream node that cannot update the running stream `app` in place: another
    Stream node's (two nodes, one session_id), or one asking for another loop length or output device (only a new
    stream has those, and a restart cuts the sound until its first generation: the user stops it when they choose)."""
    name, frames = app.config.session_name, app.runner.frames
    owner = _owners.get(name)
    if None not in (owner, unique_id) and owner != unique_id:
        raise NodeInputError(
            f"Stream: session_id {name!r} is already used by node #{owner}; give this node another session_id "
            "(or stop that stream first)"
        )
    running_window = (app.config.runner.window_s, app.config.runner.endless)
    if window != running_window:
        raise NodeInputError(
            f"Stream: window_seconds/endless {window[0]:g}/{window[1]} cannot apply to the running stream {name!r} "
            f"({running_window[0]:g}/{running_window[1]}); stop it (Stream stop), then queue again"
        )
    if source is None and not window[1] and app.bars is None and seconds_to_frames(song_seconds) != frames:
        raise NodeInputError(
            f"Stream: song_seconds {song_seconds:g} cannot apply to the running stream {name!r}, which loops "
            f"{frames / LATENT_RATE_HZ:g} s; stop it (Stream stop), then queue again to start it at the new length"
        )
    if output(audio_device) != (app.config.audio_device, app.config.playback_mode):
        raise NodeInputError(
            f"Stream: audio_device {audio_device!r} cannot apply to the running stream {name!r}, which plays on "
            f"{app.playback.stats()['device']}; stop it (Stream stop), then queue again to start it on the new output"
        )


PLUGIN_OUTPUT = "plugin"  # audio_device: the flowjam DAW plugin (plugin/, docs/plugin.md) plays the stream


def output(audio_device: str) -> tuple[str | None, str]:
    """The Stream node's audio_device -> (LiveConfig.audio_device, LiveConfig.playback_mode)."""
    device = audio_device.strip()
    if device == PLUGIN_OUTPUT:
        return None, "plugin"
    return (None if device in ("", "none", "default") else device), ("null" if device == "none" else "process")


def check_plugin_output(name: str, grid: StreamGrid) -> None:
    """A stream for the DAW plugin: its session_id is the name the plugin attaches by, and the DAW is its clock."""
    from ..live.plugin_link import control_name

    try:
        control_name(name)
    except ValueError as error:
        raise NodeInputError(f"Stream: input 'session_id' with audio_device 'plugin': {error}") from None
    if grid.sync is not None:
        raise NodeInputError(
            "Stream: audio_device 'plugin' plays through the DAW, whose transport is the clock: set sync to off"
        )


def new_stream(
    model,
    name: str,
    song_seconds: float,
    audio_device: str,
    knobs: StreamKnobs,
    sockets: StreamSockets,
    window: tuple[float, bool] = (DEFAULT_WINDOW_SECONDS, False),
    grid: StreamGrid = StreamGrid(),
):
    """A LiveApp for a new stream, not started: knobs, negative and structure are in place before its runner starts,
    so its first generation uses them."""
    from ..live.app import LiveApp, LiveConfig
    from ..live.knobs import KnobRegistry
    from ..live.runner import RunnerConfig

    registry = KnobRegistry()
    keep_played(name, registry)
    knobs.apply(registry)
    seconds = song_seconds if sockets.source is None else sockets.source.frames / LATENT_RATE_HZ
    device, mode = output(audio_device)
    config = LiveConfig(
        prompt="",
        song_seconds=seconds,
        session_name=name,
        audio_device=device,
        playback_mode=mode,
        osc_port=None,
        bpm=grid.bpm,
        time_signature=grid.time_signature,
        bars=grid.bars,
        sync=grid.sync,
        click=grid.click,
        midi_backend="jack" if grid.sync == "midi" else None,
        runner=RunnerConfig(window_s=window[0], endless=window[1]),
    )
    app = LiveApp(
        model, config, registry, initial_conditionings=(sockets.prompt_a, sockets.prompt_b), source=sockets.source
    )
    comfy_models.keep_for_stream(model)
    app.runner.set_conditioning("negative", sockets.negative)
    if sockets.context is not None:
        app.runner.set_structure(sockets.context)
    return app


def keep_played(name: str, registry) -> None:
    """Start a new stream's knobs where the panel, OSC or MIDI last left stream `name`'s (a knob with no widget
    would lose that on a stop and a restart), and record its next such moves; a move the graph overrides (a
    re-queued widget) is forgotten. The Stream node's widgets are applied after this and win."""
    played = _played.setdefault(name, {})
    for knob, value in played.items():
        if knob in registry.specs:  # a lora/<name> knob comes later with its LoRA, at the LoRA node's strength
            registry.set(knob, value, origin="kept")

    def record(change) -> None:
        if change.origin in PLAYED_ORIGINS:
            played[change.name] = change.value
        elif change.origin == "comfyui":
            played.pop(change.name, None)

    registry.subscribe(record)


def update_stream(app, model, knobs: StreamKnobs, sockets: StreamSockets) -> None:
    """Apply a re-queued Stream node to its running stream; a refused input changes nothing."""
    name, runner = app.config.session_name, app.runner
    if app.session is not model:
        raise NodeInputError(
            f"Stream: stream {name!r} runs another model; stop it (Stream stop) before switching models"
        )
    swap = sockets.source is not None and sockets.source is not runner.current_source
    if swap and sockets.source.frames != runner.frames:
        raise NodeInputError(
            f"Stream: input 'source' has {sockets.source.frames} frames but stream {name!r} loops {runner.frames}; "
            "stop the stream to change its length"
        )
    if sockets.lm_structure is not _structures.get(name) and (
        sockets.context is not None or runner.current_source is None
    ):
        runner.set_structure(sockets.context)  # None: the structure was disconnected, back to plain text
    runner.set_conditioning("a", sockets.prompt_a)
    runner.set_conditioning("b", sockets.prompt_b)
    runner.set_conditioning("negative", sockets.negative)  # None: disconnected, back to the null condition
    if swap:
        runner.swap_source(sockets.source)
    knobs.apply(app.registry)


CFG_MODE_TOOLTIP = (
    "Guidance rows. off = turbo's own mode (it is CFG-distilled); full = a negative row every step, needed for base/sft "
    "checkpoints and for guidance, cfg_rescale and apg_momentum (Shared curve) to act; initialize = the negative on the "
    "first step only; self = guidance against the slot's own noise"
)


def knob_param(name: str, tooltip: str, step: float = 1) -> Param:
    """A Stream widget for a registry knob, with the registry's range and default (so the two cannot drift apart)."""
    spec = KNOBS_BY_NAME[name]
    if spec.choices:
        return Param(name, "COMBO", tooltip, spec.choice(spec.default), options=spec.choices)
    if spec.integer:
        return Param(name, "INT", tooltip, int(spec.default), int(spec.minimum), int(spec.maximum), int(step))
    return Param(name, "FLOAT", tooltip, spec.default, spec.minimum, spec.maximum, step)


NODES = (
    NodeSpec(
        "FlowjamStream",
        "flowjam Stream",
        f"{CATEGORY}/live",
        "Start a live stream that keeps playing while you edit and re-queue; a re-queue updates it in place.",
        (
            Param("model", MODEL, "A flowjam model from Load model"),
            Param("conditioning", CONDITIONING, "Prompt A"),
            Param(
                "session_id",
                "STRING",
                "Name of the live stream; the same name updates it instead of starting another",
                "default",
            ),
            Param(
                "song_seconds",
                "FLOAT",
                "Loop length for text-only streams (a source sets its own); fixed once the stream plays",
                30.0,
                1.0,
                MAX_SONG_SECONDS,
                1.0,
            ),
            knob_param("depth", "Generations in flight (more = smoother, each arrives later)"),
            knob_param("steps", "Denoising steps per generation"),
            knob_param("denoise", "How much each regeneration may change the loop", 0.01),
            knob_param("seed", "Noise seed"),
            knob_param("shift", "Timestep shift", 0.1),
            knob_param("prompt_blend", "0 = prompt A, 1 = prompt B", 0.01),
            knob_param("structure", "How strongly the source's (or LM structure's) structure steers", 0.01),
            Param(
                "audio_device",
                "STRING",
                "Output device name or index; empty = system default (silent, the panel says so, if there is none); "
                "none = silent; plugin = the flowjam DAW plugin, attached by session_id, the DAW's transport the "
                "clock (docs/plugin.md); fixed once the stream plays",
                "",
            ),
            knob_param("cfg_mode", CFG_MODE_TOOLTIP),
            Param(
                "window_seconds",
                "FLOAT",
                "Seconds generated per request, placed at the playhead: a tick costs the window, not the loop; 0 or "
                "at least the loop = the whole loop each time; fixed once the stream plays",
                DEFAULT_WINDOW_SECONDS,
                0.0,
                MAX_SONG_SECONDS,
                1.0,
            ),
            Param(
                "endless",
                "BOOLEAN",
                "No loop: the song goes on while it plays, a window ahead of the playhead (text-only; song_seconds "
                "unused); fixed once the stream plays",
                False,
            ),
            Param(
                "bpm",
                "FLOAT",
                "Tempo of the loop's grid, 30..300 (0 = none; with sync, the clock's): the loop is whole bars of it; "
                "set the same bpm on the text encode node for the prompt's metas",
                0.0,
                0.0,
                300.0,
                0.01,
            ),
            Param("time_signature", "COMBO", "Beats per bar", "4", options=("4", "3", "2", "6")),
            Param(
                "bars",
                "INT",
                "The loop is exactly this many bars (0 = song_seconds in whole bars)",
                0,
                0,
                512,
                1,
            ),
            Param(
                "sync",
                "COMBO",
                "Follow a clock: Ableton Link, JACK transport, or a MIDI clock over JACK (connect it to "
                "flowjam-clock:clock_in); bar 1 of the loop on its bar lines, its tempo changes followed",
                "off",
                options=SYNC_CHOICES,
            ),
            Param("click", "BOOLEAN", "A metronome click on every bar start", False),
            Param("conditioning_b", CONDITIONING, "Prompt B for prompt_blend", optional=True),
            Param("source", SOURCE, "Audio to cover in a loop", optional=True),
            Param(
                "lm_structure",
                STRUCTURE,
                "Song structure from LM structure for a text-only loop (the structure knob fades it)",
                optional=True,
            ),
            Param(
                "negative",
                CONDITIONING,
                "Negative prompt that CFG guides away from; unconnected = the null condition, as the official pipeline",
                optional=True,
            ),
        ),
        (Output(STREAM, "stream"),),
        stream_start,
        output_node=True,
        always_run=True,
        hidden_unique_id=True,
    ),
)

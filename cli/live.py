"""`flowjam live`: play the stream on this machine's sound card, with OSC and MIDI control and a status line."""

from __future__ import annotations

import argparse
import math
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..live.midi_port import MIDI_BACKENDS
from ..live.playback import DEFAULT_BLOCKSIZE
from ..live.sync.follow import SYNC_SOURCES
from ..live.sync.lock import MAX_OFFSET_MS, check_offset_ms
from .flags import (
    CommandError,
    add_audio_device,
    add_backend,
    add_bpm,
    add_cfg_mode,
    add_depth,
    add_lm_model,
    add_lora_arguments,
    add_model_arguments,
    add_seconds,
    add_song_seconds,
    add_steps,
    add_time_signature,
    add_window_seconds,
    check_bpm_flag,
    check_knob_flag,
    check_port,
    check_positive,
    check_window,
    load_session,
    time_signature_flag,
)

if TYPE_CHECKING:
    from ..live.app import LiveConfig


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = commands.add_parser("live", help="play the stream: audio out, OSC and MIDI control, live status line")
    parser.add_argument("--prompt", default="ambient pads, slow evolving synth", help="caption (prompt A)")
    parser.add_argument("--prompt-b", help="second caption; the prompt_blend knob morphs A -> B")
    parser.add_argument("--negative", help="negative prompt that CFG guides away from (default: the null condition)")
    add_lora_arguments(parser)
    add_cfg_mode(parser, None, flag="--cfg-mode")
    parser.add_argument(
        "--source", type=Path, help="source song to cover in a loop: WAV, FLAC, OGG or MP3 (sets the loop length)"
    )
    add_song_seconds(parser, 30.0, help="loop length for text-only sessions (s)")
    add_window_seconds(parser)
    parser.add_argument(
        "--endless",
        action="store_true",
        help="no loop: the song goes on as long as it plays, generated a window ahead of the playhead (text-only)",
    )
    add_seconds(parser, "stop cleanly after this many seconds (default: run until Ctrl-C)")
    add_depth(parser, default=None)
    add_steps(parser, default=None, live=True)
    add_backend(parser)
    add_audio_device(parser)
    parser.add_argument("--no-audio", action="store_true", help="no sound card: advance in real time and only record")
    parser.add_argument(
        "--plugin",
        action="store_true",
        help="play on DAW tracks: every flowjam plugin instance (plugin/, docs/plugin.md) gets a session of its own "
        "(the first --session), the host's transport is the clock and its parameters are the knobs",
    )
    parser.add_argument(
        "--panel-port",
        type=int,
        help="with --plugin: the port of the prompt and knob panel on 127.0.0.1 (default: a free one; the URL, with "
        "its token, is printed at start and the plugin's `panel` parameter opens it)",
    )
    parser.add_argument(
        "--blocksize",
        type=int,
        default=DEFAULT_BLOCKSIZE,
        help=f"frames the sound card plays per callback (default {DEFAULT_BLOCKSIZE}); larger if it underruns, at the "
        "cost of knob latency (the writer stays one block ahead)",
    )
    parser.add_argument(
        "--playback", default="process", choices=("process", "thread"), help="where the audio callback runs"
    )
    parser.add_argument("--record", type=Path, help="write exactly what was played to this WAV")
    parser.add_argument(
        "--session",
        default="default",
        help="the session's name, in OSC's /flowjam/<session>/...; with --plugin the first track's (OSC and MIDI "
        "control it)",
    )
    parser.add_argument("--osc-port", type=int, default=9000, help="UDP port for OSC control (0: none)")
    parser.add_argument(
        "--osc-host", help="address to bind (default 127.0.0.1); anything but loopback must be asked for"
    )
    parser.add_argument("--osc-feedback", help="HOST:PORT that receives applied values (TouchOSC faders follow)")
    parser.add_argument("--osc-allow", help="comma-separated hosts allowed to send OSC when binding beyond loopback")
    parser.add_argument("--midi-port", help="MIDI input port name (pip install 'flowjam[midi]')")
    parser.add_argument("--midi-map", type=Path, help="JSON CC mapping file: loaded if it exists, saved on exit")
    parser.add_argument(
        "--midi-backend",
        choices=tuple(MIDI_BACKENDS),
        help="MIDI system: alsa (Linux ALSA sequencer) or jack (a running JACK server); default: mido's "
        "($MIDO_BACKEND, else the platform's own: ALSA on Linux)",
    )
    parser.add_argument(
        "--midi-learn",
        help="comma-separated knobs to MIDI-learn in order: move one control for each, and let it go (0.5 s) before "
        "moving the next",
    )
    parser.add_argument(
        "--lm", action="store_true", help="text-only: the 5 Hz LM writes the loop's structure from --prompt at start"
    )
    grid = parser.add_argument_group("tempo and bars (the loop on a musical grid; docs/live.md)")
    add_bpm(grid, "in the caption (as a whole BPM), and the loop is whole bars of it")
    add_time_signature(grid, "4")
    grid.add_argument("--bars", type=int, help="the loop is exactly this many bars (default: --song-seconds in bars)")
    grid.add_argument(
        "--sync",
        choices=SYNC_SOURCES,
        help="follow a clock: link (Ableton Link), midi (MIDI clock on --midi-port; --midi-backend jack reads it "
        "frame-exact) or jack (JACK transport); tempo from it unless --bpm, bar 1 of the loop on its bar lines",
    )
    grid.add_argument(
        "--sync-offset-ms",
        type=float,
        default=0.0,
        help=f"with --sync: play this much later against the clock, -{MAX_OFFSET_MS:g}..{MAX_OFFSET_MS:g} ms "
        "(default 0)",
    )
    grid.add_argument("--click", action="store_true", help="a metronome click on every bar start")
    grid.add_argument(
        "--source-bpm",
        type=float,
        help="the --source's tempo (default: estimated with librosa, pip install 'flowjam[grid]'); with --bpm it is "
        "time-stretched to it",
    )
    grid.add_argument(
        "--source-downbeat", type=float, help="seconds into the --source of its first bar line (default: estimated)"
    )
    add_lm_model(parser)
    add_model_arguments(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    if args.list_devices:
        from ..live.playback import list_devices

        print(list_devices())
        return 0
    check_live_args(args)
    from ..live.app import LiveApp, LiveConfig, parse_host_port
    from ..live.knobs import KnobRegistry
    from ..live.playback import PlaybackError
    from ..live.plugin_sessions import PluginSessions
    from ..live.runner import RunnerConfig

    def knobs() -> KnobRegistry:
        """A session's knobs: the registry's defaults, then the command line's."""
        registry = KnobRegistry()
        for name in ("depth", "steps", "cfg_mode"):
            if getattr(args, name) is not None:
                registry.set(name, getattr(args, name), origin="cli")
        return registry

    config = LiveConfig(
        prompt=args.prompt,
        prompt_b=args.prompt_b,
        negative=args.negative,
        source=args.source,
        song_seconds=args.song_seconds,
        session_name=args.session,
        audio_device=args.audio_device,
        blocksize=args.blocksize,
        playback_mode=playback_mode(args),
        record=args.record,
        osc_host=args.osc_host or LiveConfig.osc_host,
        osc_port=args.osc_port or None,
        osc_feedback=parse_host_port(args.osc_feedback) if args.osc_feedback else None,
        osc_allow=tuple(h.strip() for h in args.osc_allow.split(",")) if args.osc_allow else None,
        midi_port=args.midi_port,
        midi_map=args.midi_map,
        midi_learn=tuple(k.strip() for k in args.midi_learn.split(",")) if args.midi_learn else (),
        midi_backend=args.midi_backend,
        lm=args.lm,
        lm_checkpoint=args.lm_checkpoint,
        lm_preset=args.lm_preset,
        bpm=args.bpm,
        time_signature=time_signature_flag(args.time_signature),
        bars=args.bars,
        source_bpm=args.source_bpm,
        source_downbeat_s=args.source_downbeat,
        sync=args.sync,
        sync_offset_ms=args.sync_offset_ms,
        click=args.click,
        panel_port=args.panel_port or 0,
        runner=RunnerConfig(backend=args.backend, window_s=args.window_seconds, endless=args.endless),
    )
    if config.osc_port is not None:
        check_osc(config)
    if config.uses_midi:
        from ..live.midi_port import find_input_port

        find_input_port(config.midi_port, config.midi_backend)  # a wrong port or MIDI system fails before loading
    if args.plugin:  # every plugin instance on the machine: a session each, on one ring
        app = PluginSessions(load_session(args), config, knobs)
    else:
        app = LiveApp(load_session(args), config, knobs())
    interactive = sys.stderr.isatty()
    stop_on_signals()
    try:
        app.start()  # inside the try: whatever started before a failure (runner, audio process) is stopped
        primary = app.primary_app if isinstance(app, PluginSessions) else app
        panel = getattr(primary.playback, "panel", None)
        if panel is not None:
            sys.stderr.write(
                f"flowjam panel (prompts and knobs; the plugin's `panel` parameter opens it): {panel.url}\n"
            )
        started = time.monotonic()
        beats = 0
        while args.seconds is None or time.monotonic() - started < args.seconds:
            time.sleep(0.25)
            beats += 1
            if interactive:
                sys.stderr.write(f"\r{app.status_line()}")
            elif beats % 4 == 0:
                sys.stderr.write(f"{app.status_line()}\n")
            sys.stderr.flush()
    except (KeyboardInterrupt, Stopped):
        pass
    except PlaybackError as error:  # a named --audio-device that cannot be opened
        raise CommandError(str(error)) from error
    finally:
        app.stop()
    if interactive:
        sys.stderr.write("\n")
    recording = app.playback.recording if isinstance(app, LiveApp) else None
    if recording is not None:
        rate = app.buffer.sample_rate
        print(f"recorded {recording.path}: {recording.frames / rate:.2f} s ({recording.frames} frames played)")
        if recording.error is not None:  # the take was cut short (a full disk): say so in the exit status too
            raise CommandError(recording.error)
    return 0


def playback_mode(args: argparse.Namespace) -> str:
    if args.plugin:
        return "plugin"
    if args.no_audio:
        return "null-process" if args.playback == "process" else "null"
    return args.playback


def check_live_args(args: argparse.Namespace) -> None:
    """Refuse what would otherwise fail only after the model loads, or be silently clamped or ignored. The
    torch-free checks come first, so those mistakes are refused at once."""
    from ..engine.params import song_frames

    if args.seconds is not None:
        check_positive("--seconds", args.seconds, " (leave it out to play until Ctrl-C)")
    if args.source is None and not args.endless:
        song_frames(args.song_seconds, "--song-seconds")
    check_window(args.window_seconds, args.endless)
    if args.endless and (args.source is not None or args.lm):
        raise CommandError("--endless is text-only: --source and --lm set a song's length (they loop); drop one")
    check_grid_args(args)
    if args.plugin:
        check_plugin_args(args)
    elif args.panel_port is not None:
        raise CommandError("--panel-port serves the DAW plugin's panel: give --plugin, or drop --panel-port")
    check_knob_flag("depth", args.depth)
    check_knob_flag("steps", args.steps)
    if not 32 <= args.blocksize <= 8192:
        raise CommandError(f"--blocksize must be 32..8192 frames (default {DEFAULT_BLOCKSIZE}), got {args.blocksize}")
    check_port("--osc-port", args.osc_port, "no OSC")
    if not args.osc_port and (args.osc_host or args.osc_feedback or args.osc_allow):
        raise CommandError("--osc-host, --osc-feedback and --osc-allow need OSC, which --osc-port 0 turns off")

    from ..engine.audio.files import check_audio
    from ..engine.params import check_prompt_length
    from ..engine.render import check_prompt

    check_prompt(args.prompt)
    if args.prompt_b is not None:
        check_prompt(args.prompt_b, "--prompt-b")
    if args.negative is not None:
        check_prompt_length(args.negative, "--negative")
    if args.source is not None:
        check_audio(args.source)
    if args.record is not None:
        from ..engine.outputs import check_output_path

        check_output_path(args.record, "--record")


def check_grid_args(args: argparse.Namespace) -> None:
    """--bpm, --time-signature, --bars, --sync, --click: in range and consistent, before the model loads."""
    check_bpm_flag("--bpm", args.bpm)
    check_bpm_flag("--source-bpm", args.source_bpm)
    beats_per_bar = time_signature_flag(args.time_signature, 4)
    if args.bars is not None:
        if args.bars < 1:
            raise CommandError(f"--bars must be at least 1, got {args.bars}")
        if args.bpm is None and args.sync is None:
            raise CommandError("--bars needs a tempo: give --bpm, or follow a clock with --sync")
        if args.endless:
            raise CommandError("--bars sets a loop's length: --endless has none")
        if args.bpm is not None:  # a followed clock's tempo is known only once it is joined
            from ..engine.audio.files import SAMPLE_RATE
            from ..live.sync.grid import Grid

            Grid(args.bpm, beats_per_bar).loop_of_bars(args.bars, SAMPLE_RATE, "--bars")
    try:
        check_offset_ms(args.sync_offset_ms, "--sync-offset-ms")
    except ValueError as error:
        raise CommandError(str(error)) from None
    if args.sync_offset_ms and args.sync is None:
        raise CommandError("--sync-offset-ms moves the loop against a followed clock: give --sync too, or leave it out")
    if args.click and args.bpm is None and args.sync is None:
        raise CommandError("--click needs a tempo: give --bpm, or follow a clock with --sync")
    if args.sync is not None and args.source is not None:
        raise CommandError("--sync follows a clock with a text loop; a --source on the grid takes --bpm instead")
    if (args.source_bpm is not None or args.source_downbeat is not None) and args.source is None:
        raise CommandError("--source-bpm and --source-downbeat describe a --source: give one")
    if args.source_downbeat is not None and not (math.isfinite(args.source_downbeat) and args.source_downbeat >= 0):
        raise CommandError(f"--source-downbeat must be 0 s or later, got {args.source_downbeat:g}")
    if args.sync == "midi" and args.midi_backend != "jack" and args.midi_port is None:
        raise CommandError("--sync midi reads the clock from --midi-port (or use --midi-backend jack and connect it)")


def check_plugin_args(args: argparse.Namespace) -> None:
    """--plugin plays through the DAW: no sound card, recording or clock of its own."""
    from ..live.plugin_link import control_name

    for flag, value in (("--record", args.record), ("--sync", args.sync)):
        if value:
            raise CommandError(f"--plugin plays through the DAW, which is the output and the clock: drop {flag}")
    if args.audio_device is not None:
        raise CommandError("--plugin plays through the DAW: drop --audio-device")
    check_port("--panel-port", args.panel_port or 0, "a free port")
    try:
        control_name(args.session)
    except ValueError as error:
        raise CommandError(f"--session: {error}") from None


class Stopped(Exception):
    """SIGTERM or SIGHUP: end the performance like Ctrl-C, so the recording is closed and renamed into place."""


def stop_on_signals() -> None:
    def stop(signal_number: int, frame) -> None:
        raise Stopped(signal.Signals(signal_number).name)

    for name in ("SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), stop)


def check_osc(config: LiveConfig) -> None:
    """Start the live config's OSC bridge once and stop it, so a busy port or a host that does not resolve is refused
    before the model loads rather than after; the live app binds the port again when it starts."""
    import logging

    from ..live.knobs import KnobRegistry
    from ..live.osc import OscBridge, OscConfig, SettingNames

    bridge = OscBridge(
        KnobRegistry(),
        OscConfig(
            session=config.session_name,
            host=config.osc_host,
            port=config.osc_port,
            feedback=config.osc_feedback,
            allow_hosts=config.osc_allow,
            names=SettingNames("--session", "--osc-host", "--osc-port", "--osc-feedback", "--osc-allow"),
        ),
    )
    osc_log = logging.getLogger("flowjam.osc")
    level = osc_log.level
    osc_log.setLevel(logging.ERROR)  # its warnings (beyond loopback, small buffer) show once, when the app starts
    try:
        bridge.start()
    finally:
        osc_log.setLevel(level)
    bridge.stop()

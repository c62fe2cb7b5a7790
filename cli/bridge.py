"""`flowjam bridge`: play a served session from OSC (and MIDI) controllers on this machine."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..live.midi_port import MIDI_BACKENDS
from .flags import CommandError, add_seconds, add_server_arguments, check_port, server_client


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = commands.add_parser("bridge", help="play a served session from OSC (and MIDI) controllers on this machine")
    add_server_arguments(parser)
    parser.add_argument("--osc-port", type=int, default=9110, help="UDP port for OSC control (0: none, MIDI only)")
    parser.add_argument("--osc-host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument(
        "--osc-session", help="the <session> in /flowjam/<session>/... (default: --session), e.g. a layout's 'default'"
    )
    parser.add_argument("--midi-port", help="MIDI input port name (pip install 'flowjam[midi]')")
    parser.add_argument("--midi-map", type=Path, help="JSON CC mapping file: loaded if it exists, saved on exit")
    parser.add_argument("--midi-learn", help="comma-separated knobs to map to the next controls moved, in order")
    parser.add_argument("--midi-backend", help=f"MIDI system: {', '.join(MIDI_BACKENDS)} or a mido backend name")
    add_seconds(parser, "stop after this many seconds (default: run until Ctrl-C)")
    return parser


def run(args: argparse.Namespace) -> int:
    from ..live.osc import OscConfig, SettingNames
    from ..live.playback import PlaybackError
    from ..serve.bridge import Bridge
    from ..serve.client import ServerError

    if args.seconds is not None and not args.seconds > 0:
        raise ValueError(f"--seconds must be > 0 (leave it out to run until Ctrl-C), got {args.seconds:g}")
    check_port("--osc-port", args.osc_port, "no OSC, MIDI only")
    learn = tuple(knob.strip() for knob in args.midi_learn.split(",")) if args.midi_learn else ()
    uses_midi = args.midi_port is not None or args.midi_map is not None or bool(learn)
    if not args.osc_port and not uses_midi:
        raise ValueError("nothing to bridge: give --osc-port N (default 9110) or --midi-port NAME")
    osc = None
    if args.osc_port:
        osc = OscConfig(
            session=args.osc_session or args.session,
            host=args.osc_host,
            port=args.osc_port,
            names=SettingNames(session="--osc-session", host="--osc-host", port="--osc-port"),
        )
    bridge = Bridge(server_client(args), args.session, osc)
    try:
        if uses_midi:
            bridge.enable_midi(args.midi_port, args.midi_map, learn, args.midi_backend)
        status = bridge.start()
    except (ServerError, PlaybackError) as error:  # the server's refusal: one line like every other
        raise CommandError(str(error)) from None
    try:
        where = f"OSC on {bridge.osc.address[0]}:{bridge.osc.address[1]} /flowjam/{osc.session}/..." if osc else ""
        midi = f"MIDI from {bridge.midi.name}" if bridge.midi is not None else ""
        print(
            f"bridging {' and '.join(filter(None, (where, midi)))} to session {args.session} on {args.server} "
            f"(playhead {status.get('playhead_s', 0):.1f} s); Ctrl-C stops",
            file=sys.stderr,
        )
        started = time.monotonic()
        while args.seconds is None or time.monotonic() - started < args.seconds:
            time.sleep(0.1)
    except KeyboardInterrupt:
        pass
    finally:
        bridge.stop()
    forwarder = bridge.forwarder
    print(f"forwarded {forwarder.requests} requests to the server ({forwarder.failures} refused or failed)")
    return 0

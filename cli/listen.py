"""`flowjam listen`: play a served session on this machine's sound card, and record what arrived."""

from __future__ import annotations

import argparse
from pathlib import Path

from .flags import CommandError, add_audio_device, add_seconds, add_server_arguments, server_client


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = commands.add_parser("listen", help="play a served session on this machine's sound card (and record it)")
    add_server_arguments(parser, session_required=False)
    add_audio_device(parser)
    parser.add_argument("--out", type=Path, help="write the audio that arrived to this WAV")
    add_seconds(parser, "stop after this many seconds of audio (default: until Ctrl-C)")
    parser.add_argument("--no-audio", action="store_true", help="no sound card: only record (with --out)")
    return parser


def run(args: argparse.Namespace) -> int:
    from ..live.playback import PlaybackError
    from ..serve.client import ServerError
    from ..serve.listen import listen

    if args.list_devices:
        from ..live.playback import list_devices

        print(list_devices())
        return 0
    if args.session is None:
        raise ValueError("--session is required: the session's name, as POST /sessions returned it")
    if args.no_audio and args.out is None:
        raise ValueError("--no-audio plays nothing: give --out FILE to record the session")
    try:
        report = listen(
            server_client(args), args.session, args.seconds, args.out, args.audio_device, play=not args.no_audio
        )
    except (ServerError, PlaybackError) as error:  # the server's or the sound card's refusal: one line
        raise CommandError(str(error)) from None
    print(report.summary() + (f"; wrote {args.out}" if args.out else ""))
    return 0

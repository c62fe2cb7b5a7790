"""`flowjam demo`: stream N seconds with a scripted knob sweep and write what played to a WAV."""

from __future__ import annotations

import argparse
from pathlib import Path

from .flags import add_depth, add_model_arguments, add_seconds, check_knob_flag, check_positive, load_session


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = commands.add_parser("demo", help="stream N seconds on the tiny preset with a scripted knob sweep -> WAV")
    add_seconds(parser, "length of the output in seconds", default=12.0)
    parser.add_argument("--out", type=Path, default=Path("flowjam-demo-stream.wav"))
    add_depth(parser)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--quiet", action="store_true", help="no per-tick lines")
    add_model_arguments(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    from ..engine.demo import run_demo
    from ..engine.outputs import check_output_path
    from ..engine.params import check_seed

    check_positive("--seconds", args.seconds)
    check_knob_flag("depth", args.depth)
    check_output_path(args.out, "--out")
    check_seed(args.seed)
    session = load_session(args)

    def show(line) -> None:
        if not args.quiet:
            print(
                f"tick {line.tick:4d}  {line.tick_ms:7.1f} ms  playhead {line.playhead_s:5.2f} s  slots "
                f"{line.active_slots}  rows {line.rows}  denoise {line.denoise:.2f}  blend {line.blend:.2f}  velocity "
                f"{line.velocity_scale:4s}  delivered {line.delivered}"
            )

    path, lines = run_demo(session, args.seconds, args.out, depth=args.depth, seed=args.seed, on_tick=show)
    times = sorted(line.tick_ms for line in lines)
    print(
        f"wrote {path}: {args.seconds:g} s from {len(lines)} ticks; tick ms median {times[len(times) // 2]:.1f}, "
        f"max {times[-1]:.1f}"
    )
    return 0

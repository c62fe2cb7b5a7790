"""`python -m flowjam COMMAND ...`: dispatch only. Each command is a module of cli/ (its flags and its run); the
flags several commands share are defined once in cli/flags.py. Heavy imports happen inside the commands' run, so
--help is instant."""

from __future__ import annotations

import argparse
import sys

from .cli import bench, bridge, demo, info, listen, live, render, serve
from .cli.flags import CommandError, one_line

INTERRUPTED = 128 + 2  # the shell's exit status for a command ended by SIGINT
COMMANDS = (render, bench, demo, live, info, serve, bridge, listen)  # in --help's order


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flowjam", description="flowjam: play ACE-Step 1.5 in real time (ComfyUI nodes, OSC, MIDI)"
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(commands).set_defaults(run=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.run(args)
    except (CommandError, ValueError, OSError) as error:  # anything else is a bug: its traceback shows
        print(f"flowjam {args.command}: error: {one_line(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a command that plays until Ctrl-C (live, serve) catches it and ends cleanly itself
        print(f"flowjam {args.command}: stopped by Ctrl-C; nothing was written", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())

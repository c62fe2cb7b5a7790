"""`flowjam info`: the parameter counts of a preset's networks, without weights."""

from __future__ import annotations

import argparse

from .flags import add_preset


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = commands.add_parser("info", help="parameter counts of a preset's networks (no weights needed)")
    add_preset(parser, "turbo-2b")
    return parser


def run(args: argparse.Namespace) -> int:
    from ..engine.bench.ticks import parameter_census

    for name, count in parameter_census(args.preset).items():
        print(f"{name:>26}: {count:>15,}")
    return 0

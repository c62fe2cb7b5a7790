"""`flowjam bench served`: a running server measured from outside, through HTTP and WebSocket as players use it
(serve/load.py): its creates and where they went, each session's first sound and latent interval, a shared knob
turned on every session at once and followed to the ear, and, on Ray Serve, a replica killed while they play."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import asdict
from typing import TYPE_CHECKING

from .flags import CommandError

if TYPE_CHECKING:
    from ..serve.load import KillFigures, LoadReport, Spread


def bench_served(args: argparse.Namespace) -> int:
    from ..engine.outputs import check_output_path, write_atomic
    from ..serve.access import read_key
    from ..serve.client import Client, ServerError
    from ..serve.load import CALL_TIMEOUT_S, KNOB, LoadOptions, measure_load, ray_killer

    if args.json is not None:
        check_output_path(args.json, "--json")
    client = Client(args.server, timeout_s=CALL_TIMEOUT_S, key=read_key(args.key_file))
    try:
        reason = client.not_ready()  # unreachable: ConnectionError, one line naming the fix
    except ServerError as error:
        raise CommandError(f"{args.server} answered GET /health with {error}; is it `flowjam serve`?") from None
    if reason is not None:
        raise CommandError(f"{args.server} cannot create sessions yet ({reason}); try again once GET /health is ok")
    kill = ray_killer(args.address) if args.kill_replica else None
    options = LoadOptions(
        args.sessions,
        args.prompt,
        args.song_seconds,
        args.window_seconds,
        args.depth,
        args.cfg,
        args.rounds,
        args.interval_s,
        args.recreate_timeout_s,
    )
    print(
        f"served load on {client.server}: {options.sessions} sessions ({options.song_seconds:g} s loops, window "
        f"{options.window_seconds:g} s, depth {options.depth}, cfg {options.cfg_mode}), {options.rounds} rounds of "
        f"{KNOB} {options.interval_s:g} s apart{', then a replica killed' if kill else ''}",
        flush=True,
    )
    try:
        report = measure_load(client, options, kill, say=lambda line: print(line, flush=True))
    except ServerError as error:  # a call the load does not expect refused (its sessions are ended by then)
        raise CommandError(str(error)) from None
    print_report(report)
    if args.json is not None:
        figures = {**asdict(report), "errors": report.errors, "ok": report.ok}
        write_atomic(args.json, json.dumps(figures, indent=2).encode())
        print(f"wrote {args.json}")
    return 0 if report.ok else 1


def spread(figure: Spread, unit: str, digits: int = 1) -> str:
    """A Spread as 'median / p95 unit'."""
    if figure.count == 0:
        return "none"
    return f"{figure.median:.{digits}f} / {figure.p95:.{digits}f} {unit}"


def number(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_report(r: LoadReport) -> None:
    from ..serve.load import KNOB

    through = [created for created in r.creates if created.replica]
    refused = [f"{c.session}: {c.refused} (HTTP {c.refused_status})" for c in r.creates if not c.replica]
    sounded = sum(created.sounded_s is not None for created in through)
    print(
        f"report:\n  creates: {len(through)} of {len(r.creates)} through, a create {spread(r.create_s, 's', 2)} "
        f"(median / p95); refused: {'; '.join(refused) or 'none'}\n"
        f"  placement: {', '.join(f'{replica} {count}' for replica, count in r.placement.items()) or 'none'}\n"
        f"  first sound after the create's answer: {spread(r.first_sound_s, 's', 2)}, {sounded} of {len(through)} "
        "sessions sounded\n"
        f"  latent interval (status `latents` over the rounds, this client's clock): {spread(r.latent_interval_ms, 'ms')}"
    )
    print(
        f"  {'session':<16} {'replica':<12} {'latent ms':>9} {'write ms':>8} {'tick ms':>7} {'chunks':>6} "
        f"{'longest gap ms':>14} {'skipped':>7} {'dropped':>7} {'errors':>6}"
    )
    for p in r.played:
        print(
            f"  {p.session:<16} {p.replica:<12} {number(p.latent_interval_ms):>9} {number(p.write_interval_ms):>8} "
            f"{number(p.ring_tick_ms):>7} {p.chunks:>6} {number(p.longest_gap_ms, 0):>14} {p.skipped:>7} "
            f"{p.dropped:>7} {number(p.runner_errors, 0):>6}"
        )
    print(
        f"  shared knob {KNOB}: {r.heard} of {len(r.turns)} changes heard ({len(r.played)} sessions x "
        f"{r.options.rounds} rounds), {len(r.errors)} errors\n"
        f"    knob -> first tick {spread(r.to_tick_ms, 'ms')}, -> ear {spread(r.to_ear_ms, 'ms')} (median / p95, "
        "from its arrival at the host)\n"
        f"    the HTTP call {spread(r.call_ms, 'ms')}; client -> ear at most {spread(r.client_to_ear_ms, 'ms')}"
    )
    for error in r.errors:
        print(f"    {error}")
    for p in r.played:
        events = [f"{event.get('event')} at {event['at_s']:.1f} s" for event in p.events]
        if events or p.stream_failure:
            print(f"    {p.session}'s stream: {', '.join(events) or 'no event'}; {p.stream_failure or 'open'}")
    if r.kill is not None:
        print_kill(r.kill)
    print(f"  ended {r.ended} sessions")


def print_kill(k: KillFigures) -> None:
    from ..serve.load import WATCH_AFTER_KILL_S

    codes = ", ".join(f"{code} x{count}" for code, count in Counter(k.codes_after.values()).items())
    gaps = max(k.others_longest_gap_ms.values(), default=None)
    through = [created for created in k.recreated if created.replica]
    sounds = [created.answered_s + created.sounded_s for created in through if created.sounded_s is not None]
    print(
        f"  replica {k.replica} killed ({len(k.sessions)} sessions): their lost events {spread(k.lost_ms, 'ms')} "
        f"after the kill (median / p95), {len(k.not_lost)} without one; their status then answered {codes or '-'}\n"
        f"    the other {len(k.others_longest_gap_ms)} sessions over the {WATCH_AFTER_KILL_S:g} s after the kill (the "
        f"re-creates in it): the longest gap between chunks "
        f"{number(gaps, 0)} ms, {k.others_skipped} chunks skipping samples, {k.others_dropped} dropped\n"
        f"    re-created {len(through)} of {len(k.sessions)} ({k.refusals} creates answered 503 first): the first "
        f"through {number(k.first_through_s)} s after the kill, the last {number(k.last_through_s)} s; sounded "
        f"{number(min(sounds, default=None))}-{number(max(sounds, default=None))} s after the kill"
    )
    for created in k.recreated:
        if not created.replica:
            print(f"    {created.session} not re-created: {created.refused} (HTTP {created.refused_status})")

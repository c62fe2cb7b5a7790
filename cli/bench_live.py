"""`flowjam bench latency | soak`: the live layer without a sound card: knob -> ear, and minutes under a knob storm."""

from __future__ import annotations

import argparse
import os
import statistics

from ..engine.params import DEFAULT_STEPS
from .flags import CommandError, check_bpm_flag, load_session, time_signature_flag

RUNNER_TIMINGS = ("tick_ms", "loop_ms", "decode_ms", "interval_ms", "write_ms", "lead_s", "patch_s")
MEDIAN_TARGET_MS = 2.0  # bench sync fails (exit 1) when the bars' median phase error is beyond this


def bench_latency(args: argparse.Namespace) -> int:
    from ..live.bench import measure_latency

    session = load_session(args)
    session.backend = args.backend
    print(
        f"knob latency: preset {args.preset}, backend {args.backend}, precision {args.precision}, depth {args.depth}, "
        f"cfg {args.cfg}, {DEFAULT_STEPS} steps, {args.song_seconds:g} s loop, {args.trials} trials per knob, no "
        f"audio device (real-time clock)"
    )
    print(
        f"{'knob':>16} {'kind':>8} {'knob->tick ms (median / p95)':>30} {'knob->written ms':>17} "
        f"{'knob->ear ms (median / p95)':>30} {'first touch ->ear ms':>21} {'its new-plan ticks':>19}"
    )
    summaries, status = measure_latency(
        session,
        args.trials,
        args.song_seconds,
        args.depth,
        cfg_mode=args.cfg,
        window_s=args.window_seconds,
        endless=args.endless,
    )
    for s in summaries:
        print(
            f"{s.knob:>16} {s.kind:>8} {s.tick_ms_median:17.1f} / {s.tick_ms_p95:8.1f} {s.written_ms_median:17.1f} "
            f"{s.ear_ms_median:17.1f} / {s.ear_ms_p95:8.1f} {s.first_touch_ear_ms:21.1f} {s.first_touch_plan_ticks:19d}"
        )
    print("runner at the end: " + ", ".join(f"{key} {status[key]}" for key in (*RUNNER_TIMINGS, "tick_graphs")))
    return first_touch_verdict(summaries)


def first_touch_verdict(summaries) -> int:
    """Print each knob's first touch against its later touches (the bound FIRST_TOUCH_BOUND); 1 if any misses it."""
    from ..live.bench import FIRST_TOUCH_BOUND

    slow = [s.knob for s in summaries if not s.first_touch_ratio <= FIRST_TOUCH_BOUND]
    ratios = ", ".join(f"{s.knob} {s.first_touch_ratio:.2f}x" for s in summaries)
    verdict = f"FAILED: {', '.join(slow)}" if slow else "passed"
    print(f"first touch -> ear over the later touches': {ratios} (bound {FIRST_TOUCH_BOUND:g}x): {verdict}")
    return 1 if slow else 0


def bench_soak(args: argparse.Namespace) -> int:
    from ..live.bench import soak

    session = load_session(args)
    session.backend = args.backend
    r = soak(
        session,
        args.minutes,
        args.song_seconds,
        args.depth,
        cfg_mode=args.cfg,
        report=print,
        window_s=args.window_seconds,
        endless=args.endless,
    )
    print(
        f"soak {r.minutes:g} min: {r.ticks} ticks, {r.knob_sets} knob sets, {r.prompt_swaps} prompt swaps, "
        f"{r.errors} runner errors"
    )
    since = "" if r.rss_minute1_mb is None else f"; from minute 1: {r.rss_end_mb - r.rss_minute1_mb:+.1f} MB"
    print(f"  RSS {r.rss_start_mb:.1f} -> {r.rss_end_mb:.1f} MB ({r.rss_end_mb - r.rss_start_mb:+.1f} MB{since})")
    drift_ms = r.tick_ms_last - r.tick_ms_first
    print(f"  tick ms median: first {r.tick_ms_first:.2f}, last {r.tick_ms_last:.2f} (drift {drift_ms:+.2f})")
    if r.gpu_mb is not None:
        since = "" if r.gpu_minute1_mb is None else f"; from minute 1: {r.gpu_mb[1] - r.gpu_minute1_mb:+.1f} MB"
        print(f"  GPU memory allocated {r.gpu_mb[0]:.1f} -> {r.gpu_mb[1]:.1f} MB, peak {r.gpu_mb[2]:.1f} MB{since}")
    print(
        f"  underruns {r.underruns}: {r.gaps} gaps (the engine behind the playhead), {r.late_blocks} late blocks (the "
        f"output itself late); and {r.start_underruns} while starting, before the storm"
    )
    print("  runner at the end: " + ", ".join(f"{key} {r.status[key]}" for key in RUNNER_TIMINGS))
    for which in ("tick_graphs", "window_graphs"):
        if r.status[which] is not None:
            print(
                f"  {which.replace('_', ' ')}: " + ", ".join(f"{key} {value}" for key, value in r.status[which].items())
            )
    return _soak_verdict(r, args.strict)


def _soak_verdict(r, strict: bool) -> int:
    """The soak's last lines: capture failures, gaps (with when) and late blocks, and what the run is judged by:
    runner errors and capture failures always fail it; with `strict` (a GPU soak), gaps and late blocks too."""
    when = ", ".join(f"{t:g}" for t in r.gap_times_s[:20]) + (" ..." if len(r.gap_times_s) > 20 else "")
    print(
        f"capture failures {r.capture_failures}; gaps {r.gaps}"
        + (f" (at {when} s)" if when else "")
        + f"; late blocks {r.late_blocks}; runner errors {r.errors}"
    )
    failed = [what for what, count in (("runner errors", r.errors), ("capture failures", r.capture_failures)) if count]
    if strict:
        failed += [what for what, count in (("gaps", r.gaps), ("late blocks", r.late_blocks)) if count]
    judged = "runner errors, capture failures" + (", gaps, late blocks (--strict)" if strict else "")
    print(f"verdict: {'FAILED: ' + ', '.join(failed) if failed else 'passed'} (judged by {judged})")
    return 1 if failed else 0


PRIVATE_NETWORK = "FLOWJAM_PRIVATE_NETWORK"
LOOPBACK_MULTICAST = "ip link set lo up && ip link set lo multicast on && ip route add 224.0.0.0/4 dev lo"


def bench_sync(args: argparse.Namespace) -> int:
    from ..engine.audio.files import SAMPLE_RATE
    from ..live.sync.grid import Grid
    from ..live.sync_bench import MISSED_SEARCH_S, check_jack_tools
    from ..live.sync_bench import bench_sync as run_sync

    check_bpm_flag("--bpm", args.bpm)
    check_bpm_flag("--tempo-change", args.tempo_change)
    args.time_signature = time_signature_flag(args.time_signature)
    Grid(args.bpm, args.time_signature).loop_of_bars(args.bars, SAMPLE_RATE, "--bars")
    check_jack_tools()
    if args.clock == "link" and os.environ.get(PRIVATE_NETWORK) != "1":
        return _in_a_private_network()
    session = load_session(args)
    print(
        f"sync: flowjam follows a {args.clock} clock at {args.bpm:g} BPM, {args.time_signature} beats a bar, on a JACK "
        f"dummy server (period {args.period}); a {args.bars}-bar loop clicks on every bar start; {args.minutes:g} min; "
        f"preset {args.preset} on {args.device}"
    )
    r = run_sync(
        session,
        args.clock,
        args.bpm,
        args.time_signature,
        args.bars,
        args.minutes * 60.0,
        args.period,
        print,
        args.tempo_change,
    )
    print(
        f"  bar-start phase error over {r.bars_heard} bars: median {r.median_ms:.3f} ms, max {r.max_ms:.3f} ms "
        f"(target {MEDIAN_TARGET_MS:g} / 5); {r.bars_missed} bars without a click after the start"
    )
    if r.errors_ms:
        chunks = [r.errors_ms[i : i + 15] for i in range(0, len(r.errors_ms), 15)]
        print("  median error by stretch of bars (ms): " + ", ".join(f"{statistics.median(c):+.2f}" for c in chunks))

    def late(bar) -> str:
        return (
            "no late block" if bar.late_block_s is None else f"the nearest late block {bar.late_block_s:+.2f} s from it"
        )

    for bar in r.missed:
        click = "none" if bar.click_offset_ms is None else f"one {bar.click_offset_ms:+.1f} ms off"
        print(
            f"    bar {bar.index} at {bar.at_s:.2f} s without a click: within {MISSED_SEARCH_S:g} s, {click}; {late(bar)}"
        )
        for event in bar.nearby:
            print(f"      {event}")
    for bar in r.far:
        print(f"    bar {bar.index} at {bar.at_s:.2f} s heard {bar.error_ms:+.2f} ms off its line; {late(bar)}")
        for event in bar.nearby:
            print(f"      {event}")
    if r.late_at_s:
        print("  late blocks at (s from the recording's start): " + ", ".join(f"{t:.2f}" for t in r.late_at_s))
    clock = "-" if r.clock_bpm is None else f"{r.clock_bpm:.3f} BPM ({r.clock_bpm - r.bpm:+.3f})"
    print(
        f"  clock tempo as followed: {clock}; phase corrections {r.corrections}; underruns {r.underruns} ({r.gaps} gaps, "
        f"{r.late_blocks} late blocks); runner errors {r.runner_errors}; cycles the band's recorder missed "
        f"{r.unrecorded_cycles}"
        + (
            f"; Link's bar lines taken {r.latency_ms:.2f} ms early (the output's latency: Link aims the heard beat)"
            if r.kind == "link"
            else ""
        )
    )
    if r.tempo_change is not None:
        late = "never" if r.change_bars_late is None else f"on bar line {r.change_bars_late} after it"
        print(
            f"  tempo change {r.bpm:g} -> {r.tempo_change:g} BPM on a bar line: the loop at the new tempo began {late} "
            f"(0: that bar line); loops switched {r.switches}; until then the old loop is kept on the bar lines by "
            "the phase lock (its corrections above)"
        )
        settled = "never" if r.tempo_settled_s is None else f"{r.tempo_settled_s:.2f} s"
        print(
            f"  the followed tempo within 0.05 BPM of {r.tempo_change:g} from {settled} after the change (target 2 s)"
        )
    return 0 if r.bars_heard and not r.bars_missed and r.runner_errors == 0 and r.median_ms <= MEDIAN_TARGET_MS else 1


def _in_a_private_network() -> int:
    """Run this bench again inside a network namespace with only the loopback interface, multicast routed on it:
    Link's peers find each other by multicast, and no packet may leave the machine."""
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None or shutil.which("ip") is None:
        raise CommandError("bench sync --clock link needs unshare and ip (util-linux, iproute2) for a private network")
    command = ["unshare", "-n", "sh", "-c", f'{LOOPBACK_MULTICAST} && exec "$@"', "sh", sys.executable, "-m", "flowjam"]
    done = subprocess.run([*command, *sys.argv[1:]], env={**os.environ, PRIVATE_NETWORK: "1"})
    if done.returncode != 0 and done.returncode != 1:
        raise CommandError("bench sync --clock link could not make a private network namespace (unshare -n) here")
    return done.returncode

"""`flowjam bench latency | soak`: the live layer without a sound card: knob -> ear, and minutes under a knob storm."""

from __future__ import annotations

import argparse

from ..engine.params import DEFAULT_STEPS
from .flags import load_session

RUNNER_TIMINGS = ("tick_ms", "loop_ms", "decode_ms", "interval_ms", "write_ms", "lead_s", "patch_s")


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
    return 0


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
    print(f"  RSS {r.rss_start_mb:.1f} -> {r.rss_end_mb:.1f} MB ({r.rss_end_mb - r.rss_start_mb:+.1f} MB)")
    drift_ms = r.tick_ms_last - r.tick_ms_first
    print(f"  tick ms median: first {r.tick_ms_first:.2f}, last {r.tick_ms_last:.2f} (drift {drift_ms:+.2f})")
    if r.gpu_mb is not None:
        print(f"  GPU memory allocated {r.gpu_mb[0]:.1f} -> {r.gpu_mb[1]:.1f} MB, peak {r.gpu_mb[2]:.1f} MB")
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
    return 0 if r.errors == 0 else 1

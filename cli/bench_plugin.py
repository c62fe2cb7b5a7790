"""`flowjam bench plugin`: the DAW plugin (its LV2 in jalv on a JACK dummy server) beside a generating engine: the
plugin's time per block in the host's audio thread, xruns, gaps, and host automation's way to the engine."""

from __future__ import annotations

import argparse
import statistics

from .flags import CommandError, check_bpm_flag

PERIODS = tuple(2**k for k in range(5, 13))  # what jackd takes: 32..4096 frames


def model_flags(args: argparse.Namespace) -> list[str]:
    """The model flags of this command, for the engine it starts (`flowjam live --plugin`)."""
    flags = ["--preset", args.preset, "--device", args.device, "--dtype", args.dtype, "--precision", args.precision]
    if args.checkpoint is not None:
        flags += ["--checkpoint", str(args.checkpoint)]
    return flags


def bench_plugin(args: argparse.Namespace) -> int:
    from ..live.plugin_soak import check_plugin_soak_tools, soak_plugin
    from ..live.sync_bench import check_jack_tools

    check_bpm_flag("--bpm", args.bpm)
    if args.period not in PERIODS:
        raise CommandError(
            f"--period {args.period}: JACK's period is a power of two, one of {', '.join(map(str, PERIODS))}"
        )
    check_jack_tools()
    check_plugin_soak_tools()
    print(
        f"plugin: the LV2 in jalv on a JACK dummy server (period {args.period}, 48 kHz) rolled by a timebase master at "
        f"{args.bpm:g} BPM, beside `flowjam live --plugin` ({args.preset}, {args.device}) generating a {args.bars}-bar "
        f"loop; {args.minutes:g} min",
        flush=True,
    )
    r = soak_plugin(
        args.minutes * 60.0, args.period, args.bpm, args.bars, model_flags(args), lambda s: print(s, flush=True)
    )
    b = r.blocks
    print(
        f"plugin {r.seconds:.0f} s: {b.blocks} blocks timed ({r.host_blocks} attached blocks counted), per block "
        f"median {b.median_us:.1f} us, p99 {b.p99_us:.1f} us, max {b.max_us:.1f} us (the period: {r.period_us:.0f} us)\n"
        f"  transport rolled {r.cycles} cycles: {r.gaps} gaps (cycles of silence after the first sound)\n"
        f"  JACK xruns {r.xruns}; the plugin's callback could cause {r.plugin_xruns} (its slowest block against half a "
        f"period)\n"
        f"  engine latents {r.engine_latents} (it generated throughout)\n"
        f"{automation_line(r)}\n"
        f"verdict: {'passed' if r.passed else 'FAILED'} (judged by gaps and the xruns the plugin can cause)"
    )
    return 0 if r.passed else 1


def automation_line(r) -> str:
    """Host automation's way to the engine: set in jalv -> the plugin's block -> taken in by the engine."""
    from ..live.bench import p95
    from ..live.plugin_soak import AUTOMATE_EVERY_S, AUTOMATE_KNOB

    if not r.automation:
        return "  host automation: no knob set was taken in (the run was shorter than one set)"
    host, engine = (sorted(leg) for leg in zip(*r.automation))
    total = sorted(a + b for a, b in r.automation)

    def figures(values: list[float]) -> str:
        return f"{statistics.median(values):.1f} / {p95(values):.1f} / {values[-1]:.1f} ms"

    return (
        f"  host automation ({AUTOMATE_KNOB} set in jalv every {AUTOMATE_EVERY_S:g} s, {len(total)} sets; median / p95 "
        f"/ max): set -> the plugin's block {figures(host)}, block -> engine {figures(engine)}, in all "
        f"{figures(total)} (one period: {r.period_us / 1000:.1f} ms); from the engine on, a knob's way to the ear is "
        f"`live`'s (bench latency)"
    )

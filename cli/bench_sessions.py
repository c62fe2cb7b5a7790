"""`flowjam bench sessions`: live sessions on one host (or one host per GPU): does each get a fresh latent often
enough, and how soon is a knob heard?"""

from __future__ import annotations

import argparse
import sys

from .bench_live import first_touch_verdict
from .flags import CommandError, describe_device, load_session


def bench_sessions(args: argparse.Namespace) -> int:
    import torch

    if args.gpus < 1:
        raise CommandError(f"--gpus {args.gpus}: give 1 or more GPUs")
    if args.gpus > 1:
        if not args.device.startswith("cuda"):
            raise CommandError(f"--gpus {args.gpus} runs one process per GPU: add --device cuda")
        found = torch.cuda.device_count()
        if found < args.gpus:
            raise CommandError(
                f"--gpus {args.gpus}: this machine has {found} CUDA device(s); use --gpus {max(1, found)} or a machine "
                f"with {args.gpus} GPUs"
            )
        return bench_sessions_on_gpus(args.gpus)

    from ..serve.bench import measure_sessions
    from ..serve.host import RingHost

    session = load_session(args)
    session.backend = args.backend
    print(
        f"Live sessions on one host: preset {args.preset}, {args.song_seconds:g} s loops, depth {args.depth}, cfg "
        f"{args.cfg}, {args.backend}, {args.dtype}, {describe_device(args.device)}, torch {torch.__version__}; every "
        f"session's knob turned at once, {args.trials} trials; real time: a latent every <= {args.interval_ms:g} ms "
        f"and a shared knob heard within {args.ear_ms:g} ms (p95)"
    )
    lora = None
    if args.lora_rank:
        from ..engine.bench.ticks import random_lora
        from ..engine.lora import lora_set

        decoder = session.models.acestep.decoder
        lora = "bench"
        lora_set(decoder).attach(random_lora(decoder, lora, args.lora_rank, seed=0), 1.0, "live")
        print(f"  a live LoRA of rank {args.lora_rank}, each session at its own strength")
    batched = args.writes == "batched"
    if args.overlap and not batched:
        raise CommandError("--overlap needs --writes batched (the ring's writer is woken once each tick has ended)")
    # one host for every count: admission learns from each
    host = RingHost(session, latent_interval_ms=args.interval_ms, batched_writes=batched, overlap_ticks=args.overlap)
    writer = "one ring writer, in batches" if batched else "a writer thread per session"
    cycle = "; the next tick prepared while the GPU runs the last" if args.overlap else ""
    print(f"  windows written by {writer}{cycle}")
    try:
        for count in args.sessions:
            r = measure_sessions(
                host,
                count,
                args.song_seconds,
                args.depth,
                args.cfg,
                args.trials,
                lora,
                window_s=args.window_seconds,
                endless=args.endless,
            )
            report_sessions(r, count, args)
    finally:
        host.close()
    return 0


def bench_sessions_on_gpus(gpus: int) -> int:
    """The same `bench sessions` on GPUs 0..gpus-1 at once, each in a process of its own that sees one GPU (as one
    Ray replica would), their lines prefixed with the GPU; -> the worst exit status."""
    import os
    import subprocess

    argv, rest = [], iter(sys.argv[1:])
    for arg in rest:
        if arg == "--gpus":
            next(rest, None)  # and its value
        elif not arg.startswith("--gpus="):
            argv.append(arg)
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "flowjam", *argv],
            env={**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for gpu in range(gpus)
    ]
    outputs = [child.communicate()[0] for child in children]
    for gpu, output in enumerate(outputs):
        for line in output.splitlines():
            print(f"[gpu {gpu}] {line}")
    return max(child.returncode for child in children)


def report_sessions(r, count: int, args: argparse.Namespace) -> None:
    from ..serve.bench import SETTLE_TIMEOUT_S

    def settled(seconds: float | None) -> str:
        return f"not within {SETTLE_TIMEOUT_S:g} s" if seconds is None else f"{seconds:.1f} s"

    verdict = "REAL TIME" if r.realtime(args.interval_ms, args.ear_ms) else "not real time"
    p = r.phases
    print(
        f"  {count} asked, {r.sessions} playing: tick {r.ring_tick_ms:.1f} ms, a latent every "
        f"{r.latent_interval_ms:.0f} ms (slowest session: {r.cycles_per_latent:.2f} ring cycles of "
        f"{r.latent_interval_ms / r.cycles_per_latent:.1f} ms; {r.restarting_interval_ms:.0f} ms while a per-request "
        f"knob restarts the slots), {r.errors} errors, {r.late_writes} of {r.writes} writes late -> {verdict}\n"
        f"    tick graphs settled {settled(r.settle_s)} after the last session started (target 5 s; the sessions "
        f"started over {r.starting_s:.1f} s, admission measuring the ring between creates)\n"
        f"    ring cycle {p.cycle_ms:.1f} ms: runners {p.runners_ms:.1f} + tick {p.tick_ms:.1f} + hand-out "
        f"{p.handout_ms:.1f} + other {p.cycle_ms - p.runners_ms - p.tick_ms - p.handout_ms:.1f} ms"
    )
    if r.write_batches:
        print(f"    ring writer: {r.write_batches} batches, {r.writes / r.write_batches:.2f} windows a batch")
    for s, touch_settle_s in zip(r.knobs, r.touch_settle_s):
        print(
            f"    {s.knob:>15} ({s.kind}): knob -> tick {s.tick_ms_median:.1f} / {s.tick_ms_p95:.1f} ms, -> ear "
            f"{s.ear_ms_median:.1f} / {s.ear_ms_p95:.1f} ms (median / p95; first touch {s.first_touch_ear_ms:.1f} "
            f"in its slowest session, the later turns' slowest {s.later_touch_ear_ms:.1f} (median); graphs settled "
            f"{settled(touch_settle_s)} after it)"
        )
    if r.refused:
        print(f"    refused: {r.refused}")
    if r.graphs is not None:
        cause = f" (the newest: {r.graphs.last_failure})" if r.graphs.capture_failures else ""
        print(
            f"    tick graphs: {r.graphs.captures} captures ({r.graphs.capture_ms:.0f} ms of host time, the slowest "
            f"{r.graphs.capture_ms_max:.0f} ms), {r.graphs.capture_failures} capture failures{cause}"
        )
    first_touch_verdict(r.knobs)

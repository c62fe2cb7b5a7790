"""`flowjam bench dit | decode | lm | kernels`: one network (or the fused kernels) at a time, timed at real shapes
with random weights."""

from __future__ import annotations

import argparse

from .flags import describe_device


def bench_dit(args: argparse.Namespace) -> int:
    import torch

    from ..engine.bench.ticks import time_dit_forward

    print(
        f"DiT forward: preset {args.preset}, batch {args.batch}, {args.dtype}, {describe_device(args.device)}, "
        f"torch {torch.__version__}"
    )
    print(f"{'window s':>9} {'frames':>7} {'median ms':>10} {'min ms':>8} {'max ms':>8}")
    for song_seconds in args.song_seconds:
        timing = time_dit_forward(
            args.preset, song_seconds, args.batch, args.device, getattr(torch, args.dtype), args.repeats
        )
        print(
            f"{timing.seconds:9.1f} {timing.frames:7d} {timing.median_ms:10.2f} {timing.min_ms:8.2f} "
            f"{timing.max_ms:8.2f}"
        )
    return 0


def bench_decode(args: argparse.Namespace) -> int:
    import torch

    from ..engine.bench.ticks import bench_decode as measure

    print(
        f"windowed VAE decode: preset {args.preset}, {args.dtype}, {describe_device(args.device)}, "
        f"torch {torch.__version__}"
    )
    print("| window s | plain ms | graph ms | audio ms per ms |")
    print("|---|---|---|---|")
    for r in measure(args.preset, args.window, args.device, getattr(torch, args.dtype), args.repeats):
        print(f"| {r.window_s:g} | {r.plain_ms:.2f} | {r.graph_ms:.2f} | {r.audio_ms_per_ms:.0f} |")
    return 0


def bench_lm(args: argparse.Namespace) -> int:
    import torch

    from ..engine.bench.lm import run_lm_bench

    run_lm_bench(
        args.lm_preset,
        args.batch,
        args.lm_cfg,
        args.tokens,
        args.device,
        getattr(torch, args.dtype),
        args.repeats,
        not args.no_baseline,
        args.compile,
        args.profile,
    )
    return 0


def bench_kernels(args: argparse.Namespace) -> int:
    import torch

    from ..engine.bench.kernels import bench_kernels as measure

    timings = measure(args.preset, args.song_seconds, args.batch, args.device)
    print(f"fused kernels: preset {args.preset}, bf16, {describe_device(args.device)}, torch {torch.__version__}")
    print("graph-replayed, microseconds per call")
    for op in dict.fromkeys(t.op for t in timings):
        rows = [t for t in timings if t.op == op]
        paths = list(rows[0].paths_us)
        print(f"\n{op}\n| rows x tokens | " + " | ".join(paths) + " |")
        print("|---|" + "---|" * len(paths))
        for t in rows:
            print(f"| {t.rows:,} | " + " | ".join(f"{t.paths_us[p]:.1f}" for p in paths) + " |")
    return 0

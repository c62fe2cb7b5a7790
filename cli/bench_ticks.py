"""`flowjam bench tick | ring | lora`: steady-state StreamPipeline ticks at real shapes (random weights), against
the FLOP bound: one stream, several sessions in one ring, and the cost of LoRAs."""

from __future__ import annotations

import argparse
import dataclasses

from ..engine.params import REALTIME_LATENT_INTERVAL_MS
from .flags import describe_device


def build_fixture(args: argparse.Namespace, seconds: float | None = None, gemm_tflops: float = 0.0):
    """The preset's DiT with random weights and a song latent of `seconds` (default --song-seconds), on --device in
    --dtype; `gemm_tflops`: a GEMM peak measured already (0: measure it)."""
    import torch

    from ..engine.bench.ticks import TickFixture

    song_s = args.song_seconds if seconds is None else seconds
    return TickFixture.build(args.preset, song_s, args.device, getattr(torch, args.dtype), gemm_tflops=gemm_tflops)


def bench_tick(args: argparse.Namespace) -> int:
    import torch

    from ..engine.bench.ticks import bench_tick as measure
    from ..engine.kernels import fused_kernels_turned
    from ..engine.params import LATENT_RATE_HZ
    from ..engine.stream.windows import ring_frames, window_frames

    songs: list[tuple[str, float, bool]] = [(f"{s:g} s", s, False) for s in args.song_seconds]
    if args.endless:
        ring_s = ring_frames(window_frames(args.window_seconds, None), None) / LATENT_RATE_HZ
        songs.append(("endless", ring_s, True))
    window = f"{args.window_seconds:g} s windows" if args.window_seconds else "whole-song requests"
    print(
        f"StreamPipeline ticks: preset {args.preset}, songs {', '.join(name for name, _, _ in songs)}, {window}, "
        f"{args.steps} steps, {args.dtype}, {describe_device(args.device)}, torch {torch.__version__}"
    )
    reports, fixtures = [], []
    for song, seconds, endless in songs:
        fixture = build_fixture(args, seconds, fixtures[0].gemm_tflops if fixtures else 0.0)
        if not fixtures:
            print(f"  measured GEMM peak {fixture.gemm_tflops:.1f} TFLOP/s")
        fixtures.append(fixture)
        for precision in args.precision:
            if precision == "fp8":
                error = fixture.to_fp8(args.steps)
                print(
                    f"  fp8 vs bf16: velocity relative error {error.velocity:.4f} (one forward, 8 rows), finished "
                    f"{args.steps}-step latent {error.latent:.4f} (relative L2)"
                )
            runs = (
                (d, c, b, f) for d in args.depth for c in args.cfg for b in args.backend for f in args.fused_kernels
            )
            for depth, cfg, backend, fused in runs:
                with fused_kernels_turned(fused == "on"):
                    r = measure(
                        fixture,
                        depth,
                        args.steps,
                        cfg,
                        ticks=args.ticks,
                        backend=backend,
                        profile=args.profile,
                        window_s=args.window_seconds,
                        endless=endless,
                        fresh_seeds=args.fresh_seeds,
                    )
                if len(args.fused_kernels) > 1:
                    r = dataclasses.replace(r, backend=f"{backend} ({'fused' if fused == 'on' else 'unfused'})")
                reports.append((song, r))
                print(
                    f"  song {song} depth {depth} cfg {cfg:10s} {r.backend:13s} {precision} {r.rows_per_tick:5.2f} rows  "
                    f"{r.median_ms:7.2f} ms/tick (p95 {r.p95_ms:.2f}, free-running {r.free_ms:.2f}, host "
                    f"{r.host_ms:.2f})  bound {r.bound_ms:.2f} ms = {r.median_ms / r.bound_ms:.2f}x  "
                    f"warm-up {r.warmup_s:.1f} s  {r.audio_s_per_s:.0f} audio s/s"
                )
                if r.graphs:
                    print(f"    graphs {r.graphs}")
                if r.profile:
                    print("    " + r.profile.replace("\n", "\n    "))
    first: dict[tuple, float] = {}  # each configuration's ms/tick at the first song: the ratios' base
    for _, r in reports:
        first.setdefault((r.depth, r.cfg, r.backend, r.precision), r.median_ms)
    print(
        "\n| song | depth | cfg | rows | backend | precision | ms/tick (p95) | vs first song | free-running | host ms | "
        "bound ms | / bound |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for song, r in reports:
        ratio = r.median_ms / first[r.depth, r.cfg, r.backend, r.precision]
        print(
            f"| {song} | {r.depth} | {r.cfg} | {r.rows_per_tick:.2f} | {r.backend} | {r.precision} | {r.median_ms:.2f} "
            f"({r.p95_ms:.2f}) | {ratio:.2f}x | {r.free_ms:.2f} | {r.host_ms:.2f} | {r.bound_ms:.2f} | "
            f"{r.median_ms / r.bound_ms:.2f}x |"
        )
    if len(songs) > 1:
        print_interleaved(args, songs, fixtures)
    return 0


INTERLEAVED_TICKS_PER_ROUND = 3


def print_interleaved(args: argparse.Namespace, songs: list[tuple[str, float, bool]], fixtures: list) -> None:
    """Every song's ticks again, in alternating rounds (`interleaved_ms`): the ratios a busy machine cannot tilt."""
    from ..engine.bench.ticks import TickRun, interleaved_ms

    rounds = max(4, args.ticks // INTERLEAVED_TICKS_PER_ROUND)
    print(
        f"\nInterleaved: the songs' ticks in {rounds} alternating rounds of {INTERLEAVED_TICKS_PER_ROUND} "
        f"(precision {fixtures[0].precision}), median ms/tick and the ratio to the first song:"
    )
    for depth, cfg, backend in ((d, c, b) for d in args.depth for c in args.cfg for b in args.backend):
        runs = [
            TickRun(
                fixture, depth, args.steps, cfg, backend, args.window_seconds, endless, fresh_seeds=args.fresh_seeds
            )
            for fixture, (_, _, endless) in zip(fixtures, songs)
        ]
        for run in runs:
            run.warm_up()
        medians = interleaved_ms(runs, rounds, INTERLEAVED_TICKS_PER_ROUND)
        cells = ", ".join(f"{song} {ms:.2f} ms ({ms / medians[0]:.2f}x)" for (song, _, _), ms in zip(songs, medians))
        print(f"  depth {depth} cfg {cfg} {backend}: {cells}")


def bench_ring(args: argparse.Namespace) -> int:
    import torch

    from ..engine.bench.ticks import bench_ring as measure

    print(
        f"Sessions in one ring: preset {args.preset}, {args.song_seconds:g} s loops, depth {args.depth}, "
        f"{args.steps} steps, cfg {args.cfg}, {args.backend}, {args.dtype}, {describe_device(args.device)}, "
        f"torch {torch.__version__}"
    )
    fixture = build_fixture(args)
    print(
        f"  measured GEMM peak {fixture.gemm_tflops:.1f} TFLOP/s; real time: a fresh latent every <= "
        f"{REALTIME_LATENT_INTERVAL_MS:g} ms each"
    )
    for sessions in args.sessions:
        r = measure(fixture, sessions, args.depth, args.steps, args.cfg, args.backend, args.ticks)
        print(
            f"  {r.sessions:2d} sessions {r.rows:5.1f} rows  {r.median_ms:7.2f} ms/tick (p95 {r.p95_ms:.2f})  "
            f"{r.median_ms / r.bound_ms:4.2f}x bound ({r.bound_ms:.2f} ms)  latent every {r.latent_interval_ms:6.1f} "
            f"ms per session  {'real time' if r.realtime else 'NOT real time'}"
        )
    return 0


def bench_lora(args: argparse.Namespace) -> int:
    import torch

    from ..engine.bench.ticks import bench_lora as measure

    print(
        f"LoRA ticks: preset {args.preset}, {args.song_seconds:g} s song, {args.loras} LoRAs of rank {args.rank} on "
        f"every attention and MLP projection, depth {args.depth}, cfg {args.cfg}, {args.backend}, {args.dtype}, "
        f"{describe_device(args.device)}, torch {torch.__version__}"
    )
    fixture = build_fixture(args)
    r = measure(
        fixture, args.loras, args.rank, args.depth, args.steps, args.cfg, args.backend, args.ticks, args.profile
    )
    base = r.plain.median_ms
    rows = (
        ("no LoRA", r.plain),
        ("live (unmerged)", r.unmerged),
        ("folded", r.folded),
        ("folded, moving", r.folded_moving),
        ("merged", r.merged),
    )
    for label, report in rows:
        print(
            f"  {label:16s} {report.median_ms:7.2f} ms/tick (p95 {report.p95_ms:.2f}, host {report.host_ms:.2f})  "
            f"{(report.median_ms / base - 1) * 100:+5.1f} %  {report.rows_per_tick:.0f} rows"
        )
    print(
        f"  (folded, moving: every strength changes before every tick, so each tick pays one fold; one fold "
        f"{r.fold_ms:.2f} ms, {r.folded_gb:.3f} GB of resting weights kept)"
    )
    for mode, cost in r.changes.items():
        print(
            f"  3 strength changes on a warm {mode} stream: {cost.recompiles} recompiles, {cost.recaptures} tick "
            f"graphs captured, {cost.folds} folds"
        )
    if r.unmerged.profile:
        print("  unmerged ticks: " + r.unmerged.profile.replace("\n", "\n  "))
    return 0

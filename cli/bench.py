"""`flowjam bench TARGET`: benchmarks that print numbers. The flags of every target are here; what each target
measures and prints is in bench_models (dit, decode, lm), bench_ticks (tick, ring, lora), bench_live (latency, soak, sync),
bench_sessions (sessions), bench_served (served) and bench_plugin (plugin)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..engine.params import MAX_STEPS, REALTIME_LATENT_INTERVAL_MS, song_frames
from . import bench_live, bench_models, bench_plugin, bench_served, bench_sessions, bench_ticks
from .flags import (
    CommandError,
    add_backend,
    add_bpm,
    add_cfg_mode,
    add_depth,
    add_device,
    add_dtype,
    add_key_file,
    add_lm_preset,
    add_model_arguments,
    add_precision,
    add_preset,
    add_server_url,
    add_song_seconds,
    add_steps,
    add_time_signature,
    add_window_seconds,
    check_device,
    check_knob_flag,
    check_positive,
    check_range,
    check_window,
)

TARGETS = {
    "dit": bench_models.bench_dit,
    "tick": bench_ticks.bench_tick,
    "ring": bench_ticks.bench_ring,
    "lora": bench_ticks.bench_lora,
    "decode": bench_models.bench_decode,
    "latency": bench_live.bench_latency,
    "sessions": bench_sessions.bench_sessions,
    "served": bench_served.bench_served,
    "soak": bench_live.bench_soak,
    "lm": bench_models.bench_lm,
    "kernels": bench_models.bench_kernels,
    "sync": bench_live.bench_sync,
    "plugin": bench_plugin.bench_plugin,
}
COUNTS = (
    "batch",
    "repeats",
    "ticks",
    "trials",
    "sessions",
    "loras",
    "rank",
    "tokens",
    "lora_rank",
    "bars",
    "rounds",
)  # 1 or more
AMOUNTS = ("minutes", "window", "interval_ms", "ear_ms", "interval_s", "recreate_timeout_s")  # finite, above 0


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = commands.add_parser("bench", help="benchmarks that print numbers")
    targets = parser.add_subparsers(dest="target", metavar="TARGET", required=True)

    dit = targets.add_parser("dit", help="time one batched DiT forward at several window lengths")
    add_song_seconds(dit, [10.0, 20.0, 60.0], multiple=True, help="the latent lengths to time, one forward each (s)")
    dit.add_argument("--batch", type=int, default=1, help="rows per forward (depth x CFG)")
    dit.add_argument("--repeats", type=int, default=5)
    add_random_model(dit, "tiny")

    tick = targets.add_parser("tick", help="steady-state StreamPipeline ticks at real shapes (random weights)")
    add_ring(
        tick,
        song_seconds_help="song latent lengths (s): one fixture each, ticks compared",
        cfg="off",
        ticks=48,
        multiple=True,
    )
    add_window_seconds(tick, default=0.0)
    tick.add_argument("--endless", action="store_true", help="also time an endless song (needs --window-seconds)")
    tick.add_argument(
        "--profile",
        action="store_true",
        help="print a torch.profiler summary of 8 ticks per run (GPU) and the host time by section over 40 more",
    )
    tick.add_argument(
        "--fused-kernels",
        nargs="+",
        choices=["on", "off"],
        default=["on"],
        help="compile-graph's fused GEMM epilogues (Hopper GPUs with Triton); 'on off' times both, side by side",
    )
    tick.add_argument(
        "--fresh-seeds",
        action="store_true",
        help="a new seed every tick (each admission draws its noise on the host); default: one seed, as a live "
        "stream's seed knob",
    )
    add_precision(tick, multiple=True, more_help="; fp8 also prints its error vs bf16")
    add_random_model(tick)

    ring = targets.add_parser("ring", help="several sessions (lanes) in one ring: ticks against the bound, real time")
    ring.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4])
    add_ring(ring, song_seconds_help="loop latent length (s)", cfg="full", ticks=32)
    add_random_model(ring)

    lora = targets.add_parser("lora", help="tick cost of LoRAs (live, folded, merged) and what a strength change costs")
    lora.add_argument("--loras", type=int, default=2, help="random LoRAs on every attention and MLP projection")
    lora.add_argument("--rank", type=int, default=64)
    add_ring(lora, song_seconds_help="song latent length (s)", cfg="full", ticks=48)
    lora.add_argument("--profile", action="store_true", help="print a torch.profiler summary of the unmerged ticks")
    add_random_model(lora)

    decode = targets.add_parser("decode", help="windowed VAE decodes: plain against CUDA-graph replays")
    decode.add_argument("--window", type=float, nargs="+", default=[0.1, 0.2, 0.4, 1.6], help="window seconds")
    decode.add_argument("--repeats", type=int, default=20)
    add_random_model(decode)

    latency = targets.add_parser(
        "latency", help="knob -> first changed tick and knob -> ear, shared vs per-request knob"
    )
    latency.add_argument("--trials", type=int, default=12)
    add_stream(latency, song_seconds=10.0, cfg="off")
    add_model_arguments(latency)

    sessions = targets.add_parser(
        "sessions", help="live sessions on one host: real time (latent interval) and knob -> ear per session"
    )
    sessions.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 3])
    sessions.add_argument("--trials", type=int, default=8)
    add_stream(sessions, song_seconds=60.0, cfg="full")
    sessions.add_argument(
        "--interval-ms",
        type=float,
        default=REALTIME_LATENT_INTERVAL_MS,
        help="a fresh latent per session at least this often",
    )
    sessions.add_argument("--ear-ms", type=float, default=150.0, help="knob -> ear target (p95 of the shared knob)")
    sessions.add_argument(
        "--gpus", type=int, default=1, help="run the same bench on GPUs 0..N-1 at once, one process (host) each"
    )
    sessions.add_argument(
        "--writes",
        choices=("each", "batched"),
        default="each",
        help="who decodes the sessions' windows: a writer thread per session (each, what serve runs) or one ring "
        "writer in batches (batched)",
    )
    sessions.add_argument(
        "--overlap",
        action="store_true",
        help="the ring prepares the next tick and hands out the last one's latents while the GPU runs it (needs "
        "--writes batched)",
    )
    sessions.add_argument(
        "--lora-rank",
        type=int,
        help="attach a random live LoRA of this rank on every attention and MLP projection; each session plays it "
        "at its own strength (0.5, 0.6, ...)",
    )
    add_model_arguments(sessions)

    served = targets.add_parser(
        "served",
        help="a running server (serve --local, or on Ray Serve) measured from outside over HTTP and WebSocket, as "
        "players use it: creates, placement, latent interval, a shared knob -> ear, a replica killed",
    )
    add_server_url(served)
    add_key_file(served)
    served.add_argument("--sessions", type=int, default=8, help="sessions created, one at a time (default 8)")
    served.add_argument("--prompt", default="lofi hip hop, mellow piano", help="every session's caption (prompt A)")
    add_song_seconds(served, 60.0, help="each session's loop length (s)")
    add_window_seconds(served)
    add_depth(served)
    add_cfg_mode(served, "off")
    served.add_argument(
        "--rounds", type=int, default=6, help="rounds of velocity_scale turned on every session at once (default 6)"
    )
    served.add_argument("--interval-s", type=float, default=3.0, help="between the rounds' starts (s, default 3)")
    served.add_argument(
        "--kill-replica",
        action="store_true",
        help="then kill the replica holding the most sessions (Ray Serve only; joins the server's Ray cluster): its "
        "sessions' lost events, the others' gaps, and their re-creates",
    )
    served.add_argument(
        "--address",
        default="auto",
        help="with --kill-replica: the Ray cluster the server runs on ('auto', the default: the one on this machine)",
    )
    served.add_argument(
        "--recreate-timeout-s",
        type=float,
        default=120.0,
        help="how long re-creates refused with 503 are tried again (s, default 120)",
    )
    served.add_argument("--json", type=Path, help="also write every figure to this JSON file")

    soak = targets.add_parser("soak", help="play for N minutes under a knob storm and prompt swaps")
    soak.add_argument("--minutes", type=float, default=2.0, help="how long to play")
    soak.add_argument(
        "--strict",
        action="store_true",
        help="gaps and late blocks fail the run too (a GPU soak); without it only runner errors and capture failures do",
    )
    add_stream(soak, song_seconds=10.0, cfg="off")
    add_model_arguments(soak)

    sync = targets.add_parser(
        "sync", help="follow a band's clock on a JACK dummy server: bar-start phase error of the played clicks"
    )
    sync.add_argument("--clock", choices=("jack", "midi", "link"), default="jack", help="the band's clock")
    add_bpm(sync, "the band's (default 120)", default=120.0)
    add_time_signature(sync, "4")
    sync.add_argument("--bars", type=int, default=2, help="flowjam's loop in bars")
    sync.add_argument("--minutes", type=float, default=5.0, help="how long the band plays")
    sync.add_argument("--period", type=int, default=512, help="JACK's period (frames), flowjam's output block too")
    sync.add_argument("--tempo-change", type=float, help="half-way, the band moves to this tempo at a bar line")
    add_model_arguments(sync)

    plugin = targets.add_parser(
        "plugin", help="the DAW plugin's LV2 in jalv beside a generating engine: time per block, xruns, gaps"
    )
    plugin.add_argument("--minutes", type=float, default=10.0, help="how long the transport rolls")
    plugin.add_argument("--period", type=int, default=512, help="JACK's period (frames): the host's block")
    add_bpm(plugin, "the timebase master's (default 123)", default=123.0)
    plugin.add_argument("--bars", type=int, default=4, help="the engine's loop in bars")
    add_model_arguments(plugin)

    kernels = targets.add_parser(
        "kernels", help="each fused kernel's paths side by side at a preset's layer shapes (Hopper GPU, Triton)"
    )
    add_song_seconds(kernels, [10.0, 20.0, 60.0], multiple=True, help="the loop lengths whose token counts to time (s)")
    kernels.add_argument("--batch", type=int, default=8, help="batch rows (depth x CFG)")
    add_preset(kernels, "turbo-2b")
    add_device(kernels, "cuda")

    lm = targets.add_parser("lm", help="5 Hz LM code generation: ms/step and codes/s vs transformers' generate")
    add_lm_preset(lm, "lm-1.7b")
    lm.add_argument("--batch", type=int, default=8, help="sequences generated together")
    lm.add_argument("--lm-cfg", type=float, default=2.0, help="LM guidance (1 = no unconditional rows)")
    lm.add_argument("--tokens", type=int, default=300, help="codes per sequence (300 = 60 s)")
    lm.add_argument("--repeats", type=int, default=3)
    lm.add_argument("--no-baseline", action="store_true", help="skip transformers' generate")
    lm.add_argument("--compile", action="store_true", help="also time the torch.compile'd layer step (CUDA)")
    lm.add_argument(
        "--profile", action="store_true", help="print the kernels of one generate call per decode step (GPU)"
    )
    add_device(lm, "cuda")
    add_dtype(lm, "bfloat16")
    return parser


def add_random_model(parser: argparse.ArgumentParser, preset: str = "turbo-2b") -> None:
    """A preset with random weights (none to load) on --device in --dtype."""
    add_preset(parser, preset)
    add_device(parser)
    add_dtype(parser)


def add_ring(
    parser: argparse.ArgumentParser, song_seconds_help: str, cfg: str, ticks: int, multiple: bool = False
) -> None:
    """The ring a tick bench builds: song length, depth, steps, guidance, backend, and how many ticks it times."""
    add_song_seconds(parser, [60.0] if multiple else 60.0, multiple=multiple, help=song_seconds_help)
    add_depth(parser, multiple=multiple)
    add_steps(parser)
    add_cfg_mode(parser, cfg, multiple=multiple)
    parser.add_argument("--ticks", type=int, default=ticks, help="measured ticks (after warm-up)")
    add_backend(parser, multiple=multiple)


def add_stream(parser: argparse.ArgumentParser, song_seconds: float, cfg: str) -> None:
    """The live stream a latency, sessions or soak bench plays: depth, song length, guidance, backend."""
    add_depth(parser)
    add_song_seconds(parser, song_seconds, help="loop latent length (s)")
    add_window_seconds(parser)
    parser.add_argument("--endless", action="store_true", help="no loop: an endless song (needs a window)")
    add_cfg_mode(parser, cfg)
    add_backend(parser)


def run(args: argparse.Namespace) -> int:
    check_bench_args(args)
    if "device" in args:  # `served` measures a server elsewhere: no device here
        check_device(args.device)
    return TARGETS[args.target](args)


def check_bench_args(args: argparse.Namespace) -> None:
    """Refuse, before any model is built, the values a bench would fail on (or measure nothing with) only after."""
    for seconds in flag_values(args, "song_seconds"):
        song_frames(seconds, "--song-seconds")
    if getattr(args, "window_seconds", None) is not None:
        check_window(args.window_seconds, getattr(args, "endless", False))
    for depth in flag_values(args, "depth"):
        check_knob_flag("depth", depth)
    for steps in flag_values(args, "steps"):
        check_range("--steps", steps, 1, MAX_STEPS)
    for name in COUNTS:
        for count in flag_values(args, name):
            if count < 1:
                raise CommandError(f"--{name.replace('_', '-')} {count} must be 1 or more")
    for name in AMOUNTS:
        for amount in flag_values(args, name):
            check_positive(f"--{name.replace('_', '-')}", amount)


def flag_values(args: argparse.Namespace, name: str) -> list:
    """The values a flag holds in this bench target: none, one, or the list of a flag given several."""
    value = getattr(args, name, None)
    return [] if value is None else value if isinstance(value, list) else [value]

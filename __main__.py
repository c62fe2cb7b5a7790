"""`python -m flowjam ...`: the command line. Heavy imports happen inside the commands, so --help is instant."""

from __future__ import annotations

import argparse
import math
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .cli import serve as serve_commands
from .engine.params import BACKENDS, CFG_MODES, LORA_MODES, PRECISIONS, parse_lora_option
from .live.midi import MIDI_BACKENDS

if TYPE_CHECKING:
    from .live.app import LiveConfig

DTYPES = ("float32", "bfloat16")


class CommandError(Exception):
    """A refusal whose message is the whole story (bad input, a missing device): one line on stderr, exit 2."""


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset",
        default="tiny",
        help="network preset when no --checkpoint is given: tiny (default, no files), turbo-2b, xl (random weights)",
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        help="local weights: official ACE-Step 1.5 folder, ComfyUI models/ folder or file, or a flowjam .safetensors",
    )
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument(
        "--precision",
        default="bf16",
        choices=PRECISIONS,
        help="fp8: the DiT's per-tick linear layers in FP8 (Ada/Hopper GPUs, with --dtype bfloat16)",
    )


def add_lora_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lora",
        action="append",
        metavar="PATH[:STRENGTH]",
        help="a LoRA for the DiT (PEFT folder or .safetensors), strength 0..2 (default 1); repeatable. Live, its "
        "strength is the knob lora/<file name>",
    )
    parser.add_argument(
        "--lora-mode",
        default="auto",
        choices=LORA_MODES,
        help="how every --lora applies: live (low-rank GEMMs each tick), folded (into the weights on the tick after "
        "a strength change: merged speed, a copy of the layers' weights), merged (fixed strength), auto (folded on "
        "a GPU, else live)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flowjam", description="flowjam: play ACE-Step 1.5 in real time (ComfyUI nodes, OSC, MIDI)"
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    render = commands.add_parser("render", help="generate one piece offline and write a 48 kHz stereo WAV")
    render.add_argument("--prompt", required=True, help="caption / tags describing the music")
    add_lora_argument(render)
    render.add_argument(
        "--lyrics", default="", help="lyrics text, or @file.txt to read them from a file (default: instrumental)"
    )
    render.add_argument("--seconds", type=float, default=10.0, help="length of the output in seconds (> 0)")
    render.add_argument("--out", type=Path, default=Path("flowjam.wav"), help="output WAV path")
    render.add_argument("--cover", type=Path, help="source WAV to cover (keeps its structure)")
    render.add_argument("--seed", type=int, default=0)
    render.add_argument("--steps", type=int, default=8, help="denoising steps (turbo: 8)")
    render.add_argument("--shift", type=float, default=3.0, help="timestep shift (turbo: 3)")
    render.add_argument("--denoise", type=float, default=1.0, help="1 = from noise; below 1 keeps that much of --cover")
    render.add_argument("--bpm", type=int)
    render.add_argument("--key", help="key scale, e.g. 'G major', 'F# minor'")
    render.add_argument("--time-signature", help="2, 3, 4 or 6 (or 4/4 style)")
    render.add_argument("--language", default="unknown", help="lyrics language code (en, zh, ja, ...)")
    render.add_argument(
        "--lm", action="store_true", help="let the 5 Hz LM write the song structure (audio codes) first"
    )
    render.add_argument(
        "--lm-checkpoint",
        type=Path,
        help="LM weights: acestep-5Hz-lm-* folder, ComfyUI qwen_{1.7b,4b}_ace15 file or models/ folder",
    )
    render.add_argument(
        "--lm-preset",
        default="tiny",
        help="LM preset when no --lm-checkpoint: tiny (default), lm-0.6b, lm-1.7b, lm-4b (random weights)",
    )
    render.add_argument("--lm-cfg", type=float, default=2.0, help="LM guidance (>= 1; 1 = off)")
    render.add_argument("--lm-temperature", type=float, default=0.85, help="LM sampling temperature (0 = greedy)")
    render.add_argument("--lm-top-p", type=float, default=0.9, help="LM nucleus sampling mass (1 = off)")
    render.add_argument("--lm-top-k", type=int, default=0, help="LM top-k (0 = off)")
    add_model_arguments(render)

    bench = commands.add_parser("bench", help="benchmarks that print numbers")
    targets = bench.add_subparsers(dest="target", metavar="TARGET", required=True)
    dit = targets.add_parser("dit", help="time one batched DiT forward at several window lengths")
    dit.add_argument("--preset", default="tiny")
    dit.add_argument("--seconds", type=float, nargs="+", default=[10.0, 20.0, 60.0])
    dit.add_argument("--batch", type=int, default=1, help="rows per forward (depth x CFG)")
    dit.add_argument("--repeats", type=int, default=5)
    dit.add_argument("--device", default="cpu")
    dit.add_argument("--dtype", default="float32", choices=DTYPES)

    tick = targets.add_parser("tick", help="steady-state StreamPipeline ticks at real shapes (random weights)")
    tick.add_argument("--preset", default="turbo-2b")
    tick.add_argument("--seconds", type=float, default=60.0, help="song latent length")
    tick.add_argument("--depth", type=int, nargs="+", default=[4])
    tick.add_argument("--steps", type=int, default=8)
    tick.add_argument("--cfg", nargs="+", default=["off"], choices=CFG_MODES)
    tick.add_argument("--ticks", type=int, default=48, help="measured ticks (after warm-up)")
    tick.add_argument("--backend", nargs="+", default=["eager"], choices=BACKENDS)
    tick.add_argument("--profile", action="store_true", help="print a torch.profiler summary of 8 ticks per run")
    tick.add_argument(
        "--precision", nargs="+", default=["bf16"], choices=PRECISIONS, help="fp8 also prints its error vs bf16"
    )
    tick.add_argument("--device", default="cpu")
    tick.add_argument("--dtype", default="float32", choices=DTYPES)

    ring = targets.add_parser("ring", help="several sessions (lanes) in one ring: ticks against the bound, real time")
    ring.add_argument("--preset", default="turbo-2b")
    ring.add_argument("--seconds", type=float, default=60.0, help="loop latent length")
    ring.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4])
    ring.add_argument("--depth", type=int, default=4)
    ring.add_argument("--steps", type=int, default=8)
    ring.add_argument("--cfg", default="full", choices=CFG_MODES)
    ring.add_argument("--ticks", type=int, default=32, help="measured ticks (after warm-up)")
    ring.add_argument("--backend", default="eager", choices=BACKENDS)
    ring.add_argument("--device", default="cpu")
    ring.add_argument("--dtype", default="float32", choices=DTYPES)

    lora = targets.add_parser("lora", help="tick cost of LoRAs (live, folded, merged) and what a strength change costs")
    lora.add_argument("--preset", default="turbo-2b")
    lora.add_argument("--seconds", type=float, default=60.0, help="song latent length")
    lora.add_argument("--loras", type=int, default=2, help="random LoRAs on every attention and MLP projection")
    lora.add_argument("--rank", type=int, default=64)
    lora.add_argument("--depth", type=int, default=4)
    lora.add_argument("--steps", type=int, default=8)
    lora.add_argument("--cfg", default="full", choices=CFG_MODES)
    lora.add_argument("--ticks", type=int, default=48, help="measured ticks (after warm-up)")
    lora.add_argument("--backend", default="eager", choices=BACKENDS)
    lora.add_argument("--profile", action="store_true", help="print a torch.profiler summary of the unmerged ticks")
    lora.add_argument("--device", default="cpu")
    lora.add_argument("--dtype", default="float32", choices=DTYPES)

    decode = targets.add_parser("decode", help="windowed VAE decodes: plain against CUDA-graph replays")
    decode.add_argument("--preset", default="turbo-2b")
    decode.add_argument("--window", type=float, nargs="+", default=[0.1, 0.2, 0.4, 1.6], help="window seconds")
    decode.add_argument("--repeats", type=int, default=20)
    decode.add_argument("--device", default="cpu")
    decode.add_argument("--dtype", default="float32", choices=DTYPES)

    latency = targets.add_parser(
        "latency", help="knob -> first changed tick and knob -> ear, shared vs per-request knob"
    )
    latency.add_argument("--trials", type=int, default=12)
    latency.add_argument("--depth", type=int, default=4)
    latency.add_argument("--song-seconds", type=float, default=10.0)
    latency.add_argument("--backend", default="eager", choices=BACKENDS)
    latency.add_argument(
        "--cfg", default="off", choices=CFG_MODES, help="cfg_mode of the stream (full: negative rows every step)"
    )
    add_model_arguments(latency)
    sessions = targets.add_parser(
        "sessions", help="live sessions on one host: real time (latent interval) and knob -> ear per session"
    )
    sessions.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 3])
    sessions.add_argument("--trials", type=int, default=8)
    sessions.add_argument("--depth", type=int, default=4)
    sessions.add_argument("--song-seconds", type=float, default=60.0)
    sessions.add_argument("--cfg", default="full", choices=CFG_MODES)
    sessions.add_argument("--backend", default="eager", choices=BACKENDS)
    sessions.add_argument(
        "--interval-ms", type=float, default=250.0, help="a fresh latent per session at least this often"
    )
    sessions.add_argument("--ear-ms", type=float, default=150.0, help="knob -> ear target (p95 of the shared knob)")
    sessions.add_argument(
        "--gpus", type=int, default=1, help="run the same bench on GPUs 0..N-1 at once, one process (host) each"
    )
    sessions.add_argument(
        "--lora-rank",
        type=int,
        help="attach a random live LoRA of this rank on every attention and MLP projection; each session plays it "
        "at its own strength (0.5, 0.6, ...)",
    )
    add_model_arguments(sessions)
    soak = targets.add_parser("soak", help="play for N minutes under a knob storm and prompt swaps")
    soak.add_argument("--minutes", type=float, default=2.0)
    soak.add_argument("--depth", type=int, default=4)
    soak.add_argument("--song-seconds", type=float, default=10.0)
    soak.add_argument("--cfg", default="off", choices=CFG_MODES, help="cfg_mode of the stream")
    soak.add_argument("--backend", default="eager", choices=BACKENDS)
    add_model_arguments(soak)

    lm = targets.add_parser("lm", help="5 Hz LM code generation: ms/step and codes/s vs transformers' generate")
    lm.add_argument("--preset", default="lm-1.7b", help="tiny, lm-0.6b, lm-1.7b or lm-4b (random weights)")
    lm.add_argument("--batch", type=int, default=8, help="sequences generated together")
    lm.add_argument("--cfg", type=float, default=2.0, help="LM guidance (1 = no unconditional rows)")
    lm.add_argument("--tokens", type=int, default=300, help="codes per sequence (300 = 60 s)")
    lm.add_argument("--repeats", type=int, default=3)
    lm.add_argument("--no-baseline", action="store_true", help="skip transformers' generate")
    lm.add_argument("--compile", action="store_true", help="also time the torch.compile'd layer step (CUDA)")
    lm.add_argument("--device", default="cuda")
    lm.add_argument("--dtype", default="bfloat16", choices=DTYPES)

    demo = commands.add_parser("demo", help="stream N seconds on the tiny preset with a scripted knob sweep -> WAV")
    demo.add_argument("--seconds", type=float, default=12.0)
    demo.add_argument("--out", type=Path, default=Path("flowjam-demo-stream.wav"))
    demo.add_argument("--depth", type=int, default=4)
    demo.add_argument("--seed", type=int, default=42)
    demo.add_argument("--quiet", action="store_true", help="no per-tick lines")
    add_model_arguments(demo)

    live = commands.add_parser("live", help="play the stream: audio out, OSC and MIDI control, live status line")
    live.add_argument("--prompt", default="ambient pads, slow evolving synth", help="caption (prompt A)")
    live.add_argument("--prompt-b", help="second caption; the prompt_blend knob morphs A -> B")
    live.add_argument("--negative", help="negative prompt that CFG guides away from (default: the null condition)")
    add_lora_argument(live)
    live.add_argument(
        "--cfg-mode",
        choices=CFG_MODES,
        help="guidance rows: off (default: turbo is CFG-distilled), full, initialize, self",
    )
    live.add_argument("--source", type=Path, help="source WAV to cover in a loop (sets the loop length)")
    live.add_argument("--song-seconds", type=float, default=30.0, help="loop length for text-only sessions")
    live.add_argument("--seconds", type=float, help="stop cleanly after this many seconds (default: run until Ctrl-C)")
    live.add_argument("--depth", type=int, help="in-flight generations (1..8; default 4)")
    live.add_argument("--steps", type=int, help="denoising steps per generation (default 8)")
    live.add_argument("--backend", default="eager", choices=BACKENDS)
    live.add_argument("--audio-device", help="output device name or index (see --list-devices)")
    live.add_argument("--list-devices", action="store_true", help="print audio output devices and exit")
    live.add_argument("--no-audio", action="store_true", help="no sound card: advance in real time and only record")
    live.add_argument(
        "--playback", default="process", choices=("process", "thread"), help="where the audio callback runs"
    )
    live.add_argument("--record", type=Path, help="write exactly what was played to this WAV")
    live.add_argument("--session", default="default", help="OSC session name in /flowjam/<session>/...")
    live.add_argument("--osc-port", type=int, default=9000, help="UDP port for OSC control (0: none)")
    live.add_argument("--osc-host", help="address to bind (default 127.0.0.1); anything but loopback must be asked for")
    live.add_argument("--osc-feedback", help="HOST:PORT that receives applied values (TouchOSC faders follow)")
    live.add_argument("--osc-allow", help="comma-separated hosts allowed to send OSC when binding beyond loopback")
    live.add_argument("--midi-port", help="MIDI input port name (pip install 'flowjam[midi]')")
    live.add_argument("--midi-map", type=Path, help="JSON CC mapping file: loaded if it exists, saved on exit")
    live.add_argument(
        "--midi-backend",
        choices=tuple(MIDI_BACKENDS),
        help="MIDI system: alsa (Linux ALSA sequencer) or jack (a running JACK server); default: mido's "
        "($MIDO_BACKEND, else the platform's own: ALSA on Linux)",
    )
    live.add_argument(
        "--lm", action="store_true", help="text-only: the 5 Hz LM writes the loop's structure from --prompt at start"
    )
    live.add_argument("--lm-checkpoint", type=Path, help="LM weights (see render --lm-checkpoint)")
    live.add_argument("--lm-preset", default="tiny", help="LM preset when no --lm-checkpoint (default tiny)")
    live.add_argument(
        "--midi-learn",
        help="comma-separated knobs to MIDI-learn in order: move one control for each, and let it go (0.5 s) before "
        "moving the next",
    )
    add_model_arguments(live)

    info = commands.add_parser("info", help="parameter counts of a preset's networks (no weights needed)")
    info.add_argument("--preset", default="turbo-2b")
    serve_commands.add_commands(commands)
    return parser


class ProgressBar:
    """A one-line terminal progress bar on stderr."""

    def __init__(self, label: str, width: int = 30):
        self.label, self.width, self.start = label, width, time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        filled = round(self.width * done / total)
        elapsed = time.perf_counter() - self.start
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} {elapsed:5.1f}s")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def run_render(args: argparse.Namespace) -> int:
    from .engine.outputs import check_output_path
    from .engine.params import song_frames

    song_frames(args.seconds, "--seconds")  # torch-free checks first: a typo is refused at once
    check_output_path(args.out, "--out")
    lyrics = read_lyrics(args.lyrics)

    from .engine.lm.sampling import SamplingParams
    from .engine.render import RenderRequest, render

    request = RenderRequest(
        prompt=args.prompt,
        seconds=args.seconds,
        out=args.out,
        lyrics=lyrics,
        cover=args.cover,
        seed=args.seed,
        steps=args.steps,
        shift=args.shift,
        denoise=args.denoise,
        bpm=args.bpm,
        key=args.key,
        time_signature=args.time_signature,
        language=args.language,
        lm=args.lm,
        lm_checkpoint=args.lm_checkpoint,
        lm_preset=args.lm_preset,
        lm_sampling=SamplingParams(
            temperature=args.lm_temperature, top_k=args.lm_top_k, top_p=args.lm_top_p, cfg=args.lm_cfg
        ),
    )
    request.validate()  # --out, --cover and the lengths are checked before the model loads
    session = load_session(args)
    path = render(session, request, on_step=ProgressBar("denoise"))
    print(f"wrote {path} ({args.seconds:g} s, 48 kHz stereo, seed {args.seed}, {session.models.source})")
    return 0


def read_lyrics(text: str) -> str:
    """--lyrics: the text itself, or `@file.txt` for a UTF-8 text file's contents."""
    if not text.startswith("@"):
        return text
    path = Path(text[1:]).expanduser()
    if path.is_dir():
        raise CommandError(f"--lyrics {text}: {path} is a folder; give a text file, e.g. --lyrics @lyrics.txt")
    if not path.is_file():
        raise CommandError(f"--lyrics {text}: no such file {path}; give a text file, or the lyrics themselves")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise CommandError(f"--lyrics {text}: {path} is not UTF-8 text; save it as UTF-8") from None


def check_device(name: str) -> None:
    """Refuse a device torch does not know or cannot use here, before anything loads onto it."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise CommandError(f"unknown --device {name!r}; use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise CommandError(f"--device {name}: MPS (Apple GPU) is not available here; use --device cpu")
        return
    if device.type != "cuda":
        raise CommandError(f"--device {name}: flowjam runs on cpu, cuda or mps; use --device cpu")
    if not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise CommandError(f"--device {name}: {why}; use --device cpu")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise CommandError(
            f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) are visible; use --device cuda:0"
        )


def load_session(args: argparse.Namespace):
    import torch

    from .engine.session import Session

    check_device(args.device)
    if args.precision == "fp8":
        from .engine.models.fp8 import check_fp8_device

        try:
            check_fp8_device(torch.device(args.device))
        except ValueError as error:
            raise CommandError(f"--precision: {error}") from None
    session = Session.load(
        args.checkpoint,
        preset=args.preset,
        device=args.device,
        dtype=getattr(torch, args.dtype),
        precision=args.precision,
    )
    for spec in getattr(args, "lora", None) or ():
        path, strength = parse_lora_option(spec)
        try:
            session.load_lora(path, strength, mode=args.lora_mode)
        except (ValueError, FileNotFoundError) as error:
            raise CommandError(f"--lora {spec}: {error}") from None
    return session


def run_bench(args: argparse.Namespace) -> int:
    benches = {"dit": bench_dit, "tick": bench_tick, "decode": bench_decode, "lm": bench_lm, "lora": bench_lora}
    benches["ring"] = bench_ring
    benches["sessions"] = bench_sessions
    return {**benches, "latency": bench_latency, "soak": bench_soak}[args.target](args)


def bench_decode(args: argparse.Namespace) -> int:
    import torch

    from .engine.bench.ticks import bench_decode as measure

    check_device(args.device)
    device_name = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    print(f"windowed VAE decode: preset {args.preset}, {args.dtype}, {device_name}, torch {torch.__version__}")
    print("| window s | plain ms | graph ms | audio ms per ms |")
    print("|---|---|---|---|")
    for r in measure(args.preset, args.window, args.device, getattr(torch, args.dtype), args.repeats):
        print(f"| {r.window_s:g} | {r.plain_ms:.2f} | {r.graph_ms:.2f} | {r.audio_ms_per_ms:.0f} |")
    return 0


def bench_lm(args: argparse.Namespace) -> int:
    import torch

    from .engine.bench.lm import run_lm_bench

    run_lm_bench(
        args.preset,
        args.batch,
        args.cfg,
        args.tokens,
        args.device,
        getattr(torch, args.dtype),
        args.repeats,
        not args.no_baseline,
        args.compile,
    )
    return 0


RUNNER_TIMINGS = ("tick_ms", "loop_ms", "decode_ms", "interval_ms", "write_ms", "lead_s", "window_s")


def bench_latency(args: argparse.Namespace) -> int:
    from .live.bench import measure_latency

    session = load_session(args)
    session.backend = args.backend
    print(
        f"knob latency: preset {args.preset}, backend {args.backend}, precision {args.precision}, depth {args.depth}, cfg {args.cfg}, 8 steps, {args.song_seconds:g} s loop, {args.trials} trials per knob, no audio device (real-time clock)"
    )
    print(
        f"{'knob':>16} {'kind':>8} {'knob->tick ms (median / p95)':>30} {'knob->written ms':>17} "
        f"{'knob->ear ms (median / p95)':>30} {'first touch ->ear ms':>21}"
    )
    summaries, status = measure_latency(session, args.trials, args.song_seconds, args.depth, cfg_mode=args.cfg)
    for s in summaries:
        print(
            f"{s.knob:>16} {s.kind:>8} {s.tick_ms_median:17.1f} / {s.tick_ms_p95:8.1f} {s.written_ms_median:17.1f} "
            f"{s.ear_ms_median:17.1f} / {s.ear_ms_p95:8.1f} {s.first_touch_ear_ms:21.1f}"
        )
    print("runner at the end: " + ", ".join(f"{key} {status[key]}" for key in RUNNER_TIMINGS))
    return 0


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

    from .serve.bench import measure_sessions
    from .serve.host import RingHost

    session = load_session(args)
    session.backend = args.backend
    device = torch.cuda.get_device_name(session.device) if session.device.type == "cuda" else "cpu"
    print(
        f"Live sessions on one host: preset {args.preset}, {args.song_seconds:g} s loops, depth {args.depth}, cfg "
        f"{args.cfg}, {args.backend}, {args.dtype}, {device}, torch {torch.__version__}; every session's knob turned "
        f"at once, {args.trials} trials; real time: a latent every <= {args.interval_ms:g} ms and a shared knob heard "
        f"within {args.ear_ms:g} ms (p95)"
    )
    lora = None
    if args.lora_rank:
        from .engine.bench.ticks import random_lora
        from .engine.lora import lora_set

        decoder = session.models.acestep.decoder
        lora = "bench"
        lora_set(decoder).attach(random_lora(decoder, lora, args.lora_rank, seed=0), 1.0, "live")
        print(f"  a live LoRA of rank {args.lora_rank}, each session at its own strength")
    host = RingHost(session, latent_interval_ms=args.interval_ms)  # one host: admission learns from every count
    try:
        for count in args.sessions:
            r = measure_sessions(host, count, args.song_seconds, args.depth, args.cfg, args.trials, lora)
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
    from .serve.bench import SETTLE_TIMEOUT_S

    def settled(seconds: float | None) -> str:
        return f"not within {SETTLE_TIMEOUT_S:g} s" if seconds is None else f"{seconds:.1f} s"

    verdict = "REAL TIME" if r.realtime(args.interval_ms, args.ear_ms) else "not real time"
    p = r.phases
    print(
        f"  {count} asked, {r.sessions} playing: tick {r.ring_tick_ms:.1f} ms, a latent every "
        f"{r.latent_interval_ms:.0f} ms (slowest session: {r.cycles_per_latent:.2f} ring cycles of "
        f"{r.latent_interval_ms / r.cycles_per_latent:.1f} ms; {r.restarting_interval_ms:.0f} ms while a per-request "
        f"knob restarts the slots), {r.errors} errors -> {verdict}\n"
        f"    tick graphs settled {settled(r.settle_s)} after the sessions started\n"
        f"    ring cycle {p.cycle_ms:.1f} ms: runners {p.runners_ms:.1f} + tick {p.tick_ms:.1f} + hand-out "
        f"{p.handout_ms:.1f} + other {p.cycle_ms - p.runners_ms - p.tick_ms - p.handout_ms:.1f} ms"
    )
    for s, touch_settle_s in zip(r.knobs, r.touch_settle_s):
        print(
            f"    {s.knob:>15} ({s.kind}): knob -> tick {s.tick_ms_median:.1f} / {s.tick_ms_p95:.1f} ms, -> ear "
            f"{s.ear_ms_median:.1f} / {s.ear_ms_p95:.1f} ms (median / p95; first touch {s.first_touch_ear_ms:.1f}, "
            f"graphs settled {settled(touch_settle_s)} after it)"
        )
    if r.refused:
        print(f"    refused: {r.refused}")


def bench_soak(args: argparse.Namespace) -> int:
    from .live.bench import soak

    session = load_session(args)
    session.backend = args.backend
    r = soak(session, args.minutes, args.song_seconds, args.depth, cfg_mode=args.cfg, report=print)
    print(
        f"soak {r.minutes:g} min: {r.ticks} ticks, {r.knob_sets} knob sets, {r.prompt_swaps} prompt swaps, {r.errors} runner errors"
    )
    print(f"  RSS {r.rss_start_mb:.1f} -> {r.rss_end_mb:.1f} MB ({r.rss_end_mb - r.rss_start_mb:+.1f} MB)")
    print(
        f"  tick ms median: first {r.tick_ms_first:.2f}, last {r.tick_ms_last:.2f} (drift {r.tick_ms_last - r.tick_ms_first:+.2f})"
    )
    if r.gpu_mb is not None:
        print(f"  GPU memory allocated {r.gpu_mb[0]:.1f} -> {r.gpu_mb[1]:.1f} MB, peak {r.gpu_mb[2]:.1f} MB")
    print(f"  underruns {r.underruns} (and {r.start_underruns} while starting, before the storm)")
    print("  runner at the end: " + ", ".join(f"{key} {r.status[key]}" for key in RUNNER_TIMINGS))
    for which in ("tick_graphs", "window_graphs"):
        if r.status[which] is not None:
            print(
                f"  {which.replace('_', ' ')}: " + ", ".join(f"{key} {value}" for key, value in r.status[which].items())
            )
    return 0 if r.errors == 0 else 1


def bench_tick(args: argparse.Namespace) -> int:
    import torch

    from .engine.bench.ticks import TickFixture
    from .engine.bench.ticks import bench_tick as measure

    device_name = (
        torch.cuda.get_device_name(args.device)
        if args.device.startswith("cuda")
        else f"cpu ({torch.get_num_threads()} threads)"
    )
    print(
        f"StreamPipeline ticks: preset {args.preset}, {args.seconds:g} s song, {args.steps} steps, {args.dtype}, "
        f"{device_name}, torch {torch.__version__}"
    )
    fixture = TickFixture.build(args.preset, args.seconds, args.device, getattr(torch, args.dtype))
    print(f"  measured GEMM peak {fixture.gemm_tflops:.1f} TFLOP/s")
    reports = []
    for precision in args.precision:
        if precision == "fp8":
            error = fixture.to_fp8(args.steps)
            print(
                f"  fp8 vs bf16: velocity relative error {error.velocity:.4f} (one forward, 8 rows), finished "
                f"{args.steps}-step latent {error.latent:.4f} (relative L2)"
            )
        for depth, cfg, backend in ((d, c, b) for d in args.depth for c in args.cfg for b in args.backend):
            r = measure(fixture, depth, args.steps, cfg, ticks=args.ticks, backend=backend, profile=args.profile)
            reports.append(r)
            print(
                f"  depth {depth} cfg {cfg:10s} {backend:13s} {precision} {r.rows_per_tick:5.2f} rows  "
                f"{r.median_ms:7.2f} ms/tick (p95 {r.p95_ms:.2f}, free-running {r.free_ms:.2f}, host "
                f"{r.host_ms:.2f})  bound {r.bound_ms:.2f} ms = {r.median_ms / r.bound_ms:.2f}x  "
                f"warm-up {r.warmup_s:.1f} s  {r.audio_s_per_s:.0f} audio s/s"
            )
            if r.graphs:
                print(f"    graphs {r.graphs}")
            if r.profile:
                print("    " + r.profile.replace("\n", "\n    "))
    print(
        "\n| depth | cfg | rows | backend | precision | ms/tick (p95) | free-running | host ms | bound ms | / bound |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in reports:
        print(
            f"| {r.depth} | {r.cfg} | {r.rows_per_tick:.2f} | {r.backend} | {r.precision} | {r.median_ms:.2f} ({r.p95_ms:.2f}) | "
            f"{r.free_ms:.2f} | {r.host_ms:.2f} | {r.bound_ms:.2f} | {r.median_ms / r.bound_ms:.2f}x |"
        )
    return 0


def bench_ring(args: argparse.Namespace) -> int:
    import torch

    from .engine.bench.ticks import TickFixture
    from .engine.bench.ticks import bench_ring as measure

    device = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
    print(
        f"Sessions in one ring: preset {args.preset}, {args.seconds:g} s loops, depth {args.depth}, {args.steps} steps, "
        f"cfg {args.cfg}, {args.backend}, {args.dtype}, {device}, torch {torch.__version__}"
    )
    fixture = TickFixture.build(args.preset, args.seconds, args.device, getattr(torch, args.dtype))
    print(f"  measured GEMM peak {fixture.gemm_tflops:.1f} TFLOP/s; real time: a fresh latent every <= 250 ms each")
    for sessions in args.sessions:
        r = measure(fixture, sessions, args.depth, args.steps, args.cfg, args.backend, args.ticks)
        print(
            f"  {r.sessions:2d} sessions {r.rows:5.1f} rows  {r.median_ms:7.2f} ms/tick (p95 {r.p95_ms:.2f})  "
            f"{r.median_ms / r.bound_ms:4.2f}x bound ({r.bound_ms:.2f} ms)  latent every {r.latent_interval_ms:6.1f} ms "
            f"per session  {'real time' if r.realtime else 'NOT real time'}"
        )
    return 0


def bench_lora(args: argparse.Namespace) -> int:
    import torch

    from .engine.bench.ticks import TickFixture
    from .engine.bench.ticks import bench_lora as measure

    print(
        f"LoRA ticks: preset {args.preset}, {args.seconds:g} s song, {args.loras} LoRAs of rank {args.rank} on every "
        f"attention and MLP projection, depth {args.depth}, cfg {args.cfg}, {args.backend}, {args.dtype}, "
        f"{torch.cuda.get_device_name(args.device) if args.device.startswith('cuda') else 'cpu'}, torch {torch.__version__}"
    )
    fixture = TickFixture.build(args.preset, args.seconds, args.device, getattr(torch, args.dtype))
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


def bench_dit(args: argparse.Namespace) -> int:
    import torch

    from .engine.bench.ticks import time_dit_forward

    print(
        f"DiT forward, preset {args.preset}, batch {args.batch}, {args.dtype}, device {args.device}, torch threads {torch.get_num_threads()}"
    )
    print(f"{'window s':>9} {'frames':>7} {'median ms':>10} {'min ms':>8} {'max ms':>8}")
    for seconds in args.seconds:
        timing = time_dit_forward(
            args.preset, seconds, args.batch, args.device, getattr(torch, args.dtype), args.repeats
        )
        print(
            f"{timing.seconds:9.1f} {timing.frames:7d} {timing.median_ms:10.2f} {timing.min_ms:8.2f} {timing.max_ms:8.2f}"
        )
    return 0


def run_info(args: argparse.Namespace) -> int:
    from .engine.bench.ticks import parameter_census

    for name, count in parameter_census(args.preset).items():
        print(f"{name:>26}: {count:>15,}")
    return 0


def run_demo(args: argparse.Namespace) -> int:
    from .engine.demo import run_demo as perform
    from .engine.outputs import check_output_path

    check_output_path(args.out, "--out")
    session = load_session(args)

    def show(line) -> None:
        if not args.quiet:
            print(
                f"tick {line.tick:4d}  {line.tick_ms:7.1f} ms  playhead {line.playhead_s:5.2f} s  slots {line.active_slots}  rows {line.rows}"
                f"  denoise {line.denoise:.2f}  blend {line.blend:.2f}  velocity {line.velocity_scale:4s}  delivered {line.delivered}"
            )

    path, lines = perform(session, args.seconds, args.out, depth=args.depth, seed=args.seed, on_tick=show)
    times = sorted(line.tick_ms for line in lines)
    print(
        f"wrote {path}: {args.seconds:g} s from {len(lines)} ticks; tick ms median {times[len(times) // 2]:.1f}, max {times[-1]:.1f}"
    )
    return 0


def check_live_args(args: argparse.Namespace) -> None:
    """Refuse what would otherwise fail only after the model loads, or be silently clamped or ignored. The
    torch-free checks come first, so those mistakes are refused at once."""
    from .engine.params import KNOBS_BY_NAME, song_frames

    if args.seconds is not None and not (math.isfinite(args.seconds) and args.seconds > 0):
        raise CommandError(
            f"--seconds must be a finite number > 0 (leave it out to play until Ctrl-C), got {args.seconds:g}"
        )
    if args.source is None:
        song_frames(args.song_seconds, "--song-seconds")
    for name in ("depth", "steps"):
        value, spec = getattr(args, name), KNOBS_BY_NAME[name]
        if value is not None and not spec.minimum <= value <= spec.maximum:
            raise CommandError(f"--{name} {value} is outside {spec.minimum:g}..{spec.maximum:g} ({spec.description})")
    if not args.osc_port and (args.osc_host or args.osc_feedback or args.osc_allow):
        raise CommandError("--osc-host, --osc-feedback and --osc-allow need OSC, which --osc-port 0 turns off")

    from .engine.audio.files import check_wav
    from .engine.render import check_prompt

    check_prompt(args.prompt)
    if args.prompt_b is not None:
        check_prompt(args.prompt_b, "--prompt-b")
    if args.source is not None:
        check_wav(args.source)
    if args.record is not None:
        from .engine.outputs import check_output_path

        check_output_path(args.record, "--record")


class Stopped(Exception):
    """SIGTERM or SIGHUP: end the performance like Ctrl-C, so the recording is closed and renamed into place."""


def stop_on_signals() -> None:
    def stop(signal_number: int, frame) -> None:
        raise Stopped(signal.Signals(signal_number).name)

    for name in ("SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), stop)


def check_osc(config: LiveConfig) -> None:
    """Start the live config's OSC bridge once and stop it, so a busy port or a host that does not resolve is refused
    before the model loads rather than after; the live app binds the port again when it starts."""
    import logging

    from .live.knobs import KnobRegistry
    from .live.osc import OscBridge, OscConfig

    bridge = OscBridge(
        KnobRegistry(),
        OscConfig(
            session=config.session_name,
            host=config.osc_host,
            port=config.osc_port,
            feedback=config.osc_feedback,
            allow_hosts=config.osc_allow,
        ),
    )
    osc_log = logging.getLogger("flowjam.osc")
    level = osc_log.level
    osc_log.setLevel(logging.ERROR)  # its warnings (beyond loopback, small buffer) show once, when the app starts
    try:
        bridge.start()
    finally:
        osc_log.setLevel(level)
    bridge.stop()


def run_live(args: argparse.Namespace) -> int:
    if args.list_devices:
        from .live.playback import list_devices

        print(list_devices())
        return 0
    check_live_args(args)
    from .live.app import LiveApp, LiveConfig, parse_host_port
    from .live.knobs import KnobRegistry
    from .live.playback import PlaybackError
    from .live.runner import RunnerConfig

    registry = KnobRegistry()
    for name in ("depth", "steps", "cfg_mode"):
        if getattr(args, name) is not None:
            registry.set(name, getattr(args, name), origin="cli")
    config = LiveConfig(
        prompt=args.prompt,
        prompt_b=args.prompt_b,
        negative=args.negative,
        source=args.source,
        song_seconds=args.song_seconds,
        session_name=args.session,
        audio_device=args.audio_device,
        playback_mode=("null-process" if args.playback == "process" else "null") if args.no_audio else args.playback,
        record=args.record,
        osc_host=args.osc_host or LiveConfig.osc_host,
        osc_port=args.osc_port or None,
        osc_feedback=parse_host_port(args.osc_feedback) if args.osc_feedback else None,
        osc_allow=tuple(h.strip() for h in args.osc_allow.split(",")) if args.osc_allow else None,
        midi_port=args.midi_port,
        midi_map=args.midi_map,
        midi_learn=tuple(k.strip() for k in args.midi_learn.split(",")) if args.midi_learn else (),
        midi_backend=args.midi_backend,
        lm=args.lm,
        lm_checkpoint=args.lm_checkpoint,
        lm_preset=args.lm_preset,
        runner=RunnerConfig(backend=args.backend),
    )
    if config.osc_port is not None:
        check_osc(config)
    if config.uses_midi:
        from .live.midi import find_input_port

        find_input_port(config.midi_port, config.midi_backend)  # a wrong port or MIDI system fails before loading
    app = LiveApp(load_session(args), config, registry)
    interactive = sys.stderr.isatty()
    stop_on_signals()
    try:
        app.start()  # inside the try: whatever started before a failure (runner, audio process) is stopped
        started = time.monotonic()
        beats = 0
        while args.seconds is None or time.monotonic() - started < args.seconds:
            time.sleep(0.25)
            beats += 1
            if interactive:
                sys.stderr.write(f"\r{app.status_line()}")
            elif beats % 4 == 0:
                sys.stderr.write(f"{app.status_line()}\n")
            sys.stderr.flush()
    except (KeyboardInterrupt, Stopped):
        pass
    except PlaybackError as error:  # a named --audio-device that cannot be opened
        raise CommandError(str(error)) from error
    finally:
        app.stop()
    if interactive:
        sys.stderr.write("\n")
    recording = app.playback.recording
    if recording is not None:
        rate = app.buffer.sample_rate
        print(f"recorded {recording.path}: {recording.frames / rate:.2f} s ({recording.frames} frames played)")
    return 0


COMMANDS = {
    "render": run_render,
    "bench": run_bench,
    "info": run_info,
    "demo": run_demo,
    "live": run_live,
    **dict.fromkeys(("serve", "bridge", "listen"), serve_commands.run),
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return COMMANDS[args.command](args)
    except (CommandError, ValueError, OSError) as error:  # anything else is a bug: its traceback shows
        print(f"flowjam {args.command}: error: {one_line(error)}", file=sys.stderr)
        return 2


def one_line(error: Exception) -> str:
    """The message of a refusal on one line; an OSError as its reason and the file it concerns."""
    if isinstance(error, OSError) and error.strerror:
        text = f"{error.strerror}: {error.filename}" if error.filename else error.strerror
    else:
        text = str(error)
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())

"""The flags several commands share, each defined once and meaning one thing in every command, and what the commands
share beyond flags: `CommandError` (a refusal: one line on stderr, exit 2), `check_device`, `load_session`.

One name, one meaning: --seconds is always a duration (how long the output is, or how long the command runs);
--song-seconds is always the length of the song or loop latent that is generated; --device is always a torch device
and --audio-device always a sound card. Torch is imported inside the functions that need it, so --help stays instant.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from ..engine.params import (
    BACKENDS,
    CFG_MODES,
    DEFAULT_PRECISION,
    DEFAULT_STEPS,
    DTYPES,
    KNOBS_BY_NAME,
    LM_PRESET_NAMES,
    LORA_MODES,
    MAX_STEPS,
    PRECISIONS,
    PRESET_NAMES,
    parse_lora_option,
)
from ..engine.prompts import BPM_RANGE

DEFAULT_DEPTH = int(KNOBS_BY_NAME["depth"].default)
TOKEN_ENV = "FLOWJAM_TOKEN"  # a served session's token, when not in a --token-file


class CommandError(Exception):
    """A refusal whose message is the whole story (bad input, a missing device): one line on stderr, exit 2."""


def one_line(error: Exception) -> str:
    """The message of a refusal on one line; an OSError as its reason and the file it concerns."""
    if isinstance(error, OSError) and error.strerror:
        text = f"{error.strerror}: {error.filename}" if error.filename else error.strerror
    else:
        text = str(error)
    return " ".join(text.split())


def check_range(option: str, value: float, low: float, high: float, note: str = "") -> None:
    """Refuse a flag's value outside low..high (NaN too) with one line naming the range; torch-free, so a command
    runs it before anything loads."""
    if not low <= value <= high:
        raise CommandError(f"{option} {value:g} is outside {low:g}..{high:g}{note}")


def check_positive(option: str, value: float, note: str = "") -> None:
    """Refuse a flag's amount (a duration, a window) that is not a finite number above 0."""
    if not (math.isfinite(value) and value > 0):
        raise CommandError(f"{option} must be a finite number > 0{note}, got {value:g}")


def check_knob_flag(name: str, value: float | None) -> None:
    """A flag that starts a knob (--depth, --steps of a live stream) within the knob's range."""
    if value is not None:
        spec = KNOBS_BY_NAME[name]
        check_range(f"--{name}", value, spec.minimum, spec.maximum, f" ({spec.description})")


def check_port(option: str, port: int, zero: str) -> None:
    """A UDP or TCP port flag; `zero` says what 0 means to this command."""
    check_range(option, port, 0, 65535, f" (0: {zero})")


def _nargs(multiple: bool) -> dict:
    """argparse keywords for a flag that takes one value, or (multiple) a list the command runs once per value."""
    return {"nargs": "+"} if multiple else {}


# ---- the model ----------------------------------------------------------------------------------------------------


def add_preset(parser: argparse.ArgumentParser, default: str = "tiny", checkpoint: bool = False) -> None:
    when = " when no --checkpoint is given" if checkpoint else ""
    parser.add_argument(
        "--preset",
        default=default,
        help=f"network preset{when}: {', '.join(PRESET_NAMES)} (random weights; tiny needs no files; default "
        f"{default})",
    )


def add_lm_preset(parser: argparse.ArgumentParser, default: str = "tiny", checkpoint: bool = False) -> None:
    when = " when no --lm-checkpoint is given" if checkpoint else ""
    parser.add_argument(
        "--lm-preset",
        default=default,
        help=f"5 Hz LM preset{when}: {', '.join(LM_PRESET_NAMES)} (random weights; default {default})",
    )


def add_lm_model(parser: argparse.ArgumentParser) -> None:
    """The 5 Hz LM a command loads with --lm: --lm-checkpoint or --lm-preset."""
    parser.add_argument(
        "--lm-checkpoint",
        type=Path,
        help="LM weights: acestep-5Hz-lm-* folder, ComfyUI qwen_{1.7b,4b}_ace15 file or models/ folder",
    )
    add_lm_preset(parser, checkpoint=True)


def add_device(parser: argparse.ArgumentParser, default: str = "cpu") -> None:
    parser.add_argument("--device", default=default, help=f"torch device: cpu, cuda or cuda:N (default {default})")


def add_dtype(parser: argparse.ArgumentParser, default: str = "float32") -> None:
    parser.add_argument("--dtype", default=default, choices=DTYPES)


def add_precision(parser: argparse.ArgumentParser, multiple: bool = False, more_help: str = "") -> None:
    parser.add_argument(
        "--precision",
        default=[DEFAULT_PRECISION] if multiple else DEFAULT_PRECISION,
        choices=PRECISIONS,
        help="fp8: the DiT's per-tick linear layers in FP8 (Ada/Hopper GPUs, with --dtype bfloat16)" + more_help,
        **_nargs(multiple),
    )


def add_model_arguments(parser: argparse.ArgumentParser, preset: str = "tiny") -> None:
    """The model a command loads: --preset or --checkpoint, on --device in --dtype at --precision."""
    add_preset(parser, preset, checkpoint=True)
    parser.add_argument(
        "--checkpoint",
        type=Path,
        help="local weights: official ACE-Step 1.5 folder, ComfyUI models/ folder or file, or a flowjam .safetensors",
    )
    add_device(parser)
    add_dtype(parser)
    add_precision(parser)


LORA_HELP = (
    "a LoRA for the DiT (PEFT folder or .safetensors), strength 0..2 (default 1); repeatable. Live, its strength is "
    "the knob lora/<file name>"
)


def lora_option(spec: str, note: str = "") -> tuple[Path, float]:
    """A --lora PATH[:STRENGTH] with its strength in range and its file a readable LoRA (headers only, before any
    model loads), or a CommandError naming it and the fix (`note` added)."""
    from ..engine.lora.formats import check_lora_path

    try:
        path, strength = parse_lora_option(spec)
        check_lora_path(path)
    except (ValueError, FileNotFoundError) as error:
        raise CommandError(f"--lora {spec}: {error}{note}") from None
    return path, strength


def add_lora_arguments(parser: argparse.ArgumentParser, help: str = LORA_HELP, modes: bool = True) -> None:
    parser.add_argument("--lora", action="append", metavar="PATH[:STRENGTH]", help=help)
    if modes:
        parser.add_argument(
            "--lora-mode",
            default="auto",
            choices=LORA_MODES,
            help="how every --lora applies: live (low-rank GEMMs each tick), folded (into the weights on the tick "
            "after a strength change: merged speed, a copy of the layers' weights), merged (fixed strength), auto "
            "(folded on a GPU, else live)",
        )


# ---- lengths and the stream ---------------------------------------------------------------------------------------


def add_window_seconds(parser: argparse.ArgumentParser, default: float | None = None) -> None:
    """--window-seconds (default: DEFAULT_WINDOW_SECONDS)."""
    from ..engine.params import DEFAULT_WINDOW_SECONDS, MIN_WINDOW_SECONDS

    parser.add_argument(
        "--window-seconds",
        type=float,
        default=DEFAULT_WINDOW_SECONDS if default is None else default,
        help=f"generate this much of the song per request, placed at the playhead (>= {MIN_WINDOW_SECONDS:g} s; "
        "a tick costs the window, not the song); 0 or a window as long as the loop: the whole loop each time",
    )


def check_window(seconds: float, endless: bool = False) -> None:
    """--window-seconds in range (and not 0 for endless play), before any model loads."""
    from ..engine.stream.windows import check_window_seconds

    try:
        check_window_seconds(seconds)
    except ValueError as error:
        raise CommandError(str(error)) from None
    if endless and seconds == 0:
        raise CommandError("--endless needs a window: give --window-seconds, e.g. 20")


def add_seconds(parser: argparse.ArgumentParser, help: str, default: float | None = None) -> None:
    """--seconds: a duration, of the output or of the run."""
    parser.add_argument("--seconds", type=float, default=default, help=help)


def add_song_seconds(
    parser: argparse.ArgumentParser, default, multiple: bool = False, help: str = "length of the song latent (s)"
) -> None:
    """--song-seconds: the length of the song or loop that is generated (the latent's length), not a duration."""
    parser.add_argument("--song-seconds", type=float, default=default, help=help, **_nargs(multiple))


def add_depth(parser: argparse.ArgumentParser, default: int | None = DEFAULT_DEPTH, multiple: bool = False) -> None:
    spec = KNOBS_BY_NAME["depth"]
    parser.add_argument(
        "--depth",
        type=int,
        default=[default] if multiple else default,
        help=f"{spec.description} ({spec.minimum:g}..{spec.maximum:g}; default {DEFAULT_DEPTH})",
        **_nargs(multiple),
    )


def add_steps(parser: argparse.ArgumentParser, default: int | None = DEFAULT_STEPS, live: bool = False) -> None:
    """--steps: denoising steps per generation, 1..MAX_STEPS; live, 1..50: the steps knob's range (a controller
    sweeps it, and a live generation of N steps reaches the ear N ticks after it is asked for)."""
    if live:
        spec = KNOBS_BY_NAME["steps"]
        more = f"{spec.minimum:g}..{spec.maximum:g}, the steps knob's range: a generation takes one tick per step"
    else:
        more = f"1..{MAX_STEPS}"
    parser.add_argument(
        "--steps", type=int, default=default, help=f"denoising steps per generation ({more}; default {DEFAULT_STEPS})"
    )


def add_bpm(parser: argparse.ArgumentParser, help: str, default: float | None = None) -> None:
    """--bpm: a tempo in beats per minute, a number in the model's range (30..300) in every command."""
    low, high = BPM_RANGE
    parser.add_argument("--bpm", type=float, default=default, help=f"tempo in BPM, {low}..{high}: {help}")


def add_time_signature(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    """--time-signature: the beats per bar (the model hears only those), as 4 or '4/4'."""
    parser.add_argument(
        "--time-signature",
        default=default,
        help=f"beats per bar: 2, 3, 4 or 6, or written 4/4, 3/4, 6/8 (default {default or 'none given'})",
    )


def check_bpm_flag(option: str, bpm: float | None) -> None:
    """A tempo flag (--bpm, --source-bpm) in the model's range, before anything loads."""
    from ..engine.prompts import check_bpm

    if bpm is not None:
        try:
            check_bpm(bpm, option)
        except ValueError as error:
            raise CommandError(str(error)) from None


def time_signature_flag(text: str | None, default: int | None = None) -> int | None:
    """--time-signature as beats per bar (`default` when not given), or a CommandError naming the fix."""
    from ..engine.prompts import time_signature_numerator

    if text is None:
        return default
    try:
        return time_signature_numerator(text)
    except ValueError as error:
        raise CommandError(f"--time-signature: {error}") from None


def add_cfg_mode(
    parser: argparse.ArgumentParser, default: str | None, multiple: bool = False, flag: str = "--cfg"
) -> None:
    parser.add_argument(
        flag,
        default=[default] if multiple else default,
        choices=CFG_MODES,
        help="guidance rows: off (turbo's own: CFG-distilled), full (a negative row every step), initialize, self",
        **_nargs(multiple),
    )


def add_backend(parser: argparse.ArgumentParser, default: str | None = "eager", multiple: bool = False) -> None:
    parser.add_argument(
        "--backend",
        default=[default] if multiple else default,
        choices=BACKENDS,
        help="how the ticks run: eager, torch.compile, CUDA graphs, or both",
        **_nargs(multiple),
    )


def add_audio_device(parser: argparse.ArgumentParser) -> None:
    """--audio-device: the sound card to play on (never a torch device), and --list-devices to show them."""
    parser.add_argument("--audio-device", help="sound card: output device name or index (default: the system's)")
    parser.add_argument("--list-devices", action="store_true", help="print audio output devices and exit")


def add_server_url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default="http://127.0.0.1:8000", help="the server's URL (flowjam serve)")


def add_key_file(parser: argparse.ArgumentParser, more_help: str = "") -> None:
    """--key-file: the server key of `flowjam serve` (the environment's FLOWJAM_SERVE_KEY otherwise)."""
    parser.add_argument(
        "--key-file",
        type=Path,
        help="a file whose first line is the server key, needed to create and list sessions (or set "
        f"FLOWJAM_SERVE_KEY){more_help}",
    )


def add_server_arguments(parser: argparse.ArgumentParser, session_required: bool = True) -> None:
    """Where a served session is and what opens it: the server's URL, the session's name and its token."""
    add_server_url(parser)
    parser.add_argument(
        "--session", required=session_required, help="the session's name (as POST /sessions returned it)"
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        help=f"a file whose first line is the session's token, as POST /sessions returned it (or set {TOKEN_ENV})",
    )


def server_client(args: argparse.Namespace):
    """A client of `--server` holding the session's token from --token-file or the environment."""
    from ..serve.client import Client

    if args.token_file is not None:
        try:
            lines = args.token_file.expanduser().read_text().splitlines()
        except OSError as error:
            raise CommandError(f"--token-file {args.token_file}: {error.strerror or error}") from None
        token = lines[0].strip() if lines else ""
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise CommandError(
            f"the session's token is needed: --token-file FILE or {TOKEN_ENV}=... (POST /sessions returned it)"
        )
    return Client(args.server, token=token)


# ---- devices and the session --------------------------------------------------------------------------------------


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


def describe_device(name: str) -> str:
    """The device as a benchmark line names it: the GPU's model, or the CPU and its torch threads."""
    import torch

    if name.startswith("cuda"):
        return torch.cuda.get_device_name(name)
    return f"cpu ({torch.get_num_threads()} threads)"


def load_session(args: argparse.Namespace):
    """The Session of the model flags (add_model_arguments), with every --lora attached."""
    import torch

    from ..engine.session import Session

    check_device(args.device)
    loras = [(spec, *lora_option(spec)) for spec in getattr(args, "lora", None) or ()]
    if args.precision == "fp8":
        from ..engine.models.fp8 import check_fp8_device

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
    for spec, path, strength in loras:
        try:
            session.load_lora(path, strength, mode=args.lora_mode)
        except (ValueError, FileNotFoundError) as error:
            raise CommandError(f"--lora {spec}: {error}") from None
    return session

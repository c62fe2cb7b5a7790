"""`flowjam render`: generate one piece offline and write a 48 kHz stereo WAV."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..engine.params import DEFAULT_SHIFT
from .flags import (
    CommandError,
    add_lm_model,
    add_lora_arguments,
    add_model_arguments,
    add_seconds,
    add_steps,
    load_session,
)


def add_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = commands.add_parser("render", help="generate one piece offline and write a 48 kHz stereo WAV")
    parser.add_argument("--prompt", required=True, help="caption / tags describing the music")
    add_lora_arguments(parser)
    parser.add_argument(
        "--lyrics", default="", help="lyrics text, or @file.txt to read them from a file (default: instrumental)"
    )
    add_seconds(parser, "length of the output in seconds (> 0)", default=10.0)
    parser.add_argument("--out", type=Path, default=Path("flowjam.wav"), help="output WAV path")
    parser.add_argument("--cover", type=Path, help="source song to cover (keeps its structure): WAV, FLAC, OGG or MP3")
    parser.add_argument("--seed", type=int, default=0)
    add_steps(parser)
    parser.add_argument("--shift", type=float, default=DEFAULT_SHIFT, help=f"timestep shift (turbo: {DEFAULT_SHIFT:g})")
    parser.add_argument("--denoise", type=float, default=1.0, help="1 = from noise; below 1 keeps that much of --cover")
    parser.add_argument("--bpm", type=int)
    parser.add_argument("--key", help="key scale, e.g. 'G major', 'F# minor'")
    parser.add_argument("--time-signature", help="2, 3, 4 or 6 (or 4/4 style)")
    parser.add_argument("--language", default="unknown", help="lyrics language code (en, zh, ja, ...)")
    parser.add_argument(
        "--lm", action="store_true", help="let the 5 Hz LM write the song structure (audio codes) first"
    )
    add_lm_model(parser)
    parser.add_argument("--lm-cfg", type=float, default=2.0, help="LM guidance (>= 1; 1 = off)")
    parser.add_argument("--lm-temperature", type=float, default=0.85, help="LM sampling temperature (0 = greedy)")
    parser.add_argument("--lm-top-p", type=float, default=0.9, help="LM nucleus sampling mass (1 = off)")
    parser.add_argument("--lm-top-k", type=int, default=0, help="LM top-k (0 = off)")
    add_model_arguments(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    from ..engine.outputs import check_output_path
    from ..engine.params import song_frames

    song_frames(args.seconds, "--seconds")  # torch-free checks first: a typo is refused at once
    check_output_path(args.out, "--out")
    lyrics = read_lyrics(args.lyrics)

    from ..engine.lm.sampling import SamplingParams
    from ..engine.render import RenderRequest, render

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

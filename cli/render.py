"""`flowjam render`: generate one piece offline and write a 48 kHz stereo WAV."""

from __future__ import annotations

import argparse
import stat
import sys
import time
from pathlib import Path

from ..engine.params import DEFAULT_SHIFT
from .flags import (
    CommandError,
    add_bpm,
    add_lm_model,
    add_lora_arguments,
    add_model_arguments,
    add_seconds,
    add_steps,
    add_time_signature,
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
    add_bpm(parser, "in the caption's metas, as a whole BPM (default: none given, or the LM's with --lm)")
    parser.add_argument("--key", help="key scale: a note A-G, an optional # or b, and major or minor, e.g. 'F# minor'")
    add_time_signature(parser)
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
    with ProgressBar("denoise") as progress:
        path = render(session, request, on_step=progress)
    print(f"wrote {path} ({args.seconds:g} s, 48 kHz stereo, seed {args.seed}, {session.models.source})")
    return 0


MAX_LYRICS_BYTES = 1 << 20  # far beyond what the lyric encoder reads (its tokens are cut at LYRIC_MAX_TOKENS)


def read_lyrics(text: str) -> str:
    """--lyrics: the text itself, or `@file.txt` for a UTF-8 text file's contents. What the path is gets checked
    before it is opened, so a FIFO never blocks and a device is never read."""
    if not text.startswith("@"):
        return text
    path = Path(text[1:]).expanduser()
    try:
        found = path.stat()
    except FileNotFoundError:
        raise CommandError(
            f"--lyrics {text}: no such file {path}; give a text file, or the lyrics themselves"
        ) from None
    except OSError as error:
        raise CommandError(
            f"--lyrics {text}: cannot read {path} ({error.strerror}); give a readable text file"
        ) from None
    kind = not_a_file(found.st_mode)
    if kind:
        raise CommandError(
            f"--lyrics {text}: {path} is {kind}, not a text file; give a file, e.g. --lyrics @lyrics.txt"
        )
    if found.st_size > MAX_LYRICS_BYTES:
        raise CommandError(
            f"--lyrics {text}: {path} is too large for lyrics ({found.st_size:,} bytes; at most {MAX_LYRICS_BYTES:,}); "
            "give the song's lyrics only"
        )
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise CommandError(f"--lyrics {text}: {path} is not UTF-8 text; save it as UTF-8") from None
    except OSError as error:
        raise CommandError(
            f"--lyrics {text}: cannot read {path} ({error.strerror}); give a readable text file"
        ) from None


def not_a_file(mode: int) -> str:
    """What a path whose stat mode is `mode` is when it is not a regular file ("a folder", "a FIFO (named pipe)",
    ...); "" for a regular file."""
    kinds = (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "" if stat.S_ISREG(mode) else "not a regular file")


class ProgressBar:
    """A one-line terminal progress bar on stderr; as a context manager it ends its line however the work ends (a
    Ctrl-C's message then starts on a line of its own)."""

    def __init__(self, label: str, width: int = 30):
        self.label, self.width, self.start = label, width, time.perf_counter()
        self.line_open = False

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc_info) -> None:
        if self.line_open:
            sys.stderr.write("\n")
            sys.stderr.flush()

    def __call__(self, done: int, total: int) -> None:
        filled = round(self.width * done / total)
        elapsed = time.perf_counter() - self.start
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} {elapsed:5.1f}s")
        self.line_open = done != total
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()

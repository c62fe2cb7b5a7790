"""The exact caption and lyric strings ACE-Step 1.5 feeds its Qwen3 text encoder (spec §2.2, §1.4).

Pure string functions; the tokenizer appends its own `<|endoftext|>` after the one written here.
"""

from __future__ import annotations

import math

TEXT2MUSIC_INSTRUCTION = "Fill the audio semantic mask based on the given conditions:"
COVER_INSTRUCTION = "Generate audio semantic tokens based on the given conditions:"
REPAINT_INSTRUCTION = "Repaint the mask area based on the given conditions:"
DEFAULT_INSTRUCTION = TEXT2MUSIC_INSTRUCTION

TASK_INSTRUCTIONS: dict[str, str] = {
    "text2music": TEXT2MUSIC_INSTRUCTION,
    "cover": COVER_INSTRUCTION,
    "repaint": REPAINT_INSTRUCTION,
}

INSTRUMENTAL_LYRICS = "[Instrumental]"
UNKNOWN_LANGUAGE = "unknown"
NOT_AVAILABLE = "N/A"
DEFAULT_DURATION_S = 30

BPM_RANGE = (30, 300)
DURATION_RANGE_S = (10, 600)
TIME_SIGNATURES = (2, 3, 4, 6)  # beats per bar, as the model was trained with
TIME_SIGNATURE_NOTES = (2, 4, 8, 16)  # the lower number of "6/8": ignored by the model, refused when not a note
KEY_NOTES = ("A", "B", "C", "D", "E", "F", "G")
KEY_ACCIDENTALS = ("", "#", "b", "♯", "♭")
KEY_MODES = ("major", "minor")
KEY_SCALES = frozenset(
    f"{note}{accidental} {mode}" for note in KEY_NOTES for accidental in KEY_ACCIDENTALS for mode in KEY_MODES
)

# BCP-47 codes ACE-Step 1.5 was trained with (constants.py VALID_LANGUAGES), "unknown" included.
LANGUAGES = frozenset(
    "ar az bg bn ca cs da de el en es fa fi fr he hi hr ht hu id is it ja ko la lt ms ne nl no "
    "pa pl pt ro ru sa sk sr sv sw ta te th tl tr uk ur vi yue zh unknown".split()
)

_CAPTION_TEMPLATE = "# Instruction\n{instruction}\n\n# Caption\n{caption}\n\n# Metas\n{metas}<|endoftext|>\n"
_LYRIC_TEMPLATE = "# Languages\n{language}\n\n# Lyric\n{lyrics}<|endoftext|>"


def check_bpm(bpm: object, what: str = "bpm") -> float:
    """`bpm` as a float when it is a finite number in the range the model knows; else a ValueError naming `what`."""
    if isinstance(bpm, bool) or not isinstance(bpm, int | float) or not math.isfinite(bpm):
        raise ValueError(f"{what} must be a number in {BPM_RANGE[0]}..{BPM_RANGE[1]}, got {bpm!r}")
    if not BPM_RANGE[0] <= bpm <= BPM_RANGE[1]:
        raise ValueError(f"{what} must be a number in {BPM_RANGE[0]}..{BPM_RANGE[1]}, got {bpm:g}")
    return float(bpm)


def time_signature_numerator(time_signature: int | str) -> int:
    """4, "4" and "4/4" all give 4 (the beats per bar; the model hears only those); a numerator outside {2, 3, 4, 6}
    or a lower number that is not a note value raises ValueError naming the fix."""
    text = str(time_signature).strip()
    numerator_text, slash, denominator_text = text.partition("/")
    try:
        numerator = int(numerator_text.strip())
        denominator = int(denominator_text.strip()) if slash else None
    except ValueError:
        raise ValueError(f"time signature {time_signature!r} is not a number like 4 or '4/4'") from None
    if numerator not in TIME_SIGNATURES:
        raise ValueError(f"time signature {time_signature!r}: numerator must be one of {TIME_SIGNATURES}")
    if denominator is not None and denominator not in TIME_SIGNATURE_NOTES:
        notes = ", ".join(map(str, TIME_SIGNATURE_NOTES))
        raise ValueError(
            f"time signature {time_signature!r}: the lower number is a note value ({notes}); write e.g. '4/4' or '6/8'"
        )
    return numerator


def check_key_scale(key_scale: str, what: str = "key scale") -> str:
    """`key_scale` if the model knows it (e.g. 'G major', 'F# minor'); else a ValueError naming `what` and the form."""
    if key_scale not in KEY_SCALES:
        raise ValueError(
            f"{what} {key_scale!r} is not a note A-G, an optional accidental (# b ♯ ♭) and 'major' or 'minor', "
            "e.g. 'G major', 'F# minor'"
        )
    return key_scale


def check_language(language: str, what: str = "language") -> str:
    """`language` if it is one of ACE-Step's codes; else a ValueError naming `what` and the codes."""
    if language not in LANGUAGES:
        raise ValueError(f"{what} {language!r} is not one of ACE-Step's codes: {' '.join(sorted(LANGUAGES))}")
    return language


def metas_block(
    bpm: float | None = None,
    time_signature: int | str | None = None,
    key_scale: str | None = None,
    duration_s: float | None = None,
) -> str:
    """The four "- key: value" lines; missing values (None, "") read "N/A", a missing duration "30 seconds"."""
    key_scale = key_scale or None
    time_signature = None if time_signature is None or str(time_signature).strip() == "" else time_signature
    if bpm is not None:
        check_bpm(bpm)
    if key_scale is not None:
        check_key_scale(key_scale)
    if duration_s is not None and not DURATION_RANGE_S[0] <= duration_s <= DURATION_RANGE_S[1]:
        raise ValueError(f"duration {duration_s} s is outside {DURATION_RANGE_S[0]}..{DURATION_RANGE_S[1]} s")
    bpm_text = NOT_AVAILABLE if bpm is None else str(round(bpm))  # the model was trained on whole BPMs
    time_signature_text = NOT_AVAILABLE if time_signature is None else str(time_signature_numerator(time_signature))
    key_scale_text = NOT_AVAILABLE if key_scale is None else key_scale
    duration_text = f"{int(DEFAULT_DURATION_S if duration_s is None else duration_s)} seconds"
    return (
        f"- bpm: {bpm_text}\n"
        f"- timesignature: {time_signature_text}\n"
        f"- keyscale: {key_scale_text}\n"
        f"- duration: {duration_text}\n"
    )


def caption_prompt(
    caption: str,
    instruction: str = DEFAULT_INSTRUCTION,
    bpm: float | None = None,
    time_signature: int | str | None = None,
    key_scale: str | None = None,
    duration_s: float | None = None,
) -> str:
    """The caption string for the Qwen3 encoder; the instruction is made to end with ":" as upstream does."""
    if not instruction.strip():
        raise ValueError("instruction is empty; use one of TASK_INSTRUCTIONS")
    if not instruction.endswith(":"):
        instruction += ":"
    metas = metas_block(bpm=bpm, time_signature=time_signature, key_scale=key_scale, duration_s=duration_s)
    return _CAPTION_TEMPLATE.format(instruction=instruction, caption=caption, metas=metas)


def lyric_prompt(lyrics: str, language: str = UNKNOWN_LANGUAGE) -> str:
    """The lyric string (embedded by token lookup only). Instrumental music uses INSTRUMENTAL_LYRICS."""
    check_language(language)
    return _LYRIC_TEMPLATE.format(language=language, lyrics=lyrics)

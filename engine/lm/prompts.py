"""The chat strings the 5 Hz LM was trained on (spec §5.5): Phase 1 (metadata "thinking") and Phase 2 (codes).

Pure string functions. Phase 2 follows the official pipeline: the CoT is a closed assistant turn
("…</think>\n\n<|im_end|>\n") and the codes follow it.
"""

from __future__ import annotations

from ..prompts import INSTRUMENTAL_LYRICS

CODES_INSTRUCTION = "Generate audio semantic tokens based on the given conditions:"
SYSTEM_PROMPT = f"# Instruction\n{CODES_INSTRUCTION}\n\n"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def chat(system: str, user: str) -> str:
    """Qwen3 chat template up to an open assistant turn."""
    return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def lyrics_text(lyrics: str) -> str:
    return lyrics.strip() or INSTRUMENTAL_LYRICS


def user_turn(caption: str, lyrics: str) -> str:
    return f"# Caption\n{caption}\n\n# Lyric\n{lyrics_text(lyrics)}\n"


def closed_cot(cot: str) -> str:
    """The assistant turn holding a finished CoT block (empty `cot` = the unconditional "<think>\n\n</think>")."""
    return (
        f"{THINK_OPEN}\n{cot}\n{THINK_CLOSE}\n\n<|im_end|>\n"
        if cot
        else f"{THINK_OPEN}\n\n{THINK_CLOSE}\n\n<|im_end|>\n"
    )


def metadata_prompt(caption: str, lyrics: str) -> str:
    """Phase 1, conditional: the model writes "<think>\n" + YAML + "\n</think>" after this."""
    return chat(SYSTEM_PROMPT, user_turn(caption, lyrics))


def metadata_uncond_prompt(lyrics: str) -> str:
    """Phase 1, unconditional (CFG): the caption is removed from the user turn."""
    return chat(SYSTEM_PROMPT, f"# Lyric\n{lyrics_text(lyrics)}\n")


def codes_prompt(caption: str, lyrics: str, cot: str) -> str:
    """Phase 2, conditional: the metadata CoT closes the assistant turn; audio-code tokens follow."""
    return chat(SYSTEM_PROMPT, user_turn(caption, lyrics)) + closed_cot(cot)


def codes_uncond_prompt(caption: str, lyrics: str, negative: str = "") -> str:
    """Phase 2, unconditional: the same user turn (caption replaced by a negative prompt if given), empty CoT."""
    return chat(SYSTEM_PROMPT, user_turn(negative.strip() or caption, lyrics)) + closed_cot("")

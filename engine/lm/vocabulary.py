"""The 5 Hz LM's vocabulary: Qwen3's BPE and special tokens plus the 65,535 `<|audio_code_N|>` tokens (spec §5.2).

The code tokens are handled here, around the Qwen3 tokenizer, rather than as 65,535 more tiktoken specials: a
text tag `<|audio_code_N|>` is id AUDIO_CODE_BASE + N, and those ids decode back to the tag.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ..models.lm import AUDIO_CODE_BASE, LM_VOCAB
from ..models.text_tokenizer import Qwen3Tokenizer

CODE_SLOTS = LM_VOCAB - AUDIO_CODE_BASE  # 65,535 code tokens; only the first NUM_CODES are valid FSQ indices
_CODE_TAG = re.compile(r"<\|audio_code_(\d+)\|>")


def code_tag(code: int) -> str:
    return f"<|audio_code_{code}|>"


class LMTokenizer:
    """Text <-> LM ids: Qwen3 text and specials, plus audio-code tags. No EOS is appended (chat prompts end
    where the template ends)."""

    def __init__(self, text_tokenizer: Qwen3Tokenizer):
        self.text = text_tokenizer

    @property
    def vocab_size(self) -> int:
        return LM_VOCAB

    def encode(self, text: str, add_eos: bool = False) -> list[int]:
        """Ids of `text`; `add_eos` is accepted for the Qwen3Tokenizer signature and must stay False."""
        if add_eos:
            raise ValueError("LM prompts take no appended <|endoftext|>; the chat template closes them")
        ids: list[int] = []
        for index, piece in enumerate(_CODE_TAG.split(text)):
            if index % 2:
                slot = int(piece)
                if slot >= CODE_SLOTS:
                    raise ValueError(f"<|audio_code_{slot}|> is beyond the {CODE_SLOTS} code tokens")
                ids.append(AUDIO_CODE_BASE + slot)
            elif piece:
                ids.extend(self.text.encode(piece, add_eos=False))
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, code tokens written as their tags."""
        parts, run = [], []
        for token in (int(i) for i in ids):
            if token >= AUDIO_CODE_BASE:
                parts.append(self.text.decode(run))
                run = []
                parts.append(code_tag(token - AUDIO_CODE_BASE))
            else:
                run.append(token)
        parts.append(self.text.decode(run))
        return "".join(parts)

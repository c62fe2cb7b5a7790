"""LM Phase 1: the metadata chain of thought the 5 Hz LM writes before the audio codes (spec §5.5).

When any of bpm, key/scale, time signature or duration is open, the LM writes "<think>\\n" + YAML + "\\n</think>"
and Phase 2 (codes) is conditioned on that block. Here the block is written under constraints: "<think>", the
keys, ": " and the newlines, and every value the user gave, are forced; each open value is sampled only among
that field's valid strings, through a trie over their token ids. Both CFG rows share one forward per step.

Official format (ace-step/ACE-Step-1.5 at f30aee4, files under acestep/):
- The LM writes the keys in this order: bpm, caption, duration, keyscale, language, timesignature
  (constrained_logits_processor.py:275; `genres` is skipped in Phase 1, llm_inference.py:1142).
- Phase 2's block is `yaml.dump(items, allow_unicode=True, sort_keys=True).strip()` of the fields that are set
  (llm_inference.py:1003-1030): `bpm: 120`, `duration: 60`, `timesignature: 4` as ints; `keyscale: F# minor` and
  `language: en` plain, but YAML 1.1 booleans are quoted (`language: 'no'`); a long caption is folded into lines of
  about 80 columns, the continuation lines indented by two spaces, and is quoted when YAML needs it. `cot()` is
  that text.
- Valid values (constants.py:13-66, the same tables as engine/prompts.py): bpm 30..300, duration 10..600 s, time
  signature 2|3|4|6, 70 key scales (A-G; '', #, b, ♯, ♭; major|minor), 51 language codes with "unknown".
- A given value is written as " {value}\\n" (constrained_logits_processor.py:1809-2087); the value tries come from
  the tokens of "key: value" (:216-238); the first language token is the top-1 of the allowed ones, not a
  sample (:2014).
- The caption is free text: at most 512 tokens, with no backtick and no audio code (:1878-1895). After a token that
  holds a newline, the caption ends if the most likely next token does not start with a space or tab (YAML
  continuation lines do) (:1849). The caption read back is its lines, stripped and joined by spaces (:368).
- CFG: the conditional row has caption and lyrics, the unconditional row only the lyrics (llm_inference.py:1426).
  Logits are u + g·(c − u), then the FSM mask, then sampling (:2380-2409). Phase 1 is skipped when bpm, keyscale,
  timesignature and duration are all given (:995, :1117).

Choices made here:
- Caption: the official default (`use_cot_caption=True`) has the LM write the caption. The LM's caption is what the
  DiT gets (inference.py:650), and Phase 2's CoT is built from it. So an empty `known.caption` is an open field:
  the result carries the LM's caption, or the user's when the LM writes an empty one (acestep.cpp does the same).
  A set `known.caption` is forced as given, on one line: this is the official `user_metadata["caption"]` injection.
- Key names get the tokens of the training text (`bpm:` -> b|pm|:), as in acestep.cpp. The official FSM instead
  takes the longest single-token prefix each time, which gives bp|m|: for bpm and the same tokens for the other keys.
- Caption tokens are ordinary BPE tokens only (no special token, no audio code, no backtick), so the block stays
  well formed.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import torch
import yaml

from ..models.lm import Qwen3LM
from ..models.text_tokenizer import NUM_BPE_RANKS, Qwen3Tokenizer
from ..prompts import BPM_RANGE, DURATION_RANGE_S, KEY_SCALES, LANGUAGES, TIME_SIGNATURES
from .prompts import THINK_OPEN, metadata_prompt, metadata_uncond_prompt
from .sampling import SamplingParams, cfg_logits, sample

# YAML key -> SongMetadata attribute, in the order the LM writes them.
COT_FIELDS: dict[str, str] = {
    "bpm": "bpm",
    "caption": "caption",
    "duration": "duration_s",
    "keyscale": "keyscale",
    "language": "language",
    "timesignature": "timesignature",
}
REQUIRED_FIELDS = ("bpm", "duration_s", "keyscale", "timesignature")  # all given: Phase 1 is skipped
CAPTION_MAX_TOKENS = 512
PHASE1_STEP_BASE = 1 << 30  # Phase 1 draws (seed, step ≥ 2^30) never reuse the (seed, step) of a Phase 2 code


def _numbers(low: int, high: int) -> tuple[str, ...]:
    return tuple(str(value) for value in range(low, high + 1))


# The strings the LM may write for each field other than the caption.
VALUE_STRINGS: dict[str, tuple[str, ...]] = {
    "bpm": _numbers(*BPM_RANGE),
    "duration": _numbers(*DURATION_RANGE_S),
    "keyscale": tuple(sorted(KEY_SCALES)),
    "language": tuple(sorted(LANGUAGES)),
    "timesignature": tuple(str(value) for value in TIME_SIGNATURES),
}
_NUMERIC_KEYS = frozenset({"bpm", "duration", "timesignature"})


# ---- the metadata ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SongMetadata:
    """The CoT fields. None, or an empty caption, means not given: the LM writes it."""

    bpm: int | None = None
    caption: str = ""
    duration_s: int | None = None
    keyscale: str | None = None
    language: str | None = None
    timesignature: int | None = None

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def is_complete(self) -> bool:
        """bpm, key/scale, time signature and duration are all given, so the LM is not needed (as upstream)."""
        return all(getattr(self, attr) is not None for attr in REQUIRED_FIELDS)

    def cot_items(self) -> dict[str, int | str]:
        """YAML key -> value for the fields that are set."""
        return {key: value for key, attr in COT_FIELDS.items() if (value := getattr(self, attr)) not in (None, "")}

    def cot(self) -> str:
        """The YAML that goes between "<think>\\n" and "\\n</think>", as upstream writes it for Phase 2."""
        items = self.cot_items()
        return yaml.dump(items, allow_unicode=True, sort_keys=True, default_flow_style=False).strip() if items else ""


def _is_whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_range(name: str, value: object, low: int, high: int, unit: str = "") -> None:
    if value is not None and not (_is_whole(value) and low <= value <= high):
        raise ValueError(f"{name} must be a whole number in {low}..{high}{unit}, got {value!r}")


def _validate(meta: SongMetadata) -> None:
    _check_range("bpm", meta.bpm, *BPM_RANGE)
    _check_range("duration_s", meta.duration_s, *DURATION_RANGE_S, unit=" seconds")
    if not isinstance(meta.caption, str):
        raise ValueError(f"caption must be a string, got {meta.caption!r}")
    if meta.keyscale is not None and meta.keyscale not in KEY_SCALES:
        raise ValueError(
            f"keyscale {meta.keyscale!r} is not a note A-G, an optional accidental (# b ♯ ♭) and 'major' or "
            "'minor', e.g. 'G major', 'F# minor'"
        )
    if meta.language is not None and meta.language not in LANGUAGES:
        raise ValueError(f"language {meta.language!r} is not one of ACE-Step's codes: {' '.join(sorted(LANGUAGES))}")
    if meta.timesignature is not None and not (_is_whole(meta.timesignature) and meta.timesignature in TIME_SIGNATURES):
        raise ValueError(
            f"timesignature must be one of {TIME_SIGNATURES} (the beats per bar: 4 = 4/4, 6 = 6/8), "
            f"got {meta.timesignature!r}"
        )


def _one_line(text: str) -> str:
    """Lines stripped and joined by single spaces (how upstream reads a folded caption back)."""
    return " ".join(line.strip() for line in text.split("\n") if line.strip())


# ---- token tries -------------------------------------------------------------------------------------------------


@dataclass
class TokenTrie:
    """Prefix tree over the token ids of a field's valid values; `value` is set on the node where one ends."""

    children: dict[int, TokenTrie] = field(default_factory=dict)
    value: str | None = None

    def add(self, tokens: Sequence[int], value: str) -> None:
        node = self
        for token in tokens:
            node = node.children.setdefault(token, TokenTrie())
        node.value = value

    def options(self, end: int) -> list[int]:
        """The tokens allowed here: those that continue some value, and `end` where a value is complete."""
        return [*self.children, *([end] if self.value is not None else [])]

    @property
    def depth(self) -> int:
        """The most tokens still to write from here, `end` included."""
        return max([1 + child.depth for child in self.children.values()] + [int(self.value is not None)])


def _newline(tokenizer: Qwen3Tokenizer) -> int:
    (token,) = tokenizer.encode("\n", add_eos=False)
    return token


@functools.lru_cache(maxsize=4)
def value_tries(tokenizer: Qwen3Tokenizer) -> dict[str, TokenTrie]:
    """One trie per field of VALUE_STRINGS, over the tokens of " {value}" (what follows "key:")."""
    tries = {}
    for key, values in VALUE_STRINGS.items():
        trie = TokenTrie()
        for value in values:
            trie.add(tokenizer.encode(f" {value}", add_eos=False), value)
        tries[key] = trie
    return tries


# ---- constrained writing -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Segment:
    """Tokens to write as they are, then the value of the open field `key`."""

    forced: tuple[int, ...]
    key: str


def _plan(tokenizer: Qwen3Tokenizer, known: SongMetadata) -> list[_Segment]:
    """The CoT as forced runs, each closed by an open field; what follows the last open field is never needed."""
    segments, forced = [], tokenizer.encode(f"{THINK_OPEN}\n", add_eos=False)
    for key, attr in COT_FIELDS.items():
        forced += tokenizer.encode(f"{key}:", add_eos=False)
        value = getattr(known, attr)
        if value in (None, ""):
            segments.append(_Segment(tuple(forced), key))
            forced = []
        else:
            forced += tokenizer.encode(f" {_one_line(str(value))}\n", add_eos=False)
    return segments


@dataclass
class _Writer:
    """Feeds the CoT to the conditional row 0 and (with CFG) the unconditional row 1, and draws the open tokens.

    Written tokens wait in `pending` until the next logits are needed: the first batch is prefilled after its
    row's prompt, later ones go one decode step at a time for both rows together."""

    lm: Qwen3LM
    prompts: list[list[int]]
    sampling: SamplingParams
    seed: torch.Tensor  # [1] int64
    pending: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # per row: the cache slot of the next token
    logits: torch.Tensor | None = None  # [rows, V] for the token after everything fed so far
    draws: int = 0

    @property
    def device(self) -> torch.device:
        return self.seed.device

    def force(self, tokens: Iterable[int]) -> None:
        self.pending.extend(tokens)

    def next_logits(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Guided fp32 logits [V] of the next token (only the `ids` columns if given)."""
        self._feed()
        rows = self.logits if ids is None else self.logits[:, ids]
        return cfg_logits(rows[0], rows[1], self.sampling.cfg) if len(self.prompts) == 2 else rows[0].float()

    def draw(self, logits: torch.Tensor) -> int:
        """An index into `logits` [n], sampled at this writer's next (seed, step)."""
        step = torch.tensor([PHASE1_STEP_BASE + self.draws], device=self.device)
        self.draws += 1
        return int(sample(logits[None], self.sampling, self.seed, step)[0])

    def choose(self, options: list[int], greedy: bool = False) -> int:
        """Write one of `options` (a lone option is written without running the LM) and return it."""
        token = options[0]
        if len(options) > 1:
            logits = self.next_logits(torch.tensor(options, device=self.device))
            token = options[int(logits.argmax()) if greedy else self.draw(logits)]
        self.pending.append(token)
        return token

    def _feed(self) -> None:
        """Run the LM over the pending tokens: prefilled after the prompts the first time, then decode steps."""
        if self.logits is None:
            self._prefill()
        else:
            for token in self.pending:
                tokens = torch.full((len(self.prompts),), token, device=self.device)
                positions = torch.tensor(self.positions, device=self.device)
                self.logits = self.lm.decode_step(tokens, positions, keys_end=max(self.positions) + 1)
                self.positions = [position + 1 for position in self.positions]
        self.pending.clear()

    def _prefill(self) -> None:
        ids = [torch.tensor([prompt + self.pending], device=self.device) for prompt in self.prompts]
        self.logits = torch.cat([self.lm.prefill(row_ids, row=row) for row, row_ids in enumerate(ids)])
        self.positions = [row_ids.shape[1] for row_ids in ids]


def _write_value(writer: _Writer, trie: TokenTrie, end: int, greedy_first: bool) -> str:
    """Walk `trie` one written token at a time until `end` closes a value; -> that value."""
    node = trie
    token = writer.choose(node.options(end), greedy=greedy_first)
    while token != end:
        node = node.children[token]
        token = writer.choose(node.options(end))
    return node.value


def _starts_new_line(tokenizer: Qwen3Tokenizer, token: int) -> bool:
    """True unless `token` is ordinary text that starts with a space or tab (a YAML continuation line)."""
    return token >= NUM_BPE_RANKS or tokenizer.decode([token])[:1] not in (" ", "\t")


def _caption_ids(tokenizer: Qwen3Tokenizer, device: torch.device) -> torch.Tensor:
    """The ordinary BPE tokens except the backtick."""
    ids = torch.arange(NUM_BPE_RANKS, device=device)
    return ids[~torch.isin(ids, torch.tensor(tokenizer.encode("`", add_eos=False), device=device))]


def _write_caption(writer: _Writer, tokenizer: Qwen3Tokenizer, allowed: torch.Tensor, end: int) -> str:
    """Free caption text, ended as upstream ends it; -> the raw text, newlines included."""
    tokens: list[int] = []
    while len(tokens) < CAPTION_MAX_TOKENS:
        logits = writer.next_logits()
        if tokens and "\n" in tokenizer.decode(tokens[-1:]) and _starts_new_line(tokenizer, int(logits.argmax())):
            return tokenizer.decode(tokens)
        tokens.append(int(allowed[writer.draw(logits[allowed])]))
        writer.force(tokens[-1:])
    writer.force([end])
    return tokenizer.decode(tokens)


def _budget(segments: list[_Segment], tries: dict[str, TokenTrie]) -> int:
    """The most CoT tokens the rows will hold."""
    open_values = sum(CAPTION_MAX_TOKENS + 1 if s.key == "caption" else tries[s.key].depth for s in segments)
    return sum(len(s.forced) for s in segments) + open_values


@torch.no_grad()
def generate_metadata(
    lm: Qwen3LM,
    tokenizer: Qwen3Tokenizer,
    caption: str,
    lyrics: str,
    known: SongMetadata,
    sampling: SamplingParams,
    seed: int,
) -> SongMetadata:
    """LM Phase 1: `known` with every missing field written by the LM (valid values only), the same for the same
    seed. `caption` and `lyrics` are the user's and go into the prompts. An empty `known.caption` is written by the
    LM (the official default); set it to the user's caption to keep that. Returns `known` itself when it is
    complete. Replaces the LM's KV cache."""
    sampling.validate()
    if known.is_complete:
        return known
    device = lm.model.embed_tokens.weight.device
    prompts = [tokenizer.encode(metadata_prompt(caption, lyrics), add_eos=False)]
    if sampling.guided:
        prompts.append(tokenizer.encode(metadata_uncond_prompt(lyrics), add_eos=False))
    segments, tries, end = _plan(tokenizer, known), value_tries(tokenizer), _newline(tokenizer)
    lm.setup_cache(len(prompts), max(map(len, prompts)) + _budget(segments, tries))
    writer = _Writer(lm, prompts, sampling, torch.tensor([seed], device=device))
    filled: dict[str, int | str] = {}
    for segment in segments:
        writer.force(segment.forced)
        if segment.key == "caption":
            text = _write_caption(writer, tokenizer, _caption_ids(tokenizer, device), end)
            filled["caption"] = _one_line(text) or caption
        else:
            value = _write_value(writer, tries[segment.key], end, greedy_first=segment.key == "language")
            filled[COT_FIELDS[segment.key]] = int(value) if segment.key in _NUMERIC_KEYS else value
    return replace(known, **filled)

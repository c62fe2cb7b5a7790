"""LM Phase 1 metadata CoT: the official YAML text, round trip, validation, and constrained generation on a tiny LM."""

import pytest
import torch
import yaml
from flowjam.engine.lm.metadata import (
    CAPTION_MAX_TOKENS,
    COT_FIELDS,
    VALUE_STRINGS,
    SongMetadata,
    generate_metadata,
)
from flowjam.engine.lm.prompts import metadata_prompt
from flowjam.engine.lm.sampling import SamplingParams
from flowjam.engine.models.lm import LM_PRESETS, Qwen3LM
from flowjam.engine.prompts import BPM_RANGE, DURATION_RANGE_S, KEY_SCALES, LANGUAGES, TIME_SIGNATURES

CAPTION = "lofi hip hop with dusty drums and a mellow rhodes"
LYRICS = "[verse]\nrain on the window\nslow and low"
BALLAD = (
    "An emotional ballad with soft piano and warm strings. "
    "The track opens with a gentle intro, then builds to a soaring chorus."
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def parse_cot(text: str) -> SongMetadata:
    """What a CoT block says, read back with PyYAML: the inverse `SongMetadata.cot()` must have."""
    data = yaml.safe_load(text) if text.strip() else {}
    return SongMetadata(**{COT_FIELDS[key]: value for key, value in data.items()})


@pytest.fixture(scope="module")
def lm() -> Qwen3LM:
    torch.manual_seed(0)
    model = Qwen3LM(LM_PRESETS["tiny"]).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" not in name:
                parameter.normal_(std=0.02)
    return model


class RecordingLM:
    """The real LM, passed through; records the tokens each cache row receives and the logits it returns."""

    def __init__(self, lm: Qwen3LM):
        self.lm, self.rows, self.outputs = lm, {}, []

    @property
    def model(self):
        return self.lm.model

    def setup_cache(self, batch, max_len):
        self.lm.setup_cache(batch, max_len)

    def prefill(self, ids, start=0, row=0):
        logits = self.lm.prefill(ids, start, row)
        self.rows[row] = ids[0].tolist()
        self.outputs.append((list(self.rows[row]), logits[0]))
        return logits

    def decode_step(self, tokens, positions, keys_end=None):
        logits = self.lm.decode_step(tokens, positions, keys_end)
        for row in range(tokens.shape[0]):
            assert int(positions[row]) == len(self.rows[row])
            self.rows[row].append(int(tokens[row]))
            self.outputs.append((list(self.rows[row]), logits[row]))
        return logits


class UnusableLM:
    def __getattr__(self, name):
        raise AssertionError(f"the LM was used ({name}) although the metadata was complete")


# ---- format ------------------------------------------------------------------------------------------------------


def test_cot_is_the_official_yaml_text():
    meta = SongMetadata(bpm=120, caption=BALLAD, duration_s=60, keyscale="B♭ major", language="no", timesignature=4)
    assert meta.cot() == (
        "bpm: 120\n"
        "caption: An emotional ballad with soft piano and warm strings. The track opens with\n"
        "  a gentle intro, then builds to a soaring chorus.\n"
        "duration: 60\n"
        "keyscale: B♭ major\n"
        "language: 'no'\n"
        "timesignature: 4"
    )
    assert SongMetadata(bpm=90, keyscale="F# minor").cot() == "bpm: 90\nkeyscale: F# minor"
    assert SongMetadata().cot() == ""


@pytest.mark.parametrize(
    "meta",
    [
        SongMetadata(bpm=120, caption=BALLAD, duration_s=60, keyscale="B♭ major", language="no", timesignature=4),
        SongMetadata(bpm=30, caption="Rock: loud # guitars", duration_s=600, keyscale="C major", timesignature=6),
        SongMetadata(caption="'quoted' start\nsecond line", language="yue"),
        SongMetadata(caption="yes", duration_s=10, language="unknown"),
        SongMetadata(),
    ],
)
def test_cot_reads_back_as_the_same_metadata(meta):
    assert parse_cot(meta.cot()) == meta


def test_metadata_is_complete_once_bpm_key_time_signature_and_duration_are_given():
    assert not SongMetadata().is_complete
    assert not SongMetadata(bpm=100, caption="x", keyscale="D minor").is_complete
    assert SongMetadata(
        bpm=100, duration_s=30, keyscale="D minor", timesignature=3
    ).is_complete  # caption, language: no LM


def test_open_values_get_the_tokens_of_the_training_text(tokenizer):
    """A key, then its value, then the newline, tokenised apart = "key: value\\n" tokenised as one text."""
    for key, values in VALUE_STRINGS.items():
        for value in values:
            parts = [tokenizer.encode(text, add_eos=False) for text in (f"{key}:", f" {value}", "\n")]
            assert sum(parts, []) == tokenizer.encode(f"{key}: {value}\n", add_eos=False), (key, value)


# ---- validation ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"bpm": 500}, r"bpm must be a whole number in 30\.\.300"),
        ({"bpm": 120.5}, "bpm must be a whole number"),
        ({"bpm": True}, "bpm must be a whole number"),
        ({"duration_s": 5}, r"duration_s must be a whole number in 10\.\.600 seconds"),
        ({"keyscale": "H major"}, "keyscale 'H major' is not a note A-G"),
        ({"keyscale": "c major"}, "keyscale 'c major'"),
        ({"language": "english"}, "language 'english' is not one of ACE-Step's codes"),
        ({"timesignature": 5}, r"timesignature must be one of \(2, 3, 4, 6\)"),
        ({"timesignature": "4/4"}, "timesignature must be one of"),
        ({"caption": None}, "caption must be a string"),
    ],
)
def test_bad_metadata_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SongMetadata(**kwargs)


def test_bad_sampling_is_refused(lm, tokenizer):
    with pytest.raises(ValueError, match="LM cfg must be >= 1"):
        generate_metadata(lm, tokenizer, CAPTION, LYRICS, SongMetadata(), SamplingParams(cfg=0.5), 0)


# ---- generation --------------------------------------------------------------------------------------------------


def assert_valid(meta: SongMetadata) -> None:
    assert BPM_RANGE[0] <= meta.bpm <= BPM_RANGE[1]
    assert DURATION_RANGE_S[0] <= meta.duration_s <= DURATION_RANGE_S[1]
    assert meta.keyscale in KEY_SCALES and meta.language in LANGUAGES and meta.timesignature in TIME_SIGNATURES
    assert meta.caption, "the caption was left empty"


@pytest.mark.parametrize("cfg", [1.0, 2.0])
def test_known_fields_are_kept_and_missing_ones_filled_with_valid_values(lm, tokenizer, cfg):
    known = SongMetadata(caption=CAPTION, bpm=85, keyscale="F# minor")
    meta = generate_metadata(lm, tokenizer, CAPTION, LYRICS, known, SamplingParams(cfg=cfg), seed=7)
    assert_valid(meta)
    assert (meta.caption, meta.bpm, meta.keyscale) == (CAPTION, 85, "F# minor")
    assert parse_cot(meta.cot()) == meta


def test_same_seed_same_metadata_and_seeds_differ(lm, tokenizer):
    known = SongMetadata(caption=CAPTION)
    results = [generate_metadata(lm, tokenizer, CAPTION, LYRICS, known, SamplingParams(), seed) for seed in range(5)]
    for meta in results:
        assert_valid(meta)
    assert generate_metadata(lm, tokenizer, CAPTION, LYRICS, known, SamplingParams(), 3) == results[3]
    assert any(len({getattr(meta, attr) for meta in results}) > 1 for attr in ("bpm", "duration_s", "keyscale"))


def test_the_lm_reads_the_training_tokens_of_the_cot_and_cached_logits_equal_a_full_pass(lm, tokenizer):
    spy = RecordingLM(lm)
    known = SongMetadata(caption=CAPTION, bpm=85, language="en")
    meta = generate_metadata(spy, tokenizer, CAPTION, LYRICS, known, SamplingParams(), seed=1)
    prompt = tokenizer.encode(metadata_prompt(CAPTION, LYRICS), add_eos=False)
    fed = spy.rows[0][len(prompt) :]
    text = (
        f"<think>\nbpm: 85\ncaption: {CAPTION}\nduration: {meta.duration_s}\nkeyscale: {meta.keyscale}\n"
        f"language: en\ntimesignature: {meta.timesignature}\n</think>"
    )
    full = tokenizer.encode(text, add_eos=False)
    assert spy.rows[0][: len(prompt)] == prompt
    assert fed == full[: len(fed)] and len(full) - len(fed) <= 3  # the last value's last token, "\n", "</think>"
    assert spy.rows[1][-len(fed) :] == fed  # the unconditional row reads the same CoT
    with torch.no_grad():
        for ids, logits in spy.outputs:
            torch.testing.assert_close(logits, lm(torch.tensor([ids]))[0, -1], rtol=1e-4, atol=1e-5)


def test_an_empty_caption_is_written_by_the_lm(lm, tokenizer):
    known = SongMetadata(bpm=100, duration_s=30, keyscale="G major")
    greedy = SamplingParams(temperature=0.0)  # the argmax keeps this 512-token walk fast
    meta = generate_metadata(lm, tokenizer, CAPTION, LYRICS, known, greedy, seed=0)
    assert_valid(meta)
    assert meta.caption and "\n" not in meta.caption and "`" not in meta.caption
    assert len(tokenizer.encode(meta.caption, add_eos=False)) <= CAPTION_MAX_TOKENS
    assert generate_metadata(lm, tokenizer, CAPTION, LYRICS, known, greedy, seed=0) == meta


def test_complete_metadata_does_not_run_the_lm(tokenizer):
    known = SongMetadata(bpm=100, duration_s=30, keyscale="G major", timesignature=4)
    assert generate_metadata(UnusableLM(), tokenizer, CAPTION, LYRICS, known, SamplingParams(), 0) is known

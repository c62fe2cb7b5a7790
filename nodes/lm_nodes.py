"""The 5 Hz LM node: a prompt becomes a song structure (audio codes) that Generate and Stream can follow."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from ..engine.params import LATENT_RATE_HZ, LM_PRESET_NAMES
from . import comfy_io, comfy_models
from .spec import CATEGORY, MODEL, STRUCTURE, NodeInputError, NodeSpec, Output, Param, check_range

_lm_lock = threading.Lock()
LM_FIX = (
    "pick LM weights in 'lm_checkpoint' (qwen_1.7b_ace15 / qwen_4b_ace15 in ComfyUI/models/text_encoders/, or an "
    "all-in-one checkpoint in ComfyUI/models/checkpoints/)"
)


@dataclass(frozen=True)
class Structure:
    """LM codes for one song (5 per second) and the metadata the LM wrote or was given."""

    codes: Any  # torch int64 [N]
    cot: str

    @property
    def seconds(self) -> float:
        from ..engine.lm.song import CODE_RATE_HZ

        return len(self.codes) / CODE_RATE_HZ


def _attach_lm(model, checkpoint: str, preset: str, sampling) -> None:
    """The model's LM, loaded once per (checkpoint, preset); sampling settings follow the node on every run."""
    path = comfy_io.resolve_checkpoint(checkpoint, "LM structure", LM_FIX)
    comfy_io.check_preset("LM structure", "lm_preset", preset, LM_PRESET_NAMES, path, LM_FIX)
    with _lm_lock:
        if model.song_writer is None or model.lm_origin != (None if path is None else str(path), preset, 0):
            try:
                model.attach_lm(path, preset=preset)
            except ValueError as error:
                raise NodeInputError(f"LM structure: {error}") from None
        model.song_writer.generator.set_sampling(sampling)


def lm_structure(
    model,
    caption: str,
    seconds: float,
    lyrics: str,
    bpm: int,
    key: str,
    time_signature: str,
    seed: int,
    cfg: float,
    temperature: float,
    top_p: float,
    lm_checkpoint: str,
    lm_preset: str,
) -> tuple:
    """The song structure, with ComfyUI's progress bar over its codes; Cancel stops it at the next code."""
    from ..engine.lm.sampling import SamplingParams
    from ..engine.lm.song import codes_for_seconds

    check_range("LM structure", "seconds", seconds, 10.0, 600.0)
    sampling = SamplingParams(temperature=temperature, top_p=top_p, cfg=cfg)
    try:
        sampling.validate()
    except ValueError as error:
        raise NodeInputError(f"LM structure: {error}") from None
    comfy_models.use(model)  # the LM loads on the session's device
    _attach_lm(model, lm_checkpoint, lm_preset, sampling)
    try:
        song = model.generate_codes(
            caption,
            seconds,
            lyrics=lyrics,
            bpm=bpm or None,
            key=key.strip() or None,
            time_signature=time_signature.strip() or None,
            seeds=(seed,),
            on_code=comfy_io.progress(codes_for_seconds(seconds)),
        )
    except ValueError as error:
        raise NodeInputError(f"LM structure: {error}") from None
    cot = song.metadata.cot()
    return Structure(song.codes[0], cot), cot


def structure_context(node: str, model, structure: Structure, frames: int):
    """A structure -> the DiT context latents for `frames` (a clear error when it is too short)."""
    try:
        return model.codes_context(structure.codes, frames)
    except ValueError:
        raise NodeInputError(
            f"{node}: input 'structure' covers {structure.seconds:g} s but {frames / LATENT_RATE_HZ:g} s are generated; "
            "raise 'seconds' on LM structure"
        ) from None


NODES = (
    NodeSpec(
        "FlowjamLMStructure",
        "flowjam LM structure",
        f"{CATEGORY}/conditioning",
        "The 5 Hz LM writes a song structure (audio codes, 5 per second) from the prompt; it writes bpm, key and "
        "time signature too when you leave them open. Connect it to Generate or Stream.",
        (
            Param("model", MODEL, "A flowjam model from Load model"),
            Param(
                "caption",
                "STRING",
                "Caption: genre, instruments, mood (the same text as Text conditioning)",
                "ambient pads, slow evolving synth",
                multiline=True,
            ),
            Param("seconds", "FLOAT", "Song length the codes cover, 10..600 s", 30.0, 10.0, 600.0, 0.2),
            Param("lyrics", "STRING", "Lyrics; empty = instrumental", "", multiline=True),
            Param("bpm", "INT", "Tempo, 30..300 (0 = the LM chooses)", 0, 0, 300, 1),
            Param("key", "STRING", "Key scale such as 'G major' (empty = the LM chooses)", ""),
            Param("time_signature", "STRING", "2, 3, 4 or 6 (empty = the LM chooses)", ""),
            Param("seed", "INT", "Sampling seed: same seed, same structure", 0, 0, 2**31 - 1, 1),
            Param("cfg", "FLOAT", "LM guidance (1 = off, 2 = official default)", 2.0, 1.0, 10.0, 0.1),
            Param("temperature", "FLOAT", "Sampling temperature (0 = greedy)", 0.85, 0.0, 2.0, 0.01),
            Param("top_p", "FLOAT", "Nucleus sampling mass (1 = off)", 0.9, 0.01, 1.0, 0.01),
            Param(
                "lm_checkpoint",
                "COMBO",
                "LM weights from text_encoders/ (qwen_1.7b_ace15, qwen_4b_ace15) or an all-in-one checkpoint; none = lm_preset",
                "none",
                options=lambda: ("none", *comfy_io.lm_folder_files()),
            ),
            Param(
                "lm_preset",
                "COMBO",
                "Used when lm_checkpoint is none: tiny is a small seeded test LM (no files, random structure)",
                "tiny",
                options=comfy_io.NODE_PRESETS,
                legacy=tuple(p for p in LM_PRESET_NAMES if p not in comfy_io.NODE_PRESETS),
            ),
        ),
        (Output(STRUCTURE, "structure"), Output("STRING", "metadata", "The metadata the codes follow (YAML)")),
        lm_structure,
    ),
)

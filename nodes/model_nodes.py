"""Batch nodes: load a model, encode text, blend conditions, prepare a source, curves, one-shot generation."""

from __future__ import annotations

import threading
from weakref import WeakValueDictionary

from ..engine.params import (
    BACKENDS,
    CURVE_OPS,
    DEFAULT_STEPS,
    DTYPES,
    LATENT_RATE_HZ,
    MAX_SONG_SECONDS,
    MIN_SONG_SECONDS,
    PRESET_NAMES,
    WAVE_KINDS,
    seconds_to_frames,
)
from ..engine.prompts import DEFAULT_DURATION_S, DURATION_RANGE_S
from . import comfy_io, comfy_models
from .lm_nodes import structure_context
from .lora_nodes import with_loras
from .spec import (
    AUDIO,
    CATEGORY,
    CONDITIONING,
    CURVE,
    LATENT,
    MODEL,
    SOURCE,
    STRUCTURE,
    NodeInputError,
    NodeSpec,
    Output,
    Param,
    check_range,
)

TASKS = ("text2music", "cover", "repaint")
EXAMPLE_BARS_MAX, EXAMPLE_BPM, EXAMPLE_RATE = 16, (60, 200), 48_000
CHECKPOINT_FIX = (
    "pick ACE-Step 1.5 weights in 'checkpoint' (files in ComfyUI/models/diffusion_models/ or "
    "ComfyUI/models/checkpoints/)"
)
_sessions: WeakValueDictionary = WeakValueDictionary()  # a session lives while a graph's cache or a stream holds it
_load_lock = threading.Lock()


def _device(choice: str) -> str:
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if choice == "auto" else choice


def load_model(preset: str, checkpoint: str, device: str, dtype: str, backend: str) -> tuple:
    """Load once per (preset, checkpoint, device, dtype) while anything holds the session: re-queued graphs reuse it;
    after ComfyUI frees its cache (and no stream plays it) it is freed, and the next run loads it again."""
    import torch

    from ..engine.checkpoints.loading import CheckpointError
    from ..engine.session import Session

    path = comfy_io.resolve_checkpoint(checkpoint)
    comfy_io.check_preset("Load model", "preset", preset, PRESET_NAMES, path, CHECKPOINT_FIX)
    key = (preset, str(path), _device(device), dtype)
    with _load_lock:
        session = _sessions.get(key)
        if session is None:
            try:
                session = Session.load(path, preset=preset, device=key[2], dtype=getattr(torch, dtype))
            except CheckpointError as error:
                raise NodeInputError(f"Load model: input 'checkpoint' {checkpoint!r}: {error}") from None
            _sessions[key] = session
            comfy_models.give_back_when_freed(session)
    session.backend = backend
    return (session,)


def text_conditioning(
    model, tags: str, lyrics: str, bpm: int, key: str, time_signature: str, duration: float, task: str, language: str
) -> tuple:
    if not tags.strip():
        raise NodeInputError("Text conditioning: input 'tags' is empty; describe the music (genre, instruments, mood)")
    if task not in TASKS:
        raise NodeInputError(f"Text conditioning: input 'task' must be one of {', '.join(TASKS)}")
    low, high = DURATION_RANGE_S
    if duration != 0 and not low <= duration <= high:  # NaN fails both comparisons
        given = "is not a number" if duration != duration else f"= {duration:g} s is outside {low}..{high} s"
        raise NodeInputError(
            f"Text conditioning: input 'duration' {given}; give seconds between {low} and {high} "
            f"(0 = {DEFAULT_DURATION_S} s)"
        )
    comfy_models.use(model)
    try:
        conditioning = model.encode_text(
            tags,
            lyrics,
            bpm=bpm or None,
            key=key.strip() or None,
            time_signature=time_signature.strip() or None,
            duration_s=duration or None,
            task=task,
            language=language.strip() or "unknown",
        )
    except ValueError as error:
        raise NodeInputError(f"Text conditioning: {error}") from None
    return (conditioning,)


def blend_conditioning(model, a, b, amount: float) -> tuple:
    check_range("Conditioning blend", "amount", amount, 0.0, 1.0)
    comfy_models.use(model)
    return (model.blend_conditionings(a, b, amount),)


def prepare_source(model, audio=None, latent=None) -> tuple:
    """ComfyUI AUDIO (any rate, mono or stereo) or an ACE-Step 1.5 audio LATENT -> a flowjam source."""
    import torch

    from ..engine.session import Source

    if (audio is None) == (latent is None):
        raise NodeInputError("Prepare source: connect exactly one of 'audio' or 'latent'")
    comfy_models.use(model)
    if audio is not None:
        waveform, rate = comfy_io.audio_from_comfy("Prepare source", audio)
        return (model.prepare_source(waveform, rate),)
    latents = comfy_io.latent_from_comfy("Prepare source", latent).to(model.device, model.dtype)
    with torch.no_grad():
        quantized, codes = model.models.acestep.tokenize(latents, model.models.silence_latent)
        hints = model.models.acestep.detokenize(quantized)[:, : latents.shape[1]]
    return (Source(latents, hints, codes[..., 0]),)


def example_song(bars: int, bpm: int) -> tuple:
    """A song made in code (engine/audio/example_song.py) as ComfyUI AUDIO: a cover example needs no file."""
    from ..engine.audio.example_song import example_song as synthesize

    check_range("Example song", "bars", bars, 1, EXAMPLE_BARS_MAX)
    check_range("Example song", "bpm", bpm, *EXAMPLE_BPM)
    return (comfy_io.audio_to_comfy(synthesize(int(bars), float(bpm), EXAMPLE_RATE), EXAMPLE_RATE),)


def _frames(node: str, seconds: float) -> int:
    return seconds_to_frames(check_range(node, "seconds", seconds, MIN_SONG_SECONDS, MAX_SONG_SECONDS))


def curve_constant(value: float, seconds: float) -> tuple:
    from ..engine.sampling import curves

    return (curves.constant(check_range("Curve constant", "value", value), _frames("Curve constant", seconds)),)


def curve_ramp(start: float, end: float, seconds: float) -> tuple:
    from ..engine.sampling import curves

    return (
        curves.ramp(
            check_range("Curve ramp", "start", start),
            check_range("Curve ramp", "end", end),
            _frames("Curve ramp", seconds),
        ),
    )


def curve_wave(kind: str, cycles: float, low: float, high: float, seconds: float) -> tuple:
    from ..engine.sampling import curves

    if kind not in WAVE_KINDS:
        raise NodeInputError(f"Curve wave: input 'kind' must be one of {', '.join(WAVE_KINDS)}")
    return (
        curves.wave(
            _frames("Curve wave", seconds),
            kind,
            cycles=check_range("Curve wave", "cycles", cycles, 0.0),
            low=low,
            high=high,
        ),
    )


def curve_points(points: str, seconds: float) -> tuple:
    """Comma-separated values spread evenly, or "x:y" pairs with x in 0..1 (drawn automation)."""
    from ..engine.sampling import curves

    text = [p.strip() for p in points.replace("\n", ",").split(",") if p.strip()]
    try:
        parsed = [tuple(float(v) for v in p.split(":")) if ":" in p else float(p) for p in text]
    except ValueError:
        raise NodeInputError(
            "Curve points: input 'points' must be numbers like '0, 0.5, 1' or pairs like '0:0, 0.5:1, 1:0'"
        ) from None
    if not parsed:
        raise NodeInputError("Curve points: input 'points' is empty")
    return (curves.from_points(parsed, _frames("Curve points", seconds)),)


def curve_math(a, b, op: str) -> tuple:
    from ..engine.sampling import curves

    if op not in CURVE_OPS:
        raise NodeInputError(f"Curve math: input 'op' must be one of {', '.join(CURVE_OPS)}")
    try:
        return (curves.combine(a, b, op),)
    except ValueError as error:
        raise NodeInputError(f"Curve math: {error}") from None


def generate(
    model,
    conditioning,
    seconds: float,
    seed: int,
    steps: int,
    shift: float,
    denoise: float,
    source=None,
    velocity_scale=None,
    structure=None,
) -> tuple:
    """One-shot generation with ComfyUI's progress bar; AUDIO for Save/Preview Audio and the audio LATENT."""
    check_range("Generate", "seconds", seconds, MIN_SONG_SECONDS, MAX_SONG_SECONDS)
    check_range("Generate", "denoise", denoise, 0.0, 1.0)
    if denoise < 1.0 and source is None:
        raise NodeInputError(
            "Generate: input 'denoise' below 1 needs a 'source' to start from (connect Prepare source)"
        )
    if structure is not None and source is not None:
        raise NodeInputError("Generate: connect either 'source' (a cover) or 'structure' (LM structure), not both")
    model = with_loras("Generate", model)
    comfy_models.use(model)
    progress = comfy_io.progress(steps)
    options = {} if velocity_scale is None else {"velocity_scale": _fit_curve(velocity_scale, source, seconds)}
    if structure is not None:
        options["context_latents"] = structure_context("Generate", model, structure, seconds_to_frames(seconds))
    try:
        latent = model.generate(
            conditioning,
            seconds,
            seed=seed,
            steps=steps,
            shift=shift,
            denoise=denoise,
            source=source,
            on_step=progress,
            **options,
        )
    except ValueError as error:
        raise NodeInputError(f"Generate: {error}") from None
    from ..engine.session import peak_normalize

    audio = peak_normalize(model.decode(latent))
    return comfy_io.audio_to_comfy(audio, model.sample_rate), comfy_io.latent_to_comfy(latent)


def _fit_curve(curve, source, seconds: float):
    """Resample a curve to the generation's frame count."""
    from ..engine.sampling import curves

    frames = source.frames if source is not None else seconds_to_frames(seconds)
    return curve if curve.numel() in (1, frames) else curves.resample(curve.flatten(), frames)


def _model_param() -> Param:
    return Param("model", MODEL, "A flowjam model from Load model")


SECONDS = Param(
    "seconds",
    "FLOAT",
    f"Length in seconds ({LATENT_RATE_HZ} latent frames per second)",
    10.0,
    MIN_SONG_SECONDS,
    MAX_SONG_SECONDS,
    MIN_SONG_SECONDS,
)

NODES = (
    NodeSpec(
        "FlowjamLoadModel",
        "flowjam Load model",
        f"{CATEGORY}/model",
        "Load ACE-Step 1.5 weights from ComfyUI's model folders (or the tiny test preset, no files) once per process.",
        (
            Param(
                "preset",
                "COMBO",
                "Used when checkpoint is none: tiny is a small seeded test network (no files, noise-like sound); "
                "real music needs ACE-Step 1.5 weights in checkpoint",
                "tiny",
                options=comfy_io.NODE_PRESETS,
                legacy=tuple(p for p in PRESET_NAMES if p not in comfy_io.NODE_PRESETS),
            ),
            Param(
                "checkpoint",
                "COMBO",
                "ACE-Step 1.5 weights from diffusion_models/ or checkpoints/ (none = the tiny test preset)",
                "none",
                options=lambda: ("none", *comfy_io.model_folder_files()),
            ),
            Param("device", "COMBO", "Where the networks run", "auto", options=("auto", "cpu", "cuda")),
            Param(
                "dtype",
                "COMBO",
                "Weights and activations precision (bf16 on GPUs)",
                DTYPES[0],
                options=DTYPES,
            ),
            Param(
                "backend",
                "COMBO",
                "How streams run the DiT: eager; compile (torch.compile, faster after a one-time compile); graph "
                "(each tick one CUDA-graph replay); compile-graph (both: the fastest on a GPU)",
                "eager",
                options=BACKENDS,
            ),
        ),
        (Output(MODEL, "model"),),
        load_model,
    ),
    NodeSpec(
        "FlowjamTextConditioning",
        "flowjam Text conditioning",
        f"{CATEGORY}/conditioning",
        "Encode tags, lyrics and song metadata into the condition the DiT listens to.",
        (
            _model_param(),
            Param(
                "tags",
                "STRING",
                "Caption: genre, instruments, mood, production",
                "ambient pads, slow evolving synth",
                multiline=True,
            ),
            Param("lyrics", "STRING", "Lyrics with [Verse]/[Chorus] tags; empty = instrumental", "", multiline=True),
            Param("bpm", "INT", "Tempo, 30..300 (0 = not given)", 0, 0, 300, 1),
            Param("key", "STRING", "Key scale such as 'G major' or 'F# minor' (empty = not given)", ""),
            Param("time_signature", "STRING", "2, 3, 4 or 6 (or '4/4'); empty = not given", ""),
            Param(
                "duration",
                "FLOAT",
                f"Song duration written into the prompt, {DURATION_RANGE_S[0]}..{DURATION_RANGE_S[1]} s "
                f"(0 = {DEFAULT_DURATION_S} s)",
                0.0,
                0.0,
                MAX_SONG_SECONDS,
                1.0,
            ),
            Param("task", "COMBO", "text2music from silence, or cover (with a source)", "text2music", options=TASKS),
            Param("language", "STRING", "Lyrics language code (en, zh, ja, ...; empty = unknown)", ""),
        ),
        (Output(CONDITIONING, "conditioning"),),
        text_conditioning,
    ),
    NodeSpec(
        "FlowjamConditioningBlend",
        "flowjam Conditioning blend",
        f"{CATEGORY}/conditioning",
        "Morph between two prompts in embedding space.",
        (
            _model_param(),
            Param("a", CONDITIONING, "Prompt at amount 0"),
            Param("b", CONDITIONING, "Prompt at amount 1"),
            Param("amount", "FLOAT", "0 = a, 1 = b", 0.5, 0.0, 1.0, 0.01),
        ),
        (Output(CONDITIONING, "conditioning"),),
        blend_conditioning,
    ),
    NodeSpec(
        "FlowjamPrepareSource",
        "flowjam Prepare source",
        f"{CATEGORY}/conditioning",
        "Encode source audio (ComfyUI AUDIO, any rate) or an ACE-Step 1.5 audio LATENT for covers and live loops.",
        (
            _model_param(),
            Param("audio", AUDIO, "Audio to cover (LoadAudio)", optional=True),
            Param("latent", LATENT, "Or an ACE-Step 1.5 audio latent from ComfyUI's own nodes", optional=True),
        ),
        (Output(SOURCE, "source"),),
        prepare_source,
    ),
    NodeSpec(
        "FlowjamExampleSong",
        "flowjam Example song",
        f"{CATEGORY}/conditioning",
        "A short song made in code (C, G, Am, F with bass, arpeggio and drums): music to cover with no file to find.",
        (
            Param(
                "bars", "INT", "Length in bars of 4 beats; the chords repeat every 4 bars", 4, 1, EXAMPLE_BARS_MAX, 1
            ),
            Param("bpm", "INT", "Tempo in beats per minute", 120, *EXAMPLE_BPM, 1),
        ),
        (Output(AUDIO, "audio", "48 kHz stereo; 4 bars at 120 bpm = 8 s"),),
        example_song,
    ),
    NodeSpec(
        "FlowjamCurveConstant",
        "flowjam Curve constant",
        f"{CATEGORY}/curves",
        "A flat per-frame curve.",
        (Param("value", "FLOAT", "Value at every frame", 1.0, -100.0, 100.0, 0.01), SECONDS),
        (Output(CURVE, "curve"),),
        curve_constant,
    ),
    NodeSpec(
        "FlowjamCurveRamp",
        "flowjam Curve ramp",
        f"{CATEGORY}/curves",
        "A straight line from start to end over the song.",
        (
            Param("start", "FLOAT", "Value at the first frame", 0.0, -100.0, 100.0, 0.01),
            Param("end", "FLOAT", "Value at the last frame", 1.0, -100.0, 100.0, 0.01),
            SECONDS,
        ),
        (Output(CURVE, "curve"),),
        curve_ramp,
    ),
    NodeSpec(
        "FlowjamCurveWave",
        "flowjam Curve wave",
        f"{CATEGORY}/curves",
        "A periodic curve that loops without a seam.",
        (
            Param("kind", "COMBO", "Wave shape", "sine", options=WAVE_KINDS),
            Param("cycles", "FLOAT", "Cycles over the whole song", 2.0, 0.0, 1000.0, 0.25),
            Param("low", "FLOAT", "Minimum", 0.0, -100.0, 100.0, 0.01),
            Param("high", "FLOAT", "Maximum", 1.0, -100.0, 100.0, 0.01),
            SECONDS,
        ),
        (Output(CURVE, "curve"),),
        curve_wave,
    ),
    NodeSpec(
        "FlowjamCurvePoints",
        "flowjam Curve points",
        f"{CATEGORY}/curves",
        "A drawn curve: values spread evenly, or x:y breakpoints (x from 0 to 1), linearly interpolated.",
        (Param("points", "STRING", "'0, 1, 0.5' or '0:0, 0.25:1, 1:0'", "0:1, 0.5:1.4, 1:1", multiline=True), SECONDS),
        (Output(CURVE, "curve"),),
        curve_points,
    ),
    NodeSpec(
        "FlowjamCurveMath",
        "flowjam Curve math",
        f"{CATEGORY}/curves",
        "Combine two curves frame by frame.",
        (
            Param("a", CURVE, "First curve"),
            Param("b", CURVE, "Second curve"),
            Param("op", "COMBO", "Operation", "multiply", options=CURVE_OPS),
        ),
        (Output(CURVE, "curve"),),
        curve_math,
    ),
    NodeSpec(
        "FlowjamGenerate",
        "flowjam Generate",
        f"{CATEGORY}/generate",
        "One-shot generation: AUDIO for Save/Preview Audio and the audio LATENT for VAEDecodeAudio.",
        (
            _model_param(),
            Param("conditioning", CONDITIONING, "What to play (Text conditioning)"),
            SECONDS,
            Param("seed", "INT", "Noise seed: same seed, same music", 42, 0, 2**31 - 1, 1),
            Param("steps", "INT", f"Denoising steps (turbo: {DEFAULT_STEPS})", DEFAULT_STEPS, 1, 50, 1),
            Param("shift", "FLOAT", "Timestep shift (turbo: 3)", 3.0, 1.0, 10.0, 0.1),
            Param("denoise", "FLOAT", "1 = from noise; below 1 keeps that much of the source", 1.0, 0.0, 1.0, 0.01),
            Param(
                "source", SOURCE, "Source to cover (Prepare source); its length sets the output length", optional=True
            ),
            Param("velocity_scale", CURVE, "Per-frame velocity scale curve", optional=True),
            Param("structure", STRUCTURE, "Song structure from LM structure (text-only songs)", optional=True),
        ),
        (Output(AUDIO, "audio"), Output(LATENT, "latent")),
        generate,
    ),
)

"""The parameter registry: every name and range a player, a node or the command line can set, in one torch-free
place. The stream, the knob registry, the nodes and the CLI import these instead of keeping copies."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

LATENT_RATE_HZ = 25  # latent frames per second (48 kHz / 1920-sample hop)

PRESET_NAMES = ("tiny", "turbo-2b", "xl")  # DiT + encoders + VAE shapes (engine/models/presets.py)
LM_PRESET_NAMES = ("tiny", "lm-0.6b", "lm-1.7b", "lm-4b")  # 5 Hz LM shapes (engine/models/lm.py)

BACKENDS = ("eager", "compile", "graph", "compile-graph")  # how a stream runs its ticks (engine/stream/backends.py)
PRECISIONS = ("bf16", "fp8")  # the DiT's per-tick linear layers: the model's dtype, or FP8 (engine/models/fp8.py)
CFG_MODES = ("off", "full", "initialize", "self")  # off: turbo's own (CFG-distilled); full: uncond row every step
GUIDANCE_METHODS = ("apg", "cfg")
SOLVERS = ("ode", "sde")
DCW_MODES = ("low", "high", "double", "pix")
WAVE_KINDS = ("sine", "square", "triangle", "pulse", "saw")
CURVE_OPS = ("add", "subtract", "multiply", "min", "max")
DTYPES = ("float32", "bfloat16")  # the model dtypes the command line offers

DEFAULT_STEPS = 8  # denoising steps per generation: the turbo model's
MAX_STEPS = 200  # the longest timestep schedule the engine builds (engine/sampling/schedule.py)
DEFAULT_SHIFT = 3.0  # timestep schedule shift
DEFAULT_PRECISION = PRECISIONS[0]
REALTIME_LATENT_INTERVAL_MS = 250.0  # a live session needs a fresh latent at least this often to play in real time
MAX_PROMPT_CHARS = 4096  # a caption (prompt A, B or negative) from the command line, OSC or a served session


MAX_SEED = 2**63 - 1  # seeds are 64-bit generator seeds: a larger one would wrap around to another seed's noise


def check_seed(seed: int, option: str = "--seed") -> int:
    """`seed` if it is a whole number in 0..MAX_SEED; else ValueError naming the range."""
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{option} must be a whole number from 0 to {MAX_SEED} (2**63 - 1), got {seed}")
    return seed


def check_prompt_length(text: str, what: str = "prompt") -> str:
    """`text` if it fits MAX_PROMPT_CHARS; else ValueError naming the limit."""
    if len(text) > MAX_PROMPT_CHARS:
        raise ValueError(f"{what} has {len(text)} characters; a prompt takes at most {MAX_PROMPT_CHARS}")
    return text


def seconds_to_frames(seconds: float) -> int:
    """Latent frames for a length in seconds (at least one)."""
    if not seconds > 0 or not math.isfinite(seconds):
        raise ValueError(f"seconds must be a finite number > 0, got {seconds}")
    return max(1, round(seconds * LATENT_RATE_HZ))


class KnobKind(str, Enum):
    """When a change is felt."""

    SHARED = "shared"  # a shared curve: every in-flight slot, from the next tick
    REQUEST = "request"  # the next generation: felt once the next request enters the ring
    GLOBAL = "global"  # engine/playback-wide (ring depth, volume)


@dataclass(frozen=True)
class KnobSpec:
    """A playable parameter. A choice knob (`choices` set) holds the index of its choice as its value."""

    name: str
    minimum: float
    maximum: float
    default: float
    kind: KnobKind
    unit: str = ""
    integer: bool = False
    description: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.minimum < self.maximum:
            raise ValueError(f"knob {self.name!r}: minimum {self.minimum} must be below maximum {self.maximum}")
        if not self.minimum <= self.default <= self.maximum:
            raise ValueError(f"knob {self.name!r}: default {self.default} is outside [{self.minimum}, {self.maximum}]")
        if self.choices and (not self.integer or (self.minimum, self.maximum) != (0, len(self.choices) - 1)):
            raise ValueError(f"choice knob {self.name!r} must be an integer knob over 0..{len(self.choices) - 1}")

    def clamp(self, value: float) -> float:
        """The value limited to [minimum, maximum]; integer knobs round half up."""
        value = min(max(float(value), self.minimum), self.maximum)
        return float(math.floor(value + 0.5)) if self.integer else value

    def to_normalized(self, value: float) -> float:
        """The value as 0..1 of the knob's range (what a controller fader shows)."""
        return (self.clamp(value) - self.minimum) / (self.maximum - self.minimum)

    def unclamped(self, unit: float) -> float:
        """A 0..1 controller value mapped onto the range, not yet clamped (what the controller asked for)."""
        return self.minimum + float(unit) * (self.maximum - self.minimum)

    def choice(self, value: float) -> str:
        """The name a choice knob's value stands for."""
        return self.choices[int(self.clamp(value))]

    def index_of(self, choice: str) -> float:
        """A choice knob's value for a choice name; ValueError naming the valid ones."""
        if choice not in self.choices:
            raise ValueError(f"knob {self.name!r} takes one of {', '.join(self.choices)}, got {choice!r}")
        return float(self.choices.index(choice))


S, R, G = KnobKind.SHARED, KnobKind.REQUEST, KnobKind.GLOBAL
KNOB_SPECS: tuple[KnobSpec, ...] = (
    KnobSpec("velocity_scale", 0.0, 2.0, 1.0, S, description="scales the predicted velocity of every step"),
    KnobSpec("ode_noise", 0.0, 1.0, 0.0, S, description="fresh noise injected after each ODE step"),
    KnobSpec(
        "sde_denoise",
        0.0,
        1.0,
        1.0,
        S,
        description="per-frame pull back toward the previous loop (SDE re-noise); 1 = off",
    ),
    KnobSpec(
        "x0_target_strength",
        0.0,
        1.0,
        0.0,
        S,
        description="pull of the late steps toward the target (source or captured loop)",
    ),
    KnobSpec("guidance", 1.0, 10.0, 1.0, S, description="guidance scale; acts when cfg_mode is not off"),
    KnobSpec(
        "cfg_rescale",
        0.0,
        1.0,
        0.0,
        S,
        description="rescales the guided velocity toward the positive one; acts when cfg_mode is not off",
    ),
    KnobSpec(
        "apg_momentum",
        -1.0,
        0.0,
        -0.75,
        S,
        description="APG momentum of the guidance difference; acts when guidance > 1",
    ),
    KnobSpec(
        "denoise", 0.0, 1.0, 0.7, R, description="how far from the current loop each generation starts (1 = from noise)"
    ),
    KnobSpec("seed", 0.0, float(2**31 - 1), 42.0, R, integer=True, description="noise seed of the next generation"),
    KnobSpec(
        "steps",
        1.0,
        50.0,
        float(DEFAULT_STEPS),
        R,
        unit="steps",
        integer=True,
        description="denoising steps per generation",
    ),
    KnobSpec("shift", 1.0, 10.0, DEFAULT_SHIFT, R, description="timestep schedule shift"),
    KnobSpec("prompt_blend", 0.0, 1.0, 0.0, R, description="blend between prompt A (0) and prompt B (1)"),
    KnobSpec(
        "structure",
        0.0,
        1.0,
        1.0,
        R,
        description="steering by the structure hints (source audio or LM codes); 0 = silent context",
    ),
    KnobSpec(
        "cfg_mode",
        0.0,
        3.0,
        0.0,
        R,
        integer=True,
        choices=CFG_MODES,
        description="guidance rows: off (turbo is CFG-distilled), full, initialize (first step only), self",
    ),
    KnobSpec("depth", 1.0, 8.0, 4.0, G, unit="slots", integer=True, description="in-flight generations in the ring"),
    KnobSpec("volume", 0.0, 1.0, 0.8, G, description="playback gain"),
)
del S, R, G

# The step-time fields a shared curve overrides for every in-flight slot from the next tick: the shared knobs.
SHARED_FIELDS = tuple(spec.name for spec in KNOB_SPECS if spec.kind is KnobKind.SHARED)
KNOBS_BY_NAME = {spec.name: spec for spec in KNOB_SPECS}
LORA_KNOB_PREFIX = "lora/"  # a loaded LoRA's strength knob is lora/<name>
LORA_MODES = ("auto", "live", "folded", "merged")  # how a LoRA applies; see Session.load_lora
LORA_STRENGTH_RANGE = (0.0, 2.0)


def parse_lora_option(spec: str) -> tuple[Path, float]:
    """ "style.safetensors:0.7" -> (path, 0.7); a path alone means strength 1 (a --lora option). A colon that
    starts a path's part (C:\\loras\\x.safetensors) or belongs to an existing file's name is the path's; ValueError for
    a strength that is no number in LORA_STRENGTH_RANGE."""
    path, _, strength = spec.rpartition(":")
    if not path or "/" in strength or "\\" in strength or Path(spec).exists():
        return Path(spec), 1.0
    try:
        value = float(strength)
    except ValueError:
        raise ValueError(f"strength {strength!r} is not a number; write PATH:0.8") from None
    low, high = LORA_STRENGTH_RANGE
    if not low <= value <= high:
        raise ValueError(f"strength {strength} is outside {low:g}..{high:g}; write PATH:0.8")
    return Path(path), value


def lora_knob(name: str) -> KnobSpec:
    """The strength knob of a loaded LoRA: 0..2, default 1 (the strength it was trained at); felt like a shared
    curve, by every generation in flight from the next tick."""
    return KnobSpec(
        LORA_KNOB_PREFIX + name,
        *LORA_STRENGTH_RANGE,
        1.0,
        KnobKind.SHARED,
        description=f"strength of the LoRA {name!r}",
    )


MAX_SONG_SECONDS = 600.0  # ACE-Step 1.5 generates at most 10 minutes (its silence latent and captions stop there)
MIN_SONG_SECONDS = 1 / LATENT_RATE_HZ  # one latent frame
DEFAULT_WINDOW_SECONDS = 20.0  # generated per request (engine/stream/windows.py): ACE-Step's phrases span 10-20 s
MIN_WINDOW_SECONDS = 4.0  # below this a window keeps under 2 s of context: too little to continue a phrase


def song_frames(seconds: float, option: str = "seconds") -> int:
    """Latent frames of a song or loop length, refused outside MIN_SONG_SECONDS..MAX_SONG_SECONDS with `option`
    (the CLI flag) named. The upper limit is the model's; it also bounds the memory a render can ask for."""
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{option} must be a finite number > 0 (at most {MAX_SONG_SECONDS:g} s), got {seconds:g}")
    if seconds > MAX_SONG_SECONDS:
        raise ValueError(
            f"{option} {seconds:g} is longer than ACE-Step 1.5 generates (at most {MAX_SONG_SECONDS:g} s = 10 min); "
            f"use {option} {MAX_SONG_SECONDS:g} or less"
        )
    if seconds < MIN_SONG_SECONDS:
        raise ValueError(
            f"{option} {seconds:g} is shorter than one latent frame ({MIN_SONG_SECONDS:g} s); "
            f"use {option} {MIN_SONG_SECONDS:g} or more"
        )
    return seconds_to_frames(seconds)

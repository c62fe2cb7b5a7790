"""Find and load ACE-Step 1.5 weights (official folders, ComfyUI files, flowjam single files) or build a preset
from a seed. Everything loads from local files; nothing is ever downloaded.

Network shapes are read off the tensors. The DiT's sliding window is not in any tensor: it comes from the official
folder's config.json or a flowjam file's metadata; without either, only the official head size (128) implies the
official window (128), and other shapes are refused rather than guessed. The 5 Hz LM loads in lm/checkpoint.py."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ..models.acestep import AceStepModel
from ..models.presets import TURBO_2B, AceStepConfig, Preset, get_preset
from ..models.text_encoder import Qwen3TextEncoder
from ..models.text_tokenizer import Qwen3Tokenizer
from ..models.vae import OobleckVAE
from ..outputs import atomic_output
from ..params import LATENT_RATE_HZ, MAX_SONG_SECONDS
from . import key_maps

FLOWJAM_FORMAT = "flowjam-1"
SILENCE_FRAMES = round(MAX_SONG_SECONDS * LATENT_RATE_HZ)  # 15,000: the official silence_latent length
SILENCE_PROBE_SECONDS = 4


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or its tensors do not fit the network."""


@dataclass
class ModelBundle:
    """Every network a session needs, loaded and in eval mode."""

    name: str
    acestep: AceStepModel
    text_encoder: Qwen3TextEncoder
    tokenizer: Qwen3Tokenizer
    vae: OobleckVAE
    silence_latent: torch.Tensor  # [1, frames, 64]
    source: str

    @property
    def config(self) -> AceStepConfig:
        return self.acestep.config

    def to(self, device: torch.device | str, dtype: torch.dtype) -> ModelBundle:
        for net in (self.acestep, self.text_encoder, self.vae):
            net.to(device=device, dtype=dtype)
        self.silence_latent = self.silence_latent.to(device=device, dtype=dtype)
        return self

    @property
    def device(self) -> torch.device:
        return self.acestep.null_condition_emb.device

    @property
    def dtype(self) -> torch.dtype:
        return self.acestep.null_condition_emb.dtype


def silence_frames(silence_latent: torch.Tensor, frames: int) -> torch.Tensor:
    """`frames` frames of the silence latent [1, frames, C], repeating its last frame past the stored length."""
    stored = silence_latent.shape[1]
    if frames <= stored:
        return silence_latent[:, :frames]
    return torch.cat([silence_latent, silence_latent[:, -1:].expand(-1, frames - stored, -1)], dim=1)


def derive_silence_latent(vae: OobleckVAE) -> torch.Tensor:
    """The VAE latent of digital silence [1, 15000, C]: encode a few seconds of zeros, keep the head frames
    (edge effects) and repeat the steady middle frame. Used when no `silence_latent.pt` is at hand."""
    param = next(vae.parameters())
    zeros = torch.zeros(
        1, vae.config.audio_channels, SILENCE_PROBE_SECONDS * vae.sample_rate, device=param.device, dtype=param.dtype
    )
    with torch.no_grad():
        probe = vae.encode(zeros).transpose(1, 2)
    middle = probe.shape[1] // 2
    return silence_frames(probe[:, : middle + 1], SILENCE_FRAMES)


def build_random(
    preset: str | Preset = "tiny", seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> ModelBundle:
    """A preset with seeded random weights: the embedded default (`tiny`) or full shapes for benchmarks."""
    preset = get_preset(preset) if isinstance(preset, str) else preset
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        acestep, text, vae = AceStepModel(preset.dit), Qwen3TextEncoder(preset.text), OobleckVAE(preset.vae)
    vae.center_seeded_output()
    bundle = ModelBundle(
        name=preset.name,
        acestep=acestep.eval(),
        text_encoder=text.eval(),
        tokenizer=Qwen3Tokenizer.from_package(),
        vae=vae.eval(),
        silence_latent=torch.zeros(0),
        source=f"preset {preset.name} (seeded random weights, seed {seed})",
    )
    bundle.to(device, dtype)
    bundle.silence_latent = derive_silence_latent(bundle.vae)
    return bundle


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors and the metadata of a .safetensors file (CPU)."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {k: handle.get_tensor(k) for k in handle.keys()}, dict(handle.metadata() or {})
    except Exception as exc:  # safetensors raises several exception types for corrupt files
        raise unreadable_safetensors(path, exc) from exc


def safetensors_header(path: Path) -> tuple[list[str], dict[str, str]]:
    """The tensor names and the metadata of a .safetensors file, without reading its tensors."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            return list(handle.keys()), dict(handle.metadata() or {})
    except Exception as exc:  # safetensors raises several exception types for corrupt files
        raise unreadable_safetensors(path, exc) from exc


def unreadable_safetensors(path: Path, error: Exception) -> CheckpointError:
    """The error for a checkpoint file safetensors refused, saying what is wrong with it and the fix."""
    problem = safetensors_problem(path)
    if problem is None:
        return CheckpointError(f"cannot read {path}: {error}; is it a complete .safetensors file?")
    fix = (
        "pass a .safetensors checkpoint or its folder" if problem.startswith("is not") else "copy or download it again"
    )
    return CheckpointError(f"{path} {problem}; {fix}")


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with a file safetensors refused, to follow its path: empty, not a .safetensors file at all, or
    cut short (bytes of tensor data present of those its header describes). None when none of these."""
    size = path.stat().st_size
    if size == 0:
        return "is empty (0 bytes)"
    with path.open("rb") as handle:
        header_bytes = int.from_bytes(handle.read(8), "little") if size >= 8 else size
        try:
            header = json.loads(handle.read(header_bytes)) if 8 + header_bytes <= size else None
        except ValueError:
            header = None
    if not isinstance(header, dict):
        return "is not a .safetensors file (no valid header)"
    try:
        needed = max((entry["data_offsets"][1] for k, entry in header.items() if k != "__metadata__"), default=0)
    except (KeyError, IndexError, TypeError):
        needed = 0
    present = size - 8 - header_bytes
    if present < needed:
        return f"is truncated ({present:,} of {needed:,} bytes of tensor data)"
    return None


def read_sharded(folder: Path, stem: str = "model") -> dict[str, torch.Tensor]:
    """`{stem}.safetensors`, or the shards named by `{stem}.safetensors.index.json`, from an HF folder."""
    single, index = folder / f"{stem}.safetensors", folder / f"{stem}.safetensors.index.json"
    if single.is_file():
        return read_safetensors(single)[0]
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        state: dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(read_safetensors(folder / shard)[0])
        return state
    raise CheckpointError(f"{folder} has no {stem}.safetensors nor {stem}.safetensors.index.json")


def load_strict(net: nn.Module, state: Mapping[str, torch.Tensor], what: str, origin: str) -> None:
    """Load every tensor or raise one error that lists the missing, unexpected and mis-shaped keys."""
    expected = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    mismatched = sorted(
        f"{k} {tuple(state[k].shape)} != {expected[k]}"
        for k in expected.keys() & state.keys()
        if tuple(state[k].shape) != expected[k]
    )
    if missing or unexpected or mismatched:

        def listed(label: str, items: list[str]) -> str:
            return f"{len(items)} {label} ({', '.join(items[:6])}{', ...' if len(items) > 6 else ''})" if items else ""

        parts = "; ".join(
            p
            for p in (listed("missing", missing), listed("unexpected", unexpected), listed("mis-shaped", mismatched))
            if p
        )
        raise CheckpointError(f"{origin} does not fit the {what}: {parts}. Pass the matching file for the {what}.")
    check_float_weights(state, origin)
    net.load_state_dict({k: v.to(dtype=torch.float32) for k, v in state.items()}, strict=True, assign=True)


def check_float_weights(state: Mapping[str, torch.Tensor], origin: str) -> None:
    """Refuse integer (quantized) weights, naming the first such tensor and the fix: cast to float as they are, they
    load without a word and the network computes NaN or noise from them."""
    for key, tensor in state.items():
        if not tensor.is_floating_point():
            kind = str(tensor.dtype).removeprefix("torch.")
            raise CheckpointError(
                f"{origin}: tensor {key} holds {kind} weights (quantized); flowjam needs float weights: give a "
                "float16, bfloat16 or float32 checkpoint of the model"
            )


def assemble(
    name: str,
    dit_state: Mapping[str, torch.Tensor],
    text_state: Mapping[str, torch.Tensor],
    vae_state: Mapping[str, torch.Tensor],
    origins: tuple[str, str, str],
    tokenizer: Qwen3Tokenizer,
    silence_latent: torch.Tensor | None,
    config_overrides: Mapping[str, object] | None = None,
) -> ModelBundle:
    """Build networks whose shapes the state dicts dictate and load them strictly (kept in fp32 on CPU).

    `config_overrides` are the DiT config values no tensor holds (from config.json or a flowjam file's metadata).
    Without a sliding window among them only the official head size implies the official window (128)."""
    for state, marker, origin in (
        (dit_state, key_maps.DIT_MARKER, origins[0]),
        (text_state, "embed_tokens.weight", origins[1]),
        (vae_state, key_maps.VAE_MARKER, origins[2]),
    ):
        if marker not in state:
            raise CheckpointError(
                f"{origin} is not the expected kind of file (no {marker!r}); check which file goes where"
            )
    dit_config = key_maps.infer_acestep_config(dit_state)
    overrides = {k: v for k, v in (config_overrides or {}).items() if hasattr(dit_config, k)}
    if "sliding_window" not in overrides and dit_config.head_dim != TURBO_2B.head_dim:
        raise CheckpointError(
            f"{origins[0]} has head_dim {dit_config.head_dim}, not ACE-Step 1.5's {TURBO_2B.head_dim}, and no config "
            "gives its sliding window (the tensors do not hold it). Put the model's config.json (with "
            '"sliding_window") beside its model.safetensors in the official folder layout (acestep-v15-*/ next to '
            "vae/ and Qwen3-Embedding-0.6B/), or save the networks with save_flowjam_file, which records the window"
        )
    dit_config = replace(dit_config, **overrides)
    with torch.device("meta"):
        acestep = AceStepModel(dit_config)
        text = Qwen3TextEncoder(key_maps.infer_qwen3_config(text_state))
        vae = OobleckVAE(key_maps.infer_vae_config(vae_state))
    load_strict(acestep, dit_state, "ACE-Step DiT", origins[0])
    load_strict(text, text_state, "Qwen3 text encoder", origins[1])
    load_strict(vae, vae_state, "Oobleck VAE", origins[2])
    vae.eval()
    silence = silence_latent if silence_latent is not None else derive_silence_latent(vae)
    return ModelBundle(
        name, acestep.eval(), text.eval(), tokenizer, vae, silence.float(), source=", ".join(sorted(set(origins)))
    )


def load_silence_pt(path: Path) -> torch.Tensor:
    """The official `silence_latent.pt` ([1, 64, F] or [64, F], fp32) as [1, F, 64]."""
    tensor = torch.load(path, map_location="cpu", weights_only=True)
    tensor = tensor.reshape(-1, tensor.shape[-1]) if tensor.dim() != 2 else tensor
    return tensor.float().t().unsqueeze(0).contiguous()


# ---- layouts -------------------------------------------------------------------------------------------------


def load_official_folder(root: Path) -> ModelBundle:
    """The HF layout: <root>/acestep-v15-*/ (model.safetensors, config.json, silence_latent.pt), <root>/vae/,
    <root>/Qwen3-Embedding-0.6B/ (weights + vocab.json/merges.txt). `root` may also be the DiT folder itself."""
    dit_dir = root if (root / "config.json").is_file() and any(root.glob("model*.safetensors")) else None
    if dit_dir is None:
        candidates = sorted(p for p in root.glob("acestep-v15*") if p.is_dir())
        if not candidates:
            raise CheckpointError(f"{root} has no acestep-v15-* model folder; point at the folder that holds it")
        dit_dir = candidates[0]
    base = dit_dir.parent
    vae_dir, text_dir = base / "vae", base / "Qwen3-Embedding-0.6B"
    for folder in (vae_dir, text_dir):
        if not folder.is_dir():
            raise CheckpointError(
                f"missing {folder}: the official layout keeps vae/ and Qwen3-Embedding-0.6B/ beside {dit_dir.name}/"
            )
    overrides = {}
    config_path = dit_dir / "config.json"
    if config_path.is_file():
        raw = json.loads(config_path.read_text())
        overrides = {k: raw[k] for k in ("sliding_window", "rope_theta", "rms_norm_eps") if k in raw}
    silence_path = dit_dir / "silence_latent.pt"
    return assemble(
        dit_dir.name,
        read_sharded(dit_dir),
        key_maps.text_encoder_keys(read_sharded(text_dir)),
        key_maps.vae_keys(read_sharded(vae_dir, "diffusion_pytorch_model")),
        (str(dit_dir), str(text_dir), str(vae_dir)),
        Qwen3Tokenizer.load(text_dir),
        load_silence_pt(silence_path) if silence_path.is_file() else None,
        overrides,
    )


COMFY_DIT_FILES = ("acestep_v1.5_turbo.safetensors", "acestep_v1.5_xl_turbo_bf16.safetensors")
COMFY_TEXT_FILE = "qwen_0.6b_ace15.safetensors"
COMFY_VAE_FILE = "ace_1.5_vae.safetensors"
COMFY_AIO_FILE = "ace_step_1.5_turbo_aio.safetensors"


def load_comfy_files(dit_path: Path, text_path: Path, vae_path: Path, silence_path: Path | None = None) -> ModelBundle:
    """ComfyUI's split files: diffusion_models/, text_encoders/ and vae/ (key layouts mapped to official names)."""
    dit_state = read_safetensors(dit_path)[0]
    if any(k.startswith(key_maps.COMFY_DIT_PREFIX) for k in dit_state):
        dit_state = key_maps.strip_prefix(dit_state, key_maps.COMFY_DIT_PREFIX)
    return assemble(
        dit_path.stem,
        dit_state,
        key_maps.text_encoder_keys(read_safetensors(text_path)[0]),
        key_maps.vae_keys(read_safetensors(vae_path)[0]),
        (str(dit_path), str(text_path), str(vae_path)),
        Qwen3Tokenizer.from_package(),
        load_silence_pt(silence_path) if silence_path else None,
    )


def load_comfy_aio(path: Path) -> ModelBundle:
    """ComfyUI's all-in-one checkpoint (DiT, VAE, text encoder and LM under their own prefixes)."""
    state = read_safetensors(path)[0]
    return assemble(
        path.stem,
        key_maps.strip_prefix(state, key_maps.COMFY_DIT_PREFIX),
        key_maps.text_encoder_keys(key_maps.strip_prefix(state, key_maps.COMFY_AIO_TEXT_PREFIX)),
        key_maps.vae_keys(key_maps.strip_prefix(state, key_maps.COMFY_AIO_VAE_PREFIX)),
        (str(path),) * 3,
        Qwen3Tokenizer.from_package(),
        None,
    )


def save_flowjam_file(bundle: ModelBundle, path: str | Path) -> Path:
    """One safetensors holding every network (prefixes acestep./text_encoder./vae.) plus the silence latent."""
    tensors = {"silence_latent": bundle.silence_latent.detach().cpu().contiguous()}
    for prefix, net in (("acestep.", bundle.acestep), ("text_encoder.", bundle.text_encoder), ("vae.", bundle.vae)):
        tensors.update({prefix + k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()})
    meta = {"format": FLOWJAM_FORMAT, "name": bundle.name, "sliding_window": str(bundle.config.sliding_window)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(path) as temporary:
        save_file(tensors, str(temporary), metadata=meta)
    return path


def load_flowjam_file(path: Path, state: dict[str, torch.Tensor], meta: dict[str, str]) -> ModelBundle:
    return assemble(
        meta.get("name", path.stem),
        key_maps.strip_prefix(state, "acestep."),
        key_maps.strip_prefix(state, "text_encoder."),
        key_maps.strip_prefix(state, "vae."),
        (str(path),) * 3,
        Qwen3Tokenizer.from_package(),
        state.get("silence_latent"),
        {"sliding_window": int(meta["sliding_window"])} if "sliding_window" in meta else None,
    )


def load_file(path: Path) -> ModelBundle:
    """A single .safetensors: a flowjam file, a ComfyUI AIO, or a ComfyUI diffusion model with its siblings."""
    keys, meta = safetensors_header(path)
    if meta.get("format") == FLOWJAM_FORMAT:
        state, meta = read_safetensors(path)
        return load_flowjam_file(path, state, meta)
    if any(k.startswith(key_maps.COMFY_AIO_TEXT_PREFIX) for k in keys):
        return load_comfy_aio(path)
    if any(k.startswith(key_maps.COMFY_DIT_PREFIX) for k in keys) or key_maps.DIT_MARKER in keys:
        models = path.parent.parent
        return load_comfy_files(path, models / "text_encoders" / COMFY_TEXT_FILE, models / "vae" / COMFY_VAE_FILE)
    raise CheckpointError(f"{path} is not an ACE-Step 1.5 checkpoint flowjam knows (no DiT keys found)")


def load_comfy_models_dir(models: Path) -> ModelBundle:
    """A ComfyUI `models/` folder: the AIO checkpoint, else the split DiT + text encoder + VAE files."""
    aio = models / "checkpoints" / COMFY_AIO_FILE
    for name in COMFY_DIT_FILES:
        dit = models / "diffusion_models" / name
        if dit.is_file():
            return load_comfy_files(dit, models / "text_encoders" / COMFY_TEXT_FILE, models / "vae" / COMFY_VAE_FILE)
    if aio.is_file():
        return load_comfy_aio(aio)
    raise CheckpointError(
        f"{models} has neither diffusion_models/{COMFY_DIT_FILES[0]} nor checkpoints/{COMFY_AIO_FILE}"
    )


def load_checkpoint(path: str | Path) -> ModelBundle:
    """Load any supported layout from a local path (file or folder); fp32 on CPU, eval mode."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"checkpoint path not found: {path} (give a checkpoint folder or .safetensors file)")
    if path.is_file():
        return load_file(path)
    if (path / "diffusion_models").is_dir() or (path / "checkpoints").is_dir():
        return load_comfy_models_dir(path)
    return load_official_folder(path)


def load_models(
    checkpoint: str | Path | None = None,
    preset: str = "tiny",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> ModelBundle:
    """The one entry point: weights from `checkpoint` when given, else the seeded `preset`."""
    if checkpoint is None:
        return build_random(preset, seed=seed, device=device, dtype=dtype)
    return load_checkpoint(checkpoint).to(device, dtype)

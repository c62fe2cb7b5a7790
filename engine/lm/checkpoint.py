"""Load the ACE-Step 1.5 5 Hz LM from local files, or build a preset with seeded random weights.

Accepted layouts (nothing is ever downloaded):
- the official HF folder `acestep-5Hz-lm-{0.6B,1.7B,4B}/`: `model.safetensors`, or shards named by
  `model.safetensors.index.json`; keys with or without the `model.` prefix;
- ComfyUI's split file `models/text_encoders/qwen_{1.7b,4b}_ace15.safetensors` (keys `model.*`);
- ComfyUI's all-in-one checkpoint, whose LM lives under `text_encoders.qwen3_{2b,4b}.transformer.`.
ComfyUI's `qwen_0.6b_ace15.safetensors` is the Qwen3-Embedding caption encoder, not an LM: it is refused with a
message saying which file to pass. The network shape is read off the tensors, so every size loads.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open

from ..checkpoints.key_maps import infer_qwen3_config, strip_prefix
from ..checkpoints.loading import COMFY_AIO_FILE, CheckpointError, load_strict, read_sharded, safetensors_header
from ..models.lm import LM_PRESETS, LM_VOCAB, Qwen3LM
from ..models.presets import Qwen3Config

LM_FOLDERS = ("acestep-5Hz-lm-0.6B", "acestep-5Hz-lm-1.7B", "acestep-5Hz-lm-4B")
COMFY_LM_FILES = ("qwen_1.7b_ace15.safetensors", "qwen_4b_ace15.safetensors")
COMFY_AIO_LM_PREFIXES = ("text_encoders.qwen3_2b.transformer.", "text_encoders.qwen3_4b.transformer.")
TEXT_ENCODER_VOCAB = 151_669  # Qwen3-Embedding-0.6B: the Qwen vocabulary without the audio-code tokens
BODY_PREFIX = "model."
EMBED_KEY = "model.embed_tokens.weight"
HEAD_KEY = "lm_head.weight"
CONFIG_JSON_FIELDS = ("rope_theta", "rms_norm_eps", "max_position_embeddings")
INIT_STD = 0.02
LM_MAX_POSITIONS = LM_PRESETS["lm-1.7b"].max_position_embeddings  # 40,960 for every size (ComfyUI llama.py)
SEARCH_PATHS = (
    *LM_FOLDERS,
    *COMFY_LM_FILES,
    *(f"text_encoders/{name}" for name in COMFY_LM_FILES),
    f"checkpoints/{COMFY_AIO_FILE}",
)
EXPECTED = (
    "an acestep-5Hz-lm-{0.6B,1.7B,4B}/ folder (model.safetensors or sharded model-*-of-*.safetensors), "
    "ComfyUI's text_encoders/qwen_1.7b_ace15.safetensors or qwen_4b_ace15.safetensors, "
    "or a ComfyUI all-in-one checkpoint that holds the LM"
)


def lm_preset(name: str) -> Qwen3Config:
    """The LM_PRESETS entry `name`; ValueError naming the valid ones otherwise."""
    if name not in LM_PRESETS:
        raise ValueError(f"unknown LM preset {name!r}; valid presets: {', '.join(LM_PRESETS)}")
    return LM_PRESETS[name]


def build_random_lm(
    preset: str = "tiny", seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> Qwen3LM:
    """A preset with seeded weights: N(0, 0.02) matrices, unit norms. Drawn on the CPU in fp32, one tensor at a
    time, so a seed gives the same weights on every device and the peak memory is the model plus one tensor."""
    with torch.device("meta"):
        lm = Qwen3LM(lm_preset(preset))
    lm = lm.to(dtype=dtype).to_empty(device=device)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in lm.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.copy_(torch.empty(param.shape).normal_(0.0, INIT_STD, generator=generator))
    return lm.eval()


# ---- reading -------------------------------------------------------------------------------------------------


def _no_lm(origin: str) -> CheckpointError:
    return CheckpointError(f"{origin} holds no 5 Hz LM (no {EMBED_KEY}); pass {EXPECTED}")


def _lm_prefix(keys: list[str], path: Path) -> str:
    """Where a file keeps the LM: a ComfyUI all-in-one prefix, or '' for a file that is only the LM."""
    for prefix in COMFY_AIO_LM_PREFIXES:
        if prefix + EMBED_KEY in keys:
            return prefix
    if EMBED_KEY in keys or EMBED_KEY.removeprefix(BODY_PREFIX) in keys:
        return ""
    raise _no_lm(str(path))


def read_lm_file(path: Path) -> tuple[dict[str, torch.Tensor], str]:
    """The LM tensors of one .safetensors file (only those under the LM prefix of an all-in-one) and their origin."""
    keys = safetensors_header(path)[0]
    prefix = _lm_prefix(keys, path)
    with safe_open(str(path), framework="pt") as handle:
        state = {k[len(prefix) :]: handle.get_tensor(k) for k in keys if k.startswith(prefix)}
    return state, f"{path} ({prefix}*)" if prefix else str(path)


def _is_lm_folder(folder: Path) -> bool:
    return (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()


def find_lm(folder: Path) -> Path:
    """The one LM folder or file at or inside `folder` (an official LM folder, its parent, a ComfyUI models/ folder)."""
    if _is_lm_folder(folder):
        return folder
    found = [folder / rel for rel in SEARCH_PATHS if (folder / rel).exists()]
    if not found:
        raise CheckpointError(f"{folder} holds no 5 Hz LM; expected {EXPECTED}")
    if len(found) > 1:
        listed = ", ".join(str(p) for p in found)
        raise CheckpointError(f"{folder} holds several 5 Hz LMs ({listed}); pass the one to use")
    return found[0]


def _config_json(folder: Path) -> dict[str, object]:
    """RoPE/norm/length settings from an HF folder's config.json (absent for ComfyUI files)."""
    path = folder / "config.json"
    raw = json.loads(path.read_text()) if path.is_file() else {}
    return {k: raw[k] for k in CONFIG_JSON_FIELDS if k in raw}


# ---- keys and shapes -----------------------------------------------------------------------------------------


def lm_keys(state: Mapping[str, torch.Tensor], origin: str) -> dict[str, torch.Tensor]:
    """Official key names: `model.` added where a checkpoint omits it; an `lm_head.weight` equal to the embedding
    dropped (the head is tied); a text-encoder file or an untied head refused."""
    body = {(k if k.startswith(BODY_PREFIX) else BODY_PREFIX + k): v for k, v in state.items() if k != HEAD_KEY}
    embed = body.get(EMBED_KEY)
    if embed is None:
        raise _no_lm(origin)
    if embed.shape[0] == TEXT_ENCODER_VOCAB:
        raise CheckpointError(
            f"{origin} is the Qwen3-Embedding text encoder (vocabulary {TEXT_ENCODER_VOCAB:,}, no audio-code tokens), "
            f"not the 5 Hz LM (vocabulary {LM_VOCAB:,}); pass {EXPECTED}"
        )
    head = state.get(HEAD_KEY)
    if head is not None and not (head.shape == embed.shape and torch.equal(head, embed)):
        raise CheckpointError(
            f"{origin}: {HEAD_KEY} differs from {EMBED_KEY}, so the output head is not tied; the 5 Hz LM ties it "
            "to the token embedding. Pass an ACE-Step 5 Hz LM checkpoint."
        )
    return body


def infer_lm_config(
    state: Mapping[str, torch.Tensor], origin: str, overrides: Mapping[str, object] | None = None
) -> Qwen3Config:
    """The LM shape read off an official-named state dict; equals the matching LM_PRESETS entry for official files."""
    try:
        shape = infer_qwen3_config(strip_prefix(state, BODY_PREFIX))
    except KeyError as exc:
        missing = BODY_PREFIX + exc.args[0]
        raise CheckpointError(f"{origin} lacks {missing}, needed to read the LM's shape; pass {EXPECTED}") from exc
    return replace(shape, **{"max_position_embeddings": LM_MAX_POSITIONS, **(overrides or {})})


# ---- entry point ---------------------------------------------------------------------------------------------


def load_lm_checkpoint(path: Path) -> Qwen3LM:
    """Any accepted layout from an existing local path; fp32 on the CPU. Built on the meta device and filled by
    `load_strict` (assign), which relies on Qwen3LM holding no non-persistent buffers."""
    source = find_lm(path) if path.is_dir() else path
    if source.is_dir():
        state, origin = read_sharded(source), str(source)
        overrides = _config_json(source)
    else:
        state, origin = read_lm_file(source)
        overrides = {}
    state = lm_keys(state, origin)
    with torch.device("meta"):
        lm = Qwen3LM(infer_lm_config(state, origin, overrides))
    load_strict(lm, state, "5 Hz LM", origin)
    return lm


def load_lm(
    path: str | Path | None,
    preset: str = "tiny",
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Qwen3LM:
    """The 5 Hz LM in eval mode: weights from `path` when given (shape read off the file; `preset` and `seed`
    unused), else the seeded `preset`."""
    if path is None:
        return build_random_lm(preset, seed=seed, device=device, dtype=dtype)
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointError(f"5 Hz LM checkpoint not found: {path}; expected {EXPECTED}")
    return load_lm_checkpoint(path).to(device=device, dtype=dtype).eval()

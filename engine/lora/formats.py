"""Reading the LoRA files ACE-Step 1.5 users have into a LoraAdapter, strictly: every tensor must be understood.

- PEFT adapter folders (the official trainer's `save_pretrained`): adapter_config.json (`r`, `lora_alpha`,
  `use_rslora`, `rank_pattern`, `alpha_pattern`) + adapter_model.safetensors with `lora_A`/`lora_B` keys.
- Single .safetensors files as ComfyUI and the community trainers save them: `lora_A`/`lora_B` or
  `lora_down`/`lora_up` keys with a per-layer `.alpha` tensor, module paths dotted (`diffusion_model.layers.0...`)
  or underscored (`lora_unet_layers_0_self_attn_q_proj`).
- LoKr (LyCORIS) single files: `lokr_w1` or `lokr_w1_a`/`lokr_w1_b`, the same for w2, and `.alpha`.

Scales follow the libraries that trained them: PEFT alpha / r (alpha / sqrt(r) for rsLoRA); kohya/ComfyUI alpha /
rank with no alpha meaning 1; LoKr alpha / (rank of its low-rank factor), 1 when both factors are full."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors import safe_open

from ..checkpoints.loading import safetensors_problem
from .adapter import Delta, Kronecker, LoraAdapter, LowRank

PREFIXES = (
    "base_model.model.",
    "model.diffusion_model.",
    "diffusion_model.",
    "transformer.",
    "decoder.",
    "model.decoder.",
)
UNDERSCORED = ("lora_unet_", "lycoris_", "lora_transformer_")
PICKLED = (".bin", ".pt", ".pth", ".ckpt")  # refused unread: unpickling can run code
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
_LOW_RANK_PARTS = {
    "lora_A.weight": "down",
    "lora_B.weight": "up",
    "lora_A.default.weight": "down",
    "lora_B.default.weight": "up",
    "lora_down.weight": "down",
    "lora_up.weight": "up",
}
_LOKR_PARTS = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")


def read_lora(path: str | Path, module_paths: set[str], name: str | None = None) -> LoraAdapter:
    """Read a PEFT folder or a single .safetensors LoRA; `module_paths` are the decoder's module names (to read
    underscored keys back into dotted paths)."""
    path = Path(path)
    check_lora_path(path)
    name = name or (path.name if path.is_dir() else path.stem)
    if path.is_dir():
        return _read_peft_folder(path, module_paths, name)
    if path.name == PEFT_WEIGHTS and (path.parent / PEFT_CONFIG).exists():  # a PEFT folder picked by its file
        return _read_peft_folder(path.parent, module_paths, name if name != path.stem else path.parent.name)
    tensors, metadata = _load(path)
    return _from_tensors(tensors, module_paths, name, str(path), metadata_config(metadata))


def check_lora_path(path: Path) -> None:
    """Refuse, with one line naming the path and the fix, what cannot be a LoRA: a pickled file, a missing path, a
    folder that is no PEFT adapter, a file that is not a whole .safetensors file. Reads file headers only, so a
    command runs it before its model loads; read_lora runs it too, so every caller says the same."""
    if path.suffix in PICKLED:
        raise ValueError(f"{path}: LoRAs are read from .safetensors only (pickled .bin/.pt files can run code)")
    if not path.exists():
        raise FileNotFoundError(
            f"LoRA not found: no such file or folder {path}; give a PEFT adapter folder or a .safetensors file"
        )
    if path.is_dir():
        missing = [name for name in (PEFT_CONFIG, PEFT_WEIGHTS) if not (path / name).exists()]
        if missing:
            raise ValueError(f"{path}: not a PEFT adapter folder, {' and '.join(missing)} missing")
        path = path / PEFT_WEIGHTS
    elif path.suffix != ".safetensors":
        raise ValueError(f"{path}: not a .safetensors file; give a PEFT adapter folder or a .safetensors LoRA")
    try:
        with safe_open(str(path), framework="pt"):  # reads and checks the header, not the tensors
            pass
    except Exception as error:  # safetensors raises its own SafetensorError for a broken file
        problem = safetensors_problem(path) or f"is not a valid .safetensors file ({error})"
        raise ValueError(f"LoRA file {path} {problem}; download or export it again") from None


def _read_peft_folder(folder: Path, module_paths: set[str], name: str) -> LoraAdapter:
    config_path, weights_path = folder / PEFT_CONFIG, folder / PEFT_WEIGHTS
    config = json.loads(config_path.read_text())
    tensors, _ = _load(weights_path)
    return _from_tensors(tensors, module_paths, name, str(folder), config)


def metadata_config(metadata: dict[str, str] | None) -> dict | None:
    """A PEFT config some trainers embed in the file's metadata (key `adapter_config` or `lora_config`)."""
    for key in ("adapter_config", "lora_config"):
        if metadata and key in metadata:
            try:
                return json.loads(metadata[key])
            except json.JSONDecodeError:
                return None
    return None


def _load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    with safe_open(str(path), framework="pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}, handle.metadata()


def _from_tensors(
    tensors: dict[str, torch.Tensor], module_paths: set[str], name: str, source: str, config: dict | None
) -> LoraAdapter:
    underscored = {path.replace(".", "_"): path for path in module_paths}
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    unknown = []
    for key, tensor in tensors.items():
        split = _split_key(key)
        if split is None:
            unknown.append(key)
            continue
        module, part = split
        grouped.setdefault(_module_path(module, module_paths, underscored), {})[part] = tensor
    if unknown:
        raise ValueError(
            f"LoRA {name!r} ({source}): {len(unknown)} tensors are not LoRA weights this loader knows "
            f"(e.g. {', '.join(unknown[:4])}); supported: PEFT lora_A/lora_B, lora_down/lora_up with .alpha, LoKr"
        )
    if not grouped:
        raise ValueError(f"LoRA {name!r} ({source}) holds no LoRA tensors")
    deltas, problems = {}, []
    for module, parts in grouped.items():
        try:
            deltas[module] = _delta(module, parts, config)
        except ValueError as error:
            problems.append(str(error))
    if problems:
        raise ValueError(f"LoRA {name!r} ({source}) is malformed:\n  " + "\n  ".join(problems[:12]))
    kinds = {type(d) for d in deltas.values()}
    fmt = "lokr" if Kronecker in kinds else ("peft" if config is not None else "comfyui")
    return LoraAdapter(name, source, fmt, deltas)


def _split_key(key: str) -> tuple[str, str] | None:
    """(module, part) of a LoRA tensor key; None if it is none."""
    for suffix in (*_LOW_RANK_PARTS, "alpha", *_LOKR_PARTS):
        if key.endswith("." + suffix):
            return key[: -len(suffix) - 1], suffix
    return None


def _module_path(module: str, module_paths: set[str], underscored: dict[str, str]) -> str:
    """The decoder module a key's module part names: known prefixes stripped; underscored names mapped back."""
    for prefix in UNDERSCORED:
        if module.startswith(prefix):
            bare = module[len(prefix) :]
            for dotted_prefix in PREFIXES:
                bare = _strip_underscored(bare, dotted_prefix)
            return underscored.get(bare, bare)
    changed = True
    while changed:
        changed = False
        for prefix in PREFIXES:
            if module.startswith(prefix) and module not in module_paths:
                module, changed = module[len(prefix) :], True
    return module


def _strip_underscored(name: str, dotted_prefix: str) -> str:
    prefix = dotted_prefix.replace(".", "_")
    return name[len(prefix) :] if name.startswith(prefix) else name


def _delta(module: str, parts: dict[str, torch.Tensor], config: dict | None) -> Delta:
    alpha_tensor = parts.pop("alpha", None)
    alpha = None if alpha_tensor is None else float(alpha_tensor.float().reshape(-1)[0])
    if any(part.startswith("lokr_") for part in parts):
        return _lokr(module, parts, alpha)
    roles = {}
    for part, tensor in parts.items():
        role = _LOW_RANK_PARTS[part]
        if role in roles:
            raise ValueError(f"{module}: two {role} tensors")
        roles[role] = tensor
    for role, label in (("down", "lora_A / lora_down"), ("up", "lora_B / lora_up")):
        if role not in roles:
            raise ValueError(f"{module}: {label} is missing")
    down, up = roles["down"].float(), roles["up"].float()
    down, up = down.reshape(down.shape[0], -1), up.reshape(up.shape[0], -1)
    rank = down.shape[0]
    if up.shape[1] != rank:
        raise ValueError(f"{module}: lora_A has rank {rank} but lora_B has {up.shape[1]}")
    return LowRank(down, up, _low_rank_scale(module, rank, alpha, config))


def _low_rank_scale(module: str, rank: int, alpha: float | None, config: dict | None) -> float:
    if config is not None and alpha is None:
        rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
        r = _pattern_value(module, rank_pattern, config.get("r", rank))
        if r != rank:
            raise ValueError(f"{module}: adapter_config says rank {r}, the tensors have rank {rank}")
        lora_alpha = _pattern_value(module, alpha_pattern, config.get("lora_alpha", r))
        return lora_alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return 1.0 if alpha is None else alpha / rank


def _pattern_value(module: str, pattern: dict, default):
    """PEFT's rank_pattern/alpha_pattern: the first key that matches the module's name (a regex match at the end
    of the name, or the whole name) overrides the default."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _lokr(module: str, parts: dict[str, torch.Tensor], alpha: float | None) -> Kronecker:
    factors, rank = [], None
    for side in ("w1", "w2"):
        full, a, b = parts.get(f"lokr_{side}"), parts.get(f"lokr_{side}_a"), parts.get(f"lokr_{side}_b")
        if full is not None:
            factors.append(full.float())
        elif a is not None and b is not None:
            if a.shape[1] != b.shape[0]:
                raise ValueError(f"{module}: lokr_{side}_a {tuple(a.shape)} and _b {tuple(b.shape)} do not chain")
            factors.append(a.float() @ b.float())
            rank = b.shape[0]
        else:
            raise ValueError(f"{module}: lokr_{side} (or lokr_{side}_a and lokr_{side}_b) is missing")
    scale = 1.0 if alpha is None or rank is None else alpha / rank
    return Kronecker(factors[0], factors[1], scale)

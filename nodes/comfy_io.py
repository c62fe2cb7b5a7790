"""ComfyUI's AUDIO / LATENT dictionaries, model folders and progress bar, at the node edge (imports torch lazily)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from .spec import NodeInputError

LATENT_CHANNELS = 64
NODE_PRESETS = ("tiny",)  # the only preset the nodes build without weights (the CLI's bench commands build the rest)


def progress(total: int) -> Callable[[int, int], None]:
    """A per-step callback `(done, total)` for a node's long loop: it moves the node's progress bar in ComfyUI, and
    raises ComfyUI's InterruptProcessingException once Cancel was pressed, so the loop stops at its next step.
    Outside ComfyUI it does nothing."""
    try:
        import comfy.model_management
        import comfy.utils
    except ImportError:
        return lambda done, total: None
    bar = comfy.utils.ProgressBar(total)

    def step(done: int, total: int) -> None:
        comfy.model_management.throw_exception_if_processing_interrupted()
        bar.update_absolute(done, total)

    return step


def model_folder_files(
    folders: tuple[str, ...] = ("diffusion_models", "checkpoints"), keep=lambda name: "ace" in name.lower()
) -> tuple[str, ...]:
    """Checkpoint choices from ComfyUI's model folders ("diffusion_models/x.safetensors", ...); empty without ComfyUI."""
    try:
        import folder_paths
    except ImportError:
        return ()
    files = []
    for folder in folders:
        try:
            files += [f"{folder}/{name}" for name in folder_paths.get_filename_list(folder) if keep(name)]
        except Exception:  # an unknown folder kind in an older ComfyUI
            continue
    return tuple(files)


def lm_folder_files() -> tuple[str, ...]:
    """5 Hz LM choices: ComfyUI's qwen_{1.7b,4b}_ace15 text encoders and ACE-Step all-in-one checkpoints (the 0.6B
    file there is the caption encoder, not an LM)."""
    return model_folder_files(
        ("text_encoders",), lambda name: "ace15" in name and "0.6b" not in name
    ) + model_folder_files(("checkpoints",), lambda name: "ace" in name.lower())


def resolve_checkpoint(
    choice: str, node: str = "Load model", fix: str = "put ACE-Step 1.5 files in ComfyUI/models/diffusion_models"
) -> Path | None:
    """ "none" -> None; "folder/name" -> the full path from ComfyUI's registry; else a local path as given."""
    if choice in ("", "none"):
        return None
    folder, _, name = choice.partition("/")
    try:
        import folder_paths

        full = folder_paths.get_full_path(folder, name)
        if full:
            return Path(full)
    except ImportError:
        pass
    path = Path(choice).expanduser()
    if not path.exists():
        raise NodeInputError(f"{node}: input 'checkpoint' {choice!r} was not found; {fix}")
    return path


def check_preset(node: str, name: str, preset: str, known: tuple[str, ...], checkpoint: Path | None, fix: str) -> None:
    """A loader's preset is built only when no checkpoint is chosen (a checkpoint sets its own shape). Full-size
    presets are not offered: with random weights they take minutes per step and only make noise. Older saved graphs
    may still name one: with a checkpoint they load as before, without one the error says what to pick."""
    if preset not in known:
        raise NodeInputError(f"{node}: input '{name}' must be one of {', '.join(NODE_PRESETS)}, got {preset!r}")
    if checkpoint is None and preset not in NODE_PRESETS:
        raise NodeInputError(
            f"{node}: input '{name}' {preset!r} has no weights without a checkpoint (random full-size weights take "
            f"minutes per step and only make noise); {fix}, or set '{name}' to tiny (no files, test sound)"
        )


def audio_from_comfy(node: str, audio: Any):
    """ComfyUI AUDIO {"waveform": [B, C, N], "sample_rate": int} -> ([C, N] float tensor, rate); first batch item."""
    import torch

    if not isinstance(audio, dict) or "waveform" not in audio or "sample_rate" not in audio:
        raise NodeInputError(f"{node}: input 'audio' must be ComfyUI AUDIO (a dict with waveform and sample_rate)")
    waveform, rate = audio["waveform"], audio["sample_rate"]
    if not isinstance(waveform, torch.Tensor) or waveform.dim() != 3:
        raise NodeInputError(
            f"{node}: input 'audio' waveform must be [batch, channels, samples], got {getattr(waveform, 'shape', type(waveform))}"
        )
    if waveform.shape[1] not in (1, 2):
        raise NodeInputError(f"{node}: input 'audio' has {waveform.shape[1]} channels; give mono or stereo audio")
    if not isinstance(rate, int) or not 8_000 <= rate <= 384_000:
        raise NodeInputError(f"{node}: input 'audio' sample_rate {rate!r} is not a usable rate (8000..384000 Hz)")
    if not torch.isfinite(waveform).all():
        raise NodeInputError(f"{node}: input 'audio' contains NaN or infinite samples")
    return waveform[0].float(), rate


def audio_to_comfy(audio, rate: int) -> dict:
    """[C, N] tensor or array -> ComfyUI AUDIO."""
    import torch

    tensor = torch.as_tensor(audio, dtype=torch.float32).detach().cpu()
    return {"waveform": tensor.unsqueeze(0), "sample_rate": int(rate)}


def latent_to_comfy(latent) -> dict:
    """Our [1, T, 64] latent -> ComfyUI's audio LATENT {"samples": [1, 64, T], "type": "audio"}."""
    return {"samples": latent.detach().float().cpu().transpose(1, 2).contiguous(), "type": "audio"}


def latent_from_comfy(node: str, latent: Any):
    """ComfyUI audio LATENT -> our [1, T, 64] (first batch item)."""
    import torch

    samples = latent.get("samples") if isinstance(latent, dict) else None
    if not isinstance(samples, torch.Tensor) or samples.dim() != 3 or samples.shape[1] != LATENT_CHANNELS:
        raise NodeInputError(f"{node}: input 'latent' must be an ACE-Step 1.5 audio LATENT with samples [B, 64, T]")
    return samples[:1].transpose(1, 2).float()

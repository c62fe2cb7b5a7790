"""The LoRA node: attaches a LoRA from ComfyUI's loras/ folder to a flowjam model, chainable.

A flowjam model is one loaded Session shared by every graph that uses it, so a LoRA node does not change it: its
output is the model plus the chain of LoRAs it asks for (`ModelWithLoras`). The nodes that run the DiT
(Generate, Stream) bring the session to exactly that list before they run: missing LoRAs are loaded, others
unloaded, strengths set. On a running stream a new strength goes through the stream's `lora/<name>` knob, so a
re-queue with another strength changes the music in place and the panel, OSC and MIDI see it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engine.params import LORA_MODES
from .spec import CATEGORY, MODEL, NodeInputError, NodeSpec, Output, Param, check_range


@dataclass(frozen=True)
class LoraChoice:
    name: str  # its knob is lora/<name>
    path: Path
    strength: float
    mode: str  # one of LORA_MODES (see Session.load_lora)


@dataclass(frozen=True)
class ModelWithLoras:
    """A flowjam model with the LoRAs a chain of LoRA nodes asks for; reads through to the session otherwise."""

    session: Any
    chain: tuple[LoraChoice, ...]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)


def chain_of(model: Any) -> tuple[LoraChoice, ...]:
    """The LoRAs a model socket's value asks for (none for Load model's output)."""
    return model.chain if isinstance(model, ModelWithLoras) else ()


def session_of(model: Any) -> Any:
    """The Session behind a model socket's value (a LoRA node's output or Load model's)."""
    return model.session if isinstance(model, ModelWithLoras) else model


def with_loras(node: str, model: Any, registry=None) -> Any:
    """The session, brought to the LoRAs `model` asks for (none for Load model's output), for a node that runs the
    DiT. `registry`: a running stream's knobs, whose lora/<name> knobs carry the strengths. All or nothing: every
    file to load is read and checked first, and the swap itself is undone if it fails, so on an error the session
    (and a stream playing it) keeps exactly the LoRAs it had, and the node says what failed."""
    from ..engine.params import LORA_KNOB_PREFIX
    from ..live.app import add_lora_knobs

    session = session_of(model)
    wanted = {choice.name: choice for choice in chain_of(model)}
    modes = {name: session.lora_mode(choice.mode) for name, choice in wanted.items()}
    loaded = session.loras
    stale = [
        name
        for name, (strength, mode) in loaded.items()
        if name not in wanted or modes[name] != mode or (mode == "merged" and wanted[name].strength != strength)
    ]
    # a stream keeps the LoRAs it plays; a Generate graph would only read another graph's leftovers in that list
    kept = f"; nothing changed (LoRAs loaded: {', '.join(loaded) or 'none'})" if registry else "; nothing was generated"
    load = []
    for choice in wanted.values():
        if choice.name not in loaded or choice.name in stale:
            try:
                adapter = session.read_lora(choice.path, choice.name)
            except (ValueError, FileNotFoundError) as error:
                raise NodeInputError(f"{node}: LoRA {choice.path.name!r}: {_one_line(error)}{kept}") from None
            load.append((adapter, choice.strength, modes[choice.name]))
    try:
        session.swap_loras(stale, load)
    except ValueError as error:
        raise NodeInputError(f"{node}: {_one_line(error)}{kept}") from None
    if registry is None:
        for name, choice in wanted.items():
            if name in loaded and name not in stale and loaded[name][0] != choice.strength:
                session.set_lora_strength(name, choice.strength)
    else:  # a stream's strengths go through its lora/<name> knobs, so the panel, OSC and MIDI see them
        add_lora_knobs(registry, session)
        for choice in wanted.values():
            if modes[choice.name] != "merged":
                registry.set(LORA_KNOB_PREFIX + choice.name, choice.strength, origin="comfyui")
    return session


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


def lora_files() -> tuple[str, ...]:
    """LoRA choices from ComfyUI's loras/ folder (.safetensors; a PEFT folder shows as its adapter file)."""
    try:
        import folder_paths
    except ImportError:
        return ()
    return tuple(name for name in folder_paths.get_filename_list("loras") if name.endswith(".safetensors"))


def _lora_path(choice: str) -> Path:
    try:
        import folder_paths
    except ImportError:
        folder_paths = None
    full = folder_paths.get_full_path("loras", choice) if folder_paths is not None else None
    path = Path(full) if full else Path(choice)
    if not path.exists():
        raise NodeInputError(
            f"LoRA: input 'lora' {choice!r} is not a file in ComfyUI/models/loras/; put the LoRA there (a "
            ".safetensors file, or a PEFT folder with adapter_config.json) and refresh"
        )
    return path


def attach_lora(model, lora: str, strength: float, mode: str) -> tuple:
    """The model with this LoRA added to its chain (checked here, loaded where the DiT runs)."""
    check_range("LoRA", "strength", strength, 0.0, 2.0)
    if mode not in LORA_MODES:
        raise NodeInputError(f"LoRA: input 'mode' {mode!r}: choose one of {', '.join(LORA_MODES)}")
    if lora == "none":
        return (model,)
    path = _lora_path(lora)
    name = path.parent.name if path.name == "adapter_model.safetensors" else path.stem
    chain = chain_of(model)
    if any(choice.name == name for choice in chain):
        raise NodeInputError(f"LoRA: {name!r} is in this chain already; use one LoRA node per file")
    choice = LoraChoice(name, path, float(strength), mode)
    return (ModelWithLoras(session_of(model), (*chain, choice)),)


NODES = (
    NodeSpec(
        "FlowjamLora",
        "flowjam LoRA",
        f"{CATEGORY}/model",
        "Add a LoRA (PEFT, ComfyUI or LyCORIS LoKr .safetensors from models/loras/) to the model; chain several. "
        "live and folded: its strength is the stream's lora/<name> knob, re-queue to change it in place (live runs "
        "its low-rank GEMMs every tick; folded folds it into the weights on the tick after a change: merged speed, "
        "a copy of the layers' weights in memory; auto: folded on a GPU); merged: baked in at a fixed strength.",
        (
            Param("model", MODEL, "A flowjam model from Load model (or another LoRA node)"),
            Param(
                "lora",
                "COMBO",
                "A LoRA from ComfyUI/models/loras/ (none: the model passes through)",
                "none",
                options=lambda: ("none", *lora_files()),
            ),
            Param("strength", "FLOAT", "0 = off, 1 = as trained, up to 2", 1.0, 0.0, 2.0, 0.01),
            Param(
                "mode",
                "COMBO",
                "auto, live or folded (playable strength), merged (fixed strength)",
                "auto",
                options=LORA_MODES,
            ),
        ),
        (Output(MODEL, "model"),),
        attach_lora,
    ),
)

"""Loaded models' memory in ComfyUI: they take part in its model management (`comfy.model_management`; no-ops
without ComfyUI), and a freed model's memory goes back to the system.

A session's DiT, text encoder and VAE form one ModelPatcher. Before a node computes with a session they are (re)loaded
on its device, whole (plain torch layers cannot run split across devices), and ComfyUI unloads other models if it
needs the memory; ComfyUI's unload (a /free request, or another model's load) moves them to its offload device. A
session a stream plays is off ComfyUI's list until the stream stops: weights never move under a running stream.
The 5 Hz LM and the 4 MB silence latent stay where they are (the LM's decode keeps CUDA graphs of its weights)."""

from __future__ import annotations

import ctypes
import sys
from functools import cache
from typing import Any
from weakref import WeakKeyDictionary, finalize

from .lora_nodes import session_of

_patchers: WeakKeyDictionary = WeakKeyDictionary()  # session -> its ModelPatcher, dropped with the session


@cache
def _model_management():
    """ComfyUI's model management module, or None outside ComfyUI."""
    try:
        import comfy.model_management
        import comfy.model_patcher  # noqa: F401 - `_patcher` needs it
    except ImportError:
        return None
    return comfy.model_management


def _streamed(session: Any) -> bool:
    """Whether a running stream plays `session`."""
    from ..live import performances

    return any(app is not None and app.session is session for app in map(performances.get, performances.names()))


def _patcher(management, session: Any):
    """The session's ModelPatcher, made on first use (the weights are still where Load model put them)."""
    if session not in _patchers:
        import comfy.model_patcher
        import torch

        models = session.models
        networks = torch.nn.ModuleDict({"dit": models.acestep, "text_encoder": models.text_encoder, "vae": models.vae})
        _patchers[session] = comfy.model_patcher.ModelPatcher(
            networks, load_device=session.device, offload_device=management.unet_offload_device()
        )
    return _patchers[session]


def use(session: Any) -> None:
    """Call before a node computes with `session`: its weights are on its device afterwards (unless a stream plays
    it: then they already are, and stay)."""
    session = session_of(session)
    management = _model_management()
    if management is not None and not _streamed(session):
        management.load_models_gpu([_patcher(management, session)], force_full_load=True)


def keep_for_stream(session: Any) -> None:
    """A stream starts playing `session` (after `use`): off ComfyUI's list, so no unload moves its weights."""
    session = session_of(session)
    management = _model_management()
    if management is None or session not in _patchers:
        return
    patcher = _patchers[session]
    for loaded in [m for m in management.current_loaded_models if m.model is patcher]:
        management.current_loaded_models.remove(loaded)
        loaded.model_finalizer.detach()


def give_back_when_freed(session: Any) -> None:
    """Once `session` is freed, hand the heap pages it held back to the system: glibc keeps freed memory for reuse
    (tensors made in ComfyUI's worker thread sit in that thread's heap), so without this a /free frees the model
    while the process's memory stays as high as before."""
    finalize(session, _trim_heap)


def _trim_heap() -> None:
    """glibc's malloc_trim: free heap pages of every thread's heap back to the system."""
    libc = ctypes.CDLL(None) if sys.platform == "linux" else None
    if libc is not None and hasattr(libc, "malloc_trim"):  # glibc; musl has no such call
        libc.malloc_trim(0)

"""Prompt texts encoded on a thread of their own, so that a burst of prompts never stops the runner's ticks."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from ..engine.conditioning import Conditioning
from .messages import Message, PromptConditioning


class PromptEncoder:
    """Encodes prompt texts on a thread of its own, so a burst of prompts never stops the ticks; of several texts
    waiting for one slot only the newest is encoded. Each result reaches the runner as a PromptConditioning."""

    def __init__(
        self,
        encode: Callable[[str], Conditioning],
        deliver: Callable[[Message], None],
        on_error: Callable[[Exception], None],
        device: torch.device | None = None,
    ):
        """`device`: a GPU's texts are encoded on a CUDA stream of their own (the ticks never queue behind a text
        encoder's forward) and waited for before the runner gets them."""
        self._encode, self._deliver, self._on_error = encode, deliver, on_error
        self._device = device if device is not None and device.type == "cuda" else None
        self._stream: torch.cuda.Stream | None = None
        self._pending: dict[str, str] = {}
        self._busy = False
        self._ready = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def submit(self, slot: str, text: str) -> None:
        with self._ready:
            self._pending[slot] = text
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="flowjam-prompt-encoder", daemon=True)
                self._thread.start()
            self._ready.notify()

    @property
    def idle(self) -> bool:
        """Nothing waiting and nothing being encoded (every submitted text has been delivered)."""
        with self._ready:
            return not self._pending and not self._busy

    def stop(self) -> None:
        with self._ready:
            self._stopping = True
            self._ready.notify()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._pending and not self._stopping:
                    self._ready.wait()
                if self._stopping:
                    return
                slot, text = self._pending.popitem()
                self._busy = True
            try:
                empty_negative = slot == "negative" and not text.strip()
                self._deliver(PromptConditioning(slot, None if empty_negative else self._encode_aside(text)))
            except Exception as error:  # a bad prompt must not stop later ones
                self._on_error(error)
            finally:
                with self._ready:
                    self._busy = False

    def _encode_aside(self, text: str) -> Conditioning:
        if self._device is None:
            return self._encode(text)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self._device)
        with torch.cuda.stream(self._stream):
            conditioning = self._encode(text)
        self._stream.synchronize()
        return conditioning

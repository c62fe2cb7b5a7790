"""The engine's side of a DAW plugin (plugin/), in place of Playback: no sound card; the plugin in the DAW's audio
thread is the output. It creates the session's control block (live/plugin_link.py) and points it at the loop buffer,
writes the heartbeat, tells the plugin the loop's bars and whether the loop is written yet (an offline bounce waits for
it), carries the block size the host plays into the buffer (the writer's lead covers one block), and applies the knobs
the host changed as knob changes (origin "plugin"). The engine's own knob values go back into the block for the plugin
to show. It serves the panel (live/plugin_panel.py) and opens it in the browser when the plugin's `panel` parameter
asks."""

from __future__ import annotations

import logging
import threading
import time
import webbrowser
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ..engine.params import KNOB_SPECS
from .knobs import KnobRegistry
from .loop_buffer import BLOCK, RUNNING, LoopBuffer
from .plugin_link import (
    ENGINE_CLICK,
    ENGINE_HOST_CHANGES_TAKEN,
    ENGINE_HOST_LAG_MS,
    ENGINE_LOOP_BARS,
    ENGINE_LOOP_WRITTEN,
    HOST_BLOCK_FRAMES,
    HOST_BLOCKS,
    HOST_CHANGES_NS,
    HOST_PANEL_REQUESTS,
    HOST_PLAYING,
    HOST_PROMPTS_SEQ,
    HOST_SAMPLE_RATE,
    PLUGIN_ORIGIN,
    STALE_AFTER_S,
    ControlBlock,
)
from .plugin_panel import PluginPanel

if TYPE_CHECKING:
    from .plugin_tempo import HostTempo

log = logging.getLogger("flowjam.plugin")
POLL_S = 0.02  # the longest between two reads of the control block (a host that plays no blocks yet)
SHORTEST_POLL_S = 0.002  # the shortest: a host at 64 frames is not read every 1.3 ms
ANSWER_WAIT_S = 30.0  # the longest the engine keeps the plugin's pushed prompts before answering with what plays


class PluginOutput:
    def __init__(
        self,
        buffer: LoopBuffer,
        registry: KnobRegistry,
        session: str = "default",
        on_prompt: Callable[[str, str], None] | None = None,
        captions: Callable[[], dict[str, str]] | None = None,
        written: Callable[[], bool] = lambda: True,
        panel_port: int | None = None,
    ):
        """`on_prompt(slot, text)`: a prompt the host gave (a DAW project's, or typed in the panel); `captions()`: the
        prompts playing now, for the host to save in the project; `written()`: the loop playing holds the stream's
        audio; `panel_port`: serve the panel there (0: a free port; None: no panel)."""
        self.buffer, self.registry, self.session = buffer, registry, session
        self._on_prompt, self._captions, self._written = on_prompt, captions, written
        self.panel: PluginPanel | None = None
        self._host_lock = threading.Lock()  # the host's changes are taken in by one thread at a time
        if panel_port is not None and on_prompt is not None and captions is not None:
            self.panel = PluginPanel(registry, on_prompt, captions, panel_port, before_change=self.take_host_changes)
        self._panel_requests = 0
        self._host_prompts_seen = 0
        self._captions_written: dict[str, str] | None = None
        self._taken_written = 0  # the plugin's prompt area the engine's prompts written last answer
        self._answering: tuple[int, dict[str, str], float] | None = None  # (its seq, prompts on their way, since)
        self.control = ControlBlock(session)
        self.recording = None  # the DAW records the track
        self.error: str | None = None
        self._seen = np.zeros(len(KNOB_SPECS), np.int64)
        self._shown = self.control.engine_values[: len(KNOB_SPECS)].copy()  # the engine's values as last written
        self._blocks = (0, time.monotonic())  # the plugin's block count and when it last moved
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.tempo: HostTempo | None = None  # follows the host's tempo where the loop is whole bars

    def set_bars(self, bars: int | None, bar_frames: float, click: bool, region: int = 0) -> None:
        """The loop's bars and bar length, by which the plugin maps the host's bars onto it (None: not on a grid), and
        whether the engine clicks (the plugin's `click` parameter at "engine")."""
        self.buffer.set_bars(region, bars or 0, bar_frames if bars else 0.0)
        self.control.counters[ENGINE_LOOP_BARS] = bars or 0
        self.control.counters[ENGINE_CLICK] = int(click)

    def start(self) -> None:
        self.control.beat(time.monotonic_ns())
        self.control.set_buffer(self.buffer.name)
        self._thread = threading.Thread(target=self._serve, name="flowjam-plugin", daemon=True)
        self._thread.start()
        if self.tempo is not None:
            self.tempo.start()
        if self.panel is not None:
            self.panel.start()
        log.info("waiting for the flowjam plugin in the DAW (session %r)", self.session)

    def _serve(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    @property
    def poll_s(self) -> float:
        """The control block is read once per host block (between SHORTEST_POLL_S and POLL_S): a knob the host moved
        reaches the registry within one block of its own, and the runner on its next tick, as a knob of `live`."""
        block, rate = (int(self.control.counters[slot]) for slot in (HOST_BLOCK_FRAMES, HOST_SAMPLE_RATE))
        if block <= 0 or rate <= 0:
            return POLL_S
        return min(POLL_S, max(SHORTEST_POLL_S, block / rate))

    def poll(self) -> None:
        """One round: heartbeat, the host's block size, its knob changes in, the engine's values out."""
        control, counters = self.control, self.buffer.counters
        control.beat(time.monotonic_ns())
        block = int(control.counters[HOST_BLOCK_FRAMES])
        if block > 0:
            counters[BLOCK] = block
        blocks = int(control.counters[HOST_BLOCKS])
        if blocks != self._blocks[0]:
            self._blocks = (blocks, time.monotonic())
        counters[RUNNING] = int(self.running)
        control.reals[ENGINE_LOOP_WRITTEN] = float(self._written())
        requests = int(control.counters[HOST_PANEL_REQUESTS])
        if requests != self._panel_requests:
            self._panel_requests = requests
            self.open_panel()
        self.take_host_changes()
        self._show_engine_values()

    def take_host_changes(self) -> None:
        """The knobs and prompts the host changed since the last round, into the registry and the app; the panel
        calls this before its own change, so that a change the host made before it is not taken in after it (the
        plugin gives its project's values within a block of attaching, the round that reads them may come later)."""
        with self._host_lock:
            control = self.control
            block_ns = int(control.counters[HOST_CHANGES_NS])
            sent_at = block_ns / 1e9 if block_ns > 0 else None
            changes = control.host_changes[: len(KNOB_SPECS)].copy()
            changed = np.flatnonzero(changes != self._seen)
            for index in changed:
                self._seen[index] = changes[index]
                spec = KNOB_SPECS[index]
                try:  # sent at the block's start: perf_counter and the plugin's clock are both CLOCK_MONOTONIC
                    self.registry.set(
                        spec.name, float(control.host_values[index]), origin=PLUGIN_ORIGIN, sent_at=sent_at
                    )
                except ValueError as error:  # a host sent a value the knob refuses: keep the old one, say so
                    log.warning("plugin knob %s: %s", spec.name, error)
            if len(changed) and sent_at is not None:
                control.reals[ENGINE_HOST_LAG_MS] = (time.perf_counter() - sent_at) * 1000.0
                control.counters[ENGINE_HOST_CHANGES_TAKEN] += 1
            if self._captions is not None:
                self._exchange_prompts()

    def _show_engine_values(self) -> None:
        """The engine's knob values out, for the host to show: a value the engine came to by itself (OSC, MIDI, the
        panel) counts a change the plugin passes on to the host. Not one the host holds already (its own change taken
        in), nor one made while a change of the host's is still on its way in (the host's is newer: it wins)."""
        control = self.control
        with self._host_lock:
            taken = control.host_changes[: len(KNOB_SPECS)] == self._seen
        for index, spec in enumerate(KNOB_SPECS):
            value = self.registry.get(spec.name)
            if value == self._shown[index]:
                continue
            self._shown[index] = control.engine_values[index] = value
            if taken[index] and value != control.host_values[index]:
                control.engine_changes[index] += 1

    def open_panel(self) -> None:
        """The panel in the browser that $BROWSER (else the desktop's default) names, on a thread of its own: a
        browser command may run until its window closes."""
        if self.panel is None:
            log.warning("the plugin asked for the panel, but this engine serves none")
            return
        threading.Thread(target=self._open_browser, args=(self.panel.url,), name="flowjam-browser", daemon=True).start()

    @staticmethod
    def _open_browser(url: str) -> None:
        if not webbrowser.open(url):
            log.warning("no browser to open the panel: open %s yourself, or set $BROWSER", url)

    def _exchange_prompts(self) -> None:
        """The project's prompts in (once per change the plugin made), the engine's out (when they moved). The engine's
        prompts answer the plugin's push once they play (or were refused, or ANSWER_WAIT_S passed): until then the
        plugin keeps the prompts it pushed, and a project saved meanwhile saves those, not the ones still playing."""
        seq = int(self.control.counters[HOST_PROMPTS_SEQ])
        given = self.control.host_prompts() if seq != self._host_prompts_seen else None
        if given is not None and given["a"]:
            self._host_prompts_seen = seq
            playing = self._captions()
            wanted = {}
            for slot, text in given.items():
                text = text or (given["a"] if slot == "b" else "")
                if text != playing.get(slot) and self._on_prompt is not None:
                    try:
                        self._on_prompt(slot, text)
                        wanted[slot] = text
                    except ValueError as error:
                        log.warning("plugin prompt %s refused: %s", slot, error)
            self._answering = (seq, wanted, time.monotonic())
        captions = self._captions()
        taken = self._taken_written
        if self._answering is not None:
            answering, wanted, since = self._answering
            arrived = all(captions.get(slot) == text for slot, text in wanted.items())
            if arrived or time.monotonic() - since > ANSWER_WAIT_S:
                taken, self._answering = answering, None
        if (captions, taken) != (self._captions_written, self._taken_written):
            self.control.write_engine_prompts(captions, taken)
            self._captions_written, self._taken_written = captions, taken

    @property
    def running(self) -> bool:
        """The plugin rendered a block within the last STALE_AFTER_S."""
        return self._blocks[0] > 0 and time.monotonic() - self._blocks[1] < STALE_AFTER_S

    @property
    def host_playing(self) -> bool:
        return bool(self.control.counters[HOST_PLAYING])

    def stop(self) -> None:
        if self.tempo is not None:
            self.tempo.stop()
        if self.panel is not None:
            self.panel.stop()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        if self.control.counters is not None:
            self.control.unlink()

    def stats(self) -> dict:
        rate = self.buffer.sample_rate
        return {
            "mode": "plugin",
            "device": f"DAW plugin (session {self.session!r})",
            "running": self.running,
            "host_playing": self.host_playing,
            "playhead_frames": self.buffer.playhead_frames,
            "playhead_s": self.buffer.playhead_frames / rate,
            "underruns": self.buffer.underruns,
            "late_blocks": self.buffer.late_blocks,
            "gaps": self.buffer.gaps,
            "callbacks": self.buffer.callbacks,
            "latency_s": 0.0,
            "realtime": None,
            "recorded_s": 0.0,
            "recording_error": None,
            "error": self.error,
        }

"""The runner thread: owns the stream, turns knob values into shared curves and requests, and ticks; each finished
latent goes to the writer (`writer.py`), which decodes it just ahead of the playhead on a thread (and CUDA stream) of
its own while the next tick runs.

Knob changes are applied at the top of every tick, so a shared knob is in the very next tick. On a GPU each tick
is waited for before the next one is prepared: the host never queues ticks ahead of the device, where a knob
change would wait behind them. Prompt changes, source swaps and depth changes come in as messages and are applied
between ticks; audio keeps playing from the buffer meanwhile.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..engine.conditioning import Conditioning
from ..engine.params import DEFAULT_WINDOW_SECONDS, KNOBS_BY_NAME, LATENT_RATE_HZ, LORA_KNOB_PREFIX, KnobKind
from ..engine.sampling.curves import frame_view
from ..engine.session import Session, Source
from ..engine.stream import Finished, SlotRequest
from ..engine.stream.walker import WindowWalker
from ..engine.stream.windows import window_frames
from .knobs import KnobRegistry
from .latency import RunnerStats
from .loop_buffer import LoopBuffer
from .loop_map import LoopMap
from .messages import (
    CurveOverride,
    Message,
    PromptConditioning,
    SourceSwap,
    StructureSwap,
    TargetCapture,
    TargetClear,
)
from .plugin_link import PLUGIN_ORIGIN
from .prompt_encoder import PromptEncoder
from .realtime import raise_thread_priority
from .shared_ticker import SharedTicker
from .writer import EMA_WEIGHT, AheadWriter

log = logging.getLogger("flowjam.runner")

PROMPT_SLOTS = ("a", "b", "negative")  # prompt A, prompt B, and the negative prompt that CFG guides away from


@dataclass(frozen=True)
class RunnerConfig:
    backend: str | None = None  # None: the session's own backend
    window_s: float = DEFAULT_WINDOW_SECONDS  # generation window (engine/stream/windows.py); 0: the whole loop
    endless: bool = False  # no loop: the buffer is a ring that rolls forward and the window walks without end
    ahead_s: float | None = None  # a window's write point past the playhead; None: lead + its steps' measured ticks
    patch_s: float = 0.4  # audio kept per write
    stop_timeout_s: float = 10.0  # how long stop() waits for a tick in progress (a heavy one may take longer)
    min_lead_s: float = 0.015  # the lead's floor; it follows the write time, its jitter and the output's block
    max_lead_s: float = 2.0
    bpm: int | None = None  # the caption's metas (a musical grid): tempo and beats per bar, None: not given
    time_signature: int | None = None


class LiveRunner:
    def __init__(
        self,
        session: Session,
        registry: KnobRegistry,
        buffer: LoopBuffer,
        prompt: str | Conditioning,
        prompt_b: str | Conditioning | None = None,
        source: Source | None = None,
        config: RunnerConfig = RunnerConfig(),
        negative: str | Conditioning | None = None,
        ticker: SharedTicker | None = None,
        name: str = "default",
    ):
        """`negative`: what CFG guides away from (None or "": the null condition, as the official pipeline).
        `ticker`: play on a lane called `name` of a ring shared with other sessions (ticked by the ticker's thread),
        refused with ValueError if the ring could no longer keep every session in real time; else on a stream of
        its own."""
        self.session, self.registry, self.buffer, self.config = session, registry, buffer, config
        self._hop = session.models.vae.hop_samples
        # a loop of whole bars is rarely whole latent frames; a cover's latent repeats the loop's start past its end
        self.loop_map = LoopMap(buffer.frames, self._hop, "loop" if source is not None else "latent")
        self.frames = self.loop_map.frames
        window = window_frames(config.window_s, None if config.endless else self.frames)
        self._walker = None  # whole-loop generation; else requests placed on a timeline at the playhead
        if window is not None:
            channels = session.models.config.audio_acoustic_hidden_dim
            self._walker = WindowWalker(self.frames, window, channels, session.device, session.dtype, config.endless)
        self._ticker = ticker
        depth = int(registry.get("depth"))
        if ticker is None:
            self.stream = session.stream(depth=depth, backend=config.backend, paced=True)
        else:
            cfg_mode = registry.specs["cfg_mode"].choice(registry.get("cfg_mode"))
            self.stream = ticker.add_lane(name, depth, int(registry.get("steps")), cfg_mode)
        buffer.gain = registry.get("volume")
        self._messages: queue.Queue[Message] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seq_applied = 0
        self._request_changed = False  # a per-request knob or a prompt changed since the last submitted request
        self._prompts: dict[str, Conditioning | None] = {
            "a": self._encode(prompt),
            "b": self._encode(prompt_b if prompt_b is not None else prompt),
            "negative": self._encode(negative) if negative else None,
        }
        self._captions_lock = threading.Lock()
        self._captions = {slot: "" if c is None else c.caption for slot, c in self._prompts.items()}
        self._blends: OrderedDict[float, Conditioning] = OrderedDict()
        self._null_conditions: dict[int, Conditioning] = {}  # condition length -> its null condition
        self._silence_context = session.context_latents(self.frames, None)
        self._blended_context: tuple[torch.Tensor, float, torch.Tensor] | None = None  # hints, structure, context
        self._captured_target: torch.Tensor | None = None
        self._set_source(source)
        self._latest: torch.Tensor | None = None
        self._latest_seq = 0
        self._encoder = PromptEncoder(self._encode_text, self._messages.put, self.count_error, session.device)
        self._errors_lock = threading.Lock()
        self.stats = RunnerStats(patch_s=config.patch_s)
        self._writer = AheadWriter(
            session,
            buffer,
            self.stats,
            self.count_error,
            (config.min_lead_s, config.max_lead_s),
            config.patch_s,
            # LiveApp fills the loop with the source; else the first latent does (a windowed one writes its window only)
            loop_filled=source is not None or self._walker is not None,
            loop_map=self.loop_map,
            ring=None if ticker is None else ticker.writer,
        )
        self._tick_done = torch.cuda.Event() if session.device.type == "cuda" and ticker is None else None
        self._tick_started: float | None = None
        if ticker is not None:
            self.stats.latency.follow_cycles(ticker.cycle_starts)
            ticker.register(self)

    def _encode(self, prompt: str | Conditioning) -> Conditioning:
        return prompt if isinstance(prompt, Conditioning) else self._encode_text(prompt)

    def _encode_text(self, text: str) -> Conditioning:
        """A prompt with the grid's tempo and metre in its caption's metas."""
        return self.session.encode_text(text, bpm=self.config.bpm, time_signature=self.config.time_signature)

    # ---- messages (any thread) -------------------------------------------------------------------------------

    def set_prompt(self, which: str, text: str) -> None:
        """Prompt text for slot "a", "b" or "negative" (an empty negative goes back to the null condition); encoded
        off the runner thread, applied at the top of the tick after it is ready."""
        self._encoder.submit(_prompt_slot(which), text)

    def captions(self) -> dict[str, str]:
        """The prompt texts playing now: "a", "b" and "negative" ("" for the null condition)."""
        with self._captions_lock:
            return dict(self._captions)

    def retempo(self, bpm: int) -> None:
        """The grid's tempo moved: every prompt is encoded again with the new tempo in its metas."""
        self.config = replace(self.config, bpm=bpm)
        for slot, text in self.captions().items():
            if text or slot != "negative":
                self.set_prompt(slot, text)

    @property
    def encoding(self) -> bool:
        """Prompt texts are waiting to be encoded or being encoded."""
        return not self._encoder.idle

    def set_conditioning(self, which: str, conditioning: Conditioning | None) -> None:
        """Use an already encoded condition as prompt A, B or the negative (from a ComfyUI graph, say)."""
        if conditioning is None and which != "negative":
            raise ValueError(f"prompt {which!r} needs a condition; only the negative can be None (the null condition)")
        self._messages.put(PromptConditioning(_prompt_slot(which), conditioning))

    def set_curve(self, name: str, curve: torch.Tensor | None) -> None:
        """A per-frame shared curve (or None to fall back to the knob's scalar) for every in-flight slot."""
        self._messages.put(CurveOverride(name, curve))

    def set_structure(self, context: torch.Tensor | None) -> None:
        """Text-only structure: context latents [1, frames, 128] (e.g. `session.codes_context` of LM codes) that the
        `structure` knob fades in, with no source audio; None goes back to plain text2music."""
        if context is not None and tuple(context.shape) != (1, self.frames, self._silence_context.shape[-1]):
            raise ValueError(
                f"structure context must be [1, {self.frames}, {self._silence_context.shape[-1]}], got {tuple(context.shape)}"
            )
        self._messages.put(StructureSwap(context))

    def swap_source(self, source: Source | None) -> None:
        """Replace the source (None: text-only). Its length must match the loop buffer."""
        if source is not None and source.frames != self.frames:
            raise ValueError(
                f"source has {source.frames} frames but the loop has {self.frames}; trim or pad it to the loop length"
            )
        self._messages.put(SourceSwap(source))

    def capture_target(self) -> None:
        """The loop as it sounds now becomes what `x0_target_strength` pulls toward."""
        self._messages.put(TargetCapture())

    def clear_target(self) -> None:
        """Back to the default x0 target: the source's latents, or none for a text-only loop."""
        self._messages.put(TargetClear())

    def start(self) -> None:
        self._writer.start()
        if self._ticker is not None:
            self._ticker.attach(self)
            return
        self._thread = threading.Thread(target=self._run, name="flowjam-runner", daemon=True)
        self._thread.start()
        _started.add(self)

    def stop(self) -> None:
        """Ask the loop to end after the tick (and the write) in progress and wait up to `config.stop_timeout_s`;
        on a shared ring, leave it (the lane ends, the other sessions play on)."""
        self._stop.set()
        self._encoder.stop()
        if self._ticker is not None:
            self._ticker.detach(self, self.config.stop_timeout_s)
        if self._thread is not None:
            self._thread.join(self.config.stop_timeout_s)
        self._writer.stop(self.config.stop_timeout_s)  # its own wait: a write in progress ends before we return
        _started.discard(self)

    @property
    def request_frames(self) -> int:
        """T of this stream's requests: its window, or the whole loop (the ring it plays on needs one T)."""
        return self.frames if self._walker is None else self._walker.window

    @property
    def writer(self) -> AheadWriter:
        """This session's writer (its windows decoded by the ring's writer on a ring with batched writes)."""
        return self._writer

    @property
    def current_source(self) -> Source | None:
        return self._source

    @property
    def latest(self) -> torch.Tensor | None:
        """The newest finished latent [1, T, 64] (what the loop is being rewritten with), None before the first."""
        return self._latest

    @property
    def latest_seq(self) -> int:
        """The knob registry's sequence number when the newest latent's request was made: the latent carries every
        knob change up to it."""
        return self._latest_seq

    @property
    def target(self) -> torch.Tensor | None:
        """The x0 target requests carry: a captured loop, else the source's latents, else None."""
        if self._captured_target is not None:
            return self._captured_target
        return None if self._source is None else self._source.latents

    @property
    def alive(self) -> bool:
        if self._ticker is not None:
            return self._writer.running and not self._stop.is_set() and self._ticker.alive
        return self._thread is not None and self._thread.is_alive()

    # ---- the loop (runner thread) ----------------------------------------------------------------------------

    def _run(self) -> None:
        raise_thread_priority()
        while not self._stop.is_set():
            try:
                self.tick()
            except Exception as error:  # a bad message or knob must never stop the music
                self.count_error(error)
                time.sleep(0.01)

    def count_error(self, error: Exception) -> None:
        """Count and log a failure; the stream keeps playing."""
        with self._errors_lock:
            self.stats.errors += 1
            if str(error) != self.stats.last_error:
                log.error("runner: %s; the stream keeps playing", error, exc_info=not isinstance(error, ValueError))
            self.stats.last_error = str(error)

    def step(self) -> None:
        """One tick and, for a runner stepped by hand (not started), its write ahead of the playhead; on a shared
        ring, one tick of the ring (every session on it)."""
        if self._ticker is not None:
            self._ticker.step()
            return
        self.tick()
        self.write_pending()

    def write_pending(self) -> None:
        """For a runner stepped by hand: write the newest latent ahead of the playhead now."""
        if not self._writer.running:
            self._writer.write_pending()

    def tick(self) -> None:
        """Messages, knobs, submit, one tick (waited for on a GPU); a finished latent goes to the writer."""
        if self._ticker is not None:
            raise RuntimeError("a runner on a shared ring is ticked by the ring: call step() or ring.step()")
        started = self.begin_tick()
        finished = self.stream.tick()
        if self._tick_done is not None:
            self._tick_done.record()
            self._tick_done.synchronize()
        self.end_tick(started, time.perf_counter(), finished)

    def begin_tick(self) -> float:
        """A tick's first half: messages, knobs and this tick's request; -> when the tick started."""
        self._drain_messages()
        self.apply_knobs()
        started = time.perf_counter()
        if self._tick_started is not None:
            self.stats.loop_s += EMA_WEIGHT * (started - self._tick_started - self.stats.loop_s)
        self._tick_started = started
        self.stats.latency.tick_started(started)
        self.stream.submit(self._request(), supersedes=self._request_changed)
        self._request_changed = False
        return started

    def end_tick(self, started: float, tick_done: float, finished: list[Finished]) -> None:
        """A tick's second half: its figures, and the newest finished latent to the writer."""
        self.stats.ticks += 1
        fresh_from = self._land(finished)
        self.tick_ended(started, tick_done, len(finished), fresh_from, self.stats.ticks)
        self._offer(fresh_from)

    def hand_out(self, finished: list[Finished]) -> tuple[int, int | None]:
        """A tick launched and not yet ended (a ring that overlaps its ticks): its latents to the writer now (they
        are ready once the device gets past the tick) -> (the tick's number, the tag of the request it finished or
        None), for `tick_ended` once it has ended."""
        self.stats.ticks += 1
        fresh_from = self._land(finished)
        self._offer(fresh_from)
        return self.stats.ticks, fresh_from

    def tick_ended(self, started: float, tick_done: float, latents: int, fresh_from: int | None, tick: int) -> None:
        """Tick `tick` (begun at `started`) ended at `tick_done`, finishing `latents` (the newest from request
        `fresh_from`): its figures."""
        self.stats.tick_ms = (tick_done - started) * 1000.0
        if latents:
            self.stats.latents += latents
            self.stats.latent_times.extend([tick_done] * latents)
        self.stats.latency.tick_done(tick_done, fresh_from, tick)

    def _land(self, finished: list[Finished]) -> int | None:
        """The finished latents merged in as the latent the writer decodes -> the newest one's request tag."""
        if not finished:
            return None
        self._latest = self._landed(finished)
        self._latest_seq = finished[-1].request.tag
        return self._latest_seq

    def _offer(self, fresh_from: int | None) -> None:
        """The newest latent to the writer, if this tick finished one."""
        if fresh_from is not None:
            self._writer.offer(self._latest, fresh_from, self.stats.ticks)

    def _landed(self, finished: list[Finished]) -> torch.Tensor:
        """The latent the writer decodes from now on: the newest whole loop, or, windowed, the timeline with the
        finished windows merged in (after the frames whose audio is already written, which never change)."""
        if self._walker is None:
            return finished[-1].latent
        written = self.buffer.playhead_frames + int(self.stats.lead_s * self.buffer.sample_rate)
        frozen = self.loop_map.latent_sample(written) // self._hop
        self._walker.land(finished, frozen)
        return self._walker.timeline.snapshot()  # a copy for the writer's thread: merges go on here meanwhile

    def _drain_messages(self) -> None:
        """Apply every waiting message in order."""
        while True:
            try:
                message = self._messages.get_nowait()
            except queue.Empty:
                return
            try:
                self._apply_message(message)
            except Exception as error:  # one bad message must not drop the ones after it
                self.count_error(error)

    def _apply_message(self, message: Message) -> None:
        if isinstance(message, PromptConditioning):
            self._set_prompt(message.slot, message.conditioning)
        elif isinstance(message, CurveOverride):
            self._override_curve(message.name, message.curve)
        elif isinstance(message, SourceSwap):
            self._set_source(message.source)
            self._latest = None  # the next generation starts from the new source, not the old loop
            self._writer.forget()
        elif isinstance(message, StructureSwap):
            self._source = None
            self._hints_context = (
                None if message.context is None else message.context.to(self.session.device, self.session.dtype)
            )
        elif isinstance(message, TargetCapture):
            if self._latest is None:
                raise ValueError(
                    "target capture ignored: the first generation has not finished yet; capture again in a moment"
                )
            if self._walker is None:
                self._captured_target = self._latest
            else:  # the loop as heard: frames no window has reached yet are silence
                silence = self._silence_context[..., : self._walker.timeline.latents.shape[-1]]
                self._captured_target = self._walker.timeline.snapshot(unwritten=silence)
        elif isinstance(message, TargetClear):
            self._captured_target = None

    def _override_curve(self, name: str, curve: torch.Tensor | None) -> None:
        """A shared curve, or None back to the knob's value; windowed, a per-frame one is read at each window."""
        if self._walker is not None:
            if curve is not None and frame_view(curve).shape[1] > 1:
                self._walker.set_frame_curve(name, curve)
                return
            self._walker.drop_frame_curve(name)
        if curve is None:
            self._apply_shared(name, self.registry.get(name))
        else:
            self.stream.set_shared_curve(name, curve)

    def _set_prompt(self, slot: str, conditioning: Conditioning | None) -> None:
        self._prompts[slot] = conditioning
        with self._captions_lock:
            self._captions[slot] = "" if conditioning is None else conditioning.caption
        self._request_changed = True
        if slot != "negative":
            self._blends.clear()

    def apply_knobs(self) -> None:
        """Knob changes since the last pass, onto the stream (a ring that overlaps its ticks passes again just before
        launching one, so a shared knob moved during the runners' turns is in it)."""
        for change in self.registry.changes_since(self._seq_applied):
            spec = self.registry.specs[change.name]
            if change.name.startswith(LORA_KNOB_PREFIX):
                self._apply_lora(change.name[len(LORA_KNOB_PREFIX) :], change.value)
            elif spec.kind is KnobKind.SHARED:
                self._apply_shared(change.name, change.value)
            elif change.name == "depth":
                self.stream.set_depth(int(change.value))
            elif change.name == "volume" and change.origin != PLUGIN_ORIGIN:  # a DAW plugin set the gain itself
                self.buffer.gain = change.value
            self._request_changed |= spec.kind is KnobKind.REQUEST
            if spec.kind is not KnobKind.GLOBAL:
                self.stats.latency.track(change, spec.kind, self.stats.ticks + 1)
            self._seq_applied = max(self._seq_applied, change.seq)

    def _apply_lora(self, name: str, strength: float) -> None:
        """A LoRA strength knob (on a shared ring, this session's own strength); one whose LoRA was unloaded
        meanwhile is reported, and the stream plays on."""
        try:
            if self._ticker is None:
                self.session.set_lora_strength(name, strength)
            else:
                self.stream.set_lora_strength(name, strength)
        except ValueError as error:
            self.count_error(error)

    def _apply_shared(self, name: str, value: float) -> None:
        """A shared knob at its default lets every slot run its own request's value (the default too), so the
        stream takes exactly the path it takes when the knob was never touched."""
        self.stream.set_shared_curve(name, None if value == KNOBS_BY_NAME[name].default else value)

    def _set_source(self, source: Source | None) -> None:
        """Switch source; its context latents are built here once, not on every tick."""
        self._source = source
        self._hints_context = None if source is None else self.session.context_latents(self.frames, source)
        if source is not None and self._walker is not None:
            self._walker.fill(source.latents)

    def _condition(self) -> Conditioning:
        blend = round(self.registry.get("prompt_blend"), 2)
        cached = self._blends.get(blend)
        if cached is None:
            cached = self.session.blend_conditionings(self._prompts["a"], self._prompts["b"], blend)
            self._blends[blend] = cached
            if len(self._blends) > 16:
                self._blends.popitem(last=False)
        return cached

    def _negative(self, condition: Conditioning) -> Conditioning:
        """The negative prompt, or the null condition at the condition's length (built once per length)."""
        if self._prompts["negative"] is not None:
            return self._prompts["negative"]
        null = self._null_conditions.get(condition.length)
        if null is None:
            null = self._null_conditions[condition.length] = self.session.null_conditioning(condition)
        return null

    def _request(self):
        knobs = self.registry
        seconds = self.frames / LATENT_RATE_HZ
        condition = self._condition()
        cfg_mode = knobs.specs["cfg_mode"].choice(knobs.get("cfg_mode"))
        options: dict[str, Any] = dict(
            seed=int(knobs.get("seed")),
            steps=int(knobs.get("steps")),
            shift=knobs.get("shift"),
            tag=knobs.seq,
            cfg_mode=cfg_mode,
            negative=None if cfg_mode == "off" else self._negative(condition),
            x0_target=self.target,
        )
        if self._walker is not None:
            return self._window_request(condition, options)
        options["context_latents"] = self._context()
        start = self._latest if self._latest is not None else (None if self._source is None else self._source.latents)
        if start is None:
            return self.session.make_request(condition, seconds, **options)
        return self.session.make_request(
            condition, seconds, denoise=knobs.get("denoise"), source_latents=start, **options
        )

    def _window_request(self, condition: Conditioning, options: dict[str, Any]) -> SlotRequest:
        """The request for the window at the playhead (live/walker.py)."""
        walker, knobs = self._walker, self.registry
        ahead_s = self.config.ahead_s
        if ahead_s is None:  # when it is delivered, from now
            ahead_s = self.stats.lead_s + options["steps"] * self.stats.loop_s
        write_at = self.buffer.playhead_frames + int(ahead_s * self.buffer.sample_rate)
        place = walker.place(self.loop_map.latent_sample(write_at), self._hop)
        denoise = knobs.get("denoise")
        options.update(
            walker.inputs(place, self._context(), options["x0_target"], denoise, options["steps"], options["shift"])
        )
        walker.crop_frame_curves(place, self.stream.set_shared_curve)
        seconds = place.frames / LATENT_RATE_HZ
        if "source_latents" not in options:
            return self.session.make_request(condition, seconds, **options)
        return self.session.make_request(condition, seconds, denoise=denoise, **options)

    def _context(self) -> torch.Tensor:
        """The requests' context latents: silence, or structure hints blended in by the `structure` knob. The same
        tensor while neither changes, so the stream checks it for NaN once, not with a GPU sync on every tick."""
        if self._hints_context is None:
            return self._silence_context
        hints, structure = self._hints_context, self.registry.get("structure")
        kept = self._blended_context
        if kept is None or kept[0] is not hints or kept[1] != structure:
            kept = self._blended_context = (hints, structure, torch.lerp(self._silence_context, hints, structure))
        return kept[2]

    def status(self) -> dict[str, Any]:
        stats = self.stats
        return {
            "ticks": stats.ticks,
            "latents": stats.latents,
            "tick_ms": round(stats.tick_ms, 2),
            "loop_ms": round(stats.loop_s * 1000.0, 2),
            "decode_ms": round(stats.decode_ms, 2),
            "interval_ms": round(stats.interval_s * 1000.0, 2),
            "write_ms": round(stats.write_s * 1000.0, 2),
            "late_writes": stats.late_writes,
            "lead_s": round(stats.lead_s, 3),
            "patch_s": round(stats.patch_s, 3),
            "playhead_s": round(self.buffer.position / self.buffer.sample_rate, 3),
            "song_s": round(self.buffer.playhead_frames / self.buffer.sample_rate, 3),  # time played (endless)
            "window_s": 0.0 if self._walker is None else self._walker.window / LATENT_RATE_HZ,
            "endless": self.config.endless,
            "errors": stats.errors,
            "last_error": stats.last_error,
            "depth": self.stream.depth,
            "tick_graphs": self.stream.stats()["graphs"],
            "window_graphs": self._writer.graph_counters,
            "cfg_mode": self.registry.specs["cfg_mode"].choice(self.registry.get("cfg_mode")),
            "negative": "null condition" if self._prompts["negative"] is None else self._prompts["negative"].caption,
            "target": "captured"
            if self._captured_target is not None
            else ("source" if self._source is not None else None),
        }


def _prompt_slot(which: str) -> str:
    if which not in PROMPT_SLOTS:
        raise ValueError(f"prompt slot must be one of {', '.join(PROMPT_SLOTS)}, got {which!r}")
    return which


_started: weakref.WeakSet[LiveRunner] = weakref.WeakSet()  # runners started and not stopped


@atexit.register
def _stop_started_runners() -> None:
    """A daemon thread still inside a torch call when the interpreter finalizes aborts the process ("terminate called
    without an active exception"): a runner nobody stopped is stopped, its writer too, before that."""
    for runner in list(_started):
        runner.stop()

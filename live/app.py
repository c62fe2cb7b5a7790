"""A live performance: session + knob registry + loop buffer + playback + runner + OSC (+ MIDI), started and
stopped as one. `python -m flowjam live` is a thin shell around `LiveApp`."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..engine.audio.files import read_audio
from ..engine.conditioning import Conditioning
from ..engine.lm.song import lm_duration
from ..engine.params import LATENT_RATE_HZ, MAX_SONG_SECONDS, lora_knob, song_frames
from ..engine.session import Session, Source
from ..engine.stream.windows import ring_frames, window_frames
from .knobs import KnobRegistry
from .loop_buffer import LoopBuffer
from .osc import TRANSPORT_COMMANDS, OscBridge, OscConfig
from .playback import DEFAULT_BLOCKSIZE, Playback
from .runner import LiveRunner, RunnerConfig

log = logging.getLogger("flowjam.live")
NO_AUDIO_DEVICE = (
    "no audio device: playing silently (capture, recording and the knobs still work); connect an output and "
    "restart the stream"
)


@dataclass(frozen=True)
class LiveConfig:
    prompt: str
    prompt_b: str | None = None
    negative: str | None = None  # what CFG guides away from; None: the null condition (official default)
    source: Path | None = None
    song_seconds: float = 30.0
    session_name: str = "default"
    audio_device: str | int | None = None
    blocksize: int = DEFAULT_BLOCKSIZE  # frames per output callback; the writer's lead covers one
    playback_mode: str = "process"  # process | thread | null | null-process (no audio device; see playback.py)
    record: Path | None = None
    osc_host: str = "127.0.0.1"
    osc_port: int | None = 9000  # None: no OSC
    osc_feedback: tuple[str, int] | None = None
    osc_allow: tuple[str, ...] | None = None
    midi_port: str | None = None
    midi_map: Path | None = None
    midi_learn: tuple[str, ...] = ()  # knobs to learn in order (move one control per knob); saved to midi_map
    midi_backend: str | None = None  # "alsa", "jack" or a mido backend name; None: mido's default ($MIDO_BACKEND)
    lm: bool = False  # text-only: the 5 Hz LM writes the loop's structure (audio codes) from prompt A at start
    lm_checkpoint: Path | None = None
    lm_preset: str = "tiny"
    runner: RunnerConfig = RunnerConfig()

    @property
    def uses_midi(self) -> bool:
        return self.midi_port is not None or self.midi_map is not None or bool(self.midi_learn)


def add_lora_knobs(registry: KnobRegistry, session: Session) -> None:
    """A `lora/<name>` knob, at the LoRA's strength, for every playable (live or folded) LoRA the session has and
    the registry lacks."""
    for name, (strength, mode) in session.loras.items():
        spec = lora_knob(name)
        if mode != "merged" and spec.name not in registry.specs:
            registry.add(spec)
            registry.set(spec.name, strength, origin="load")


def parse_host_port(text: str) -> tuple[str, int]:
    """ "127.0.0.1:9111" -> ("127.0.0.1", 9111), with an error naming the expected form."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT such as 127.0.0.1:9111, got {text!r}")
    return host, int(port)


class LiveApp:
    def __init__(
        self,
        session: Session,
        config: LiveConfig,
        registry: KnobRegistry | None = None,
        initial_conditionings: tuple[Conditioning, Conditioning] | None = None,
        source: Source | None = None,
    ):
        """`initial_conditionings` (A, B) replace the prompt texts; `source` replaces `config.source`."""
        self.session, self.config = session, config
        self.registry = registry or KnobRegistry()
        add_lora_knobs(self.registry, session)
        seconds = config.song_seconds
        initial = None
        if source is None and config.source is not None:
            audio, rate = read_audio(config.source, MAX_SONG_SECONDS)  # a longer source loops its first 10 min
            source = session.prepare_source(audio, rate)
        if source is not None:
            seconds = source.frames / LATENT_RATE_HZ
            initial = session.decode(source.latents)
        frames = self._ring_frames(config, seconds, source is not None)
        hop = session.models.vae.hop_samples
        self.buffer = LoopBuffer(frames * hop, channels=2, sample_rate=session.sample_rate)
        try:
            if initial is not None:
                self.buffer.fill(initial[:, : frames * hop])
            self.playback = Playback(
                self.buffer,
                device=config.audio_device,
                blocksize=config.blocksize,
                mode=config.playback_mode,
                record_path=None if config.record is None else str(config.record),
            )
            prompts = initial_conditionings or (config.prompt, config.prompt_b)
            self.runner = LiveRunner(
                session, self.registry, self.buffer, prompts[0], prompts[1], source, config.runner, config.negative
            )
            if config.lm:
                if source is not None:
                    raise ValueError(
                        "--lm writes the structure from the text; a --source brings its own: use one of them"
                    )
                self.runner.set_structure(self._lm_structure(frames))
            self.osc: OscBridge | None = None
            self.midi = None
            self.mapper = None
            self._midi_map: Path | None = None
            self._started = False
            self.output_warning: str | None = None  # why it plays silently though an output was asked for
            if config.osc_port is not None:
                self.enable_osc(config.osc_port, config.osc_host, config.osc_feedback, config.osc_allow)
            if config.uses_midi:
                self.enable_midi(config.midi_port, config.midi_map, config.midi_learn, config.midi_backend)
        except BaseException:  # nothing half-built stays behind: the shared memory and any threads go
            self._discard()
            raise

    @staticmethod
    def _ring_frames(config: LiveConfig, seconds: float, has_source: bool) -> int:
        """Frames of the playback buffer: the loop, or for endless play the window's ring."""
        if not config.runner.endless:
            return song_frames(seconds, "song_seconds")
        if has_source:
            raise ValueError("endless play is text-only: a source sets the song's length (it loops); leave one out")
        if config.lm:
            raise ValueError("endless play has no song length for the 5 Hz LM to write a structure for; use a loop")
        return ring_frames(window_frames(config.runner.window_s, None), None)

    def _discard(self) -> None:
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.stop()
        self.buffer.unlink()

    def _lm_structure(self, frames: int) -> torch.Tensor:
        """LM codes for prompt A over the loop (at least the LM's 10 s; cropped to the loop) -> context latents."""
        session, config = self.session, self.config
        if session.song_writer is None:
            session.attach_lm(config.lm_checkpoint, config.lm_preset)
        song = session.generate_codes(
            config.prompt, lm_duration(frames / LATENT_RATE_HZ), seeds=(int(self.registry.get("seed")),)
        )
        log.info("LM structure: %d codes, %s", song.codes.shape[1], song.metadata.cot().replace("\n", ", "))
        return session.codes_context(song.codes[0], frames)

    def enable_osc(
        self,
        port: int,
        host: str = "127.0.0.1",
        feedback: tuple[str, int] | None = None,
        allow: tuple[str, ...] | None = None,
    ) -> OscBridge:
        """Add (or replace) the OSC bridge; started at once if the app already runs. If the new bridge cannot start
        (a busy port), the old one keeps serving and the error is raised."""
        old = self.osc
        same_port = old is not None and old.config.port == port and port != 0
        if same_port and self._started:
            old.stop()  # free the port for its replacement
        bridge = OscBridge(
            self.registry,
            OscConfig(session=self.config.session_name, host=host, port=port, feedback=feedback, allow_hosts=allow),
            on_prompt=self.runner.set_prompt,
            on_transport=self.transport,
            on_target=self.target,
            status=self.status,
        )
        if self._started:
            try:
                bridge.start()
            except OSError:
                if same_port:
                    old.start()
                raise
        if old is not None and not same_port:
            old.stop()
        self.osc = bridge
        return bridge

    def enable_midi(
        self,
        port: str | None = None,
        map_path: Path | None = None,
        learn: tuple[str, ...] = (),
        backend: str | None = None,
    ) -> None:
        """Add (or replace) the MIDI input, loading `map_path` if it exists and learning `learn` knobs in order (the
        mapper arms each knob once the previous control is released). `backend` None: the config's."""
        from .midi import MidiInput, MidiMapper

        if self.midi is not None:
            self.midi.stop()
        existing = map_path is not None and Path(map_path).is_file()
        self.mapper = MidiMapper.load(map_path, self.registry) if existing else MidiMapper(self.registry)
        self._midi_map = map_path
        if learn:
            self.mapper.learn(*learn)
        self.midi = MidiInput(self.mapper, port_name=port, backend=backend or self.config.midi_backend)
        if self._started:
            self.midi.start()

    def transport(self, command: str) -> None:
        """play: fade in at the playhead; stop: fade to silence within 10 ms, the engine keeps running (warm);
        reset: every knob back to its default. The new state is echoed to OSC controllers."""
        if command == "reset":
            self.registry.reset()
            return
        if command not in TRANSPORT_COMMANDS:
            raise ValueError(f"unknown transport command {command!r}: {', '.join(TRANSPORT_COMMANDS)}")
        self.buffer.playing = command == "play"
        if self.osc is not None:
            self.osc.announce("transport", command)

    def target(self, command: str) -> None:
        """capture: the loop as it sounds now becomes the x0 target; clear: back to the source (or none)."""
        if command == "capture":
            if self.runner.latest is None:
                raise ValueError(
                    "nothing to capture yet: the first generation has not finished; capture again in a moment"
                )
            self.runner.capture_target()
        elif command == "clear":
            self.runner.clear_target()
        else:
            raise ValueError(f"unknown target command {command!r}: capture or clear")

    def start(self) -> None:
        """Open MIDI first (a missing port or MIDI system fails before anything runs), then start playback (falling
        back to a silent real-time clock when no audio device can be opened and none was asked for by name), the
        runner and OSC."""
        try:
            if self.midi is not None:
                self.midi.start()
            self._start_playback()
            self.runner.start()
            self._started = True
            if self.osc is not None:
                self.osc.start()
        except BaseException:  # undo what did start: no thread outlives a failed start, no shared memory leaks
            self.stop()
            raise

    def _start_playback(self) -> None:
        try:
            self.playback.start()
        except Exception as error:
            if self.config.audio_device is not None or self.config.playback_mode.startswith("null"):
                raise
            log.warning(
                "no audio output (%s); running without sound%s", error, ", recording only" if self.config.record else ""
            )
            self.playback = Playback(
                self.buffer,
                blocksize=self.config.blocksize,
                mode="null",
                record_path=None if self.config.record is None else str(self.config.record),
            )
            self.playback.start()
            self.output_warning = NO_AUDIO_DEVICE

    def stop(self) -> None:
        """Stop everything in reverse order; the recording is written by the playback's stop."""
        for part in (self.midi, self.osc):
            if part is not None:
                part.stop()
        if self.midi is not None and self._midi_map is not None:
            self.mapper.save(self._midi_map)
        self.runner.stop()
        self.playback.stop()
        self.buffer.unlink()

    @property
    def played_frames(self) -> int:
        """Frames played of the stream's own audio (its source, or generations): none of the silence before its
        first generation filled the loop."""
        since = self.runner.stats.audio_from_frames
        return 0 if since is None else self.playback.playhead_frames - since

    def capture(self, seconds: float):
        """The last `seconds` of what was played, float32 [2, N]: the loop region just behind the playhead (writes
        only ever land ahead of it), capped below the loop length minus the write window, and at `played_frames`."""
        rate = self.buffer.sample_rate
        limit = self.buffer.frames - int((self.runner.stats.lead_s + self.runner.stats.patch_s) * rate)
        frames = min(int(seconds * rate), max(0, limit), self.played_frames)
        if frames <= 0:
            return np.zeros((self.buffer.channels, 0), np.float32)
        end = self.buffer.position
        loop = self.buffer.snapshot()
        return np.roll(loop, -end, axis=1)[:, -frames:] * self.buffer.gain

    def status(self) -> dict[str, Any]:
        status = self.runner.status()
        playback = self.playback.stats()
        status.update(
            underruns=playback.get("underruns"),
            recording_error=playback.get("recording_error"),
            output_warning=self.output_warning,
            playing=self.playback.running,
            transport="playing" if self.buffer.playing else "stopped",
        )
        if self.osc is not None:
            osc = self.osc.stats()
            status["last_osc"] = osc["last_message"]
            status["osc"] = {key: osc[key] for key in ("received", "applied", "rejected", "clamped", "dropped_hosts")}
        status["knobs"] = self.registry.values()
        return status

    def status_line(self) -> str:
        s = self.status()
        return (
            f"tick {s['tick_ms']:6.1f} ms  decode {s['decode_ms']:5.1f} ms  lead {s['lead_s']:.2f} s  "
            f"{'song' if s['endless'] else 'playhead'} {s['song_s' if s['endless'] else 'playhead_s']:6.2f} s  underruns {s['underruns']}  errors {s['errors']}  latents {s['latents']}  "
            f"osc rejected {sum(s.get('osc', {}).get('rejected', {}).values())}  last {s.get('last_osc') or '-'}"
            + ("  RECORDING STOPPED" if s["recording_error"] else "")
        )

"""A live performance: session + knob registry + loop buffer + playback + runner + OSC (+ MIDI), started and
stopped as one. `python -m flowjam live` is a thin shell around `LiveApp`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..engine.audio.beats import SourceGrid
from ..engine.audio.files import read_audio
from ..engine.conditioning import Conditioning
from ..engine.lm.song import lm_duration
from ..engine.params import LATENT_RATE_HZ, MAX_SONG_SECONDS, lora_knob
from ..engine.session import Session, Source
from ..engine.stream.windows import window_frames
from .following import Following
from .knobs import KnobRegistry
from .loop_buffer import LoopRegion
from .loop_map import LoopMap
from .loop_plan import LoopPlan, source_plan, text_plan
from .osc import TRANSPORT_COMMANDS, OscBridge, OscConfig
from .playback import DEFAULT_BLOCKSIZE, PORTAUDIO_FIX, PORTAUDIO_MISSING, Playback
from .plugin_output import PluginOutput
from .plugin_tempo import HostTempo
from .runner import LiveRunner, RunnerConfig
from .shared_ticker import SharedTicker
from .sync.follow import FollowedClock, clock_grid, open_clock
from .sync.grid import Grid
from .sync.lock import check_offset_ms
from .sync.midi_clock import MidiClockFollower

log = logging.getLogger("flowjam.live")
SILENT = "playing silently (capture, recording and the knobs still work)"
NO_AUDIO_DEVICE = f"no audio device: {SILENT}; connect an output and restart the stream"


def silent_output_warning(error: BaseException) -> str:
    """Why a stream plays silently, for its status: PortAudio missing (with the install line) or no output device."""
    if PORTAUDIO_MISSING in str(error):
        return f"no audio: {PORTAUDIO_MISSING}; {SILENT}; {PORTAUDIO_FIX}, then restart the stream"
    return NO_AUDIO_DEVICE


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
    playback_mode: str = "process"  # process | thread | null | null-process (see playback.py) | plugin (a DAW's)
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
    bpm: float | None = None  # the grid's tempo (into the caption's metas); with --sync, the clock's when not given
    time_signature: int | None = None  # beats per bar (2, 3, 4, 6); None: a JACK master's metre, else 4
    bars: int | None = None  # the loop is exactly this many bars; None: song_seconds in whole bars once a tempo is set
    source_bpm: float | None = None  # the source's tempo (else estimated with librosa when the source is on a grid)
    source_downbeat_s: float | None = None  # the source's first downbeat (else estimated)
    sync: str | None = None  # follow a clock: link | midi | jack (live/sync/)
    sync_offset_ms: float = 0.0  # play this much later against the clock (a DAW's own output latency, say)
    click: bool = False  # a metronome click on every bar start of the loop
    panel_port: int | None = 0  # with playback_mode "plugin": the panel's port on loopback (0: a free one; None: none)
    runner: RunnerConfig = RunnerConfig()

    def __post_init__(self) -> None:
        check_offset_ms(self.sync_offset_ms, "sync_offset_ms")  # else a NaN fails in the phase lock, mid-performance

    @property
    def uses_midi(self) -> bool:
        return self.midi_port is not None or self.midi_map is not None or bool(self.midi_learn)


def on_the_grid(config: LiveConfig) -> bool:
    """A source is cut to whole bars when a tempo, a bar count or its own tempo is given."""
    return config.bpm is not None or config.bars is not None or config.source_bpm is not None


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
        ticker: SharedTicker | None = None,
    ):
        """`initial_conditionings` (A, B) replace the prompt texts; `source` replaces `config.source`; `ticker`: play
        on lanes of a ring shared with other sessions (named after `config.session_name`), else on a stream of its
        own."""
        self.session, self.config, self.ticker = session, config, ticker
        self._lanes = 0  # the runners made on the ticker so far: each takes a lane of its own name
        self.registry = registry or KnobRegistry()
        add_lora_knobs(self.registry, session)
        self.midi = self.mapper = None
        self._midi_map: Path | None = None
        self._started = False
        self.clock: FollowedClock | None = None
        self.following: Following | None = None
        try:
            source, plan = self._plan(config, source)
        except BaseException:
            self._close_clock()
            raise
        self.plan = plan
        following = self.clock is not None or config.playback_mode == "plugin"
        self.buffer = plan.buffer(session.sample_rate, tempo_may_change=following)
        try:
            if source is not None:
                self.buffer.fill(session.decode(source.latents)[:, : plan.samples])
            self.playback = self._output(config)
            prompts = initial_conditionings or (config.prompt, config.prompt_b)
            self._runner_config = config.runner
            if self.grid is not None:
                beats = self.grid.beats_per_bar
                self._runner_config = replace(config.runner, bpm=round(self.grid.bpm), time_signature=beats)
            self.runner = LiveRunner(
                session,
                self.registry,
                self.buffer.region(0),
                prompts[0],
                prompts[1],
                source,
                self._runner_config,
                config.negative,
                **self._lane(),
            )
            if config.lm:
                if source is not None:
                    raise ValueError(
                        "--lm writes the structure from the text; a --source brings its own: use one of them"
                    )
                self.runner.set_structure(self._lm_structure(self.runner.frames))
            if config.click and self.grid is not None:
                bar = self.grid.bar_samples(session.sample_rate)
                self.buffer.set_click(bar, 0.0 if plan.bars else bar)
            if self.clock is not None:
                self.following = Following(
                    self.clock,
                    self.buffer,
                    self.grid,
                    plan.bars,
                    config.sync_offset_ms / 1000.0,
                    lambda: self.runner,
                    self._runner_at,
                    self._switched,
                    self._announce,
                )
            self.osc: OscBridge | None = None
            self.output_warning: str | None = None  # why it plays silently though an output was asked for
            if config.osc_port is not None:
                self.enable_osc(config.osc_port, config.osc_host, config.osc_feedback, config.osc_allow)
            if config.uses_midi and self.midi is None:
                self.enable_midi(config.midi_port, config.midi_map, config.midi_learn, config.midi_backend)
        except BaseException:  # nothing half-built stays behind: the shared memory and any threads go
            self._discard()
            raise

    def _output(self, config: LiveConfig) -> Playback | PluginOutput:
        """The sound card (or a null clock), or with playback_mode "plugin" the DAW plugin that attaches by name."""
        if config.playback_mode == "plugin":
            output = PluginOutput(
                self.buffer,
                self.registry,
                config.session_name,
                self.set_prompt,
                lambda: self.runner.captions(),
                lambda: self.runner.stats.audio_from_frames is not None,
                config.panel_port,
            )
            if self.grid is not None:
                output.set_bars(self.plan.bars, self.grid.bar_samples(self.session.sample_rate), config.click)
            if self.grid is not None and self.plan.bars:
                output.tempo = HostTempo(
                    output.control,
                    self.buffer,
                    self.grid,
                    self.plan.bars,
                    lambda: self.runner,
                    self._runner_at,
                    self._switched,
                )
            return output
        return Playback(
            self.buffer,
            device=config.audio_device,
            blocksize=config.blocksize,
            mode=config.playback_mode,
            record_path=None if config.record is None else str(config.record),
        )

    def _plan(self, config: LiveConfig, source: Source | None) -> tuple[Source | None, LoopPlan]:
        """The source (read and prepared, cut to whole bars on a grid) and what the performance loops. Following a
        clock opens it here: its tempo sets the grid (a MIDI clock read through the MIDI input starts that input)."""
        session, hop, rate = self.session, self.session.models.vae.hop_samples, self.session.sample_rate
        if config.runner.endless and (source is not None or config.source is not None):
            raise ValueError("endless play is text-only: a source sets the song's length (it loops); leave one out")
        if source is None and config.source is not None:
            if config.sync is not None:
                raise ValueError("--sync with --source: a source sets its own loop; follow a clock with a text loop")
            audio, audio_rate = read_audio(config.source, MAX_SONG_SECONDS)  # a longer source loops its first 10 min
            if not on_the_grid(config):
                source = session.prepare_source(audio, audio_rate)
                return source, LoopPlan(source.frames * hop)
            audio, plan = source_plan(
                audio,
                audio_rate,
                rate,
                hop,
                config.bpm,
                config.time_signature or 4,
                config.bars,
                config.source_bpm,
                config.source_downbeat_s,
            )
            return session.prepare_source(audio, rate), plan
        if source is not None:
            return source, LoopPlan(source.frames * hop)
        if config.runner.endless and config.lm:
            raise ValueError("endless play has no song length for the 5 Hz LM to write a structure for; use a loop")
        grid = None
        if config.sync is not None:
            self.clock = open_clock(
                config.sync, config.time_signature or 4, config.bpm, config.midi_port, config.midi_backend
            )
            if self.clock.midi_follower is not None:
                self.enable_midi(
                    config.midi_port, config.midi_map, config.midi_learn, config.midi_backend, self.clock.midi_follower
                )
                self.midi.start()
            grid = clock_grid(self.clock, config.bpm, config.time_signature)
        elif config.bpm is not None:
            grid = Grid(float(config.bpm), config.time_signature or 4)
        elif config.bars is not None:
            raise ValueError("--bars needs a tempo: give --bpm, or follow a clock with --sync")
        return None, text_plan(
            grid, config.bars, config.song_seconds, rate, hop, config.runner.endless, config.runner.window_s
        )

    @property
    def grid(self) -> Grid | None:
        """The grid playing now (a followed clock's tempo changes replace it)."""
        return self.plan.grid

    @property
    def bars(self) -> int | None:
        return self.plan.bars

    @property
    def source_grid(self) -> SourceGrid | None:
        return self.plan.source_grid

    def _announce(self, path: str, value: float) -> None:
        if self.osc is not None:
            self.osc.announce(path, value)

    def _runner_at(self, region: LoopRegion, grid: Grid) -> LiveRunner:
        """A runner for a new tempo's loop: the prompts playing now, their metas at the new tempo."""
        captions = self.runner.captions()
        config = replace(self._runner_config, bpm=round(grid.bpm), time_signature=grid.beats_per_bar)
        negative = captions["negative"] or None
        lane = self._lane(self._request_frames(region, config))
        return LiveRunner(
            self.session, self.registry, region, captions["a"], captions["b"], None, config, negative, **lane
        )

    def _request_frames(self, region: LoopRegion, config: RunnerConfig) -> int:
        """T of a runner's requests on `region` (LiveRunner.request_frames, before it is made)."""
        frames = LoopMap(region.frames, self.session.models.vae.hop_samples).frames
        window = window_frames(config.window_s, None if config.endless else frames)
        return frames if window is None else window

    def _lane(self, request_frames: int | None = None) -> dict[str, Any]:
        """A new runner's place: on the ticker, a lane named after the session (a new tempo's loop: a lane beside);
        a loop whose requests are of another length than the ring's plays on a stream of its own (one ring, one
        length)."""
        ring = None if self.ticker is None else self.ticker.pipeline.frames
        if self.ticker is None or (request_frames is not None and ring not in (None, request_frames)):
            return {}
        self._lanes += 1
        name = self.config.session_name
        return {"ticker": self.ticker, "name": name if self._lanes == 1 else f"{name}~{self._lanes}"}

    def _switched(self, runner: LiveRunner, grid: Grid, bars: int | None = None) -> None:
        """The output plays `runner`'s loop at `grid` now (of `bars` bars where a plugin's parameter changed them)."""
        bars = self.plan.bars if bars is None else bars
        self.runner, self.plan = runner, replace(self.plan, grid=grid, samples=self.buffer.frames, bars=bars)

    def set_prompt(self, which: str, text: str) -> None:
        """Prompt A, B or the negative for the loop playing, and for a new tempo's loop being made."""
        self.runner.set_prompt(which, text)
        pending = None if self.following is None else self.following.pending
        tempo = getattr(self.playback, "tempo", None)
        if tempo is not None:
            pending = tempo.pending
        if pending is not None:
            pending.set_prompt(which, text)

    def _close_clock(self) -> None:
        if self.following is not None:
            self.following.stop()
        if self.midi is not None:
            self.midi.stop()
        if self.clock is not None:
            self.clock.close()
            self.clock = None

    def _discard(self) -> None:
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.stop()
        if isinstance(getattr(self, "playback", None), PluginOutput):  # its control block goes too
            self.playback.stop()
        self._close_clock()
        self.buffer.unlink()

    def _lm_structure(self, frames: int) -> torch.Tensor:
        """LM codes for prompt A over the loop (at least the LM's 10 s; cropped to the loop) -> context latents."""
        session, config = self.session, self.config
        if session.song_writer is None:
            session.attach_lm(config.lm_checkpoint, config.lm_preset)
        grid = {} if self.grid is None else {"bpm": round(self.grid.bpm), "time_signature": self.grid.beats_per_bar}
        song = session.generate_codes(
            config.prompt, lm_duration(frames / LATENT_RATE_HZ), seeds=(int(self.registry.get("seed")),), **grid
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
            on_prompt=self.set_prompt,
            on_transport=self.transport,
            on_target=self.target,
            status=self.status,
            sync=self.sync_status,
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
        clock: MidiClockFollower | None = None,
    ) -> None:
        """Add (or replace) the MIDI input, loading `map_path` if it exists and learning `learn` knobs in order (the
        mapper arms each knob once the previous control is released). `backend` None: the config's; `clock`: the
        port's MIDI clock feeds it (--sync midi)."""
        from .midi import MidiMapper
        from .midi_port import MidiInput

        if self.midi is not None:
            self.midi.stop()
        existing = map_path is not None and Path(map_path).is_file()
        self.mapper = MidiMapper.load(map_path, self.registry) if existing else MidiMapper(self.registry)
        self._midi_map = map_path
        if learn:
            self.mapper.learn(*learn)
        self.midi = MidiInput(self.mapper, port_name=port, backend=backend or self.config.midi_backend, clock=clock)
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

    def start(self, before_runner: Callable[[], None] | None = None) -> None:
        """Open MIDI first (a missing port or MIDI system fails before anything runs), then start playback (falling
        back to a silent real-time clock when no audio device can be opened and none was asked for by name), the
        runner and OSC. `before_runner()`: called once the output plays, before the first generation."""
        try:
            if self.midi is not None:
                self.midi.start()
            self._start_playback()
            if before_runner is not None:
                before_runner()
            self.runner.start()
            if self.following is not None:
                self.following.start()
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
            if self.config.audio_device is not None or self.config.playback_mode.startswith(("null", "plugin")):
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
            self.output_warning = silent_output_warning(error)

    def stop(self) -> None:
        """Stop everything in reverse order; the recording is written by the playback's stop."""
        for part in (self.midi, self.osc):
            if part is not None:
                part.stop()
        if self.midi is not None and self._midi_map is not None:
            self.mapper.save(self._midi_map)
        self._close_clock()
        self.runner.stop()
        self.playback.stop()
        self.buffer.unlink()

    @property
    def played_frames(self) -> int:
        """Frames played of the stream's own audio (its source, or generations): none of the silence before its
        first generation filled the loop."""
        since = self.runner.stats.audio_from_frames
        return 0 if since is None else self.buffer.played_frames - since

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
        status.update(self.sync_status())
        status["knobs"] = self.registry.values()
        return status

    def sync_status(self) -> dict[str, Any]:
        """The grid (tempo, metre, bars, the loop's bar.beat) and, following a clock, the clock and the lock."""
        if self.grid is None:
            return {}
        rate = self.buffer.sample_rate
        position = self.buffer.playhead_frames % (self.buffer.frames if self.bars else self.grid.bar_samples(rate))
        bar, beat, _ = self.grid.bar_beat(position, rate)
        status: dict[str, Any] = {
            "bpm": self.grid.bpm,
            "beats_per_bar": self.grid.beats_per_bar,
            "bars": self.bars,
            "bar_beat": f"{bar}.{beat}",
        }
        if self.following is not None:
            status["sync"] = self.following.status()
        return status

    def status_line(self) -> str:
        s = self.status()
        return (
            f"tick {s['tick_ms']:6.1f} ms  decode {s['decode_ms']:5.1f} ms  lead {s['lead_s']:.2f} s  "
            f"{'song' if s['endless'] else 'playhead'} {s['song_s' if s['endless'] else 'playhead_s']:6.2f} s  underruns {s['underruns']}  errors {s['errors']}  latents {s['latents']}  "
            f"osc rejected {sum(s.get('osc', {}).get('rejected', {}).values())}  last {s.get('last_osc') or '-'}"
            + ("  RECORDING STOPPED" if s["recording_error"] else "")
            + _grid_line(s)
        )


def _grid_line(status: dict[str, Any]) -> str:
    """The status line's bar.beat and clock."""
    if "bar_beat" not in status:
        return ""
    line = f"  bar {status['bar_beat']} @ {status['bpm']:.2f} BPM"
    sync = status.get("sync")
    if sync is not None:
        clock = "-" if sync["clock_bpm"] is None else f"{sync['clock_bpm']:.2f} BPM"
        state = "playing" if sync["clock_playing"] else "stopped"
        error = "-" if sync["phase_error_ms"] is None else f"{sync['phase_error_ms']:+.1f} ms"
        line += f"  {sync['source']} {clock} {state} {sync['clock_bar_beat'] or '-'} phase {error}"
    return line

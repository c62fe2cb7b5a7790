"""The band `bench sync` plays with, in a process of its own like a DAW: a clock (a JACK timebase master, a MIDI clock
sent over JACK MIDI frame-exactly, or an Ableton Link peer), and a JACK recorder of flowjam's output that stamps
every cycle with its JACK frame. It knows when its bar lines fall, in JACK frames; `bar_errors` finds flowjam's
metronome clicks in the recording and says how far each is from the band's bar line."""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
from dataclasses import dataclass

import numpy as np

from .clock import now_s

CLOCK_PULSE, CLOCK_START = b"\xf8", b"\xfa"


@dataclass(frozen=True)
class BandPlan:
    kind: str  # jack | midi | link
    bpm: float
    beats_per_bar: int
    seconds: float  # how long to record once the clock starts
    tempo_change: float | None = None  # a new tempo half-way through (None: none)


class Recorder:
    """A JACK client with one input, recording into a preallocated array; `frame_at_start` is the JACK frame of the
    recording's first sample. Each block is written where its JACK frame puts it, so a cycle the recorder missed (an
    xrun) stays silence in its place instead of moving everything after it one block early."""

    def __init__(self, client, seconds: float):
        self.client = client
        self.port = client.inports.register("in")
        self.audio = np.zeros(int(seconds * client.samplerate) + client.blocksize, np.float32)
        self.written = 0
        self.frame_at_start: int | None = None
        self.recording = False
        self.missed: list[tuple[int, int]] = []  # (recording frame, frames) of the cycles this recorder missed

    def process(self, frames: int) -> None:
        if not self.recording:
            return
        frame = self.client.last_frame_time
        if self.frame_at_start is None:
            self.frame_at_start = frame
        at = frame - self.frame_at_start
        if at + frames > self.audio.shape[0]:
            return
        if self.written and at > self.written:  # cycles went by without this callback: silence there, not flowjam's
            self.missed.append((self.written, at - self.written))
        self.audio[at : at + frames] = self.port.get_array()
        self.written = at + frames


class TimebaseMaster:
    """JACK transport's timebase master: bar/beat/tick from the transport frame at a tempo that may change at a bar
    line (the bars before it keep the old tempo)."""

    def __init__(self, client, bpm: float, beats_per_bar: int):
        import jack

        self._jack, self.client, self.beats_per_bar = jack, client, beats_per_bar
        self.bpm = bpm
        self._change: tuple[int, float, float] | None = None  # (transport frame, beats there, new bpm)
        client.set_timebase_callback(self._timebase)

    def beats_at(self, frame: int) -> float:
        rate = self.client.samplerate
        if self._change is not None and frame >= self._change[0]:
            start, beats, bpm = self._change
            return beats + (frame - start) / rate * bpm / 60.0
        return frame / rate * self.bpm / 60.0

    def change_tempo_at_next_bar(self, bpm: float) -> int:
        """A new tempo from the transport's next bar line; returns that line's transport frame."""
        frame = self.client.transport_frame
        beats = self.beats_at(frame)
        bar_beats = (int(beats // self.beats_per_bar) + 1) * self.beats_per_bar
        at = round(bar_beats / self.bpm * 60.0 * self.client.samplerate)
        self._change = (at, float(bar_beats), bpm)
        return at

    def _timebase(self, state, blocksize, pos, new_pos) -> None:
        beats = self.beats_at(pos.frame)
        bpm = self._change[2] if self._change is not None and pos.frame >= self._change[0] else self.bpm
        bar, beat = divmod(int(beats), self.beats_per_bar)
        pos.valid |= self._jack.POSITION_BBT
        pos.bar, pos.beat = bar + 1, beat + 1
        pos.tick = int((beats - int(beats)) * 1920)
        pos.bar_start_tick = bar * self.beats_per_bar * 1920.0
        pos.beats_per_bar, pos.beat_type, pos.ticks_per_beat, pos.beats_per_minute = (
            self.beats_per_bar,
            4.0,
            1920.0,
            bpm,
        )


class MidiClockSender:
    """24 pulses a beat on a JACK MIDI output, each at its exact frame (as a DAW's clock output), sent whether or not
    it plays; Start at `start_frame`, from which the beats count."""

    def __init__(self, client, bpm: float):
        self.client, self.port = client, client.midi_outports.register("clock_out")
        self.bpm = bpm
        self.start_frame: int | None = None  # JACK frame of the Start (the first pulse of the song)
        self._next_pulse: float | None = None  # JACK frame of the next pulse
        self._pulses = 0  # pulses sent since the Start
        self._change: tuple[float, int] | None = None  # (new bpm, beats per bar) from the next bar line
        self.changed_at = 0.0

    def pulse_frames(self) -> float:
        return self.client.samplerate * 60.0 / (self.bpm * 24)

    def process(self, frames: int) -> None:
        self.port.clear_buffer()
        first = self.client.last_frame_time
        if self._next_pulse is None:
            self._next_pulse = float(first)
        while round(self._next_pulse) < first + frames:
            offset = max(0, round(self._next_pulse) - first)
            if self.start_frame is not None and round(self._next_pulse) == self.start_frame:
                self.port.write_midi_event(offset, CLOCK_START)
                self._pulses = 0
            change = self._change
            if change is not None and self._pulses and self._pulses % (24 * change[1]) == 0:
                self.bpm, self.changed_at, self._change = change[0], self._next_pulse, None
            self.port.write_midi_event(offset, CLOCK_PULSE)
            self._pulses += 1
            self._next_pulse += self.pulse_frames()

    def change_tempo_at_next_bar(self, bpm: float, beats_per_bar: int) -> float:
        """A new tempo from the song's next bar line (pulses counted from Start); that line's JACK frame."""
        self._change = (bpm, beats_per_bar)
        wait_until(lambda: self._change is None, 10, "the tempo change's bar line")
        return self.changed_at

    def start_at_next_pulse(self, after_frames: int) -> int:
        """Start the song on a pulse at least `after_frames` ahead; its JACK frame."""
        wait_until(lambda: self._next_pulse is not None, 5, "the clock's first cycle")
        target = self.client.frame_time + after_frames
        pulse = self._next_pulse
        while pulse < target:
            pulse += self.pulse_frames()
        self.start_frame = round(pulse)
        return self.start_frame


class LinkPeer:
    """An Ableton Link session (the DAW) on an asyncio loop of its own."""

    def __init__(self, bpm: float, quantum: int):
        from aalink import Link

        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True).start()

        async def join():
            link = Link(bpm)
            link.quantum = quantum
            link.enabled = True
            return link

        self.link = asyncio.run_coroutine_threadsafe(join(), self._loop).result(timeout=10)

    def beat_and_time(self) -> tuple[float, float, float]:
        """(beat, the sync clock then, tempo)."""
        return float(self.link.beat), now_s(), float(self.link.tempo)

    def set_tempo(self, bpm: float) -> None:
        async def change():
            self.link.tempo = bpm

        asyncio.run_coroutine_threadsafe(change(), self._loop).result(timeout=10)


def bar_errors(
    audio: np.ndarray, first_frame: int, bar_frames: np.ndarray, click: np.ndarray, search: int
) -> np.ndarray:
    """For each bar line (JACK frames) inside the recording, the click's offset from it in frames: the peak of the
    recording's correlation with the click within `search` frames either side; NaN where no click stands out."""
    errors = np.full(bar_frames.shape[0], np.nan)
    for index, frame in enumerate(bar_frames):
        at = int(round(frame)) - first_frame
        low, high = at - search, at + search + click.shape[0]
        if low < 0 or high > audio.shape[0]:
            continue
        window = audio[low:high]
        score = np.correlate(window, click, "valid")
        peak = int(np.argmax(score))
        if score[peak] < 0.5 * float(click @ click):  # no click here (the loop had not started)
            continue
        errors[index] = low + peak - at
    return errors


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the band waited {timeout_s:g} s for {what}")
        time.sleep(0.01)


def _cycle_pair(client) -> tuple[int, float, int]:
    """(JACK frame, sync-clock time, transport frame) of the current cycle's start, read as one."""
    while True:
        before = client.last_frame_time
        _, position = client.transport_query_struct()
        if client.last_frame_time == before:
            return before, position.usecs / 1e6, position.frame


def _flowjam_output(client) -> str:
    """The first audio output on the server that is neither the system's nor the band's: flowjam's. Looked up by the
    band's own client (a client opened only to look would join and leave the graph while flowjam plays)."""
    ports = sorted(
        port.name
        for port in client.get_ports(is_audio=True, is_output=True)
        if not port.name.startswith(("system:", f"{client.name}:"))
    )
    if not ports:
        raise RuntimeError("flowjam's output is not on the JACK server")
    return ports[0]


def play_band(plan: BandPlan, conn) -> None:
    """The band's process: clock + recorder; on "go" it connects flowjam's output to its recorder, starts its clock
    and records."""
    import jack

    client = jack.Client("flowjam-band", no_start_server=True)
    rate = client.samplerate
    recorder = Recorder(client, plan.seconds + 5)
    master = sender = peer = None
    if plan.kind == "jack":
        master = TimebaseMaster(client, plan.bpm, plan.beats_per_bar)
    elif plan.kind == "midi":
        sender = MidiClockSender(client, plan.bpm)
    else:
        peer = LinkPeer(plan.bpm, plan.beats_per_bar)

    def process(frames: int) -> None:
        if sender is not None:
            sender.process(frames)
        recorder.process(frames)

    client.set_process_callback(process)
    client.activate()
    if master is not None:
        client.transport_stop()
        client.transport_frame = 0
    conn.send(("ready", None if sender is None else sender.port.name))
    conn.recv()
    client.connect(_flowjam_output(client), recorder.port)
    recorder.recording = True
    wait_until(lambda: recorder.frame_at_start is not None, 5, "the recording to start")
    bar_s = plan.beats_per_bar * 60.0 / plan.bpm
    if master is not None:
        client.transport_start()
        wait_until(lambda: client.transport_state == jack.ROLLING, 5, "the transport to roll")
        frame, _, transport_frame = _cycle_pair(client)
        start = frame - transport_frame  # the JACK frame of transport frame 0
        first_bar = 0.0
    elif sender is not None:
        start, first_bar = sender.start_at_next_pulse(rate // 2), 0.0
    else:
        beat, at, tempo = peer.beat_and_time()
        frame, cycle_s, _ = _cycle_pair(client)
        start = frame + (at - cycle_s) * rate - beat * 60.0 / tempo * rate  # the JACK frame of Link's beat 0
        first_bar = float(np.ceil(beat / plan.beats_per_bar))
    bars = np.arange(first_bar, first_bar + plan.seconds / bar_s + 2)
    bar_frames = start + bars * bar_s * rate
    changed_at = changed_s = None
    if plan.tempo_change is None:
        time.sleep(plan.seconds)
    else:  # half-way, a new tempo from a bar line on: the bar lines after it are that tempo's
        time.sleep(plan.seconds / 2)
        if master is not None:
            changed_at = start + master.change_tempo_at_next_bar(plan.tempo_change)
        elif sender is not None:
            changed_at = sender.change_tempo_at_next_bar(plan.tempo_change, plan.beats_per_bar)
        else:
            beat, at, tempo = peer.beat_and_time()
            frame, cycle_s, _ = _cycle_pair(client)
            bar_line = (
                frame
                + (at - cycle_s + (np.ceil(beat / plan.beats_per_bar) * plan.beats_per_bar - beat) * 60 / tempo) * rate
            )
            while _cycle_pair(client)[0] < bar_line - client.blocksize:
                time.sleep(0.001)
            peer.set_tempo(plan.tempo_change)  # Link keeps the beat where it is at this moment: the bar line nearest it
            beat, at, tempo = peer.beat_and_time()
            frame, cycle_s, _ = _cycle_pair(client)
            changed_at = (
                frame
                + (at - cycle_s + (np.round(beat / plan.beats_per_bar) * plan.beats_per_bar - beat) * 60 / tempo) * rate
            )
        frame, cycle_s, _ = _cycle_pair(client)
        changed_s = cycle_s + (changed_at - frame) / rate
        new_bar = plan.beats_per_bar * 60.0 / plan.tempo_change * rate
        before = bar_frames[bar_frames < changed_at - 1]
        after = changed_at + np.arange(0, plan.seconds / 2 / (new_bar / rate) + 2) * new_bar
        bar_frames = np.concatenate([before, after])
        time.sleep(max(0.0, plan.seconds / 2 - 0.5))
    recorder.recording = False
    recorded_until_s = now_s()
    with tempfile.NamedTemporaryFile(suffix=".npy", delete=False) as file:
        np.save(file, recorder.audio[: recorder.written])
    conn.send(
        (
            "done",
            file.name,
            recorder.frame_at_start,
            bar_frames.tolist(),
            changed_at,
            changed_s,
            recorded_until_s,
            recorder.missed,
        )
    )
    conn.recv()
    client.deactivate()
    client.close()

"""`flowjam bench sync`: flowjam follows a band's clock on a JACK dummy server, its metronome clicking on every bar
start, while the band (a process of its own, as a DAW is) records flowjam's output frame by frame. Each click's
distance from the band's bar line is the phase error; the follower's tempo against the band's is the tempo error."""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .app import LiveApp, LiveConfig
from .renderer import click_wave
from .sync.band import BandPlan, bar_errors, play_band, wait_until
from .sync.clock import now_s

RATE = 48_000
PROMPT = "steady drum machine groove, techno"


@dataclass(frozen=True)
class MissedBar:
    """A bar line with no click within the measured window, and what was near it: what tells a dropped click from a
    shifted one, and whether the output came late then."""

    index: int  # of the bar lines the band played
    at_s: float  # from the start of the recording
    click_offset_ms: float | None  # the click found searching MISSED_SEARCH_S either side instead; None: none there
    late_block_s: float | None  # the nearest late block's time from the bar line (negative: before it); None: none
    nearby: tuple[str, ...] = ()  # what the lock, the clock and the recorder did within a bar of it (s from it)


MISSED_SEARCH_S = 0.5  # how far either side of a missed bar line its click is looked for
FAR_MS = 5.0  # a click further than this from its bar line is shown with what happened near it


@dataclass(frozen=True)
class FarBar:
    """A bar whose click was heard more than FAR_MS off its line, and what was near it."""

    index: int
    at_s: float  # from the start of the recording
    error_ms: float
    late_block_s: float | None  # the nearest late block's time from the bar line; None: none
    nearby: tuple[str, ...]  # what the lock, the clock and the band's recorder did within a bar of it


@dataclass
class SyncReport:
    kind: str
    bpm: float
    bars_heard: int  # bar lines with flowjam's click found
    bars_missed: int  # bar lines after flowjam started with no click found
    errors_ms: list[float] = field(default_factory=list)
    clock_bpm: float | None = None  # the follower's tempo at the end
    underruns: int = 0
    gaps: int = 0
    late_blocks: int = 0
    corrections: int = 0
    runner_errors: int = 0
    latency_ms: float = 0.0  # the output's latency (Link aims the heard beat: its bar lines are this much earlier)
    tempo_change: float | None = None
    change_bars_late: int | None = None  # the bar line after the tempo change the new tempo's loop began on
    tempo_settled_s: float | None = None  # from the change until the followed tempo stays within 0.05 BPM of it
    switches: int = 0
    missed: list[MissedBar] = field(default_factory=list)
    far: list[FarBar] = field(default_factory=list)
    late_at_s: list[float] = field(default_factory=list)  # when the output's late-block count rose (50 ms polls)
    unrecorded_cycles: int = 0  # cycles the band's recorder missed (silence there is the bench's, not flowjam's)

    @property
    def median_ms(self) -> float:
        return statistics.median(abs(e) for e in self.errors_ms) if self.errors_ms else float("nan")

    @property
    def max_ms(self) -> float:
        return max((abs(e) for e in self.errors_ms), default=float("nan"))


JACK_TOOLS = ("jackd", "jack_wait")  # the server the bench starts, and what tells when it runs


def check_jack_tools() -> None:
    """bench sync starts a JACK server of its own: a FileNotFoundError naming what is missing and how to install it
    (a command checks this before its model loads)."""
    missing = [tool for tool in JACK_TOOLS if shutil.which(tool) is None]
    if missing:
        raise FileNotFoundError(
            f"bench sync runs a JACK server of its own: {' and '.join(missing)} not found on PATH; install JACK "
            "(Debian: apt install jackd2)"
        )
    if importlib.util.find_spec("jack") is None:
        raise FileNotFoundError("bench sync talks to JACK through JACK-Client: pip install JACK-Client")


class PrivateJackServer:
    """`jackd -d dummy` under a name of its own (JACK_DEFAULT_SERVER is set for this process and its children)."""

    def __init__(self, period: int, rate: int = RATE):
        check_jack_tools()
        self.name = f"flowjam-bench-{os.getpid()}"
        os.environ["JACK_DEFAULT_SERVER"] = self.name
        os.environ["JACK_NO_AUDIO_RESERVATION"] = "1"
        command = ["jackd", "-R", "-n", self.name, "-d", "dummy", "-r", str(rate), "-p", str(period)]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while subprocess.run(["jack_wait", "-c"], capture_output=True, text=True).stdout.strip() != "running":
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.close()
                raise RuntimeError("jackd did not start within 10 s")
            time.sleep(0.1)
        time.sleep(0.5)  # it answers jack_wait a moment before it accepts clients

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()


def bench_sync(
    session,
    kind: str,
    bpm: float,
    beats_per_bar: int,
    bars: int,
    seconds: float,
    period: int,
    report: Callable,
    tempo_change: float | None = None,
) -> SyncReport:
    """flowjam following `kind` for `seconds` of the band's clock, its clicks measured against the band's bar lines."""

    server = PrivateJackServer(period)
    context = multiprocessing.get_context("spawn")
    conn, band_conn = context.Pipe()
    band = context.Process(
        target=play_band, args=(BandPlan(kind, bpm, beats_per_bar, seconds, tempo_change), band_conn)
    )
    band.start()
    app = None
    try:
        if not conn.poll(30):
            raise RuntimeError("the band did not start")
        _, clock_port = conn.recv()
        config = LiveConfig(
            prompt=PROMPT,
            audio_device="jack",
            blocksize=period,
            osc_port=None,
            sync=kind,
            bars=bars,
            time_signature=beats_per_bar,
            click=True,
            midi_port=clock_port,
            midi_backend="jack" if kind == "midi" else None,
        )
        app = LiveApp(session, config)
        app.registry.set("volume", 0.1, origin="bench")  # the clicks stand out of the loop
        app.start()
        wait_until(lambda: app.runner.stats.writes > 0, 120, "flowjam's first write")
        conn.send(("go",))
        started = last_report = time.monotonic()
        tempi: list[tuple[float, float]] = []  # (sync clock, the followed tempo), every 50 ms
        late_at: list[float] = []  # sync clock times the late-block count rose at
        late_seen = app.buffer.late_blocks
        events: list[tuple[float, str]] = []  # (sync clock, what the lock or the clock follower did)
        watched = _watched(app)
        while not conn.poll(0.05):
            now_watched = _watched(app)
            events += [
                (now_s(), f"{name} {now_watched[name]}") for name in watched if now_watched[name] != watched[name]
            ]
            watched = now_watched
            state = app.following.lock.state
            if state is not None and state.bpm is not None:
                tempi.append((now_s(), state.bpm))
            late_now = app.buffer.late_blocks
            late_at += [now_s()] * (late_now - late_seen)
            late_seen = late_now
            if time.monotonic() - last_report >= 30.0:
                last_report = time.monotonic()
                report(f"{last_report - started:5.0f} s  {app.status_line()}")
        _, path, first_frame, bar_frames, changed_at, changed_s, recorded_until_s, unrecorded = conn.recv()
        status, latency_s = app.status(), app.buffer.latency_s
        gaps, late_blocks = app.buffer.gaps, app.buffer.late_blocks
        switched_s = None if app.following is None else app.following.tempo_switch.switched_at_s
        conn.send(("bye",))
    finally:
        if app is not None:
            app.stop()
        band.join(10)
        if band.is_alive():
            band.kill()
        server.close()
    audio = np.load(path)
    os.unlink(path)
    bar_frames = np.asarray(bar_frames)
    if kind == "link":  # Link's beat is the one heard: a bar line's audio is in the graph the output's latency before
        bar_frames -= latency_s * RATE
    errors = bar_errors(audio, first_frame, bar_frames, click_wave(RATE)[:, 0], int(0.05 * RATE))
    heard = np.flatnonzero(~np.isnan(errors))
    recording_s = recorded_until_s - audio.shape[0] / RATE  # the sync clock at the recording's first frame
    late_s = [at - recording_s for at in late_at]
    events += [(recording_s + at / RATE, f"the band's recorder missed {frames} frames") for at, frames in unrecorded]
    events = [(at - recording_s, what) for at, what in events]
    missed_bars = [] if heard.size == 0 else _missed_bars(audio, first_frame, bar_frames, heard, late_s, events)
    far = _far_bars(errors, first_frame, bar_frames, heard, late_s, events)
    tempi = [(at, bpm) for at, bpm in tempi if at <= recorded_until_s]  # the band plays on unwatched after it
    late, steady, settled = None, heard, None
    if changed_s is not None and tempo_change is not None:  # from when on the followed tempo stays within 0.05 BPM
        after = [(at, abs(bpm - tempo_change) <= 0.05) for at, bpm in tempi if at >= changed_s]
        if after and after[-1][1]:
            settled = max((at for at, near in after if not near), default=changed_s) - changed_s
    if changed_at is not None and tempo_change is not None:
        new_bar_s = beats_per_bar * 60.0 / tempo_change
        if switched_s is not None and switched_s > changed_s - 0.5 * new_bar_s:
            late = round((switched_s - changed_s) / new_bar_s)  # the bar line after the change the new loop began on
            change_index = int(np.searchsorted(bar_frames, changed_at - 1))
            steady = heard[(heard < change_index) | (heard >= change_index + late)]
    sync = status.get("sync", {})
    return SyncReport(
        kind=kind,
        bpm=bpm,
        bars_heard=int(heard.size),
        bars_missed=len(missed_bars),
        errors_ms=(errors[steady] / RATE * 1000.0).tolist(),
        tempo_change=tempo_change,
        change_bars_late=late,
        tempo_settled_s=settled,
        switches=int(status.get("sync", {}).get("switches", 0)),
        clock_bpm=tempi[-1][1] if tempi else None,
        underruns=int(status.get("underruns") or 0),
        gaps=gaps,
        late_blocks=late_blocks,
        corrections=int(sync.get("corrections", 0)),
        runner_errors=int(status.get("errors", 0)),
        latency_ms=latency_s * 1000.0,
        missed=missed_bars,
        far=far,
        late_at_s=late_s,
        unrecorded_cycles=len(unrecorded),
    )


def _watched(app: LiveApp) -> dict[str, object]:
    """What a missed click is looked up against: the lock's starts and corrections, the loop's shift and transport,
    the clock follower's own counts."""
    lock = app.following.lock
    return {
        "starts": lock.starts,
        "corrections": lock.corrections,
        "shift": app.buffer.shift,
        "playing": app.buffer.playing,
        **app.following.clock.counts(),
    }


def _missed_bars(
    audio: np.ndarray,
    first_frame: int,
    bar_frames: np.ndarray,
    heard: np.ndarray,
    late_s: list[float],
    events: list[tuple[float, str]],
) -> list[MissedBar]:
    """Each bar line between the first and the last heard one with no click near it, with a wider search for its
    click, the nearest late block and the `events` within a bar of it (times from the recording's start)."""
    found = set(heard.tolist())
    indices = [i for i in range(int(heard[0]), int(heard[-1]) + 1) if i not in found]
    if not indices:
        return []
    wide = bar_errors(audio, first_frame, bar_frames[indices], click_wave(RATE)[:, 0], int(MISSED_SEARCH_S * RATE))
    missed = []
    for index, offset in zip(indices, wide):
        at_s, nearest, nearby = _near(bar_frames, index, first_frame, late_s, events)
        click = None if np.isnan(offset) else float(offset) / RATE * 1000.0
        missed.append(MissedBar(index, at_s, click, nearest, nearby))
    return missed


def _far_bars(
    errors: np.ndarray,
    first_frame: int,
    bar_frames: np.ndarray,
    heard: np.ndarray,
    late_s: list[float],
    events: list[tuple[float, str]],
) -> list[FarBar]:
    """Each heard bar whose click (`errors`, frames from its line) is more than FAR_MS off, with the nearest late
    block and the `events` within a bar of it (times from the recording's start)."""
    far = []
    for index in heard.tolist():
        error_ms = float(errors[index]) / RATE * 1000.0
        if abs(error_ms) > FAR_MS:
            at_s, nearest, nearby = _near(bar_frames, index, first_frame, late_s, events)
            far.append(FarBar(index, at_s, error_ms, nearest, nearby))
    return far


def _near(
    bar_frames: np.ndarray, index: int, first_frame: int, late_s: list[float], events: list[tuple[float, str]]
) -> tuple[float, float | None, tuple[str, ...]]:
    """Bar `index`'s time from the recording's start, the nearest late block's time from it, and the `events` within
    a bar of it (their times from it)."""
    at_s = (bar_frames[index] - first_frame) / RATE
    nearest = min((t - at_s for t in late_s), key=abs, default=None)
    bar_s = float(bar_frames[index] - bar_frames[index - 1] if index else bar_frames[1] - bar_frames[0]) / RATE
    return at_s, nearest, tuple(f"{at - at_s:+.3f} s {what}" for at, what in events if abs(at - at_s) <= bar_s)

"""Following a MIDI clock: 24 pulses per quarter note, Start / Stop / Continue and Song Position Pointer in; tempo,
transport and beat position out. Pure: `MidiClockFollower.handle` takes a message and the time it arrived (in
seconds, any monotonic clock); the I/O edge (`MidiInput` with a follower) feeds it from a port.

Tempo: a straight line fitted (least squares) through the arrival times of the pulses since the tempo last changed,
at most the last `window_s` seconds of them: the pulses' jitter averages out over the line (a JACK client sees its
MIDI once per process cycle, 21 ms at 1024 frames, more than a pulse at 120 BPM), so the tempo settles to a small
fraction of a BPM. A tempo change is told from jitter by the mean offset of the last `RECENT_PULSES` pulses from the
line: a mean of jitter never goes beyond the largest offset of the pulses before them, a new tempo's drift does; then
the line restarts with those pulses (the new tempo is measured from there, not averaged with the old one). Pulses that
sit a whole number of periods off the line at its tempo were miscounted (a loss unseen, a late pulse taken for a
loss: an xrun's doing on a loaded machine), and are counted again from the line, so the beat is never a pulse off
for good; pulses lost in a line's first beat, before its tempo and jitter are known, are counted once two more beats
have fitted it (`_recount_first`); and whatever a storm of missed cycles left, a steady line sitting whole pulses off
the last steady line of its tempo is counted again by that step (`_reanchor`).
Position: beats since the song's start, from the line (smoothed, not the last pulse's arrival); Start sets it to 0,
Song Position Pointer (in sixteenths) sets it while stopped, Continue plays on from it.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque

from .clock import ClockState

PULSES_PER_BEAT = 24
CLOCK, START, CONTINUE, STOP, SONG_POSITION = "clock", "start", "continue", "stop", "songpos"  # mido's type names
CLOCK_MESSAGES = frozenset({CLOCK, START, CONTINUE, STOP, SONG_POSITION})
RECENT_PULSES = 24  # the pulses (a beat) whose mean offset from the line tells a tempo change
MIN_PULSES = 6  # pulses before a tempo is reported (a quarter of a beat)
GAP_PULSES = 6  # a silence of this many pulse periods is a paused clock, not a slower tempo
LOST_PULSE_REACH = 0.25  # pulses this steady (jitter within a quarter period) can tell a lost pulse from a late one
LOST_PULSE_SLACK = 0.25  # a gap this close to whole periods, then a pulse one period on: pulses were lost
MISCOUNT_PULSES = 3  # pulses off the line that tell a new tempo, or (a whole number of periods off) a miscount
BUNCHED = 0.25  # a pulse this many periods after the one before, from a steady clock, was sent late (bunched)
FIRST_CHECK_PULSES = 3 * RECENT_PULSES  # a line's first beat checked for lost pulses once two more beats are fitted
MAX_TEMPO_RATIO = 4.0  # pulses off the line at a pace beyond this ratio to the old are bunched, not a new tempo
ANCHOR_REACH_GROWTH, ANCHOR_REACH_SLACK = 1.5, 0.02  # a line no steadier than this to the anchor's reach keeps it
ONE_TEMPO = 5e-4  # two lines whose periods differ by less than this fraction are of one tempo (0.06 BPM at 120)


class MidiClockFollower:
    def __init__(self, window_s: float = 4.0, min_drift: float = 0.05):
        """`window_s`: the longest stretch of pulses one tempo is fitted over; `min_drift`: the smallest mean offset
        from the line (in pulse periods) that means a new tempo, however steady the clock."""
        self.window_s = window_s
        self.min_drift = min_drift
        self.playing = False
        self._index = 0  # pulses received, ever (the tempo line's count; the transport never resets it)
        self._pulses: deque[tuple[float, int]] = deque()  # (arrival, index) since the tempo last changed
        self._origin = 1  # the pulse index at which the song position is `_base`
        self._base = 0  # song position in pulses at `_origin`
        self._lock = threading.Lock()  # messages come on the MIDI thread, readings on others
        self._held: tuple[float, float] | None = None  # the old tempo's line, standing in at a change
        self._reach: float | None = None  # the pulses' largest offset from their line, in periods (their jitter)
        self._suspect: tuple[int, float] | None = None  # (pulses perhaps lost before the newest, the period then)
        self._lost_s = 0.0  # seconds of messages the port says it lost since the last pulse
        self._first: list[tuple[float, int]] | None = []  # the line's first beat of pulses; None once checked
        self._line_pulses = 0  # pulses fitted since the line (re)started
        self._anchor: tuple[float, float, float] | None = None  # the newest steady line and its reach: what a
        # miscount is told against
        self.pauses = 0  # silences of GAP_PULSES periods or more: the tempo line began afresh (no tempo until fitted)
        self.recounts = 0  # pulses counted again: lost on the way, or miscounted

    def lost(self, seconds: float) -> None:
        """The port lost `seconds` of messages since the last one (a JACK client that missed a process cycle never
        sees that cycle's MIDI): the next pulse counts the pulses its gap held, however jittery the clock."""
        with self._lock:
            self._lost_s += seconds

    def handle(self, kind: str, at_s: float, position_16ths: int | None = None) -> None:
        """One MIDI real-time message (`CLOCK`, `START`, `CONTINUE`, `STOP`) or a `SONG_POSITION` (with its
        `position_16ths`), arrived at `at_s`. After Start the next pulse is the song's first (position 0); after
        Continue the next pulse is at the last Song Position Pointer's place."""
        with self._lock:
            self._handle(kind, at_s, position_16ths)

    def _handle(self, kind: str, at_s: float, position_16ths: int | None) -> None:
        if kind == CLOCK:
            self._pulse(at_s)
        elif kind in (START, CONTINUE):
            self._base = 0 if kind == START else self._base
            self._origin, self.playing = self._index + 1, True
        elif kind == STOP:
            if self.playing:
                self._base += self._index - self._origin + 1  # where it stopped: the pulses it played
            self.playing = False
        elif kind == SONG_POSITION:
            if position_16ths is None or not 0 <= position_16ths <= 16383:
                raise ValueError(f"a song position needs its sixteenths (0..16383), got {position_16ths!r}")
            if not self.playing:  # a DAW sends it before Continue; while playing it would jump the beat
                self._base = position_16ths * PULSES_PER_BEAT // 4
        else:
            raise ValueError(f"unknown MIDI clock message {kind!r}: one of clock, start, continue, stop, songpos")

    @property
    def bpm(self) -> float | None:
        with self._lock:
            line = self._line()
        return None if line is None else 60.0 / (line[0] * PULSES_PER_BEAT)

    def state(self, at_s: float | None = None) -> ClockState:
        """Tempo, transport and beat position at `at_s` (on the fitted line between pulses, so a pulse's jitter
        does not move it)."""
        with self._lock:
            return self._state(at_s)

    def _state(self, at_s: float | None) -> ClockState:
        line = self._line()
        bpm = None if line is None else 60.0 / (line[0] * PULSES_PER_BEAT)
        if not self.playing:
            return ClockState(bpm, False, self._base / PULSES_PER_BEAT)
        index = self._index if line is None or at_s is None else (at_s - line[1]) / line[0]
        return ClockState(bpm, True, (self._base + index - self._origin) / PULSES_PER_BEAT)

    def _pulse(self, at_s: float) -> None:
        """A clock pulse feeds the tempo whether or not the transport plays (a DAW sends its clock while stopped)."""
        line = self._line()
        lost_s, self._lost_s = self._lost_s, 0.0
        periods = None
        if line is not None and self._pulses:
            gap_s = at_s - self._pulses[-1][0]
            if lost_s > 0.0:  # pulses went by unheard (as many as the lost stretch can hold): the song went on
                unheard = max(0, min(round(gap_s / line[0]) - 1, math.floor(lost_s / line[0]) + 1))
                self._index += unheard
                if unheard:
                    self.recounts += 1
                gap_s -= unheard * line[0]
            periods = gap_s / line[0]
            if periods > GAP_PULSES:
                self.pauses += 1
                self._pulses.clear()  # the clock paused (many DAWs stop it with the transport): a new line from here
                self._held, self._suspect, self._anchor, periods = None, None, None, None
                self._restart_line()
            else:
                self._resolve_lost(gap_s)
        self._index += 1
        steady = self._reach is not None and self._reach < LOST_PULSE_REACH
        if periods is not None and steady and periods < BUNCHED:  # caught up after a stall: counted, not fitted
            return
        self._pulses.append((at_s, self._index))
        self._line_pulses += 1
        if self._first is not None and len(self._first) < RECENT_PULSES:
            self._first.append((at_s, self._index))
        elif self._first is not None and self._line_pulses >= FIRST_CHECK_PULSES:
            self._recount_first()
        if periods is not None and self._reach is not None and self._reach < LOST_PULSE_REACH:
            whole = round(periods)
            if whole >= 2 and abs(periods - whole) < LOST_PULSE_SLACK:  # pulses lost on the way, or a slower tempo:
                self._suspect = (whole - 1, line[0])  # the next pulse tells
        while at_s - self._pulses[0][0] > self.window_s:
            self._pulses.popleft()
        kept = self._new_tempo()
        if kept is not None:
            self._pulses = deque(kept)  # a new tempo, measured from its own pulses
            self._first, self._line_pulses = list(kept[:RECENT_PULSES]), len(kept)
        else:
            self._reanchor()

    def _reanchor(self) -> None:
        """A storm of missed cycles on both sides (pulses lost in the port's, pulses sent late and bunched after the
        sender's) can leave the count whole pulses off whatever each pulse was taken for, and the pulses after it on
        a line of their own: a pulse off for good. The song's tempo line tells it: once the pulses are steady again
        over FIRST_CHECK_PULSES, their line is held against the last steady line before; of one tempo, a step of whole
        pulses between the two is a miscount, and the pulses are counted again by it. Otherwise (a new tempo, or no
        steady line yet) this line becomes the one later lines are held against, unless its pulses sit further off it
        than the anchor's did (a storm's late pulses still in the window)."""
        reach = self._reach
        if self._line_pulses < FIRST_CHECK_PULSES or reach is None or reach >= LOST_PULSE_REACH:
            return
        line = _fit(self._pulses)
        anchor = self._anchor
        if line is None:
            return
        if anchor is not None and abs(line[0] / anchor[0] - 1.0) < ONE_TEMPO:
            at = self._pulses[-1][0]
            step = (at - line[1]) / line[0] - (at - anchor[1]) / anchor[0]
            whole = round(step)
            if whole and abs(step - whole) < LOST_PULSE_SLACK:
                self._recount_from(self._pulses[0][1], -whole)
                return
            if reach > ANCHOR_REACH_GROWTH * anchor[2] + ANCHOR_REACH_SLACK:
                return
        self._anchor = (*line, reach)

    def _restart_line(self) -> None:
        self._first, self._line_pulses = [], 0

    def _recount_first(self) -> None:
        """Pulses lost (or one too many counted) among a line's first beat, before its tempo and its jitter were
        known: the lost pulse's gap went by as jitter and every pulse after it was counted short, a pulse off for
        good. Once the pulses after that beat know the line and its reach (FIRST_CHECK_PULSES), the first beat's
        pulses that sit a whole number of periods off it tell where and how many: the pulses after each such step
        are counted again. Left as they are where the clock's jitter is too wide to tell whole periods apart."""
        first, self._first = self._first or [], None
        later = [(t, i) for t, i in self._pulses if i > first[-1][1]]
        line = _fit(later, least=2 * RECENT_PULSES)
        if line is None:
            return
        period, offset = line
        reach = max(abs(t - (offset + i * period)) for t, i in later) / period
        if reach >= LOST_PULSE_REACH:
            return
        offsets = [(t - (offset + i * period)) / period for t, i in first]
        steps = [round(o) for o in offsets]
        if any(abs(o - w) >= LOST_PULSE_SLACK for o, w in zip(offsets, steps)):
            return  # not whole periods: the line's first beat had another tempo
        boundaries = zip([*first[1:], later[0]], steps, [*steps[1:], 0])
        for (_, index), before, after in reversed(list(boundaries)):  # the newest first: older counts stay valid
            if after != before:
                self._recount_from(index, after - before)

    def _resolve_lost(self, gap_s: float) -> None:
        """After a gap of whole periods, a pulse one of those periods on means the pulses in the gap were lost on
        the way (a JACK xrun drops a cycle's MIDI): the song went on without them, so the pulse before counts them.
        Another long gap is a slower tempo."""
        if self._suspect is not None and abs(gap_s / self._suspect[1] - 1.0) < LOST_PULSE_SLACK:
            at, index = self._pulses.pop()
            self._pulses.append((at, index + self._suspect[0]))
            self._index += self._suspect[0]
            self.recounts += 1
        self._suspect = None

    def _new_tempo(self) -> list[tuple[float, int]] | None:
        """The pulses of a new tempo, or None while the tempo holds. A new tempo: the last `RECENT_PULSES` pulses'
        mean offset from the line through the pulses before them is beyond every offset of those (the jitter's
        reach: a mean of jitter never exceeds its largest value, a new tempo's drift grows past it). Its pulses are
        the trailing run of recent ones off the old line (beyond the reach), or all recent ones if the newest is on
        it; until they are `MIN_PULSES`, the old line stands in."""
        pulses = list(self._pulses)
        older, recent = pulses[:-RECENT_PULSES], pulses[-RECENT_PULSES:]
        line = _fit(older)
        if line is None or len(older) < 2 * RECENT_PULSES:  # a jitter's pattern (a JACK cycle beating against
            return None  # the pulses) repeats within two beats: its reach is seen before it is compared
        period, offset = line
        offsets = [t - (offset + i * period) for t, i in recent]
        reach = max(abs(t - (offset + i * period)) for t, i in older)
        self._reach = reach / period
        near = max(reach, self.min_drift * period)  # a pulse this close to the line is on it
        if abs(sum(offsets)) / RECENT_PULSES <= near:
            return None
        off_line = 0  # the trailing run of pulses off the old line: the new tempo's
        while off_line < RECENT_PULSES and abs(offsets[-1 - off_line]) > near:
            off_line += 1
        if off_line < MISCOUNT_PULSES:  # late pulses back on the line, or a change's first pulses: the next tell
            return None
        run = recent[-off_line:]
        run_line = _fit(run, least=MISCOUNT_PULSES)
        if run_line is None or not 1 / MAX_TEMPO_RATIO < run_line[0] / period < MAX_TEMPO_RATIO:
            return None  # pulses bunched (a sender that caught up after a stall): late ones, not a tempo
        miscount = self._miscount(offsets, off_line, period)
        if miscount is not None:
            self._recount(off_line, miscount)
            return None
        self._held = line
        return run

    def _miscount(self, offsets: list[float], off_line: int, period: float) -> int | None:
        """Pulses miscounted by a whole number, or None: a new tempo. `offsets`: the recent pulses' from the line,
        the last `off_line` of them (at least MISCOUNT_PULSES) off it. A miscount (a loss unseen, or a late pulse
        taken for a loss: an xrun's doing) is a step of whole periods from where the pulses before sat, the same for
        every pulse after it but a first late one; a new tempo's pulses drift off the line pulse by pulse. Told by
        medians, so a clock's jitter and a few late pulses do not hide it."""
        before, after = offsets[:-off_line][-2 * MISCOUNT_PULSES :], offsets[-off_line:][1:]
        if len(before) < MISCOUNT_PULSES:
            return None
        base = statistics.median(before)
        whole = round((statistics.median(after) - base) / period)
        if whole and all(abs((o - base) / period - whole) < LOST_PULSE_SLACK for o in after):
            return whole
        return None

    def _recount(self, pulses: int, by: int) -> None:
        """The newest `pulses` pulses (and the count) moved `by` whole pulses: the song position is the clock's."""
        self._recount_from(self._pulses[-pulses][1], by)

    def _recount_from(self, index: int, by: int) -> None:
        """The pulses from count `index` on (and the count) moved `by` whole pulses: the song position is the
        clock's. A Start heard among them moves with them (the song began at its pulse, whatever it is counted)."""
        self._pulses = deque((at, i + by if i >= index else i) for at, i in self._pulses)
        self._index += by
        self.recounts += 1
        if self._origin >= index:
            self._origin += by

    def _line(self) -> tuple[float, float] | None:
        """The tempo line through the pulses, or the old tempo's while a new one has too few pulses for its own."""
        return _fit(self._pulses) or self._held


def _fit(pulses, least: int = MIN_PULSES) -> tuple[float, float] | None:
    """(seconds per pulse, arrival time of pulse index 0) fitted through (arrival, index) pulses; None with fewer
    than `least`."""
    if len(pulses) < least:
        return None
    n = len(pulses)
    mean_i = sum(i for _, i in pulses) / n
    mean_t = sum(t for t, _ in pulses) / n
    spread = sum((i - mean_i) ** 2 for _, i in pulses)
    period = sum((i - mean_i) * (t - mean_t) for t, i in pulses) / spread
    if period <= 0:
        return None
    return period, mean_t - period * mean_i

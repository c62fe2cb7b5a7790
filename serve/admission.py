"""Who may join a host's ring, by what it measures: a new session is let in only while every session playing gets
its fresh latents within the target interval, measured since the ring last changed (a session let in or ended).
Creates take turns (`turn`); a ring that a measurement puts near its target (HEADROOM) is measured again after the last
change before another session is let in, so two are never let in on one measurement of a ring near or over its target.
A ring with no measurement yet is judged by admission control's prediction (`engine/stream/lanes.py`), which has its
say after this in any case."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence

from ..engine.stream import MAX_DEPTH
from . import refusals
from .errors import SessionRefused

MEASURED_LATENTS = 3  # fresh latents per playing session since the ring changed: two intervals to measure
LONGEST_WAIT_S = 8.0  # a create waits no longer for a measurement (a client gives up on an answer after 15 s)
SETTLE_S = 10.0  # a ring that just took a session in captures its new plans first: over target this long is behind
HEADROOM = 0.5  # sessions whose latest latents came within this share of the target let a create in at once
POLL_S = 0.01


def latent_interval_ms(times: Sequence[float], since: float, now: float) -> float | None:
    """A session's time between fresh latents from its latent times (perf_counter) after `since`: the mean of the
    last intervals, or the time since its last latent if that is longer (a stalled ring); None until it has had
    MEASURED_LATENTS latents since then."""
    recent = [t for t in times if t > since][-MEASURED_LATENTS:]
    if len(recent) < MEASURED_LATENTS:
        return None
    mean_s = (recent[-1] - recent[0]) / (len(recent) - 1)
    return max(mean_s, now - recent[-1]) * 1000.0


class Admission:
    def __init__(self, target_ms: float):
        """`target_ms`: the interval between fresh latents every session is promised (the ring's need)."""
        self.target_ms = target_ms
        self.turn = threading.Lock()  # held by one create from its measurement until its session plays
        self._changed_at = time.perf_counter()

    @property
    def wait_s(self) -> float:
        """The longest wait for a measurement within the target once every session plays: a ring in real time gives
        one well within it (a new session's slots ramp up over MAX_DEPTH intervals, then MEASURED_LATENTS more),
        after SETTLE_S for the tick plans the newest session brought (run plain once, then captured)."""
        return min(LONGEST_WAIT_S, SETTLE_S + (MAX_DEPTH + MEASURED_LATENTS + 1) * self.target_ms / 1000.0)

    def changed(self) -> None:
        """The ring changed (a session let in or ended): the next create waits for a measurement after this."""
        self._changed_at = time.perf_counter()

    def check(self, playing: Callable[[], Iterable[Sequence[float]]]) -> None:
        """Return once every playing session (`playing`: each one's latent times) is measured within the target
        since the ring changed, or when `wait_s` has passed without a measurement that says otherwise (a session
        still making its first latents, a slow ring: the prediction judges it then); SessionRefused when one is
        still measured over the target then. Hold `turn` around this and the session's start."""
        if self._comfortable([list(times) for times in playing()]):
            return
        while True:
            now = time.perf_counter()
            sessions = [list(times) for times in playing()]
            intervals = [latent_interval_ms(times, self._changed_at, now) for times in sessions]
            measured = [interval for interval in intervals if interval is not None]
            behind = bool(measured) and max(measured) > self.target_ms
            if not behind and len(measured) == len(intervals):
                return
            if now > self._changed_at + self.wait_s:
                if behind:
                    raise SessionRefused(refusals.behind(max(measured), self.target_ms))
                return
            time.sleep(POLL_S)

    def _comfortable(self, sessions: list[list[float]]) -> bool:
        """Whether nothing measured says the ring is near its target: every session measured so far (MEASURED_LATENTS
        latents, since the ring changed or not) got its latest latents within HEADROOM of it, or none is measured yet
        (the prediction has its say then). A ring nearer its target is measured again after the last change first."""
        now = time.perf_counter()
        intervals = [latent_interval_ms(times, float("-inf"), now) for times in sessions]
        measured = [interval for interval in intervals if interval is not None]
        return not measured or max(measured) <= HEADROOM * self.target_ms

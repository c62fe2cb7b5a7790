"""Timetagged OSC bundle contents, held until their time on a thread of their own so the receive loop never waits."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable

from pythonosc.osc_message import OscMessage

from .udp import Address

MAX_SCHEDULED = 10_000


class BundleScheduler:
    """A heap of (due, message, sender); run() applies each at its due time (perf_counter domain) until stopped."""

    def __init__(self, apply: Callable[[OscMessage, Address, float], None]):
        self._apply = apply
        self._ready = threading.Condition()
        self._due: list[tuple[float, int, OscMessage, Address]] = []
        self._order = itertools.count()  # equal due times apply in arrival order

    def add(self, due: float, message: OscMessage, sender: Address) -> bool:
        """Hold `message` until `due`; False (and nothing held) when MAX_SCHEDULED already wait."""
        with self._ready:
            if len(self._due) >= MAX_SCHEDULED:
                return False
            heapq.heappush(self._due, (due, next(self._order), message, sender))
            self._ready.notify()
        return True

    def run(self, stopping: threading.Event) -> None:
        """The scheduler thread: returns once `stopping` is set and wake() was called."""
        while True:
            with self._ready:
                while not stopping.is_set():
                    wait_s = self._due[0][0] - time.perf_counter() if self._due else None
                    if wait_s is not None and wait_s <= 0:
                        break
                    self._ready.wait(wait_s)
                if stopping.is_set():
                    return
                due, _, message, sender = heapq.heappop(self._due)
            self._apply(message, sender, due)

    def wake(self) -> None:
        with self._ready:
            self._ready.notify_all()

    def clear(self) -> None:
        with self._ready:
            self._due.clear()

"""The plugin lobby: one small shared-memory segment per engine (`flowjam-plugin-lobby`, or $FLOWJAM_LOBBY) where
every plugin instance on the machine claims a row and asks for a session, and the engine answers with the session it
serves that instance (created on demand, a lane of its one ring). The engine creates it and writes its heartbeat;
each instance's watcher thread (never the audio thread) claims a free row (or one whose owner stopped beating for
ROW_STALE_S) by compare-and-swap of the row's token, beats in it, and asks for a name: its saved session's, or ""
for a new one. The engine grants the name asked, or for "" a name no live instance holds (the engine's --session
first, then track-2, track-3, ...), and writes it back; the instance saves it in the DAW project.

Layout (native byte order, one writer per field): int64 COUNTERS (MAGIC, VERSION, HEARTBEAT_NS, ROWS), then ROWS rows
of int64 ROW_COUNTERS (TOKEN: the owner's, written only by instances; BEAT_NS: the owner's CLOCK_MONOTONIC; ASK_SEQ:
the owner counts each ask; GRANT_SEQ: the ask the engine answered) and two NUL-terminated names of NAME_BYTES (the
asked, the instance's; the granted, the engine's: "" where it could not serve one). plugin/src/flowjam_generated.h
holds the same numbers."""

from __future__ import annotations

import os
from dataclasses import dataclass
from multiprocessing import shared_memory

import numpy as np

LOBBY_MAGIC = 0x464C4A4D4C4F4242  # "FLJMLOBB"
LOBBY_VERSION = 1
DEFAULT_LOBBY = "flowjam-plugin-lobby"
LOBBY_ENV = "FLOWJAM_LOBBY"  # another lobby's name (an engine and its plugins apart from another's, as in the tests)
COUNTERS, ROWS, ROW_COUNTERS, NAME_BYTES = 4, 32, 4, 48
# Slots of the lobby's counters.
MAGIC, VERSION, HEARTBEAT_NS, ROW_COUNT = 0, 1, 2, 3
# Slots of a row's counters.
TOKEN, BEAT_NS, ASK_SEQ, GRANT_SEQ = 0, 1, 2, 3
ROW_BYTES = 8 * ROW_COUNTERS + 2 * NAME_BYTES
ROWS_OFFSET = 8 * COUNTERS
SIZE = ROWS_OFFSET + ROWS * ROW_BYTES
ROW_STALE_S = 10.0  # a row whose owner has not beaten for this long is free (a host that crashed)


def lobby_name() -> str:
    """The lobby's shared-memory name: $FLOWJAM_LOBBY, else the machine's one."""
    return os.environ.get(LOBBY_ENV) or DEFAULT_LOBBY


@dataclass(frozen=True)
class Ask:
    """A row's owner and its newest ask."""

    row: int
    token: int
    beat_ns: int
    seq: int
    name: str


class Lobby:
    """The engine's side: created (taking over a name left by a killed engine) and unlinked by the engine."""

    def __init__(self, name: str | None = None):
        self.name = name or lobby_name()
        try:
            shared_memory.SharedMemory(name=self.name).unlink()
        except FileNotFoundError:
            pass
        self._shm = shared_memory.SharedMemory(name=self.name, create=True, size=SIZE)
        buf = self._shm.buf
        self.counters = np.ndarray((COUNTERS,), np.int64, buf, 0)
        rows = np.ndarray((ROWS, ROW_BYTES), np.uint8, buf, ROWS_OFFSET)
        self._row_counters = [row[: 8 * ROW_COUNTERS].view(np.int64) for row in rows]
        self._asked = rows[:, 8 * ROW_COUNTERS : 8 * ROW_COUNTERS + NAME_BYTES]
        self._granted = rows[:, 8 * ROW_COUNTERS + NAME_BYTES :]
        rows[:] = 0
        self.counters[[VERSION, ROW_COUNT]] = (LOBBY_VERSION, ROWS)
        self.counters[MAGIC] = LOBBY_MAGIC  # last: an instance mapping it now sees a whole lobby

    def beat(self, now_ns: int) -> None:
        self.counters[HEARTBEAT_NS] = now_ns

    def asks(self, now_ns: int) -> list[Ask]:
        """Every row whose owner beat within ROW_STALE_S."""
        found = []
        for row, counters in enumerate(self._row_counters):
            token, beat, seq = (int(counters[slot]) for slot in (TOKEN, BEAT_NS, ASK_SEQ))
            if token != 0 and now_ns - beat < ROW_STALE_S * 1e9:
                found.append(Ask(row, token, beat, seq, _text(self._asked[row])))
        return found

    def granted(self, row: int) -> str:
        return _text(self._granted[row])

    def grant(self, ask: Ask, session: str) -> None:
        """Answer `ask` with the session served ("": none could be), name first, then the sequence it answers."""
        encoded = session.encode()[: NAME_BYTES - 1]
        self._granted[ask.row] = 0
        self._granted[ask.row, : len(encoded)] = np.frombuffer(encoded, np.uint8)
        self._row_counters[ask.row][GRANT_SEQ] = ask.seq

    def unlink(self) -> None:
        self.counters = self._row_counters = self._asked = self._granted = None
        self._shm.close()
        self._shm.unlink()


def _text(raw: np.ndarray) -> str:
    return bytes(raw).split(b"\0", 1)[0].decode(errors="replace")

"""The plugin's control block: a small shared-memory segment per session, named `flowjam-plugin-<session>`, that
the engine creates and a DAW plugin instance (plugin/) attaches to by that name. The plugin writes the host's
transport (tempo, metre, bar position, play state) every block and the knob values the host changed; the engine
writes a heartbeat, the name of the loop buffer to play and its own knob values (shown back to the host: each knob's
ENGINE_CHANGES counts the values the engine came to by itself, OSC, MIDI or the panel, not the host's own).

Layout (native byte order, every field 8-byte aligned, one writer each): int64 COUNTERS, float64 REALS, float64
HOST_VALUES and int64 HOST_CHANGES (one per knob of KNOB_SPECS, the plugin's), float64 ENGINE_VALUES and int64
ENGINE_CHANGES (the engine's),
then the loop buffer's name as NUL-terminated UTF-8, then the prompts (A, B, negative) as NUL-terminated UTF-8: the
host's (a DAW project's, given back to the engine when it opens) and the engine's (saved in the project), then int64
BLOCK_TIMES (the plugin's: its slowest block's time and a histogram of its blocks' times, see `block_time_bin`). A prompt
area is written under a sequence lock: its counter is odd while it is written. plugin/src/flowjam_generated.h holds
the same numbers."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import numpy as np

from ..engine.params import KNOB_SPECS, MAX_PROMPT_CHARS

CONTROL_MAGIC = 0x464C4A4D4354524C  # "FLJMCTRL"
CONTROL_VERSION = 5
CONTROL_PREFIX = "flowjam-plugin-"
COUNTERS, REALS, MAX_KNOBS, NAME_BYTES = 24, 16, 64, 128
PROMPTS = ("a", "b", "negative")  # the order of the prompt areas
PROMPT_BYTES = 4 * MAX_PROMPT_CHARS + 1  # one prompt of MAX_PROMPT_CHARS characters in UTF-8, and its NUL
# Slots of ControlBlock.counters (int64).
MAGIC, VERSION, HEARTBEAT_NS = 0, 1, 2  # HEARTBEAT_NS: the engine's CLOCK_MONOTONIC when it was last alive
HOST_BLOCKS = 3  # blocks the plugin rendered (it writes the fields below before counting one)
HOST_PLAYING = 4  # 1 while the host's transport plays
HOST_FRAME = 5  # the host's song position in frames at the newest block
BUFFER_SEQ = 6  # the engine counts each new loop buffer name; the plugin attaches again when it moves
KNOB_COUNT = 7  # knobs in the value arrays (len(KNOB_SPECS))
HOST_SAMPLE_RATE = 8
HOST_BLOCK_FRAMES = 9  # the host's largest block
HOST_PROMPTS_SEQ = 10  # the plugin's prompt area: odd while the plugin writes it
ENGINE_PROMPTS_SEQ = 11  # the engine's prompt area: odd while the engine writes it
HOST_LOOP_BARS = 12  # the plugin's `bars` parameter: the loop's length in bars the host asks for (0: the engine's)
ENGINE_LOOP_BARS = 13  # the loop's bars playing now (0: not on a grid)
ENGINE_CLICK = 14  # 1 where the engine was started with --click (the plugin's `click` parameter at "engine")
HOST_PANEL_REQUESTS = 15  # the plugin counts each turn of its `panel` parameter to on: the engine opens the panel
ENGINE_PROMPTS_TAKEN = 16  # the HOST_PROMPTS_SEQ the engine had taken in when it wrote its prompt area: the plugin
# keeps the prompts it pushed until the engine's answer them (a new session's own prompts, written after the push but
# before the engine read it, would otherwise go into the DAW project)
ENGINE_ID = 17  # random, nonzero, fixed for the block's life: a plugin attaching again to the same engine (after its
# heartbeat went stale: a stall, a swap storm) keeps what the engine has; only a new engine is given the project's knobs
HOST_CHANGES_NS = 18  # the plugin's CLOCK_MONOTONIC at the start of the block with its newest knob changes
ENGINE_HOST_CHANGES_TAKEN = 19  # host knob changes the engine took in (ENGINE_HOST_LAG_MS: the newest one's lag)
MAX_LOOP_BARS = 64
# Slots of ControlBlock.reals (float64).
HOST_BPM, HOST_BEATS_PER_BAR = 0, 1
HOST_BARS = 2  # the host's position in bars since its song's start (bar 1 = 0.0), at the newest block
ENGINE_LOOP_WRITTEN = 8  # 1.0 once the loop playing holds the stream's audio (0.0: silent yet; an offline bounce waits)
HOST_OFFLINE = 9  # 1.0 while the plugin finds the host rendering faster than real time (a bounce)
HOST_WAITS = 10  # blocks the plugin held back in offline renders until the engine wrote the loop
HOST_WAITED_S = 11  # seconds those blocks waited, in all
ENGINE_HOST_LAG_MS = 12  # the newest host knob change: its block's start -> the engine took it in (what `live` lacks)
BLOCK_TIME_BINS = 128  # the histogram of the plugin's block times: quarter octaves of nanoseconds (to ~8.6 s)
BLOCK_TIME_MAX_NS = 0  # BLOCK_TIMES[0]: the slowest block's nanoseconds; the bins follow from index 1
PLUGIN_ORIGIN = "plugin"  # a knob change from the plugin's parameter (the plugin applied volume to the gain itself)
STALE_AFTER_S = 1.0  # a heartbeat older than this: the engine is gone, the plugin plays silence


def control_name(session: str) -> str:
    """The control block's shared-memory name for a session (the plugin's `session` state)."""
    if not session or len(session) > 40 or not all(c.isalnum() or c in "-_" for c in session):
        raise ValueError(f"a plugin session name is 1-40 letters, digits, - or _, got {session!r}")
    return CONTROL_PREFIX + session


def _offsets() -> dict[str, int]:
    reals = 8 * COUNTERS
    host_values = reals + 8 * REALS
    host_changes = host_values + 8 * MAX_KNOBS
    engine_values = host_changes + 8 * MAX_KNOBS
    engine_changes = engine_values + 8 * MAX_KNOBS
    name = engine_changes + 8 * MAX_KNOBS
    host_prompts = name + NAME_BYTES
    prompt_area = 8 * ((len(PROMPTS) * PROMPT_BYTES + 7) // 8)
    engine_prompts = host_prompts + prompt_area
    block_times = engine_prompts + prompt_area
    return {
        "reals": reals,
        "host_values": host_values,
        "host_changes": host_changes,
        "engine_values": engine_values,
        "engine_changes": engine_changes,
        "name": name,
        "host_prompts": host_prompts,
        "engine_prompts": engine_prompts,
        "block_times": block_times,
        "size": block_times + 8 * (1 + BLOCK_TIME_BINS),
    }


OFFSETS = _offsets()
assert len(KNOB_SPECS) <= MAX_KNOBS


def block_time_bin(ns: int) -> int:
    """The histogram bin of a block that took `ns` nanoseconds (plugin/src/block_times.hpp counts the same): bins 0-3
    hold 0-3 ns, then four bins per octave."""
    if ns < 4:
        return max(0, ns)
    top = ns.bit_length() - 1
    return min(BLOCK_TIME_BINS - 1, 4 * (top - 1) + ((ns >> (top - 2)) & 3))


def block_time_bin_floor(index: int) -> int:
    """The fewest nanoseconds a block in bin `index` took."""
    if index < 4:
        return index
    top, quarter = index // 4 + 1, index % 4
    return (4 + quarter) << (top - 2)


@dataclass(frozen=True)
class BlockTimes:
    """The plugin's time per block in the host's audio thread (its `run`, from entry to return, while attached)."""

    blocks: int
    median_us: float  # the bins' upper edges: a block at most this long
    p99_us: float
    max_us: float

    @classmethod
    def of(cls, histogram: np.ndarray, max_ns: int) -> BlockTimes:
        counts = np.asarray(histogram, np.int64)
        blocks = int(counts.sum())

        def percentile(q: float) -> float:
            if blocks == 0:
                return 0.0
            index = int(np.searchsorted(np.cumsum(counts), q * blocks))
            return min(block_time_bin_floor(index + 1), max_ns) / 1000.0

        return cls(blocks, percentile(0.5), percentile(0.99), max_ns / 1000.0)


class ControlBlock:
    """The engine's side of the segment: created (and unlinked) by the engine, attached to by a plugin."""

    def __init__(self, session: str = "default", create: bool = True):
        name = control_name(session)
        if create:
            try:  # a segment left by an engine that was killed: take its name over
                shared_memory.SharedMemory(name=name).unlink()
            except FileNotFoundError:
                pass
        self._shm = shared_memory.SharedMemory(name=name, create=create, size=OFFSETS["size"] if create else 0)
        if not create:  # Python's resource tracker would unlink the engine's segment when this process exits
            resource_tracker.unregister(self._shm._name, "shared_memory")
        self._owner = create
        buf = self._shm.buf
        self.counters = np.ndarray((COUNTERS,), np.int64, buf, 0)
        self.reals = np.ndarray((REALS,), np.float64, buf, OFFSETS["reals"])
        self.host_values = np.ndarray((MAX_KNOBS,), np.float64, buf, OFFSETS["host_values"])
        self.host_changes = np.ndarray((MAX_KNOBS,), np.int64, buf, OFFSETS["host_changes"])
        self.engine_values = np.ndarray((MAX_KNOBS,), np.float64, buf, OFFSETS["engine_values"])
        self.engine_changes = np.ndarray((MAX_KNOBS,), np.int64, buf, OFFSETS["engine_changes"])
        self._name = np.ndarray((NAME_BYTES,), np.uint8, buf, OFFSETS["name"])
        self._prompts = {
            area: np.ndarray((len(PROMPTS), PROMPT_BYTES), np.uint8, buf, OFFSETS[f"{area}_prompts"])
            for area in ("host", "engine")
        }
        self._block_times = np.ndarray((1 + BLOCK_TIME_BINS,), np.int64, buf, OFFSETS["block_times"])
        if create:
            self._block_times[:] = 0
            self.counters[:] = 0
            self.reals[:] = 0.0
            self.host_changes[:] = 0
            self.engine_changes[:] = 0
            for index, spec in enumerate(KNOB_SPECS):
                self.host_values[index] = self.engine_values[index] = spec.default
            self.counters[[VERSION, KNOB_COUNT]] = (CONTROL_VERSION, len(KNOB_SPECS))
            self.counters[ENGINE_ID] = secrets.randbits(62) + 1
            self.counters[MAGIC] = CONTROL_MAGIC  # last: a plugin attaching now sees a whole block
        elif self.counters[MAGIC] != CONTROL_MAGIC:
            self.close()
            raise ValueError(f"shared memory {name!r} is not a flowjam plugin control block")
        self.name = name

    def set_buffer(self, buffer_name: str) -> None:
        """Point the plugin at a loop buffer (it attaches on its next check)."""
        encoded = buffer_name.encode()
        if len(encoded) >= NAME_BYTES:
            raise ValueError(f"loop buffer name {buffer_name!r} is longer than {NAME_BYTES - 1} bytes")
        self._name[:] = 0
        self._name[: len(encoded)] = np.frombuffer(encoded, np.uint8)
        self.counters[BUFFER_SEQ] += 1

    @property
    def buffer_name(self) -> str:
        return bytes(self._name).split(b"\0", 1)[0].decode()

    def host_prompts(self) -> dict[str, str] | None:
        """The prompts the plugin gave (a DAW project's), or None while it writes them."""
        return self._read_prompts("host", HOST_PROMPTS_SEQ)

    def engine_prompts(self) -> dict[str, str] | None:
        return self._read_prompts("engine", ENGINE_PROMPTS_SEQ)

    def write_engine_prompts(self, prompts: dict[str, str], taken_seq: int) -> None:
        """The engine's prompts now, for the plugin to save in the DAW project; `taken_seq`: the plugin's prompt area
        (HOST_PROMPTS_SEQ) the engine had taken in before."""
        seq = int(self.counters[ENGINE_PROMPTS_SEQ])
        self.counters[ENGINE_PROMPTS_SEQ] = seq + 1
        self.counters[ENGINE_PROMPTS_TAKEN] = taken_seq
        for index, slot in enumerate(PROMPTS):
            encoded = prompts.get(slot, "").encode()[: PROMPT_BYTES - 1]
            row = self._prompts["engine"][index]
            row[: len(encoded)] = np.frombuffer(encoded, np.uint8)
            row[len(encoded)] = 0
        self.counters[ENGINE_PROMPTS_SEQ] = seq + 2

    def _read_prompts(self, area: str, seq_slot: int) -> dict[str, str] | None:
        before = int(self.counters[seq_slot])
        rows = self._prompts[area].copy()
        if before % 2 or int(self.counters[seq_slot]) != before:
            return None
        return {
            slot: bytes(rows[index]).split(b"\0", 1)[0].decode(errors="replace") for index, slot in enumerate(PROMPTS)
        }

    def block_times(self) -> BlockTimes:
        """The plugin's block times so far (it writes them as it plays: a reading, not a snapshot)."""
        times = self._block_times.copy()
        return BlockTimes.of(times[1:], int(times[BLOCK_TIME_MAX_NS]))

    def beat(self, now_ns: int) -> None:
        """The engine's heartbeat (CLOCK_MONOTONIC nanoseconds, time.monotonic_ns on Linux)."""
        self.counters[HEARTBEAT_NS] = now_ns

    def close(self) -> None:
        self.counters = self.reals = self.host_values = self.host_changes = self.engine_values = None
        self.engine_changes = self._name = None
        self._block_times = None
        self._prompts = {}
        self._shm.close()

    def unlink(self) -> None:
        """Free the segment (engine only): a plugin attached to it sees its heartbeat go stale."""
        if self._owner:
            self._shm.unlink()
        self.close()

"""Real-time scheduling for the threads that must not be late: the audio output process and its callback thread
(SCHED_FIFO where the OS allows it, memory locked), and the engine's threads (the runner, the writer: a raised
priority among normal processes, so a CPU hog beside them cannot starve the ticks and decodes that feed the audio).
Everything here is best effort: where the OS refuses, things run as before and one warning says how to allow it."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import resource
import threading
import time
from collections.abc import Callable

log = logging.getLogger("flowjam.playback")

# SCHED_FIFO priority of the audio callback thread (and of the null clock) where the host API leaves it unset (ALSA, a
# non-RT JACK server). An RT JACK server sets its clients' process threads itself (its -P minus 5; jackd's default -P
# is 10, so 5) and is left alone. Everything else in the output process runs at FIFO 1 (see _output_process_main).
REALTIME_PRIORITY = 60


def acquire_realtime(priority: int = REALTIME_PRIORITY, thread_id: int = 0) -> tuple[bool, str]:
    """Make a thread (its native id; 0: the calling one) SCHED_FIFO at `priority`, or at the RLIMIT_RTPRIO ceiling when
    that is lower (threads it creates afterwards inherit it) -> (granted, a one-line description). Never raises:
    without the right (root, CAP_SYS_NICE, or an `rtprio` limit) the thread stays as it was."""
    if not hasattr(os, "sched_setscheduler"):
        return False, "real-time scheduling refused: not available on this OS"
    soft = resource.getrlimit(resource.RLIMIT_RTPRIO)[0]
    error = "RLIMIT_RTPRIO is 0"
    for value in [priority] + ([int(soft)] if 0 < soft < priority else []):
        try:
            os.sched_setscheduler(thread_id, os.SCHED_FIFO, os.sched_param(value))
        except OSError as refused:
            error = refused.strerror
            continue
        return True, f"SCHED_FIFO {value}"
    limit = "unlimited" if soft == resource.RLIM_INFINITY else soft
    return False, (
        f"real-time scheduling refused ({error}; rtprio limit {limit}): playback may underrun while the machine is "
        f"busy. Allow it with an rtprio limit of {REALTIME_PRIORITY} or more for this user (e.g. `@audio - rtprio 95` "
        "in /etc/security/limits.d/audio.conf and membership of the audio group; `ulimit -r` shows it) or run as root"
    )


def promote_callback_thread(native_id: Callable[[], int], timeout_s: float = 1.0) -> str:
    """Raise the thread that runs the callback to REALTIME_PRIORITY, unless its host API made it real-time already
    (an RT JACK server: its client priority is part of its graph's scheme) -> a description."""
    deadline = time.monotonic() + timeout_s
    while not native_id() and time.monotonic() < deadline:  # the first callback says which thread it is
        time.sleep(0.002)
    thread_id = native_id()
    if not thread_id:
        return f"callback thread unknown (no callback within {timeout_s:g} s)"
    try:
        policy, priority = os.sched_getscheduler(thread_id), os.sched_getparam(thread_id).sched_priority
    except OSError as error:
        return f"callback thread not inspected ({error.strerror})"
    if policy in (os.SCHED_FIFO, os.SCHED_RR) and priority > 1:
        return f"callback thread {'SCHED_FIFO' if policy == os.SCHED_FIFO else 'SCHED_RR'} {priority} (its host API's)"
    return "callback thread " + acquire_realtime(REALTIME_PRIORITY, thread_id)[1]


def lock_memory() -> str:
    """mlockall(MCL_CURRENT): the pages mapped now (the buffer, the recording ring, PortAudio's, numpy's) are faulted
    in and never paged out, so the callback takes no page fault. Not MCL_FUTURE: past RLIMIT_MEMLOCK that would make
    later allocations fail. -> a description for the start-up note."""
    try:
        mlockall = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).mlockall
    except (OSError, AttributeError, TypeError):
        return "memory not locked (no mlockall)"
    if mlockall(1) == 0:  # MCL_CURRENT
        return "memory locked"
    return f"memory not locked ({os.strerror(ctypes.get_errno())}; `ulimit -l` is too small)"


def settle() -> str:
    """Everything the callback uses exists now: lock it in memory and move every object to the GC's permanent
    generation (a collection the callback happens to trigger then scans only what it allocated since). -> a note."""
    locked = lock_memory()
    gc.collect()
    gc.freeze()
    return locked


_logged: list[str] = []  # the refusal already logged in this process, if any


def log_refusal(note: str) -> None:
    """Warn once per process that the output process runs without real-time scheduling."""
    if "refused" in note and not _logged:
        _logged.append(note)
        log.warning("audio output process: %s", note)


ENGINE_NICE = -10  # the runner's and writer's niceness where allowed: preferred over normal processes, not real time


def raise_thread_priority(nice: int = ENGINE_NICE) -> bool:
    """Give the calling thread a higher priority among normal (non-real-time) threads, where allowed (root or
    CAP_SYS_NICE, or an RLIMIT_NICE that permits it); whether it was granted. On Linux niceness is per thread."""
    if not hasattr(os, "setpriority"):
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError:
        return False
    return True

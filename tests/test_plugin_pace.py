"""The plugin's offline detection (plugin/src/host_pace.hpp, through libflowjam_core.so): DPF 1.6 passes no offline
flag, so the plugin tells a bounce by the host's pace. Blocks as a sound card paces them (with late wake-ups, and with
a host splitting its period into sub-blocks) are real time; blocks four times faster than real time are a bounce once
two of the host's largest blocks have come; the plugin's own waits are not the host's time."""

import ctypes

import numpy as np
import pytest
from plugin_build import build

RATE, BLOCK = 48_000, 512
PERIOD_NS = BLOCK * 1_000_000_000 // RATE


@pytest.fixture(scope="module")
def core():
    library = ctypes.CDLL(str(build(need_dpf=False) / "libflowjam_core.so"))
    library.flowjam_pace_new.restype = ctypes.c_void_p
    library.flowjam_pace_new.argtypes = (ctypes.c_int, ctypes.c_double)
    library.flowjam_pace_block.argtypes = (ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int)
    library.flowjam_pace_held.argtypes = (ctypes.c_void_p, ctypes.c_longlong)
    library.flowjam_pace_free.argtypes = (ctypes.c_void_p,)
    return library


def judged(core, starts_ns, frames, held_ns=None) -> list[bool]:
    """Whether each block (starting at `starts_ns`, of `frames`) was judged offline; `held_ns[i]`: the plugin waited
    that long in block i."""
    pace = core.flowjam_pace_new(BLOCK, RATE)
    try:
        verdicts = []
        for index, (start, size) in enumerate(zip(starts_ns, frames)):
            verdicts.append(bool(core.flowjam_pace_block(pace, int(start), int(size))))
            if held_ns is not None and held_ns[index]:
                core.flowjam_pace_held(pace, int(held_ns[index]))
        return verdicts
    finally:
        core.flowjam_pace_free(pace)


def test_a_sound_cards_pace_is_real_time_even_with_late_wake_ups_and_sub_blocks(core):
    rng = np.random.default_rng(3)
    periods = np.arange(2000) * PERIOD_NS
    late = rng.uniform(0, 0.95, periods.size) * PERIOD_NS  # each callback up to 95% of a period late
    assert not any(judged(core, periods + late, [BLOCK] * periods.size))
    # a host that splits each period into four sub-blocks, played back to back
    starts = [period + late[i] + quarter * 2000 for i, period in enumerate(periods) for quarter in range(4)]
    assert not any(judged(core, starts, [BLOCK // 4] * len(starts)))


def test_blocks_four_times_faster_than_real_time_are_a_bounce_after_two_blocks(core):
    starts = np.arange(50) * (PERIOD_NS // 5)
    verdicts = judged(core, starts, [BLOCK] * 50)
    assert verdicts[:2] == [False, False] and all(verdicts[2:]), verdicts[:6]
    slower = np.arange(50) * (PERIOD_NS // 3)  # three times faster than real time: not a bounce
    assert not any(judged(core, slower, [BLOCK] * 50))


def test_the_plugins_own_waits_do_not_make_a_bounce_look_real_time(core):
    wait_ns = 2 * PERIOD_NS
    starts = np.cumsum([0] + [PERIOD_NS // 10 + wait_ns] * 49)  # each block waited two periods for the engine
    assert all(judged(core, starts, [BLOCK] * 50, [wait_ns] * 50)[2:])
    assert not any(judged(core, starts, [BLOCK] * 50)[2:]), "without the waits counted out, it is real time"

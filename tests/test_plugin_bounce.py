"""An offline bounce started as the engine starts: DawDreamer (which renders as fast as it can, and which the plugin
takes for a bounce by that pace: DPF 1.6 passes it no offline flag) renders the VST3 right after the engine's control
block appears (the plugin tests' shared engine, killed and started again), before the engine has written its first
loop. The plugin holds its blocks back until the loop is
written (2 s a block at most), so the bounced audio has music from its third block on, where it would otherwise
start with the silence of a loop not yet written."""

import time

import numpy as np
import pytest
from daw_host import BAR_FRAMES, BLOCK, BPM, SESSION, parameter_index, plugin_for_session
from flowjam.live.plugin_link import (
    ENGINE_LOOP_WRITTEN,
    HEARTBEAT_NS,
    HOST_OFFLINE,
    HOST_WAITED_S,
    HOST_WAITS,
    STALE_AFTER_S,
    ControlBlock,
)
from helpers import wait_for
from plugin_build import build

daw = pytest.importorskip("dawdreamer", reason="DawDreamer (pip install 'flowjam[test]') hosts the VST3")

BARS = 4
UNJUDGED_BLOCKS = 2  # the plugin knows a bounce by its pace once two blocks have come
# the engine's most: its first loop comes after 50 ticks, not 8, well after the bounce's start
SLOW_FIRST_LOOP_STEPS = 50


def attach_fresh(session: str) -> ControlBlock:
    """The engine's control block as soon as it beats (the engine is up; its loop is not yet written), not the one a
    killed engine left behind."""

    def beating() -> ControlBlock | None:
        try:
            control = ControlBlock(session, create=False)
        except (FileNotFoundError, ValueError):
            return None
        if time.monotonic_ns() - control.counters[HEARTBEAT_NS] > 0.5e9:
            control.close()
            return None
        return control

    return wait_for(beating, 180, "the engine's control block", poll_s=0.005)


def silent_runs(audio: np.ndarray, at_least: int) -> list[tuple[int, int]]:
    """(start, length) of every run of at least `at_least` exact zeros."""
    zero = np.concatenate([[False], audio == 0.0, [False]])
    edges = np.flatnonzero(np.diff(zero.astype(np.int8)))
    return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2]) if b - a >= at_least]


def test_an_offline_bounce_started_with_the_engine_waits_for_its_loop_instead_of_bouncing_silence(
    plugin_engine, tmp_path
):
    vst3 = build() / "flowjam.vst3"
    host, plugin = plugin_for_session(daw, vst3, SESSION, tmp_path / "state")
    plugin.set_parameter(parameter_index(plugin, "click"), 0.5)  # off: what is heard is the loop
    plugin_engine.kill()
    time.sleep(STALE_AFTER_S + 0.3)  # its heartbeat goes stale
    plugin_engine.restart("--steps", str(SLOW_FIRST_LOOP_STEPS))
    control = None
    try:
        control = attach_fresh(SESSION)
        time.sleep(0.15)  # the plugin's watcher attaches within 0.1 s
        written_before = control.reals[ENGINE_LOOP_WRITTEN]
        started = time.monotonic()
        host.render(BARS * 4 * 60 / BPM)
        render_s = time.monotonic() - started
        audio = host.get_audio()[0]
        waits, waited_s = int(control.reals[HOST_WAITS]), float(control.reals[HOST_WAITED_S])
        print(f"bounce of {BARS} bars in {render_s:.2f} s: {waits} blocks waited {waited_s:.2f} s in all")
        assert written_before == 0.0, "the engine wrote its loop before the bounce began: nothing to wait for"
        assert audio.size >= round(BARS * BAR_FRAMES)
        music = audio[UNJUDGED_BLOCKS * BLOCK : round(BARS * BAR_FRAMES)]
        runs = silent_runs(music, 64)
        assert not runs, f"silent stretches in the bounce (start, frames) after its first blocks: {runs[:5]}"
        assert np.sqrt(np.mean(music**2)) > 1e-3, "the bounce holds the loop"
        assert control.reals[HOST_OFFLINE] == 1.0, "DawDreamer's pace is taken for a bounce"
        assert waits >= 1 and 0 < waited_s <= 2.0 * waits, (waits, waited_s)
    finally:
        if control is not None:
            control.close()
        plugin_engine.kill()
        plugin_engine.restart()  # as the other plugin tests know it
        plugin_engine.wait_ready()

"""The VST3 in a real host (DawDreamer, headless, 48 kHz, 512-frame blocks) with `flowjam live --plugin` running on
the tiny preset: 16 bars at 123 BPM with every click within one sample of the host's ideal bar line, the loop
audible at volume 0.1, and the host's automation of `volume` to 0 over the last four bars leaving only the clicks; a
state saved in one process gives the engine its prompt and knobs back in another; a tempo change in the host gives a
loop at the new tempo on its bar lines; the click and bars parameters turn the click off and on and make the loop
again in other bars; the engine killed gives silence, not
a crash, and the stream comes back with the engine."""

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from daw_host import (
    BAR_FRAMES,
    BLOCK,
    BPM,
    RATE,
    SESSION,
    click_onset_near,
    dpf_state,
    parameter_index,
    plugin_for_session,
)
from flowjam.engine.params import KNOB_SPECS
from flowjam.live.plugin_link import ENGINE_LOOP_BARS, STALE_AFTER_S, ControlBlock
from flowjam.live.renderer import click_wave
from helpers import wait_for
from plugin_build import build

daw = pytest.importorskip("dawdreamer", reason="DawDreamer (pip install 'flowjam[test]') hosts the VST3")

BARS = 16
SEED, STEPS = (next(i for i, spec in enumerate(KNOB_SPECS) if spec.name == name) for name in ("seed", "steps"))


@pytest.fixture(scope="module")
def vst3():
    return build() / "flowjam.vst3"


@pytest.fixture
def engine(vst3, plugin_engine):
    return plugin_engine


def click_onsets(audio: np.ndarray, bars: int, bar_frames: float = BAR_FRAMES) -> np.ndarray:
    """Each bar's click onset, found near its ideal bar line."""
    return np.array([click_onset_near(audio, round(bar * bar_frames)) for bar in range(bars)])


def test_vst3_plays_the_loop_on_the_hosts_bar_lines_and_volume_automation_to_zero_leaves_only_clicks(
    engine, vst3, tmp_path
):
    host, plugin = plugin_for_session(daw, vst3, SESSION, tmp_path / "state")
    frames = round(BARS * BAR_FRAMES)
    volume = np.full(frames + RATE, 0.1)
    quiet_from = round((BARS - 4) * BAR_FRAMES)
    volume[quiet_from:] = 0.0
    plugin.set_automation(parameter_index(plugin, "volume"), volume)
    host.render(BARS * 4 * 60 / BPM + 0.05)
    audio = host.get_audio()
    assert audio.shape[0] == 2 and audio.shape[1] >= frames

    ideal = np.round(np.arange(BARS) * BAR_FRAMES).astype(int)
    errors = click_onsets(audio[0], BARS) - ideal
    assert np.abs(errors).max() <= 1, f"clicks against the host's bar lines (samples): {errors.tolist()}"

    click = click_wave(RATE)[:, 0]
    clicks_only = np.zeros(audio.shape[1], np.float32)
    for onset in ideal + errors:
        clicks_only[onset : onset + click.size] += click[: audio.shape[1] - onset]
    loud = slice(round(0.5 * BAR_FRAMES), quiet_from - BLOCK)
    music = audio[0, loud] - clicks_only[loud]
    assert np.sqrt(np.mean(music**2)) > 1e-3, "the loop is audible at volume 0.1"
    quiet = slice(quiet_from + 2 * BLOCK, frames)  # automation arrives at the next block start, ramps over one
    left = np.abs(audio[:, quiet] - clicks_only[quiet]).max()
    assert left == 0.0, f"volume 0 leaves only the clicks, but {left:.3g} of the loop is left"


SAVE_IN_ANOTHER_PROCESS = """
import sys, pathlib
import dawdreamer
from daw_host import parameter_index, plugin_for_session
host, plugin = plugin_for_session(dawdreamer, sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3]))
plugin.set_parameter(parameter_index(plugin, "steps"), (12 - 1) / 49)
plugin.set_parameter(parameter_index(plugin, "seed"), 1234 / (2**31 - 1))
host.render(0.5)
import time; time.sleep(0.5)  # the engine's prompt comes back to the plugin within its next checks
plugin.save_state(sys.argv[3])
"""


def engine_session(control: ControlBlock) -> tuple[str, float, float]:
    """(prompt A, seed, steps) as the engine plays them."""
    prompts = control.engine_prompts() or {"a": None}
    return prompts["a"], control.engine_values[SEED], control.engine_values[STEPS]


def test_vst3_state_saved_in_one_process_gives_the_engine_its_session_back_in_another(engine, vst3, tmp_path):
    saved = tmp_path / "project-state"
    tests = Path(__file__).parent
    subprocess.run(
        [sys.executable, "-c", SAVE_IN_ANOTHER_PROCESS, str(vst3), SESSION, str(saved)],
        check=True,
        cwd=tests,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])},
        timeout=120,
    )
    control = ControlBlock(SESSION, create=False)
    try:
        wait_for(lambda: engine_session(control) == ("ambient pads", 1234, 12), 10, "the knobs the host set")
        other = tmp_path / "other-state"
        plugin_for_session(daw, vst3, SESSION, other)
        dpf_state(other, prompt="solo piano", prompt_b="", negative="")
        host, plugin = plugin_for_session(daw, vst3, SESSION, other)
        host.render(0.5)
        wait_for(lambda: engine_session(control)[0] == "solo piano", 30, "another project's prompt on the engine")
        host, plugin = plugin_for_session(daw, vst3, SESSION, saved)
        host.render(0.5)
        wait_for(
            lambda: engine_session(control) == ("ambient pads", 1234, 12),
            30,
            lambda: f"the saved session on the engine {engine_session(control)}",
        )
    finally:
        control.close()


def test_vst3_tempo_change_in_the_host_gives_a_new_loop_on_its_bar_lines(engine, vst3, tmp_path):
    host, plugin = plugin_for_session(daw, vst3, SESSION, tmp_path / "state")
    host.set_bpm(100.0)
    bar = 4 * 60 / 100.0 * RATE
    ideal = np.round(np.arange(4) * bar).astype(int)

    def at_new_tempo() -> bool:
        host.render(2 * 4 * 60 / 100.0)
        return np.abs(click_onsets(host.get_audio()[0], 2, bar) - ideal[:2]).max() <= 1

    wait_for(at_new_tempo, 90, "the loop at the host's new tempo", poll_s=0.2)
    host.render(4 * 4 * 60 / 100.0 + 0.05)
    audio = host.get_audio()[0]
    errors = click_onsets(audio, 4, bar) - ideal
    assert np.abs(errors).max() <= 1, f"clicks against the new tempo's bar lines (samples): {errors.tolist()}"
    assert np.sqrt(np.mean(audio[: ideal[-1]] ** 2)) > 1e-3, "the new loop is audible"


def test_vst3_click_and_bars_parameters_switch_the_click_and_remake_the_loop_in_bars(engine, vst3, tmp_path):
    host, plugin = plugin_for_session(daw, vst3, SESSION, tmp_path / "state")
    seconds = 4 * 60 / BPM
    plugin.set_parameter(parameter_index(plugin, "volume"), 0.0)
    plugin.set_parameter(parameter_index(plugin, "click"), 0.5)  # off
    host.render(seconds)
    assert not host.get_audio()[:, 2 * BLOCK :].any(), "volume 0 and the click off: silence"
    plugin.set_parameter(parameter_index(plugin, "click"), 1.0)  # on
    plugin.set_parameter(parameter_index(plugin, "bars"), 4 / 64)
    host.render(seconds)
    assert click_onset_near(host.get_audio()[0], 0) == 0, "the click is back"
    control = ControlBlock(SESSION, create=False)

    def remade() -> bool:
        host.render(seconds)  # the plugin switches to the new loop on a bar line the host plays
        return control.counters[ENGINE_LOOP_BARS] == 4

    try:
        wait_for(remade, 60, "the loop made again in 4 bars", poll_s=0.1)
    finally:
        control.close()
    host.render(8 * seconds + 0.05)
    audio = host.get_audio()[0]
    ideal = np.round(np.arange(8) * BAR_FRAMES).astype(int)
    errors = [click_onset_near(audio, int(at)) - int(at) for at in ideal]
    assert max(map(abs, errors)) <= 1, f"clicks of the 4-bar loop against the bar lines (samples): {errors}"


def test_vst3_plays_silence_when_the_engine_dies_and_the_stream_again_once_it_is_back(engine, vst3, tmp_path):
    host, plugin = plugin_for_session(daw, vst3, SESSION, tmp_path / "state")
    seconds = 2 * 4 * 60 / BPM
    host.render(seconds)
    assert np.abs(host.get_audio()).max() > 0.1, "the stream plays while the engine runs"
    engine.kill()
    time.sleep(STALE_AFTER_S + 0.3)  # its heartbeat goes stale
    host.render(seconds)
    assert not host.get_audio().any(), "a dead engine's session plays silence"
    assert plugin.get_parameter(parameter_index(plugin, "connected")) == 0.0
    engine.restart()
    engine.wait_ready()
    time.sleep(0.3)  # the plugin's watcher attaches again within 0.1 s
    host.render(seconds)
    assert np.abs(host.get_audio()).max() > 0.1, "the stream plays again once the engine is back"

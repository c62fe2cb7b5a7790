"""The VST3 in a real host (DawDreamer, headless, 48 kHz, 512-frame blocks) with `flowjam live --plugin` running on
the tiny preset: 16 bars at 123 BPM with every click within one sample of the host's ideal bar line, the loop
audible at volume 0.1, and the host's automation of `volume` to 0 over the last four bars leaving only the clicks."""

import os

import numpy as np
import pytest
from daw_host import BAR_FRAMES, BLOCK, BPM, RATE, Engine, parameter_index, plugin_for_session
from flowjam.live.renderer import click_wave
from plugin_build import build

daw = pytest.importorskip("dawdreamer", reason="DawDreamer (pip install 'flowjam[test]') hosts the VST3")

SESSION = f"ci-{os.getpid()}"
BARS = 16


@pytest.fixture(scope="module")
def vst3():
    return build("vst3") / "flowjam.vst3"


@pytest.fixture(scope="module")
def engine(vst3):
    running = Engine(SESSION, "--bpm", "123", "--bars", "2", "--click", "--prompt", "ambient pads")
    try:
        running.wait_ready()
        yield running
    finally:
        running.stop()


def click_onsets(audio: np.ndarray, bars: int) -> np.ndarray:
    """Each bar's click onset: the best match of the click's shape within 20 ms of the ideal bar line."""
    click = click_wave(RATE)[:, 0].astype(np.float64)
    onsets = []
    for bar in range(bars):
        ideal = round(bar * BAR_FRAMES)
        low = max(0, ideal - RATE // 50)
        window = audio[low : ideal + RATE // 50 + click.size].astype(np.float64)
        onsets.append(low + int(np.argmax(np.correlate(window, click, mode="valid"))))
    return np.array(onsets)


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

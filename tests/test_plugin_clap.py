"""The CLAP build in a minimal CLAP host (plugin/tools/clap_render.cpp: no CLAP host installs here) with `flowjam live
--plugin` running on the tiny preset: it loads, connects to the engine's session and plays 8 bars at 123 BPM from the
host's transport with every click within one sample of the ideal bar line. The host stops its transport for a while
and plays on: with `on_stop` at free-run the loop runs on through the stop on its own clock (its clicks where the
host's bars would have been) and snaps back to the host's position at play; at fade it is silent through the stop."""

import math
import os
import subprocess

import numpy as np
from daw_host import BAR_FRAMES, SESSION, click_onset_near
from plugin_build import build

BARS = 8
BLOCK = 512  # clap_render's block
STOP_AT, STOP_BARS = 3, 2.5  # the host stops at bar 3 (bar 1 = 0) for two and a half bars of blocks


def clap_render(tmp_path, *options: str) -> np.ndarray:
    """The left channel of BARS bars rendered by the CLAP build in clap_render."""
    folder = build()
    rendered = tmp_path / "out.f32"
    subprocess.run(
        [str(folder / "clap_render"), str(folder / "flowjam.clap"), str(rendered), "123", str(BARS), *options],
        check=True,
        env={**os.environ, "FLOWJAM_SESSION": SESSION},
        timeout=60,
    )
    return np.fromfile(rendered, np.float32).reshape(-1, 2)[:, 0]


def click_errors(audio: np.ndarray, ideal) -> list[int]:
    return [click_onset_near(audio, int(at)) - int(at) for at in ideal]


def test_clap_build_plays_the_engines_loop_on_the_hosts_bar_lines(plugin_engine, tmp_path):
    audio = clap_render(tmp_path)
    assert audio.size >= BARS * BAR_FRAMES
    ideal = np.round(np.arange(BARS) * BAR_FRAMES).astype(int)
    errors = click_errors(audio, ideal)
    assert max(map(abs, errors)) <= 1, f"clicks against the host's bar lines (samples): {errors}"
    assert np.sqrt(np.mean(audio**2)) > 1e-2, "the loop plays"


def stop_frames() -> tuple[int, int]:
    """(the output frame the host stopped at, the one it played on from): whole blocks, as clap_render stops."""
    stop_at = math.ceil(STOP_AT * BAR_FRAMES)
    stopped = BLOCK * math.ceil(stop_at / BLOCK)
    return stopped, stopped + BLOCK * math.ceil(math.ceil(STOP_BARS * BAR_FRAMES) / BLOCK)


def clicks_after_play(stopped: int, resumed: int, audio_frames: int) -> list[int]:
    """The host's bar lines once it plays on from where it stopped, as output frames."""
    bars = range(STOP_AT + 1, BARS)
    return [
        resumed + round(bar * BAR_FRAMES) - stopped
        for bar in bars
        if resumed + bar * BAR_FRAMES - stopped < audio_frames - 2000
    ]


def test_clap_free_run_plays_on_through_the_hosts_stop_and_snaps_back_to_its_bars_at_play(plugin_engine, tmp_path):
    audio = clap_render(tmp_path, "on_stop=1", f"stop={STOP_AT}:{STOP_BARS}")
    stopped, resumed = stop_frames()
    through_stop = audio[stopped + BLOCK : resumed]
    assert np.sqrt(np.mean(through_stop**2)) > 1e-2, "the loop plays on while the host stands"
    own_clock = [round(bar * BAR_FRAMES) for bar in range(STOP_AT + 1, BARS) if stopped < bar * BAR_FRAMES < resumed]
    assert own_clock, "the stop spans a bar line of the loop's own clock"
    errors = click_errors(audio, own_clock)
    assert max(map(abs, errors)) <= 1, f"clicks through the stop against the loop's own bar lines: {errors}"
    host_bars = clicks_after_play(stopped, resumed, audio.size)
    errors = click_errors(audio, host_bars)
    assert max(map(abs, errors)) <= 1, f"clicks after play against the host's bar lines (samples): {errors}"
    free_running = round(math.ceil(resumed / BAR_FRAMES) * BAR_FRAMES)  # where the loop's own clock would click next
    assert min(abs(free_running - at) for at in host_bars) > BAR_FRAMES / 4, "the test tells the two clocks apart"


def test_clap_fade_on_stop_is_silent_through_the_stop_and_plays_on_the_hosts_bars_again(plugin_engine, tmp_path):
    audio = clap_render(tmp_path, "on_stop=0", f"stop={STOP_AT}:{STOP_BARS}")
    stopped, resumed = stop_frames()
    assert np.abs(audio[stopped - BLOCK : stopped]).max() > 0, "the loop played up to the stop"
    assert not audio[stopped + BLOCK : resumed].any(), "the host's stop fades the loop out within a block"
    errors = click_errors(audio, clicks_after_play(stopped, resumed, audio.size))
    assert max(map(abs, errors)) <= 1, f"clicks after play against the host's bar lines (samples): {errors}"

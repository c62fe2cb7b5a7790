"""The CLAP build in a minimal CLAP host (plugin/tools/clap_render.cpp: no CLAP host installs here) with `flowjam live
--plugin` running on the tiny preset: it loads, connects to the engine's session and plays 8 bars at 123 BPM from the
host's transport with every click within one sample of the ideal bar line."""

import os
import subprocess

import numpy as np
from daw_host import BAR_FRAMES, SESSION, click_onset_near
from plugin_build import build

BARS = 8


def test_clap_build_plays_the_engines_loop_on_the_hosts_bar_lines(plugin_engine, tmp_path):
    folder = build()
    rendered = tmp_path / "out.f32"
    subprocess.run(
        [str(folder / "clap_render"), str(folder / "flowjam.clap"), str(rendered), "123", str(BARS)],
        check=True,
        env={**os.environ, "FLOWJAM_SESSION": SESSION},
        timeout=60,
    )
    audio = np.fromfile(rendered, np.float32).reshape(-1, 2)[:, 0]
    assert audio.size >= BARS * BAR_FRAMES
    ideal = np.round(np.arange(BARS) * BAR_FRAMES).astype(int)
    errors = [click_onset_near(audio, int(at)) - int(at) for at in ideal]
    assert max(map(abs, errors)) <= 1, f"clicks against the host's bar lines (samples): {errors}"
    assert np.sqrt(np.mean(audio**2)) > 1e-2, "the loop plays"

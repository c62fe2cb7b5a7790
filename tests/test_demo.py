"""`python -m flowjam demo`: a scripted stream on the tiny preset, stitched into a WAV of the requested length."""

import subprocess
import sys

import torch
from flowjam.engine.audio.files import read_audio
from flowjam.engine.audio.stitch import append_with_overlap, equal_power_ramps
from flowjam.engine.demo import knob_script


def test_demo_cli_streams_the_requested_seconds_and_prints_tick_stats(tmp_path):
    out = tmp_path / "demo.wav"
    result = subprocess.run(
        [sys.executable, "-m", "flowjam", "demo", "--seconds", "6", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    tick_lines = [line for line in result.stdout.splitlines() if line.startswith("tick ")]
    assert len(tick_lines) == 7 + 15, (
        "expected 7 ticks before the first latent (8 steps), then one 0.4 s window per tick"
    )
    assert "velocity wave" in result.stdout and "blend 1.00" in result.stdout
    audio, rate = read_audio(out)
    assert rate == 48_000 and audio.shape == (2, 6 * 48_000)
    assert audio[:, 48_000:].std(dim=-1).min() > 1e-3


def test_knob_script_sweeps_denoise_blend_and_the_shared_curve():
    start, middle, end = knob_script(0.0), knob_script(0.5), knob_script(0.99)
    assert start[0] < middle[0] and start[1] == 0.0 and end[1] == 1.0
    assert not start[2] and middle[2] and not end[2]


def test_equal_power_crossfades_keep_constant_power_and_join_seamlessly():
    fade_out, fade_in = equal_power_ramps(64)
    torch.testing.assert_close(fade_out**2 + fade_in**2, torch.ones(64))
    ones = torch.ones(2, 100)
    joined = append_with_overlap(ones, ones, 10)
    assert joined.shape == (2, 190)

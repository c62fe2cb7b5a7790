"""Offline generation on the tiny preset: real WAV files, determinism by seed, covers from an input WAV or FLAC."""

import hashlib
import math
import subprocess
import sys

import numpy as np
import pytest
import soundfile
import torch
from flowjam.engine.audio.files import read_audio, write_wav
from flowjam.engine.render import RenderRequest, render


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_render_cli_writes_a_48k_stereo_wav_of_the_requested_length(tmp_path):
    out = tmp_path / "x.wav"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "flowjam",
            "render",
            "--prompt",
            "ambient pads, slow",
            "--seconds",
            "3.5",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "8/8" in result.stderr  # the progress bar reached the last step
    audio, rate = read_audio(out)
    assert rate == 48_000 and audio.shape == (2, 168_000)
    assert torch.isfinite(audio).all() and audio.abs().max() <= 1.0
    assert audio.std(dim=-1).min() > 1e-4, "rendered audio is silent"


def test_same_seed_same_file_different_seed_different_file(session, tmp_path):
    paths = [
        render(session, RenderRequest("lofi beat", 2.0, tmp_path / f"{name}.wav", seed=seed))
        for name, seed in (("a", 7), ("b", 7), ("c", 8))
    ]
    assert digest(paths[0]) == digest(paths[1])
    assert digest(paths[0]) != digest(paths[2])


def test_prompt_changes_the_output(session, tmp_path):
    a = render(session, RenderRequest("dark techno", 2.0, tmp_path / "a.wav", seed=1))
    b = render(session, RenderRequest("bright folk guitar", 2.0, tmp_path / "b.wav", seed=1))
    assert digest(a) != digest(b)


def test_cover_of_a_mono_44k_wav_follows_denoise(session, tmp_path):
    t = torch.arange(44_100 * 3) / 44_100
    source_path = write_wav(tmp_path / "src.wav", (0.5 * torch.sin(2 * math.pi * 220 * t))[None], 44_100)
    audio, rate = read_audio(source_path)
    source = session.prepare_source(audio, rate)
    assert source.latents.shape == (1, 75, 64) and source.hints.shape == (1, 75, 64)
    assert source.codes.shape == (1, 15) and int(source.codes.max()) < 64_000
    cond = session.encode_text("cover it", task="cover")
    light = session.generate(cond, seed=0, denoise=0.2, source=source)
    heavy = session.generate(cond, seed=0, denoise=1.0, source=source)
    assert light.shape == heavy.shape == (1, 75, 64)

    def distance(x):
        return (x - source.latents).pow(2).mean().item()

    assert distance(light) < distance(heavy), "a low denoise should stay closer to the source latents"
    out = render(session, RenderRequest("cover it", 4.0, tmp_path / "cover.wav", cover=source_path, denoise=0.5))
    rendered, rate = read_audio(out)
    assert rate == 48_000 and rendered.shape == (2, 192_000)


def test_a_flac_cover_renders_the_same_file_as_the_wav_of_the_song(session, tmp_path):
    t = np.arange(44_100 * 3) / 44_100
    song = np.round(np.stack([np.sin(2 * np.pi * 220 * t), np.sin(2 * np.pi * 330 * t)], axis=1) * 0.4 * 32767)
    rendered = []
    for kind in ("wav", "flac"):
        soundfile.write(tmp_path / f"song.{kind}", song.astype(np.int16), 44_100)
        out, cover = tmp_path / f"from-{kind}.wav", tmp_path / f"song.{kind}"
        rendered.append(digest(render(session, RenderRequest("cover it", 2.0, out, cover=cover, denoise=0.5))))
    assert rendered[0] == rendered[1], "the same song as FLAC and as WAV gave different covers"


def test_bad_requests_are_rejected_before_any_work(session, tmp_path):
    with pytest.raises(ValueError, match="seconds must be a finite number > 0"):
        render(session, RenderRequest("x", 0.0, tmp_path / "x.wav"))
    with pytest.raises(ValueError, match="needs --cover"):
        render(session, RenderRequest("x", 2.0, tmp_path / "x.wav", denoise=0.5))
    with pytest.raises(ValueError, match="prompt is empty"):
        render(session, RenderRequest("  ", 2.0, tmp_path / "x.wav"))
    with pytest.raises(FileNotFoundError):
        render(session, RenderRequest("x", 2.0, tmp_path / "x.wav", cover=tmp_path / "missing.wav"))
    with pytest.raises(ValueError, match="channels"):
        session.prepare_source(torch.zeros(3, 48_000), 48_000)
    with pytest.raises(ValueError, match="NaN"):
        session.prepare_source(torch.full((2, 48_000), float("nan")), 48_000)
    assert not (tmp_path / "x.wav").exists()


@pytest.mark.parametrize(
    "changes, expected",
    [
        (dict(seconds=601.0), "at most 600 s"),
        (dict(seconds=1e-9), "shorter than one latent frame"),
        (dict(steps=1000), "steps must be in 1..200"),
        (dict(out="FOLDER"), "is a folder"),
        (dict(out="MISSING"), "does not exist"),
    ],
)
def test_lengths_steps_and_unwritable_outputs_are_refused_before_the_model_runs(changes, expected, tmp_path):
    out = {"FOLDER": tmp_path, "MISSING": tmp_path / "missing" / "x.wav"}.get(changes.get("out"), tmp_path / "x.wav")
    request = RenderRequest("ambient", **{"seconds": 2.0, **changes, "out": out})
    with pytest.raises(ValueError, match=expected):
        render(None, request)  # no session: validation must come before any use of one
    assert list(tmp_path.iterdir()) == []

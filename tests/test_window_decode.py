"""Windowed decodes through `WindowDecoder` (static tensors; CUDA-graph replays on a GPU) equal `Session.decode`."""

import pytest
import torch
from flowjam.engine.audio.window_decode import batch_rows, plan_window


@pytest.fixture(scope="module")
def latent(session, prompts):
    return session.generate(prompts[0], 4.0, seed=4)  # 100 frames


@pytest.mark.parametrize(
    "t_start, window_s, cyclic",
    [(0.0, 0.4, True), (1.0, 0.2, False), (3.9, 0.4, True), (3.9, 0.4, False), (0.1, 3.9, True), (2.0, 8.0, True)],
    ids=["loop start", "inside", "across the seam", "clamped at the end", "wraps twice", "longer than the loop"],
)
def test_window_decoder_equals_session_decode(session, latent, t_start, window_s, cyclic):
    decoder = session.window_decoder()
    expected = session.decode(latent, t_start=t_start, window_s=window_s, cyclic=cyclic)
    for _ in range(3):  # warm-up, (capture on a GPU), replay: every pass the same audio
        got = decoder(latent, t_start, window_s, margin_frames=12, cyclic=cyclic)
        assert torch.equal(got, expected)
    assert got.shape == (2, plan_window(100, t_start, window_s, 12, cyclic).keep * 1920)


def test_a_window_decode_returns_its_own_tensor(session, latent):
    decoder = session.window_decoder()
    first = decoder(latent, 0.0, 0.4, margin_frames=12)
    kept = first.clone()
    decoder(latent * 0.5, 0.0, 0.4, margin_frames=12)
    assert torch.equal(first, kept), "a later decode of the same shape must not overwrite an earlier result"


def test_plan_window_segments_cover_the_context_in_order():
    plan = plan_window(100, 3.9, 0.4, 12, cyclic=True)
    assert (plan.start, plan.keep, plan.left) == (97, 10, 12)
    assert plan.segments == ((85, 100), (0, 19)) and plan.input_frames == 34
    with pytest.raises(ValueError, match="window_s must be > 0"):
        plan_window(100, 0.0, 0.0, 12, cyclic=True)


def test_a_batch_of_windows_is_each_window_as_decoded_alone(session, latent, prompts):
    other = session.generate(prompts[1], 4.0, seed=9)
    latents, starts = [latent, other, latent * 0.5], [0.0, 3.9, 1.3]  # one across the seam
    decoder, alone = session.window_decoder(), session.window_decoder()
    expected = [alone(z, t, 0.4, margin_frames=12) for z, t in zip(latents, starts)]
    for _ in range(3):  # warm-up, (capture on a GPU), replay
        got = decoder.decode_many(latents, starts, 0.4, margin_frames=12)
        assert got.shape == (3, 2, 10 * 1920)
        for row, want in enumerate(expected):
            assert torch.allclose(got[row], want, atol=1e-5, rtol=1e-4), f"row {row} is not its own window"
    assert not torch.allclose(got[0], got[1], atol=1e-3), "the rows decoded the same window"
    assert batch_rows(3) == 4 and batch_rows(1) == 1 and batch_rows(8) == 8


def test_a_batch_of_windows_of_different_lengths_is_refused_with_its_fix(session, latent):
    with pytest.raises(ValueError, match="one length.*decode those apart"):
        session.window_decoder().decode_many([latent, latent[:, :5]], [0.0, 0.0], 0.4, margin_frames=12)

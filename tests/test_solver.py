"""Per-step solver math on tiny hand-made latents [B, T, C]: worked numbers, identities and per-frame curves."""

import math

import pytest
import torch
from flowjam.engine.sampling.solver import (
    apg,
    blend_velocities,
    blend_x0_target,
    blend_x0_target_scalar,
    cfg,
    cfg_rescale,
    dcw_correct,
    euler_step,
    haar_dwt,
    haar_idwt,
    inject_ode_noise,
    mask_post_blend,
    mask_pre_blend,
    noised,
    predict_x0,
    scale_velocity,
    sde_curve_step,
    step_range_active,
)


def frames(*values):
    """A [1, T, 1] latent (or per-frame curve) holding `values` along time."""
    return torch.tensor(values, dtype=torch.float64).view(1, -1, 1)


def latent(rows):
    """A [1, T, C] latent from a list of T frames of C channels."""
    return torch.tensor(rows, dtype=torch.float64).unsqueeze(0)


def close(actual, expected, atol=1e-9):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


def test_straight_path_steps_on_worked_numbers():
    x0, noise = frames(1.0), frames(3.0)
    x_t = noised(x0, noise, 0.25)
    close(x_t, frames(1.5))
    velocity = noise - x0
    close(predict_x0(x_t, velocity, 0.25), x0)
    close(euler_step(x_t, velocity, 0.25, 0.0), x0)
    close(noised(predict_x0(x_t, velocity, 0.25), frames(5.0), 0.5), frames(3.0))  # the SDE step: re-noise x0 to t'


def test_velocity_scale_per_frame_curve_scales_each_frame():
    velocity = torch.ones(2, 3, 4)
    scaled = scale_velocity(velocity, torch.tensor([0.0, 0.5, 2.0]))
    assert scaled.shape == (2, 3, 4)
    assert scaled[:, :, 0].tolist() == [[0.0, 0.5, 2.0]] * 2, "frame k must be scaled by curve[k]"
    close(scale_velocity(velocity, 0.5), torch.full((2, 3, 4), 0.5))


def test_ode_noise_injection_grows_with_t_next_per_row():
    x_next, noise = torch.ones(2, 1, 1), torch.full((2, 1, 1), 2.0)
    injected = inject_ode_noise(x_next, noise, 0.5, torch.tensor([0.25, 0.0]))
    assert injected.flatten().tolist() == [1.25, 1.0]


def test_sde_curve_step_one_is_the_plain_sde_step_and_zero_follows_source():
    torch.manual_seed(0)
    x_t, velocity, noise, source = (torch.randn(1, 5, 3) for _ in range(4))
    x0 = predict_x0(x_t, velocity, 0.8)
    assert torch.equal(sde_curve_step(x0, source, noise, 0.5, 1.0), noised(predict_x0(x_t, velocity, 0.8), noise, 0.5))
    assert torch.equal(sde_curve_step(x0, source, noise, 0.5, 0.0), noised(source, noise, 0.5))


def test_sde_curve_step_at_t_zero_mixes_x0_and_source_per_frame():
    x0, source, noise = frames(4.0, 4.0), frames(0.0, 0.0), frames(9.0, 9.0)
    close(sde_curve_step(x0, source, noise, 0.0, frames(1.0, 0.25)), frames(4.0, 1.0))


def test_cfg_scale_one_is_the_positive_velocity():
    v_pos, v_neg = frames(3.0, -1.0), frames(1.0, 1.0)
    close(cfg(v_pos, v_neg, 1.0), v_pos)
    close(cfg(v_pos, v_neg, 2.0), frames(5.0, -3.0))


def test_apg_without_a_difference_returns_v_pos():
    v_pos = torch.randn(2, 6, 4)
    guided, running = apg(v_pos, v_pos.clone(), 5.0, None)
    assert torch.equal(guided, v_pos)
    assert torch.equal(running, torch.zeros_like(v_pos))


def test_apg_keeps_only_the_part_orthogonal_to_v_pos_on_worked_numbers():
    v_pos = frames(1.0, 0.0)
    # d = (1, 1): parallel to v_pos over time is (1, 0), orthogonal (0, 1)
    guided, _ = apg(v_pos, frames(0.0, -1.0), 3.0, None)
    close(guided, frames(1.0, 2.0))
    guided, _ = apg(v_pos, frames(0.0, -1.0), 3.0, None, eta=0.5)
    close(guided, frames(2.0, 2.0))


def test_apg_guidance_is_orthogonal_to_v_pos_per_channel_over_time():
    torch.manual_seed(1)
    v_pos, v_neg = torch.randn(2, 16, 3, dtype=torch.float64), torch.randn(2, 16, 3, dtype=torch.float64)
    guided, _ = apg(v_pos, v_neg, 4.0, None, norm_threshold=100.0)
    dot = ((guided - v_pos) * v_pos).sum(dim=1)
    assert dot.abs().max() < 1e-10, f"guidance term not orthogonal to v_pos: {dot}"
    assert (guided - v_pos).abs().max() > 0.1


def test_apg_clips_the_difference_norm_over_time_but_keeps_the_raw_running_buffer():
    v_pos = frames(1.0, 0.0)
    # d = (30, 40), norm 50 -> clipped to (1.5, 2.0); with eta=1 and scale 2 the whole clipped d is added
    guided, running = apg(v_pos, frames(-29.0, -40.0), 2.0, None, eta=1.0)
    close(guided, frames(2.5, 2.0))
    close(running, frames(30.0, 40.0))
    assert (guided - v_pos).norm(dim=1).item() == pytest.approx(2.5)


def test_apg_momentum_accumulates_across_calls_and_accepts_a_curve():
    v_pos = frames(1.0, 0.0)
    _, running = apg(v_pos, frames(1.0, -1.0), 2.0, None)
    close(running, frames(0.0, 1.0))
    guided, running_2 = apg(v_pos, frames(1.0, -2.0), 2.0, running)
    close(running_2, frames(0.0, 1.25))  # 2 + (-0.75)*1
    close(guided, frames(1.0, 1.25))
    _, per_frame = apg(v_pos, frames(1.0, -2.0), 2.0, running, momentum=frames(0.0, -0.5))
    close(per_frame, frames(0.0, 1.5))


def test_apg_scale_per_frame_curve():
    v_pos = latent([[1.0, 0.0], [0.0, 1.0]])
    v_neg = latent([[1.0, -1.0], [-1.0, 1.0]])  # d = [[0, 1], [1, 0]], orthogonal to v_pos in each channel
    guided, _ = apg(v_pos, v_neg, frames(2.0, 3.0), None)
    close(guided, latent([[1.0, 1.0], [2.0, 1.0]]))


def test_cfg_rescale_matches_v_pos_norm_per_frame():
    velocity, v_pos = latent([[3.0, 4.0], [1.0, 0.0]]), latent([[0.0, 10.0], [0.0, 2.0]])
    close(cfg_rescale(velocity, v_pos, 1.0), latent([[6.0, 8.0], [2.0, 0.0]]), atol=1e-5)
    close(cfg_rescale(velocity, v_pos, 0.5), latent([[4.5, 6.0], [1.5, 0.0]]), atol=1e-5)
    assert torch.equal(cfg_rescale(velocity, v_pos, 0.0), velocity)
    close(cfg_rescale(velocity, v_pos, frames(1.0, 0.0)), latent([[6.0, 8.0], [1.0, 0.0]]), atol=1e-5)


def test_cfg_rescale_random_frames_take_v_pos_norms():
    torch.manual_seed(2)
    velocity, v_pos = torch.randn(2, 7, 5), torch.randn(2, 7, 5)
    rescaled = cfg_rescale(velocity, v_pos, 1.0)
    close(rescaled.norm(dim=-1), v_pos.norm(dim=-1), atol=1e-5)


def test_x0_target_gate_opens_after_its_fraction_of_steps():
    x0, target = frames(0.0, 0.0), frames(4.0, 4.0)
    assert blend_x0_target(x0, target, 1.0, 0.5, 0.5) is x0
    close(blend_x0_target(x0, target, 1.0, 0.75, 0.5), frames(2.0, 2.0))
    close(blend_x0_target(x0, target, 0.5, 1.0, 0.5), frames(2.0, 2.0))
    close(blend_x0_target(x0, target, frames(1.0, 0.25), 1.0, 0.0), frames(4.0, 1.0))
    with pytest.raises(ValueError, match="gate"):
        blend_x0_target(x0, target, 1.0, 1.0, 1.0)


def test_scalar_x0_target_blend():
    close(blend_x0_target_scalar(frames(0.0), frames(4.0), 0.25), frames(1.0))


def test_mask_blends_generate_at_one_and_keep_the_original_at_zero():
    x, original, noise = frames(5.0, 5.0), frames(1.0, 1.0), frames(3.0, 3.0)
    close(mask_pre_blend(x, 1.0, original, noise, 0.5), x)
    close(mask_pre_blend(x, 0.0, original, noise, 0.5), frames(2.0, 2.0))
    close(mask_pre_blend(x, torch.tensor([1.0, 0.0]), original, noise, 0.5), frames(5.0, 2.0))
    close(mask_post_blend(x, frames(1.0, 0.0), original), frames(5.0, 1.0))
    close(mask_post_blend(x, 0.5, original), frames(3.0, 3.0))


def test_blend_velocities_weighs_per_frame_and_falls_back_to_the_mean_at_zero_weight():
    a, b = frames(2.0, 2.0, 2.0), frames(6.0, 6.0, 6.0)
    close(blend_velocities([a, b], [None, None]), frames(4.0, 4.0, 4.0))
    close(blend_velocities([a, b], [3.0, 1.0]), frames(3.0, 3.0, 3.0))
    blended = blend_velocities([a, b], [torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 1.0, 0.0])])
    close(blended, frames(2.0, 6.0, 4.0))
    assert not blended.isnan().any()
    with pytest.raises(ValueError):
        blend_velocities([a, b], [None])


def test_step_range_is_half_open_on_progress():
    assert step_range_active(None, 7, 8)
    assert [step_range_active((0.0, 0.5), k, 8) for k in range(8)] == [True] * 4 + [False] * 4
    assert [step_range_active((0.5, 1.0), k, 8) for k in range(8)] == [False] * 4 + [True] * 4


@pytest.mark.parametrize("length", [1, 2, 5, 8])
def test_haar_round_trip_is_exact_for_odd_and_even_lengths(length):
    x = torch.randn(2, length, 3, dtype=torch.float64)
    low, high = haar_dwt(x)
    assert low.shape == high.shape == (2, math.ceil(length / 2), 3)
    close(haar_idwt(low, high, length), x, atol=1e-12)
    close(low.square().sum() + high.square().sum(), x.square().sum(), atol=1e-9)


def test_haar_worked_numbers_pad_an_odd_frame_with_zero():
    low, high = haar_dwt(frames(1.0, 3.0, 5.0))
    r = math.sqrt(2.0)
    close(low, frames(4.0 / r, 5.0 / r))
    close(high, frames(-2.0 / r, 5.0 / r))


@pytest.mark.parametrize("mode", ["low", "high", "double", "pix"])
def test_dcw_is_identity_with_zero_scales_or_when_x_next_equals_x0_hat(mode):
    torch.manual_seed(3)
    x_next, x0_hat = torch.randn(2, 5, 3), torch.randn(2, 5, 3)
    close(dcw_correct(x_next, x0_hat, 0.5, mode, 0.0, 0.0), x_next, atol=1e-6)
    close(dcw_correct(x_next, x_next.clone(), 0.5, mode, 0.3, 0.3), x_next, atol=1e-6)


def test_dcw_worked_numbers_per_mode():
    x_next, x0_hat = frames(1.0, 3.0), frames(0.0, 0.0)
    # bands of (1, 3): low 4/sqrt2, high -2/sqrt2; at t = 0.5 a scale of 0.1 grows a band by 5 %
    close(dcw_correct(x_next, x0_hat, 0.5, "low", 0.1, 0.7), frames(1.1, 3.1), atol=1e-6)
    close(dcw_correct(x_next, x0_hat, 0.5, "high", 0.7, 0.1), frames(0.95, 3.05), atol=1e-6)
    close(dcw_correct(x_next, x0_hat, 0.5, "double", 0.1, 0.1), frames(1.05, 3.15), atol=1e-6)
    close(dcw_correct(x_next, x0_hat, 0.5, "pix", 0.1, 0.7), frames(1.1, 3.3), atol=1e-6)  # no t factor


def test_dcw_low_mode_leaves_the_high_band_untouched():
    torch.manual_seed(4)
    x_next, x0_hat = torch.randn(1, 8, 4), torch.randn(1, 8, 4)
    corrected = dcw_correct(x_next, x0_hat, 0.9, "low", 0.5, 0.5)
    close(haar_dwt(corrected)[1], haar_dwt(x_next)[1], atol=1e-6)
    assert (haar_dwt(corrected)[0] - haar_dwt(x_next)[0]).abs().max() > 1e-3


def test_dcw_per_frame_scales_act_on_the_band_pairs_they_cover():
    torch.manual_seed(5)
    x_next, x0_hat = torch.randn(2, 5, 3), torch.randn(2, 5, 3)
    curve = torch.tensor([0.0, 0.0, 0.2, 0.2, 0.2]).view(1, 5, 1)
    corrected = dcw_correct(x_next, x0_hat, torch.tensor([0.3, 0.7]), "double", curve, curve)
    close(corrected[:, :2], x_next[:, :2], atol=1e-6)
    constant = dcw_correct(x_next, x0_hat, torch.tensor([0.3, 0.7]), "double", 0.2, 0.2)
    close(corrected[:, 2:], constant[:, 2:], atol=1e-6)
    pair_mean = dcw_correct(frames(1.0, 3.0), frames(0.0, 0.0), 0.5, "low", frames(0.0, 0.2), 0.0)
    close(pair_mean, frames(1.1, 3.1), atol=1e-6)  # the pair's scale is mean(0, 0.2) = 0.1


def test_dcw_unknown_mode_names_the_valid_ones():
    with pytest.raises(ValueError, match="double"):
        dcw_correct(frames(1.0), frames(1.0), 0.5, "wavelet", 0.05, 0.02)


def test_functions_keep_the_latent_dtype_and_leave_inputs_unchanged():
    torch.manual_seed(6)
    a, b, c = (torch.randn(1, 4, 2).to(torch.bfloat16) for _ in range(3))
    saved = [a.clone(), b.clone(), c.clone()]
    curve = torch.tensor([0.1, 0.2, 0.3, 0.4])
    outputs = [
        scale_velocity(a, curve),
        inject_ode_noise(a, b, curve, 0.5),
        sde_curve_step(a, b, c, 0.5, curve),
        cfg(a, b, curve),
        apg(a, b, curve, c, momentum=curve)[0],
        cfg_rescale(a, b, curve),
        blend_x0_target(a, b, curve, 1.0, 0.5),
        mask_pre_blend(a, curve, b, c, 0.5),
        mask_post_blend(a, curve, b),
        blend_velocities([a, b], [curve, None]),
        dcw_correct(a, b, 0.5, "double", curve, curve),
    ]
    assert all(out.dtype == torch.bfloat16 for out in outputs), [out.dtype for out in outputs]
    assert all(torch.equal(x, y) for x, y in zip((a, b, c), saved)), "an input was modified in place"

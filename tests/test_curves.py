"""Curves: normalisation to broadcastable shapes with clear errors, resampling, and the builders' values."""

import math

import pytest
import torch
from flowjam.engine.sampling.curves import as_curve, combine, constant, from_points, lerp, ramp, resample, wave


@pytest.mark.parametrize(
    "value, shape",
    [
        (0.5, (1, 1, 1)),
        (2, (1, 1, 1)),
        (torch.tensor(0.5), (1, 1, 1)),
        (torch.zeros(6), (1, 6, 1)),
        (torch.zeros(1, 6), (1, 6, 1)),
        (torch.zeros(3, 6), (3, 6, 1)),
        (torch.zeros(3, 6, 1), (3, 6, 1)),
        (torch.zeros(1), (1, 1, 1)),
    ],
)
def test_as_curve_shapes_broadcast_over_latents(value, shape):
    curve = as_curve(value, 6, "velocity_scale")
    assert curve.shape == shape
    assert (torch.ones(3, 6, 64) * curve).shape == (3, 6, 64)


def test_as_curve_keeps_float_dtype_and_promotes_numbers_to_float32():
    assert as_curve(0.5, 4, "c").dtype == torch.float32
    assert as_curve(torch.zeros(4, dtype=torch.float64), 4, "c").dtype == torch.float64
    assert as_curve(torch.tensor([1, 2, 3, 4]), 4, "c").dtype == torch.float32
    assert as_curve(0.25, 4, "c").item() == 0.25


def test_as_curve_wrong_length_names_curve_expected_and_got():
    with pytest.raises(ValueError) as raised:
        as_curve(torch.zeros(5), 1500, "sde_denoise_curve")
    message = str(raised.value)
    assert "sde_denoise_curve" in message and "1500" in message and "5" in message


@pytest.mark.parametrize(
    "value, needle",
    [
        (float("nan"), "contains NaN"),
        (torch.tensor([0.0, float("inf"), 0.0]), "contains NaN or inf"),
        (True, "bool"),
        ("0.5", "str"),
        ([0.1, 0.2, 0.3], "list"),
        (torch.zeros(1, 3, 2), "shape"),
        (torch.tensor([True, False, True]), "dtype"),
    ],
)
def test_as_curve_rejects_bad_values_with_the_curve_name(value, needle):
    with pytest.raises(ValueError, match=needle) as raised:
        as_curve(value, 3, "guidance_curve")
    assert "guidance_curve" in str(raised.value)


def test_resample_keeps_endpoints_and_interpolates_linearly():
    assert resample([0.0, 1.0], 5).tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert resample([0.0, 2.0, 4.0], 5).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert resample([7.0], 3).tolist() == [7.0, 7.0, 7.0]
    long = resample(torch.rand(1000), 37)
    assert len(long) == 37
    odd = [0.1, 0.7, 0.3, 0.9]
    squeezed = resample(odd, 1500)
    assert squeezed[0].item() == pytest.approx(0.1) and squeezed[-1].item() == pytest.approx(0.9)
    assert squeezed.dtype == torch.float32


def test_constant_and_ramp_lengths_and_endpoints():
    assert constant(0.3, 4).tolist() == pytest.approx([0.3] * 4)
    values = ramp(0.2, 0.9, 1500)
    assert len(values) == 1500 and values[0].item() == pytest.approx(0.2) and values[-1].item() == pytest.approx(0.9)
    assert ramp(1.0, 2.0, 1).tolist() == [1.0]


@pytest.mark.parametrize(
    "build", [lambda: constant(1.0, 0), lambda: ramp(0, 1, -3), lambda: wave(0), lambda: resample([1.0], 0)]
)
def test_builders_reject_fewer_than_one_frame(build):
    with pytest.raises(ValueError, match="frames"):
        build()


def test_sine_starts_at_the_middle_rising_and_spans_low_to_high():
    values = wave(8, "sine", low=0.2, high=1.0)
    assert values.tolist() == pytest.approx(
        [
            0.6,
            0.6 + 0.4 * math.sqrt(0.5),
            1.0,
            0.6 + 0.4 * math.sqrt(0.5),
            0.6,
            0.6 - 0.4 * math.sqrt(0.5),
            0.2,
            0.6 - 0.4 * math.sqrt(0.5),
        ],
        abs=1e-6,
    )
    assert wave(4, "sine", phase=0.25).tolist() == pytest.approx([1.0, 0.5, 0.0, 0.5], abs=1e-6)


def test_other_wave_kinds_on_worked_numbers():
    assert wave(4, "square").tolist() == [1.0, 1.0, 0.0, 0.0]
    assert wave(8, "pulse", duty=0.25).tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert wave(4, "triangle").tolist() == [0.0, 0.5, 1.0, 0.5]
    assert wave(4, "saw", low=-1.0, high=1.0).tolist() == [-1.0, -0.5, 0.0, 0.5]
    assert wave(8, "square", cycles=2.0).tolist() == [1.0, 1.0, 0.0, 0.0] * 2
    assert wave(8, "saw", cycles=2.0).tolist() == [0.0, 0.25, 0.5, 0.75] * 2


def test_unknown_wave_kind_lists_the_valid_kinds():
    with pytest.raises(ValueError, match="triangle"):
        wave(10, "noise")


def test_from_points_y_values_and_xy_pairs():
    assert from_points([0.0, 1.0, 0.0], 5).tolist() == [0.0, 0.5, 1.0, 0.5, 0.0]
    assert from_points([(1.0, 0.0), (0.0, 1.0)], 3).tolist() == [1.0, 0.5, 0.0], "pairs must be sorted by x"
    held = from_points([(0.25, 2.0), (0.75, 4.0)], 5)
    assert held.tolist() == [2.0, 2.0, 3.0, 4.0, 4.0], "values outside the points must hold the end y"
    assert from_points([(0.5, 3.0)], 3).tolist() == [3.0, 3.0, 3.0]
    with pytest.raises(ValueError, match="pairs"):
        from_points([(0.0, 1.0, 2.0)], 3)


def test_combine_and_lerp():
    a, b = torch.tensor([1.0, 4.0]), torch.tensor([3.0, 2.0])
    assert combine(a, b, "add").tolist() == [4.0, 6.0]
    assert combine(a, b, "subtract").tolist() == [-2.0, 2.0]
    assert combine(a, b, "multiply").tolist() == [3.0, 8.0]
    assert combine(a, b, "min").tolist() == [1.0, 2.0]
    assert combine(a, b, "max").tolist() == [3.0, 4.0]
    assert combine(a, 2.0, "multiply").tolist() == [2.0, 8.0]
    assert lerp(a, b, 0.5).tolist() == [2.0, 3.0]
    assert lerp(a, b, torch.tensor([0.0, 1.0])).tolist() == [1.0, 2.0]


def test_combine_errors_say_how_to_fix():
    with pytest.raises(ValueError, match="resample"):
        combine(torch.zeros(3), torch.zeros(4), "add")
    with pytest.raises(ValueError, match="lerp"):
        combine(torch.zeros(3), torch.zeros(3), "divide")

"""Timestep schedules equal the spec's worked values (turbo shift 3; denoise 0.5 / 0.75; shift 3.5)."""

import pytest
from flowjam.engine.sampling.schedule import timestep_schedule


def rounded(values, places=4):
    return [round(v, places) for v in values]


def test_turbo_shift3_full_denoise():
    assert rounded(timestep_schedule(8, 3.0, 1.0)) == [1.0, 0.9545, 0.9, 0.8333, 0.75, 0.6429, 0.5, 0.3, 0.0]


def test_shift_3_5():
    assert rounded(timestep_schedule(8, 3.5, 1.0)) == [1.0, 0.9608, 0.913, 0.8537, 0.7778, 0.6774, 0.5385, 0.3333, 0.0]


def test_denoise_half_keeps_the_tail_then_shifts():
    assert rounded(timestep_schedule(8, 3.0, 0.5)) == [0.75, 0.7, 0.6429, 0.5769, 0.5, 0.4091, 0.3, 0.1667, 0.0]


def test_denoise_three_quarters_starts_at_0_9231():
    schedule = timestep_schedule(8, 3.0, 0.75)
    assert len(schedule) == 9 and round(schedule[0], 4) == 0.9231 and schedule[-1] == 0.0
    assert all(a > b for a, b in zip(schedule, schedule[1:]))


def test_unshifted_turbo_grid_and_near_zero_denoise():
    assert rounded(timestep_schedule(8, 1.0, 1.0)) == [1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125, 0.0]
    assert timestep_schedule(8, 3.0, 1e-9) == (0.0, 0.0)


def test_schedule_cache_is_bounded():
    for i in range(1000):
        timestep_schedule(8, 3.0, 0.3 + i * 1e-4)
    assert timestep_schedule.cache_info().currsize <= timestep_schedule.cache_info().maxsize


@pytest.mark.parametrize("steps, shift, denoise", [(0, 3.0, 1.0), (8, 0.0, 1.0), (8, 3.0, 1.5), (8, 3.0, -0.1)])
def test_out_of_range_arguments_raise(steps, shift, denoise):
    with pytest.raises(ValueError):
        timestep_schedule(steps, shift, denoise)

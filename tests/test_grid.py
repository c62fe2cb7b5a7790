"""The band's grid (live/sync/grid.py): loops of whole bars in samples, bar.beat of a position, and how far the
playhead is from where a clock's beat puts it."""

import pytest
from flowjam.live.sync.grid import Grid, loop_phase_error

RATE = 48_000


def test_a_loop_of_whole_bars_in_samples():
    assert Grid(120.0, 4).loop_samples(2, RATE) == 4 * RATE  # 8 beats of 0.5 s
    assert Grid(123.0, 3).loop_samples(4, RATE) == round(12 * 60 / 123 * RATE)  # not a whole number of latent frames
    with pytest.raises(ValueError, match="bars must be a whole number"):
        Grid(120.0).loop_samples(0, RATE)


def test_bar_and_beat_count_from_one_at_the_loops_start():
    grid = Grid(120.0, 3)
    assert grid.bar_beat(0, RATE) == (1, 1, 0.0)
    assert grid.bar_beat(RATE * 0.5 * 4 + RATE * 0.25, RATE) == (2, 2, pytest.approx(0.5))


@pytest.mark.parametrize(
    ("bpm", "beats_per_bar", "message"),
    [
        (20.0, 4, "bpm must be a number in 30..300"),
        (float("nan"), 4, "bpm must"),
        (120.0, 5, "numerator must be one of"),
    ],
)
def test_a_grid_outside_what_the_model_knows_is_refused(bpm, beats_per_bar, message):
    with pytest.raises(ValueError, match=message):
        Grid(bpm, beats_per_bar)


def test_the_phase_error_is_the_shortest_way_round_the_loop():
    grid = Grid(120.0, 4)
    loop = grid.loop_samples(2, RATE)  # 8 beats
    assert loop_phase_error(0, loop, 8.0, grid, RATE) == 0  # the clock's bar line at the loop's start
    assert loop_phase_error(240, loop, 0.0, grid, RATE) == 240  # 5 ms ahead
    assert loop_phase_error(loop - 240, loop, 16.0, grid, RATE) == -240  # 5 ms behind, across the seam
    assert loop_phase_error(RATE, loop, 2.0, grid, RATE) == 0  # beat 3 of bar 1

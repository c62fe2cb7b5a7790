"""The band's grid (live/sync/grid.py): loops of whole bars in samples, bar.beat of a position, and how far the
playhead is from where a clock's beat puts it."""

import pytest
from flowjam.live.sync.grid import Grid, phase_error

RATE = 48_000


def test_a_loop_of_whole_bars_in_samples():
    assert Grid(120.0, 4).loop_samples(2, RATE) == 4 * RATE  # 8 beats of 0.5 s
    assert Grid(123.0, 3).loop_samples(4, RATE) == round(12 * 60 / 123 * RATE)  # not a whole number of latent frames
    with pytest.raises(ValueError, match="bars must be a whole number"):
        Grid(120.0).loop_samples(0, RATE)


def test_a_loop_longer_than_the_model_generates_names_the_most_bars_that_fit():
    """The CLI's --bars and a served session's bars share this check: the length in seconds, the limit in bars."""
    grid = Grid(123.0, 4)
    assert grid.loop_of_bars(307, RATE, "--bars") == grid.loop_samples(307, RATE) <= 600 * RATE
    with pytest.raises(ValueError) as error:
        grid.loop_of_bars(600, RATE, "--bars")
    assert str(error.value) == (
        "--bars 600 at 123 BPM, 4 beats a bar, is a loop of 1170.73 s, longer than ACE-Step 1.5 generates (at most "
        "600 s); use --bars 307 or less"
    )
    with pytest.raises(ValueError, match="use bars 1230 or less"):  # 1230 bars of 2 beats at 246 BPM: 600 s
        Grid(246.0, 2).loop_of_bars(1231, RATE, "bars")
    assert Grid(120.0, 4).loop_of_bars(300, RATE) == 600 * RATE  # exactly 10 minutes fits


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
    assert phase_error(0, loop, 8.0, 8) == 0  # the clock's bar line at the loop's start
    assert phase_error(240, loop, 0.0, 8) == 240  # 5 ms ahead
    assert phase_error(loop - 240, loop, 16.0, 8) == -240  # 5 ms behind, across the seam
    assert phase_error(RATE, loop, 2.0, 8) == 0  # beat 3 of bar 1


def test_a_loop_rounded_to_the_sample_does_not_drift_against_the_clock():
    grid = Grid(123.0, 4)
    loop = grid.loop_samples(1, RATE)  # 93,658.5 samples, rounded
    assert loop != grid.bar_samples(RATE)
    for laps in (1, 1_000, 100_000):  # the clock's bar 1 of lap after lap is the loop's frame 0
        assert phase_error(0, loop, 4.0 * laps, 4) == 0
        assert phase_error(loop // 2, loop, 4.0 * laps + 2.0, 4) == pytest.approx(loop // 2 - loop / 2)


def test_endless_play_locks_the_phase_within_a_bar():
    grid = Grid(120.0, 4)
    bar = grid.bar_samples(RATE)
    song = 1000 * bar + 480  # far into the song: only the bar phase counts
    assert phase_error(song, bar, 37 * 4.0, 4) == pytest.approx(480)

"""`bench sync`'s account of a bar without a click: whether its click came but too far off, or never came, the late
block nearest it and what the lock, the clock and the band's recorder did within a bar of it, found in a recording
the way the bench finds them."""

import numpy as np
from flowjam.live.renderer import click_wave
from flowjam.live.sync_bench import RATE, _far_bars, _missed_bars

BAR = 2 * RATE  # a 2-second bar


def recording(offsets: dict[int, float | None], bars: int = 8) -> np.ndarray:
    """Clicks on every bar line of `bars`, bar i's `offsets[i]` seconds off its line (None: no click)."""
    click = click_wave(RATE)[:, 0]
    audio = np.zeros((bars + 1) * BAR, dtype=np.float32)
    for bar in range(bars):
        offset = offsets.get(bar, 0.0)
        if offset is not None:
            at = bar * BAR + round(offset * RATE)
            audio[at : at + click.shape[0]] += click
    return audio


def test_a_missed_bar_tells_a_click_pushed_off_from_one_never_played_and_names_the_late_block_near_it():
    audio = recording({3: 0.120, 5: None})
    bar_frames = np.arange(8) * BAR + 1_000.0  # JACK frames; the recording starts at frame 1,000
    heard = np.array([0, 1, 2, 4, 6, 7])
    events = [(4.5, "corrections 3"), (9.2, "the band's recorder missed 512 frames"), (13.0, "starts 2")]
    missed = _missed_bars(audio, 1_000, bar_frames, heard, late_s=[5.9, 9.5], events=events)
    assert [bar.index for bar in missed] == [3, 5]
    pushed, dropped = missed
    assert pushed.at_s == 6.0 and abs(pushed.click_offset_ms - 120.0) < 0.1
    assert abs(pushed.late_block_s - (-0.1)) < 1e-9
    assert dropped.at_s == 10.0 and dropped.click_offset_ms is None and abs(dropped.late_block_s - (-0.5)) < 1e-9
    assert pushed.nearby == ("-1.500 s corrections 3",), "what the lock and the band did within a bar of it"
    assert dropped.nearby == ("-0.800 s the band's recorder missed 512 frames",)
    assert _missed_bars(audio, 1_000, bar_frames, np.arange(8), late_s=[], events=events) == []


def test_a_bar_heard_more_than_5_ms_off_is_named_with_what_was_near_it():
    bar_frames = np.arange(8) * BAR + 1_000.0
    errors = np.array([0.0, 0.2, 10.56, -0.1, np.nan, -6.0, 4.9, 0.0]) / 1000.0 * RATE  # frames from each line
    heard = np.flatnonzero(~np.isnan(errors))
    events = [(3.9, "corrections 4"), (7.0, "starts 2")]
    far = _far_bars(errors, 1_000, bar_frames, heard, late_s=[3.88], events=events)
    assert [(bar.index, round(bar.error_ms, 2)) for bar in far] == [(2, 10.56), (5, -6.0)], "4.9 ms is within 5 ms"
    assert far[0].at_s == 4.0 and abs(far[0].late_block_s - (-0.12)) < 1e-9
    assert far[0].nearby == ("-0.100 s corrections 4",) and far[1].nearby == ()

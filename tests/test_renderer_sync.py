"""What the audio callback does for a followed clock, through the real callback body on a real loop buffer: a phase
correction crossfades from the old position to the new one, a start on a given frame begins exactly there, the
metronome clicks on every bar start of the loop position, a new tempo's loop in the other region takes over on its
block, and a loop of whole bars that is not whole latent frames is spliced at its seam."""

import numpy as np
import pytest
import torch
from flowjam.live.loop_buffer import LoopBuffer
from flowjam.live.loop_map import LoopMap
from flowjam.live.renderer import BlockRenderer, click_wave

SR = 48_000
BLOCK = 512


def ramp_loop(frames: int, regions: int = 1, loop_frames: int | None = None) -> LoopBuffer:
    """A loop whose every frame holds its own index / frames (so a read position shows in the audio)."""
    buffer = LoopBuffer(frames, 2, SR, regions=regions, loop_frames=loop_frames)
    length = buffer.frames
    buffer.fill(np.broadcast_to(np.arange(length, dtype=np.float32) / length, (2, length)))
    return buffer


def render(renderer: BlockRenderer, blocks: int = 1) -> np.ndarray:
    out = np.empty((BLOCK, 2), np.float32)
    played = []
    for _ in range(blocks):
        renderer.render(out, BLOCK)
        played.append(out[:, 0].copy())
    return np.concatenate(played)


def test_a_phase_correction_crossfades_over_one_block_then_reads_the_new_position():
    buffer = ramp_loop(SR)
    try:
        renderer = BlockRenderer(buffer, BLOCK, None)
        render(renderer)
        buffer.shift = 300
        moved = render(renderer)
        old = (BLOCK + np.arange(BLOCK)) / SR
        new = (BLOCK + 300 + np.arange(BLOCK)) / SR
        assert moved[0] == pytest.approx(old[0], abs=1e-4) and moved[-1] == pytest.approx(new[-1], abs=1e-4)
        assert np.all((moved >= old - 1e-6) & (moved <= new + 1e-6)), "a crossfade lies between the two positions"
        after = render(renderer)
        np.testing.assert_allclose(after, (2 * BLOCK + 300 + np.arange(BLOCK)) / SR, atol=1e-6)
        assert buffer.playhead_frames == 3 * BLOCK + 300 and buffer.played_frames == 3 * BLOCK
    finally:
        buffer.unlink()


def test_a_start_on_a_given_frame_begins_exactly_there():
    buffer = ramp_loop(SR)
    try:
        buffer.playing = False
        renderer = BlockRenderer(buffer, BLOCK, None)
        render(renderer)  # the stop's 10 ms fade
        assert not render(renderer).any()
        buffer.start_at(2 * BLOCK + 300)
        block = render(renderer)
        assert not block[:300].any() and block[300] > 0
        np.testing.assert_allclose(block[340:], (2 * BLOCK + 340 + np.arange(BLOCK - 340)) / SR, atol=1e-6)
        assert buffer.playing and buffer.fade_started_frames == 2 * BLOCK + 300
    finally:
        buffer.unlink()


def test_the_metronome_clicks_on_every_bar_start_of_the_loop_even_across_blocks_and_the_seam():
    bar = 4 * 60 / 123 * SR  # 93,658.5 frames: bar starts are rounded to the frame
    buffer = LoopBuffer(round(2 * bar), 2, SR)
    try:
        buffer.gain = 0.0  # the loop silent: only the clicks are heard
        buffer.set_click(bar)
        renderer = BlockRenderer(buffer, BLOCK, None)
        heard = render(renderer, 3 * round(2 * bar) // BLOCK)
        click = click_wave(SR)[:, 0]
        onsets = np.flatnonzero((heard[1:] != 0) & (heard[:-1] == 0)) + 1
        expected = [lap * round(2 * bar) + round(k * bar) for lap in range(3) for k in range(2)]
        assert [0, *onsets.tolist()][: len(expected)] == expected
        np.testing.assert_allclose(heard[expected[1] : expected[1] + click.shape[0]], click, atol=1e-6)
        buffer.set_click(0.0)
        assert not render(renderer, 200).any()
    finally:
        buffer.unlink()


@pytest.mark.parametrize("moved", [300, -300])
def test_a_phase_correction_across_a_bar_start_still_clicks_it_once(moved):
    """The phase lock moves the loop position between two blocks. A bar start it jumps over still clicks, at the start
    of the block after the jump (as late as the jump: here 300 frames, 6 ms); one it moves back over, clicked already,
    does not click again. Before, the first was never heard: under a jittery MIDI clock `bench sync` found bars
    without a click and no late block near them."""
    bar = 4 * 60 / 120 * SR  # 96,000 frames: bar 2's start is at offset 256 of block 187
    buffer = LoopBuffer(round(2 * bar), 2, SR)
    try:
        buffer.gain = 0.0  # the loop silent: only the clicks are heard
        buffer.set_click(bar)
        renderer = BlockRenderer(buffer, BLOCK, None)
        heard = [render(renderer, 187 if moved > 0 else 188)]
        buffer.shift = moved
        heard.append(render(renderer, 12))
        heard = np.concatenate(heard)
        click = click_wave(SR)[:, 0]
        at = 187 * BLOCK if moved > 0 else 96_000
        expected = np.zeros_like(heard)
        expected[: click.shape[0]] = click  # the loop's start
        expected[at : at + click.shape[0]] = click
        np.testing.assert_allclose(heard, expected, atol=1e-6)
    finally:
        buffer.unlink()


def test_a_new_tempos_loop_in_the_other_region_takes_over_on_its_block_with_its_click():
    buffer = LoopBuffer(SR, 2, SR, regions=2, loop_frames=SR // 2)
    try:
        buffer.fill(np.full((2, SR // 2), 0.25, np.float32))
        renderer = BlockRenderer(buffer, BLOCK, None)
        render(renderer, 4)
        buffer.prepare(1, 30_000, shift=-4 * BLOCK)  # its bar 1 at the frame played 4 blocks ahead
        buffer.region(1).fill(np.full((2, 30_000), 0.75, np.float32))
        buffer.switch_at(6 * BLOCK + 100, 1, click_bar=15_000.0)
        assert np.allclose(render(renderer, 2), 0.25) and buffer.active == 0
        switching = render(renderer)
        assert switching[0] == pytest.approx(0.25, abs=1e-3) and switching[-1] == pytest.approx(0.75, abs=1e-2)
        assert buffer.active == 1 and not buffer.switch_pending
        assert buffer.frames == 30_000 and buffer.position == 7 * BLOCK - 4 * BLOCK
        after = render(renderer, 60)
        onsets = np.flatnonzero(np.abs(after - 0.75) > 1e-3)
        assert onsets[0] == 15_000 - 3 * BLOCK, "the new loop's click, on its bar 2"
        with pytest.raises(ValueError, match="is playing"):
            buffer.prepare(1, 1000, 0)
    finally:
        buffer.unlink()


def test_a_loop_of_whole_bars_on_whole_latent_frames_is_spliced_at_its_seam():
    hop = 1920
    loop = LoopMap(round(4 * 60 / 123 * SR), hop)  # one bar at 123 BPM: 93,659 samples, 48.8 frames
    assert loop.frames == 49 and loop.skip == 49 * hop - loop.samples
    decoded = torch.arange(49 * hop, dtype=torch.float32)[None].repeat(2, 1)  # each sample: its latent sample
    cyclic = torch.cat([decoded, decoded], dim=1)
    start = loop.samples - 1000
    spliced = loop.splice(cyclic[:, start : start + 4000], start, fade=0)
    assert spliced.shape[1] == 4000 - loop.skip
    assert spliced[0, 999].item() == loop.samples - 1 and spliced[0, 1000].item() == 0, "on to the latent's frame 0"
    faded = loop.splice(cyclic[:, start : start + 4000], start, fade=480)
    assert faded[0, 1000].item() == 0 and faded[0, 1000 - 481].item() == loop.samples - 481
    assert loop.latent_sample(loop.samples + 5) == 49 * hop + 5
    whole = loop.loop_audio(decoded, fade=480)
    assert whole.shape[1] == loop.samples and whole[0, -1].item() > loop.samples, "the seam eases into the latent's end"
    exact = LoopMap(8 * SR, hop)
    assert exact.skip == 0 and torch.equal(exact.splice(cyclic[:, :4000], 8 * SR - 10, 480), cyclic[:, :4000])


def test_blocks_the_device_lost_are_made_up_so_the_loop_keeps_time():
    buffer = ramp_loop(SR)
    try:
        renderer = BlockRenderer(buffer, BLOCK, None)
        assert renderer.make_up(2.3 * BLOCK / SR, BLOCK) == 2  # 2.3 periods after its cycle's start: two lost
        assert buffer.played_frames == 2 * BLOCK
        assert renderer.make_up(0.9 * BLOCK / SR, BLOCK) == 0  # a wake-up most of a period late, nothing lost
        assert buffer.played_frames == 2 * BLOCK
        block = render(renderer)
        np.testing.assert_allclose(block, (2 * BLOCK + np.arange(BLOCK)) / SR, atol=1e-6)
    finally:
        buffer.unlink()

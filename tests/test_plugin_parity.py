"""The plugin's block rendering (plugin/src/render_core.cpp) gives the same samples and leaves the same header as
live/renderer.py's BlockRenderer, bit for bit, over twin loop buffers driven through the same blocks: a gain ramp,
the click on the bar starts, a stop's fade and a start on a given frame, a phase correction's crossfade, a new loop
switched in on a bar line, odd-sized blocks."""

import ctypes

import numpy as np
import pytest
from flowjam.live.loop_buffer import BLOCK_TIME, LoopBuffer
from flowjam.live.renderer import BlockRenderer
from plugin_build import build

SR = 48_000
BLOCK = 256
BAR = 4 * 60 / 123 * SR  # a 4/4 bar at 123 BPM, 93658.5 frames: not whole
LOOP = 2 * round(BAR / 2)


@pytest.fixture(scope="module")
def core():
    library = ctypes.CDLL(str(build(need_dpf=False) / "libflowjam_core.so"))
    library.flowjam_core_new.restype = ctypes.c_void_p
    library.flowjam_core_new.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int)
    library.flowjam_core_attach.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulonglong)
    library.flowjam_core_render.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_double)
    library.flowjam_core_free.argtypes = (ctypes.c_void_p,)
    return library


class Twins:
    """Two loop buffers with the same audio and header: the Python renderer plays one, the C++ core the other; every
    change is made to both."""

    def __init__(self, core):
        rng = np.random.default_rng(7)
        audio = rng.uniform(-0.5, 0.5, (2, LOOP)).astype(np.float32)
        other = rng.uniform(-0.5, 0.5, (2, LOOP)).astype(np.float32)
        self.buffers = [LoopBuffer(LOOP, 2, SR, regions=2) for _ in range(2)]
        for buffer in self.buffers:
            buffer.fill(audio, region=0)
            buffer.fill(other, region=1)
        self.python = BlockRenderer(self.buffers[0], BLOCK, None)
        self.core = core
        self.native = core.flowjam_core_new(BLOCK, 2, SR)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.buffers[1]._shm.buf))
        assert core.flowjam_core_attach(self.native, base, self.buffers[1]._shm.size) == 1

    def both(self, change) -> None:
        for buffer in self.buffers:
            change(buffer)

    def blocks(self, count: int, frames: int = BLOCK) -> None:
        """Render `count` blocks on both and hold the samples and the headers equal."""
        for _ in range(count):
            python_out = np.full((frames, 2), np.nan, np.float32)
            native_out = np.full((frames, 2), np.nan, np.float32)
            self.python.render(python_out, frames)
            self.core.flowjam_core_render(self.native, native_out.ctypes.data, frames, 0.0)
            at = self.buffers[0].played_frames - frames
            differ = np.flatnonzero(python_out.view(np.uint32) != native_out.view(np.uint32))
            assert differ.size == 0, f"block at frame {at}: {differ.size} samples differ, first {differ[:4]}"
            python_header = self.buffers[0].counters.copy(), np.delete(self.buffers[0].reals, BLOCK_TIME)
            native_header = self.buffers[1].counters.copy(), np.delete(self.buffers[1].reals, BLOCK_TIME)
            np.testing.assert_array_equal(native_header[0], python_header[0], f"counters after the block at {at}")
            np.testing.assert_array_equal(native_header[1], python_header[1], f"reals after the block at {at}")

    def close(self) -> None:
        self.core.flowjam_core_free(self.native)
        self.python = None
        for buffer in self.buffers:
            buffer.unlink()


@pytest.fixture
def twins(core):
    pair = Twins(core)
    yield pair
    pair.close()


def test_plugin_core_equals_the_renderer_through_gain_ramps_and_clicks(twins):
    twins.both(lambda b: setattr(b, "gain", 0.1))
    twins.both(lambda b: b.set_click(BAR / 2))
    twins.blocks(3)
    twins.both(lambda b: setattr(b, "gain", 0.73))
    twins.both(lambda b: b.counters.__setitem__(4, round(BAR / 2) - 100))  # PLAYED: a bar start 100 frames ahead
    twins.blocks(4)
    twins.both(lambda b: b.set_click(BAR, 3 * BAR))
    twins.both(lambda b: b.counters.__setitem__(4, LOOP - 300))  # the loop's end and start in one block
    twins.blocks(4)


def test_plugin_core_equals_the_renderer_through_stop_start_and_odd_blocks(twins):
    twins.blocks(2)
    twins.both(lambda b: setattr(b, "playing", False))
    twins.blocks(3)
    twins.both(lambda b: b.start_at(b.played_frames + 100))
    twins.blocks(3)
    twins.both(lambda b: setattr(b, "playing", False))
    twins.blocks(1, frames=100)  # an odd-sized block jumps instead of fading
    twins.both(lambda b: setattr(b, "playing", True))
    twins.both(lambda b: setattr(b, "gain", 0.25))
    twins.blocks(2, frames=100)
    twins.blocks(2)


def test_plugin_core_equals_the_renderer_through_a_phase_correction_and_a_region_switch_on_a_bar_line(twins):
    twins.both(lambda b: b.set_click(BAR / 2))
    twins.blocks(2)
    twins.both(lambda b: b.set_shift(300))
    twins.blocks(2)
    bar_line = round(BAR / 2) + 17
    twins.both(lambda b: b.prepare(1, LOOP - 1000, -bar_line))
    twins.both(lambda b: b.switch_at(bar_line, 1, BAR / 3, 0.0))
    twins.both(lambda b: b.counters.__setitem__(4, bar_line - 2 * BLOCK - 5))
    twins.blocks(5)
    assert twins.buffers[1].active == 1, "the switch took place"


def test_plugin_core_equals_the_renderer_through_phase_corrections_across_bar_starts(twins):
    """A bar start the phase lock jumps over clicks at the next block's start, one it moves back over does not click
    again: the same in both, sample for sample."""
    twins.both(lambda b: b.set_click(BAR / 2))
    twins.both(lambda b: b.counters.__setitem__(4, round(BAR / 2) - 700))  # PLAYED: a bar start 700 frames ahead
    twins.blocks(1)
    twins.both(lambda b: b.set_shift(300))  # jumps over it
    twins.blocks(2)
    twins.both(lambda b: b.counters.__setitem__(4, 2 * round(BAR / 2) - 700 - 300 - BLOCK))
    twins.blocks(2)  # the next bar start played in the second block
    twins.both(lambda b: b.set_shift(-100))  # moves back over it
    twins.blocks(2)

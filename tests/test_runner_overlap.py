"""The runner's tick thread and its writer overlap: a new latent's decode and patch do not wait for the next tick,
and the next tick does not wait for them. Ordering is asserted with gates (a tick or a patch held until the test
lets it go), not timings. Each test also runs windowed ("windowed": 4 s windows on a 6 s loop, placed where the
runner measures its write point to be), where the writer decodes the timeline the windows are merged into."""

import threading

import pytest
import torch
from flowjam.live.knobs import KnobRegistry
from flowjam.live.loop_buffer import LoopBuffer
from flowjam.live.runner import LiveRunner, RunnerConfig
from helpers import wait_for

SONG_SECONDS = 2.0
WINDOW_S = 4.0  # the windowed runs: the shortest window (MIN_WINDOW_SECONDS)
WINDOWED_SONG_SECONDS = 6.0  # their loop, longer than the window
WINDOWS, WINDOW_IDS = [0.0, WINDOW_S], ["whole-loop", "windowed"]
TIMEOUT_S = 20.0


def loop_frames(session, window_s: float) -> int:
    seconds = SONG_SECONDS if window_s == 0 else WINDOWED_SONG_SECONDS
    return round(seconds * 25) * session.models.vae.hop_samples


def make_runner(session, buffer, prompt: str, window_s: float, ahead_s: float | None = None) -> LiveRunner:
    config = RunnerConfig(window_s=window_s, ahead_s=ahead_s)
    runner = LiveRunner(session, KnobRegistry(), buffer, prompt, config=config)
    assert (runner.request_frames < runner.frames) == (window_s > 0)
    return runner


class GatedBuffer(LoopBuffer):
    """A real loop buffer whose patches can be held at a gate: `hold()` makes the next patch wait for `release()`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.holding = threading.Event()
        self.held = threading.Event()
        self.released = threading.Event()

    def hold(self) -> None:
        self.released.clear()
        self.holding.set()

    def release(self) -> None:
        self.holding.clear()
        self.released.set()

    def patch(self, *args, **kwargs) -> None:
        if self.holding.is_set():
            self.held.set()
            self.released.wait(TIMEOUT_S)
        super().patch(*args, **kwargs)


@pytest.fixture(params=WINDOWS, ids=WINDOW_IDS)
def runner(session, request):
    buffer = GatedBuffer(loop_frames(session, request.param), channels=2, sample_rate=session.sample_rate)
    runner = make_runner(session, buffer, "overlap a", request.param)
    yield runner
    buffer.release()
    runner.stop()
    buffer.unlink()


def test_ticks_go_on_while_a_write_is_in_progress(runner):
    runner.start()
    wait_for(lambda: runner.stats.writes >= 2, TIMEOUT_S, "the first writes")
    runner.buffer.hold()
    wait_for(runner.buffer.held.is_set, TIMEOUT_S, "a write to reach the buffer")
    ticks, latents = runner.stats.ticks, runner.stats.latents
    wait_for(lambda: runner.stats.latents >= latents + 2, TIMEOUT_S, "two more latents while the write is held")
    assert runner.stats.ticks >= ticks + 2 and runner.alive
    runner.buffer.release()
    writes = runner.stats.writes
    wait_for(lambda: runner.stats.writes > writes, TIMEOUT_S, "the held write to land")
    assert runner.stats.errors == 0, runner.stats.last_error


def test_a_new_latent_is_written_while_the_next_tick_is_held(runner, monkeypatch):
    handle = runner.stream
    real_tick = handle.tick
    gate, held = threading.Event(), threading.Event()
    delivered: list[int] = []

    def tick():
        if delivered and not gate.is_set():  # the tick after the first latent since arming waits at the gate
            held.set()
            gate.wait(TIMEOUT_S)
        finished = real_tick()
        if finished and runner.stats.writes >= 1:
            delivered.append(finished[-1].request.tag)
        return finished

    monkeypatch.setattr(handle, "tick", tick)
    runner.registry.set("velocity_scale", 1.1, origin="test")  # a latent made after it carries a new sequence
    runner.start()
    wait_for(held.is_set, TIMEOUT_S, "a tick held after a new latent")
    ticks = runner.stats.ticks
    wait_for(
        lambda: runner.stats.written_seq == delivered[0], TIMEOUT_S, "the new latent's write while the next tick waits"
    )
    assert runner.stats.ticks == ticks, "the next tick must still be held"
    gate.set()
    wait_for(lambda: runner.stats.ticks > ticks, TIMEOUT_S, "ticks to resume")
    assert runner.stats.errors == 0, runner.stats.last_error


class PatchLog(LoopBuffer):
    """A real loop buffer that remembers where each patch started and what it held."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.patches = []

    def patch(self, start_frame, audio, fade_frames=480) -> None:
        self.patches.append((start_frame, audio.copy() if hasattr(audio, "copy") else audio.clone()))
        super().patch(start_frame, audio, fade_frames)


@pytest.mark.parametrize("window_s", WINDOWS, ids=WINDOW_IDS)
def test_new_audio_starts_at_playhead_plus_lead_not_at_the_next_latent_frame(session, window_s):
    """The writer patches from playhead + lead to the sample: rounding up to the next latent frame (40 ms) would
    add up to 40 ms to every knob's way to the ear. What it writes there is the decoded latent at that time (the
    loop's, or windowed the timeline's: `runner.latest`)."""
    from flowjam.live.loop_buffer import PLAYED

    hop = session.models.vae.hop_samples
    buffer = PatchLog(loop_frames(session, window_s), channels=2, sample_rate=session.sample_rate)
    runner = make_runner(session, buffer, "exact start", window_s, ahead_s=0.0)  # windows written from frame 0 on
    try:
        while runner.stats.writes < 2:
            runner.step()
        writes = runner.stats.writes
        buffer.counters[PLAYED] = 7 * hop + 333  # the playhead inside a latent frame
        lead_s, patch_s = runner.stats.lead_s, runner.stats.patch_s  # what the next write uses (then adapts)
        while runner.stats.writes == writes:
            runner.step()
        start, audio = buffer.patches[-1]
        assert start == 7 * hop + 333 + int(lead_s * session.sample_rate) and start % hop != 0
        frame, skip = start // hop, start % hop
        written = runner.latest[:, frame : frame + round(patch_s * 25)]
        assert written.abs().amax(dim=-1).gt(0).all(), "the patch decodes generated frames (a timeline has zeros else)"
        decoded = runner.session.decode(runner.latest, frame / 25, patch_s, cyclic=True)
        assert torch.equal(torch.as_tensor(audio), decoded[:, skip:])
    finally:
        runner.stop()
        buffer.unlink()

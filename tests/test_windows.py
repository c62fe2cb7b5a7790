"""Windowed generation (issue "Any length at the cost of a window"): requests of W frames placed at the playhead on a
timeline, kept frames held bit for bit, frozen frames never rewritten, endless play, and lanes of different loop
lengths sharing one ring. Real pipeline and tiny-preset model throughout; the playhead is moved by hand so that
placements, and so the latents, are reproducible."""

import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from flowjam.engine.audio.files import read_audio
from flowjam.engine.stream import StreamPipeline
from flowjam.engine.stream.requests import CURVE_FIELDS
from flowjam.engine.stream.walker import WindowWalker
from flowjam.engine.stream.windows import Timeline, WindowPlace, cyclic_crop, place_window, ring_frames, window_frames
from flowjam.live.knobs import KnobRegistry
from flowjam.live.loop_buffer import PLAYED, LoopBuffer
from flowjam.live.runner import LiveRunner, RunnerConfig
from helpers import free_udp_port
from pythonosc.udp_client import SimpleUDPClient
from torch.utils._python_dispatch import TorchDispatchMode

W = 250  # frames (10 s): batch-size-invariant CPU GEMMs, as the shared-ring tests use
STEPS = 4
ADVANCE = 8  # latent frames the playhead moves per tick


# ---- placement and the timeline, pure -------------------------------------------------------------------------


def test_a_window_keeps_half_behind_the_write_point_and_less_at_the_start():
    assert place_window(100, 40) == WindowPlace(start=80, frames=40, keep=20)
    assert place_window(5, 40) == WindowPlace(start=0, frames=40, keep=5)
    assert place_window(100, 40).write_frame == 100


def test_window_lengths_and_their_errors():
    assert window_frames(20.0, 1500) == 500
    assert window_frames(60.0, 1500) is None, "a window as long as the loop is whole-loop generation"
    assert window_frames(0.0, 1500) is None
    assert window_frames(20.0, None) == 500
    assert ring_frames(500, None) > 500 and ring_frames(500, 1500) == 1500
    for bad in (2.0, -1.0, float("nan"), 601.0):
        with pytest.raises(ValueError, match="window"):
            window_frames(bad, 1500)
    with pytest.raises(ValueError, match="endless play needs a window"):
        window_frames(0.0, None)


def test_the_timeline_merges_after_the_frozen_frontier_and_wraps_the_loop():
    timeline = Timeline(10, 2, torch.device("cpu"), torch.float32, endless=False)
    place = WindowPlace(start=6, frames=6, keep=2)  # frames 6..11: wraps at 10
    latent = torch.arange(12, dtype=torch.float32).reshape(1, 6, 2)
    assert timeline.merge(latent, place) == 4  # the kept frames 6, 7 are not written
    assert timeline.holds(place).tolist() == [False, False, True, True, True, True]
    assert torch.equal(timeline.window(place)[:, 2:], latent[:, 2:])
    timeline.freeze(9)
    assert timeline.merge(latent + 100, WindowPlace(start=6, frames=6, keep=0)) == 3  # 9, 10 and 11 (= 0, 1)
    assert torch.equal(timeline.latents[:, 8], latent[:, 2]), "a frozen frame never changes"
    assert torch.equal(timeline.latents[:, 0], latent[:, 4] + 100)
    assert torch.equal(cyclic_crop(torch.arange(10).reshape(1, 10, 1), 8, 4).flatten(), torch.tensor([8, 9, 0, 1]))


def test_an_endless_timeline_holds_a_frame_only_for_the_lap_it_was_written_in():
    timeline = Timeline(8, 1, torch.device("cpu"), torch.float32, endless=True)
    timeline.merge(torch.ones(1, 4, 1), WindowPlace(start=2, frames=4, keep=0))
    assert timeline.holds(WindowPlace(start=2, frames=4, keep=0)).all()
    assert not timeline.holds(WindowPlace(start=10, frames=4, keep=0)).any(), "frame 10 is not frame 2"


# ---- the walker on a real pipeline ----------------------------------------------------------------------------


class Walk:
    """A lane of a pipeline walking a timeline with a playhead moved by hand: one latent frame per tick."""

    def __init__(self, session, pipeline, lane, ring: int, endless: bool, condition, seed: int):
        self.session, self.lane = session, lane
        channels = session.models.config.audio_acoustic_hidden_dim
        self.walker = WindowWalker(ring, W, channels, session.device, session.dtype, endless)
        self.context = session.context_latents(ring, None)
        self.condition, self.seed = condition, seed
        self.delivered: list = []  # (request, latent, timeline frames its kept region held at submit)
        self.snapshots: list[tuple[int, torch.Tensor]] = []

    def submit(self, tick: int) -> None:
        place = self.walker.place((tick + STEPS) * ADVANCE, 1)  # the generated part starts where it is delivered
        inputs = self.walker.inputs(place, self.context, None, 0.7, STEPS, 3.0)
        denoise = 0.7 if "source_latents" in inputs else 1.0
        request = self.session.make_request(
            self.condition, W / 25, seed=self.seed, steps=STEPS, denoise=denoise, **inputs
        )
        self.lane.submit(request)

    def land(self, finished, tick: int) -> None:
        if not finished:
            return
        for item in finished:
            self.delivered.append((item.request, item.latent, self.walker.timeline.frozen))
        self.walker.land(finished, tick * ADVANCE)
        self.snapshots.append((self.walker.timeline.frozen, self.walker.timeline.latents.clone()))


def _run(session, condition, walks_spec, ticks: int) -> list[Walk]:
    pipeline = StreamPipeline(session.models.acestep.decoder, depth=2)
    walks = []
    for name, ring, endless, seed in walks_spec:
        walks.append(Walk(session, pipeline, pipeline.add_lane(name, depth=2), ring, endless, condition, seed))
    for tick in range(ticks):
        for walk in walks:
            walk.submit(tick)
        finished = pipeline.tick()
        for walk in walks:
            walk.land([f for f in finished if f.lane == walk.lane.name], tick)
    return walks


@pytest.fixture(scope="module")
def walked(session, prompts):
    """A 60 s loop and an endless song, alone and together on one ring."""
    condition = prompts[0]
    loop, endless = ("loop", 1500, False, 5), ("endless", ring_frames(W, None), True, 9)
    alone = [_run(session, condition, [spec], 45)[0] for spec in (loop, endless)]
    together = _run(session, condition, [loop, endless], 45)
    return alone, together


def test_kept_frames_equal_the_timeline_bit_for_bit_and_frozen_frames_never_change(walked):
    alone, _ = walked
    for walk in alone:
        assert len(walk.delivered) > 10
        kept_any = 0
        for request, latent, _ in walk.delivered:
            if request.latent_mask is None:
                continue
            kept = request.latent_mask == 0
            kept_any += int(kept.sum())
            assert torch.equal(latent[:, kept], request.source_latents[:, kept]), "kept frames changed"
        assert kept_any > 0
        for (frozen, before), (_, after) in zip(walk.snapshots, walk.snapshots[1:]):
            ring = before.shape[1]
            if frozen >= ring:  # endless: only the last ring's frames are on it
                continue
            assert torch.equal(before[:, :frozen], after[:, :frozen]), "a frozen frame was rewritten"
        assert walk.walker.timeline.frozen > W, "the walk moved past its first window"


def test_every_window_request_after_the_first_takes_the_same_tick_plan(walked):
    """A request's curve fields are part of the tick graph's plan (engine/stream/graph_step.py): windows that differ
    only in which of their frames the timeline holds (the first lap of a loop, the far end of an endless window) must
    not make plans of their own."""
    for walk in walked[0]:
        kinds = {
            (
                tuple(sorted(name for name in CURVE_FIELDS if getattr(request, name) is not None)),
                request.source_latents is not None,
            )
            for request, _, _ in walk.delivered[2:]  # the depth-2 ring's first two requests found nothing held
        }
        assert len(kinds) == 1 and {"initial_noise", "latent_mask"} <= set(next(iter(kinds))[0]), kinds


def test_lanes_of_different_lengths_share_a_ring_each_bit_for_bit_as_alone(walked):
    alone, together = walked
    for single, shared in zip(alone, together):
        assert len(single.delivered) == len(shared.delivered)
        for (_, a, _), (_, b, _) in zip(single.delivered, shared.delivered):
            assert torch.equal(a, b)
        assert torch.equal(single.walker.timeline.latents, shared.walker.timeline.latents)


# ---- the live runner --------------------------------------------------------------------------------------------


def _runner_latents(session, window_s: float, ticks: int = 10) -> list[torch.Tensor]:
    hop = session.models.vae.hop_samples
    buffer = LoopBuffer(8 * 25 * hop, 2, session.sample_rate)
    registry = KnobRegistry()
    registry.set("steps", STEPS)
    runner = LiveRunner(session, registry, buffer, "pads", config=RunnerConfig(window_s=window_s))
    finished = []
    real_tick = runner.stream.tick

    def tick():
        out = real_tick()
        finished.extend(item.latent for item in out)
        return out

    runner.stream.tick = tick
    try:
        for _ in range(ticks):
            runner.tick()
            buffer.counters[PLAYED] += hop
    finally:
        runner.stop()
        buffer.unlink()
    return finished


def test_a_window_as_long_as_the_loop_is_todays_stream_bit_for_bit(session):
    whole = _runner_latents(session, 0.0)
    assert whole, "latents were delivered"
    for a, b in zip(whole, _runner_latents(session, 8.0), strict=True):
        assert torch.equal(a, b)
    assert _runner_latents(session, 4.0, ticks=6)[0].shape[1] == 100, "a shorter window generates W frames"


def test_endless_live_records_a_continuous_take_longer_than_the_window_under_a_knob_storm(tmp_path):
    osc_port = free_udp_port()
    record = tmp_path / "take.wav"
    command = [sys.executable, "-m", "flowjam", "live", "--preset", "tiny", "--endless", "--window-seconds", "4"]
    command += ["--seconds", "9", "--no-audio", "--record", str(record), "--osc-port", str(osc_port)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    client = SimpleUDPClient("127.0.0.1", osc_port)
    values = np.linspace(0.5, 1.5, 7)
    sent = 0
    while process.poll() is None and sent < 4000:
        try:
            client.send_message("/flowjam/default/knob/velocity_scale", float(values[sent % 7]))
            client.send_message("/flowjam/default/knob/denoise", float(0.4 + 0.1 * (sent % 5)))
        except OSError:  # the CLI's OSC port is not open yet
            pass
        sent += 1
        time.sleep(0.005)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    last = [line for line in err.splitlines() if "underruns" in line][-1]
    assert " song " in last and "underruns 0" in last and "errors 0" in last, last
    audio, rate = read_audio(record)
    assert audio.shape[1] > 5 * rate, "longer than the 4 s window (and its ring's first lap)"
    blocks = audio[:, : audio.shape[1] // 2400 * 2400].reshape(2, -1, 2400).abs().amax(dim=(0, 2))
    first = int(torch.nonzero(blocks > 0)[0])
    assert (blocks[first:] > 0).all(), f"an exact-zero block after the first generation: {blocks[first:].tolist()}"


def _window_after(runner: LiveRunner, delivered: list, seq: int, nth: int = 1) -> torch.Tensor:
    """Step the runner until the `nth` window (the delivered latent, not the timeline: frames frozen meanwhile keep
    whatever they held) whose request was made after registry change `seq`."""
    seen = 0
    for _ in range(200):
        count = len(delivered)
        runner.step()
        for item in delivered[count:]:
            if item.request.tag >= seq:
                seen += 1
                if seen == nth:
                    return item.latent.clone()
    pytest.fail(f"no window made after change {seq}")


@pytest.mark.parametrize("knob, changed", [("velocity_scale", 1.6), ("denoise", 0.5)])
def test_a_knob_changes_a_windowed_stream_and_restores_it_bit_for_bit(session, knob, changed):
    """The knob-effect test of tests/test_knob_effects.py on a windowed stream (a 6 s loop, 4 s windows placed at a
    fixed point ahead of the playhead so that placements repeat): the next window changes, and setting the knob back
    gives the same window bit for bit."""
    hop = session.models.vae.hop_samples
    registry = KnobRegistry()
    registry.set("steps", STEPS)
    registry.set("denoise", 1.0)
    buffer = LoopBuffer(6 * 25 * hop, 2, session.sample_rate)
    runner = LiveRunner(session, registry, buffer, "pads", config=RunnerConfig(window_s=4.0, ahead_s=0.0))
    delivered: list = []
    real_tick = runner.stream.tick

    def tick():
        finished = real_tick()
        delivered.extend(finished)
        return finished

    runner.stream.tick = tick
    try:
        depth = int(registry.get("depth"))
        original = _window_after(runner, delivered, registry.seq, nth=depth + 1)
        assert original.shape[1] == 100 and runner.latest.shape[1] == 150, "4 s windows on the 6 s timeline"
        moved = registry.set(knob, changed, origin="osc")
        assert not torch.equal(_window_after(runner, delivered, moved.seq), original), f"{knob} changed nothing"
        back = registry.set(knob, 1.0 if knob == "denoise" else registry.specs[knob].default, origin="osc")
        assert torch.equal(_window_after(runner, delivered, back.seq, nth=depth + 1), original)
    finally:
        runner.stop()
        buffer.unlink()


# ---- the engine's windowed stream (Session.stream(window_s=...)) -----------------------------------------------


def test_a_windowed_session_stream_walks_exactly_as_the_walker_does(session, prompts, walked):
    """Whole-song requests placed by `Session.stream(window_s=W)` deliver the hand-placed walk's latents bit for bit."""
    hand = walked[0][0]  # the 60 s loop, seed 5
    stream = session.stream(depth=2, paced=True, window_s=W / 25, song_seconds=60.0)
    request = session.make_request(prompts[0], 60.0, seed=5, steps=STEPS, shift=3.0)
    delivered = []
    for tick in range(45):
        stream.submit(request, at_frame=(tick + STEPS) * ADVANCE, denoise=0.7)
        delivered += [item.latent for item in stream.tick(frozen_frame=tick * ADVANCE)]
    assert len(delivered) == len(hand.delivered) > 10
    for ours, (_, theirs, _) in zip(delivered, hand.delivered):
        assert ours.shape[1] == W and torch.equal(ours, theirs)
    assert torch.equal(stream.timeline.latents, hand.walker.timeline.latents)


def test_a_song_long_curve_is_read_at_each_window_and_changes_only_its_frames(session, prompts):
    """A per-frame curve of the whole song reaches each window at the window's place: a velocity scale that differs
    from 1 only in the song's second half leaves the first windows bit for bit as without it."""
    song = 40.0

    def walk(velocity):
        stream = session.stream(depth=2, paced=True, window_s=W / 25, song_seconds=song)
        request = session.make_request(prompts[0], song, seed=3, steps=STEPS, velocity_scale=velocity)
        delivered = []
        for tick in range(12):
            stream.submit(request, at_frame=(tick + STEPS) * ADVANCE * 8)
            delivered += [(item.request.window, item.latent) for item in stream.tick(frozen_frame=0)]
        return delivered

    frames = round(song * 25)
    curve = torch.ones(frames)
    curve[frames // 2 :] = 1.5
    plain, curved = walk(None), walk(curve)
    assert [place for place, _ in plain] == [place for place, _ in curved]
    inside = [torch.equal(a, b) for (place, a), (_, b) in zip(plain, curved) if place.start + W <= frames // 2]
    reaching = [torch.equal(a, b) for (place, a), (_, b) in zip(plain, curved) if place.start + W > frames // 2]
    assert inside and all(inside), "windows before the curve's change must be unchanged"
    assert reaching and not any(reaching), "windows reaching the second half must hear the curve"


def test_session_stream_windows_only_when_the_window_is_shorter_than_the_song(session, prompts):
    assert not hasattr(session.stream(window_s=W / 25, song_seconds=W / 25), "timeline"), "W >= song: whole requests"
    assert not hasattr(session.stream(window_s=0.0, song_seconds=60.0), "timeline")
    with pytest.raises(ValueError, match="needs song_seconds"):
        session.stream(window_s=W / 25)
    with pytest.raises(ValueError, match="endless play needs a window: give window_s, e.g. 20"):
        session.stream(endless=True)
    with pytest.raises(ValueError, match="window_s 2 is outside 4..600 s"):
        session.stream(window_s=2.0, song_seconds=60.0)
    stream = session.stream(window_s=W / 25, song_seconds=60.0)
    with pytest.raises(ValueError, match="make the request with the song's seconds"):
        stream.submit(session.make_request(prompts[0], W / 25, steps=STEPS))


def test_an_endless_session_stream_walks_past_its_ring_and_never_rewrites_a_frozen_frame(session, prompts):
    stream = session.stream(depth=2, paced=True, window_s=W / 25, endless=True)
    ring = stream.timeline.ring
    request = session.make_request(prompts[0], ring / 25, seed=2, steps=STEPS)
    step = 40  # frames the playhead moves a tick: the walk laps the ring within the test
    for tick in range(2 * ring // step):
        before = stream.timeline.latents.clone()
        frozen = tick * step
        stream.submit(request, at_frame=frozen + STEPS * step, denoise=0.7)
        stream.tick(frozen_frame=frozen)
        after = stream.timeline.latents
        for frame in range(max(0, frozen - ring + W), frozen):  # frozen frames still on the ring
            position = frame % ring
            assert torch.equal(before[:, position], after[:, position]), f"frozen frame {frame} was rewritten"
    assert stream.timeline.frozen >= ring, "the walk went round the ring"


def test_a_target_captured_before_the_first_lap_is_silence_where_no_window_has_been(session):
    """The timeline's never-written frames are zeros, which are not silence: a capture gives them the silence latent
    (the loop as heard), and the generated frames as they are."""
    hop = session.models.vae.hop_samples
    buffer = LoopBuffer(150 * hop, 2, session.sample_rate)
    registry = KnobRegistry()
    registry.set("steps", STEPS)
    runner = LiveRunner(session, registry, buffer, "pads", config=RunnerConfig(window_s=4.0, ahead_s=0.0))
    try:
        while runner.latest is None:
            runner.step()
        runner.capture_target()
        runner.step()
        timeline = runner._walker.timeline
        written = timeline.frame_at >= 0
        silence = session.context_latents(150, None)[..., :64]
        assert 0 < int(written.sum()) < 150, "the capture came before the first lap"
        assert torch.equal(runner.target[:, ~written], silence[:, ~written].to(runner.target.dtype))
        assert not (runner.target[0].abs().sum(-1) == 0).any(), "no frame of the target is an all-zero latent"
    finally:
        runner.stop()
        buffer.unlink()


def test_bench_tick_costs_the_same_at_a_60_s_and_a_600_s_loop_with_10_s_windows():
    """The issue's CPU must-show (`bench tick --preset tiny --window-seconds 10 --song-seconds 60 600` prints the same
    ratio): the two songs' ticks timed in alternating rounds (`interleaved_ms`), so the machine's slow spells fall on
    both alike; a tick that grew with the song (a copy of the timeline, a crop of the whole context) would show."""
    from flowjam.engine.bench.ticks import TickFixture, TickRun, interleaved_ms

    runs = []
    for seconds in (60.0, 600.0):
        fixture = TickFixture.build("tiny", seconds, "cpu", torch.float32, gemm_tflops=1.0)  # no bound reckoned
        runs.append(TickRun(fixture, depth=4, steps=8, cfg="off", window_s=10.0))
    for run in runs:
        run.warm_up()
    assert runs[0].frames == runs[1].frames == 250, "both walk 10 s windows"
    at_60, at_600 = interleaved_ms(runs, rounds=30, ticks_per_round=3)
    print(f"10 s windows: {at_60:.2f} ms/tick at a 60 s loop, {at_600:.2f} at 600 s ({at_600 / at_60:.2f}x)")
    assert 0.85 <= at_600 / at_60 <= 1.15, (at_60, at_600)


class _LatentChecksSeen(TorchDispatchMode):
    """Counts the NaN/inf checks run over a window's latents (`isfinite(x).all()` on [1, W, C>1]: on a GPU, each a
    host-device sync; the [1, W, 1] curves the walker makes on the CPU are not counted)."""

    def __init__(self):
        super().__init__()
        self.checks = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        x = args[0] if args else None
        if func is torch.ops.aten.all.default and x.dim() == 3 and x.shape[1] == W and x.shape[2] > 1:
            self.checks += 1
        return func(*args, **(kwargs or {}))


def test_windows_check_the_song_for_nan_once_and_refuse_a_nan_written_into_it(session, prompts):
    """A window's context and x0 target are crops of the song's, new tensors at every place: the song's are checked
    once (a GPU sync each), not every crop every tick; a NaN written into the song in place is still refused, by
    name, at the next submit, and the stream plays on once it is gone."""
    song = 40.0
    stream = session.stream(depth=2, paced=True, window_s=W / 25, song_seconds=song)
    target = torch.zeros(1, round(song * 25), session.models.acestep.decoder.config.audio_acoustic_hidden_dim)
    request = session.make_request(prompts[0], song, seed=3, steps=STEPS, x0_target=target, x0_target_strength=0.5)
    stream.submit(request, at_frame=0)
    stream.tick()
    with _LatentChecksSeen() as seen:
        for tick in range(1, 6):
            stream.submit(request, at_frame=tick * ADVANCE)
            stream.tick()
    assert seen.checks == 0, f"{seen.checks} NaN checks in 5 ticks of an unchanged song"
    for name, song_tensor in (("context_latents", request.context_latents), ("x0_target", target)):
        value = song_tensor[0, 400, 3].item()  # the context may be the session's own silence: put it back
        song_tensor[0, 400, 3] = float("nan")
        with pytest.raises(ValueError, match=f"{name} contains NaN"):
            stream.submit(request, at_frame=6 * ADVANCE)
        song_tensor[0, 400, 3] = value
    stream.submit(request, at_frame=6 * ADVANCE)
    assert stream.tick() is not None


def test_a_nan_written_into_a_checked_tensor_is_refused_at_the_next_submit(session, prompts):
    pipeline = StreamPipeline(session.models.acestep.decoder, depth=2)
    request = session.make_request(prompts[0], W / 25, seed=1, steps=STEPS)
    pipeline.submit(request)
    value = request.context_latents[0, 7, 7].item()
    request.context_latents[0, 7, 7] = float("inf")
    with pytest.raises(ValueError, match="context_latents contains NaN or infinite values"):
        pipeline.submit(request)
    request.context_latents[0, 7, 7] = value
    pipeline.submit(request)
    assert [f.request.seed for f in pipeline.drain()] == [1]

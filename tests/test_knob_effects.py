"""Every knob in the registry, turned the way a player turns it (a registry write that the runner reads at the top of
its next tick, as OSC, MIDI and the panel do), changes what is generated or played; set back, it restores the
original output bit for bit.

The runner is stepped by hand on the tiny preset (CPU, fp32), so the runs are deterministic. The resting state is
the registry's defaults with `denoise` at 1.0: every generation then starts from the same seeded noise, so a run
that never touched a knob delivers the same latent over and over, and "set back" can be compared bit for bit. (At
the default denoise of 0.7 each generation starts from the previous one, so no later output of a run that moved a
knob can equal the untouched run's.) Numbers in the CPU matmuls depend on which rows share a tick's batch, so the
restored latent is taken once the ring has turned over: the (depth + 1)-th generation made after the reset.

Every test that plays a loop also runs windowed ("windowed": 4 s windows on a 6 s loop, each written from the
playhead, which the hand-stepped runner never moves, so that placements repeat as in tests/test_windows.py). There the generation compared is the delivered window: `runner.latest` is the timeline,
whose frames before the frozen frontier keep whatever they held when the frontier last moved; that the window
landed on the timeline after the frontier is checked on every one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from flowjam.engine.params import KNOB_SPECS, KnobKind
from flowjam.engine.session import Session
from flowjam.engine.stream.windows import cyclic_crop
from flowjam.live.app import LiveApp, LiveConfig
from flowjam.live.knobs import KnobRegistry
from flowjam.live.loop_buffer import PLAYED, LoopBuffer
from flowjam.live.renderer import BlockRenderer
from flowjam.live.runner import LiveRunner, RunnerConfig
from helpers import wait_for
from pythonosc.udp_client import SimpleUDPClient

SONG_SECONDS = 1.0
WINDOW_S = 4.0  # the windowed runs: the shortest window (MIN_WINDOW_SECONDS)
WINDOWED_SONG_SECONDS = 6.0  # their loop, longer than the window (the tiny preset keeps the ticks cheap)
WINDOWS = pytest.mark.parametrize("window_s", [0.0, WINDOW_S], ids=["whole-loop", "windowed"])
MIN_RELATIVE_CHANGE = 1e-3  # a moved knob changes the next affected latent by at least 0.1 % (relative L2)
MAX_STEPS = 200


@dataclass(frozen=True)
class KnobCase:
    knob: str
    changed: float | str
    setting: dict = field(default_factory=dict)  # knobs set before the run (what makes this knob act)
    source: bool = False  # a cover of a source WAV instead of a text-only loop
    target_seed: int | None = None  # capture the loop generated with this seed as the x0 target first


CASES = {
    case.knob: case
    for case in (
        KnobCase("velocity_scale", 1.5),
        KnobCase("ode_noise", 0.5),
        KnobCase("sde_denoise", 0.4),
        KnobCase("x0_target_strength", 0.8, target_seed=5),
        KnobCase("guidance", 4.0, {"cfg_mode": "full"}),
        KnobCase("cfg_rescale", 0.8, {"cfg_mode": "full", "guidance": 4.0}),
        KnobCase("apg_momentum", -0.1, {"cfg_mode": "full", "guidance": 4.0}),
        KnobCase("denoise", 0.5),
        KnobCase("seed", 7),
        KnobCase("steps", 4),
        KnobCase("shift", 1.5),
        KnobCase("prompt_blend", 1.0),
        KnobCase("structure", 0.0, source=True),
        KnobCase("cfg_mode", "full", {"guidance": 4.0}),
        KnobCase("depth", 2),
        KnobCase("volume", 0.3),
    )
}


def song_seconds(window_s: float) -> float:
    return SONG_SECONDS if window_s == 0 else WINDOWED_SONG_SECONDS


def runner_config(window_s: float) -> RunnerConfig:
    """Whole-loop generation, or windows whose write point is the playhead itself (a fixed place)."""
    return RunnerConfig(window_s=window_s, ahead_s=0.0)


@pytest.fixture(scope="module")
def noise_source(session):
    """A cover source for the `structure` knob, one per loop length: seeded stereo noise."""
    made = {}

    def make(seconds: float):
        if seconds not in made:
            noise = torch.Generator().manual_seed(3)
            audio = 0.3 * torch.randn(2, int(seconds * session.sample_rate), generator=noise)
            made[seconds] = session.prepare_source(audio, session.sample_rate)
        return made[seconds]

    return make


class Delivered:
    """The newest latent a runner's stream delivered (its real tick, watched): the whole loop (`runner.latest`), or
    the newest window, checked against the timeline the writer decodes."""

    def __init__(self, runner: LiveRunner):
        self.runner = runner
        self.item = None
        real_tick = runner.stream.tick

        def tick():
            finished = real_tick()
            if finished:
                self.item = finished[-1]
            return finished

        runner.stream.tick = tick

    def latest(self) -> torch.Tensor:
        runner, item = self.runner, self.item
        place = item.request.window
        if place is None:
            assert item.latent is runner.latest
            return runner.latest.clone()
        assert item.latent.shape[1] == runner.request_frames < runner.latest.shape[1], "a window of the timeline"
        # the window lands after the frozen frontier (the frames whose audio is written keep it) and after its kept
        # frames; from there the timeline the writer decodes holds it bit for bit
        landed = max(place.keep, runner._walker.timeline.frozen - place.start)
        assert landed < place.frames, f"the window landed nowhere: {place}, frozen at {runner._walker.timeline.frozen}"
        on_timeline = cyclic_crop(runner.latest, place.start, place.frames)
        assert torch.equal(on_timeline[:, landed:], item.latent[:, landed:]), "the window is not on the timeline"
        return item.latent.clone()


def latent_after(delivered: Delivered, seq: int, nth: int = 1) -> torch.Tensor:
    """Step the runner until the `nth` latent whose request was made after registry change `seq`; returns it."""
    runner = delivered.runner
    seen = 0
    for _ in range(MAX_STEPS):
        count = runner.stats.latents
        runner.step()
        if runner.stats.latents > count and runner.latest_seq >= seq:
            seen += 1
            if seen == nth:
                return delivered.latest()
    pytest.fail(f"no latent made after change {seq} within {MAX_STEPS} ticks")


class Rig:
    """A runner on a loop buffer, stepped in this thread; the audio callback's renderer reads the same buffer."""

    def __init__(self, session: Session, case: KnobCase, source, window_s: float):
        self.registry = KnobRegistry()
        self.registry.set("denoise", 1.0, origin="test")
        for name, value in case.setting.items():
            self.registry.set(name, value, origin="test")
        seconds = song_seconds(window_s)
        frames = round(seconds * 25) * session.models.vae.hop_samples
        self.buffer = LoopBuffer(frames, channels=2, sample_rate=session.sample_rate)
        self.runner = LiveRunner(
            session,
            self.registry,
            self.buffer,
            "knob probe a",
            "knob probe b",
            source(seconds) if case.source else None,
            config=runner_config(window_s),
        )
        assert (self.runner.request_frames < self.runner.frames) == (window_s > 0)
        self.delivered = Delivered(self.runner)
        self.renderer = BlockRenderer(self.buffer, 1024, None)
        if case.target_seed is not None:  # OSC /target/capture while another seed plays, then back to the default seed
            self.registry.set("seed", case.target_seed, origin="test")
            self.latent_after(self.registry.seq)
            self.runner.capture_target()
            self.registry.reset("seed")

    def latent_after(self, seq: int, nth: int = 1) -> torch.Tensor:
        return latent_after(self.delivered, seq, nth)

    def latents_in(self, ticks: int) -> int:
        delivered = self.runner.stats.latents
        for _ in range(ticks):
            self.runner.step()
        return self.runner.stats.latents - delivered

    def played_block(self) -> tuple[np.ndarray, np.ndarray]:
        """(loop content, what the audio callback plays of it) for one block where the runner has written audio;
        the volume ramps over one block, so the block before it is rendered first."""
        written = int(np.flatnonzero(np.abs(self.buffer.data[:, 0]) > 0)[0])
        self.buffer.counters[PLAYED] = written
        loop = self.buffer.data[written + 1024 : written + 2048].copy()
        block = np.zeros((1024, 2), np.float32)
        for _ in range(2):
            self.renderer.render(block, 1024)
        return loop, block.copy()

    def close(self) -> None:
        self.buffer.unlink()


@pytest.fixture
def rig(request, session, noise_source):
    rigs = []

    def make(case: KnobCase, window_s: float) -> Rig:
        rigs.append(Rig(session, case, noise_source, window_s))
        return rigs[-1]

    yield make
    for made in rigs:
        made.close()


def relative_change(changed: torch.Tensor, original: torch.Tensor) -> float:
    return float((changed - original).norm() / original.norm())


def test_every_registry_knob_has_an_effect_test():
    assert set(CASES) == {spec.name for spec in KNOB_SPECS}, "add a KnobCase for every knob (or remove the knob)"


@WINDOWS
@pytest.mark.parametrize("knob", [spec.name for spec in KNOB_SPECS if spec.name not in ("depth", "volume")])
def test_knob_changes_the_next_generation_and_restores_it_bit_for_bit(rig, knob, window_s):
    case = CASES[knob]
    run = rig(case, window_s)
    depth = int(run.registry.get("depth"))
    start = run.registry.seq
    original = run.latent_after(start, nth=depth + 1)
    assert torch.equal(run.latent_after(start, nth=1), original), "an untouched run must repeat itself exactly"
    spec = run.registry.specs[knob]
    moved = run.registry.set(knob, case.changed, origin="osc")
    change = relative_change(run.latent_after(moved.seq), original)
    assert change > MIN_RELATIVE_CHANGE, f"{knob} {case.changed}: the next generation changed by {change:.2e} only"
    back = run.registry.set(knob, 1.0 if knob == "denoise" else spec.default, origin="osc")
    restored = run.latent_after(back.seq, nth=depth + 1)
    assert torch.equal(restored, original), f"{knob} set back: max difference {(restored - original).abs().max():.2e}"


@WINDOWS
@pytest.mark.parametrize("knob", [spec.name for spec in KNOB_SPECS if spec.kind is KnobKind.SHARED])
def test_shared_knob_reaches_the_generations_already_in_flight(rig, knob, window_s):
    """Generations submitted BEFORE the change and delivered after it differ: every one that still had a step to
    take after the change. A slot in its last step is exempt for two knobs: ode_noise adds noise only at t' > 0,
    and sde_denoise's last step mixes toward the previous loop, which an unchanged run's last step already equals."""
    case = CASES[knob]
    run = rig(case, window_s)
    depth = int(run.registry.get("depth"))
    original = run.latent_after(run.registry.seq, nth=depth + 1)
    moved = run.registry.set(knob, case.changed, origin="osc")
    in_flight = []
    while len(in_flight) < MAX_STEPS:
        delivered = run.runner.stats.latents
        run.runner.step()
        if run.runner.stats.latents > delivered:
            if run.runner.latest_seq >= moved.seq:
                break
            in_flight.append(relative_change(run.delivered.latest(), original))
    assert len(in_flight) >= depth - 1, (
        f"expected the {depth} in-flight generations to finish first, got {len(in_flight)}"
    )
    exempt = 1 if knob in ("ode_noise", "sde_denoise") else 0
    assert all(change > MIN_RELATIVE_CHANGE for change in in_flight[exempt:]), f"{knob}: in-flight changes {in_flight}"


@WINDOWS
def test_depth_changes_how_often_a_generation_arrives_and_restores(rig, window_s):
    run = rig(CASES["depth"], window_s)
    original = run.latent_after(run.registry.seq, nth=5)
    per_16_ticks = run.latents_in(16)
    run.registry.set("depth", CASES["depth"].changed, origin="osc")
    run.latents_in(8)  # the removed slots finish their work
    assert run.latents_in(16) <= per_16_ticks // 2, "half the depth must deliver at most half as often"
    assert run.runner.stream.pipeline.stats()["rows"] == 2
    back = run.registry.set("depth", 4, origin="osc")
    restored = run.latent_after(back.seq, nth=5)
    assert run.latents_in(16) == per_16_ticks and run.runner.stream.pipeline.stats()["rows"] == 4
    assert torch.equal(restored, original), "depth set back: the generations must be the untouched run's"


@WINDOWS
def test_volume_scales_what_is_played_and_restores_it_bit_for_bit(rig, window_s):
    run = rig(CASES["volume"], window_s)
    run.latent_after(run.registry.seq, nth=2)  # the loop now holds generated audio
    loop, played = run.played_block()
    assert np.abs(loop).max() > 1e-3, "the loop must hold audible audio for this test"
    assert np.array_equal(played, loop * 0.8), "at the default volume the callback plays the loop times 0.8"
    run.registry.set("volume", CASES["volume"].changed, origin="osc")
    run.runner.step()  # the runner applies the knob at the top of its tick
    loop, played = run.played_block()
    ratio = np.abs(played).max() / np.abs(loop * 0.8).max()
    assert abs(ratio - 0.3 / 0.8) < 1e-4, f"volume 0.3 must play 0.375 of the default level, got {ratio:.4f}"
    run.registry.set("volume", 0.8, origin="osc")
    run.runner.step()
    loop, played = run.played_block()
    assert np.array_equal(played, loop * 0.8), "volume set back must play exactly what an untouched run plays"


@WINDOWS
def test_osc_cfg_mode_guidance_negative_prompt_and_target_capture_change_the_sound(session, window_s):
    """The knobs that did nothing before: played over OSC (python-osc as the controller), felt in the latents."""
    registry = KnobRegistry()
    registry.set("denoise", 1.0, origin="test")
    config = LiveConfig(
        prompt="knob probe a",
        song_seconds=song_seconds(window_s),
        playback_mode="null",
        osc_port=0,
        runner=runner_config(window_s),
    )
    app = LiveApp(session, config, registry)
    app.osc.start()
    client = SimpleUDPClient("127.0.0.1", app.osc.address[1])
    run = app.runner
    assert (run.request_frames < run.frames) == (window_s > 0)
    delivered = Delivered(run)

    def after(seq: int) -> torch.Tensor:
        return latent_after(delivered, seq, nth=5)

    def applied(count: int) -> None:
        wait_for(lambda: app.osc.stats()["applied"] >= count, 10, f"{count} OSC messages applied")
        wait_for(lambda: not run.encoding, 10, "prompt encoding")

    try:
        plain = after(0)
        client.send_message("/flowjam/default/knob/cfg_mode", "full")
        client.send_message("/flowjam/default/knob/guidance", 4.0)
        applied(2)
        guided = after(registry.seq)
        assert relative_change(guided, plain) > MIN_RELATIVE_CHANGE, "cfg full + guidance 4 must change the sound"
        assert run.status()["cfg_mode"] == "full"
        client.send_message("/flowjam/default/prompt/negative", "harsh distorted noise")
        applied(3)
        away = after(registry.seq)
        assert relative_change(away, guided) > MIN_RELATIVE_CHANGE, "a negative prompt must change the guided sound"
        client.send_message("/flowjam/default/prompt/negative", "")
        applied(4)
        assert torch.equal(after(registry.seq), guided), "an empty negative prompt is the null condition again"
        client.send_message("/flowjam/default/knob/cfg_mode", "off")
        client.send_message("/flowjam/default/knob/seed", 9)
        applied(6)
        other_seed = after(registry.seq)
        client.send_message("/flowjam/default/target/capture", 1)
        applied(7)
        client.send_message("/flowjam/default/knob/seed", 42)
        client.send_message("/flowjam/default/knob/x0_target_strength", 0.9)
        applied(9)
        pulled = after(registry.seq)
        assert relative_change(pulled, other_seed) < relative_change(plain, other_seed) * 0.8, (
            "x0_target_strength 0.9 must pull the seed-42 loop toward the captured seed-9 loop"
        )
        assert run.status()["target"] == "captured"
        assert app.osc.stats()["rejected"] == {}, app.osc.stats()["rejected"]
    finally:
        app.osc.stop()
        run.stop()
        app.buffer.unlink()
    assert run.stats.errors == 0, run.stats.last_error

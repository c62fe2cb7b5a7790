"""Live sessions on one shared ring (live/shared_ticker.py) and the host that serves them (serve/host.py):
each session's runner keeps its own knobs, prompts and loop; every tick is one forward over all of them; a session
plays bit for bit what it plays alone (CPU fp32), its knobs reach only its own audio, and the host's clock plays
every loop in real time to its subscribers without ever waiting for a slow one."""

import random
import time

import numpy as np
import pytest
import torch
from flowjam.engine.lora import lora_set
from flowjam.live.app import add_lora_knobs
from flowjam.live.knobs import KnobRegistry
from flowjam.live.loop_buffer import LoopBuffer
from flowjam.live.runner import LiveRunner, RunnerConfig
from flowjam.live.shared_ticker import SharedTicker
from flowjam.live.sync.grid import Grid
from flowjam.serve.bench import measure_sessions
from flowjam.serve.errors import SessionRefused, UnknownSession
from flowjam.serve.host import HostOptions, RingHost, SessionSpec
from flowjam.serve.protocol import decode_chunk
from helpers import ADMIT_ANY_SPEED_MS, wait_for

SECONDS = 10.0  # T = 250 frames: batch-size-invariant CPU GEMMs, so sharing a batch changes no bit
TICKS = 16


class Player:
    """A runner on a loop buffer of its own, on `ring` or alone, stepped by hand."""

    def __init__(
        self,
        session,
        prompt: str,
        knobs: dict,
        ring: SharedTicker | None = None,
        name: str = "me",
        config: RunnerConfig | None = None,
    ):
        self.registry = KnobRegistry()
        add_lora_knobs(self.registry, session)
        for knob, value in knobs.items():
            self.registry.set(knob, value, origin="test")
        frames = round(SECONDS * 25) * session.models.vae.hop_samples
        self.buffer = LoopBuffer(frames, channels=2, sample_rate=session.sample_rate)
        self.runner = LiveRunner(
            session, self.registry, self.buffer, prompt, ticker=ring, name=name, config=config or RunnerConfig()
        )
        self.latents: list[torch.Tensor] = []

    def collect(self) -> None:
        latest = self.runner.latest
        if latest is not None and (not self.latents or latest is not self.latents[-1]):
            self.latents.append(latest)

    def close(self) -> None:
        self.runner.stop()
        self.buffer.unlink()


@pytest.fixture
def players(session):
    made: list[Player] = []

    def make(*args, **kwargs) -> Player:
        made.append(Player(session, *args, **kwargs))
        return made[-1]

    yield make
    for player in made:
        player.close()


def play_alone(player: Player, ticks: int = TICKS, at: dict | None = None) -> list[torch.Tensor]:
    for tick in range(ticks):
        for knob, value in (at or {}).get(tick, {}).items():
            player.registry.set(knob, value, origin="test")
        player.runner.step()
        player.collect()
    return player.latents


def play_ring(ring: SharedTicker, players: list[Player], ticks: int = TICKS, at: dict | None = None) -> None:
    for tick in range(ticks):
        for player, knob, value in (at or {}).get(tick, ()):
            player.registry.set(knob, value, origin="test")
        ring.step()
        for player in players:
            player.collect()


ME = {"depth": 2, "steps": 4, "cfg_mode": "full", "guidance": 2.5}
DRUMS = {"depth": 4, "steps": 8, "seed": 7}


def test_a_live_session_on_a_shared_ring_plays_bit_for_bit_as_alone(session, players):
    alone = play_alone(players("mellow piano", ME))
    assert len(alone) >= 4

    ring = SharedTicker(session)
    me, drums = players("mellow piano", ME, ring, "me"), players("breakbeat drums", DRUMS, ring, "drums")
    play_ring(ring, [me, drums], at={3: [(drums, "velocity_scale", 1.4)], 6: [(drums, "denoise", 0.6)]})
    assert ring.pipeline.stats()["rows"] > 4, "the other session's rows were not in the same forward"
    assert drums.latents, "the other session delivered nothing"
    assert len(me.latents) == len(alone)
    for index, (shared, solo) in enumerate(zip(me.latents, alone)):
        assert torch.equal(shared, solo), f"latent {index}: sharing the ring changed this session's latent"
    assert not torch.equal(me.latents[-1], drums.latents[-1])


def test_a_knob_on_one_session_changes_it_and_leaves_the_other_bit_for_bit(session, players):
    ring = SharedTicker(session)
    a, b = players("a", ME, ring, "a"), players("b", ME, ring, "b")
    play_ring(ring, [a, b])
    ring_b = SharedTicker(session)
    a2, b2 = players("a", ME, ring_b, "a"), players("b", ME, ring_b, "b")
    play_ring(ring_b, [a2, b2], at={2: [(b2, "velocity_scale", 1.5)]})
    assert all(torch.equal(x, y) for x, y in zip(a.latents, a2.latents)) and len(a.latents) == len(a2.latents)
    assert not torch.equal(b.latents[-1], b2.latents[-1]), "the knob did not change its own session"


def test_a_lora_knob_on_one_session_is_its_own_strength_heard_as_alone(session, players, tint_lora):
    knob = f"lora/{tint_lora}"
    solo = play_alone(players("mellow piano", {**ME, knob: 0.3}))  # alone, the knob sets the decoder's strength
    lora_set(session.models.acestep.decoder).set_strength(tint_lora, 1.0)
    ring = SharedTicker(session)
    quiet = players("mellow piano", {**ME, knob: 0.3}, ring, "quiet")
    loud = players("mellow piano", ME, ring, "loud")
    play_ring(ring, [quiet, loud], at={2: [(loud, knob, 1.8)]})
    assert len(quiet.latents) == len(solo) >= 4
    for index, (shared, own) in enumerate(zip(quiet.latents, solo)):
        assert torch.equal(shared, own), f"latent {index}: the other session's LoRA strength reached this one"
    assert (quiet.latents[-1] - loud.latents[-1]).abs().max() > 1e-3, "the strength knobs changed nothing"
    assert loud.runner.stream.lora_strength(tint_lora) == 1.8 and quiet.runner.stream.lora_strength(tint_lora) == 0.3
    assert lora_set(session.models.acestep.decoder).strength(tint_lora) == 1.0, "a session knob moved everyone's"
    assert quiet.runner.stats.errors == 0 and loud.runner.stats.errors == 0


def test_ending_a_session_leaves_the_others_playing(session, players):
    ring = SharedTicker(session)
    a, b = players("a", ME, ring, "a"), players("b", ME, ring, "b")
    a.runner.start(), b.runner.start()
    deadline = time.monotonic() + 60
    while min(a.runner.stats.latents, b.runner.stats.latents) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    a.runner.stop()
    assert ring.pipeline.lane_names == ["main", "b"]
    latents = b.runner.stats.latents
    while b.runner.stats.latents < latents + 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert b.runner.stats.latents >= latents + 3 and b.runner.alive and not a.runner.alive
    assert b.runner.stats.errors == 0, b.runner.stats.last_error


PINNED_WRITES = RunnerConfig(min_lead_s=0.1, max_lead_s=0.1, patch_s=4.0)  # every write from 0.1 s, 4 s or more


def test_one_ring_writer_writes_each_session_its_own_audio(session, players):
    """The ring's writer decodes every session's window in one batch: each buffer gets its own session's newest
    latent, decoded (no output reads the buffers: the playhead stays at 0, so every write starts at the 0.1 s lead)."""
    ring = SharedTicker(session, batched_writes=True)
    sessions = [("mellow piano", ME), ("breakbeat drums", DRUMS), ("choir pad", {**ME, "seed": 3})]
    played = [players(prompt, knobs, ring, f"s{i}", PINNED_WRITES) for i, (prompt, knobs) in enumerate(sessions)]
    for _ in range(12):
        ring.step()
    assert ring.writer.windows > ring.writer.batches > 0, "no batch held more than one session's window"
    rate, hop, fade = session.sample_rate, session.models.vae.hop_samples, 480
    start = int(0.1 * rate)
    kept = slice(start + fade, start + 3 * rate)  # inside the newest write, past its fade-in
    heard = [player.buffer.snapshot()[:, kept] for player in played]
    for index, player in enumerate(played):
        assert player.runner.stats.writes >= 3 and player.runner.stats.errors == 0, player.runner.stats.last_error
        window = session.decode(player.runner.latest, t_start=(start // hop) / 25, window_s=4.0, cyclic=True)
        own = window[:, start % hop + fade : start % hop + 3 * rate].numpy()
        np.testing.assert_allclose(heard[index], own, atol=1e-5, err_msg=f"session {index} holds other audio")
    assert np.abs(heard[0] - heard[1]).max() > 1e-3, "two sessions' buffers hold the same audio"


def test_a_ring_that_overlaps_its_ticks_plays_bit_for_bit_what_it_plays_in_turn(session, players):
    """The overlapped cycle (runners' turns and hand-out beside the GPU's tick) queues the same work in the same
    order: with the knobs moved between steps, every latent is the plain cycle's, bit for bit, and so is the audio
    written."""
    sessions = [("mellow piano", ME), ("breakbeat drums", DRUMS)]
    played = {}
    for overlap in (False, True):
        ring = SharedTicker(session, batched_writes=True, overlap_ticks=overlap)
        pair = [players(prompt, knobs, ring, f"s{i}", PINNED_WRITES) for i, (prompt, knobs) in enumerate(sessions)]
        moves = {3: [(pair[1], "velocity_scale", 1.4)], 5: [(pair[0], "guidance", 3.0)], 7: [(pair[1], "denoise", 0.6)]}
        play_ring(ring, pair, ticks=12, at=moves)
        played[overlap] = pair
    for plain, overlapped in zip(played[False], played[True]):
        assert len(overlapped.latents) == len(plain.latents) >= 3
        for index, (a, b) in enumerate(zip(plain.latents, overlapped.latents)):
            assert torch.equal(a, b), f"latent {index}: the overlapped cycle changed it"
        assert overlapped.runner.stats.writes == plain.runner.stats.writes
        written = slice(0, int(3.1 * session.sample_rate))  # the writes' first 3 s: their length follows timing,
        # and a longer window's convolutions round a last bit differently
        np.testing.assert_allclose(
            overlapped.buffer.snapshot()[:, written], plain.buffer.snapshot()[:, written], atol=1e-6
        )
        assert overlapped.runner.stats.ticks == plain.runner.stats.ticks == 12
        assert overlapped.runner.stats.errors == 0, overlapped.runner.stats.last_error
    with pytest.raises(ValueError, match="overlap_ticks needs batched_writes"):
        SharedTicker(session, overlap_ticks=True)


def test_a_ring_that_overlaps_its_ticks_hears_each_sessions_knob_and_ends_cleanly(session, players):
    ring = SharedTicker(session, batched_writes=True, overlap_ticks=True)
    a, b = players("a", ME, ring, "a"), players("b", ME, ring, "b")
    a.runner.start(), b.runner.start()
    wait_for(lambda: min(a.runner.stats.writes, b.runner.stats.writes) >= 3, 60, "both sessions' first writes")
    a.registry.set("velocity_scale", 1.3, origin="test")
    b.registry.set("denoise", 0.5, origin="test")

    def heard(player: Player, knob: str) -> list:
        return [record for record in player.runner.stats.latencies if record.change.name == knob]

    wait_for(lambda: heard(a, "velocity_scale") and heard(b, "denoise"), 60, "both knobs heard")
    for player, knob, kind in ((a, "velocity_scale", "shared"), (b, "denoise", "request")):
        (record,) = heard(player, knob)
        assert record.kind.value == kind and 0 < record.knob_to_tick_ms < record.knob_to_ear_ms, record
    a.runner.stop()
    writes = b.runner.stats.writes
    wait_for(lambda: b.runner.stats.writes >= writes + 3, 60, "the other session's writes after one ended")
    assert b.runner.stats.errors == 0 and a.runner.stats.errors == 0, b.runner.stats.last_error
    ring.stop()
    assert not ring.alive and not b.runner.writer.running


@pytest.mark.parametrize("batched_writes", [False, True], ids=["a writer each", "one ring writer"])
def test_ending_a_session_while_the_ring_writes_leaves_the_others_written(session, players, batched_writes):
    ring = SharedTicker(session, batched_writes=batched_writes)
    a, b = players("a", ME, ring, "a"), players("b", ME, ring, "b")
    a.runner.start(), b.runner.start()
    deadline = time.monotonic() + 60
    while min(a.runner.stats.writes, b.runner.stats.writes) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert a.runner.writer.running and b.runner.writer.running
    a.runner.stop()
    writes = b.runner.stats.writes
    while b.runner.stats.writes < writes + 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert b.runner.stats.writes >= writes + 3 and not a.runner.writer.running
    assert b.runner.stats.errors == 0, b.runner.stats.last_error
    if batched_writes:
        assert ring.writer.windows > ring.writer.batches, "the two sessions' windows were never decoded together"
        ring.stop()
        assert not b.runner.writer.running, "the ring's writer outlived the ring"


# ---- the host ------------------------------------------------------------------------------------------------


@pytest.fixture
def host(session):
    made = RingHost(session, latent_interval_ms=ADMIT_ANY_SPEED_MS)
    yield made
    made.close()


def drain(subscription, seconds: float) -> list:
    chunks, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        data = subscription.get(0.05)
        if data is not None:
            chunks.append(decode_chunk(data))
    return chunks


def test_the_host_plays_each_session_in_real_time_to_its_subscribers(host):
    host.create("a", SessionSpec("lofi piano", seconds=4, knobs={"depth": 2}))
    host.create("b", SessionSpec("drums", seconds=4, knobs={"depth": 2, "seed": 3}))
    listen_a, listen_b = host.subscribe("a"), host.subscribe("b", max_chunks=100)
    started = time.monotonic()
    chunks = drain(listen_a, 2.0)
    elapsed = time.monotonic() - started
    assert abs(sum(c.frames for c in chunks) / 48_000 - elapsed) < 0.3, "the clock does not play in real time"
    samples = [c.sample for c in chunks]
    assert samples == list(range(samples[0], samples[0] + 2400 * len(samples), 2400)), "chunks skipped or repeated"
    assert max(np.abs(c.audio).max() for c in chunks[-10:]) > 0.01, "the session is silent"
    late = drain(listen_b, 0.1)
    assert len(late) >= 30 and listen_b.dropped == 0, "two seconds of chunks wait for a subscriber"
    assert host.status("a")["errors"] == 0


def test_a_slow_subscriber_loses_its_oldest_chunks_not_the_others_time(host):
    host.create("a", SessionSpec("lofi piano", seconds=4, knobs={"depth": 2}))
    slow, keen = host.subscribe("a", max_chunks=5), host.subscribe("a")
    chunks = drain(keen, 1.5)
    assert len(chunks) >= 25 and all(c.dropped == 0 for c in chunks)
    assert slow.dropped >= 20
    kept = [decode_chunk(slow.get(0)) for _ in range(5)]
    assert [c.sample - kept[0].sample for c in kept] == [2400 * i for i in range(5)]
    assert kept[-1].sample >= chunks[-1].sample, "the slow subscriber did not keep the newest chunks"
    assert kept[0].dropped >= 20, "the chunks do not tell the client how many were dropped"


def test_host_knobs_are_checked_all_first_and_reach_only_their_session(host):
    host.create("a", SessionSpec("lofi piano", seconds=4))
    host.create("b", SessionSpec("drums", seconds=4))
    with pytest.raises(ValueError, match="velocity_scale"):
        host.set_knobs("a", {"denoise": 0.5, "velocity_scale": float("nan")})
    with pytest.raises(ValueError, match="cfg_mode"):
        host.set_knobs("a", {"denoise": 0.5, "cfg_mode": "loud"})
    assert host.status("a")["knobs"]["denoise"] == 0.7, "a rejected batch applied part of itself"
    assert host.set_knobs("a", {"velocity_scale": 99}) == {"velocity_scale": 2.0}, "out of range is clamped, as OSC"
    with pytest.raises(ValueError, match="no_such_knob"):
        host.set_knobs("a", {"no_such_knob": 1})
    assert host.set_knobs("a", {"denoise": 0.5, "cfg_mode": "full"}) == {"denoise": 0.5, "cfg_mode": "full"}
    status_a, status_b = host.status("a"), host.status("b")
    assert status_a["knobs"]["denoise"] == 0.5 and status_a["knobs"]["cfg_mode"] == "full"
    assert status_b["knobs"]["denoise"] == 0.7 and status_b["knobs"]["cfg_mode"] != "full"
    with pytest.raises(UnknownSession, match="POST /sessions"):
        host.status("nobody")
    with pytest.raises(ValueError, match="prompt"):
        host.create("c", SessionSpec("  "))
    with pytest.raises(ValueError, match="playing already"):
        host.create("a", SessionSpec("again", seconds=4))


def test_each_sessions_knob_reaches_the_ring_in_the_first_cycle_that_begins_after_it(host):
    """The scheduling rule of a shared ring: a knob waits for no session's turn, at most the cycle in progress."""
    names = ("a", "b", "c")
    for index, name in enumerate(names):
        host.create(name, SessionSpec("lofi piano", seconds=4, knobs={"depth": 2, "seed": index}))
    runners = [host.runner(name) for name in names]
    wait_for(lambda: all(runner.stats.latents >= 1 for runner in runners), 120, "every session's first latent")
    pause = random.Random(46)
    values = [round(0.5 + 0.02 * turn, 2) for turn in range(36)]
    sent: dict[str, list[float]] = {name: [] for name in names}
    for turn, value in enumerate(values):  # at random moments of the ring's cycle, each session in turn
        name = names[turn % len(names)]
        host.set_knobs(name, {"velocity_scale": value})
        sent[name].append(value)
        time.sleep(pause.uniform(0.0, max(runner.stats.loop_s for runner in runners)))  # up to a ring cycle

    def heard(name: str) -> list:
        return [r for r in host.runner(name).stats.latencies if r.change.name == "velocity_scale"]

    wait_for(
        lambda: all(heard(name) and heard(name)[-1].change.value == sent[name][-1] for name in names),
        120,
        "every session's last change to reach its ear",
    )
    for name in names:
        records = heard(name)
        applied = [r.change.value for r in records]
        assert applied == [value for value in sent[name] if value in applied], "a change went astray"
        assert len(records) >= len(sent[name]) // 2, f"session {name}: most changes were superseded before a cycle"
        waited = [r.cycles_waited for r in records]
        assert waited == [0] * len(records), f"session {name}: a knob waited ring cycles {waited} before applying"
        assert all(0 < r.knob_to_tick_ms for r in records)
    assert all(host.status(name)["errors"] == 0 for name in names)
    # what a client through the gateway reads: the newest changes heard, as the session's records say
    shown = [h for h in host.status("b")["heard"] if h["knob"] == "velocity_scale"]
    assert shown and [h["value"] for h in shown] == [r.change.value for r in heard("b")][-len(shown) :]
    assert all(h["kind"] == "shared" and 0 < h["to_tick_ms"] < h["to_ear_ms"] for h in shown), shown


def test_the_host_refuses_a_session_it_could_not_keep_in_real_time(session):
    host = RingHost(session, latent_interval_ms=0.01)  # no tick is fast enough: refused once ticks are measured
    try:
        host.create("first", SessionSpec("lofi", seconds=4, knobs={"depth": 2}))
        wait_for(lambda: host.status("first")["ticks"] >= 3, 30, "three ticks of 'first' to be measured")
        with pytest.raises(SessionRefused, match=r"(behind|a latent every 0\.01 ms).*another replica"):
            host.create("second", SessionSpec("jazz", seconds=4))
        assert host.names() == ["first"] and host.status("first")["errors"] == 0
    finally:
        host.close()


def test_the_host_refuses_a_depth_its_ring_could_not_keep_in_real_time(session):
    host = RingHost(session, latent_interval_ms=0.01)
    try:
        host.create("deep", SessionSpec("lofi", seconds=4, knobs={"depth": 1}))
        wait_for(lambda: host.status("deep")["ticks"] >= 3, 30, "three ticks of 'deep' to be measured")
        with pytest.raises(ValueError, match=r"depth 4 refused: .* rows .* this session \(depth 4, 8 steps\)"):
            host.set_knobs("deep", {"depth": 4, "denoise": 0.5})
        knobs = host.status("deep")["knobs"]
        assert knobs["depth"] == 1 and knobs["denoise"] == 0.7, "a refused batch applied part of itself"
    finally:
        host.close()


def test_a_host_started_with_a_lora_gives_every_session_its_own_strength_knob(glow_lora_file, tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        HostOptions(loras=((str(tmp_path / "missing.safetensors"), 1.0),)).build()
    host = HostOptions(loras=((str(glow_lora_file), 0.7),), latent_interval_ms=ADMIT_ANY_SPEED_MS).build()
    try:
        host.create("a", SessionSpec("lofi piano", seconds=4, knobs={"depth": 1}))
        host.create("b", SessionSpec("drums", seconds=4, knobs={"depth": 1, "lora/glow": 0.2}))
        assert host.status("a")["knobs"]["lora/glow"] == 0.7 and host.status("b")["knobs"]["lora/glow"] == 0.2
        assert host.set_knobs("a", {"lora/glow": 5}) == {"lora/glow": 2.0}, "out of range is clamped, as OSC"
        lanes = {name: host._sessions[name].runner.stream for name in ("a", "b")}
        wait_for(lambda: lanes["a"].lora_strength("glow") == 2.0, 30, "session a's lane to take lora/glow 2.0")
        assert lanes["a"].lora_strength("glow") == 2.0 and lanes["b"].lora_strength("glow") == 0.2
        assert lora_set(host.session.models.acestep.decoder).strength("glow") == 0.7, "a session moved the shared"
        assert host.status("a")["errors"] == 0 and host.status("b")["errors"] == 0
    finally:
        host.close()


@pytest.mark.parametrize("batched_writes", [False, True], ids=["a writer each", "one ring writer"])
def test_the_sessions_bench_plays_every_session_follows_its_knobs_to_the_ear_and_splits_the_cycle(
    session, tint_lora, batched_writes
):
    backend, session.backend = session.backend, "graph"  # the tick-plan path CI can run: the bench waits it settles
    try:
        host = RingHost(session, latent_interval_ms=ADMIT_ANY_SPEED_MS, batched_writes=batched_writes)
    finally:
        session.backend = backend
    try:
        report = measure_sessions(host, 2, song_seconds=4.0, depth=1, trials=2, lora=tint_lora)
    finally:
        host.close()
    assert report.sessions == 2 and report.refused is None and report.errors == 0
    assert 0 <= report.late_writes <= report.writes and report.writes >= 2 * report.sessions
    assert (report.write_batches > 0) == batched_writes and report.write_batches <= report.writes
    assert [summary.knob for summary in report.knobs] == ["velocity_scale", "denoise"]
    assert 0 < report.latent_interval_ms < 60_000 and 0 < report.restarting_interval_ms < 60_000
    assert report.cycles_per_latent > 0 and report.settle_s is not None and None not in report.touch_settle_s
    assert all(summary.ear_ms_median > summary.tick_ms_median > 0 for summary in report.knobs)
    phases = report.phases
    assert phases.cycles > 3 and phases.tick_ms > 0 and phases.runners_ms > 0
    parts_ms = phases.runners_ms + phases.tick_ms + phases.handout_ms
    assert phases.cycle_ms * 0.5 <= parts_ms <= phases.cycle_ms + 1e-9, "the phases do not add up to the cycle"
    assert host.names() == [], "the bench left sessions playing"


def test_a_session_on_a_grid_loops_whole_bars_with_the_tempo_in_its_metas(host):
    host.create("g", SessionSpec("drums", bpm=123, time_signature="3/4", bars=2, knobs={"depth": 2}))
    status = host.status("g")
    assert status["loop_s"] == round(Grid(123, 3).loop_samples(2, 48_000) / 48_000, 3) == 2.927
    runner = host.runner("g")
    assert runner.config.bpm == 123 and runner.config.time_signature == 3
    assert runner.frames == 74, "2 bars of 3/4 at 123 BPM: 140,488 samples over 74 latent frames (73.2)"
    listen = host.subscribe("g")
    assert max(np.abs(c.audio).max() for c in drain(listen, 1.5)[-5:]) > 0.01, "the session is silent"
    for spec, message in (
        (SessionSpec("x", bars=2), "bars and time_signature need a tempo"),
        (SessionSpec("x", bpm=400), "bpm must be a number in 30..300"),
        (SessionSpec("x", bpm=120, bars=0), "bars must be a whole number"),
        (SessionSpec("x", bpm=120, bars=2, endless=True), "an endless session has none"),
        (SessionSpec("x", bpm=120, time_signature=5), "numerator must be one of"),
    ):
        with pytest.raises(ValueError, match=message):
            host.create("x", spec)
    assert host.status("g")["errors"] == 0

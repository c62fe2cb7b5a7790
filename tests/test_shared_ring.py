"""Several sessions in one ring (lanes of a StreamPipeline): one batched forward per tick over every session's
rows, each session isolated (bit for bit what it plays alone, whatever the others do), its knobs its own, and
admission control that refuses a session the measured tick cost says could not be kept in real time."""

import pytest
import torch
from flowjam.engine.bench.ticks import random_lora
from flowjam.engine.lora import lora_set
from flowjam.engine.stream import MAX_LANES, RealtimeNeed, StreamPipeline
from helpers import ADMIT_ANY_SPEED_MS

SECONDS = 10.0  # T = 250 frames, as the stream tests: batch-size-invariant CPU GEMMs
TICKS = 14


def play(pipeline, lanes, requests, ticks=TICKS):
    """Submit each lane's next request every tick (seeds 0, 1, ...) and tick; latents delivered, by lane."""
    delivered = {lane.name: [] for lane in lanes}
    for tick in range(ticks):
        for lane in lanes:
            lane.submit(requests[lane.name](tick))
        for finished in pipeline.tick():
            delivered[finished.lane].append((finished.request.seed, finished.latent.clone()))
    return delivered


def test_a_session_plays_bit_for_bit_as_alone_whatever_the_others_do(session, prompts, source):
    a, b, null = prompts
    decoder = session.models.acestep.decoder

    def mine(tick):
        return session.make_request(a, SECONDS, seed=tick, steps=4, cfg_mode="full", negative=null, guidance=2.5)

    alone_ring = StreamPipeline(decoder, depth=1)
    alone = play(alone_ring, [alone_ring.add_lane("me", depth=2)], {"me": mine})["me"]
    assert len(alone) >= 4

    shared_ring = StreamPipeline(decoder, depth=1)
    lanes = [shared_ring.add_lane("me", depth=2), shared_ring.add_lane("drums", 4), shared_ring.add_lane("cover", 3)]
    lanes[1].set_shared_curve("guidance", 6.0)
    requests = {
        "me": mine,
        "drums": lambda tick: session.make_request(b, SECONDS, seed=100 + tick, steps=8, cfg_mode="self"),
        "cover": lambda tick: session.make_request(
            a, SECONDS, source=source, seed=200 + tick, steps=6, denoise=0.7, cfg_mode="full", negative=null
        ),
    }
    together = play(shared_ring, lanes, requests)
    assert shared_ring.stats()["rows"] > 4, "the other sessions' rows were not in the same forward"
    assert len(together["drums"]) and len(together["cover"])
    assert [seed for seed, _ in together["me"]] == [seed for seed, _ in alone]
    for (seed, shared), (_, solo) in zip(together["me"], alone):
        assert torch.equal(shared, solo), f"seed {seed}: sharing the ring changed this session's latent"


def test_a_shared_knob_reaches_its_own_session_only(session, prompts):
    a, b, null = prompts
    decoder = session.models.acestep.decoder

    def requests(tick):
        return session.make_request(a, SECONDS, seed=tick, steps=4, cfg_mode="full", negative=null)

    def run(guidance_on_b):
        ring = StreamPipeline(decoder, depth=1)
        lanes = [ring.add_lane("a", 2), ring.add_lane("b", 2)]
        if guidance_on_b is not None:
            lanes[1].set_shared_curve("guidance", guidance_on_b)
        return play(ring, lanes, {"a": requests, "b": requests}, ticks=8)

    plain, turned = run(None), run(7.0)
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(plain["a"], turned["a"])), "b's knob reached a"
    assert any((x - y).abs().max() > 1e-3 for (_, x), (_, y) in zip(plain["b"], turned["b"])), "b's knob did nothing"


def test_admission_refuses_a_session_the_measured_ticks_could_not_keep_in_real_time(session, prompts):
    a, _, null = prompts
    ring = StreamPipeline(session.models.acestep.decoder, depth=1)
    need = RealtimeNeed(steps=8, rows_per_slot=2, latent_interval_ms=ADMIT_ANY_SPEED_MS)
    first = ring.add_lane("first", depth=2, need=need)  # nothing measured yet: admitted
    play(ring, [first], {"first": lambda t: session.make_request(a, SECONDS, seed=t, cfg_mode="full", negative=null)})
    measured = ring.predicted_tick_ms(8)
    assert measured is not None and measured > 0
    ring.add_lane("generous", depth=2, need=need)  # a minute per latent: any CPU keeps that
    impossible = RealtimeNeed(steps=8, rows_per_slot=2, latent_interval_ms=measured / 100)
    with pytest.raises(ValueError, match=r"session 'greedy' refused: .* needs a tick within .* another GPU"):
        ring.add_lane("greedy", depth=4, need=impossible)
    assert set(ring.stats()["lanes"]) == {"main", "first", "generous"}, "a refused session took a lane"
    with pytest.raises(ValueError, match="needs a tick within"):  # an existing session's need counts too
        tight = StreamPipeline(session.models.acestep.decoder, depth=1)
        kept = tight.add_lane("kept", depth=4, need=RealtimeNeed(8, 2, latent_interval_ms=2 * measured))
        play(
            tight, [kept], {"kept": lambda t: session.make_request(a, SECONDS, seed=t, cfg_mode="full", negative=null)}
        )
        for index in range(6):
            tight.add_lane(f"extra{index}", depth=8, need=RealtimeNeed(8, 2, latent_interval_ms=ADMIT_ANY_SPEED_MS))


def test_sessions_are_named_bounded_and_ended_cleanly(session, prompts):
    a, _, _ = prompts
    ring = StreamPipeline(session.models.acestep.decoder, depth=1)
    lane = ring.add_lane("one", 2)
    with pytest.raises(ValueError, match="has a session named 'one' already"):
        ring.add_lane("one", 2)
    for index in range(MAX_LANES - 1):
        ring.add_lane(f"more{index}", 1)
    with pytest.raises(ValueError, match=f"holds {MAX_LANES} sessions already"):
        ring.add_lane("one too many", 1)
    lane.submit(session.make_request(a, SECONDS, seed=1, steps=4))
    ring.tick()
    other = ring.lane("more0")
    with pytest.raises(ValueError, match="request has T=50 frames but the in-flight slots have T=250"):
        other.submit(session.make_request(a, 2.0, seed=1, steps=4))
    ring.remove_lane("one")
    with pytest.raises(ValueError, match="session 'one' has ended"):
        lane.submit(session.make_request(a, SECONDS, seed=2, steps=4))
    assert ring.idle, "an ended session's slots stayed in the ring"
    ring.add_lane("one", 2)  # its name and its slot indices are free again


def test_a_session_cannot_deepen_past_what_the_ring_keeps_in_real_time(session, prompts):
    a, _, null = prompts
    ring = StreamPipeline(session.models.acestep.decoder, depth=1)
    me = ring.add_lane(
        "me", depth=2, need=RealtimeNeed(steps=8, rows_per_slot=2, latent_interval_ms=ADMIT_ANY_SPEED_MS)
    )
    play(ring, [me], {"me": lambda t: session.make_request(a, SECONDS, seed=t, cfg_mode="full", negative=null)})
    at_12, at_24 = ring.predicted_tick_ms(12), ring.predicted_tick_ms(24)
    assert at_24 > at_12 > 0
    # a tick within (at_12 + at_24) / 2 every latent of 8 steps at depth 2 (4 ticks): 12 rows fit, 24 do not
    ring.add_lane("tight", depth=2, need=RealtimeNeed(8, 2, latent_interval_ms=4 * (at_12 + at_24) / 2))
    other = ring.add_lane("other", depth=1, need=RealtimeNeed(8, 2, latent_interval_ms=ADMIT_ANY_SPEED_MS))
    other.set_depth(2)  # 12 rows: every need kept
    with pytest.raises(ValueError, match=r"depth 8 for session 'other' refused: .* 24 rows .* session 'tight'"):
        other.set_depth(8)
    assert other.depth == 2, "a refused depth was applied"
    other.set_depth(1)  # shallower is always fine
    assert other.depth == 1


@pytest.mark.parametrize("tint_lora", ["everywhere", "per-row only"], indirect=True)
def test_each_session_hears_a_lora_at_its_own_strength_and_alone_bit_for_bit(session, prompts, tint_lora):
    a, b, null = prompts
    decoder = session.models.acestep.decoder

    def mine(tick):
        return session.make_request(a, SECONDS, seed=tick, steps=4, cfg_mode="full", negative=null)

    def alone(strength):  # a stream of its own, the decoder's (shared) strength set: no per-session path at all
        lora_set(decoder).set_strength(tint_lora, strength)
        try:
            pipeline = StreamPipeline(decoder, depth=2, paced=True)
            return play(pipeline, [pipeline.lane("main")], {"main": mine})["main"]
        finally:
            lora_set(decoder).set_strength(tint_lora, 1.0)

    quiet, shared = alone(0.3), alone(1.0)
    ring = StreamPipeline(decoder, depth=1)
    lanes = [ring.add_lane(name, depth=2) for name in ("quiet", "loud", "shared", "back")]
    lanes[0].set_lora_strength(tint_lora, 0.3)
    lanes[1].set_lora_strength(tint_lora, 1.8)
    lanes[3].set_lora_strength(tint_lora, 1.8)
    lanes[3].set_lora_strength(tint_lora, 1.0)  # turned back to the shared strength
    requests = {lane.name: mine for lane in lanes}
    requests["loud"] = lambda tick: session.make_request(b, SECONDS, seed=50 + tick, steps=4, cfg_mode="self")
    together = play(ring, lanes, requests)
    assert ring.stats()["rows"] >= 12, "the sessions' rows were not in one forward"
    for name, solo in (("quiet", quiet), ("shared", shared), ("back", shared)):
        assert len(together[name]) == len(solo) >= 4
        for (seed, mixed), (_, own) in zip(together[name], solo):
            assert torch.equal(mixed, own), f"{name}, seed {seed}: the others' LoRA strengths reached this session"
    assert all((x - y).abs().max() > 1e-4 for (_, x), (_, y) in zip(quiet, shared)), "the strength changed nothing"
    assert lanes[0].lora_strength(tint_lora) == 0.3 and lanes[2].lora_strength(tint_lora) == 1.0


def test_a_session_strength_is_refused_for_a_folded_lora_or_out_of_range(session, tint_lora):
    ring = StreamPipeline(session.models.acestep.decoder, depth=1)
    lane = ring.add_lane("me", depth=2)
    with pytest.raises(ValueError, match=r"strength must be a number in \[0, 2\]"):
        lane.set_lora_strength(tint_lora, 2.5)
    with pytest.raises(ValueError, match="no LoRA named 'nope' is loaded"):
        lane.set_lora_strength("nope", 1.0)
    loras = lora_set(session.models.acestep.decoder)
    folded = random_lora(session.models.acestep.decoder, "baked", rank=2, seed=9)
    loras.attach(folded, 1.0, "folded")
    try:
        with pytest.raises(ValueError, match="folded into the shared weights.* mode 'live'"):
            lane.set_lora_strength("baked", 0.5)
    finally:
        loras.detach("baked")
    assert lane.lora_strength(tint_lora) == 1.0

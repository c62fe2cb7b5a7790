"""The graph backend's tick through static tensors, on the CPU (the same code a CUDA graph captures, run uncaptured):
it equals the eager tick for every feature a request can use, with and without shared curves, takes prompt changes
into its static K/V, and settles into known plans."""

import pytest
import torch
from flowjam.engine.stream import DCW, ExtraCondition, StreamPipeline

SECONDS = 10.0
FRAMES = 250


def feature_requests(session, prompts, source):
    """One request per feature the tick's device work branches on."""
    a, b, null = prompts
    ramp = torch.linspace(0.0, 1.0, FRAMES)
    return [
        session.make_request(a, SECONDS, seed=1),
        session.make_request(a, SECONDS, seed=2, cfg_mode="full", negative=null, guidance=2.5),
        session.make_request(b, SECONDS, seed=3, cfg_mode="initialize", negative=null, guidance=2.0),
        session.make_request(b, SECONDS, seed=4, cfg_mode="self", guidance=1.5, solver="sde"),
        session.make_request(
            a, SECONDS, seed=5, cfg_mode="full", negative=null, guidance_method="cfg", guidance=3.0, cfg_rescale=0.5
        ),
        session.make_request(a, SECONDS, source=source, seed=6, denoise=0.6, latent_mask=(ramp > 0.5).float()),
        session.make_request(a, SECONDS, source=source, seed=7, denoise=0.7, x0_target=source.latents[:, :FRAMES]),
        session.make_request(
            a, SECONDS, source=source, seed=8, x0_target=source.latents[:, :FRAMES], x0_target_curve=ramp
        ),
        session.make_request(a, SECONDS, seed=9, ode_noise=0.3, velocity_scale=torch.linspace(0.8, 1.2, FRAMES)),
        session.make_request(a, SECONDS, source=source, seed=10, denoise=0.8, sde_denoise=ramp),
        session.make_request(a, SECONDS, seed=11, dcw=DCW(), extra_conditions=(ExtraCondition(b, ramp, (0.25, 1.0)),)),
    ]


def run(session, requests, backend, shared=None):
    """Submit the requests one per tick, four at a time (depth 4), with shared curves set while the first four
    are in flight; return the latents by seed."""
    pipeline = StreamPipeline(session.models.acestep.decoder, depth=4, backend=backend)
    delivered = []
    for index, request in enumerate(requests):
        if index == 3 and shared:
            for name, value in shared.items():
                pipeline.set_shared_curve(name, value)
        pipeline.submit(request)
        delivered += pipeline.tick()
        if index % 4 == 3:
            delivered += pipeline.drain()
    delivered += pipeline.drain()
    return {f.request.seed: f.latent for f in delivered}, pipeline


@pytest.mark.parametrize(
    "shared",
    [None, {"guidance": 3.5, "velocity_scale": torch.linspace(1.1, 0.9, FRAMES), "x0_target_strength": 0.4}],
    ids=["own values", "shared curves"],
)
def test_static_tick_equals_the_eager_tick_for_every_feature(session, prompts, source, shared):
    requests = feature_requests(session, prompts, source)
    eager, _ = run(session, requests, "eager", shared)
    static, pipeline = run(session, requests, "graph", shared)
    assert sorted(static) == sorted(eager) == list(range(1, 12))
    for seed, latent in eager.items():
        torch.testing.assert_close(static[seed], latent, atol=2e-5, rtol=1e-5, msg=f"request seed {seed}")
    stats = pipeline.stats()
    assert stats["backend"] == "graph" and stats["graphs"]["captured"] == 0  # the CPU never captures
    assert stats["graphs"]["uncaptured"] == 3 * stats["ticks"]  # a tick is three graphs: gather, forward, advance


def test_prompt_changes_reach_the_static_kv_and_return_bit_for_bit(session, prompts):
    """A group's static K/V follows the condition that takes it (at depth 1 every prompt change lands in the same
    group), so each latent matches the eager tick's; back on the first prompt, the stream is bit for bit as before."""
    a, b, _ = prompts

    def latents(sequence, backend="graph", depth=2):
        pipeline = StreamPipeline(session.models.acestep.decoder, depth=depth, backend=backend)
        out = []
        for seed, condition in enumerate(sequence):
            pipeline.submit(session.make_request(condition, SECONDS, seed=seed, steps=4))
            out += pipeline.tick()
            out += pipeline.drain() if depth == 1 else []
        out += pipeline.drain()
        return [f.latent for f in out]

    for depth in (1, 2):
        for static, eager in zip(latents([a, b, a, b], depth=depth), latents([a, b, a, b], "eager", depth)):
            torch.testing.assert_close(static, eager, atol=2e-5, rtol=1e-5, msg=f"depth {depth}")
    only_a = latents([a, a, a])
    switched = latents([a, b, a])
    assert not torch.equal(only_a[1], switched[1])  # b's K/V reached the group the slot sat in
    assert torch.equal(only_a[0], switched[0]) and torch.equal(only_a[2], switched[2])


def test_steady_state_ticks_repeat_known_plans(session, prompts):
    """At depth 4 with 8 steps and a new request every tick, the ring settles into repeating tick plans: after the
    ramp-up no plan is new, so on a GPU every tick from then on is a replay; and the forward, the costly graph to
    capture, has one plan per row count the ramp-up met (1 to 4 slots), whatever homes the slots hold."""
    a, _, null = prompts
    pipeline = StreamPipeline(session.models.acestep.decoder, depth=4, backend="graph")
    new_plans = []
    for seed in range(24):
        pipeline.submit(session.make_request(a, SECONDS, seed=seed, cfg_mode="full", negative=null, guidance=2.0))
        pipeline.tick()
        new_plans.append(pipeline.stats()["graphs"]["new_plans"])
    graphs = pipeline._graph.graphs
    assert new_plans[-1] == new_plans[11] and graphs.recent_plans("advance") <= 12, new_plans
    assert graphs.recent_plans("forward") == 4


def test_a_steady_paced_ring_replays_two_plans_whichever_places_its_slots_hold(session, prompts):
    """A live stream's ring (paced, depth 4, 8 steps, a request every tick) holds its slots at every place in turn.
    Its static tensors follow each slot's rank by age, not its place, so once the ring is full it alternates between
    two plans (a tick with a slot's first step, a tick with one's last), not one per rotation of the places."""
    a, _, null = prompts
    pipeline = StreamPipeline(session.models.acestep.decoder, depth=4, backend="graph", paced=True)
    counts, finished = [], 0
    for seed in range(48):
        pipeline.submit(session.make_request(a, SECONDS, seed=seed, cfg_mode="full", negative=null, guidance=2.0))
        finished += len(pipeline.tick())
        counts.append(pipeline.stats()["graphs"]["new_plans"])
    assert finished >= 18, "the ring did not cycle"
    assert counts[-1] - counts[15] == 0 and counts[15] - counts[7] <= 2, counts
    assert pipeline._graph.graphs.recent_plans("forward") == 4


def test_new_prompt_lengths_reuse_their_groups_static_kv_memory(session):
    """A performance meets many prompt lengths; each group's static K/V is one buffer per layer, reused at every
    length up to the longest so far (whose K/V each tick still matches the eager tick's), so new prompts add no
    static memory."""
    words = "warm analog pads with a slow build and distant thunder over rain on glass".split()
    prompts = [session.encode_text(" ".join(words[:n])) for n in (14, 3, 9, 6, 12, 1)]
    assert len({p.encoder_hidden_states.shape[1] for p in prompts}) == len(prompts)
    pipeline = StreamPipeline(session.models.acestep.decoder, depth=1, backend="graph")
    eager = StreamPipeline(session.models.acestep.decoder, depth=1, backend="eager")
    sizes = []
    for seed, prompt in enumerate(prompts):
        for stream in (pipeline, eager):
            stream.submit(session.make_request(prompt, SECONDS, seed=seed, steps=2))
        static, plain = pipeline.drain()[0].latent, eager.drain()[0].latent
        torch.testing.assert_close(static, plain, atol=2e-5, rtol=1e-5)
        sizes.append(pipeline.stats()["graphs"]["static_mb"])
    assert sizes[1:] == sizes[:1] * (len(prompts) - 1), sizes


def test_bench_host_sections_time_each_step_of_a_tick_and_leave_the_pipeline_as_it_was():
    """`bench tick --profile`'s host table: every section a graph-backend tick runs is timed once per tick (the tick's
    graphs, gather, forward and its one lane's advance, three times), and the wrapped methods are the originals again
    afterwards (a later tick pays no timer)."""
    from flowjam.engine.bench.host_sections import SECTIONS, host_sections
    from flowjam.engine.bench.ticks import TickFixture, TickRun

    before = {(owner, name): owner.__dict__[name] for owner, name in SECTIONS}
    fixture = TickFixture.build("tiny", 10.0, "cpu", torch.float32, gemm_tflops=1.0)
    run = TickRun(fixture, depth=4, steps=8, cfg="full", backend="graph")
    run.warm_up()
    report = host_sections(run.tick, lambda: None, ticks=6)
    sections = {"StreamPipeline.submit": 1, "TickBatch.of": 1, "GraphStep.run": 1, "GraphStep.advance_plans": 1}
    for section, calls in {**sections, "TickGraphs.run": 3}.items():
        line = next((line for line in report.splitlines() if section in line), None)
        assert line is not None, f"{section} missing from:\n{report}"
        ms, per_tick = float(line.split()[1]), float(line.split()[3])
        assert ms > 0 and per_tick == calls, line
    assert {(owner, name): owner.__dict__[name] for owner, name in SECTIONS} == before


def test_a_tensor_edited_in_place_between_requests_reaches_the_static_copy(session, prompts, source):
    """The graph path copies a request's read-only tensors (here its x0 target) into a home only when the home does
    not hold them already; one the caller edited in place since counts as new, as on the eager path."""
    a, _, _ = prompts
    target = source.latents[:, :FRAMES].clone()
    ramp = torch.linspace(0.0, 1.0, FRAMES)

    def latents(backend):
        pipeline = StreamPipeline(session.models.acestep.decoder, depth=1, backend=backend)
        out = []
        for scale in (1.0, 0.25):
            target.mul_(scale)
            request = session.make_request(a, SECONDS, source=source, seed=8, x0_target=target, x0_target_curve=ramp)
            pipeline.submit(request)
            out += pipeline.drain()
        target.copy_(source.latents[:, :FRAMES])
        return [f.latent for f in out]

    static, eager = latents("graph"), latents("eager")
    assert not torch.equal(eager[0], eager[1])  # the edit changes what the x0 target pulls toward
    for got, expected in zip(static, eager):
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)

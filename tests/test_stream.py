"""StreamPipeline on the tiny preset: stream == one-shot, shared curves, latency in ticks, CFG rows, depth, errors.

The stream's own behaviour (stream == one-shot, shared curves, the queue of one, latency, depth, pacing) is checked on
every backend this machine can run."""

import copy

import pytest
import torch
from flowjam.engine.models.dit import CrossGroup
from flowjam.engine.stream import DCW, StreamPipeline
from flowjam.engine.stream.backends import BACKENDS

SECONDS = 10.0  # T = 250 frames (125 tokens): large enough for batch-size-invariant CPU GEMMs
FRAMES = 250
COMPILED = ("compile", "compile-graph")  # Inductor reorders a layer's float math: equal to eager within tolerance
COMPILED_TOLERANCE = dict(atol=1e-4, rtol=1e-4)
# The graph tick's solver reads t and t_next as fp32 tensors, the eager tick as Python floats, so `t - t_next`
# rounds differently (1 - 0.9545...: 0.0454545454 against 0.0454545617): within this tolerance, not bit for bit.
GRAPH_TOLERANCE = dict(atol=2e-5, rtol=1e-5)


def cannot_run(backend: str) -> str | None:
    """Why this machine cannot run a backend here, or None. The stream tests run on the CPU, where graph ticks run
    uncaptured through the same static tensors; compiled layers need a C++ compiler for Inductor's CPU code."""
    if backend not in COMPILED:
        return None
    if not torch._dynamo.is_dynamo_supported():
        return f"backend {backend!r}: torch.compile does not support this Python"
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except Exception as error:  # Inductor's InvalidCxxCompiler, or whatever this torch raises instead
        return f"backend {backend!r}: torch.compile on the CPU needs a C++ compiler ({error})"
    return None


def backend_param(backend: str):
    """The backend as a pytest parameter with its own id ([eager], [compile-graph], ...), skipped with the reason
    (printed in the summary, `-ra`) where this machine cannot run it."""
    reason = cannot_run(backend)
    return pytest.param(backend, id=backend, marks=() if reason is None else pytest.mark.skip(reason=reason))


across_backends = pytest.mark.parametrize("backend", [backend_param(backend) for backend in BACKENDS])


def assert_equals_one_shot(streamed, one_shot, backend):
    """eager: bit for bit; graph: within GRAPH_TOLERANCE; compiled layers: within COMPILED_TOLERANCE."""
    if backend in COMPILED:
        torch.testing.assert_close(streamed, one_shot, **COMPILED_TOLERANCE, msg=f"{backend} stream vs one-shot")
    elif backend == "graph":
        torch.testing.assert_close(streamed, one_shot, **GRAPH_TOLERANCE, msg="graph stream vs one-shot")
    else:
        assert torch.equal(streamed, one_shot), f"{backend}: max diff {(streamed - one_shot).abs().max().item()}"


def slot_states(pipeline):
    return [None if slot is None else slot.x.clone() for slot in pipeline._main.slots]


@across_backends
def test_stream_equals_one_shot_generation_bitwise(session, prompts, source, backend):
    """Bit for bit on eager; within a stated tolerance on graph and compiled layers (see assert_equals_one_shot)."""
    a, b, null = prompts
    others = [
        session.make_request(b, SECONDS, seed=1),
        session.make_request(
            a, SECONDS, source=source, seed=2, denoise=0.75, cfg_mode="initialize", negative=null, guidance=3.0
        ),
        session.make_request(b, SECONDS, seed=3, cfg_mode="self", guidance=1.5, solver="sde"),
    ]
    target = dict(
        seconds=SECONDS,
        source=source,
        seed=5,
        denoise=0.6,
        cfg_mode="full",
        negative=null,
        guidance=2.0,
        velocity_scale=torch.linspace(0.8, 1.2, FRAMES),
        dcw=DCW(),
    )
    pipeline = StreamPipeline(session.models.acestep.decoder, depth=4, backend=backend)
    delivered = []
    for other in others:
        pipeline.submit(other)
        delivered += pipeline.tick()
    pipeline.submit(session.make_request(a, **target))
    while not pipeline.idle:
        assert pipeline.stats()["active_slots"] <= 4
        delivered += pipeline.tick()
    streamed = next(f.latent for f in delivered if f.request.seed == 5)
    assert len(delivered) == 4
    assert_equals_one_shot(streamed, session.generate(a, **target), backend)


def fill(session, prompt, backend, depth=4, **options):
    """A pipeline on `backend` with `depth` slots in flight at different steps (one admitted per tick)."""
    pipeline = StreamPipeline(session.models.acestep.decoder, depth=depth, backend=backend)
    for seed in range(depth):
        pipeline.submit(session.make_request(prompt, SECONDS, seed=seed, **options))
        pipeline.tick()
    return pipeline


@across_backends
def test_shared_curve_reaches_every_slot_next_tick_and_none_reverts(session, prompts, backend):
    a = prompts[0]
    plain = fill(session, a, backend)
    steered = copy.deepcopy(plain)
    assert [torch.equal(x, y) for x, y in zip(slot_states(plain), slot_states(steered))] == [True] * 4
    before = slot_states(steered)
    # freeze: an Euler step with v*0 leaves x where it is, exactly on every backend (the step runs outside the
    # compiled layers, and v*0 is 0 whatever float noise v carries)
    steered.set_shared_curve("velocity_scale", 0.0)
    assert [torch.equal(x, y) for x, y in zip(before, slot_states(steered))] == [True] * 4, "set must not touch state"
    steered.tick()
    plain.tick()
    after = slot_states(steered)
    for index, (x0, x1) in enumerate(zip(before, after)):
        if x1 is not None:
            assert torch.equal(x0, x1), f"slot {index} moved although the shared velocity scale is 0"
    steered.set_shared_curve("velocity_scale", None)
    reverted_from = slot_states(steered)
    steered.tick()
    for index, (x0, x1) in enumerate(zip(reverted_from, slot_states(steered))):
        if x1 is not None and x0 is not None:
            assert not torch.equal(x0, x1), f"slot {index} still frozen after the shared curve was removed"


@across_backends
def test_shared_curve_overrides_per_slot_values_then_per_slot_values_return(session, prompts, backend):
    pipeline = fill(session, prompts[0], backend, depth=2, velocity_scale=0.0)  # every request frozen by its own value
    frozen = slot_states(pipeline)
    pipeline.tick()
    assert all(torch.equal(x, y) for x, y in zip(frozen, slot_states(pipeline)) if y is not None)
    pipeline.set_shared_curve("velocity_scale", torch.full((FRAMES,), 1.0))
    moving = slot_states(pipeline)
    pipeline.tick()
    assert all(not torch.equal(x, y) for x, y in zip(moving, slot_states(pipeline)) if y is not None and x is not None)
    pipeline.set_shared_curve("velocity_scale", None)
    refrozen = slot_states(pipeline)
    pipeline.tick()
    assert all(torch.equal(x, y) for x, y in zip(refrozen, slot_states(pipeline)) if y is not None and x is not None)


def test_a_curve_tensor_changed_in_place_is_heard_and_set_back_plays_bit_for_bit_as_before(session, prompts):
    """The pipeline copies a host curve tensor to the device once while it is unchanged (a window walker hands the
    same mask over every tick): an in-place change must still reach the next request."""
    pipeline = StreamPipeline(session.models.acestep.decoder, depth=1)
    curve = torch.full((FRAMES,), 1.0, dtype=torch.float64)  # not the stream's dtype: its device copy is a new tensor

    def generated() -> torch.Tensor:
        pipeline.submit(session.make_request(prompts[0], SECONDS, seed=5, velocity_scale=curve))
        return pipeline.drain()[0].latent

    before = generated()
    curve[: FRAMES // 2] = 0.5
    assert not torch.equal(generated(), before), "the curve's in-place change was not heard"
    curve.fill_(1.0)
    assert torch.equal(generated(), before), "the curve set back did not play as before"


@pytest.mark.parametrize("depth, steps", [(1, 8), (4, 8), (4, 4), (8, 8)])
@across_backends
def test_free_pipeline_delivers_exactly_steps_ticks_later(session, prompts, backend, depth, steps):
    pipeline = StreamPipeline(session.models.acestep.decoder, depth=depth, backend=backend)
    pipeline.submit(session.make_request(prompts[0], SECONDS, steps=steps))
    ticks = 0
    while True:
        ticks += 1
        if pipeline.tick():
            break
    assert ticks == steps


@across_backends
def test_busy_pipeline_keeps_only_the_newest_queued_request(session, prompts, backend):
    pipeline = fill(session, prompts[0], backend, depth=2)
    pipeline.submit(session.make_request(prompts[0], SECONDS, seed=100))
    pipeline.submit(session.make_request(prompts[0], SECONDS, seed=101))  # replaces seed 100 before it starts
    delivered = pipeline.drain()
    seeds = [f.request.seed for f in delivered]
    assert 100 not in seeds and 101 in seeds and sorted(seeds) == [0, 1, 101]


def test_fused_cfg_rows_equal_separate_calls(session, prompts):
    a, _, null = prompts
    decoder = session.models.acestep.decoder
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, FRAMES, 64, generator=g)
    context = session.context_latents(FRAMES, None).expand(3, -1, -1)
    embeddings = [decoder.timestep_modulation(torch.tensor([t])) for t in (1.0, 0.9, 0.5)]
    temb, mod = torch.cat([e[0] for e in embeddings]), torch.cat([e[1] for e in embeddings])
    with torch.no_grad():
        fused = decoder.forward_rows(
            x,
            temb,
            mod,
            context,
            [
                CrossGroup(a.cross_kv(decoder), 0, 2),
                CrossGroup(null.cross_kv(decoder), 2, 1),
            ],
        )
        positive = decoder.forward_rows(x[:2], temb[:2], mod[:2], context[:2], [CrossGroup(a.cross_kv(decoder), 0, 2)])
        negative = decoder.forward_rows(
            x[2:], temb[2:], mod[2:], context[2:], [CrossGroup(null.cross_kv(decoder), 0, 1)]
        )
    assert torch.equal(fused[:2], positive) and torch.equal(fused[2:], negative)


@pytest.mark.parametrize(
    "mode, expected", [("off", [0] * 8), ("full", [1] * 8), ("initialize", [1] + [0] * 7), ("self", [0] * 8)]
)
def test_cfg_modes_make_the_documented_negative_rows(session, prompts, mode, expected):
    a, _, null = prompts
    pipeline = StreamPipeline(session.models.acestep.decoder, depth=1)
    pipeline.submit(
        session.make_request(
            a, SECONDS, cfg_mode=mode, negative=None if mode in ("off", "self") else null, guidance=2.0
        )
    )
    counts = []
    for _ in range(8):
        pipeline.tick()
        counts.append(pipeline.stats()["negative_rows"])
    assert counts == expected


@across_backends
def test_depth_shrink_finishes_every_in_flight_slot(session, prompts, backend):
    pipeline = fill(session, prompts[0], backend, depth=4)
    pipeline.set_depth(1)
    delivered = pipeline.drain()
    assert sorted(f.request.seed for f in delivered) == [0, 1, 2, 3]
    assert pipeline.stats()["depth"] == 1 and len(pipeline._main.slots) == 1
    pipeline.set_depth(3)
    pipeline.submit(session.make_request(prompts[0], SECONDS, seed=9))
    assert [f.request.seed for f in pipeline.drain()] == [9]


def test_same_seed_same_stream_output_sde_and_ode_noise_included(session, prompts, source):
    def run():
        pipeline = StreamPipeline(session.models.acestep.decoder, depth=3)
        out = []
        for seed, options in (
            (1, dict(solver="sde")),
            (2, dict(ode_noise=0.3)),
            (3, dict(sde_denoise=torch.linspace(0, 1, FRAMES), source=source, denoise=0.8)),
        ):
            pipeline.submit(session.make_request(prompts[0], SECONDS, seed=seed, **options))
            out += pipeline.tick()
        return [f.latent for f in out + pipeline.drain()]

    first, second = run(), run()
    assert len(first) == 3 and all(torch.equal(x, y) for x, y in zip(first, second))


@pytest.mark.parametrize("t_start", [0.0, 4.0, 9.6])
def test_windowed_decode_equals_full_decode_in_the_kept_region(session, prompts, t_start):
    latent = session.generate(prompts[0], SECONDS, seed=4)
    full = session.decode(latent)
    window = session.decode(latent, t_start=t_start, window_s=0.4)
    start = min(int(t_start * 25), FRAMES - 10) * 1920
    expected = full[:, start : start + window.shape[-1]]
    assert window.shape == (2, 10 * 1920)
    assert (window - expected).abs().max() < 1e-5 * max(1.0, expected.abs().max().item())


def test_cyclic_window_across_the_loop_seam(session, prompts):
    latent = session.generate(prompts[0], SECONDS, seed=4)
    rolled = torch.roll(latent, shifts=20, dims=1)
    seam = session.decode(latent, t_start=(FRAMES - 4) / 25, window_s=0.4, cyclic=True)
    middle = session.decode(rolled, t_start=(FRAMES - 4 + 20 - FRAMES) / 25, window_s=0.4)
    assert (seam - middle).abs().max() < 1e-5 * max(1.0, middle.abs().max().item())


def test_bad_inputs_raise_and_leave_the_pipeline_usable(session, prompts, source):
    a = prompts[0]
    pipeline = fill(session, a, "eager", depth=2)
    with pytest.raises(ValueError, match="T=125"):
        pipeline.submit(session.make_request(a, 5.0))
    nan_source = source.latents.clone()
    nan_source[0, 3, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        pipeline.submit(session.make_request(a, SECONDS, source_latents=nan_source, denoise=0.5))
    with pytest.raises(ValueError, match="velocity_scale.*250"):
        pipeline.submit(session.make_request(a, SECONDS, velocity_scale=torch.ones(17)))
    with pytest.raises(ValueError, match="velocity_scale.*250"):
        pipeline.set_shared_curve("velocity_scale", torch.ones(17))
    for depth in (0, 9):
        with pytest.raises(ValueError, match="depth"):
            pipeline.set_depth(depth)
    with pytest.raises(ValueError, match="unknown shared curve 'wobble'"):
        pipeline.set_shared_curve("wobble", 1.0)
    with pytest.raises(ValueError, match="negative"):
        pipeline.submit(session.make_request(a, SECONDS, cfg_mode="full"))
    assert sorted(f.request.seed for f in pipeline.drain()) == [0, 1]
    pipeline.submit(session.make_request(a, SECONDS, seed=7))
    assert [f.request.seed for f in pipeline.drain()] == [7]


def test_latent_mask_keeps_the_source_where_it_is_zero(session, prompts, source):
    mask = torch.ones(FRAMES)
    mask[:100] = 0.0
    latent = session.generate(prompts[0], SECONDS, source=source, seed=2, latent_mask=mask)
    assert torch.equal(latent[:, :100], source.latents[:, :100])
    assert not torch.allclose(latent[:, 150:], source.latents[:, 150:])


def test_x0_target_at_full_strength_lands_on_the_target(session, prompts, source):
    target = source.latents
    latent = session.generate(prompts[0], SECONDS, seed=2, x0_target=target, x0_target_strength=1.0)
    torch.testing.assert_close(latent, target)
    gated = session.generate(prompts[0], SECONDS, seed=2, x0_target=target, x0_target_curve=0.5, x0_target_gate=0.5)
    free = session.generate(prompts[0], SECONDS, seed=2)
    assert (gated - target).abs().mean() < (free - target).abs().mean()


def test_extra_condition_with_all_the_weight_equals_generating_with_it_alone(session, prompts):
    from flowjam.engine.stream import ExtraCondition

    a, b, _ = prompts
    only_b = session.generate(b, SECONDS, seed=6)
    blended = session.generate(a, SECONDS, seed=6, primary_weight=0.0, extra_conditions=(ExtraCondition(b, 1.0),))
    assert torch.equal(blended, only_b)
    halfway = session.generate(a, SECONDS, seed=6, extra_conditions=(ExtraCondition(b, None, (0.5, 1.0)),))
    assert not torch.equal(halfway, only_b) and not torch.equal(halfway, session.generate(a, SECONDS, seed=6))


def test_dcw_changes_the_result_and_stays_finite(session, prompts):
    plain = session.generate(prompts[0], SECONDS, seed=8)
    corrected = session.generate(prompts[0], SECONDS, seed=8, dcw=DCW("double", 0.05, 0.02))
    assert torch.isfinite(corrected).all() and not torch.equal(plain, corrected)


def test_compiled_backend_matches_eager(session, prompts):
    from flowjam.engine.stream.backends import decoder_forward

    a, _, null = prompts
    outputs = {}
    for backend in ("eager", "compile"):
        pipeline = StreamPipeline(session.models.acestep.decoder, depth=2, backend=backend)
        pipeline.submit(session.make_request(a, SECONDS, seed=1, steps=4))
        pipeline.tick()
        pipeline.submit(session.make_request(a, SECONDS, seed=2, steps=4, cfg_mode="full", negative=null, guidance=2.0))
        outputs[backend] = [f.latent for f in pipeline.drain()]
    for eager, compiled in zip(outputs["eager"], outputs["compile"]):
        torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)
    import gc
    import weakref

    decoder = copy.deepcopy(session.models.acestep.decoder)
    forward = decoder_forward(decoder, "compile")
    owner = weakref.ref(decoder)
    del decoder, forward
    gc.collect()
    assert owner() is None  # a compiled stream does not keep its decoder alive
    with pytest.raises(ValueError, match="unknown backend"):
        StreamPipeline(session.models.acestep.decoder, backend="tensorrt-please")


def test_decode_margin_must_cover_the_vae_receptive_field(session, prompts):
    latent = session.generate(prompts[0], SECONDS, seed=4)
    full = session.decode(latent)[:, 100 * 1920 : 110 * 1920]
    error = {
        m: (session.decode(latent, t_start=4.0, window_s=0.4, margin_frames=m) - full).abs().max().item()
        for m in (2, 9)
    }
    assert error[9] < 1e-5 < 1e-3 < error[2], error


@across_backends
def test_paced_admission_spreads_finishes_evenly(session, prompts, backend):
    """A live stream (one request per tick, depth 4, 8 steps) paced: after the ramp-up a latent finishes every second
    tick, so a shared knob is heard within two ticks. Unpaced, finishes bunch and leave longer gaps."""
    a, _, _ = prompts

    def finish_ticks(paced):
        pipeline = StreamPipeline(session.models.acestep.decoder, depth=4, backend=backend, paced=paced)
        ticks = []
        for tick in range(48):
            pipeline.submit(session.make_request(a, SECONDS, seed=tick, steps=8))
            if pipeline.tick():
                ticks.append(tick)
        return ticks

    paced, unpaced = finish_ticks(True), finish_ticks(False)
    paced_gaps = {b - a for a, b in zip(paced[2:], paced[3:])}
    unpaced_gaps = {b - a for a, b in zip(unpaced[2:], unpaced[3:])}
    assert paced_gaps == {2}, paced
    assert max(unpaced_gaps) > 2, unpaced
    assert len(paced) >= len(unpaced) - 2, "pacing keeps the throughput"


def test_compiled_stream_never_recompiles_for_new_prompts_row_counts_or_condition_groupings(session, prompts):
    """After the first tick (one slot, two rows on one condition: one attention call per layer), more slots (more
    rows), a prompt change (new token count) or slots on different prompts (condition groups of different lengths,
    whose attention results are joined) must not recompile the compiled layers: a recompile stalls the live
    stream for seconds."""
    from torch._dynamo.utils import counters

    a, b, null = prompts
    pipeline = StreamPipeline(session.models.acestep.decoder, depth=2, backend="compile")
    pipeline.submit(session.make_request(a, SECONDS, seed=0, steps=4, cfg_mode="full", negative=a))
    pipeline.tick()  # both layer kinds (sliding or not) compile here
    compiled = counters["frames"]["ok"]
    c = session.encode_text("a much longer prompt: strings, choir, slow build, distant thunder and rain on glass")
    assert len({p.encoder_hidden_states.shape[1] for p in (a, b, c)}) == 3
    for seed, prompt in enumerate((b, c, a, c, b, a, b, c)):  # up to four condition groups per tick, new lengths
        pipeline.submit(session.make_request(prompt, SECONDS, seed=seed, steps=4, cfg_mode="full", negative=null))
        pipeline.tick()
    assert counters["frames"]["ok"] == compiled


def _first_finish_of_new_values(session, prompt, supersede, sweep=False):
    """A paced live-style stream (a request every tick, depth 4, 8 steps); from tick 21 requests carry new values
    (seed 99), the first submitted with `supersede` (every one of them with `sweep`). -> (tick the first latent of
    the new values finished, that latent, ticks at which latents finished)."""
    pipeline = StreamPipeline(session.models.acestep.decoder, depth=4, paced=True)
    first, finished_at = None, []
    for tick in range(48):
        new = tick >= 21
        request = session.make_request(prompt, SECONDS, seed=99 if new else tick, steps=8, tag=int(new))
        pipeline.submit(request, supersedes=supersede and new and (sweep or tick == 21))
        for done in pipeline.tick():
            finished_at.append(tick)
            if done.request.tag == 1 and first is None:
                first = (tick, done.latent)
    return first[0], first[1], finished_at


def test_a_request_with_new_values_takes_the_youngest_slot_at_once(session, prompts):
    """Paced, a request waits for the youngest slot to get steps/depth steps in. One carrying new per-request values
    (a knob, a prompt) takes a stale youngest slot's place instead: its latent finishes `steps` ticks after it was
    submitted, sooner than waiting, and is the same latent the request makes alone."""
    a = prompts[0]
    waited, _, _ = _first_finish_of_new_values(session, a, supersede=False)
    superseded, latent, _ = _first_finish_of_new_values(session, a, supersede=True)
    assert superseded == 21 + 8 - 1 < waited
    alone = StreamPipeline(session.models.acestep.decoder, depth=1)
    alone.submit(session.make_request(a, SECONDS, seed=99, steps=8, tag=1))
    assert torch.equal(alone.drain()[0].latent, latent)


def test_new_values_every_tick_never_starve_the_ring(session, prompts):
    """A knob swept on every tick makes every request supersede: a slot that superseded is not taken over, so the
    ring keeps finishing a latent every second tick."""
    _, _, finished_at = _first_finish_of_new_values(session, prompts[0], supersede=True, sweep=True)
    late = [t for t in finished_at if t >= 30]
    assert {b - a for a, b in zip(late, late[1:])} == {2}, finished_at

"""GPU checks (skipped without CUDA, the reason printed): no host-device synchronisation inside tick(), graph replay
against eager, FP8's error at real shapes, graph-replayed window decodes, the runner's writer on its own stream."""

import sys
import time

import pytest
import torch
from flowjam.engine.session import Session
from flowjam.engine.stream import DCW, StreamPipeline
from helpers import (
    assert_a_tick_replays_without_host_sync,
    assert_close_latents,
    no_host_sync,
    stream_latents,
    track_latents,
)

if not torch.cuda.is_available():
    print("\nSKIPPED tests/test_stream_gpu.py: no CUDA device (run it on the GPU machine)", file=sys.stderr)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_tick_makes_no_host_device_sync():
    session = Session.load(preset="tiny", device="cuda")
    a = session.encode_text("gpu sync check")
    null = session.null_conditioning(a)
    pipeline = StreamPipeline(session.models.acestep.decoder, depth=4)
    requests = [
        session.make_request(a, 10.0, seed=1, cfg_mode="full", negative=null, guidance=2.0, cfg_rescale=0.3),
        session.make_request(a, 10.0, seed=2, solver="sde", dcw=DCW()),
        session.make_request(a, 10.0, seed=3, cfg_mode="initialize", negative=null, ode_noise=0.2),
        session.make_request(a, 10.0, seed=4, cfg_mode="self", guidance=1.5),
    ]
    for request in requests:  # warm-up: first use of each t builds cached embeddings
        pipeline.submit(request)
        pipeline.tick()
    pipeline.drain()
    for request in requests:
        pipeline.submit(request)
        with no_host_sync():
            pipeline.tick()
    with no_host_sync():
        for _ in range(8):
            pipeline.tick()
            pipeline.stats()  # reads CUDA events without waiting
    torch.cuda.synchronize()
    assert pipeline.stats()["gpu_tick_ms"] > 0


@cuda
def test_gpu_stream_matches_one_shot():
    session = Session.load(preset="tiny", device="cuda")
    a = session.encode_text("gpu parity")
    pipeline = StreamPipeline(session.models.acestep.decoder, depth=4)
    for seed in (1, 2, 3):
        pipeline.submit(session.make_request(a, 10.0, seed=seed))
        pipeline.tick()
    pipeline.submit(session.make_request(a, 10.0, seed=9))
    delivered = pipeline.drain()
    streamed = next(f.latent for f in delivered if f.request.seed == 9)
    torch.testing.assert_close(streamed, session.generate(a, 10.0, seed=9), atol=1e-4, rtol=1e-4)


@cuda
def test_graph_backend_replays_ticks_close_to_eager_without_host_syncs():
    """Captured ticks (bf16, real kernels) land within rounding of the eager ticks, and a replayed tick makes no
    host-device synchronisation."""
    session = Session.load(preset="tiny", device="cuda", dtype=torch.bfloat16)
    a = session.encode_text("graph parity")
    null = session.null_conditioning(a)
    _, eager = stream_latents(session, "eager", a, null)
    pipeline, graph = stream_latents(session, "graph", a, null)
    counters = pipeline.stats()["graphs"]
    assert counters["captures"] > 0 and counters["replays"] > 0
    assert_close_latents(graph, eager)
    request = session.make_request(a, 10.0, seed=99, cfg_mode="full", negative=null, guidance=2.0)
    assert_a_tick_replays_without_host_sync(pipeline, request)


@cuda
def test_fp8_error_against_bf16_at_the_turbo_shapes():
    """The figures the README gives beside FP8's speed: one 8-row forward's velocity and a finished 8-step latent,
    turbo-2b shapes (random weights), 30 s."""
    from flowjam.engine.bench.ticks import TickFixture
    from flowjam.engine.models.fp8 import check_fp8_device

    try:
        check_fp8_device(torch.device("cuda"))
    except ValueError as error:
        print(f"\nSKIPPED FP8 error figures: {error}", file=sys.stderr)
        pytest.skip(str(error))
    fixture = TickFixture.build("turbo-2b", 30.0, "cuda", torch.bfloat16)
    error = fixture.to_fp8(steps=8)
    print(f"\nFP8 vs bf16 (turbo-2b shapes, 30 s): velocity {error.velocity:.4f}, 8-step latent {error.latent:.4f}")
    assert 0 < error.velocity < 0.05 and 0 < error.latent < 0.05


@cuda
def test_window_decoder_replays_the_plain_decode_without_host_syncs():
    """The full-size VAE (random weights, bf16): a replayed window is the plain decode's audio, bit for bit."""
    from flowjam.engine.audio.window_decode import WindowDecoder
    from flowjam.engine.models.presets import get_preset
    from flowjam.engine.models.vae import OobleckVAE

    device = torch.device("cuda")
    vae = OobleckVAE(get_preset("turbo-2b").vae).to(device, torch.bfloat16).eval()
    latent = torch.randn(1, 500, 64, device=device, dtype=torch.bfloat16)
    plain = WindowDecoder(vae, device, torch.bfloat16, capture=False)(latent, 19.7, 0.6, margin_frames=12)
    decoder = WindowDecoder(vae, device, torch.bfloat16)
    for _ in range(2):  # plain warm-up, then the capture
        decoder(latent, 19.7, 0.6, margin_frames=12)
    with no_host_sync():
        replayed = decoder(latent, 19.7, 0.6, margin_frames=12)
    assert decoder.counters.captures == 1 and decoder.counters.replays == 1
    assert torch.equal(replayed, plain), f"max diff {(replayed - plain).abs().max().item()}"


@cuda
def test_a_batch_of_windows_replays_each_window_as_decoded_alone():
    """The full-size VAE (random weights, bf16): three sessions' windows in one captured decode (rows padded to 4)
    are each window's own plain decode, to bf16's rounding (a batch's convolutions run other kernels: ~1 % apart after
    the VAE's ~200 layers; another session's window is ~12 % apart: random weights' outputs look alike)."""
    from flowjam.engine.audio.window_decode import WindowDecoder
    from flowjam.engine.models.presets import get_preset
    from flowjam.engine.models.vae import OobleckVAE

    device = torch.device("cuda")
    vae = OobleckVAE(get_preset("turbo-2b").vae).to(device, torch.bfloat16).eval()
    latents = [torch.randn(1, 500, 64, device=device, dtype=torch.bfloat16) for _ in range(3)]
    starts = [19.7, 0.0, 7.3]  # the first across the seam
    alone = WindowDecoder(vae, device, torch.bfloat16, capture=False)
    expected = [alone(latent, start, 0.6, margin_frames=12) for latent, start in zip(latents, starts)]
    decoder = WindowDecoder(vae, device, torch.bfloat16)
    for _ in range(2):  # plain warm-up, then the capture
        decoder.decode_many(latents, starts, 0.6, margin_frames=12)
    with no_host_sync():
        replayed = decoder.decode_many(latents, starts, 0.6, margin_frames=12)
    assert decoder.counters.captures == 1 and decoder.counters.replays == 1
    for row, want in enumerate(expected):
        error = ((replayed[row] - want).norm() / want.norm()).item()
        assert error < 3e-2, f"row {row}: relative error {error:.2e}"
    assert ((replayed[0] - replayed[1]).norm() / expected[1].norm()).item() > 0.06, "two rows decoded one window"


@cuda
@pytest.mark.parametrize("overlap", [False, True], ids=["plain cycle", "overlapped cycle"])
def test_one_ring_writer_writes_every_session_from_its_stream_while_graph_ticks_run(overlap):
    from flowjam.live.knobs import KnobRegistry
    from flowjam.live.loop_buffer import LoopBuffer
    from flowjam.live.runner import LiveRunner
    from flowjam.live.shared_ticker import SharedTicker

    session = Session.load(preset="tiny", device="cuda", dtype=torch.bfloat16)
    ring = SharedTicker(session, backend="graph", batched_writes=True, overlap_ticks=overlap)
    buffers = [LoopBuffer(10 * 25 * 1920, channels=2, sample_rate=session.sample_rate) for _ in range(3)]
    runners = [
        LiveRunner(session, KnobRegistry(), buffer, f"ring writer {i}", ticker=ring, name=f"s{i}")
        for i, buffer in enumerate(buffers)
    ]
    for runner in runners:
        runner.start()
    try:
        time.sleep(5.0)
        statuses = [runner.status() for runner in runners]
    finally:
        for runner in runners:
            runner.stop()
        ring.stop()
        for buffer in buffers:
            buffer.unlink()
    for status, runner in zip(statuses, runners):
        assert status["errors"] == 0, status["last_error"]
        assert runner.stats.writes > 10 and runner.stats.latents > 5, runner.stats
    counters = ring.writer.decoder.counters
    assert ring.writer.windows > ring.writer.batches, "no batch held two sessions' windows"
    assert counters.replays > 0 and counters.capture_failures == 0, counters


@cuda
def test_runner_writes_from_its_own_cuda_stream_while_graph_ticks_run():
    from flowjam.live.knobs import KnobRegistry
    from flowjam.live.loop_buffer import LoopBuffer
    from flowjam.live.runner import LiveRunner, RunnerConfig

    session = Session.load(preset="tiny", device="cuda", dtype=torch.bfloat16)
    buffer = LoopBuffer(10 * 25 * 1920, channels=2, sample_rate=session.sample_rate)
    runner = LiveRunner(session, KnobRegistry(), buffer, "gpu writer", config=RunnerConfig(backend="graph"))
    runner.start()
    try:
        time.sleep(4.0)
        status = runner.status()
    finally:
        runner.stop()
        buffer.unlink()
    graphs = runner.stream.pipeline.stats()["graphs"]
    assert status["errors"] == 0, status["last_error"]
    assert runner.stats.writes > 10 and graphs["captures"] > 0 and graphs["replays"] > 0, (runner.stats, graphs)
    assert runner._writer._decode.counters.replays > 0


@cuda
@pytest.mark.parametrize("shared", [False, True], ids=["own values", "shared curves"])
def test_every_feature_is_captured_and_replayed(shared):
    """Each feature a request can use (and the shared curves a knob storm sets) runs as captured graphs: a plan
    that does something a capture forbids (a host sync, a pageable copy) fails here, not in a live stream."""
    from test_tick_graph import feature_requests

    session = Session.load(preset="tiny", device="cuda")
    a, b = session.encode_text("capture a"), session.encode_text("capture b")
    source = session.prepare_source(0.3 * torch.randn(2, 10 * 48_000), 48_000)
    requests = feature_requests(session, (a, b, session.null_conditioning(a)), source)
    pipeline = StreamPipeline(session.models.acestep.decoder, depth=4, backend="graph")
    if shared:
        for name, value in {
            "guidance": 3.5,
            "velocity_scale": 1.1,
            "x0_target_strength": 0.4,
            "ode_noise": 0.2,
            "sde_denoise": 0.5,
            "cfg_rescale": 0.3,
            "apg_momentum": -0.5,
        }.items():
            pipeline.set_shared_curve(name, value)
    for request in requests:
        for _ in range(24):  # the same request over and over: its plans repeat, are captured and replayed
            pipeline.submit(request)
            pipeline.tick()
    torch.cuda.synchronize()
    counters = pipeline.stats()["graphs"]
    assert counters["captures"] > 0 and counters["replays"] > counters["captures"], counters


@cuda
def test_a_plan_whose_capture_fails_runs_uncaptured_and_later_plans_still_capture():
    from flowjam.engine.stream.tick_graph import TickGraphs

    graphs = TickGraphs(torch.device("cuda"))
    out = torch.zeros(4, device="cuda")

    def pageable_copy():  # a host -> device copy from pageable memory: forbidden inside a capture
        out.copy_(torch.arange(4.0))

    def on_device():
        out.add_(1.0)

    for _ in range(4):  # seen, two failed captures (run plain), then plain without trying
        graphs.run("pageable", pageable_copy)
    assert graphs.counters.capture_failures == 2 and graphs.counters.uncaptured == 4
    assert out.tolist() == [0.0, 1.0, 2.0, 3.0]
    for _ in range(3):
        graphs.run("device", on_device)
    torch.cuda.synchronize()
    assert graphs.counters.captures == 1 and graphs.counters.replays == 1
    assert out.tolist() == [3.0, 4.0, 5.0, 6.0]


@cuda
def test_a_new_plan_at_shapes_that_ran_before_is_captured_at_once_and_replays_the_same_work():
    from flowjam.engine.stream.tick_graph import TickGraphs

    graphs = TickGraphs(torch.device("cuda"))
    x = torch.ones(8, device="cuda")
    graphs.run("add", lambda: x.add_(1.0), shapes="rows 8")  # new shapes: a plain warm-up
    graphs.run("double", lambda: x.mul_(2.0), shapes="rows 8")  # a new plan at those shapes: captured, replayed
    graphs.run("double", lambda: x.mul_(2.0), shapes="rows 8")
    graphs.run("halve", lambda: x.mul_(0.5), shapes="rows 16")  # shapes not seen: plain again
    torch.cuda.synchronize()
    counters = graphs.counters
    assert (counters.new_plans, counters.uncaptured, counters.captures, counters.replays) == (3, 2, 1, 1)
    assert x.tolist() == [4.0] * 8


@cuda
def test_pinned_staging_copies_every_value_while_the_gpu_is_busy_and_does_not_wait_for_it():
    from flowjam.engine.stream.pinned import BUFFERS_PER_SHAPE, PinnedStaging

    device = torch.device("cuda")
    staging = PinnedStaging(device)
    busy = torch.randn(4096, 4096, device=device)
    torch.cuda.synchronize()
    for _ in range(40):  # ~tens of ms of queued GPU work
        busy = busy @ busy
        busy /= busy.norm()
    sources = [torch.full((3, 5), float(i)) for i in range(4 * BUFFERS_PER_SHAPE)]
    outputs = [staging.to_device(source, torch.bfloat16) for source in sources[:BUFFERS_PER_SHAPE]]
    assert not torch.cuda.current_stream().query(), "staging waited for the queued GPU work"
    outputs += [staging.to_device(source, torch.bfloat16) for source in sources[BUFFERS_PER_SHAPE:]]
    torch.cuda.synchronize()
    for source, output in zip(sources, outputs):
        assert torch.equal(output.cpu().float(), source), "a reused buffer was overwritten before its copy ran"


@cuda
def test_a_lora_strength_reaches_replayed_tick_graphs_without_a_capture_and_attaching_renews_them():
    """Graph backends replay captured ticks: a strength is a tensor the graph reads (no capture, the music
    changes, and back bit for bit); attaching a LoRA changes the layers, so its ticks are new plans."""
    from flowjam.engine.bench.ticks import random_lora
    from flowjam.engine.lora import LoraAdapter, LowRank, lora_set

    session = Session.load(preset="tiny", device="cuda")
    decoder = session.models.acestep.decoder
    prompt = session.encode_text("lora on graphs")
    pipeline = StreamPipeline(decoder, depth=2, backend="graph")

    def latents(count=12):
        out = []
        for _ in range(count):
            pipeline.submit(session.make_request(prompt, 2.0, seed=5, steps=4))
            out += [f.latent.clone() for f in pipeline.tick()]
        torch.cuda.synchronize()
        return out[-1]

    plain = latents()
    captures = pipeline.stats()["graphs"]["captures"]
    attached = lora_set(decoder)
    weak = random_lora(decoder, "style", rank=4, seed=0)
    strong = {path: LowRank(d.down, d.up * 30, d.scale) for path, d in weak.deltas.items()}
    attached.attach(LoraAdapter("style", "test", "peft", strong), strength=1.0)
    styled = latents()
    assert pipeline.stats()["graphs"]["captures"] > captures, "attaching did not renew the tick graphs"
    assert (styled - plain).abs().max() > 1e-3, "the LoRA did not reach the replayed ticks"
    captures = pipeline.stats()["graphs"]["captures"]
    attached.set_strength("style", 0.0)
    silenced = latents()
    attached.set_strength("style", 1.0)
    assert torch.equal(latents(), styled), "strength back at 1 is not the same stream"
    assert pipeline.stats()["graphs"]["captures"] == captures, "a strength change captured new graphs"
    torch.testing.assert_close(silenced, plain, rtol=1e-3, atol=1e-3)


@cuda
def test_a_folded_lora_strength_refolds_replayed_tick_graphs_without_a_capture():
    """Folded LoRAs rewrite the weights the captured ticks read: attaching one captures nothing new (the layers
    are the same), a strength change refolds once (one fold-graph replay) and reaches the next tick, and strength
    0 then detaching leaves the stream and the weights as they were, to the bit."""
    from flowjam.engine.bench.ticks import random_lora
    from flowjam.engine.lora import LoraAdapter, LowRank, lora_set

    session = Session.load(preset="tiny", device="cuda", dtype=torch.bfloat16)
    decoder = session.models.acestep.decoder
    weights = {k: v.clone() for k, v in decoder.state_dict().items()}
    prompt = session.encode_text("folded lora on graphs")
    pipeline = StreamPipeline(decoder, depth=2, backend="graph")

    def latents(count=12):
        out = []
        for _ in range(count):
            pipeline.submit(session.make_request(prompt, 2.0, seed=5, steps=4))
            out += [f.latent.clone() for f in pipeline.tick()]
        torch.cuda.synchronize()
        return out[-1]

    plain = latents()
    captures = pipeline.stats()["graphs"]["captures"]
    attached = lora_set(decoder)
    weak = random_lora(decoder, "style", rank=4, seed=0)
    strong = {path: LowRank(d.down, d.up * 30, d.scale) for path, d in weak.deltas.items()}
    attached.attach(LoraAdapter("style", "test", "peft", strong), strength=1.0, mode="folded")
    styled = latents()
    assert (styled - plain).abs().max() > 1e-2, "the folded LoRA did not reach the replayed ticks"
    folds = attached.folds_run
    attached.set_strength("style", 0.0)
    attached.set_strength("style", 0.4)  # two changes between ticks: one fold
    latents(1)
    assert attached.folds_run == folds + 1
    attached.set_strength("style", 0.0)
    assert torch.equal(latents(), plain), "strength 0 folded is not the plain stream"
    attached.set_strength("style", 1.0)
    assert torch.equal(latents(), styled), "strength back at 1 is not the same stream"
    assert pipeline.stats()["graphs"]["captures"] == captures, "folding captured new tick graphs"
    assert attached.fold_runner.captures == 1, "the fold was not one graph, captured once"
    attached.detach("style")
    assert all(torch.equal(weights[k], v) for k, v in decoder.state_dict().items()), "detaching left other weights"


@cuda
@pytest.mark.parametrize("rank", [4, 128])
def test_the_fold_kernel_equals_copy_then_addmm_to_one_rounding(rank):
    """The Triton fold (one read of the resting weight, one write) against the torch ops it replaces, on odd shapes
    and several LoRAs' columns with their own strengths."""
    from flowjam.engine.lora.fold_kernel import fold_low_rank, fused_fold_available

    g = torch.Generator(device="cuda").manual_seed(0)
    rows, columns = 1000, 600
    rest = torch.randn(rows, columns, device="cuda", generator=g).bfloat16()
    up = (torch.randn(rows, rank, device="cuda", generator=g) * 0.1).bfloat16()
    down = (torch.randn(rank, columns, device="cuda", generator=g) * 0.1).bfloat16()
    column_scale = torch.rand(rank, device="cuda", generator=g)
    column_slot = torch.arange(rank, device="cuda") % 3
    strengths = torch.tensor([0.5, 1.7, 0.0, 0, 0, 0, 0, 0], device="cuda")
    assert fused_fold_available(rest)
    fused = torch.empty_like(rest)
    fold_low_rank(rest, up, down, column_scale, column_slot, strengths, fused)
    scaled = up.float() * (column_scale * strengths[column_slot])
    exact = rest.float() + scaled @ down.float()
    torch.testing.assert_close(fused.float(), exact, rtol=8e-3, atol=1e-2)
    assert not torch.equal(fused, rest), "the fold changed nothing"
    strengths.zero_()
    fold_low_rank(rest, up, down, column_scale, column_slot, strengths, fused)
    assert torch.equal(fused, rest), "strength 0 does not fold back to the resting weight"


@cuda
def test_sessions_sharing_a_graph_ring_play_as_alone():
    """Lanes on the graph backend: captured ticks over two sessions' rows; each session's latents match it alone
    (replayed ticks read fp32 t tensors: within the stream tests' graph tolerance), its knob its own."""
    session = Session.load(preset="tiny", device="cuda")
    decoder = session.models.acestep.decoder
    calm, drums = session.encode_text("calm pads"), session.encode_text("fast drums")

    def play(ring, lanes, ticks=14):
        out = {lane.name: [] for lane in lanes}
        for tick in range(ticks):
            for lane, prompt in zip(lanes, (calm, drums)):
                lane.submit(session.make_request(prompt, 4.0, seed=tick, steps=4))
            for done in ring.tick():
                out[done.lane].append(done.latent.clone())
        torch.cuda.synchronize()
        return out

    alone_ring = StreamPipeline(decoder, depth=1, backend="graph")
    alone = play(alone_ring, [alone_ring.add_lane("me", 2)])["me"]
    ring = StreamPipeline(decoder, depth=1, backend="graph")
    lanes = [ring.add_lane("me", 2), ring.add_lane("other", 3)]
    lanes[1].set_shared_curve("velocity_scale", 1.3)
    together = play(ring, lanes)
    assert ring.stats()["graphs"]["replays"] > 0, "no tick replayed a captured graph"
    assert len(together["me"]) == len(alone) >= 4 and together["other"]
    for shared, solo in zip(together["me"], alone):
        torch.testing.assert_close(shared, solo, atol=2e-5, rtol=1e-5)


@cuda
@pytest.mark.parametrize("backend", ["graph", "compile-graph"])
def test_sessions_of_a_graph_ring_hear_a_lora_at_their_own_strengths_as_eager_does(backend):
    """Per-session LoRA strengths on replayed ticks: each row's strength is a copy into the graph's static rows and
    each session's conditions get K/V at its strengths, so a graph ring plays what an eager ring plays, and moving
    one session's strength captures nothing new."""
    from flowjam.engine.bench.ticks import random_lora
    from flowjam.engine.lora import LoraAdapter, LowRank, lora_set

    session = Session.load(preset="tiny", device="cuda")
    decoder = session.models.acestep.decoder
    calm = session.encode_text("calm pads")
    weak = random_lora(decoder, "style", rank=4, seed=0)
    strong = {path: LowRank(d.down, d.up * 30, d.scale) for path, d in weak.deltas.items()}
    lora_set(decoder).attach(LoraAdapter("style", "test", "peft", strong), strength=1.0)

    def play(ring_backend):
        ring = StreamPipeline(decoder, depth=1, backend=ring_backend)
        lanes = [ring.add_lane("dry", 2), ring.add_lane("wet", 2)]
        lanes[0].set_lora_strength("style", 0.0)
        out = {lane.name: [] for lane in lanes}
        captures_before_move = None
        for tick in range(20):
            if tick == 12:
                captures_before_move = ring.stats()["graphs"] and ring.stats()["graphs"]["captures"]
                lanes[1].set_lora_strength("style", 0.5)
            for lane in lanes:
                lane.submit(session.make_request(calm, 4.0, seed=tick, steps=4))
            for done in ring.tick():
                out[done.lane].append(done.latent.clone())
        torch.cuda.synchronize()
        graphs = ring.stats()["graphs"]
        return out, None if graphs is None else graphs["captures"] - captures_before_move

    try:
        eager, _ = play("eager")
        replayed, captured_after_move = play(backend)
    finally:
        lora_set(decoder).detach("style")
    assert captured_after_move == 0, "moving a session's strength captured new tick graphs"
    for name in ("dry", "wet"):
        assert len(replayed[name]) == len(eager[name]) >= 8
        for graph_latent, eager_latent in zip(replayed[name], eager[name]):
            torch.testing.assert_close(graph_latent, eager_latent, atol=2e-3, rtol=2e-3)
    assert (replayed["dry"][2] - replayed["wet"][2]).abs().max() > 1e-2, "the sessions' strengths changed nothing"


@cuda
def test_the_writer_reads_an_offered_latent_only_once_the_offering_stream_has_made_it():
    """The runner hands its writer a copy of the timeline made on the runner's stream; the writer decodes on a
    stream of its own. A copy still queued behind other work there (a text encoder's forward, say) must be waited
    for: read early, the writer decoded whatever the memory held before (a soak heard it as silence)."""
    from flowjam.live.latency import RunnerStats
    from flowjam.live.loop_buffer import LoopBuffer
    from flowjam.live.loop_map import LoopMap
    from flowjam.live.writer import AheadWriter

    session = Session.load(preset="tiny", device="cuda", dtype=torch.bfloat16)
    frames = 4 * 25
    latent = torch.randn(1, frames, 64, generator=torch.Generator().manual_seed(3)).to("cuda", torch.bfloat16)
    expected = session.decode(latent)
    buffer = LoopBuffer(frames * session.models.vae.hop_samples, channels=2, sample_rate=session.sample_rate)
    errors = []
    hop = session.models.vae.hop_samples
    writer = AheadWriter(
        session, buffer, RunnerStats(), errors.append, (0.02, 0.2), 0.4, False, LoopMap(buffer.frames, hop)
    )
    try:
        torch.zeros_like(latent)  # the block the copy below gets holds zeros until the copy runs
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # ~1 s of the offering stream's time before the copy
        offered = latent.clone()
        writer.offer(offered, fresh_from=1, tick=1)
        writer.start()
        deadline = time.monotonic() + 30
        while writer.stats.writes < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        writer.stop(5.0)
    heard = torch.from_numpy(buffer.snapshot())
    buffer.unlink()
    assert not errors, errors
    assert writer.stats.writes >= 1
    after_patches = slice(session.sample_rate, None)  # the first write fills the loop; patches go near its start
    torch.testing.assert_close(heard[:, after_patches], expected.float().cpu()[:, after_patches], atol=1e-3, rtol=1e-3)


@cuda
def test_a_windowed_stream_walks_without_host_syncs():
    """Windows at a new place every tick are new crops of the song's context and target: the song's tensors were
    checked for NaN once, so submitting and ticking a walking window synchronises nothing with the host."""
    session = Session.load(preset="tiny", device="cuda")
    a = session.encode_text("walking window")
    song = 40.0
    stream = session.stream(depth=2, paced=True, window_s=10.0, song_seconds=song)
    target = torch.zeros(1, round(song * 25), session.models.acestep.decoder.config.audio_acoustic_hidden_dim)
    request = session.make_request(a, song, seed=3, steps=4, x0_target=target.cuda(), x0_target_strength=0.5)
    for tick in range(4):  # warm-up: the first window, the first with timeline frames, their curves
        stream.submit(request, at_frame=tick * 8)
        stream.tick()
    with no_host_sync():
        for tick in range(4, 10):
            stream.submit(request, at_frame=tick * 8)
            stream.tick()
    torch.cuda.synchronize()


@cuda
def test_captures_after_every_tick_graph_was_dropped_never_fail():
    """Evictions and a dropped set of graphs (what a K/V buffer's growth does) leave the graphs' pool without a
    graph; every capture after that still succeeds and replays the right work, round after round."""
    from flowjam.engine.stream.tick_graph import TickGraphs

    graphs = TickGraphs(torch.device("cuda"), capacity=2)
    x = torch.zeros(4096, device="cuda")
    expected = torch.zeros(4096, device="cuda")

    def plan(k: int):
        def step():  # allocates inside the capture, so the pool holds memory between captures
            x.copy_(x * 0.5 + k)

        return step

    for _ in range(6):
        for k in range(4):  # four plans in a pool of two graphs: evictions
            for _ in range(3):  # seen (plain), captured, replayed
                graphs.run(("plan", k), plan(k), shapes="4096")
                expected.copy_(expected * 0.5 + k)
        graphs.clear()  # every graph dropped at once
    torch.cuda.synchronize()
    counters = graphs.counters
    assert counters.capture_failures == 0, counters.last_failure
    assert counters.captures >= 24 and counters.evictions > 0, counters
    torch.testing.assert_close(x, expected)


@cuda
def test_a_graph_ring_whose_kv_buffers_grow_and_graphs_are_evicted_captures_without_failure():
    """Ever longer prompts grow the static K/V buffers (every tick graph dropped) while a pool of few graphs evicts:
    the ring keeps capturing and replaying with no failed capture."""
    session = Session.load(preset="tiny", device="cuda")
    pipeline = StreamPipeline(session.models.acestep.decoder, depth=4, backend="graph")
    pipeline._graph.graphs.capacity = 6  # two ticks of three graphs: the ring's rhythm evicts
    for round_ in range(6):
        conditioning = session.encode_text("grow " * (4 * 2**round_))  # a longer prompt each round
        for seed in range(12):
            pipeline.submit(session.make_request(conditioning, 10.0, seed=seed))
            pipeline.tick()
    torch.cuda.synchronize()
    counters = pipeline.stats()["graphs"]
    assert counters["capture_failures"] == 0, counters["last_failure"]
    assert counters["captures"] > 6 and counters["evictions"] > 0 and counters["replays"] > 0, counters


@cuda
def test_four_plugin_tracks_on_one_ring_make_what_each_makes_alone():
    """Four DAW tracks are four sessions (runners) on one ring: turbo-2b shapes, bf16, compile-graph, 2-bar loops at
    123 BPM. From its fourth generation on, a track makes bit for bit the latents it makes alone. Before that the ring
    ramps up (alone, its first ticks are one slot's rows; beside three others, four): other row counts, other GEMM
    algorithms, 1 bf16 ulp. On the unfused GEMMs (FLOWJAM_FUSED_KERNELS=0): with our fused kernels, measured per row
    band or held fused for every row count, the tracks differ by 1 bf16 ulp in most values throughout (H200, probe,
    2026-11-27): those kernels' rounding depends on the row count."""
    from flowjam.engine.kernels.ops import forced_path

    session = Session.load(preset="turbo-2b", device="cuda", dtype=torch.bfloat16)
    loop_samples = round(2 * 4 * 60 / 123 * session.sample_rate)
    prompts = ("ambient pads", "solo piano", "distorted drum and bass", "lofi hip hop")
    with forced_path(False):
        alone, counters_alone = track_latents(session, prompts[:1], loop_samples, ticks=40, backend="compile-graph")
        four, counters_four = track_latents(session, prompts, loop_samples, ticks=40, backend="compile-graph")
    assert counters_alone.capture_failures == counters_four.capture_failures == 0
    assert len(alone) >= 12 and alone.keys() == four.keys(), "as many generations alone as beside three tracks"
    differing = [generation for generation in alone if generation > 3 and not alone[generation].equal(four[generation])]
    assert not differing, f"generations the other tracks changed: {differing} of {len(alone)}"
    first = float((alone[1].float() - four[1].float()).abs().max())
    assert first <= 0.0625, f"the first generation differs by {first:.3g} (more than 1 bf16 ulp at |x| < 16)"


@cuda
def test_a_lanes_advance_replayed_while_another_lanes_rows_come_and_go_reads_this_ticks_velocities():
    """One session's advance graph is keyed by its own slots and the velocity rows they read; beside it another
    session's guided requests come and go, so the ring's row count (and with it the velocity tensor) changes under a
    plan the steady session has met before. Its latents stay those of the eager ring: no replay reads the velocities
    of another row count."""
    session = Session.load(preset="tiny", device="cuda")
    a, b, null = session.encode_text("steady pads"), session.encode_text("restless drums"), session.encode_text("")

    def steady_latents(ring_backend):
        ring = StreamPipeline(session.models.acestep.decoder, depth=1, backend=ring_backend)
        steady, restless = ring.add_lane("steady", 4), ring.add_lane("restless", 4)
        out = []
        for tick in range(32):
            steady.submit(session.make_request(a, 4.0, seed=tick, steps=8))
            guided = {"cfg_mode": "full", "negative": null, "guidance": 2.0} if tick % 3 == 0 else {}
            restless.submit(session.make_request(b, 4.0, seed=tick, steps=8, **guided))
            out += [done.latent.float().clone() for done in ring.tick() if done.lane == "steady"]
        torch.cuda.synchronize()
        return out, ring.stats()["graphs"]

    eager, _ = steady_latents("eager")
    replayed, counters = steady_latents("graph")
    assert counters["replays"] > 0 and counters["capture_failures"] == 0, counters
    assert len(replayed) == len(eager) >= 12
    for generation, (plain, graph) in enumerate(zip(eager, replayed)):
        assert torch.isfinite(graph).all(), f"generation {generation} has NaN"
        torch.testing.assert_close(graph, plain, atol=2e-3, rtol=1e-3, msg=f"generation {generation}")

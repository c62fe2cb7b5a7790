"""`python -m flowjam bench dit|tick` (one DiT forward; a stream tick against the spec's FLOP bound) and the
parameter census of the presets. `bench lm` is in bench/lm.py, `bench latency|soak` in live/bench.py (beside engine/)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..conditioning import Conditioning
from ..lora import LIVE_MODES, LoraAdapter, LoraSet, LowRank, lora_set, merge, unmerge
from ..models.acestep import AceStepModel
from ..models.dit import DiTDecoder
from ..models.fp8 import to_fp8
from ..models.presets import AceStepConfig, get_preset
from ..models.text_encoder import Qwen3TextEncoder
from ..models.vae import OobleckVAE
from ..params import DEFAULT_PRECISION, LATENT_RATE_HZ
from ..stream import RealtimeNeed, SlotRequest, StreamPipeline
from ..stream.windowed import WindowedStream
from .host_sections import host_sections
from .profile import kernel_profile

CONDITION_TOKENS = 256
WALK_DENOISE = 0.7  # how far a window re-noises the frames the timeline holds (the live `denoise` knob)
STREAM_SEED = 7  # the seed knob's value in a TickRun's live-like requests


def parameter_census(preset_name: str) -> dict[str, int]:
    """Parameter counts per network of a preset, counted on the meta device (no memory)."""
    preset = get_preset(preset_name)
    with torch.device("meta"):
        acestep, text, vae = AceStepModel(preset.dit), Qwen3TextEncoder(preset.text), OobleckVAE(preset.vae)

    def count(module: torch.nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    return {
        "dit decoder": count(acestep.decoder),
        "condition encoder": count(acestep.encoder),
        "audio tokenizer": count(acestep.tokenizer),
        "audio detokenizer": count(acestep.detokenizer),
        "null_condition_emb": acestep.null_condition_emb.numel(),
        "acestep checkpoint total": count(acestep),
        "qwen3 text encoder": count(text),
        "oobleck vae": count(vae),
    }


@dataclass(frozen=True)
class ForwardTiming:
    seconds: float
    frames: int
    batch: int
    median_ms: float
    min_ms: float
    max_ms: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_dit_forward(
    preset_name: str,
    seconds: float,
    batch: int = 1,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    repeats: int = 5,
    seed: int = 0,
) -> ForwardTiming:
    """Wall time of one batched DiT forward (random weights at the preset's shape, cached cross-attention K/V)."""
    config = get_preset(preset_name).dit
    dev = torch.device(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        dit = DiTDecoder(config).to(dev, dtype).eval()
        frames = round(seconds * LATENT_RATE_HZ)
        x = torch.randn(batch, frames, config.audio_acoustic_hidden_dim, device=dev, dtype=dtype)
        context = torch.randn(
            batch, frames, config.in_channels - config.audio_acoustic_hidden_dim, device=dev, dtype=dtype
        )
        cond = torch.randn(batch, CONDITION_TOKENS, config.condition_width, device=dev, dtype=dtype)
    t = torch.linspace(1.0, 0.3, batch, device=dev, dtype=dtype)
    times_ms = []
    with torch.no_grad():
        cross_kv = dit.build_cross_kv(cond)
        dit(x, t, context, cross_kv=cross_kv)  # warm-up
        for _ in range(repeats):
            _sync(dev)
            start = time.perf_counter()
            dit(x, t, context, cross_kv=cross_kv)
            _sync(dev)
            times_ms.append((time.perf_counter() - start) * 1000.0)
    return ForwardTiming(seconds, frames, batch, statistics.median(times_ms), min(times_ms), max(times_ms))


def band_mean_keys(tokens: int, window: int) -> float:
    """Mean number of keys a query sees in a ±window band over `tokens` positions."""
    total = sum(min(tokens - 1, i + window) - max(0, i - window) + 1 for i in range(tokens))
    return total / tokens


def dit_row_flops(config: AceStepConfig, frames: int, condition_tokens: int = CONDITION_TOKENS) -> float:
    """FLOPs of one DiT row per forward (spec §7): linear layers, self-attention (full and banded), cross-attention
    with cached K/V, patch in/out. Timestep MLPs (cached per t) and cross K/V projections (once per condition) excluded."""
    h, inter = config.hidden_size, config.intermediate_size
    q_dim, kv_dim = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    tokens = -(-frames // config.patch_size)
    layers = config.num_hidden_layers
    sliding = sum(config.layer_is_sliding(i) for i in range(layers))
    linear_macs = (2 * h * q_dim + 2 * h * kv_dim) + 2 * h * q_dim + 3 * h * inter
    attention = (
        4
        * q_dim
        * tokens
        * (
            (layers - sliding) * tokens
            + sliding * band_mean_keys(tokens, config.sliding_window)
            + layers * condition_tokens
        )
    )
    patch = config.patch_size * (config.in_channels * h + h * config.audio_acoustic_hidden_dim)
    return 2 * layers * tokens * linear_macs + attention + 2 * tokens * patch


def measure_gemm_tflops(
    device: torch.device, dtype: torch.dtype, sizes=((8192, 8192, 8192), (6000, 2048, 6144))
) -> float:
    """Best matmul throughput over a few shapes (TFLOP/s), timed in this process."""
    best = 0.0
    for m, k, n in sizes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        for _ in range(3):
            a @ b
        _sync(device)
        repeats = 20 if device.type == "cuda" else 2
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        _sync(device)
        best = max(best, 2 * m * k * n * repeats / (time.perf_counter() - start) / 1e12)
    return best


@dataclass(frozen=True)
class TickReport:
    backend: str
    depth: int
    cfg: str
    warmup_s: float
    median_ms: float
    p95_ms: float
    free_ms: float  # per tick over back-to-back ticks with no synchronisation between them
    host_ms: float  # the tick() call itself: host time, GPU work not awaited
    rows_per_tick: float
    audio_s_per_s: float
    bound_ms: float
    graphs: dict | None
    profile: str | None
    precision: str


@dataclass(frozen=True)
class Fp8Error:
    velocity: float  # relative L2 error of one forward's velocity (8 rows at spread-out t)
    latent: float  # relative L2 error of a finished generation


@dataclass
class TickFixture:
    """Random weights at a preset's real shapes and the inputs every measured tick uses."""

    preset: str
    seconds: float
    decoder: DiTDecoder
    positive: Conditioning
    negative: Conditioning
    context: torch.Tensor
    gemm_tflops: float
    precision: str = DEFAULT_PRECISION

    def to_fp8(self, steps: int) -> Fp8Error:
        """Switch the decoder to FP8 in place; returns its error against the bf16 decoder it replaces."""
        before = self._probe(steps)
        to_fp8(self.decoder)
        self.precision = "fp8"
        after = self._probe(steps)
        return Fp8Error(*(_relative_error(a, b) for a, b in zip(after, before)))

    @torch.no_grad()
    def _probe(self, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(velocity of one 8-row forward, a finished `steps`-step latent), from fixed inputs."""
        generator = torch.Generator(self.context.device).manual_seed(1)
        rows = 8
        x = torch.randn(rows, *self.context.shape[1:2], 64, generator=generator, device=self.context.device)
        t = torch.linspace(1.0, 0.125, rows, device=x.device)
        kv = self.positive.cross_kv(self.decoder)
        velocity = self.decoder(x.to(self.context.dtype), t, self.context.expand(rows, -1, -1), cross_kv=kv)
        pipeline = StreamPipeline(self.decoder, depth=1)
        pipeline.submit(SlotRequest(self.positive, self.context, seed=3, steps=steps))
        latent = pipeline.drain()[0].latent
        return velocity.float(), latent.float()

    @staticmethod
    def build(
        preset_name: str, seconds: float, device: str, dtype: torch.dtype, seed: int = 0, gemm_tflops: float = 0.0
    ) -> TickFixture:
        """The preset's DiT with random weights (the same for a seed) and a song's context; `gemm_tflops`: the GEMM
        peak the bound is reckoned at (0: measured here, a minute on a CPU)."""
        config = get_preset(preset_name).dit
        dev = torch.device(device)
        frames = round(seconds * LATENT_RATE_HZ)
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), torch.device(dev):
            torch.manual_seed(seed)
            dit = DiTDecoder(config).to(dtype).eval()
            positive = Conditioning(torch.randn(1, CONDITION_TOKENS, config.condition_width, dtype=dtype))
            negative = Conditioning(torch.randn(1, CONDITION_TOKENS, config.condition_width, dtype=dtype))
            context = torch.randn(1, frames, config.in_channels - config.audio_acoustic_hidden_dim, dtype=dtype)
        peak = gemm_tflops or measure_gemm_tflops(dev, dtype)
        return TickFixture(preset_name, seconds, dit, positive, negative, context, peak)


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value - reference).norm() / reference.norm()).item()


class TickRun:
    """One configuration's StreamPipeline fed a new request every tick; `window_s`: the requests walk with a playhead
    one latent frame per tick, windows of that many seconds placed on the song's timeline (or an endless one) by a
    `WindowedStream` (engine/stream/windowed.py), as a live stream places them. `before_tick(i)` runs before each tick (a knob moving every
    tick, say). Every request keeps one seed, as a live stream's seed knob does (its noise is drawn once);
    `fresh_seeds`: a new seed every tick instead, so each admission draws a request's noise on the host."""

    def __init__(
        self,
        fixture: TickFixture,
        depth: int,
        steps: int,
        cfg: str,
        backend: str = "eager",
        window_s: float = 0.0,
        endless: bool = False,
        before_tick: Callable[[int], None] | None = None,
        fresh_seeds: bool = False,
    ):
        self.fixture, self.steps, self.before_tick, self.fresh_seeds = fixture, steps, before_tick, fresh_seeds
        self.device = fixture.context.device
        self.pipeline = StreamPipeline(fixture.decoder, depth=depth, backend=backend)
        self.options = dict(cfg_mode=cfg, negative=None if cfg in ("off", "self") else fixture.negative, guidance=2.0)
        song = None if endless else fixture.context.shape[1]
        self.windowed = WindowedStream.over(self.pipeline, window_s, song, self.device, fixture.context.dtype)
        self._counter = iter(range(1 << 30))

    @property
    def frames(self) -> int:
        """A request's T: the window, or the whole song."""
        return self.fixture.context.shape[1] if self.windowed is None else self.windowed.window_frames

    def tick(self) -> list:
        """Submit the next request and tick; -> what finished."""
        index = next(self._counter)
        if self.before_tick is not None:
            self.before_tick(index)
        seed = index if self.fresh_seeds else STREAM_SEED
        request = SlotRequest(self.fixture.positive, self.fixture.context, seed=seed, steps=self.steps, **self.options)
        if self.windowed is None:
            self.pipeline.submit(request)
            return self.pipeline.tick()
        self.windowed.submit(request, at_frame=index, denoise=WALK_DENOISE)  # the playhead: one latent frame a tick
        return self.windowed.tick(frozen_frame=index)

    def warm_up(self) -> float:
        """Ticks until every slot has cycled twice (first compiles and captures); -> seconds it took."""
        started = time.perf_counter()
        for _ in range(2 * (self.steps + self.pipeline.depth)):
            self.tick()
        _sync(self.device)
        return time.perf_counter() - started

    def timed_tick(self) -> tuple[float, float, int]:
        """One tick waited for: (ms, host ms of the tick() call, latents finished)."""
        _sync(self.device)
        start = time.perf_counter()
        finished = self.tick()
        returned = time.perf_counter()
        _sync(self.device)
        return (time.perf_counter() - start) * 1000.0, (returned - start) * 1000.0, len(finished)


def interleaved_ms(runs: list[TickRun], rounds: int, ticks_per_round: int) -> list[float]:
    """Median ms/tick of each warmed run, timed in alternating rounds of a few ticks each, so that a busy machine's
    slow spells fall on every run alike: the fair comparison of runs that should cost the same."""
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(rounds):
        for run, samples in zip(runs, times):
            samples.extend(run.timed_tick()[0] for _ in range(ticks_per_round))
    return [statistics.median(samples) for samples in times]


def bench_tick(
    fixture: TickFixture,
    depth: int,
    steps: int,
    cfg: str,
    ticks: int = 48,
    backend: str = "eager",
    profile: bool = False,
    before_tick: Callable[[int], None] | None = None,
    window_s: float = 0.0,
    endless: bool = False,
    fresh_seeds: bool = False,
) -> TickReport:
    """Steady-state ticks of a `TickRun` against the FLOP bound at the GEMM peak measured in the same process."""
    run = TickRun(fixture, depth, steps, cfg, backend, window_s, endless, before_tick, fresh_seeds)
    warmup_s = run.warm_up()
    times_ms, host_ms, rows, finished = [], [], [], 0
    for _ in range(ticks):
        tick_ms, host, count = run.timed_tick()
        times_ms.append(tick_ms)
        host_ms.append(host)
        rows.append(run.pipeline.stats()["rows"])
        finished += count
    start = time.perf_counter()
    for _ in range(ticks):
        run.tick()
    _sync(run.device)
    free_ms = (time.perf_counter() - start) * 1000.0 / ticks
    table = None
    if profile:
        host = host_sections(run.tick, lambda: _sync(run.device))
        table = host if run.device.type != "cuda" else kernel_profile(run.tick, run.device, 8, "tick") + "\n" + host
    total_s = sum(times_ms) / 1000.0
    ordered = sorted(times_ms)
    row_flops = dit_row_flops(fixture.decoder.config, run.frames)
    mean_rows = sum(rows) / len(rows)
    return TickReport(
        backend=backend,
        depth=depth,
        cfg=cfg,
        warmup_s=warmup_s,
        median_ms=statistics.median(times_ms),
        p95_ms=ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))],
        free_ms=free_ms,
        host_ms=statistics.median(host_ms),
        rows_per_tick=mean_rows,
        audio_s_per_s=finished * run.frames / LATENT_RATE_HZ / total_s,
        bound_ms=mean_rows * row_flops / (fixture.gemm_tflops * 1e12) * 1000.0,
        graphs=run.pipeline.stats()["graphs"],
        profile=table,
        precision=fixture.precision,
    )


@dataclass(frozen=True)
class DecodeReport:
    window_s: float
    plain_ms: float  # median of plain PyTorch window decodes
    graph_ms: float  # median of CUDA-graph replays (plain again where nothing is captured)
    audio_ms_per_ms: float  # window audio per ms of graph decode


def bench_decode(
    preset_name: str, windows_s: list[float], device: str, dtype: torch.dtype, repeats: int = 20, seconds: float = 60.0
) -> list[DecodeReport]:
    """Windowed VAE decodes (the runner's writes: cyclic windows with the session's margin) of a random latent,
    plain against graph-replayed, each timed to the audio on the host."""
    from ..audio.window_decode import WindowDecoder
    from ..session import DECODE_MARGIN_FRAMES

    dev = torch.device(device)
    torch.manual_seed(0)
    vae = OobleckVAE(get_preset(preset_name).vae).to(dev, dtype).eval()
    latent = torch.randn(1, round(seconds * LATENT_RATE_HZ), 64, device=dev, dtype=dtype)
    plain, graphed = WindowDecoder(vae, dev, dtype, capture=False), WindowDecoder(vae, dev, dtype)

    def median_ms(decoder: WindowDecoder, window_s: float) -> float:
        times = []
        for index in range(repeats + 3):
            start = time.perf_counter()
            decoder(latent, 7.3 * index % seconds, window_s, DECODE_MARGIN_FRAMES).cpu()
            if index >= 3:
                times.append((time.perf_counter() - start) * 1000.0)
        return statistics.median(times)

    reports = []
    for window_s in windows_s:
        plain_ms, graph_ms = median_ms(plain, window_s), median_ms(graphed, window_s)
        reports.append(DecodeReport(window_s, plain_ms, graph_ms, window_s * 1000.0 / graph_ms))
    return reports


LORA_TARGETS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "cross_attn.q_proj",
    "cross_attn.k_proj",
    "cross_attn.v_proj",
    "cross_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)  # every attention and MLP projection of every layer


def random_lora(decoder: DiTDecoder, name: str, rank: int, seed: int) -> LoraAdapter:
    """A LoRA of `rank` on every attention and MLP projection, random values (scale 1 / rank)."""
    generator = torch.Generator().manual_seed(seed)
    deltas = {}
    for index, layer in enumerate(decoder.layers):
        for target in LORA_TARGETS:
            linear = layer.get_submodule(target)
            in_features, out_features = linear.in_features, linear.out_features
            down = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            up = torch.randn(out_features, rank, generator=generator) * 0.01
            deltas[f"layers.{index}.{target}"] = LowRank(down, up, 1.0 / rank)
    return LoraAdapter(name, "random", "peft", deltas)


@dataclass(frozen=True)
class LoraChangeCost:
    recompiles: int  # compiled frames after strength changes on a warm stream
    recaptures: int  # tick graphs captured after them
    folds: int  # folds run (folded mode: one on each tick after a change)


@dataclass(frozen=True)
class LoraTickReport:
    plain: TickReport
    unmerged: TickReport
    folded: TickReport  # strengths still
    folded_moving: TickReport  # a strength change before every tick: each tick pays one fold
    merged: TickReport
    changes: dict[str, LoraChangeCost]  # by live mode
    fold_ms: float  # one fold of every folded layer (GPU time; wall time on a CPU)
    folded_gb: float  # the resting weights the folded mode keeps


def bench_lora(
    fixture: TickFixture,
    loras: int,
    rank: int,
    depth: int,
    steps: int,
    cfg: str,
    backend: str,
    ticks: int = 48,
    profile: bool = False,
) -> LoraTickReport:
    """Ticks without LoRAs, with `loras` LoRAs of `rank` unmerged, folded (strengths still, and moving every
    tick) and merged, side by side on one fixture; then counts what strength changes compile, capture and fold
    on a warm stream in each live mode."""
    decoder = fixture.decoder
    adapters = [random_lora(decoder, f"bench{i}", rank, seed=i) for i in range(loras)]
    attached = lora_set(decoder)
    plain = bench_tick(fixture, depth, steps, cfg, ticks, backend)
    reports, changes = {}, {}
    for mode in LIVE_MODES:
        for adapter in adapters:
            attached.attach(adapter, mode=mode)
        reports[mode] = bench_tick(fixture, depth, steps, cfg, ticks, backend, profile=profile and mode == "live")
        changes[mode] = _strength_change_cost(fixture, attached, adapters, depth, steps, cfg, backend)
        if mode == "folded":

            def move(tick: int) -> None:
                for adapter in adapters:
                    attached.set_strength(adapter.name, 0.5 + 0.5 * (tick % 2))

            reports["moving"] = bench_tick(fixture, depth, steps, cfg, ticks, backend, before_tick=move)
            fold_ms = _fold_ms(attached)
            folded_gb = sum(layer.rest.numel() * layer.rest.element_size() for layer in attached.folds.values()) / 1e9
        for adapter in adapters:
            attached.detach(adapter.name)
    merged_loras = [merge(decoder, adapter) for adapter in adapters]
    merged = bench_tick(fixture, depth, steps, cfg, ticks, backend)
    for merged_lora in reversed(merged_loras):
        unmerge(decoder, merged_lora)
    return LoraTickReport(
        plain, reports["live"], reports["folded"], reports["moving"], merged, changes, fold_ms, folded_gb
    )


def _fold_ms(attached: LoraSet, repeats: int = 20) -> float:
    """The mean time of one fold of every folded layer, as the tick after a strength change runs it."""
    layers, device = list(attached.folds.values()), attached.strengths.device
    attached.fold_runner.run(layers, attached.strengths)
    _sync(device)
    if device.type != "cuda":
        started = time.perf_counter()
        for _ in range(repeats):
            attached.fold_runner.run(layers, attached.strengths)
        return (time.perf_counter() - started) * 1000.0 / repeats
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        attached.fold_runner.run(layers, attached.strengths)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def _strength_change_cost(
    fixture: TickFixture, attached: LoraSet, adapters: list[LoraAdapter], depth: int, steps: int, cfg: str, backend: str
) -> LoraChangeCost:
    """Warm a stream, change every strength a few times between ticks, count compiles, captures and folds."""
    from torch._dynamo.utils import counters

    pipeline = StreamPipeline(fixture.decoder, depth=depth, backend=backend)
    options = dict(cfg_mode=cfg, negative=None if cfg in ("off", "self") else fixture.negative, guidance=2.0)
    seeds = iter(range(1 << 30))

    def run(count: int) -> None:
        for _ in range(count):
            pipeline.submit(SlotRequest(fixture.positive, fixture.context, seed=next(seeds), steps=steps, **options))
            pipeline.tick()
        _sync(fixture.context.device)

    run(3 * (steps + depth))
    frames, folds = counters["frames"]["ok"], attached.folds_run
    captures = (pipeline.stats()["graphs"] or {}).get("captures", 0)
    for strength in (0.5, 1.5, 1.0):
        for adapter in adapters:
            attached.set_strength(adapter.name, strength)
        run(steps + depth)
    return LoraChangeCost(
        counters["frames"]["ok"] - frames,
        (pipeline.stats()["graphs"] or {}).get("captures", 0) - captures,
        attached.folds_run - folds,
    )


@dataclass(frozen=True)
class RingReport:
    sessions: int
    rows: float  # mean rows a tick
    median_ms: float
    p95_ms: float
    bound_ms: float  # the rows' FLOPs at the measured GEMM peak
    latent_interval_ms: float  # each session's time between fresh latents: median tick x ticks per latent
    realtime: bool  # every session gets a fresh latent within its need


def bench_ring(
    fixture: TickFixture, sessions: int, depth: int, steps: int, cfg: str, backend: str, ticks: int = 32
) -> RingReport:
    """`sessions` paced lanes of one ring, each submitting every tick (its own seeds), timed tick by tick."""
    need = RealtimeNeed(steps, 2 if cfg == "full" else 1)
    ring = StreamPipeline(fixture.decoder, depth=1, backend=backend)
    lanes = [ring.add_lane(f"session{i}", depth, paced=True) for i in range(sessions)]
    options = dict(cfg_mode=cfg, negative=None if cfg in ("off", "self") else fixture.negative, guidance=2.0)
    seeds = iter(range(1 << 30))

    def tick() -> None:
        for lane in lanes:
            lane.submit(SlotRequest(fixture.positive, fixture.context, seed=next(seeds), steps=steps, **options))
        ring.tick()

    for _ in range(3 * (steps + depth)):
        tick()
    times_ms, rows = [], []
    for _ in range(ticks):
        _sync(fixture.context.device)
        start = time.perf_counter()
        tick()
        _sync(fixture.context.device)
        times_ms.append((time.perf_counter() - start) * 1000.0)
        rows.append(ring.stats()["rows"])
    median = statistics.median(times_ms)
    mean_rows = sum(rows) / len(rows)
    interval = median * max(1, -(-steps // depth))
    return RingReport(
        sessions=sessions,
        rows=mean_rows,
        median_ms=median,
        p95_ms=sorted(times_ms)[min(len(times_ms) - 1, int(0.95 * len(times_ms)))],
        bound_ms=mean_rows
        * dit_row_flops(fixture.decoder.config, fixture.context.shape[1])
        / (fixture.gemm_tflops * 1e12)
        * 1000.0,
        latent_interval_ms=interval,
        realtime=interval <= need.latent_interval_ms,
    )

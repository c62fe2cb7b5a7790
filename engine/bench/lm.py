"""`python -m flowjam bench lm`: our code generator against transformers' `generate` in the same run, plus the
bandwidth bound (weight bytes / measured device copy bandwidth). Random weights at the real shapes."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..lm.generate import CodeGenerator, CodeRequest
from ..lm.prompts import codes_prompt, codes_uncond_prompt
from ..lm.sampling import SamplingParams
from ..models.lm import AUDIO_CODE_BASE, LM_PRESETS, NUM_CODES, Qwen3LM
from ..models.text_tokenizer import Qwen3Tokenizer
from .profile import kernel_profile

BENCH_CAPTION = "energetic synthwave with driving bass, bright analog leads and gated reverb drums"
BENCH_COT = "bpm: 118\ncaption: energetic synthwave\nduration: 60\nkeyscale: A minor\nlanguage: en\ntimesignature: 4"


@dataclass(frozen=True)
class LMBenchResult:
    label: str
    ms_per_step: float
    codes_per_s: float
    seconds: float
    first_call_s: float | None = None  # warm-up call: capture / compilation included


def random_lm(preset: str, device: str, dtype: torch.dtype, seed: int = 0) -> Qwen3LM:
    """A Qwen3LM with seeded N(0, 0.02) weights, built directly on the device (no CPU init of billions of params)."""
    if preset not in LM_PRESETS:
        raise ValueError(f"unknown LM preset {preset!r}: choose one of {', '.join(LM_PRESETS)}")
    torch.manual_seed(seed)
    with torch.device(device):
        lm = Qwen3LM(LM_PRESETS[preset]).to(dtype)
    with torch.no_grad():
        for name, parameter in lm.named_parameters():
            if "norm" not in name:
                parameter.normal_(0.0, 0.02)
    return lm.eval()


def copy_bandwidth(device: torch.device, megabytes: int = 1024, repeats: int = 10) -> float:
    """Measured device memory bandwidth in bytes/s: a large copy reads and writes every byte."""
    source = torch.empty(megabytes * 2**20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        target.copy_(source)
    _sync(device)
    return 2 * source.numel() * repeats / (time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_requests(batch: int, tokens: int) -> list[CodeRequest]:
    tokenizer = Qwen3Tokenizer.from_package()
    prompt = tuple(tokenizer.encode(codes_prompt(BENCH_CAPTION, "", BENCH_COT), add_eos=False))
    uncond = tuple(tokenizer.encode(codes_uncond_prompt(BENCH_CAPTION, ""), add_eos=False))
    return [CodeRequest(prompt, tokens, seed=i, uncond_ids=uncond) for i in range(batch)]


def time_ours(
    lm: Qwen3LM,
    requests: list[CodeRequest],
    sampling: SamplingParams,
    cuda_graphs: bool,
    repeats: int,
    compile_layers: bool = False,
) -> LMBenchResult:
    generator = CodeGenerator(lm, sampling, cuda_graphs=cuda_graphs, compile_layers=compile_layers)
    warm_start = time.perf_counter()
    generator.generate(requests)  # warm-up: kernels, compilation, and on CUDA the graphs of every bucket
    warm_s = time.perf_counter() - warm_start
    device = generator.device
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        generator.generate(requests)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    tokens = requests[0].num_codes
    label = (
        "flowjam" + (" + torch.compile" if compile_layers else "") + (" + CUDA graphs" if cuda_graphs else " (eager)")
    )
    return LMBenchResult(label, 1000 * best / tokens, len(requests) * tokens / best, best, warm_s)


def time_transformers(lm: Qwen3LM, requests: list[CodeRequest], sampling: SamplingParams) -> LMBenchResult:
    """transformers' `generate` on the same weights, cond + uncond rows stacked into one batch (left-padded), the
    same number of new tokens, sampling with the same temperature / top-p; CFG mixing itself is not applied
    (that only flatters the baseline)."""
    from transformers import Qwen3Config as HFConfig
    from transformers import Qwen3ForCausalLM

    c = lm.config
    config = HFConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        rope_theta=c.rope_theta,
        rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    weight = lm.model.embed_tokens.weight
    with torch.device(weight.device):
        reference = Qwen3ForCausalLM(config).to(weight.dtype).eval()
    reference.load_state_dict(lm.state_dict(), strict=False)
    rows = [r.prompt_ids for r in requests] + [r.uncond_ids for r in requests]
    length = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long, device=weight.device)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, length - len(row) :] = torch.tensor(row, device=weight.device)
        mask[i, length - len(row) :] = 1
    tokens = requests[0].num_codes
    options = dict(
        input_ids=ids,
        attention_mask=mask,
        do_sample=sampling.temperature > 0,
        temperature=sampling.temperature or None,
        top_p=sampling.top_p,
        top_k=sampling.top_k or None,
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        pad_token_id=0,
    )
    with torch.no_grad():
        reference.generate(**{**options, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        _sync(weight.device)
        start = time.perf_counter()
        reference.generate(**options)
        _sync(weight.device)
    seconds = time.perf_counter() - start
    return LMBenchResult("transformers generate", 1000 * seconds / tokens, len(requests) * tokens / seconds, seconds)


def run_lm_bench(
    preset: str = "lm-1.7b",
    batch: int = 8,
    cfg: float = 2.0,
    tokens: int = 300,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    repeats: int = 3,
    baseline: bool = True,
    compile_layers: bool = False,
    profile: bool = False,
) -> dict:
    """Time every variant and print one table (with `profile`, on a GPU, the kernels of one generate call of the
    fastest of ours, per decode step); returns the numbers."""
    sampling = SamplingParams(cfg=cfg)
    sampling.validate()
    if tokens < 1 or not 1 <= batch <= 64:
        raise ValueError(f"need tokens >= 1 and 1 <= batch <= 64, got tokens={tokens}, batch={batch}")
    lm = random_lm(preset, device, dtype)
    requests = bench_requests(batch, tokens)
    results = []
    if lm.model.embed_tokens.weight.device.type == "cuda":
        if compile_layers:
            results.append(time_ours(lm, requests, sampling, cuda_graphs=True, repeats=repeats, compile_layers=True))
        results.append(time_ours(lm, requests, sampling, cuda_graphs=True, repeats=repeats))
    results.append(time_ours(lm, requests, sampling, cuda_graphs=False, repeats=repeats))
    if baseline:
        results.append(time_transformers(lm, requests, sampling))
    weight_bytes = sum(p.numel() * p.element_size() for p in lm.parameters())
    bandwidth = copy_bandwidth(lm.model.embed_tokens.weight.device)
    bound_ms = 1000 * weight_bytes / bandwidth
    rows = 2 * batch if sampling.guided else batch
    print(
        f"LM {preset}, {dtype}, {device}: batch {batch} x {'cond+uncond' if sampling.guided else 'cond'} = {rows} rows, "
        f"{tokens} codes each, prompt {len(requests[0].prompt_ids)} / uncond {len(requests[0].uncond_ids)} tokens, "
        f"head {NUM_CODES} codes from id {AUDIO_CODE_BASE}"
    )
    print(f"{'engine':<38} {'ms/step':>9} {'codes/s':>10} {'total s':>9} {'first call s':>13}")
    for result in results:
        first = "" if result.first_call_s is None else f"{result.first_call_s:13.2f}"
        print(f"{result.label:<38} {result.ms_per_step:9.3f} {result.codes_per_s:10.1f} {result.seconds:9.2f} {first}")
    print(
        f"{'bandwidth bound (weights once/step)':<38} {bound_ms:9.3f}   weights {weight_bytes / 1e9:.2f} GB, "
        f"copy {bandwidth / 1e12:.2f} TB/s"
    )
    fastest = min(results[:-1] if baseline else results, key=lambda result: result.ms_per_step)
    if baseline:
        print(
            f"speed-up of {fastest.label} over generate: {results[-1].ms_per_step / fastest.ms_per_step:.1f}x; "
            f"{fastest.ms_per_step / bound_ms:.2f}x the bound"
        )
    if profile and lm.model.embed_tokens.weight.device.type != "cuda":
        print("--profile: the kernels are profiled on a GPU only (--device cuda)")
    elif profile:
        generator = CodeGenerator(lm, sampling, cuda_graphs=True, compile_layers=compile_layers)
        generator.generate(requests)  # warm: compiled, captured
        print(kernel_profile(lambda: generator.generate(requests), generator.device, 1, "step", tokens))
    return {"results": results, "bound_ms": bound_ms, "weight_bytes": weight_bytes, "bandwidth": bandwidth}

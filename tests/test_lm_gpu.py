"""GPU checks of the code generator (skipped without CUDA): CUDA-graph replay equals eager, no host sync per step."""

import pytest
import torch
from flowjam.engine.bench.lm import random_lm
from flowjam.engine.lm.generate import CodeGenerator, CodeRequest
from flowjam.engine.lm.sampling import SamplingParams
from flowjam.engine.models.lm import compiled_layer_step
from helpers import no_host_sync

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

REQUESTS = [  # different lengths: the batch shrinks twice, so three graph buckets per key range
    CodeRequest(tuple(range(100, 160)), num_codes=length, seed=seed, uncond_ids=tuple(range(100, 130)))
    for seed, length in ((1, 70), (2, 300), (3, 150), (4, 300))
]


@cuda
@pytest.mark.parametrize("preset, dtype", [("tiny", torch.float32), ("lm-0.6b", torch.float32)])
def test_cuda_graph_codes_equal_eager_codes(preset, dtype):
    lm = random_lm(preset, "cuda", dtype)
    sampling = SamplingParams(temperature=0.85, top_p=0.9, cfg=2.0)
    eager = CodeGenerator(lm, sampling, cuda_graphs=False).generate(REQUESTS)
    graphed = CodeGenerator(lm, sampling, cuda_graphs=True).generate(REQUESTS)
    for a, b in zip(eager, graphed):
        assert torch.equal(a, b)
    assert [len(codes) for codes in graphed] == [70, 300, 150, 300]


@cuda
def test_decode_steps_make_no_host_device_sync():
    lm = random_lm("tiny", "cuda", torch.float32)
    generator = CodeGenerator(lm, SamplingParams(), cuda_graphs=True)
    generator.generate(REQUESTS)  # graphs captured
    generator._start(REQUESTS)
    with no_host_sync():
        for step in range(1, 60):
            generator._run_step(len(REQUESTS), generator._keys_end(step))


@cuda
def test_compiled_layer_step_matches_the_eager_one():
    lm = random_lm("lm-0.6b", "cuda", torch.float32)
    lm.setup_cache(4, 256)
    prompt = torch.randint(0, 151_000, (4, 40), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.no_grad():
        lm.prefill(prompt)
        tokens, positions = prompt[:, -1], torch.full((4,), 40, device="cuda")
        eager = lm.decode_hidden(tokens, positions, 128)
        compiled = lm.decode_hidden(tokens, positions, 128, compiled_layer_step())
    torch.testing.assert_close(compiled, eager, atol=2e-4, rtol=2e-4)
    fresh = random_lm("tiny", "cuda", torch.float32)  # its first step stacks the weights; the next one is captured
    codes = CodeGenerator(fresh, SamplingParams(), compile_layers=True).generate(REQUESTS)
    assert [len(c) for c in codes] == [70, 300, 150, 300] and all(0 <= c.min() and c.max() < 64_000 for c in codes)

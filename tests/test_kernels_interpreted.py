"""The norm pass's Triton kernel run by Triton's interpreter on the CPU (numpy executes each program), against the
math in fp32: x' and h one bf16 rounding from the exact values, and the quantised variant's x' and row scales, at
widths that are and are not powers of two. The interpreter does not round e4m3 as a GPU does (it flushes subnormals and
can miss a carry into the exponent), so the quantised values themselves are checked on the GPU
(tests/test_fused_kernels_gpu.py). Skipped without Triton."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="Triton is not installed (pip install 'flowjam[kernels]')")

CHECK = r"""
import json
import torch
import torch.nn.functional as F
from flowjam.engine.kernels import norm_modulate
from flowjam.engine.models.fp8 import quantize_rows

norm_modulate._add_norm_modulate = norm_modulate._add_norm_modulate.fn  # the interpreter cannot time configurations
torch.manual_seed(0)
results = []
for batch, tokens, n, add, gate, modulate in [
    (2, 7, 96, True, True, True), (1, 5, 100, False, False, True), (3, 4, 64, True, False, False), (2, 3, 1000, True, True, True)
]:
    x = torch.randn(batch, tokens, n).bfloat16()
    delta = torch.randn(batch, tokens, n).bfloat16() if add else None
    gates = torch.randn(batch, n).bfloat16() if gate else None
    weight = (torch.rand(n) + 0.5).bfloat16()
    scale, shift = ((torch.randn(batch, n) * 0.2).bfloat16() for _ in range(2))
    scale, shift = (scale, shift) if modulate else (None, None)
    added, h = norm_modulate.add_norm_modulate(x, delta, gates, weight, scale, shift, 1e-6)
    quant_added, values, row_scale = norm_modulate.add_norm_quantize(x, delta, gates, weight, scale, shift, 1e-6)
    exact_x = x.float() + (0 if delta is None else delta.float() * (1 if gates is None else gates.float()[:, None]))
    exact = F.rms_norm(added.float(), (n,), weight.float(), 1e-6)  # of the x' it wrote, in fp32
    exact = exact if scale is None else exact * (1 + scale.float()[:, None]) + shift.float()[:, None]
    results.append(dict(
        shape=[batch, tokens, n],
        x_error=((added.float() - exact_x).norm() / exact_x.norm()).item(),
        x_same=torch.equal(quant_added, added),
        h_error=((h.float() - exact).norm() / exact.norm()).item(),
        scales_equal=torch.equal(row_scale, quantize_rows(h.reshape(-1, n))[1]),
        quantised=[str(values.dtype), list(values.shape), list(row_scale.shape)],
    ))
print(json.dumps(results))
"""


def test_the_norm_pass_interpreted_on_the_cpu_computes_the_eager_layers_math():
    environment = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=environment, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for result in json.loads(done.stdout.strip().splitlines()[-1]):
        batch, tokens, n = result["shape"]
        assert result["x_error"] < 4e-3, f"{result['shape']}: x' is {result['x_error']:.2e} from the exact residual"
        assert result["x_same"], f"{result['shape']}: the quantising variant wrote another x'"
        assert result["h_error"] < 4e-3, f"{result['shape']}: h is {result['h_error']:.2e} from the exact one"
        assert result["scales_equal"], f"{result['shape']}: the row scales are not quantize_rows' of h"
        assert result["quantised"] == ["torch.float8_e4m3fn", [batch * tokens, n], [batch * tokens, 1]], result

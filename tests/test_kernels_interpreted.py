"""Triton kernels run by Triton's interpreter on the CPU (numpy executes each program), against the math in fp32:
the norm pass (x' and h one bf16 rounding from the exact values, the quantised variant's x' and row scales, at
widths that are and are not powers of two), the quantising pass before FP8 projections (its row scales) and the
q/k/v GEMM with its head norms and RoPE (fp16: the interpreter's
bf16 products are wrong; heads of 16 and 32, row counts no tile divides, several tiles per program). The
interpreter does not round e4m3 as a GPU does (it flushes subnormals and can miss a carry into the exponent), so
the quantised values themselves are checked on the GPU (tests/test_fused_kernels_gpu.py). Skipped without Triton."""

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
    (2, 7, 96, True, True, True), (1, 5, 100, False, False, True),
    (3, 4, 64, True, False, False), (2, 3, 1000, True, True, True),
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


QKV_CHECK = r"""
import json
import torch
from triton.tools.tensor_descriptor import TensorDescriptor
from flowjam.engine.kernels import qkv_rope
from flowjam.engine.kernels.qkv_ops import _eager_qkv
from flowjam.engine.models.layers import rope_cos_sin

torch.manual_seed(0)
results = []
for head, heads, kv_heads, batch, tokens in [(16, 4, 2, 2, 37), (32, 2, 1, 1, 5)]:
    k, n = heads * head, (heads + 2 * kv_heads) * head
    rows = (torch.randn(n, k) / k**0.5).half()
    w_q, w_k, w_v = rows.split([heads * head, kv_heads * head, kv_heads * head])
    q_norm, k_norm = ((1 + 0.1 * torch.randn(head)).half() for _ in range(2))
    h = torch.randn(batch, tokens, k).half()
    cos, sin = rope_cos_sin(torch.arange(tokens), head, 10000.0, torch.float16)
    m = batch * tokens
    out = torch.empty(m, n, dtype=torch.float16)
    block_m, block_k = 64, min(k, 64)
    descriptors = [
        TensorDescriptor.from_tensor(h.reshape(m, k), [block_m, block_k]),
        TensorDescriptor.from_tensor(rows, [head, block_k]),
        TensorDescriptor.from_tensor(out, [block_m, head]),
    ]
    qkv_rope._qkv_norm_rope_gemm.fn[(2,)](  # 2 programs walk every tile; the autotuner's configuration by hand
        *descriptors, q_norm, k_norm, cos, sin, m, n, k, 64, tokens, heads * head, (heads + kv_heads) * head, 1e-6,
        PROGRAMS=2, BLOCK_M=block_m, BLOCK_K=block_k, GROUP_M=8, HEAD=head,
    )
    exact = _eager_qkv(*(t.float() for t in (h, w_q, w_k, w_v, q_norm, k_norm, cos, sin)), 1e-6).reshape(m, n)
    eager = _eager_qkv(h, w_q, w_k, w_v, q_norm, k_norm, cos, sin, 1e-6).reshape(m, n)
    as_bf16 = [t.bfloat16() for t in (h, w_q, w_k, w_v, q_norm, k_norm, cos, sin)]
    eager_bf16 = _eager_qkv(*as_bf16, 1e-6).reshape(m, n)
    after = qkv_rope.norm_rope_columns(  # the separate pass over the plain GEMM's output (bf16: no tl.dot in it)
        h.bfloat16().reshape(m, k) @ rows.bfloat16().t(), *as_bf16[4:], heads * head, kv_heads * head, 1e-6
    )
    error = lambda t: ((t.float() - exact).norm() / exact.norm()).item()
    results.append(dict(shape=[head, heads, kv_heads, batch, tokens], fused=error(out), eager=error(eager),
                        after=error(after), eager_bf16=error(eager_bf16),
                        v_kept=torch.equal(after[:, -kv_heads * head:], eager_bf16[:, -kv_heads * head:])))
print(json.dumps(results))
"""


QUANTIZE_CHECK = r"""
import json
import torch
import torch.nn.functional as F
from flowjam.engine.kernels import quantize
from flowjam.engine.models.fp8 import quantize_rows

quantize._quantize_rows = quantize._quantize_rows.fn  # the interpreter cannot time configurations
torch.manual_seed(0)
results = []
for m, n, gated in [(5, 96, True), (3, 1000, True), (4, 100, False)]:
    x, up = (torch.randn(m, n) * 3).bfloat16(), torch.randn(m, n).bfloat16()
    stored = F.silu(x) * up if gated else x  # what the eager layer stores before its FP8 projection
    values, row_scale = quantize.quantize_rows(x, up if gated else None)
    exact = F.silu(x.float()) * up.float() if gated else x.float()
    results.append(dict(
        shape=[m, n, gated],
        scale_error=((row_scale - quantize_rows(exact)[1]) / quantize_rows(exact)[1]).abs().max().item(),
        scales_equal=torch.equal(row_scale, quantize_rows(stored)[1]),
        quantised=[str(values.dtype), list(values.shape), list(row_scale.shape)],
    ))
print(json.dumps(results))
"""


SILU_CHECK = r"""
import json
import torch
import torch.nn.functional as F
from flowjam.engine.kernels import gemm_epilogue

torch.manual_seed(0)
results = []
for m, n, k in [(3, 100, 16), (5, 4096, 8), (1, 7, 4)]:
    a, pair = torch.randn(m, k), torch.randn(2, n, k)
    out = gemm_epilogue.paired_gemm_silu_mul(a, pair)  # one GEMM's [gate | up], then the pass over its halves
    apart = gemm_epilogue.silu_mul(torch.randn(m, n), torch.randn(m, n))
    exact = F.silu(a @ pair[0].t()) * (a @ pair[1].t())
    results.append(dict(shape=[m, n], error=(out - exact).abs().max().item(), apart=list(apart.shape)))
print(json.dumps(results))
"""


def _interpreted(check: str) -> list[dict]:
    environment = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=environment, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_qkv_gemm_interpreted_on_the_cpu_computes_the_projections_head_norms_and_rope():
    """Both paths of the op: the GEMM with the norms and RoPE in its epilogue (fp16), and the pass after a plain GEMM
    (bf16); each as close to the fp32 result as the eager layer at that precision, the v columns left as they were."""
    for result in _interpreted(QKV_CHECK):
        assert result["fused"] <= max(2 * result["eager"], 1e-3), result
        assert result["after"] <= max(2 * result["eager_bf16"], 1e-3) and result["v_kept"], result


def test_the_quantising_pass_interpreted_on_the_cpu_scales_rows_as_fp8_linears_do():
    """silu(gate) * up and a plain input: each row's scale within two bf16 steps of the exact activation's
    (the interpreter truncates where a GPU rounds to bf16, so the gated rows' exact equality with `quantize_rows`
    of the stored activation is checked on the GPU); the plain input's scales exactly `quantize_rows`'."""
    for result in _interpreted(QUANTIZE_CHECK):
        m, n, gated = result["shape"]
        assert result["scale_error"] < 2**-6, result
        assert gated or result["scales_equal"], result
        assert result["quantised"] == ["torch.float8_e4m3fn", [m, n], [m, 1]], result


def test_the_silu_mul_pass_interpreted_on_the_cpu_reads_the_two_halves_of_one_gemm():
    for result in _interpreted(SILU_CHECK):
        assert result["error"] < 1e-5 and result["apart"] == result["shape"], result


def test_the_norm_pass_interpreted_on_the_cpu_computes_the_eager_layers_math():
    for result in _interpreted(CHECK):
        batch, tokens, n = result["shape"]
        assert result["x_error"] < 4e-3, f"{result['shape']}: x' is {result['x_error']:.2e} from the exact residual"
        assert result["x_same"], f"{result['shape']}: the quantising variant wrote another x'"
        assert result["h_error"] < 4e-3, f"{result['shape']}: h is {result['h_error']:.2e} from the exact one"
        assert result["scales_equal"], f"{result['shape']}: the row scales are not quantize_rows' of h"
        assert result["quantised"] == ["torch.float8_e4m3fn", [batch * tokens, n], [batch * tokens, 1]], result

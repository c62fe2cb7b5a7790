"""FP8 linear layers (e4m3 weights per output channel, per-token activation scales) through torch._scaled_mm's CPU
implementation: the arithmetic is what a GPU runs, only slower."""

import pytest
import torch
from flowjam.engine.models.fp8 import FP8_MAX, Fp8Linear, quantize_rows, to_fp8
from flowjam.engine.session import Session
from flowjam.engine.stream import StreamPipeline


def _cpu_scaled_mm() -> bool:
    try:
        one = torch.ones(16, 16).to(torch.float8_e4m3fn)
        torch._scaled_mm(one, one.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        return False
    return True


pytestmark = pytest.mark.skipif(not _cpu_scaled_mm(), reason="this torch has no CPU torch._scaled_mm (rowwise)")


def test_rows_are_scaled_to_the_e4m3_range_and_come_back_within_its_rounding():
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 16)[:, None]
    values, scale = quantize_rows(x)
    assert values.dtype == torch.float8_e4m3fn and scale.shape == (16, 1)
    assert torch.allclose(values.float().abs().amax(dim=1), torch.full((16,), FP8_MAX))
    restored = values.float() * scale
    # e4m3 keeps 3 mantissa bits; below its smallest normal (2^-6) its steps are 2^-9 (of the row's scale)
    assert ((restored - x).abs() <= x.abs() * 2**-3 + scale * 2**-10).all()


def test_fp8_linear_equals_the_matmul_of_its_dequantized_operands():
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 48, bias=False)
    x = torch.randn(2, 10, 96)
    fp8 = Fp8Linear(linear)
    values, scale = quantize_rows(x.reshape(-1, 96))
    expected = (values.float() * scale) @ (fp8.weight.float() * fp8.weight_scale.t()).t()
    torch.testing.assert_close(fp8(x), expected.reshape(2, 10, 48), rtol=1e-5, atol=1e-5)
    relative = ((fp8(x) - linear(x)).norm() / linear(x).norm()).item()
    assert 1e-4 < relative < 0.05
    with pytest.raises(ValueError, match="bias-free"):
        Fp8Linear(torch.nn.Linear(4, 4))


def test_an_fp8_decoder_streams_close_to_the_full_precision_one():
    session = Session.load(preset="tiny")
    a = session.encode_text("fp8 check")
    reference = session.generate(a, 10.0, seed=4)
    decoder = session.models.acestep.decoder
    assert to_fp8(decoder) == 9 * len(decoder.layers)
    pipeline = StreamPipeline(decoder, depth=2)
    pipeline.submit(session.make_request(a, 10.0, seed=4))
    latent = pipeline.drain()[0].latent
    relative = ((latent - reference).norm() / reference.norm()).item()
    assert 0 < relative < 0.05, relative


def test_fp8_is_refused_where_it_cannot_run_on_tensor_cores():
    with pytest.raises(ValueError, match="use 'bf16'"):
        Session.load(preset="tiny", precision="fp8")
    with pytest.raises(ValueError, match="unknown precision"):
        Session.load(preset="tiny", precision="int3")

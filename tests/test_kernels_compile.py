"""Every Triton kernel in the package compiles for a Hopper GPU (sm_90) in the variants and tile configurations the
code launches, and for Blackwell (sm_100, sm_120), here on the CPU: Triton's front end and its bundled NVIDIA back
end (ptxas) need no GPU, so a kernel edit that does not compile fails in CI, not first on a GPU machine. What the kernels compute is checked on the GPU
(tests/test_fused_kernels_gpu.py). Skipped without Triton (`pip install 'flowjam[kernels]'`)."""

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is not installed (pip install 'flowjam[kernels]')")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction, mangle_type  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

HOPPER = GPUTarget("cuda", 90, 32)
PROGRAMS = 132  # an H100's multiprocessors: the persistent GEMMs' grid
BF16, FP8, FP32 = torch.bfloat16, torch.float8_e4m3fn, torch.float32


def _compiled(
    kernel, args: dict, constexprs: dict, num_warps: int, num_stages: int = 3, target: GPUTarget = HOPPER
) -> set[str]:
    """Compile `kernel` (a JIT function, or an autotuner around one) for `target` with arguments like `args` (CPU
    tensors, tensor descriptors, numbers) -> the stages it produced."""
    fn = kernel
    while not isinstance(fn, JITFunction):  # an autotuner's kernel
        fn = fn.fn
    signature = {name: "constexpr" if name in constexprs else mangle_type(args[name]) for name in fn.arg_names}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=target, options={"num_warps": num_warps, "num_stages": num_stages})
    return set(compiled.asm)


def _tensor(dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype)


def _descriptor(dtype: torch.dtype, shape: tuple[int, ...], block: list[int]) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(torch.empty(shape, dtype=dtype), block)


def _norm_args(n: int, quantize: bool) -> dict:
    """The norm pass's arguments at a width of n (h written as e4m3 with row scales, or in bf16)."""
    vector = _tensor(BF16, n)
    return dict(
        x_ptr=vector, delta_ptr=vector, gate_ptr=vector, weight_ptr=vector, scale_ptr=vector, shift_ptr=vector,
        x_out_ptr=vector, h_ptr=_tensor(FP8 if quantize else BF16, n),
        row_scale_ptr=_tensor(FP32 if quantize else BF16, 1),
        n=n, tokens=750, gate_stride=n, scale_stride=n, shift_stride=n, eps=1e-6,
    )  # fmt: skip


def _swiglu_args(tile: dict) -> dict:
    """The SwiGLU GEMM's arguments at turbo-2b's MLP (6,000 rows), descriptors boxed for `tile`."""
    block_m, block_n, block_k = tile["BLOCK_M"], tile["BLOCK_N"], tile["BLOCK_K"]
    return dict(
        a_desc=_descriptor(BF16, (6000, 2048), [block_m, block_k]),
        w_desc=_descriptor(BF16, (2, 6144, 2048), [2, block_n, block_k]),
        out_desc=_descriptor(BF16, (6000, 6144), [block_m, block_n]),
        M=6000, N=6144, K=2048, m_band=8192,
    )  # fmt: skip


def _qkv_args(tile: dict, head: int, heads: int, kv_heads: int) -> dict:
    """The q/k/v GEMM's arguments for these heads (6,000 rows), descriptors boxed for `tile` and a head's width."""
    n, k = (heads + 2 * kv_heads) * head, heads * head
    block_m, block_k = tile["BLOCK_M"], tile["BLOCK_K"]
    return dict(
        a_desc=_descriptor(BF16, (6000, k), [block_m, block_k]),
        w_desc=_descriptor(BF16, (n, k), [head, block_k]),
        out_desc=_descriptor(BF16, (6000, n), [block_m, head]),
        q_weight_ptr=_tensor(BF16, 1), k_weight_ptr=_tensor(BF16, 1), cos_ptr=_tensor(BF16, 1),
        sin_ptr=_tensor(BF16, 1), M=6000, N=n, K=k, m_band=8192, tokens=750, q_columns=heads * head,
        k_end=(heads + kv_heads) * head, eps=1e-6,
    )  # fmt: skip


@pytest.mark.parametrize("n", [2048, 1000])
@pytest.mark.parametrize(
    "add, gate, modulate, quantize",
    [
        (False, False, True, False),
        (False, False, False, False),
        (True, True, True, False),
        (True, False, False, False),
        (False, False, True, True),
        (True, True, True, True),
        (True, False, True, True),
    ],
)
def test_the_norm_pass_compiles_in_every_variant_the_ops_launch(n, add, gate, modulate, quantize):
    from flowjam.engine.kernels import norm_modulate

    constexprs = dict(ADD=add, GATE=gate, MODULATE=modulate, QUANTIZE=quantize, BLOCK=triton.next_power_of_2(n))
    for config in norm_modulate.ROW_CONFIGS:
        assert "cubin" in _compiled(
            norm_modulate._add_norm_modulate, _norm_args(n, quantize), constexprs, config.num_warps
        )


def test_the_swiglu_gemm_compiles_in_every_tile_configuration():
    from flowjam.engine.kernels import gemm_epilogue

    for config in gemm_epilogue.SWIGLU_CONFIGS:
        constexprs = dict(PROGRAMS=PROGRAMS, **config.kwargs)
        args = _swiglu_args(config.kwargs)
        assert "cubin" in _compiled(gemm_epilogue._swiglu_gemm, args, constexprs, config.num_warps, config.num_stages)


@pytest.mark.parametrize("head, heads, kv_heads", [(128, 16, 8), (16, 4, 2)])
def test_the_qkv_gemm_compiles_in_every_tile_configuration(head, heads, kv_heads):
    from flowjam.engine.kernels import qkv_rope

    for config in qkv_rope.QKV_CONFIGS:
        args = _qkv_args(config.kwargs, head, heads, kv_heads)
        constexprs = dict(PROGRAMS=PROGRAMS, HEAD=head, **config.kwargs)
        assert "cubin" in _compiled(qkv_rope._qkv_norm_rope_gemm, args, constexprs, config.num_warps, config.num_stages)


@pytest.mark.parametrize("head", [128, 16])
def test_the_separate_norm_and_rope_pass_compiles(head):
    from flowjam.engine.kernels import qkv_rope

    vector = _tensor(BF16, 1)
    args = dict(
        out_ptr=vector, q_weight_ptr=vector, k_weight_ptr=vector, cos_ptr=vector, sin_ptr=vector,
        M=6000, N=32 * head, tokens=750, q_columns=16 * head, eps=1e-6,
    )  # fmt: skip
    constexprs = dict(BLOCK_M=qkv_rope.PASS_ROWS, HEAD=head)
    assert "cubin" in _compiled(qkv_rope._norm_rope_columns, args, constexprs, 4)


@pytest.mark.parametrize("n, gated", [(6144, True), (2048, False), (1000, True)])
def test_the_quantising_pass_before_fp8_projections_compiles(n, gated):
    from flowjam.engine.kernels import quantize

    vector = _tensor(BF16, n)
    args = dict(x_ptr=vector, up_ptr=vector, values_ptr=_tensor(FP8, n), scale_ptr=_tensor(FP32, 1), n=n)
    constexprs = dict(GATED=gated, BLOCK=triton.next_power_of_2(n))
    for config in quantize._quantize_rows.configs:
        assert "cubin" in _compiled(quantize._quantize_rows, args, constexprs, config.num_warps)


@pytest.mark.parametrize("capability", [100, 120])
def test_every_kernel_compiles_for_blackwell_too(capability):
    """The kernels run on every GPU of compute capability 9.0 and up (`engine.kernels.MIN_CAPABILITY`): datacenter
    and consumer Blackwell compile them as well (each kernel's first tile configuration, the quantising norm pass)."""
    from flowjam.engine.kernels import gemm_epilogue, norm_modulate, qkv_rope

    target = GPUTarget("cuda", capability, 32)
    flags = dict(ADD=True, GATE=True, MODULATE=True, QUANTIZE=True, BLOCK=2048)
    assert "cubin" in _compiled(norm_modulate._add_norm_modulate, _norm_args(2048, True), flags, 8, target=target)
    tile = gemm_epilogue.SWIGLU_CONFIGS[0].kwargs
    constexprs = dict(PROGRAMS=PROGRAMS, **tile)
    assert "cubin" in _compiled(gemm_epilogue._swiglu_gemm, _swiglu_args(tile), constexprs, 8, target=target)
    tile = qkv_rope.QKV_CONFIGS[0].kwargs
    constexprs = dict(PROGRAMS=PROGRAMS, HEAD=128, **tile)
    args = _qkv_args(tile, 128, 16, 8)
    assert "cubin" in _compiled(qkv_rope._qkv_norm_rope_gemm, args, constexprs, 8, target=target)


def test_the_silu_mul_pass_and_the_lora_fold_compile():
    from flowjam.engine.kernels import gemm_epilogue
    from flowjam.engine.lora import fold_kernel

    silu = dict(gate_ptr=_tensor(BF16, 1), up_ptr=_tensor(BF16, 1), out_ptr=_tensor(BF16, 1), count=4096, n=6144,
                stride=12288)  # fmt: skip
    assert "cubin" in _compiled(gemm_epilogue._silu_mul, silu, dict(BLOCK=4096), 4)
    fold = dict(
        rest_ptr=_tensor(BF16, 1), up_ptr=_tensor(BF16, 1), down_ptr=_tensor(BF16, 1), scale_ptr=_tensor(FP32, 1),
        slot_ptr=_tensor(torch.int64, 1), strength_ptr=_tensor(FP32, 1), out_ptr=_tensor(BF16, 1),
        rows=2048, columns=2048, rank=64,
    )  # fmt: skip
    tiles = dict(BLOCK_M=fold_kernel.BLOCK_M, BLOCK_N=fold_kernel.BLOCK_N, BLOCK_R=fold_kernel.BLOCK_R)
    assert "cubin" in _compiled(fold_kernel._fold_tile, fold, tiles, fold_kernel.WARPS, fold_kernel.STAGES)

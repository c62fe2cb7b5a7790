"""The GPU profile's kernel kinds (`bench tick --profile`, `bench lm --profile`): each kernel a tick or a decode step
runs is counted under the kind a reader expects, ours included."""

import pytest
from flowjam.engine.bench.profile import kernel_kind


@pytest.mark.parametrize(
    "name, kind",
    [
        ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "gemm"),
        ("nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_TNT", "gemm"),
        ("_swiglu_gemm", "gemm"),
        ("_qkv_norm_rope_gemm", "gemm"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128", "attention"),
        ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::OpaqueType<2u>>", "copy"),
        ("void at::native::index_elementwise_kernel<128, 4, at::native::index_copy_kernel_impl>", "copy"),
        ("_add_norm_modulate", "fused elementwise"),
        ("_norm_rope_columns", "fused elementwise"),
        ("_quantize_rows", "fused elementwise"),
        ("_silu_mul", "fused elementwise"),
        ("triton_poi_fused_add_mul_view_0", "fused elementwise"),
        ("Memset (Unknown)", "other"),
    ],
)
def test_each_kernel_of_a_tick_or_step_is_counted_under_its_kind(name, kind):
    assert kernel_kind(name) == kind

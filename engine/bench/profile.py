"""Where a GPU's time goes in a bench's unit of work (a stream tick, an LM decode step): torch.profiler's kernels,
summed per unit, by kind and by name (`bench tick --profile`, `bench lm --profile`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

KERNEL_KINDS = {
    "gemm": ("gemm", "nvjet", "cutlass", "xmma", "scaled_mm", "cublas"),
    "attention": ("flash", "fmha", "attention", "cudnn"),
    "copy": ("copy", "index", "fill", "cat"),
    "fused elementwise": ("triton", "norm_modulate", "norm_rope", "quantize_rows", "silu_mul"),
    "other": (),
}


def kernel_kind(name: str) -> str:
    """Which KERNEL_KINDS a CUDA kernel's name belongs to (the first that matches; else "other")."""
    lowered = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS.items() if any(m in lowered for m in marks)), "other")


def kernel_profile(
    run: Callable[[], object], device: torch.device, runs: int, unit: str, units_per_run: int = 1
) -> str:
    """torch.profiler over `runs` calls of `run` on a GPU (each `units_per_run` units of work: ticks, decode steps):
    device time per `unit` and the kernels that take it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            run()
        torch.cuda.synchronize(device)
    units = runs * units_per_run
    kernels = [e for e in prof.key_averages() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    device_ms = sum(e.self_device_time_total for e in kernels) / 1000.0 / units
    top = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:24]
    kinds = {kind: 0.0 for kind in KERNEL_KINDS}
    for event in kernels:
        kinds[kernel_kind(event.key)] += event.self_device_time_total / 1000.0 / units
    launches = sum(e.count for e in kernels) / units
    lines = [f"device time {device_ms:.2f} ms/{unit} in {launches:.0f} kernels/{unit}"]
    lines.append("  by kind: " + ", ".join(f"{kind} {ms:.2f} ms" for kind, ms in kinds.items()))
    lines += [
        f"  {e.self_device_time_total / 1000.0 / units:7.3f} ms  {e.count / units:6.1f}x  {e.key[:90]}" for e in top
    ]
    return "\n".join(lines)

"""How the kernels' tile shapes are chosen: Triton's autotuner, timing each candidate briefly (about 25 ms instead
of its default 125 ms: the candidates differ by more than that resolution) and keeping its choices on disk in
Triton's cache directory, so a later start on the same GPU and Triton does not time them again."""

from __future__ import annotations

from collections.abc import Callable

import triton

TUNE_WARMUP_MS = 5
TUNE_REP_MS = 20


def _brief_bench(kernel_call: Callable, quantiles: tuple[float, ...]):
    return triton.testing.do_bench(kernel_call, warmup=TUNE_WARMUP_MS, rep=TUNE_REP_MS, quantiles=quantiles)


def autotuned(configs: list[triton.Config], key: list[str]) -> Callable:
    """`triton.autotune` over `configs` per value of the `key` arguments, timed briefly, its choices kept on disk."""
    return triton.autotune(configs=configs, key=key, do_bench=_brief_bench, cache_results=True)

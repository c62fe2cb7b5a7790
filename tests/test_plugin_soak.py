"""`flowjam bench plugin`: the LV2 in jalv on a JACK dummy server beside `flowjam live --plugin`, the plugin counting
its own time per block into its control block and a knob set in jalv timed to the engine; and the block-time bins the plugin counts in (C++) are the ones
the engine reads them with (Python)."""

import ctypes
import re
import shutil
import subprocess
import sys

import pytest
from flowjam.live.plugin_link import BLOCK_TIME_BINS, BlockTimes, block_time_bin, block_time_bin_floor
from plugin_build import build


def test_the_plugins_block_time_bins_are_the_engines():
    library = ctypes.CDLL(str(build(need_dpf=False) / "libflowjam_core.so"))
    library.flowjam_block_time_bin.argtypes = (ctypes.c_longlong,)
    values = [0, 1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 1000, 2_200, 4_800, 21_333_333, 2**33, 2**40, 2**62]
    values += [int(1.19**k) for k in range(240)]
    for ns in values:
        assert library.flowjam_block_time_bin(ns) == block_time_bin(ns), f"{ns} ns"
        index = block_time_bin(ns)
        if index < BLOCK_TIME_BINS - 1:
            assert block_time_bin_floor(index) <= ns < block_time_bin_floor(index + 1), f"{ns} ns in bin {index}"


def test_block_times_percentiles_are_the_bins_upper_edges_capped_by_the_slowest():
    counts = [0] * BLOCK_TIME_BINS
    counts[block_time_bin(2_000)] = 98  # 98 blocks of ~2 us, one of ~9 us, one of 40 us
    counts[block_time_bin(9_000)] = 1
    counts[block_time_bin(40_000)] = 1
    times = BlockTimes.of(counts, 40_000)
    assert times.blocks == 100 and times.max_us == 40.0
    assert times.median_us == block_time_bin_floor(block_time_bin(2_000) + 1) / 1000 == 2.048
    assert times.p99_us == block_time_bin_floor(block_time_bin(9_000) + 1) / 1000 == 10.24
    assert BlockTimes.of([0] * BLOCK_TIME_BINS, 0).blocks == 0


def test_bench_plugin_times_every_block_the_lv2_plays_in_jalv_beside_a_generating_engine():
    build()
    if shutil.which("jalv") is None or shutil.which("jackd") is None:
        pytest.skip("jalv and jackd (Debian jalv, jackd2) are needed; .ci/system-packages installs them")
    command = [sys.executable, "-m", "flowjam", "bench", "plugin", "--minutes", "0.2", "--period", "1024"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=420)
    out = result.stdout + result.stderr
    found = re.search(
        r"(\d+) blocks timed \((\d+) attached blocks counted\), per block median ([\d.]+) us, p99 ([\d.]+) us, max "
        r"([\d.]+) us",
        out,
    )
    assert found, out
    timed, counted = int(found.group(1)), int(found.group(2))
    median, p99, longest = map(float, found.group(3, 4, 5))
    assert timed == counted > 400, "the plugin timed every block it played attached (12 s at 1024 frames: ~560)"
    assert 0 < median <= p99 <= longest < 21_333, "a block took longer than its period"
    rolled = re.search(r"transport rolled (\d+) cycles: (\d+) gaps", out)
    assert rolled and int(rolled.group(1)) > 400, out
    assert re.search(r"engine latents (\d+)", out), out
    automated = re.search(
        r"(\d+) sets; median / p95 / max\): set -> the plugin's block ([\d.]+) / [\d.]+ / ([\d.]+) ms, block -> "
        r"engine ([\d.]+) / [\d.]+ / ([\d.]+) ms",
        out,
    )
    assert automated and int(automated.group(1)) >= 3, (
        f"host automation set in jalv every 2 s reached the engine: {out}"
    )
    assert 0 <= float(automated.group(2)) <= float(automated.group(3)), out
    assert 0 <= float(automated.group(4)) <= float(automated.group(5)), out
    verdict_passed = "verdict: passed" in out
    assert result.returncode == (0 if verdict_passed else 1), out


def test_bench_plugin_refuses_a_period_jack_cannot_take():
    result = subprocess.run(
        [sys.executable, "-m", "flowjam", "bench", "plugin", "--period", "1000"], capture_output=True, text=True
    )
    assert result.returncode == 2 and "a power of two" in result.stderr, result.stderr

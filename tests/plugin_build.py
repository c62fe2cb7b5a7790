"""Builds plugin/ once per test session with its own Makefile (every target the tests use, in one `make -j2` so both
cores compile), or skips the plugin tests with the reason printed when the toolchain (make, a C++ compiler, DPF) is
truly absent; a failing build fails. Without DPF the render core alone still builds for the parity test."""

import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest

PLUGIN_DIR = Path(__file__).resolve().parent.parent / "plugin"
BUILD_DIR = PLUGIN_DIR / "build"
DPF_PATH = Path("/usr/share/dpf")


def missing_toolchain(need_dpf: bool) -> str | None:
    """Why the plugin cannot be built here, or None."""
    for tool in ("make", "g++", "gcc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install g++ make, or run .ci/system-packages)"
    if need_dpf and not (DPF_PATH / "Makefile.plugins.mk").is_file():
        return f"DPF is not at {DPF_PATH} (apt-get install dpf-source, or run .ci/system-packages)"
    return None


TEST_TARGETS = ("vst3", "lv2-ttl", "clap-host", "core")  # the JACK standalone is built by `make`, not tested


@cache
def _make(*targets: str) -> None:
    result = subprocess.run(["make", "-C", str(PLUGIN_DIR), "-j2", *targets], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.fail(f"make -C plugin {' '.join(targets)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")


def build(need_dpf: bool = True) -> Path:
    """Every plugin target the tests use (once per session; only the render core without DPF); the build folder."""
    reason = missing_toolchain(need_dpf)
    if reason is not None:
        print(f"plugin tests skipped: {reason}")
        pytest.skip(reason)
    if missing_toolchain(need_dpf=True) is None:
        _make(*TEST_TARGETS)
    else:
        _make("core")
    return BUILD_DIR

"""Builds plugin/ once per test session with its own Makefile (`make -C plugin TARGET`), or skips the plugin tests
with the reason printed when the toolchain (make, a C++ compiler, DPF) is truly absent; a failing build fails."""

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


@cache
def _make(target: str) -> None:
    result = subprocess.run(["make", "-C", str(PLUGIN_DIR), "-j2", target], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.fail(f"make -C plugin {target} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")


def build(target: str, need_dpf: bool = True) -> Path:
    """`make -C plugin target` (once per session); the build folder."""
    reason = missing_toolchain(need_dpf)
    if reason is not None:
        print(f"plugin tests skipped: {reason}")
        pytest.skip(reason)
    _make(target)
    return BUILD_DIR

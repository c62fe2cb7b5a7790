"""README.md is a user's guide that stays true: its knob table is the registry's (`flowjam.live.layout.knob_table_markdown`), and every
command it shows that needs no GPU, sound card, network or real checkpoint runs as written on the tiny preset."""

from __future__ import annotations

import math
import re
import shlex
import struct
import subprocess
import sys
import wave
from pathlib import Path

import pytest
from flowjam.engine.params import KNOB_SPECS, KnobKind, KnobSpec
from flowjam.live.layout import knob_table_markdown

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
KNOBS_BEGIN, KNOBS_END = "<!-- knobs:begin -->", "<!-- knobs:end -->"
README_MAX_LINES = 300


def readme_knob_block(text: str) -> str:
    """What README.md holds between the knob markers."""
    assert KNOBS_BEGIN in text and KNOBS_END in text, f"README.md lost its {KNOBS_BEGIN} ... {KNOBS_END} markers"
    return text.split(KNOBS_BEGIN, 1)[1].split(KNOBS_END, 1)[0].strip("\n") + "\n"


def stale_knob_rows(block: str, knobs: tuple[KnobSpec, ...] = KNOB_SPECS) -> list[str]:
    """Names of the knobs whose row in `block` is missing or differs from the registry's."""
    rows = set(block.splitlines())
    return [knob.name for knob in knobs if knob_table_markdown((knob,)).splitlines()[-1] not in rows]


def test_readme_knob_table_is_the_registrys():
    block = readme_knob_block(README.read_text())
    expected = knob_table_markdown()
    if block != expected:
        print(f"README.md's knob table is stale; paste this between {KNOBS_BEGIN} and {KNOBS_END}:\n\n{expected}")
    assert block == expected, f"README.md's knob table differs from KNOB_SPECS (stale rows: {stale_knob_rows(block)})"


def test_a_knob_added_to_the_registry_is_reported_missing_from_the_readme():
    extra = KnobSpec("test_only_knob", 0.0, 1.0, 0.5, KnobKind.SHARED, description="a knob the README never saw")
    block = readme_knob_block(README.read_text())
    assert knob_table_markdown((*KNOB_SPECS, extra)) != block
    assert stale_knob_rows(block, (*KNOB_SPECS, extra)) == ["test_only_knob"]


def test_knob_table_shows_choices_by_name_and_integers_whole():
    cfg_mode = next(knob for knob in KNOB_SPECS if knob.choices)
    seed = KnobSpec("seed", 0.0, float(2**31 - 1), 42.0, KnobKind.REQUEST, integer=True)
    table = knob_table_markdown((cfg_mode, seed))
    assert f"| {', '.join(cfg_mode.choices)} | {cfg_mode.choice(cfg_mode.default)} |" in table
    assert "| 0 to 2147483647 | 42 | next generation |" in table


def test_readme_is_a_guide_of_at_most_300_lines():
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"


def test_every_docs_page_the_readme_links_exists_and_every_page_is_linked():
    text = README.read_text()
    linked = set(re.findall(r"\]\((docs/[^)#]+)", text))
    missing = sorted(path for path in linked if not (ROOT / path).is_file())
    assert not missing, f"README.md links to docs pages that do not exist: {missing}"
    unlinked = sorted(f"docs/{page.name}" for page in (ROOT / "docs").glob("*.md") if f"docs/{page.name}" not in linked)
    assert not unlinked, f"docs pages missing from README.md's index: {unlinked}"


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings."""
    headings = re.findall(r"^#+ (.+)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_every_relative_link_in_readme_and_docs_resolves():
    broken = []
    for page in (README, *sorted((ROOT / "docs").glob("*.md"))):
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if "://" in target:
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists() or (anchor and anchor not in heading_anchors(linked.read_text())):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, f"links that lead nowhere: {broken}"


# --- the README's commands ---------------------------------------------------------------------------------------

FULL_SIZE_PRESETS = ("turbo-2b", "xl", "lm-0.6b", "lm-1.7b", "lm-4b")
BENCH_DEFAULT_PRESET = {**dict.fromkeys(("tick", "ring", "lora", "decode"), "turbo-2b"), "lm": "lm-1.7b"}


def readme_commands(text: str) -> list[str]:
    """The `python -m flowjam ...` lines of the README's ```bash blocks, continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if len(words) > 3 and Path(words[0]).name.startswith("python") and words[1:3] == ["-m", "flowjam"]:
                commands.append(shlex.join(words[3:]))
    return commands


def _option(words: list[str], name: str) -> str | None:
    return words[words.index(name) + 1] if name in words[:-1] else None


def why_not_run(words: list[str]) -> str | None:
    """Why this command cannot run in the test (GPU, sound card, network, real weights, minutes), or None."""
    command = words[0]
    if (_option(words, "--device") or "").startswith("cuda") or "--gpus" in words:
        return "needs a CUDA GPU"
    if "--checkpoint" in words or "--lm-checkpoint" in words:
        return "needs real checkpoint files"
    if command == "serve":
        return "serves until stopped"
    if command in ("bridge", "listen"):
        return "needs a running flowjam serve (network)"
    if command == "live":
        if "--list-devices" in words or "--no-audio" not in words or "--audio-device" in words:
            return "needs a sound card"
        if "--seconds" not in words:
            return "plays until Ctrl-C"
        if "--midi-port" in words:
            return "needs a MIDI port"
    if command == "bench":
        target = words[1]
        if target == "soak":
            return "a soak plays for minutes"
        preset = _option(words, "--lm-preset" if target == "lm" else "--preset") or BENCH_DEFAULT_PRESET.get(
            target, "tiny"
        )
        if preset in FULL_SIZE_PRESETS:
            return f"{preset} with random weights takes minutes on the CPU"
    return None


def write_test_wav(path: Path, seconds: float = 3.0, rate: int = 48_000) -> None:
    """A stereo 16-bit sine, for the input files a command names (--cover, --source)."""
    samples = [round(8000 * math.sin(2 * math.pi * 220 * n / rate)) for n in range(round(seconds * rate))]
    with wave.open(str(path), "wb") as file:
        file.setnchannels(2)
        file.setsampwidth(2)
        file.setframerate(rate)
        file.writeframes(b"".join(struct.pack("<hh", s, s) for s in samples))


COMMANDS = readme_commands(README.read_text())
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_the_readme_shows_commands_that_the_tests_run():
    runnable = [command for command in COMMANDS if why_not_run(shlex.split(command)) is None]
    assert {shlex.split(command)[0] for command in runnable} >= {"render", "demo", "live", "info"}, runnable


@pytest.mark.parametrize("command", COMMANDS, ids=[command[:60] for command in COMMANDS])
def test_readme_command_runs_as_written(command, tmp_path):
    words = shlex.split(command)
    reason = why_not_run(words)
    if reason is not None:
        print(f"skipped `python -m flowjam {command}`: {reason}")
        pytest.skip(f"{reason}: {command}")
    for option in ("--cover", "--source"):
        source = _option(words, option)
        if source is not None and not (tmp_path / source).exists():
            write_test_wav(tmp_path / source)
    result = subprocess.run(
        [sys.executable, "-m", "flowjam", *words], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, (
        f"`python -m flowjam {command}` exited {result.returncode}:\n{result.stderr[-3000:]}\n{result.stdout[-2000:]}"
    )
    for option in ("--out", "--record"):
        written = _option(words, option)
        if written is None:
            continue
        with wave.open(str(tmp_path / written)) as file:
            frames, rate = file.getnframes(), file.getframerate()
        assert rate == 48_000 and frames > 0, f"{written}: {frames} frames at {rate} Hz"
        if words[0] == "render":
            seconds = float(_option(words, "--seconds") or 10.0)
            assert frames == round(seconds * rate), f"{written} holds {frames / rate:g} s, --seconds {seconds:g}"


@pytest.mark.parametrize("code", PYTHON_BLOCKS, ids=[f"python-block-{i}" for i in range(len(PYTHON_BLOCKS))])
def test_readme_python_runs_as_written(code, tmp_path):
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"README's Python block failed:\n{code}\n{result.stderr[-3000:]}"


COMFYUI_PAGES = (README, ROOT / "docs" / "comfyui.md", ROOT / "workflows" / "README.md")


def test_the_comfyui_pages_name_the_template_browser_where_both_frontends_have_it():
    """Frontends 1.27 and 1.58 have no "Workflow > Browse Templates": it is under the logo menu, or the sidebar's
    Templates button."""
    for page in COMFYUI_PAGES:
        text = " ".join(page.read_text().split())
        assert "Workflow > Browse Templates" not in text, f"{page.name} names a menu no frontend has"
        assert "the ComfyUI logo menu > Browse Templates, or the Templates button in the sidebar" in text, page.name


def test_the_readme_and_comfyui_guide_say_how_to_install_portaudio():
    """A stream plays through sounddevice, which needs the PortAudio system library: the install line per platform."""
    for page in COMFYUI_PAGES[:2]:
        text = " ".join(page.read_text().split())
        for fix in ("sudo apt install libportaudio2", "brew install portaudio"):
            assert fix in text, f"{page.name} does not say {fix!r}"

"""A DAW around the plugin for the tests: the engine (`python -m flowjam live --plugin`) as a process of its own, and
DawDreamer (a headless VST3 host) rendering the plugin with a host state that names the engine's session."""

import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from flowjam.live.engine_process import EngineProcess
from flowjam.live.renderer import click_wave

RATE, BLOCK, BPM = 48_000, 512, 123.0
SESSION = f"ci-{os.getpid()}"  # the plugin tests' engine session (tests/conftest.py plugin_engine)
# The tests' engines and plugin instances meet in a lobby of their own, apart from any other engine on the machine.
os.environ.setdefault("FLOWJAM_LOBBY", f"flowjam-lobby-ci-{os.getpid()}")
BAR_FRAMES = 4 * 60 / BPM * RATE
_JUCE_CHARS = ".ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+"


class Engine(EngineProcess):
    """`flowjam live --plugin` on the tiny preset, for a session."""

    def __init__(self, session: str, *flags: str, browser_log: Path | None = None):
        """`browser_log`: the engine's $BROWSER is a script that appends each URL it is asked to open to this file."""
        self.session, self.browser_log, env = session, browser_log, None
        if browser_log is not None:
            browser = browser_log.with_name("browser.sh")
            browser.write_text(f'#!/bin/sh\necho "$1" >> "{browser_log}"\n')
            browser.chmod(0o755)
            env = {**os.environ, "BROWSER": str(browser)}
        command = [sys.executable, "-m", "flowjam", "live", "--plugin", "--preset", "tiny", "--osc-port", "0"]
        super().__init__([*command, "--session", session, *flags], env)

    def wait_ready(self, latents: int = 2, timeout_s: float = 180.0) -> None:
        """Until the loop is made (its first generations written)."""
        try:
            super().wait_ready(latents, timeout_s)
        except RuntimeError as error:
            pytest.fail(str(error))


def click_onset_near(audio: np.ndarray, index: int) -> int:
    """The onset of the metronome's click nearest `index`: the best match of its shape within 20 ms."""
    click = click_wave(RATE)[:, 0].astype(np.float64)
    low = max(0, index - RATE // 50)
    window = audio[low : index + RATE // 50 + click.size].astype(np.float64)
    return low + int(np.argmax(np.correlate(window, click, mode="valid")))


def juce_base64(data: bytes) -> str:
    """JUCE's MemoryBlock::toBase64Encoding (the VST3 state in DawDreamer's files): size, '.', 6 bits a character."""
    bits = int.from_bytes(data, "little")
    chars = [_JUCE_CHARS[(bits >> (6 * i)) & 63] for i in range((8 * len(data) + 5) // 6)]
    return f"{len(data)}." + "".join(chars)


def juce_unbase64(text: str) -> bytes:
    size, _, encoded = text.partition(".")
    bits = sum(_JUCE_CHARS.index(c) << (6 * i) for i, c in enumerate(encoded))
    return (bits & ((1 << (8 * int(size))) - 1)).to_bytes(int(size), "little")


def dpf_state(path, **states: str) -> None:
    """Rewrite state values in a file DawDreamer saved (DPF keeps its states as key\\0value pairs)."""
    raw = path.read_bytes()
    xml = raw[8:].rstrip(b"\0").decode()
    found = re.search(r"<IComponent>(.*?)</IComponent>", xml)
    chunk = juce_unbase64(found.group(1))
    for key, value in states.items():
        pair = key.encode() + b"\0" + value.encode() + b"\0"
        chunk = re.sub(re.escape(key.encode()) + rb"\0[^\0]*\0", lambda _, pair=pair: pair, chunk, count=1)
    xml = xml[: found.start(1)] + juce_base64(chunk) + xml[found.end(1) :]
    body = xml.encode() + b"\0"
    path.write_bytes(b"VC2!" + len(body).to_bytes(4, "little") + body)


def plugin_for_session(daw, vst3, session: str, state_path, engine=None):
    """(render engine, the plugin processor) with the plugin on `session`, attached once the engine answers."""
    engine = engine or daw.RenderEngine(RATE, BLOCK)
    engine.set_bpm(BPM)
    plugin = engine.make_plugin_processor("flowjam", str(vst3))
    if not state_path.exists():
        plugin.save_state(str(state_path))
        dpf_state(state_path, session=session)
    load_state(plugin, state_path)
    engine.load_graph([(plugin, [])])
    time.sleep(0.4)  # the plugin's watcher attaches within 0.1 s of the session appearing
    return engine, plugin


def load_state(plugin, path) -> None:
    """Give the plugin a state DawDreamer saved, as a DAW opening a project does."""
    try:
        plugin.load_state(str(path))
    except Exception as error:  # DawDreamer applies the state, then asks a plugin without a UI for its editor
        if "editor" not in str(error):
            raise


def saved_state(path, key: str) -> str:
    """A state value in a file DawDreamer saved."""
    xml = path.read_bytes()[8:].rstrip(b"\0").decode()
    chunk = juce_unbase64(re.search(r"<IComponent>(.*?)</IComponent>", xml).group(1))
    found = re.search(re.escape(key.encode()) + rb"\0([^\0]*)\0", chunk)
    return found.group(1).decode() if found else ""


def parameter_index(plugin, name: str) -> int:
    """A host parameter found by name, as a musician's DAW shows it."""
    for description in plugin.get_parameters_description():
        if description["name"] == name:
            return int(description["index"])
    raise AssertionError(f"the plugin has no parameter {name!r}")

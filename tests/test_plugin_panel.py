"""The plugin's panel (live/plugin_panel.py) against a real engine (`flowjam live --plugin`, tiny preset) and the VST3 in
DawDreamer (the plugin tests' shared engine; what a test changes through the panel is set back after it): the engine
prints the panel's URL at start; the page and its state are served with the token and refused
without it (or from a foreign Host); a prompt typed in the panel is what the engine generates from and what the DAW
project saves, and typed back the old one again (what a prompt does to the sound is the engine's, tested there: on the
tiny preset's random weights it moves a plugin session's loop less than the loop varies between its own sweeps); a
knob turned there changes the output; bad input gets a 400 naming the fix while the
stream plays on; the plugin's `panel` parameter has the engine open the URL in the browser $BROWSER names (a script
here that writes down the URL it was given)."""

import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.parse
from pathlib import Path

import numpy as np
import pytest
from daw_host import BAR_FRAMES, BPM, SESSION, parameter_index, plugin_for_session, saved_state
from flowjam.engine.params import MAX_PROMPT_CHARS
from flowjam.live.plugin_link import HOST_BLOCKS, HOST_PANEL_REQUESTS, STALE_AFTER_S, ControlBlock
from flowjam.live.plugin_panel import PAGE
from helpers import wait_for
from plugin_build import build

daw = pytest.importorskip("dawdreamer", reason="DawDreamer (pip install 'flowjam[test]') hosts the VST3")

PROMPT, OTHER_PROMPT = "ambient pads", "distorted drum and bass, loud snare"  # PROMPT: the engine's --prompt
LOOP_S = 2 * 4 * 60 / BPM  # the engine's loop: 2 bars at 123 BPM


@pytest.fixture(scope="module")
def vst3():
    return build() / "flowjam.vst3"


@pytest.fixture
def panel_url(plugin_engine) -> str:
    """The URL the shared engine printed at its start; what a test changed through it is set back afterwards."""
    url = plugin_engine.panel_url()
    before = request(url + "state")[1]
    yield url
    for slot, text in before["prompts"].items():
        if text and request(url + "state")[1]["prompts"][slot] != text:
            post(url, "prompt", {"slot": slot, "text": text})
    for name, spec in before["knobs"].items():
        post(url, "knob", {"name": name, "value": spec["value"]})
    wait_for(lambda: request(url + "state")[1]["prompts"] == before["prompts"], 60, "the prompts set back")


def quiet_click(plugin) -> None:
    """The plugin's click off (the shared engine clicks): what is left is the loop."""
    plugin.set_parameter(parameter_index(plugin, "click"), 0.5)


def request(url: str, method: str = "GET", body: bytes | None = None, host: str | None = None):
    """(status, parsed JSON or the text) of one request to the panel."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    headers = {"Content-Type": "application/json"}
    if host is not None:
        headers["Host"] = host
    connection.request(method, parts.path, body=body, headers=headers)
    reply = connection.getresponse()
    data = reply.read().decode()
    connection.close()
    kind = reply.getheader("Content-Type", "")
    return reply.status, json.loads(data) if kind.startswith("application/json") else data


def post(panel_url: str, route: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return request(panel_url + route, "POST", data)


def test_panel_is_served_with_its_token_and_refused_without_it(panel_url):
    status, page = request(panel_url)
    assert status == 200 and "Prompt A" in page and "<script" in page
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page), "the page fetches nothing from the network"
    status, state = request(panel_url + "state")
    assert status == 200 and state["prompts"]["a"] == PROMPT
    assert {"prompt_blend", "volume", "denoise", "seed"} <= set(state["knobs"])
    assert state["knobs"]["volume"]["max"] == 1.0
    root = panel_url.rsplit("/", 2)[0] + "/"
    wrong = root + "x" * len(panel_url.rsplit("/", 2)[1]) + "/"
    for url, method in ((root, "GET"), (wrong, "GET"), (wrong + "state", "GET"), (wrong + "knob", "POST")):
        status, answer = request(url, method, b'{"name": "volume", "value": 0}' if method == "POST" else None)
        assert status == 403 and "token" in answer["error"], (url, status, answer)
    status, answer = request(panel_url + "state", host="evil.example:80")
    assert status == 403 and "127.0.0.1" in answer["error"]


def rendered_loop(host) -> np.ndarray:
    """One loop of the plugin's output from the host's bar 1 (left channel)."""
    host.render(LOOP_S)
    return host.get_audio()[0, : round(2 * BAR_FRAMES)].copy()


def type_prompt(host, plugin, engine, panel_url: str, saved_to: Path, text: str) -> None:
    """Type prompt A in the panel; return once the engine generates from it and the project saves it."""
    assert post(panel_url, "prompt", {"slot": "a", "text": text}) == (200, {"slot": "a", "text": text})
    wait_for(lambda: request(panel_url + "state")[1]["prompts"]["a"] == text, 60, f"the engine to play {text!r}")
    latents = engine.latents()
    wait_for(lambda: engine.latents() >= latents + 2, 120, f"two generations of {text!r}")

    def saved() -> bool:
        host.render(0.2)
        plugin.save_state(str(saved_to))
        return saved_state(saved_to, "prompt") == text

    wait_for(saved, 30, f"the project to save {text!r} (the engine's prompt, given back to the plugin)")


def test_a_prompt_typed_in_the_panel_is_what_the_engine_plays_and_what_the_project_saves(
    plugin_engine, panel_url, vst3, tmp_path
):
    host, plugin = plugin_for_session(daw, vst3, SESSION, tmp_path / "state")
    quiet_click(plugin)
    host.render(0.5)  # attached: the plugin has given the engine its project
    for text in (OTHER_PROMPT, PROMPT):  # typed, then typed back
        type_prompt(host, plugin, plugin_engine, panel_url, tmp_path / "saved", text)


def test_a_knob_turned_in_the_panel_changes_the_output(panel_url, vst3, tmp_path):
    host, plugin = plugin_for_session(daw, vst3, SESSION, tmp_path / "state")
    quiet_click(plugin)
    host.render(0.5)
    loud = rendered_loop(host)
    assert np.abs(loud).max() > 1e-2, "the loop is audible"
    assert post(panel_url, "knob", {"name": "volume", "value": 0.0}) == (200, {"name": "volume", "value": 0.0})
    heard = []

    def silenced() -> bool:
        heard.append(float(np.abs(rendered_loop(host)[1024:]).max()))
        return heard[-1] == 0.0

    wait_for(silenced, 30, lambda: f"volume 0 from the panel to silence the plugin (peaks {heard}, {state(panel_url)})")
    assert post(panel_url, "knob", {"name": "volume", "value": 0.8})[0] == 200
    wait_for(lambda: np.abs(rendered_loop(host)).max() > 1e-2, 30, "volume 0.8 from the panel to bring it back")


def test_a_knob_turned_in_the_panel_is_shown_in_the_host(panel_url, vst3, tmp_path):
    """The engine's own knob change (the panel's here; OSC's and MIDI's take the same path) is shown in the host: the
    VST3 takes the engine's value and asks the host to move its parameter (DPF sends it as the processor's output
    change), so the parameter's text the host shows reads the engine's value after the next blocks, and the engine
    keeps playing it (the plugin does not send its project's value back). Red before: the host showed the project's
    seed. DawDreamer's `get_parameter` is the value its own automation holds, which it does not move."""
    host, plugin = plugin_for_session(daw, vst3, SESSION, tmp_path / "state")
    seed = parameter_index(plugin, "seed")
    host.render(0.5)
    before = plugin.get_parameter_text(seed)
    try:
        assert post(panel_url, "knob", {"name": "seed", "value": 4321})[0] == 200

        def shown() -> bool:
            host.render(0.05)
            return plugin.get_parameter_text(seed) == "4321"

        wait_for(
            shown, 10, lambda: f"the host to show the panel's seed 4321 (it shows {plugin.get_parameter_text(seed)})"
        )
        host.render(0.5)
        assert request(panel_url + "state")[1]["knobs"]["seed"]["value"] == 4321, "the engine plays the panel's seed"
    finally:
        post(panel_url, "knob", {"name": "seed", "value": int(before)})


def test_a_panel_knob_holds_when_the_engine_stalls_and_the_plugin_attaches_to_it_again(
    plugin_engine, panel_url, vst3, tmp_path
):
    """An engine that stalls past the plugin's patience (a swap storm, a debugger: its heartbeat goes stale for a
    second) is the same engine when it comes back: the plugin attaches to it again without giving it the project's
    knobs a second time, so the volume the player set in the panel holds (the project still says 0.8)."""
    host, plugin = plugin_for_session(daw, vst3, SESSION, tmp_path / "state")
    quiet_click(plugin)
    host.render(0.5)
    control = ControlBlock(SESSION, create=False)
    try:
        assert post(panel_url, "knob", {"name": "volume", "value": 0.0})[0] == 200
        wait_for(lambda: not rendered_loop(host)[1024:].any(), 30, "the panel's volume 0 to silence the plugin")
        os.kill(plugin_engine.process.pid, signal.SIGSTOP)
        try:
            time.sleep(STALE_AFTER_S + 0.5)
            blocks = int(control.counters[HOST_BLOCKS])
            host.render(0.1)
            assert int(control.counters[HOST_BLOCKS]) == blocks, "the plugin let go of the stalled engine"
        finally:
            os.kill(plugin_engine.process.pid, signal.SIGCONT)

        def attached_again() -> bool:
            before = int(control.counters[HOST_BLOCKS])
            host.render(0.05)
            return int(control.counters[HOST_BLOCKS]) > before

        wait_for(attached_again, 10, "the plugin to attach to the engine again (its blocks counted)")
        time.sleep(0.3)  # the engine's next control rounds: a project volume given again would be taken in now
        peaks = [float(np.abs(rendered_loop(host)).max()) for _ in range(2)]
        assert peaks == [0.0, 0.0], f"the project's volume came back over the panel's 0 ({state(panel_url)})"
        assert "volume 0.0" in state(panel_url)
    finally:
        post(panel_url, "knob", {"name": "volume", "value": 0.8})
        control.close()


def state(panel_url: str) -> str:
    """The panel's volume and prompt A, for a failure's message."""
    now = request(panel_url + "state")[1]
    return f"the panel says volume {now['knobs']['volume']['value']}, prompt A {now['prompts']['a']!r}"


BAD_BODIES = {
    "unknown knob": ("knob", {"name": "brightness", "value": 0.5}, "unknown knob 'brightness'"),
    "out of range": ("knob", {"name": "volume", "value": 2.0}, "volume takes 0..1"),
    "not a number": ("knob", {"name": "volume", "value": "loud"}, "takes a number"),
    "too long a prompt": ("prompt", {"slot": "a", "text": "x" * (MAX_PROMPT_CHARS + 1)}, f"at most {MAX_PROMPT_CHARS}"),
    "an empty prompt A": ("prompt", {"slot": "a", "text": "  "}, "prompt A is empty"),
    "an unknown slot": ("prompt", {"slot": "c", "text": "pads"}, "one of a, b, negative"),
    "not JSON": ("prompt", b"slot=a&text=pads", "not JSON"),
    "missing fields": ("knob", {"value": 0.5}, "send a JSON object"),
}


def test_bad_input_gets_a_400_naming_the_fix_and_the_stream_plays_on(plugin_engine, panel_url):
    knobs = request(panel_url + "state")[1]["knobs"]
    latents = plugin_engine.latents()
    for case, (route, body, said) in BAD_BODIES.items():
        status, answer = post(panel_url, route, body)
        assert status == 400 and said in answer["error"], (case, status, answer)
    state = request(panel_url + "state")[1]
    assert {name: spec["value"] for name, spec in state["knobs"].items()} == {
        name: spec["value"] for name, spec in knobs.items()
    }, "a refused change changed no knob"
    assert state["prompts"]["a"] in (PROMPT, OTHER_PROMPT)
    wait_for(lambda: plugin_engine.latents() > latents + 1, 60, "the engine to go on generating")
    assert plugin_engine.process.poll() is None


def test_the_plugins_panel_parameter_has_the_engine_open_the_url_in_the_browser(
    plugin_engine, panel_url, vst3, tmp_path
):
    log = plugin_engine.browser_log

    def opened() -> list[str]:
        return log.read_text().splitlines() if log.exists() else []

    host, plugin = plugin_for_session(daw, vst3, SESSION, tmp_path / "state")
    host.render(0.2)
    earlier = opened()
    time.sleep(0.2)
    assert opened() == earlier, "nothing opened before the parameter moved"
    panel = parameter_index(plugin, "panel")
    control = ControlBlock(SESSION, create=False)
    try:
        presses = int(control.counters[HOST_PANEL_REQUESTS])
        plugin.set_parameter(panel, 1.0)
        host.render(0.2)
        wait_for(lambda: len(opened()) == len(earlier) + 1, 10, "the browser script to be run")
        assert opened()[-1] == panel_url
        host.render(0.2)  # the parameter still on: no second window
        plugin.set_parameter(panel, 0.0)
        host.render(0.2)
        plugin.set_parameter(panel, 1.0)
        host.render(0.2)
        wait_for(lambda: len(opened()) == len(earlier) + 2, 10, "a second turn to open it again")
        assert control.counters[HOST_PANEL_REQUESTS] == presses + 2, "the plugin counted two turns in the block"
    finally:
        control.close()


def test_the_pages_script_shows_the_state_and_posts_what_the_player_does(panel_url):
    """The page's own script under node (tests/panel_page.js: a minimal document, node's fetch) against the panel."""
    if shutil.which("node") is None:
        pytest.skip("node is not installed (apt-get install nodejs)")
    driver = Path(__file__).with_name("panel_page.js")
    result = subprocess.run(["node", str(driver), str(PAGE), panel_url], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    state = request(panel_url + "state")[1]
    assert shown["knobs"][0] == "prompt_blend" and sorted(shown["knobs"]) == sorted(state["knobs"])
    assert shown["shownPromptA"] == state["prompts"]["a"]
    assert shown["shownVolume"] == "0.250" and state["knobs"]["volume"]["value"] == 0.25
    assert shown["afterB"] == "prompt b applied"
    assert shown["afterEmptyA"].startswith("prompt A is empty") and shown["messageClass"] == ""
    wait_for(lambda: request(panel_url + "state")[1]["prompts"]["b"] == "glass harmonica", 60, "prompt B to play")

"""The engine's side of the plugin (live/plugin_output.py) through the shared memory a plugin attaches to: a
knob the host moved reaches the registry at the next read, and the control block is read once per host block."""

import json
import os
import time
import urllib.request

import pytest
from flowjam.engine.params import KNOB_SPECS
from flowjam.live.knobs import KnobRegistry
from flowjam.live.loop_buffer import LoopBuffer
from flowjam.live.plugin_link import (
    ENGINE_HOST_CHANGES_TAKEN,
    ENGINE_HOST_LAG_MS,
    ENGINE_PROMPTS_SEQ,
    ENGINE_PROMPTS_TAKEN,
    HOST_BLOCK_FRAMES,
    HOST_CHANGES_NS,
    HOST_PROMPTS_SEQ,
    HOST_SAMPLE_RATE,
    PROMPT_BYTES,
    PROMPTS,
)
from flowjam.live.plugin_output import POLL_S, SHORTEST_POLL_S, PluginOutput


@pytest.fixture
def output():
    buffer = LoopBuffer(48_000, 2, 48_000)
    out = PluginOutput(buffer, KnobRegistry(), session=f"out-{os.getpid()}")
    try:
        yield out, out.control  # the segment the plugin maps (a second mapping in one process would unregister it)
    finally:
        out.control.unlink()
        buffer.unlink()
        buffer.close()


@pytest.mark.parametrize(
    ("frames", "poll_s"), [(0, POLL_S), (256, 256 / 48_000), (512, 512 / 48_000), (64, SHORTEST_POLL_S), (2048, POLL_S)]
)
def test_the_control_block_is_read_once_per_host_block(output, frames, poll_s):
    out, plugin = output
    plugin.counters[HOST_BLOCK_FRAMES], plugin.counters[HOST_SAMPLE_RATE] = frames, 48_000 if frames else 0
    assert out.poll_s == pytest.approx(poll_s)


def test_a_knob_the_host_moved_reaches_the_registry_at_the_next_read_and_back(output):
    out, plugin = output
    index = next(i for i, spec in enumerate(KNOB_SPECS) if spec.name == "velocity_scale")
    before = out.registry.get("velocity_scale")
    plugin.host_values[index], plugin.host_changes[index] = 1.4, plugin.host_changes[index] + 1
    out.poll()
    assert out.registry.get("velocity_scale") == pytest.approx(1.4) != before
    assert out.control.engine_values[index] == pytest.approx(1.4), "the engine's value shown back to the host"
    plugin.host_values[index], plugin.host_changes[index] = before, plugin.host_changes[index] + 1
    out.poll()
    assert out.registry.get("velocity_scale") == before


def test_a_knob_the_engine_changed_by_itself_is_counted_for_the_host_to_show_and_the_hosts_own_is_not(output):
    """The engine's own change (OSC, MIDI, the panel: here the registry set as they set it) counts one engine change
    of that knob, its value beside it; the host's change taken in counts none (the host holds it already), and an
    engine change made while a host change is on its way in counts none either (the host's is newer and wins)."""
    out, plugin = output
    index = next(i for i, spec in enumerate(KNOB_SPECS) if spec.name == "velocity_scale")
    out.poll()
    counted = int(plugin.engine_changes[index])
    out.registry.set("velocity_scale", 1.3, origin="osc")
    out.poll()
    assert plugin.engine_changes[index] == counted + 1 and plugin.engine_values[index] == pytest.approx(1.3)
    out.poll()
    assert plugin.engine_changes[index] == counted + 1, "a value shown once is not counted again"
    plugin.host_values[index], plugin.host_changes[index] = 0.6, plugin.host_changes[index] + 1
    out.poll()
    assert out.registry.get("velocity_scale") == pytest.approx(0.6) == plugin.engine_values[index]
    assert plugin.engine_changes[index] == counted + 1, "the host's own change is not shown back as the engine's"
    plugin.host_values[index], plugin.host_changes[index] = 0.9, plugin.host_changes[index] + 1
    out.registry.set("velocity_scale", 1.5, origin="panel")  # before a round takes the host's 0.9 in
    out._show_engine_values()
    assert plugin.engine_changes[index] == counted + 1, "the host's change on its way in wins over the engine's"
    out.poll()
    assert out.registry.get("velocity_scale") == pytest.approx(0.9) and plugin.engine_changes[index] == counted + 1


def test_a_host_change_is_timed_from_the_plugins_block_to_the_engine_taking_it_in(output):
    """The plugin stamps the block that carries a host change (CLOCK_MONOTONIC, as perf_counter); the engine takes
    it in with that time as the change's sending time and writes the lag for the host's benches."""
    out, plugin = output
    index = next(i for i, spec in enumerate(KNOB_SPECS) if spec.name == "velocity_scale")
    taken = int(plugin.counters[ENGINE_HOST_CHANGES_TAKEN])
    block_ns = time.monotonic_ns() - 5_000_000  # a block that began 5 ms ago
    plugin.counters[HOST_CHANGES_NS] = block_ns
    plugin.host_values[index], plugin.host_changes[index] = 1.2, plugin.host_changes[index] + 1
    out.poll()
    assert plugin.counters[ENGINE_HOST_CHANGES_TAKEN] == taken + 1
    assert 5.0 <= plugin.reals[ENGINE_HOST_LAG_MS] < 1000.0
    change = next(c for c in out.registry.changes_since(0) if c.name == "velocity_scale")
    assert change.sent_at == pytest.approx(block_ns / 1e9) and change.received_at - change.sent_at >= 0.005
    out.poll()
    assert plugin.counters[ENGINE_HOST_CHANGES_TAKEN] == taken + 1, "no host change, no lag counted"


class Encoding:
    """The prompts an engine plays: a prompt given arrives only when `encoded()` says so (the runner encodes it on a
    thread of its own and applies it at a tick)."""

    def __init__(self):
        self.playing = {"a": "ambient pads", "b": "ambient pads", "negative": ""}
        self.on_the_way: dict[str, str] = {}

    def give(self, slot: str, text: str) -> None:
        self.on_the_way[slot] = text

    def encoded(self) -> None:
        self.playing.update(self.on_the_way)
        self.on_the_way.clear()


def push_host_prompts(control, prompts: dict[str, str]) -> int:
    """What the plugin does when a DAW project opens: its prompts into the host area, sequence-locked."""
    seq = int(control.counters[HOST_PROMPTS_SEQ])
    control.counters[HOST_PROMPTS_SEQ] = seq + 1
    for index, slot in enumerate(PROMPTS):
        encoded = prompts[slot].encode()[: PROMPT_BYTES - 1]
        row = control._prompts["host"][index]
        row[: len(encoded)] = list(encoded)
        row[len(encoded)] = 0
    control.counters[HOST_PROMPTS_SEQ] = seq + 2
    return seq + 2


def test_the_engines_prompts_answer_a_projects_only_once_they_play():
    """The plugin keeps the prompts it pushed until the engine's prompt area says it took them in (the project saves
    the engine's prompts): a new session's own prompts, written while the project's were on their way, saved the
    session's prompt into a project that had opened with another (seen in CI)."""
    buffer = LoopBuffer(48_000, 2, 48_000)
    engine = Encoding()
    out = PluginOutput(buffer, KnobRegistry(), f"answer-{os.getpid()}", engine.give, lambda: dict(engine.playing))
    control = out.control
    try:
        out.poll()
        assert control.engine_prompts()["a"] == "ambient pads" and control.counters[ENGINE_PROMPTS_TAKEN] == 0
        project = {"a": "lofi hip hop", "b": "solo piano", "negative": ""}
        pushed = push_host_prompts(control, project)
        for _ in range(3):  # encoding: the engine still plays its own prompts
            out.poll()
            assert control.counters[ENGINE_PROMPTS_TAKEN] < pushed, "an answer before the project's prompts play"
        assert engine.on_the_way == {"a": "lofi hip hop", "b": "solo piano"}
        engine.encoded()
        written = int(control.counters[ENGINE_PROMPTS_SEQ])
        out.poll()
        assert control.counters[ENGINE_PROMPTS_SEQ] > written
        assert control.counters[ENGINE_PROMPTS_TAKEN] == pushed
        assert control.engine_prompts() == project
    finally:
        out.control.unlink()
        out.control.close()
        buffer.unlink()
        buffer.close()


def panel_post(out: PluginOutput, route: str, body: dict) -> int:
    request = urllib.request.Request(
        out.panel.url + route, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return answer.status


def test_what_the_host_changed_before_a_panel_change_is_taken_in_before_it():
    """A DAW project's knobs and prompts, given by the plugin within a block of attaching, and a change in the panel a
    moment later: the panel's is the one that holds, though the round that reads the control block comes after it (a
    host rendering offline posts within milliseconds; the project's volume came in after the panel's 0, seen in CI)."""
    buffer = LoopBuffer(48_000, 2, 48_000)
    engine = Encoding()
    out = PluginOutput(
        buffer, KnobRegistry(), f"order-{os.getpid()}", engine.give, lambda: dict(engine.playing), panel_port=0
    )
    out.panel.start()
    control = out.control
    volume = next(i for i, spec in enumerate(KNOB_SPECS) if spec.name == "volume")
    try:
        control.host_values[volume], control.host_changes[volume] = 0.5, control.host_changes[volume] + 1
        push_host_prompts(control, {"a": "lofi hip hop", "b": "", "negative": ""})
        assert panel_post(out, "knob", {"name": "volume", "value": 0.0}) == 200
        assert panel_post(out, "prompt", {"slot": "a", "text": "solo cello"}) == 200
        out.poll()
        engine.encoded()
        out.poll()
        assert out.registry.get("volume") == 0.0, "the project's volume, given before, came in after the panel's"
        assert engine.playing["a"] == "solo cello", "the project's prompt, given before, came in after the panel's"
        assert engine.playing["b"] == "lofi hip hop", "the project's prompts were taken in"
    finally:
        out.panel.stop()
        out.control.unlink()
        out.control.close()
        buffer.unlink()
        buffer.close()

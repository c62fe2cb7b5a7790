"""The engine's side of the plugin (live/plugin_output.py) through the shared memory a plugin attaches to: a
knob the host moved reaches the registry at the next read, and the control block is read once per host block."""

import os

import pytest
from flowjam.engine.params import KNOB_SPECS
from flowjam.live.knobs import KnobRegistry
from flowjam.live.loop_buffer import LoopBuffer
from flowjam.live.plugin_link import HOST_BLOCK_FRAMES, HOST_SAMPLE_RATE
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

"""The plugin's parameters and header slots are generated from the registry: the committed header must be what
`python -m flowjam.live.plugin_header` writes now, so a knob added to KNOB_SPECS without the plugin fails here."""

from dataclasses import replace

from flowjam.engine import params
from flowjam.engine.params import KNOB_SPECS, KnobKind, KnobSpec
from flowjam.live import plugin_link
from flowjam.live.plugin_header import _CONTROL_COUNTERS, _CONTROL_REALS, HEADER_PATH, header_text


def test_committed_plugin_header_matches_the_knob_registry_and_buffer_layout():
    assert HEADER_PATH.read_text() == header_text(), (
        "plugin/src/flowjam_generated.h differs from the registry: run `python -m flowjam.live.plugin_header`"
    )


def test_every_knob_is_a_plugin_parameter_with_its_range_and_default():
    text = header_text()
    assert f"KNOB_COUNT = {len(KNOB_SPECS)};" in text
    for spec in KNOB_SPECS:
        assert f'{{"{spec.name}", "{spec.unit}", ' in text and f"{spec.minimum!r}, {spec.maximum!r}, " in text


def test_a_knob_added_to_the_registry_changes_the_header(monkeypatch):
    added = (*KNOB_SPECS, KnobSpec("brightness", 0.0, 1.0, 0.5, KnobKind.SHARED))
    monkeypatch.setattr("flowjam.live.plugin_header.KNOB_SPECS", added)
    assert '{"brightness", ' in header_text() and header_text() != HEADER_PATH.read_text()
    moved = tuple(replace(spec, default=spec.maximum) if spec.name == "volume" else spec for spec in params.KNOB_SPECS)
    monkeypatch.setattr("flowjam.live.plugin_header.KNOB_SPECS", moved)
    assert header_text() != HEADER_PATH.read_text()


def test_control_block_slots_are_distinct_and_the_panel_and_bounce_ones_are_counter_15_and_reals_8_to_11():
    counters = {name: getattr(plugin_link, name) for name in _CONTROL_COUNTERS}
    reals = {name: getattr(plugin_link, name) for name in _CONTROL_REALS}
    for slots, size in ((counters, plugin_link.COUNTERS), (reals, plugin_link.REALS)):
        assert len(set(slots.values())) == len(slots) and max(slots.values()) < size, slots
    assert counters["HOST_PANEL_REQUESTS"] == 15
    bounce = ("ENGINE_LOOP_WRITTEN", "HOST_OFFLINE", "HOST_WAITS", "HOST_WAITED_S")
    assert [reals[name] for name in bounce] == [8, 9, 10, 11]
    assert "constexpr int HOST_PANEL_REQUESTS = 15;" in header_text()

"""The plugin's parameters and header slots are generated from the registry: the committed header must be what
`python -m flowjam.live.plugin_header` writes now, so a knob added to KNOB_SPECS without the plugin fails here."""

from dataclasses import replace

from flowjam.engine import params
from flowjam.engine.params import KNOB_SPECS, KnobKind, KnobSpec
from flowjam.live.plugin_header import HEADER_PATH, header_text


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

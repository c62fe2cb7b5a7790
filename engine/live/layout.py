"""Controller layouts generated from the knob registry, so they always name real knobs and real ranges."""

from __future__ import annotations

import json
from pathlib import Path

from .knobs import DEFAULT_KNOBS, KnobKind, KnobSpec

LAYOUT_DIR = Path(__file__).parent / "layouts"
OPEN_STAGE_CONTROL_FILE = LAYOUT_DIR / "flowjam-open-stage-control.json"
COLUMN_WIDTH, ROW_HEIGHT = 110, 300
TAB_LABELS = {KnobKind.SHARED: "next tick", KnobKind.REQUEST: "next generation", KnobKind.GLOBAL: "engine"}


def _fader(spec: KnobSpec, session: str, column: int, row: int) -> dict:
    return {
        "type": "fader",
        "id": spec.name,
        "label": spec.name.replace("_", " "),
        "left": column * COLUMN_WIDTH,
        "top": row * ROW_HEIGHT,
        "width": COLUMN_WIDTH - 10,
        "height": ROW_HEIGHT - 20,
        "range": {"min": spec.minimum, "max": spec.maximum},
        "value": spec.default,
        "default": spec.default,
        "step": 1 if spec.integer else "",
        "decimals": 0 if spec.integer else 2,
        "unit": spec.unit,
        "address": f"/flowjam/{session}/knob/{spec.name}",
        "preArgs": [],
        "typeTags": "i" if spec.integer else "f",
        "target": [],
    }


def open_stage_control_session(session: str = "default", knobs: tuple[KnobSpec, ...] = DEFAULT_KNOBS) -> dict:
    """An Open Stage Control session: one row of faders per knob kind, plus a prompt field and a status button.

    Run Open Stage Control with `--send 127.0.0.1:9000` (flowjam's OSC port) and `--port 9111`, and start flowjam
    with `--osc-feedback 127.0.0.1:9111` so the faders follow values set from anywhere else."""
    widgets = []
    for row, kind in enumerate(KnobKind):
        for column, spec in enumerate(s for s in knobs if s.kind is kind):
            widgets.append(_fader(spec, session, column, row))
    widgets.append({
        "type": "input", "id": "prompt", "label": "prompt A", "left": 0, "top": len(KnobKind) * ROW_HEIGHT,
        "width": 6 * COLUMN_WIDTH, "height": 60, "address": f"/flowjam/{session}/prompt", "preArgs": [], "target": [],
    })
    widgets.append({
        "type": "input", "id": "prompt_b", "label": "prompt B", "left": 0, "top": len(KnobKind) * ROW_HEIGHT + 70,
        "width": 6 * COLUMN_WIDTH, "height": 60, "address": f"/flowjam/{session}/prompt/b", "preArgs": [], "target": [],
    })
    return {
        "createdWith": "Open Stage Control",
        "version": "1.26.0",
        "type": "session",
        "content": {"type": "root", "id": "root", "label": f"flowjam {session}", "widgets": widgets, "tabs": []},
    }


def write_open_stage_control(path: Path = OPEN_STAGE_CONTROL_FILE, session: str = "default") -> Path:
    path.write_text(json.dumps(open_stage_control_session(session), indent=2) + "\n", encoding="utf-8")
    return path

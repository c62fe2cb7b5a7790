"""Controller layouts and the README's knob table, generated from the knob registry, so they always name real knobs and
real ranges."""

from __future__ import annotations

import json
from pathlib import Path

from ..engine.params import KNOB_SPECS, KnobKind, KnobSpec

LAYOUT_DIR = Path(__file__).parent / "layouts"
OPEN_STAGE_CONTROL_FILE = LAYOUT_DIR / "flowjam-open-stage-control.json"
COLUMN_WIDTH, ROW_HEIGHT = 110, 300
TAB_LABELS = {KnobKind.SHARED: "next tick", KnobKind.REQUEST: "next generation", KnobKind.GLOBAL: "engine"}


def _knob_widget(spec: KnobSpec, session: str, column: int, row: int) -> dict:
    """A fader for a knob, or a column of buttons (each sending its index) for a choice knob."""
    widget = {
        "type": "switch" if spec.choices else "fader",
        "id": spec.name,
        "label": spec.name.replace("_", " "),
        "left": column * COLUMN_WIDTH,
        "top": row * ROW_HEIGHT,
        "width": COLUMN_WIDTH - 10,
        "height": ROW_HEIGHT - 20,
    }
    if spec.choices:
        widget.update(
            values={choice: index for index, choice in enumerate(spec.choices)},
            value=int(spec.default),
            default=int(spec.default),
        )
    else:
        widget.update(
            range={"min": spec.minimum, "max": spec.maximum},
            value=spec.default,
            default=spec.default,
            step=1 if spec.integer else "",
            decimals=0 if spec.integer else 2,
            unit=spec.unit,
        )
    widget.update(
        address=f"/flowjam/{session}/knob/{spec.name}", preArgs=[], typeTags="i" if spec.integer else "f", target=[]
    )
    return widget


def open_stage_control_session(session: str = "default", knobs: tuple[KnobSpec, ...] = KNOB_SPECS) -> dict:
    """An Open Stage Control session: one row of faders per knob kind (buttons for a choice knob), the prompt fields,
    and transport and target-capture buttons.

    Run Open Stage Control with `--send 127.0.0.1:9000` (flowjam's OSC port) and `--port 9111`, and start flowjam
    with `--osc-feedback 127.0.0.1:9111` so the faders follow values set from anywhere else."""
    widgets = []
    for row, kind in enumerate(KnobKind):
        for column, spec in enumerate(s for s in knobs if s.kind is kind):
            widgets.append(_knob_widget(spec, session, column, row))
    widgets.append(
        {
            "type": "input",
            "id": "prompt",
            "label": "prompt A",
            "left": 0,
            "top": len(KnobKind) * ROW_HEIGHT,
            "width": 6 * COLUMN_WIDTH,
            "height": 60,
            "address": f"/flowjam/{session}/prompt",
            "preArgs": [],
            "target": [],
        }
    )
    widgets.append(
        {
            "type": "input",
            "id": "prompt_b",
            "label": "prompt B",
            "left": 0,
            "top": len(KnobKind) * ROW_HEIGHT + 70,
            "width": 6 * COLUMN_WIDTH,
            "height": 60,
            "address": f"/flowjam/{session}/prompt/b",
            "preArgs": [],
            "target": [],
        }
    )
    widgets.append(
        {
            "type": "input",
            "id": "prompt_negative",
            "label": "negative prompt",
            "left": 0,
            "top": len(KnobKind) * ROW_HEIGHT + 140,
            "width": 6 * COLUMN_WIDTH,
            "height": 60,
            "address": f"/flowjam/{session}/prompt/negative",
            "preArgs": [],
            "target": [],
        }
    )
    for column, (label, address, argument) in enumerate(
        (
            ("stop", "transport", "stop"),
            ("play", "transport", "play"),
            ("capture target", "target/capture", 1),
        )
    ):
        widgets.append(
            {
                "type": "button",
                "id": f"button_{column}",
                "label": label,
                "mode": "tap",
                "left": 6 * COLUMN_WIDTH + 10,
                "top": len(KnobKind) * ROW_HEIGHT + 70 * column,
                "width": COLUMN_WIDTH,
                "height": 60,
                "on": argument,
                "off": argument,
                "address": f"/flowjam/{session}/{address}",
                "preArgs": [],
                "target": [],
            }
        )
    return {
        "createdWith": "Open Stage Control",
        "version": "1.26.0",
        "type": "session",
        "content": {"type": "root", "id": "root", "label": f"flowjam {session}", "widgets": widgets, "tabs": []},
    }


def write_open_stage_control(path: Path = OPEN_STAGE_CONTROL_FILE, session: str = "default") -> Path:
    path.write_text(json.dumps(open_stage_control_session(session), indent=2) + "\n", encoding="utf-8")
    return path


KNOB_FELT = {
    KnobKind.SHARED: "next tick, by every generation in flight",
    KnobKind.REQUEST: "next generation",
    KnobKind.GLOBAL: "at once",
}


def _number(value: float, integer: bool) -> str:
    return str(int(value)) if integer else f"{value:g}"


def knob_table_markdown(knobs: tuple[KnobSpec, ...] = KNOB_SPECS) -> str:
    """The README's knob table (Markdown), one row per knob of the registry, in the registry's order."""
    rows = ["| knob | range | default | felt | what it does |", "|---|---|---|---|---|"]
    for knob in knobs:
        if knob.choices:
            value_range, default = ", ".join(knob.choices), knob.choice(knob.default)
        else:
            value_range = f"{_number(knob.minimum, knob.integer)} to {_number(knob.maximum, knob.integer)}"
            value_range += f" {knob.unit}" if knob.unit else ""
            default = _number(knob.default, knob.integer)
        description = knob.description.replace("|", "\\|")
        rows.append(f"| `{knob.name}` | {value_range} | {default} | {KNOB_FELT[knob.kind]} | {description} |")
    return "\n".join(rows) + "\n"

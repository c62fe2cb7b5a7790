"""The live panel's server side without ComfyUI (and without aiohttp): `status_for` and `set_knob`, the functions
that GET /flowjam/session/{name} and POST /flowjam/session/{name}/knob wrap, and the publisher that pushes the
`flowjam.status` event, against a real tiny-preset stream started through the nodes (audio_device "none": a silent
real-time clock); the V1 path's registration inside a stand-in ComfyUI server; and web/panel_rows.js under node."""

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from flowjam.engine.params import CFG_MODES, KNOB_SPECS, KNOBS_BY_NAME, lora_knob
from flowjam.live import performances
from flowjam.nodes.web_routes import SPECS_JSON, STATUS_EVENT, StatusPublisher, set_knob, spec_json, status_for
from helpers import STREAM_DEFAULTS, free_udp_port, node, stream, text, wait_for, wait_ticks
from pythonosc.udp_client import SimpleUDPClient


@pytest.fixture
def panel_stream(model):
    """A running stream "panel", played for a few ticks; stopped after the test."""
    stream(model, text(model, "warm analog pads"), "panel")
    app = performances.get("panel")
    wait_ticks(app, 3)
    yield app
    performances.stop_all()


def ok_status(name: str) -> dict:
    status, body = status_for(name)
    assert status == 200, body
    assert json.loads(json.dumps(body)) == body, "the status must be plain JSON"
    return body


def test_status_of_an_absent_stream_is_running_false_with_the_specs_not_a_404():
    body = ok_status("no_such_stream")
    assert body["running"] is False and body["name"] == "no_such_stream"
    assert set(body["specs"]) == {spec.name for spec in KNOB_SPECS}, "the panel ranges its sliders before a stream"


def test_status_of_a_running_stream_carries_specs_with_defaults_and_choices(panel_stream):
    body = ok_status("panel")
    assert body["running"] is True and body["ticks"] >= 3 and body["curves"] == []
    assert body["specs"]["cfg_mode"] == {
        "min": 0.0,
        "max": 3.0,
        "default": 0.0,
        "kind": "request",
        "integer": True,
        "unit": "",
        "choices": list(CFG_MODES),
        "description": KNOBS_BY_NAME["cfg_mode"].description,
    }
    assert body["specs"]["velocity_scale"]["default"] == 1.0 and body["specs"]["velocity_scale"]["choices"] == []
    assert body["specs"]["x0_target_strength"]["kind"] == "shared"
    assert body["loop_s"] == pytest.approx(2.0) and body["knobs"]["denoise"] == pytest.approx(0.7)


def test_a_curve_driven_shared_knob_is_listed_in_curves_and_a_constant_one_is_not(panel_stream):
    (ramp,) = node("FlowjamCurveRamp").run(start=0.5, end=1.5, seconds=2.0)
    node("FlowjamSharedCurve").run(stream="panel", knob="velocity_scale", value=1.0, curve=ramp)
    node("FlowjamSharedCurve").run(stream="panel", knob="ode_noise", value=0.3)
    wait_for(lambda: ok_status("panel")["curves"] == ["velocity_scale"], 10, "velocity_scale to be curve-driven")
    assert ok_status("panel")["knobs"]["ode_noise"] == pytest.approx(0.3), "a constant shows its number"

    node("FlowjamSharedCurve").run(stream="panel", knob="velocity_scale", value=1.2)  # the curve disconnected
    wait_for(lambda: ok_status("panel")["curves"] == [], 10, "velocity_scale to follow its value again")


def test_cfg_mode_takes_a_choice_name_or_its_index(panel_stream):
    assert set_knob("panel", {"name": "cfg_mode", "value": "full"}) == (
        200,
        {"name": "cfg_mode", "value": 1.0, "clamped": False},
    )
    assert ok_status("panel")["cfg_mode"] == "full"
    assert set_knob("panel", {"name": "cfg_mode", "value": 2})[0] == 200
    assert ok_status("panel")["cfg_mode"] == "initialize"


@pytest.mark.parametrize(
    "body, fix",
    [
        (None, '{"name": <knob>, "value": <number'),  # not JSON at all
        ([1, 2], "send a JSON object"),
        ({"value": 1.0}, "lacks 'name'"),
        ({"name": "volume"}, "lacks 'value'"),
        ({"name": "velocity_scal", "value": 1.0}, "did you mean 'velocity_scale'"),
        ({"name": "volume", "value": "loud"}, "send a float or an int"),
        ({"name": "volume", "value": True}, "send a float or an int"),
        ({"name": "cfg_mode", "value": "fulll"}, "takes one of off, full, initialize, self"),
    ],
    ids=["not_json", "a_list", "no_name", "no_value", "misspelt_knob", "text_value", "bool_value", "bad_choice"],
)
def test_a_bad_body_is_a_400_that_names_the_fix_and_changes_nothing(panel_stream, body, fix):
    before = panel_stream.registry.values()
    status, reply = set_knob("panel", body)
    assert status == 400 and fix in reply["error"], reply
    assert panel_stream.registry.values() == before


def test_a_knob_for_an_absent_or_stopped_stream_is_a_404_naming_the_node_to_queue(panel_stream):
    status, reply = set_knob("elsewhere", {"name": "volume", "value": 0.5})
    assert status == 404 and "Stream node" in reply["error"] and "session_id is 'elsewhere'" in reply["error"], reply

    assert set_knob("panel", {"name": "volume", "value": 0.5})[0] == 200
    node("FlowjamStreamStop").run(stream="panel")
    assert ok_status("panel")["running"] is False, "a stopped stream reads as not running, still a 200"
    assert set_knob("panel", {"name": "volume", "value": 0.6})[0] == 404


# ---- every registry knob reaches the panel --------------------------------------------------------------------------


def assert_registry_specs(specs: dict) -> None:
    for spec in KNOB_SPECS:
        sent = specs.get(spec.name)
        assert sent is not None, f"the registry knob {spec.name!r} is missing from the specs the panel gets"
        expected = (spec.minimum, spec.maximum, spec.default, spec.kind.value, spec.integer, spec.unit)
        assert (sent["min"], sent["max"], sent["default"], sent["kind"], sent["integer"], sent["unit"]) == expected
        assert sent["choices"] == list(spec.choices), f"{spec.name}: the panel's select needs the choices"


def test_every_registry_knob_reaches_the_panel_with_its_range_unit_and_choices(panel_stream):
    assert_registry_specs(ok_status("no_such_stream")["specs"])
    running = ok_status("panel")["specs"]
    assert_registry_specs(running)
    assert list(running) == [spec.name for spec in KNOB_SPECS], "rows follow the registry's order"


def test_a_stream_with_a_lora_sends_its_strength_knob_with_the_specs_and_values(model, glow_lora_file):
    (with_glow,) = node("FlowjamLora").run(model=model, lora=str(glow_lora_file), strength=0.6, mode="live")
    try:
        stream(with_glow, text(model, "warm analog pads"), "panel_lora")
        body = ok_status("panel_lora")
        assert body["specs"]["lora/glow"] == spec_json(lora_knob("glow"))
        assert body["specs"]["lora/glow"]["max"] == 2.0 and body["knobs"]["lora/glow"] == pytest.approx(0.6)
        assert set(body["specs"]) == {*SPECS_JSON, "lora/glow"}
        pushed = StatusPublisher(lambda event, payload: None).publish_once()
        assert "lora/glow" in pushed["sessions"]["panel_lora"]["knobs"], "the panel learns of the new knob"
    finally:
        performances.stop_all()
        for name in list(model.loras):
            model.unload_lora(name)


# ---- the status pushed as a ComfyUI event ---------------------------------------------------------------------------


def test_the_publisher_pushes_the_streams_values_while_it_runs_and_once_when_it_stops(panel_stream):
    assert set_knob("panel", {"name": "volume", "value": 0.55})[0] == 200
    events = []
    publisher = StatusPublisher(lambda event, payload: events.append((event, payload)), interval_s=0.02).start()
    try:
        wait_for(lambda: len(events) >= 3, 10, "three flowjam.status events")
        event, payload = events[-1]
        assert event == STATUS_EVENT == "flowjam.status"
        assert json.loads(json.dumps(payload)) == payload, "the event must be plain JSON"
        status = payload["sessions"]["panel"]
        assert status["running"] is True and status["ticks"] >= 3 and status["curves"] == []
        assert status["knobs"]["volume"] == pytest.approx(0.55) and status["cfg_mode"] == "off"
        assert "specs" not in status, "the specs come with GET, not four times a second"

        performances.stop("panel")
        wait_for(lambda: events[-1][1] == {"sessions": {}}, 10, "the event that says no stream runs")
        sent = len(events)
        time.sleep(0.2)
        assert len(events) == sent, "with no stream the publisher must stay silent"
    finally:
        publisher.stop()


# ---- knobs moved away from the graph: pushed to the browsers, kept across a restart -------------------------------


def test_an_osc_move_and_a_panel_move_reach_the_browsers_in_the_pushed_status(panel_stream):
    """web/flowjam.js writes the knob values it is pushed into the graph's widgets: an OSC move must be among them."""
    port = free_udp_port()
    node("FlowjamOscBridge").run(stream="panel", port=port, feedback="", host="127.0.0.1")
    SimpleUDPClient("127.0.0.1", port).send_message("/flowjam/panel/knob/denoise", 0.35)
    wait_for(lambda: panel_stream.registry.get("denoise") == pytest.approx(0.35), 5, "the OSC move to apply")
    assert set_knob("panel", {"name": "volume", "value": 0.45})[0] == 200
    pushed = StatusPublisher(lambda event, payload: None).publish_once()["sessions"]["panel"]["knobs"]
    assert pushed["denoise"] == pytest.approx(0.35) and pushed["volume"] == pytest.approx(0.45)


def test_a_knob_moved_by_hand_keeps_its_value_across_a_stop_and_a_restart(model):
    """volume has no widget, so nothing in the graph remembers the panel's 0.4; steps has one, and the Stream node's
    value wins on the restart (the panel wrote its move into that widget, web/widget_sync.js)."""
    conditioning = text(model, "warm analog pads")
    try:
        stream(model, conditioning, "kept")
        assert set_knob("kept", {"name": "volume", "value": 0.4})[0] == 200
        assert set_knob("kept", {"name": "steps", "value": 6})[0] == 200
        node("FlowjamStreamStop").run(stream="kept")
        stream(model, conditioning, "kept")
        registry = performances.get("kept").registry
        assert registry.get("volume") == pytest.approx(0.4), "the panel's volume was lost when the stream restarted"
        assert registry.get("steps") == STREAM_DEFAULTS["steps"], "the Stream node's widget must win on a restart"
    finally:
        performances.stop_all()


# ---- registration on ComfyUI's server through the V1 classes -------------------------------------------------------

V1_SERVER = r"""
import asyncio, importlib.abc, json, sys, threading, types

class NoV3(importlib.abc.MetaPathFinder):  # a ComfyUI without the V3 schema API: flowjam takes the V1 path
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "comfy_api":
            raise ImportError(f"{name} blocked: no V3 schema API")
sys.meta_path.insert(0, NoV3())

class Routes(list):  # aiohttp's RouteTableDef, as far as the routes use it
    def get(self, path):
        return self.route("GET", path)
    def post(self, path):
        return self.route("POST", path)
    def route(self, method, path):
        def add(handler):
            self.append(types.SimpleNamespace(method=method, path=path, handler=handler))
            return handler
        return add

server = types.ModuleType("server")
server.PromptServer = type("PromptServer", (), {})
on_prompt = []  # ComfyUI's on_prompt handlers, run on every /prompt body before its validation
server.PromptServer.instance = types.SimpleNamespace(
    routes=Routes(), send_sync=lambda event, data, sid=None: None, add_on_prompt_handler=on_prompt.append
)
web = types.ModuleType("aiohttp.web")
web.json_response = lambda body, status=200: (status, body)
aiohttp = types.ModuleType("aiohttp")
aiohttp.web = web
sys.modules.update({"server": server, "aiohttp": aiohttp, "aiohttp.web": web})

import flowjam
from flowjam.nodes import comfy_v1, web_routes

routes = server.PromptServer.instance.routes
status = next(r.handler for r in routes if r.path == "/flowjam/session/{name}")
answer = asyncio.run(status(types.SimpleNamespace(match_info={"name": "nothing"})))
print(json.dumps({
    "v1_path": hasattr(flowjam, "NODE_CLASS_MAPPINGS"),
    "again": [comfy_v1.register_web_routes(), web_routes.register()],
    "routes": [[r.method, r.path] for r in routes],
    "publishers": sum(t.name == "flowjam-status-publisher" for t in threading.enumerate()),
    "status": [answer[0], answer[1]["running"]],
    "on_prompt": [handler.__name__ for handler in on_prompt],
}))
"""


def test_the_v1_path_registers_the_routes_and_the_publisher_once_inside_comfyui():
    """Older ComfyUI (no comfy_api.latest) loads the V1 classes: importing them adds the routes, and a second ask
    (the V3 entry point's, or another import) adds nothing."""
    result = subprocess.run([sys.executable, "-c", V1_SERVER], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["v1_path"], "the package did not take the V1 path"
    assert found["routes"] == [
        ["GET", "/flowjam/sessions"],
        ["GET", "/flowjam/session/{name}"],
        ["POST", "/flowjam/session/{name}/knob"],
    ], found["routes"]
    assert found["again"] == [False, False] and found["publishers"] == 1, found
    assert found["status"] == [200, False], "the registered route answers like status_for"
    assert found["on_prompt"] == ["refuse_text_booleans"], "the posted-values check is registered once"


# ---- the panel's rows, built in JavaScript from the specs -----------------------------------------------------------

PANEL_ROWS_JS = Path(__file__).resolve().parent.parent / "web" / "panel_rows.js"
ROWS_SCRIPT = """
import { readFileSync } from "node:fs";
import * as rows from "./panel_rows.mjs";
const { specs, calls } = JSON.parse(readFileSync(0, "utf8"));
const built = rows.panelRows(specs);
const byName = Object.fromEntries(built.map((row) => [row.name, row]));
console.log(JSON.stringify({ rows: built, results: calls.map(([fn, knob, value]) => rows[fn](byName[knob], value)) }));
"""


def test_panel_rows_js_builds_a_select_integer_steps_units_and_lora_rows_from_the_specs(tmp_path):
    if shutil.which("node") is None:
        print("\nSKIPPED panel_rows.js test: node is not installed", file=sys.stderr)
        pytest.skip("node is not installed")
    shutil.copyfile(PANEL_ROWS_JS, tmp_path / "panel_rows.mjs")  # an ES module to node whatever package.json says
    (tmp_path / "rows.mjs").write_text(ROWS_SCRIPT)
    specs = {**SPECS_JSON, "lora/glow": spec_json(lora_knob("glow"))}
    calls = [
        ["shownValue", "steps", 7.6],
        ["movedValue", "steps", 99],
        ["shownValue", "velocity_scale", 1],
        ["movedValue", "lora/glow", 3.5],
        ["shownValue", "lora/glow", 0.6],
        ["movedValue", "cfg_mode", 1],
        ["movedValue", "cfg_mode", "self"],
        ["choiceName", "cfg_mode", 2.0],
        ["shownValue", "cfg_mode", 1],
        ["shownValue", "seed", 42],
    ]
    stdin = json.dumps({"specs": specs, "calls": calls})
    result = subprocess.run(["node", "rows.mjs"], cwd=tmp_path, input=stdin, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout)
    rows = {row["name"]: row for row in found["rows"]}
    assert [row["name"] for row in found["rows"]] == list(specs), "one row per spec, in the registry's order"
    for spec in KNOB_SPECS:
        row = rows[spec.name]
        assert (row["min"], row["max"], row["start"], row["unit"]) == (
            spec.minimum,
            spec.maximum,
            spec.default,
            spec.unit,
        )
        assert row["step"] == ("1" if spec.integer else "any"), f"{spec.name}: integer knobs step by 1"
        assert (row["control"] == "select") == bool(spec.choices) and row["choices"] == list(spec.choices)
    assert rows["steps"]["control"] == "range" and rows["seed"]["control"] == "number", "a seed is typed, not slid"
    assert rows["lora/glow"] | {"title": ""} == {
        "name": "lora/glow",
        "control": "range",
        "min": 0.0,
        "max": 2.0,
        "step": "any",
        "integer": False,
        "choices": [],
        "unit": "",
        "start": 1.0,
        "title": "",
    }
    assert found["results"] == ["8 steps", 50, "1.00", 2.0, "0.60", "full", "self", "initialize", "", ""]


# ---- knob values written back into the graph's widgets (web/widget_sync.js under node) -----------------------------

WEB = Path(__file__).resolve().parent.parent / "web"
SYNC_SCRIPT = r"""
import { readFileSync } from "node:fs";
import { panelRows } from "./panel_rows.js";
import { followStream, loraKnob } from "./widget_sync.js";

const { specs, loras, heard, moved, typed } = JSON.parse(readFileSync(0, "utf8"));
const rows = Object.fromEntries(panelRows(specs).map((row) => [row.name, row]));
const graph = {
  nodes: [],
  dirty: 0,
  findNodesByType(type) { return this.nodes.filter((n) => n.type === type); },
  setDirtyCanvas() { this.dirty += 1; },
};
// A LiteGraph node as ComfyUI's frontend makes one: widgets, inputs (a widget turned into an input carries
// `widget`), links to the nodes feeding them.
function node(type, widgets = {}, inputs = {}, linkedWidgets = []) {
  const sources = [...Object.values(inputs), ...linkedWidgets.map(() => graph.nodes[0])];
  const made = {
    type,
    graph,
    widgets: Object.entries(widgets).map(([name, value]) => ({ name, value, callback() {} })),
    inputs: [
      ...Object.entries(inputs).map(([name, source]) => ({ name, link: source ? 1 : null })),
      ...linkedWidgets.map((name) => ({ name, widget: { name }, link: 2 })),
    ],
    findInputSlot(name) { return this.inputs.findIndex((input) => input.name === name); },
    getInputNode(slot) { return sources[slot] ?? null; },
  };
  graph.nodes.push(made);
  return made;
}
const model = node("FlowjamLoadModel");
const glow = node("FlowjamLora", { lora: loras[0], strength: 1.0, mode: "live" }, { model });
const dust = node("FlowjamLora", { lora: loras[1], strength: 0.5, mode: "live" }, { model: glow });
const reroute = node("Reroute", {}, { "": dust });
const widgets = { session_id: "jam", steps: 8, denoise: 0.7, seed: 42, shift: 3.0, cfg_mode: "off" };
const stream = node("FlowjamStream", widgets, { model: reroute }, ["shift"]);
const other = node("FlowjamStream", { session_id: "other" });
const shared = node("FlowjamSharedCurve", { knob: "velocity_scale", value: 1.0 }, { stream, curve: null });
const curved = node("FlowjamSharedCurve", { knob: "ode_noise", value: 0.1 }, { stream, curve: model });
const elsewhere = node("FlowjamSharedCurve", { knob: "velocity_scale", value: 1.0 }, { stream: other, curve: null });

const heardNow = {};
const first = followStream(stream, rows, heardNow, heard);
stream.widgets.find((w) => w.name === "steps").value = typed; // typed into the widget, not queued yet
const written = followStream(stream, rows, heardNow, moved, new Set(["denoise"]));
const values = (n) => Object.fromEntries(n.widgets.map((w) => [w.name, w.value]));
console.log(JSON.stringify({
  first, written, dirty: graph.dirty,
  stream: values(stream), glow: values(glow).strength, dust: values(dust).strength,
  shared: values(shared).value, curved: values(curved).value, elsewhere: values(elsewhere).value,
  knobs: [...loras, "peft_x\\adapter_model.safetensors", "styles/glow.v2.safetensors"].map(loraKnob),
}));
"""


def test_knob_moves_made_away_from_the_graph_are_written_into_its_widgets(model, tmp_path):
    """What web/flowjam.js does with each pushed status, on plain objects shaped like the frontend's LiteGraph nodes:
    a knob the stream changed (OSC, MIDI) lands in the widget a re-queue sends (the Stream node's own, a wired Shared
    curve's value, the strength of the LoRA node whose file names the knob); a widget fed by a link, a curve-driven
    Shared curve, a knob in the hand and a value typed but not queued are left alone."""
    if shutil.which("node") is None:
        print("\nSKIPPED widget_sync.js test: node is not installed", file=sys.stderr)
        pytest.skip("node is not installed")
    for name in ("panel_rows.js", "widget_sync.js"):
        shutil.copyfile(WEB / name, tmp_path / name)
    (tmp_path / "package.json").write_text('{"type": "module"}')  # the files are ES modules, as the browser has them
    (tmp_path / "sync.js").write_text(SYNC_SCRIPT)
    lora_files = [tmp_path / "styles" / "glow.safetensors", tmp_path / "dust" / "adapter_model.safetensors"]
    chained = model
    for path in lora_files:
        path.parent.mkdir()
        path.write_bytes(b"")  # the LoRA node checks that the file is there; loading it comes later
        (chained,) = node("FlowjamLora").run(model=chained, lora=str(path), strength=1.0, mode="live")
    specs = {**SPECS_JSON, **{f"lora/{c.name}": spec_json(lora_knob(c.name)) for c in chained.chain}}
    heard = {name: spec["default"] for name, spec in specs.items()} | {"steps": 8, "seed": 42}
    moves = {"velocity_scale": 1.4, "cfg_mode": 1.0, "seed": 7, "denoise": 0.5, "shift": 5.0, "ode_noise": 0.5}
    moves |= {"lora/glow": 0.3, "lora/dust": 1.5, "volume": 0.3}
    stdin = json.dumps(
        {"specs": specs, "loras": [str(p) for p in lora_files], "heard": heard, "moved": heard | moves, "typed": 12}
    )
    result = subprocess.run(["node", "sync.js"], cwd=tmp_path, input=stdin, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout)
    assert found["knobs"][:2] == [f"lora/{c.name}" for c in chained.chain] == ["lora/glow", "lora/dust"], (
        "web/widget_sync.js and nodes/lora_nodes.py must name a LoRA's knob alike"
    )
    assert found["knobs"][2:] == ["lora/peft_x", "lora/glow.v2"]
    assert found["first"] == [], "the first values heard must leave a loaded graph's widgets alone"
    assert sorted(found["written"]) == ["cfg_mode", "lora/dust", "lora/glow", "seed", "velocity_scale"]
    assert found["stream"] == {
        "session_id": "jam",
        "steps": 12,
        "denoise": 0.7,
        "seed": 7,
        "shift": 3.0,
        "cfg_mode": "full",
    }
    assert (found["glow"], found["dust"], found["shared"]) == (0.3, 1.5, 1.4)
    assert (found["curved"], found["elsewhere"]) == (0.1, 1.0), "a curve-driven or another stream's Shared curve moved"
    assert found["dirty"] >= 1, "the canvas must redraw the written widgets"


# ---- what the panel shows of a status, and how (web/panel_status.js under node) -------------------------------------

STATUS_SCRIPT = """
import { readFileSync } from "node:fs";
import { CSS, statusView } from "./panel_status.js";
const statuses = JSON.parse(readFileSync(0, "utf8"));
console.log(JSON.stringify({ css: CSS, views: statuses.map(statusView) }));
"""


def panel_status_js(tmp_path, statuses: list[dict]) -> dict:
    """web/panel_status.js's CSS and its view of each status, run under node."""
    if shutil.which("node") is None:
        print("\nSKIPPED panel_status.js test: node is not installed", file=sys.stderr)
        pytest.skip("node is not installed")
    shutil.copyfile(WEB / "panel_status.js", tmp_path / "panel_status.js")
    (tmp_path / "package.json").write_text('{"type": "module"}')
    (tmp_path / "status.js").write_text(STATUS_SCRIPT)
    stdin = json.dumps(statuses)
    result = subprocess.run(
        ["node", "status.js"], cwd=tmp_path, input=stdin, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def declarations(css: str) -> dict[str, str]:
    return {k.strip(): v.strip() for k, _, v in (d.partition(":") for d in css.split(";") if d.strip())}


def test_a_long_status_text_cannot_widen_the_panel_and_the_silent_notice_wraps(panel_stream, tmp_path):
    """A headless box's "no audio" line (white-space: nowrap) set the panel's one grid column to its own ~800 px
    width in a 320 px node: every knob row widened with it, values hidden, sliders clipped. The column is now the
    node's width (minmax(0, 1fr), min-width 0 down the tree) and the notice wraps inside it."""
    status = ok_status("panel") | {"output_warning": "no audio: the PortAudio library is not installed; " * 8}
    found = panel_status_js(tmp_path, [status])
    css = {name: declarations(text) for name, text in found["css"].items()}
    assert css["panel"]["grid-template-columns"] == "minmax(0, 1fr)", "the column must not grow with its content"
    for part in ("panel", "meters", "line", "notice", "rows", "row"):
        assert css[part].get("min-width") == "0", f"{part}: a grid/flex item's least width is its content's"
    assert css["line"]["white-space"] == "nowrap" and css["line"]["overflow"] == "hidden"
    assert css["notice"]["white-space"] == "normal" and css["notice"]["overflow-wrap"] == "anywhere"
    view = found["views"][0]
    assert view["notice"] == status["output_warning"] and status["output_warning"] not in view["lines"]


# The frontends' dark and light palettes (comfy_base: the CSS variables; litegraph_base: NODE_DEFAULT_BGCOLOR, the node
# body the panel sits on). The notice brings its own background, so a node body of another shade changes nothing.
PALETTES = {
    "dark": {"node": "#353535", "--input-text": "#dddddd", "--comfy-input-bg": "#222222", "--error-text": "#ff4444"},
    "light": {"node": "#ffffff", "--input-text": "#222222", "--comfy-input-bg": "#c9c9c9", "--error-text": "#f44336"},
}


def resolve(value: str, palette: dict[str, str]) -> str:
    """A CSS colour: var(--name, fallback) read from the palette (the fallback where the palette lacks it)."""
    found = re.fullmatch(r"var\((--[\w-]+),\s*(#[0-9a-fA-F]+)\)", value)
    return palette.get(found.group(1), found.group(2)) if found else value


def luminance(colour: str) -> float:
    digits = colour.lstrip("#")
    digits = "".join(c * 2 for c in digits) if len(digits) == 3 else digits
    channels = [int(digits[i : i + 2], 16) / 255 for i in (0, 2, 4)]
    linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def contrast(a: str, b: str) -> float:
    high, low = sorted((luminance(a), luminance(b)), reverse=True)
    return (high + 0.05) / (low + 0.05)


@pytest.mark.parametrize("theme", sorted(PALETTES))
def test_the_warning_texts_are_readable_at_4_5_to_1_in_dark_and_light_themes(panel_stream, tmp_path, theme):
    """The warning was red text on the node: 2.1:1 (dark, 1.58) and 3:1 (light). WCAG asks 4.5:1 for text."""
    palette = PALETTES[theme]
    css = {name: declarations(text) for name, text in panel_status_js(tmp_path, [])["css"].items()}
    for part in ("notice", "error"):
        text = resolve(css[part]["color"], palette)
        background = resolve(css[part].get("background", palette["node"]), palette)
        ratio = contrast(text, background)
        assert ratio >= 4.5, f"{theme}: the {part} text {text} on {background} has {ratio:.1f}:1"


def test_the_panel_shows_the_loop_its_bars_and_the_window_it_really_generates(model, tmp_path):
    """bpm 100 made a 5 s loop 4.8 s (two bars) without a word, a window longer than the loop silently meant the
    whole loop, and in endless play the playhead bar cycled the 30 s ring as if it were a loop."""
    stream(model, text(model, "warm analog pads"), "looped", song_seconds=5.0, bpm=100.0, window_seconds=30.0)
    stream(model, text(model, "warm analog pads"), "walking", song_seconds=6.0, window_seconds=4.0)
    stream(model, text(model, "warm analog pads"), "endless", endless=True, window_seconds=4.0)
    try:
        statuses = [ok_status(name) for name in ("looped", "walking", "endless")]
        assert [s["loop"] for s in statuses] == [
            "loop 4.8 s · 2 bars @ 100 · window = whole loop (30 s asked)",
            "loop 6.0 s · window 4 s",
            "endless · window 4 s",
        ]
        views = panel_status_js(tmp_path, statuses)["views"]
        assert [view["lines"][2] for view in views] == [s["loop"] for s in statuses], "the panel shows the field"
        assert views[2]["progress"] is None, "endless play has no loop for the playhead bar to cycle"
        assert 0 <= views[0]["progress"] <= 1
    finally:
        performances.stop_all()


# ---- the status event is listened for before the frontend's websocket delivers it (web/flowjam.js under node) ------

EXTENSION_SCRIPT = """
globalThis.listened = [];
globalThis.extensions = [];
const { api } = await import("./scripts/api.js");
await import("./extensions/flowjam/flowjam.js");
const beforeSetup = [...listened];
for (const extension of extensions) await extension.setup?.();
console.log(JSON.stringify({ beforeSetup, afterSetup: listened }));
"""
STUB_API = "export const api = { addEventListener(type) { globalThis.listened.push(type); }, fetchApi() {} };\n"
STUB_APP = "export const app = { registerExtension(extension) { globalThis.extensions.push(extension); } };\n"


def test_the_status_event_has_a_listener_as_soon_as_the_panel_module_loads(tmp_path):
    """The frontend opens its websocket before the extensions' setup(): a stream already running when the page loads
    sent flowjam.status to no listener, and the console said "Unknown message type flowjam.status"."""
    if shutil.which("node") is None:
        print("\nSKIPPED flowjam.js test: node is not installed", file=sys.stderr)
        pytest.skip("node is not installed")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "api.js").write_text(STUB_API)
    (tmp_path / "scripts" / "app.js").write_text(STUB_APP)
    shutil.copytree(WEB, tmp_path / "extensions" / "flowjam", ignore=shutil.ignore_patterns("*.png"))
    (tmp_path / "package.json").write_text('{"type": "module"}')
    (tmp_path / "run.js").write_text(EXTENSION_SCRIPT)
    result = subprocess.run(["node", "run.js"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout)
    assert STATUS_EVENT in found["beforeSetup"], f"listened before setup(): {found['beforeSetup']}"
    assert found["afterSetup"].count(STATUS_EVENT) == 1, "one listener, not two"

"""The live panel's routes without ComfyUI (and without aiohttp): `status_for` and `set_knob`, the functions that
GET /flowjam/session/{name} and POST /flowjam/session/{name}/knob wrap, against a real tiny-preset stream started
through the nodes (audio_device "none": a silent real-time clock)."""

import json

import pytest
from flowjam.engine.params import CFG_MODES, KNOB_SPECS, KNOBS_BY_NAME
from flowjam.live import performances
from flowjam.nodes.web_routes import set_knob, status_for
from test_nodes import node, stream, text, wait_for, wait_ticks


@pytest.fixture(scope="module")
def model():
    (session,) = node("FlowjamLoadModel").run(
        preset="tiny", checkpoint="none", device="cpu", dtype="float32", backend="eager"
    )
    return session


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

"""What the server refuses and how it says so, over a real uvicorn and RingHost (tiny preset, CPU): no answer names
another player's session, admission goes by the ring's measured latents one create at a time, JSON nested past the
limit is a clear 400 (the stream goes on), a depth change answers what the ring applied, a loop's bar limit in bars."""

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
from flowjam.engine.stream import RealtimeNeed
from flowjam.engine.stream.lanes import AdmissionRefused, Lane, check_admission, deepened
from flowjam.serve import admission as admission_module
from flowjam.serve import host as host_module
from flowjam.serve import refusals
from flowjam.serve.client import Client
from flowjam.serve.errors import SessionRefused
from flowjam.serve.guard import MAX_JSON_DEPTH
from flowjam.serve.host import RingHost, SessionSpec
from flowjam.serve.protocol import AudioChunk
from helpers import ADMIT_ANY_SPEED_MS, served, wait_for

SECRET = "alice-secret-jam"  # another player's session: no answer to anyone else may hold this name
TIGHT_MS = 0.01  # a realtime need no ring keeps


def http(method: str, url: str, body: object = None, token: str | None = None) -> tuple[int, dict]:
    data = body.encode() if isinstance(body, str) else None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_no_refusal_names_another_players_session(session, monkeypatch):
    """Every refusal a stranger can draw while SECRET plays: a taken name, admission's prediction, a ring measured
    behind, a full host, a bad knob, bad JSON; and the owner's own depth refused with the ring's numbers."""
    monkeypatch.setattr(admission_module, "SETTLE_S", 0.2)  # a tiny ring settles at once: judge it without waiting
    host = RingHost(session, latent_interval_ms=TIGHT_MS)  # every lane needs what no tick gives
    host.admission.target_ms = (
        ADMIT_ANY_SPEED_MS  # so a create passes the measured check and meets the ring's prediction
    )
    with served(host) as url:
        owner = Client(url, timeout_s=30.0)
        owner.create("lofi piano", name=SECRET, seconds=2.0, knobs={"depth": 1})  # nothing measured yet: let in
        wait_for(lambda: len(host.runner(SECRET).stats.latent_times) >= 3, 60.0, "the owner's ring measured")
        stranger = {"prompt": "jazz trio", "seconds": 2.0, "knobs": {"depth": 1}}
        answers = {
            "taken name": http("POST", f"{url}/sessions", {**stranger, "name": SECRET}),
            "predicted": http("POST", f"{url}/sessions", stranger),
            "bad knob": http("POST", f"{url}/sessions", {**stranger, "knobs": {"depht": 2}}),
            "bad json": http("POST", f"{url}/sessions", "[" * 100),
            "unknown": http("GET", f"{url}/sessions/{SECRET}x", token=owner.tokens[SECRET]),
        }
        host.admission.target_ms = TIGHT_MS
        answers["behind"] = http("POST", f"{url}/sessions", stranger)
        monkeypatch.setattr(host_module, "MAX_LANES", 1)
        answers["full"] = http("POST", f"{url}/sessions", stranger)
        own_depth = http("POST", f"{url}/sessions/{SECRET}/knobs", {"depth": 4}, owner.tokens[SECRET])
    expected = {"taken name": 400, "predicted": 503, "bad knob": 400, "bad json": 400, "unknown": 403}
    assert {what: status for what, (status, _) in answers.items()} == {**expected, "behind": 503, "full": 503}
    for what, (_, body) in answers.items():
        assert SECRET not in json.dumps(body), f"the {what} refusal names another player's session: {body}"
    assert "playing already" in answers["taken name"][1]["error"]
    assert "rows a tick" in answers["predicted"][1]["error"] and "another session" in answers["predicted"][1]["error"]
    assert "behind" in answers["behind"][1]["error"] and "another replica" in answers["behind"][1]["error"]
    assert own_depth[0] == 400 and "depth 4 refused" in own_depth[1]["error"] and "rows" in own_depth[1]["error"]


def test_admissions_refusal_of_a_deeper_depth_names_only_the_callers_session():
    """A depth that would make another session miss its need is refused with the ring's numbers, not its name."""
    need = RealtimeNeed(steps=8, rows_per_slot=1, latent_interval_ms=250.0)
    tight, raising = Lane(SECRET, 0, 1, True, need), Lane("bob", 8, 1, True, need)
    with pytest.raises(AdmissionRefused) as refused:
        check_admission(deepened([tight, raising], raising, 8), [(2, 20.0)], "depth 8 refused")
    assert SECRET in str(refused.value), "the engine's own message (for a local ring) names the lane"
    answer = refusals.admission(refused.value, "bob", 8)
    assert SECRET not in answer, answer
    assert answer.startswith(
        "depth 8 refused: at depth 8 this host's ring would run 9 rows a tick, measured to take ~90"
    )
    assert "another session playing here would no longer get a latent every 250 ms" in answer


def test_creates_take_turns_so_two_are_never_let_in_on_one_measurement(session, monkeypatch):
    """With a session measured over the target playing, creates at once are each measured again, one at a time,
    and refused: none is let in on the measurement another create saw."""
    monkeypatch.setattr(admission_module, "SETTLE_S", 0.2)
    host = RingHost(session, latent_interval_ms=ADMIT_ANY_SPEED_MS)
    outcomes: list[str] = []

    def create(name: str) -> None:
        try:
            host.create(name, SessionSpec("lofi", seconds=2.0, knobs={"depth": 1}))
            outcomes.append("in")
        except SessionRefused as error:
            outcomes.append(str(error))

    try:
        create("first")
        wait_for(lambda: len(host.runner("first").stats.latent_times) >= 3, 60.0, "the first session measured")
        host.admission.target_ms = TIGHT_MS  # a need no ring keeps: the measured session is over it
        threads = [threading.Thread(target=create, args=(f"s{i}",)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60.0)
        assert outcomes[0] == "in" and outcomes.count("in") == 1, outcomes
        assert all("behind" in outcome for outcome in outcomes[1:]), outcomes
    finally:
        host.close()


def test_a_depth_change_answers_what_the_ring_applied(session):
    host = RingHost(session, latent_interval_ms=ADMIT_ANY_SPEED_MS)
    try:
        host.create("jam", SessionSpec("lofi", seconds=2.0, knobs={"depth": 2}))
        assert host.set_knobs("jam", {"depth": 3}) == {"depth": 3}
        assert host.runner("jam").stream.depth == 3, "the answer said depth 3 before the ring played it"
        wait_for(lambda: host.status("jam")["ticks"] >= 5, 30.0, "five ticks at the new depth")
        status = host.status("jam")
        assert (status["depth"], status["knobs"]["depth"], status["errors"]) == (3, 3, 0), status
    finally:
        host.close()


def test_json_nested_past_the_limit_is_a_400_and_the_stream_goes_on(session):
    deep = "[" * 8000 + "]" * 8000
    with served(RingHost(session, latent_interval_ms=ADMIT_ANY_SPEED_MS)) as url:
        status, answer = http("POST", f"{url}/sessions", deep)  # no credentials needed to reach the parser
        assert status == 400 and f"at most {MAX_JSON_DEPTH}" in answer["error"], (status, answer)
        client = Client(url, timeout_s=30.0)
        name = client.create("lofi", seconds=2.0, knobs={"depth": 1})["session"]
        status, answer = http("POST", f"{url}/sessions/{name}/knobs", deep, client.tokens[name])
        assert status == 400 and "nested 8000 deep" in answer["error"], (status, answer)
        with client.stream(name) as stream:
            for message in (deep, '{"ack": ' + deep + "}"):
                stream.connection.send(message)
                while not isinstance(event := stream.receive(10.0), dict):
                    assert event is not None, "the stream closed on a deeply nested control message"
                assert event["event"] == "error" and f"deep; at most {MAX_JSON_DEPTH}" in event["error"], event
            assert all(isinstance(stream.receive(10.0), AudioChunk) for _ in range(5)), "the audio stopped"


def test_a_loop_of_too_many_bars_is_refused_in_bars_with_the_real_limit(session):
    host = RingHost(session, latent_interval_ms=ADMIT_ANY_SPEED_MS)
    try:
        with pytest.raises(ValueError, match=r"bars 600 at 123 BPM.* loop of 1170\.73 s.* use bars 307 or less"):
            host.create("long", SessionSpec("lofi", bpm=123, bars=600))
    finally:
        host.close()


def test_a_create_is_not_refused_for_want_of_a_measurement_while_a_session_makes_its_first_latents():
    """A host's first session compiles before its first latent (seconds on a GPU): a create meanwhile is not refused
    as behind for want of a measurement, nor kept waiting: the prediction judges it."""
    from flowjam.serve.admission import Admission

    admission = Admission(50.0)
    admission.changed()
    started = time.perf_counter()
    admission.check(lambda: [[]])  # a session with no latent yet: let in at once
    assert time.perf_counter() - started < 0.05


def test_a_ring_over_its_target_while_a_new_session_settles_is_judged_once_it_has_settled(monkeypatch):
    """A session just let in brings tick plans the ring runs plain and captures first: its first latents come
    slowly. A create then waits for the ring to settle and is let in once the intervals are back within target; a
    ring still over target when the wait ends is refused as behind."""
    from flowjam.serve.admission import Admission

    monkeypatch.setattr(admission_module, "SETTLE_S", 1.0)
    target_ms = 50.0
    admission = Admission(target_ms)
    admission.changed()
    start = time.perf_counter()
    times = [start + 0.3 * k for k in range(3)]  # 300 ms apart: over target while the new plans are captured

    def settles() -> None:
        time.sleep(0.8)
        for _ in range(4):
            times.append(time.perf_counter())
            time.sleep(target_ms / 4000.0)

    threading.Thread(target=settles, daemon=True).start()
    admission.check(lambda: [times])
    assert time.perf_counter() - start >= 0.8, "let in on the slow intervals, before the ring settled"

    admission.changed()
    slow = [time.perf_counter() + 0.3 * k for k in range(3)]
    with pytest.raises(SessionRefused, match="behind"):
        admission.check(lambda: [slow])


def test_a_ring_well_within_its_target_lets_a_create_in_at_once():
    """Sessions whose latest latents came at a small share of the target (a CPU host's loose target, a GPU ring far
    from full) are not waited on for a fresh measurement: the create is let in at once."""
    from flowjam.serve.admission import HEADROOM, Admission

    admission = Admission(1000.0)
    now = time.perf_counter()
    well_within = [now - 0.3, now - 0.2, now - 0.1]  # 100 ms apart against a 1,000 ms target
    admission.changed()  # nothing since the change: a fresh measurement would take seconds
    started = time.perf_counter()
    admission.check(lambda: [well_within])
    assert time.perf_counter() - started < 0.05, "waited for a fresh measurement of a ring well within its target"
    assert 100.0 <= HEADROOM * admission.target_ms

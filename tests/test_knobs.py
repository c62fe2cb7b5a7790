"""Knob registry: validation with clear errors, clamping, 0..1 mapping, latest-wins under threads, subscribers."""

import logging
import math
import sys
import threading

import pytest
from flowjam.engine.params import KNOB_SPECS, SHARED_FIELDS, KnobKind, KnobSpec
from flowjam.engine.stream import SlotRequest
from flowjam.live.knobs import KnobError, KnobRegistry


def test_default_knobs_name_engine_fields():
    kinds = {spec.name: spec.kind for spec in KNOB_SPECS}
    shared = {name for name, kind in kinds.items() if kind is KnobKind.SHARED}
    assert shared == set(SHARED_FIELDS), f"shared knobs {shared} differ from the stream's {SHARED_FIELDS}"
    request_fields = set(SlotRequest.__dataclass_fields__)
    for name in ("denoise", "seed", "steps", "shift", "cfg_mode"):
        assert kinds[name] is KnobKind.REQUEST and name in request_fields, name
    assert {name for name, kind in kinds.items() if kind is KnobKind.GLOBAL} == {"depth", "volume"}
    assert KnobRegistry().values() == {spec.name: spec.default for spec in KNOB_SPECS}


def test_parameter_registry_is_torch_free_and_names_what_the_engine_has():
    import subprocess

    code = "import sys, flowjam.engine.params, flowjam.live.knobs; print('torch' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )
    from flowjam.engine import params
    from flowjam.engine.models.lm import LM_PRESETS
    from flowjam.engine.models.presets import PRESETS
    from flowjam.engine.sampling import curves

    assert tuple(PRESETS) == params.PRESET_NAMES and tuple(LM_PRESETS) == params.LM_PRESET_NAMES
    assert tuple(curves.COMBINE_OPS) == params.CURVE_OPS


def test_choice_knob_takes_a_choice_name_or_its_index():
    knobs = KnobRegistry()
    spec = knobs.specs["cfg_mode"]
    assert spec.choice(knobs.get("cfg_mode")) == "off"
    assert knobs.set("cfg_mode", "full").value == 1.0 and spec.choice(knobs.get("cfg_mode")) == "full"
    assert knobs.set("cfg_mode", 3).value == 3.0 and spec.choice(3.0) == "self"
    with pytest.raises(KnobError) as raised:
        knobs.set("cfg_mode", "loud")
    assert raised.value.reason == "unknown_choice" and "off, full, initialize, self" in str(raised.value)
    with pytest.raises(KnobError):
        knobs.set("guidance", "full")  # only a choice knob takes text
    assert spec.choice(knobs.get("cfg_mode")) == "self"


def test_set_clamps_to_range_and_reports_it():
    knobs = KnobRegistry()
    change = knobs.set("velocity_scale", 3.5)
    assert (change.value, change.requested, change.clamped) == (2.0, 3.5, True)
    assert knobs.get("velocity_scale") == 2.0
    assert knobs.set("apg_momentum", -4).value == -1.0
    inside = knobs.set("velocity_scale", 1.25)
    assert (inside.value, inside.clamped) == (1.25, False)


def test_integer_knobs_round_half_up_without_counting_as_clamped():
    knobs = KnobRegistry()
    change = knobs.set("steps", 6.5)
    assert (change.value, change.clamped) == (7.0, False), "integer knobs round half up, not to even"
    assert knobs.set("steps", 7.49).value == 7.0
    assert knobs.set("seed", 2**40).value == 2**31 - 1
    assert knobs.set("depth", 0).value == 1.0


def test_normalized_mapping_both_ways():
    spec = KnobSpec("guidance", 1.0, 10.0, 1.0, KnobKind.SHARED)
    assert spec.clamp(spec.unclamped(0.0)) == 1.0 and spec.clamp(spec.unclamped(1.0)) == 10.0
    assert spec.clamp(spec.unclamped(0.5)) == pytest.approx(5.5)
    assert spec.to_normalized(5.5) == pytest.approx(0.5)
    assert spec.clamp(spec.unclamped(1.7)) == 10.0 and spec.clamp(spec.unclamped(-1)) == 1.0
    knobs = KnobRegistry()
    change = knobs.set_normalized("apg_momentum", 0.25)
    assert change.value == pytest.approx(-0.75) and knobs.normalized("apg_momentum") == pytest.approx(0.25)
    over = knobs.set_normalized("volume", 1.5)
    assert (over.value, over.requested, over.clamped) == (1.0, 1.5, True)
    assert knobs.set_normalized("steps", 0.5).value == 26.0  # 1 + 0.5 * 49 = 25.5, rounded half up


@pytest.mark.parametrize(
    "value, reason, words",
    [
        (math.nan, "not_finite", "finite"),
        (math.inf, "not_finite", "finite"),
        (-math.inf, "not_finite", "finite"),
        (10**400, "not_finite", "finite"),
        ("1.5", "not_a_number", "float"),
        (None, "not_a_number", "number"),
        (True, "not_a_number", "number"),
    ],
)
def test_bad_values_are_rejected_with_the_knob_named(value, reason, words):
    knobs = KnobRegistry()
    with pytest.raises(KnobError) as raised:
        knobs.set("ode_noise", value)
    assert raised.value.reason == reason and raised.value.knob == "ode_noise"
    assert "'ode_noise'" in str(raised.value) and words in str(raised.value), str(raised.value)
    with pytest.raises(KnobError):
        knobs.set_normalized("ode_noise", value)
    assert knobs.get("ode_noise") == 0.0 and knobs.seq == 0, "a rejected write must change nothing"


def test_unknown_name_lists_the_valid_names():
    knobs = KnobRegistry()
    with pytest.raises(KnobError) as raised:
        knobs.set("velocity", 1.0)
    message = str(raised.value)
    assert raised.value.reason == "unknown_knob"
    assert "'velocity'" in message and "did you mean 'velocity_scale'" in message, message
    assert all(spec.name in message for spec in KNOB_SPECS), message
    for call in (knobs.get, knobs.normalized, knobs.reset):
        with pytest.raises(KnobError, match="valid knobs"):
            call("velocity")


def test_latest_wins_and_changes_since_gives_each_knobs_latest_in_seq_order():
    knobs = KnobRegistry()
    assert knobs.seq == 0 and knobs.changes_since(0) == []
    knobs.set("volume", 0.1)
    knobs.set("guidance", 2.0)
    mark = knobs.seq
    knobs.set("volume", 0.2)
    knobs.set("shift", 4.0, origin="midi", sent_at=12.5)
    knobs.set("volume", 0.3)
    assert knobs.seq == 5 and knobs.get("volume") == 0.3
    assert [(c.name, c.value, c.seq) for c in knobs.changes_since(mark)] == [("shift", 4.0, 4), ("volume", 0.3, 5)]
    assert [c.name for c in knobs.changes_since(0)] == ["guidance", "shift", "volume"]
    shift = knobs.changes_since(mark)[0]
    assert (shift.origin, shift.sent_at) == ("midi", 12.5) and shift.received_at > 0


def test_reset_restores_defaults():
    knobs = KnobRegistry()
    knobs.set("volume", 0.1)
    knobs.set("steps", 20)
    knobs.reset("volume")
    assert knobs.get("volume") == 0.8 and knobs.get("steps") == 20
    knobs.reset()
    assert knobs.values() == {spec.name: spec.default for spec in KNOB_SPECS}
    assert knobs.changes_since(0)[-1].origin == "reset"


def test_concurrent_setters_never_expose_a_half_done_set():
    knobs = KnobRegistry()
    seen, went_back = [], []
    knobs.subscribe(seen.append)
    threads_n, per_thread = 8, 3000
    writing = threading.Event()
    start_line = threading.Barrier(threads_n)

    def play(thread_index):
        start_line.wait()
        for i in range(per_thread):
            knobs.set("velocity_scale", (thread_index * per_thread + i) / (threads_n * per_thread))

    def watch():  # a seq is issued and its change stored at once, or a reader sees a half-done set()
        while writing.is_set():
            issued = knobs.seq
            stored = knobs.changes_since(0)
            if stored and stored[-1].seq < issued:
                went_back.append((issued, stored[-1].seq))

    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so a missing lock shows
    writing.set()
    watcher = threading.Thread(target=watch)
    threads = [threading.Thread(target=play, args=(t,)) for t in range(threads_n)]
    try:
        watcher.start()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        writing.clear()
        watcher.join()
        sys.setswitchinterval(switch_interval)
    total = threads_n * per_thread
    assert knobs.seq == total and sorted(c.seq for c in seen) == list(range(1, total + 1)), "seq must be unique"
    assert not went_back, f"{len(went_back)} reads saw a seq issued before its change was stored: {went_back[0]}"
    last = max(seen, key=lambda c: c.seq)
    assert knobs.get("velocity_scale") == last.value and knobs.changes_since(0) == [last]


def test_a_failing_subscriber_is_logged_once_and_never_breaks_set(caplog):
    knobs = KnobRegistry()
    received = []

    def broken(change):
        raise RuntimeError("controller unplugged")

    knobs.subscribe(broken)
    unsubscribe = knobs.subscribe(received.append)
    with caplog.at_level(logging.ERROR, logger="flowjam.knobs"):
        for value in (0.1, 0.2, 0.3):
            assert knobs.set("volume", value).value == value
    assert [c.value for c in received] == [0.1, 0.2, 0.3], "later subscribers must still be called"
    failures = [r for r in caplog.records if "controller unplugged" in (r.exc_text or "")]
    assert len(failures) == 1, f"expected one log of the failing subscriber, got {len(caplog.records)} records"
    unsubscribe()
    unsubscribe()
    knobs.set("volume", 0.4)
    assert len(received) == 3, "an unsubscribed callback must not be called"


def test_spec_rejects_a_default_outside_its_range():
    with pytest.raises(ValueError, match="outside"):
        KnobSpec("x", 0.0, 1.0, 2.0, KnobKind.GLOBAL)

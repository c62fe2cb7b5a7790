"""`flowjam bench served` against a real server: the gateway over one RingHost (tiny preset, CPU) on a loopback port
with a server key, measured by the command in its own process as a user runs it; its statistics on worked numbers;
and its refusals, each one line naming the fix."""

import json
import math
import os
import subprocess
import sys

import pytest
from flowjam.__main__ import main
from flowjam.serve.access import KEY_ENV, AccessPolicy
from flowjam.serve.client import Client
from flowjam.serve.host import HostOptions
from flowjam.serve.load import LoadOptions, heard_record, latent_interval_ms, longest_gap_ms, measure_load
from helpers import ADMIT_ANY_SPEED_MS, free_tcp_port, served

KEY = "load-test-server-key-0123456789"  # with a key the server lists its sessions: that every one ended shows
SESSIONS, ROUNDS = 2, 2
SHORT = ("--song-seconds", "4", "--window-seconds", "4", "--depth", "1")  # the tiny preset ticks these fast


@pytest.fixture(scope="module")
def server():
    # admission that never refuses for speed: the 2-core CI machine runs the suite beside the ring
    host = HostOptions(preset="tiny", latent_interval_ms=ADMIT_ANY_SPEED_MS).build()
    with served(host, AccessPolicy.for_server("127.0.0.1", KEY)) as url:
        yield url


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_bench_served_creates_plays_hears_every_change_and_ends_every_session(server, tmp_path):
    out = tmp_path / "served.json"
    command = ["bench", "served", "--server", server, "--sessions", str(SESSIONS), "--rounds", str(ROUNDS)]
    result = subprocess.run(
        [sys.executable, "-m", "flowjam", *command, "--interval-s", "1", *SHORT, "--json", str(out)],
        env={**os.environ, KEY_ENV: KEY},
        capture_output=True,
        text=True,
        timeout=120,
    )
    print(result.stdout)  # the report, in the test's log
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads(out.read_text())
    creates = figures["creates"]
    assert [created["replica"] for created in creates] == ["local"] * SESSIONS, f"a create was refused: {creates}"
    assert sum(figures["placement"].values()) == SESSIONS, figures["placement"]
    assert all(created["sounded_s"] is not None for created in creates), f"a session never sounded: {creates}"
    assert figures["heard"] == SESSIONS * ROUNDS == len(figures["turns"]), figures["turns"]
    for turn in figures["turns"]:
        assert all(positive(turn[key]) for key in ("call_ms", "to_tick_ms", "to_ear_ms")), turn
        assert turn["to_tick_ms"] <= turn["to_ear_ms"], f"heard before its first tick: {turn}"
    for played in figures["played"]:
        assert positive(played["latent_interval_ms"]) and played["chunks"] > 0, played
    assert figures["ended"] == SESSIONS and figures["ok"] and not figures["errors"], figures
    tick, ear, call = figures["to_tick_ms"], figures["to_ear_ms"], figures["call_ms"]
    for line in (
        f"placement: local {SESSIONS}",
        f"{SESSIONS * ROUNDS} of {SESSIONS * ROUNDS} changes heard",
        f"knob -> first tick {tick['median']:.1f} / {tick['p95']:.1f} ms, -> ear {ear['median']:.1f} / {ear['p95']:.1f}",
        f"the HTTP call {call['median']:.1f} / {call['p95']:.1f} ms",
        f"ended {SESSIONS} sessions",
    ):
        assert line in result.stdout, f"the printed report and the JSON differ: {line!r} not in\n{result.stdout}"
    assert Client(server, key=KEY).sessions() == [], "a session of the load was left playing on the server"


def test_killing_a_replica_of_a_local_server_is_refused_and_its_session_ended(server):
    client = Client(server, timeout_s=20.0, key=KEY)
    options = LoadOptions(1, song_seconds=4.0, window_seconds=4.0, depth=1, rounds=1)
    with pytest.raises(ValueError, match=r"serve --local.*flowjam serve --replicas N"):
        measure_load(client, options, kill=lambda replica: pytest.fail(f"killed {replica}"), say=lambda line: None)
    assert client.sessions() == [], "the session created before the refusal was left playing"


def test_an_unreachable_server_or_a_missing_key_is_one_line_naming_the_fix(server, capsys, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    nobody = f"http://127.0.0.1:{free_tcp_port()}"
    assert main(["bench", "served", "--server", nobody, "--sessions", "1"]) == 2
    said = capsys.readouterr().err.strip()
    assert said.count("\n") == 0 and nobody in said and "is `flowjam serve` running there?" in said, said
    assert main(["bench", "served", "--server", server, "--sessions", "1", *SHORT]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert "--key-file FILE or FLOWJAM_SERVE_KEY" in said[-1], said
    assert main(["bench", "served", "--server", server, "--sessions", "0"]) == 2
    assert "--sessions 0 must be 1 or more" in capsys.readouterr().err


def test_the_longest_gap_counts_the_silence_at_either_edge():
    arrivals = [1.00, 1.05, 1.10, 1.30, 1.35]
    assert longest_gap_ms(arrivals, 1.0, 1.4) == pytest.approx(200.0)
    assert longest_gap_ms(arrivals, 0.5, 1.4) == pytest.approx(500.0), "from the start to the first chunk"
    assert longest_gap_ms(arrivals, 1.0, 2.0) == pytest.approx(650.0), "from the last chunk to the end"
    assert longest_gap_ms([], 1.0, 2.0) == pytest.approx(1000.0), "no chunk at all"


def test_a_change_is_matched_by_knob_value_and_a_newer_sequence_number():
    heard = [
        {"knob": "velocity_scale", "value": 1.3, "seq": 4, "to_tick_ms": 20.0, "to_ear_ms": 80.0},
        {"knob": "denoise", "value": 0.7, "seq": 5, "to_tick_ms": 30.0, "to_ear_ms": 90.0},
        {"knob": "velocity_scale", "value": 0.7, "seq": 6, "to_tick_ms": 25.0, "to_ear_ms": 70.0},
    ]
    assert heard_record(heard, "velocity_scale", 0.7, after_seq=4)["seq"] == 6
    assert heard_record(heard, "velocity_scale", 1.3, after_seq=4) is None, "an older change of the same value"
    assert heard_record(heard, "velocity_scale", 1.3, after_seq=3)["seq"] == 4


def test_the_latent_interval_is_the_time_over_the_latents_counted():
    assert latent_interval_ms((10.0, 100), (13.0, 124)) == pytest.approx(125.0)
    assert latent_interval_ms((10.0, 100), (13.0, 100)) is None, "no latent came"

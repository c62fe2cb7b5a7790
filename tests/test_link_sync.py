"""Following Ableton Link with a real peer (a second aalink session playing the DAW). Link finds peers by multicast,
so both run in a network namespace of their own with only the loopback interface, multicast routed on it: no packet
leaves the machine. Where the namespace cannot be made, the test skips and says why."""

import json
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("aalink", reason="aalink is not installed (pip install aalink)")

PEERS = r"""
import asyncio, json, threading, time
from aalink import Link
from flowjam.live.sync.link import LinkFollower

def phase_gap(beats, other, quantum=4.0):  # peers agree on the phase within a bar, not on the beat count
    gap = (beats - other) % quantum
    return min(gap, quantum - gap)

loop = asyncio.new_event_loop()
threading.Thread(target=loop.run_forever, daemon=True).start()

async def join():
    daw = Link(128.0)
    daw.quantum = 4
    daw.enabled = True
    return daw

daw = asyncio.run_coroutine_threadsafe(join(), loop).result()
time.sleep(1.0)  # the DAW's session is older: when sessions meet, Link keeps the older one's timeline and tempo
follower = LinkFollower(quantum=4, bpm=100.0)
deadline = time.monotonic() + 10
while follower.peers == 0 and time.monotonic() < deadline:
    time.sleep(0.02)
time.sleep(0.3)
first, daw_beat = follower.state(), daw.beat
daw.tempo = 93.0
time.sleep(0.5)
second, daw_beat_2 = follower.state(), daw.beat
print(json.dumps({
    "peers": follower.peers,
    "tempo": first.bpm, "phase_gap": phase_gap(first.beats, daw_beat),
    "tempo_after_change": second.bpm, "phase_gap_after": phase_gap(second.beats, daw_beat_2),
    "playing": second.playing,
}))
follower.close()
"""


def run_in_a_private_network(script: str) -> dict:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("unshare or ip (util-linux, iproute2) is missing: no private network namespace for Link")
    setup = "ip link set lo up && ip link set lo multicast on && ip route add 224.0.0.0/4 dev lo"
    probe = subprocess.run(["unshare", "-n", "sh", "-c", setup], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a private network namespace for Link here: {probe.stderr.strip()}")
    done = subprocess.run(
        ["unshare", "-n", "sh", "-c", f'{setup} && exec "$0" -c "$1"', sys.executable, script],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_follower_joins_a_link_session_takes_its_tempo_and_phase_and_hears_a_tempo_change():
    seen = run_in_a_private_network(PEERS)
    assert seen["peers"] == 1, seen
    assert seen["tempo"] == pytest.approx(128.0, abs=0.01), "a joining peer takes the session's tempo"
    assert seen["phase_gap"] < 0.01, "the two peers are at different places in the bar"
    assert seen["tempo_after_change"] == pytest.approx(93.0, abs=0.01)
    assert seen["phase_gap_after"] < 0.01 and seen["playing"]

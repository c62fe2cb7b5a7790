"""flowjam in time with a band, measured as `bench sync` measures it: the band (a process of its own, as a DAW) runs a
real clock on a JACK dummy server and records flowjam's output frame by frame; flowjam's metronome clicks on every bar
start of its loop. Each click's distance from the band's bar line is the phase error. A JACK timebase master, a MIDI
clock over JACK MIDI and an Ableton Link peer (inside a network namespace with only the loopback interface), short
runs of the bench's own code; `python -m flowjam bench sync` prints the 5-minute figures (docs/benchmarks.md)."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from flowjam.live.sync.band import Recorder

RUN = r"""
import dataclasses, json, sys
from flowjam.engine.session import Session
from flowjam.live.sync_bench import bench_sync
kind, seconds, change = sys.argv[1], float(sys.argv[2]), (float(sys.argv[3]) if sys.argv[3] != "-" else None)
report = bench_sync(Session.load(preset="tiny"), kind, 120.0, 4, 2, seconds, 512, lambda line: None, change)
print(json.dumps(dataclasses.asdict(report)))
"""
LOOPBACK_MULTICAST = "ip link set lo up && ip link set lo multicast on && ip route add 224.0.0.0/4 dev lo"


def bench(kind: str, seconds: float, tempo_change: float | None = None, private_network: bool = False) -> dict:
    if shutil.which("jackd") is None:
        pytest.skip("jackd (Debian jackd2) is not installed")
    command = [sys.executable, "-c", RUN, kind, str(seconds), "-" if tempo_change is None else str(tempo_change)]
    if private_network:
        if shutil.which("unshare") is None or shutil.which("ip") is None:
            pytest.skip("unshare or ip (util-linux, iproute2) is missing: no private network namespace for Link")
        probe = subprocess.run(["unshare", "-n", "sh", "-c", LOOPBACK_MULTICAST], capture_output=True, text=True)
        if probe.returncode != 0:
            pytest.skip(f"cannot make a private network namespace for Link here: {probe.stderr.strip()}")
        command = ["unshare", "-n", "sh", "-c", f'{LOOPBACK_MULTICAST} && exec "$@"', "sh", *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    errors = [abs(e) for e in report["errors_ms"]]
    report["median_ms"] = sorted(errors)[len(errors) // 2] if errors else None
    report["max_ms"] = max(errors, default=None)
    return report


def assert_on_the_bar_lines(report: dict, bars: int) -> None:
    """Every bar heard, the bars on the band's bar lines (median within the 2 ms target), no hole in the loop. On a
    loaded 2-core CI machine an xrun (a lost block, or the band's lost pulses) can put one bar off by up to two periods
    before the lock makes it up; the 5-minute figures against the 5 ms target are `bench sync`'s (benchmarks.md)."""
    shown = json.dumps(report)
    assert report["bars_heard"] >= bars and report["bars_missed"] == 0, shown
    assert report["median_ms"] <= 2.0 and report["max_ms"] <= 2 * 512 / 48, shown
    assert report["gaps"] == 0 and report["runner_errors"] == 0, shown


def test_jack_transport_bars_and_a_tempo_change_at_a_bar_line():
    report = bench("jack", 24.0, tempo_change=128.0)
    assert_on_the_bar_lines(report, 8)
    assert report["clock_bpm"] == pytest.approx(128.0, abs=0.05), "the transport's new tempo is followed"
    assert report["switches"] == 1 and report["change_bars_late"] in (0, 1, 2), report


def test_a_midi_clock_over_jack_gives_the_bar_lines():
    report = bench("midi", 16.0)
    assert_on_the_bar_lines(report, 5)
    assert report["clock_bpm"] == pytest.approx(120.0, abs=0.05)


def test_an_ableton_link_session_gives_the_bar_lines_heard():
    pytest.importorskip("aalink", reason="aalink is not installed (pip install aalink)")
    report = bench("link", 16.0, private_network=True)
    assert_on_the_bar_lines(report, 5)
    assert report["clock_bpm"] == pytest.approx(120.0, abs=0.01)


class _Port:
    def __init__(self):
        self.block = np.zeros(4, np.float32)

    def get_array(self):
        return self.block


class _Client:
    """What the recorder reads of a JACK client: its sample rate, block size, input ports and the cycle's frame."""

    samplerate, blocksize, last_frame_time = 8, 4, 1000

    def __init__(self):
        self.port = _Port()
        self.inports = self

    def register(self, name):
        return self.port


def test_the_band_recorder_keeps_each_block_at_its_frame_across_a_missed_cycle():
    """A cycle the recorder missed (an xrun) stays silent in its place: the blocks after it are not moved one block
    early, which would put every later bar line one block early in the measured phase errors."""
    client = _Client()
    recorder = Recorder(client, seconds=2.0)
    recorder.recording = True
    for cycle in (0, 1, 3):  # cycle 2 never reaches the recorder
        client.last_frame_time = 1000 + 4 * cycle
        client.port.block = np.full(4, cycle + 1, np.float32)
        recorder.process(4)
    assert recorder.frame_at_start == 1000 and recorder.written == 16
    assert recorder.audio[:16].tolist() == [1] * 4 + [2] * 4 + [0] * 4 + [4] * 4

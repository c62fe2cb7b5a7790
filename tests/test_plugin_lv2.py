"""The LV2 in jalv (a real LV2 host) on the suite's JACK dummy server, with `flowjam live --plugin` running on the tiny
preset and a JACK timebase master at 123 BPM in 4/4 rolling the transport: every click the plugin plays lies within
one sample of the master's bar lines (the position comes from JACK's bar/beat/tick through jalv), and the plugin takes
the dummy server's real-time pace for a host playing, not for a bounce (it never waits)."""

import os
import shutil
import subprocess
import time

import numpy as np
import pytest
from daw_host import BAR_FRAMES, BPM, RATE, SESSION, click_onset_near
from flowjam.live.plugin_link import HOST_OFFLINE, ControlBlock
from helpers import jack_timebase_master, wait_for
from plugin_build import build

BEATS, TICKS_PER_BEAT = 4, 1920.0
BARS = 4


class TransportRecorder:
    """A JACK client that records two ports and the transport frame at the start of each cycle it recorded."""

    def __init__(self, seconds: float):
        import jack

        self.client = jack.Client("fj-lv2-recorder", no_start_server=True)
        self.inputs = [self.client.inports.register(f"in_{channel}") for channel in range(2)]
        self.audio = np.zeros((int(seconds * RATE), 2), np.float32)
        self.cycles: list[tuple[int, int]] = []  # (recorded frames before the cycle, its transport frame)
        self.written = 0
        self.recording = False
        self.client.set_process_callback(self._process)
        self.client.activate()

    def _process(self, frames: int) -> None:
        state, position = self.client.transport_query()
        if not self.recording or state != 1 or self.written + frames > len(self.audio):  # 1: rolling
            return
        self.cycles.append((self.written, position["frame"]))
        for channel, port in enumerate(self.inputs):
            self.audio[self.written : self.written + frames, channel] = port.get_array()
        self.written += frames

    def connect(self, outputs) -> bool:
        """Record `outputs`; False while their client is not active yet."""
        import jack

        try:
            for source, sink in zip(outputs, self.inputs):
                if sink.name not in {port.name for port in self.client.get_all_connections(source)}:
                    self.client.connect(source, sink)
        except jack.JackError:
            return False
        return True

    def at_transport(self, frame: int, margin: int = 2500) -> int | None:
        """The recorded index of a transport frame, where the cycles around it (`margin` frames each side) were all
        recorded one after another; None where a cycle there was missed (a late cycle on a busy machine)."""
        block = self.client.blocksize
        for index, (written, start) in enumerate(self.cycles):
            if start <= frame < start + block:
                around = self.cycles[max(0, index - margin // block - 1) : index + margin // block + 2]
                steady = all(b == (w + block, s + block) for (w, s), b in zip(around, around[1:]))
                return written + frame - start if steady and len(around) > 2 * (margin // block) else None
        return None

    def close(self) -> None:
        self.client.deactivate()
        self.client.close()


@pytest.fixture
def lv2_bundle():
    bundle = build() / "flowjam.lv2"  # the bundle with its TTL files
    if shutil.which("jalv") is None:
        print("plugin LV2 test skipped: jalv is not installed (apt-get install jalv, or run .ci/system-packages)")
        pytest.skip("jalv (Debian jalv) is not installed")
    return bundle


@pytest.fixture
def timebase_master(jack_server):
    """The timebase master: 123 BPM in 4/4, bar/beat/tick from the transport frame (as Ardour's would be)."""
    with jack_timebase_master(jack_server, "fj-lv2-timebase", BPM, BEATS, TICKS_PER_BEAT) as client:
        yield client


def test_lv2_in_jalv_clicks_on_the_jack_timebase_masters_bar_lines(
    lv2_bundle, jack_server, timebase_master, plugin_engine, tmp_path
):
    (tmp_path / "lv2").mkdir()
    (tmp_path / "lv2" / "flowjam.lv2").symlink_to(lv2_bundle)  # LV2_PATH holds only LV2 bundles
    jalv = recorder = None
    try:
        env = {**os.environ, "LV2_PATH": str(tmp_path / "lv2"), "FLOWJAM_SESSION": SESSION}
        jalv = subprocess.Popen(
            ["jalv", "-x", "-n", "fj-lv2", "urn:flowjam:plugin"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        recorder = TransportRecorder(BARS * BAR_FRAMES / RATE + 2.0)
        outputs = wait_for(lambda: recorder.client.get_ports("fj-lv2:", is_output=True, is_audio=True), 20, "jalv")
        wait_for(lambda: recorder.connect(outputs), 10, "jalv's ports to connect (its client active)", poll_s=0.1)
        time.sleep(0.5)  # the plugin attaches to the engine's session
        timebase_master.transport_frame = 0
        recorder.recording = True
        timebase_master.transport_start()
        control = ControlBlock(SESSION, create=False)
        offline = []  # the plugin's verdict on the host's pace, read as it plays

        def recorded() -> bool:
            offline.append(float(control.reals[HOST_OFFLINE]))
            return recorder.written >= len(recorder.audio) - 2048

        try:
            wait_for(recorded, BARS * BAR_FRAMES / RATE + 15, "4 bars", poll_s=0.05)
        finally:
            control.close()
        timebase_master.transport_stop()
        assert offline and not any(offline), "JACK's real-time pace was taken for an offline render"
        audio = recorder.audio[: recorder.written, 0]
        first = recorder.cycles[0][1]
        bars = [bar for bar in range(BARS) if round(bar * BAR_FRAMES) >= first + 1024]
        assert len(bars) >= BARS - 1, f"the recording starts late, at transport frame {first}"
        errors = []
        for bar in bars:
            ideal = recorder.at_transport(round(bar * BAR_FRAMES))
            if ideal is not None:
                errors.append(click_onset_near(audio, ideal) - ideal)
        assert len(errors) >= 2, f"too few bar lines recorded whole to measure ({len(errors)} of {len(bars)})"
        assert max(map(abs, errors)) <= 1, f"clicks against the master's bar lines (samples): {errors}"
        assert np.sqrt(np.mean(audio**2)) > 1e-3, "the loop is audible"
    finally:
        if recorder is not None:
            recorder.close()
        if jalv is not None:
            jalv.terminate()
            jalv.wait(timeout=10)

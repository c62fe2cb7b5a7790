"""`flowjam bench plugin`: the LV2 plugin in jalv (a real LV2 host) on a private JACK dummy server rolled by a
timebase master, beside `flowjam live --plugin` generating, for minutes: the plugin's time per block in the host's
audio thread (counted by the plugin itself into its control block), the JACK server's xruns, gaps (cycles of
exact silence on the plugin's outputs after its first sound: not attached, or a loop not written), and host automation:
a shared knob set in jalv every AUTOMATE_EVERY_S, timed from the set to the plugin's block that carried it and from
that block to the engine taking it in (what a knob of `live` does not pass through; the rest of its way to the ear is
the same runner's)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .engine_process import EngineProcess
from .plugin_link import (
    ENGINE_HOST_CHANGES_TAKEN,
    ENGINE_HOST_LAG_MS,
    HOST_BLOCKS,
    HOST_CHANGES_NS,
    BlockTimes,
    ControlBlock,
)
from .sync.band import TimebaseMaster
from .sync_bench import RATE, PrivateJackServer

LV2_BUNDLE = Path(__file__).resolve().parent.parent / "plugin" / "build" / "flowjam.lv2"
LV2_URI = "urn:flowjam:plugin"
PROMPT = "ambient pads, warm synth"
READY_TIMEOUT_S = 300.0  # the engine's first writes (its model loads, its loop is made)
AUTOMATE_EVERY_S = 2.0  # host automation: the knob set in jalv this often, between AUTOMATE_VALUES
AUTOMATE_KNOB, AUTOMATE_VALUES = "velocity_scale", (1.3, 0.7)
AWAIT_POLL_S = 0.002  # how often a set on its way to the engine is looked for (its time is the engine's, not this)


@dataclass(frozen=True)
class PluginSoakReport:
    seconds: float  # rolled and recorded
    period: int  # JACK's period (frames): the host's block
    blocks: BlockTimes  # the plugin's own count of its blocks and their times
    host_blocks: int  # blocks the plugin rendered attached (its control block's count)
    cycles: int  # JACK cycles the recorder saw while the transport rolled
    gaps: int  # of those, cycles of exact silence on both outputs after the plugin's first sound
    xruns: int  # the JACK server's, over the whole run
    engine_latents: int  # generations the engine finished (it kept generating beside the host)
    automation: tuple[tuple[float, float], ...] = ()  # per knob set in jalv: (set -> its block, block -> engine) ms

    @property
    def period_us(self) -> float:
        return self.period / RATE * 1e6

    @property
    def plugin_xruns(self) -> int:
        """Xruns the plugin's callback can have caused: none while its slowest block stayed under half a period."""
        return self.xruns if self.blocks.max_us >= 0.5 * self.period_us else 0

    @property
    def passed(self) -> bool:
        return self.gaps == 0 and self.plugin_xruns == 0 and self.blocks.blocks > 0


def check_plugin_soak_tools() -> None:
    """What the bench runs besides JACK: jalv and the built LV2 bundle; a FileNotFoundError naming the fix."""
    if shutil.which("jalv") is None:
        raise FileNotFoundError("bench plugin plays the LV2 in jalv: install it (Debian: apt install jalv)")
    if not (LV2_BUNDLE / "manifest.ttl").is_file():
        raise FileNotFoundError(f"the LV2 bundle is not built ({LV2_BUNDLE}): run make -C plugin (docs/plugin.md)")


class _Recorder:
    """A JACK client reading the plugin's two outputs each cycle while the transport rolls: silent cycles after the
    first sound, and the server's xruns."""

    def __init__(self):
        import jack

        self._rolling = jack.ROLLING
        self.client = jack.Client("flowjam-soak-recorder", no_start_server=True)
        self.inputs = [self.client.inports.register(f"in_{channel}") for channel in range(2)]
        self.cycles = self.gaps = self.xruns = 0
        self.heard = False
        self.recording = False
        self.client.set_process_callback(self._process)
        self.client.set_xrun_callback(self._xrun)
        self.client.activate()

    def _process(self, frames: int) -> None:
        if not self.recording or self.client.transport_state != self._rolling:
            return
        self.cycles += 1
        sound = any(port.get_array().any() for port in self.inputs)
        if sound:
            self.heard = True
        elif self.heard:
            self.gaps += 1

    def _xrun(self, delay_us: float) -> None:
        self.xruns += 1

    def connect(self, prefix: str) -> bool:
        """Record `prefix`'s audio outputs; False while that client has none yet."""
        import jack

        outputs = self.client.get_ports(prefix, is_output=True, is_audio=True)
        if len(outputs) < 2:
            return False
        try:
            for source, sink in zip(outputs, self.inputs):
                self.client.connect(source, sink)
        except jack.JackError:
            return False
        return True

    def close(self) -> None:
        self.client.deactivate()
        self.client.close()


class _Automation:
    """Host automation in jalv: AUTOMATE_KNOB set through its console every AUTOMATE_EVERY_S, each set timed to the
    plugin's block that gave it to the engine (the block's start, HOST_CHANGES_NS) and on to the engine taking it in
    (ENGINE_HOST_LAG_MS). perf_counter, the plugin's clock and the engine's are all CLOCK_MONOTONIC."""

    def __init__(self, jalv: subprocess.Popen, control: ControlBlock):
        self.jalv, self.control = jalv, control
        self.timed: list[tuple[float, float]] = []
        self._sets = 0
        self._set_at: float | None = None
        self._taken = int(control.counters[ENGINE_HOST_CHANGES_TAKEN])
        self._next = time.perf_counter() + AUTOMATE_EVERY_S

    def step(self) -> float:
        """Set the knob when due, time a set the engine took in; -> seconds until it needs looking at again."""
        now = time.perf_counter()
        taken = int(self.control.counters[ENGINE_HOST_CHANGES_TAKEN])
        if self._set_at is not None and taken != self._taken:
            block_s = int(self.control.counters[HOST_CHANGES_NS]) / 1e9
            self.timed.append(((block_s - self._set_at) * 1000.0, float(self.control.reals[ENGINE_HOST_LAG_MS])))
            self._set_at = None
        self._taken = taken
        if self._set_at is None and now >= self._next:
            value = AUTOMATE_VALUES[self._sets % len(AUTOMATE_VALUES)]
            self._sets += 1
            self._next = now + AUTOMATE_EVERY_S
            self._set_at = time.perf_counter()  # before jalv can read it: its block starts after this
            self.jalv.stdin.write(f"{AUTOMATE_KNOB} = {value}\n".encode())
            self.jalv.stdin.flush()
        return AWAIT_POLL_S if self._set_at is not None else max(0.0, self._next - time.perf_counter())


def _engine_command(session: str, bpm: float, bars: int, model_flags: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "flowjam",
        "live",
        "--plugin",
        "--osc-port",
        "0",
        "--session",
        session,
        "--bpm",
        f"{bpm:g}",
        "--bars",
        str(bars),
        "--prompt",
        PROMPT,
        *model_flags,
    ]


def _wait(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come within {timeout_s:g} s")
        time.sleep(0.1)


def soak_plugin(
    seconds: float, period: int, bpm: float, bars: int, model_flags: list[str], report: Callable[[str], None]
) -> PluginSoakReport:
    """Play the LV2 in jalv for `seconds` of rolling transport beside a generating engine; `report` gets a line
    every 30 s."""
    check_plugin_soak_tools()
    session = f"soak-{os.getpid()}"
    server = PrivateJackServer(period)
    engine = jalv = recorder = timebase = control = None
    try:
        engine = EngineProcess(_engine_command(session, bpm, bars, model_flags))
        engine.wait_ready(timeout_s=READY_TIMEOUT_S)
        with tempfile.TemporaryDirectory() as lv2_path:
            (Path(lv2_path) / LV2_BUNDLE.name).symlink_to(LV2_BUNDLE)
            env = {**os.environ, "LV2_PATH": lv2_path, "FLOWJAM_SESSION": session}
            jalv = subprocess.Popen(
                ["jalv", "-x", "-n", "fj-soak", LV2_URI],
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            import jack

            recorder = _Recorder()
            _wait(lambda: recorder.connect("fj-soak:"), 30, "jalv's outputs")
            timebase = jack.Client("flowjam-soak-timebase", no_start_server=True)
            TimebaseMaster(timebase, bpm, 4)
            timebase.activate()
            control = ControlBlock(session, create=False)
            _wait(lambda: control.counters[HOST_BLOCKS] > 0, 30, "the plugin's first attached block")
            timebase.transport_frame = 0
            recorder.recording = True
            timebase.transport_start()
            started = last = time.monotonic()
            automation = _Automation(jalv, control)
            while (now := time.monotonic()) - started < seconds:
                if jalv.poll() is not None:
                    raise RuntimeError(f"jalv exited (status {jalv.returncode}) after {now - started:.0f} s")
                wait_s = automation.step()
                if now - last >= 30.0:
                    last = now
                    b = control.block_times()
                    report(
                        f"{now - started:5.0f} s: {b.blocks} blocks, plugin p99 {b.p99_us:.1f} us, max "
                        f"{b.max_us:.1f} us; {recorder.xruns} xruns, {recorder.gaps} gaps; engine latents "
                        f"{engine.latents()}"
                    )
                time.sleep(min(wait_s, 1.0, max(0.0, seconds - (now - started))))
            timebase.transport_stop()
            recorder.recording = False
            return PluginSoakReport(
                seconds=time.monotonic() - started,
                period=period,
                blocks=control.block_times(),
                host_blocks=int(control.counters[HOST_BLOCKS]),
                cycles=recorder.cycles,
                gaps=recorder.gaps,
                xruns=recorder.xruns,
                engine_latents=engine.latents(),
                automation=tuple(automation.timed),
            )
    finally:
        if control is not None:
            control.close()
        if jalv is not None:
            jalv.terminate()
            try:
                jalv.wait(timeout=10)
            except subprocess.TimeoutExpired:
                jalv.kill()
        if recorder is not None:
            recorder.close()
        if timebase is not None:
            timebase.deactivate()
            timebase.close()
        if engine is not None:
            engine.stop()
        server.close()

"""LoopBuffer and Playback: the buffer's math without a device; real audio through a JACK dummy server, captured
by a second JACK client and compared sample by sample (JACK's float path is bit-exact)."""

import os
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from flowjam.engine.audio.files import read_audio
from flowjam.live.loop_buffer import PLAYED, LoopBuffer
from flowjam.live.playback import Playback, PlaybackError, find_device, list_devices
from helpers import JackRecorder

SR = 48_000
BLOCK = 1024


def tone(freq_hz: float, frames: int, amplitude: float = 0.5, noise: float = 0.01, seed: int = 0) -> np.ndarray:
    """[2, frames] sine (right channel phase-shifted) plus a little noise, so an alignment is unique."""
    t = np.arange(frames) / SR
    rng = np.random.default_rng(seed)
    left = amplitude * np.sin(2 * np.pi * freq_hz * t) + noise * rng.standard_normal(frames)
    right = amplitude * np.sin(2 * np.pi * freq_hz * t + 0.5) + noise * rng.standard_normal(frames)
    return np.stack([left, right]).astype(np.float32)


def peak_hz(samples: np.ndarray) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    return float(np.fft.rfftfreq(len(samples), 1 / SR)[np.argmax(spectrum)])


def loop_offset(captured: np.ndarray, loop: np.ndarray) -> int:
    """p such that captured[k] ~ loop[:, (p + k) % frames], by circular cross-correlation of the left channel."""
    frames = loop.shape[1]
    n = min(len(captured), frames)
    corr = np.fft.irfft(np.fft.rfft(loop[0]) * np.conj(np.fft.rfft(captured[:n, 0], frames)), frames)
    return int(np.argmax(corr))


def loop_excerpt(loop: np.ndarray, offset: int, count: int) -> np.ndarray:
    return loop[:, (offset + np.arange(count)) % loop.shape[1]].T


@pytest.fixture
def loop():
    buffer = LoopBuffer(2 * SR)
    buffer.fill(tone(440.0, 2 * SR))
    yield buffer
    buffer.unlink()


# --- LoopBuffer, no device -----------------------------------------------------------------------------------------


def test_patch_wraps_past_the_loop_end_with_equal_power_edges():
    with LoopBuffer(1000) as ones_under_zeros, LoopBuffer(1000) as zeros_under_ones:
        ones_under_zeros.fill(np.ones((2, 1000), np.float32))
        ones_under_zeros.patch(1900, torch.zeros(2, 300), fade_frames=50)  # 1900 % 1000 = 900: wraps to 0..199
        zeros_under_ones.patch(1900, np.ones(300, np.float32), fade_frames=50)  # 1-D: the same on every channel
        audio, new_weight = ones_under_zeros.snapshot(), zeros_under_ones.snapshot()
        assert np.all(audio[:, 950:] == 0) and np.all(audio[:, :150] == 0), (
            "new audio is not fully in between the fades"
        )
        assert np.all(audio[:, 200:900] == 1), "the patch touched frames outside its span"
        for edge in (slice(900, 950), slice(150, 200)):
            old_weight = audio[:, edge]
            assert np.all(np.abs(np.diff(old_weight)) < 0.05), f"fade at {edge} is not smooth"
            np.testing.assert_allclose(
                old_weight + new_weight[:, edge], 1.0, atol=1e-5, err_msg="fade is not equal-gain"
            )
        assert np.all(np.diff(audio[0, 900:950]) < 0) and np.all(np.diff(audio[0, 150:200]) > 0), (
            "old audio does not fade out/in"
        )


def test_patch_rejects_more_frames_than_the_loop_and_the_wrong_channel_count():
    with LoopBuffer(100) as buffer:
        with pytest.raises(ValueError, match="does not fit"):
            buffer.patch(0, np.zeros((2, 101)))
        with pytest.raises(ValueError, match=r"\[2, frames\]"):
            buffer.patch(0, np.zeros((3, 10)))
        with pytest.raises(ValueError, match="NaN"):
            buffer.patch(0, np.full((2, 10), np.nan))


def test_attached_buffer_shares_audio_counters_and_gain_and_reads_across_the_seam():
    with LoopBuffer(64, sample_rate=44_100) as buffer:
        buffer.fill(np.arange(128, dtype=np.float32).reshape(2, 64))
        other = LoopBuffer.attach(buffer.name)
        assert (other.frames, other.channels, other.sample_rate) == (64, 2, 44_100)
        other.gain = 0.25
        other.counters[PLAYED] = 130  # the played counter, as the output process would advance it
        assert buffer.gain == 0.25 and buffer.playhead_frames == 130 and buffer.position == 2
        out = np.empty((4, 2), np.float32)
        other.read_into(out, 62)
        np.testing.assert_array_equal(out, [[62, 126], [63, 127], [0, 64], [1, 65]], err_msg="read_into does not wrap")
        other.close()


# --- devices -------------------------------------------------------------------------------------------------------


def test_find_device_picks_jack_and_its_errors_name_the_outputs_and_the_fix(jack_server):
    import sounddevice as sd

    index = find_device("system")
    assert sd.query_hostapis(sd.query_devices(index)["hostapi"])["name"].startswith("JACK")
    assert find_device("JACK") == index and find_device(index) == index and find_device(str(index)) == index
    for bad in ("no-such-card", 999):
        with pytest.raises(ValueError, match="--list-devices") as error:
            find_device(bad)
        assert "system" in str(error.value), f"the error does not name the available outputs: {error.value}"
    assert "JACK" in list_devices()


def test_start_on_a_missing_device_raises_naming_list_devices(jack_server, loop):
    playback = Playback(loop, device="no-such-card")
    with pytest.raises(PlaybackError, match="--list-devices"):
        playback.start()
    assert not playback.running and playback._process.exitcode is not None, "the output process was left running"
    playback.stop()


# --- real audio through JACK ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_tone_plays_bit_exact_without_gaps_or_underruns(jack_server, loop, mode):
    loop.gain = 0.0
    with Playback(loop, device="system", mode=mode) as playback:
        recorder = JackRecorder(seconds=4)
        recorder.connect_portaudio()
        time.sleep(0.3)
        # the JACK frame of the cycle under way (exact), not `frame_time`'s estimate from the clock, which a late
        # dummy driver on a busy machine puts ahead of the frames the cycles carry (an onset of -26 ms, once)
        started, start_frames, push_frame = time.monotonic(), playback.playhead_frames, recorder.client.last_frame_time
        loop.gain = 1.0
        time.sleep(2.2)
        captured = recorder.stop()
        elapsed_s, played = time.monotonic() - started, playback.playhead_frames - start_frames
        assert playback.running, f"playback stopped: {playback.stats()}"
        underruns = playback.underruns
    heard = np.flatnonzero(np.any(captured != 0, axis=1))
    assert heard.size, "nothing arrived at the JACK recorder"
    onset = int(heard[0])
    onset_latency_s = (recorder.first_frame_time + onset - push_frame) / SR
    print(
        f"\n{mode}: onset latency {1000 * onset_latency_s:.1f} ms, underruns {underruns}, "
        f"playhead rate {played / (elapsed_s * SR):.4f} x real time"
    )
    assert 0 <= onset_latency_s < 0.2, f"sound started {1000 * onset_latency_s:.0f} ms after the gain went up"
    steady = captured[onset + BLOCK :]  # the first block ramps the gain up
    assert len(steady) > SR, f"only {len(steady)} frames were captured after the onset"
    block_peaks = np.abs(steady[: len(steady) // 256 * 256]).reshape(-1, 256, 2).max(axis=(1, 2))
    assert block_peaks.min() > 0.1, f"{np.sum(block_peaks <= 0.1)} silent 256-frame blocks inside the played span"
    assert abs(peak_hz(steady[:SR, 0]) - 440.0) <= 2.0, f"recorded tone is at {peak_hz(steady[:SR, 0]):.1f} Hz"
    expected = loop_excerpt(loop.snapshot(), loop_offset(steady, loop.snapshot()), len(steady))
    assert np.abs(steady - expected).max() <= 1e-6, (
        f"captured audio differs from the loop by {np.abs(steady - expected).max()}"
    )
    assert underruns == 0, f"{underruns} output underflows"
    assert abs(played / (elapsed_s * SR) - 1) < 0.1, f"playhead advanced {played} frames in {elapsed_s:.2f} s"


def test_patch_ahead_of_the_playhead_is_heard_where_expected_with_smooth_edges(jack_server, loop):
    patch_frames, fade = SR // 2, 480
    with Playback(loop, device="system") as playback:
        recorder = JackRecorder(seconds=3)
        recorder.connect_portaudio()
        time.sleep(0.3)
        playhead, push_frame = playback.playhead_frames, recorder.client.frame_time
        start = playhead + SR // 4
        old_at_start = loop.snapshot()[:, start % loop.frames]
        # a 660 Hz cosine starting against the old audio's sign: a hard cut would jump by ~0.8
        new = (
            0.8
            * np.cos(2 * np.pi * 660 * np.arange(patch_frames) / SR)[None].repeat(2, 0)
            * -np.sign(old_at_start)[:, None]
        )
        loop.patch(start, new, fade_frames=fade)
        time.sleep(1.0)
        captured = recorder.stop()
    after = loop.snapshot()
    first_heard = int(np.flatnonzero(np.any(captured != 0, axis=1))[0])  # frames before are from before connect
    offset = loop_offset(captured[first_heard:], after)
    heard_start = (start % loop.frames - offset) % loop.frames + first_heard
    expected_start = push_frame - recorder.first_frame_time + (start - playhead)
    print(f"\npatch heard {heard_start - expected_start} frames after playhead + lead")
    assert abs(heard_start - expected_start) < 2 * BLOCK, (
        f"patch heard at {heard_start}, expected near {expected_start}"
    )
    span = captured[heard_start - fade : heard_start + patch_frames + fade]
    assert len(span) == patch_frames + 2 * fade, "the recording ended before the patch was played"
    assert abs(peak_hz(captured[heard_start + fade : heard_start + patch_frames - fade, 0]) - 660) <= 2
    jump = np.abs(np.diff(span, axis=0)).max()
    assert jump < 0.2, f"discontinuity of {jump:.2f} at the patch edges (crossfade missing?)"
    expected = loop_excerpt(after, offset, len(captured) - first_heard)
    assert np.abs(captured[first_heard:] - expected).max() <= 1e-6, "what JACK heard is not the patched loop"


def test_recording_written_by_stop_equals_what_jack_heard(jack_server, loop, tmp_path):
    wav = tmp_path / "played.wav"
    playback = Playback(loop, device="system", record_path=str(wav))
    playback.start()
    recorder = JackRecorder(seconds=3)
    recorder.connect_portaudio()
    time.sleep(1.0)
    captured = recorder.stop()
    playback.stop()
    recorded, rate = read_audio(wav)
    recorded_pcm = np.round(recorded.numpy().T * 32768).astype(np.int32)
    assert rate == SR and len(recorded_pcm) == playback.playhead_frames, "the WAV does not hold every played frame"
    heard = captured[np.flatnonzero(np.any(captured != 0, axis=1))[0] :]
    heard_pcm = np.round(heard * 32767).astype(np.int32)
    offset = int(
        np.argmax(
            np.correlate(recorded_pcm[:, 0].astype(np.float64), heard_pcm[: SR // 4, 0].astype(np.float64), "valid")
        )
    )
    assert np.array_equal(recorded_pcm[offset : offset + len(heard_pcm)], heard_pcm), (
        "the WAV differs from the JACK capture"
    )


@pytest.mark.parametrize("mode", ["null", "null-process"])
def test_null_mode_plays_in_real_time_and_records_exactly_what_it_played(loop, tmp_path, mode):
    wav = tmp_path / "null.wav"
    playback = Playback(loop, mode=mode, record_path=str(wav))
    playback.start()
    started, first = time.monotonic(), playback.playhead_frames  # a spawned clock starts once its process runs
    time.sleep(1.0)
    played, elapsed_s = playback.playhead_frames - first, time.monotonic() - started
    playback.stop()
    assert abs(played / (elapsed_s * SR) - 1) < 0.1, f"null clock played {played} frames in {elapsed_s:.2f} s"
    recorded, _ = read_audio(wav)
    assert recorded.shape[1] == playback.playhead_frames, "WAV length differs from the frames played"
    expected = np.round(loop_excerpt(loop.snapshot(), 0, recorded.shape[1]) * 32767)
    assert np.array_equal(np.round(recorded.numpy().T * 32768), expected), (
        "null mode recorded other audio than the loop"
    )


def hold_the_gil(seconds: float) -> None:
    """Keep the GIL for about `seconds` in one C call (as a compile or a graph capture does): no thread of this
    process runs meanwhile."""
    per_second = 60_000_000
    started = time.perf_counter()
    sum(range(int(per_second * 0.05)))
    rate = 0.05 * per_second / (time.perf_counter() - started)
    sum(range(int(rate * seconds)))


def test_the_null_clock_in_its_own_process_is_never_late_when_the_engine_holds_the_gil(loop):
    """A clock thread shares the engine's GIL and misses blocks while the engine holds it; the null-process clock,
    like the output process a sound card gets, keeps time."""
    underruns, late = {}, {}
    for mode in ("null", "null-process"):
        playback = Playback(loop, mode=mode)
        playback.start()
        time.sleep(0.2)
        before = playback.stats()
        hold_the_gil(0.4)
        time.sleep(0.2)
        after = playback.stats()
        underruns[mode], late[mode] = (after[key] - before[key] for key in ("underruns", "late_blocks"))
        playback.stop()
    assert underruns["null"] >= 1, "the thread clock was never late: the GIL was not held"
    assert late["null"] == underruns["null"], "a late clock counts late blocks, not gaps"
    assert underruns["null-process"] == 0, f"the process clock was late {underruns['null-process']} times"


def test_a_hole_in_the_loop_after_sound_is_counted_as_gaps_not_late_blocks(loop):
    """Exact zeros while playing (the engine fell behind the playhead and the loop holds nothing there) are
    underruns of their own kind, told apart from an output that came late."""
    loop.patch(SR // 2, np.zeros((2, SR // 2), np.float32), fade_frames=0)  # 0.5 s of nothing in a 2 s loop
    playback = Playback(loop, mode="null-process")
    playback.start()
    try:
        time.sleep(1.3)
        stats = playback.stats()
    finally:
        playback.stop()
    blocks = (SR // 2) // 512
    assert blocks - 2 <= stats["gaps"] <= blocks + 2, stats
    assert stats["underruns"] == stats["gaps"] + stats["late_blocks"], stats


def test_killed_output_process_is_reported_and_stop_still_works(jack_server, loop):
    playback = Playback(loop, device="system")
    playback.start()
    playback._process.kill()
    deadline = time.monotonic() + 3
    while playback.running and time.monotonic() < deadline:
        time.sleep(0.02)
    stats = playback.stats()
    assert not stats["running"] and "ended unexpectedly" in (stats["error"] or ""), f"death not reported: {stats}"
    started = time.monotonic()
    playback.stop()
    assert time.monotonic() - started < 2, "stop() hung after the output process died"


def test_jack_server_stopping_under_the_output_process_is_reported(jack_server, loop, monkeypatch):
    server = f"flowjam-vanishing-{os.getpid()}"
    env = dict(os.environ, JACK_DEFAULT_SERVER=server, JACK_NO_AUDIO_RESERVATION="1")
    jackd = subprocess.Popen(
        ["jackd", "-R", "-d", "dummy", "-r", str(SR), "-p", str(BLOCK)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while subprocess.run(["jack_wait", "-c"], env=env, capture_output=True, text=True).stdout.strip() != "running":
            assert time.monotonic() < deadline and jackd.poll() is None, "the second jackd did not start"
            time.sleep(0.05)
        monkeypatch.setenv("JACK_DEFAULT_SERVER", server)  # the spawned output process plays on the second server
        playback = Playback(loop, device="system")
        playback.start()
        time.sleep(0.2)
        assert playback.running, f"did not start on the second server: {playback.stats()}"
        jackd.terminate()
        jackd.wait(timeout=5)
        deadline = time.monotonic() + 2
        while playback.running and time.monotonic() < deadline:
            time.sleep(0.01)
        stats = playback.stats()
        assert not stats["running"] and "stopped on its own" in (stats["error"] or ""), (
            f"vanished server not reported: {stats}"
        )
        started = time.monotonic()
        playback.stop()
        assert time.monotonic() - started < 2 and playback._process.exitcode == 0, (
            f"output process did not exit cleanly (exit code {playback._process.exitcode})"
        )
    finally:
        if jackd.poll() is None:
            jackd.kill()
            jackd.wait()
        for leftover in Path("/dev/shm").glob(f"jack_sem.*_{server}_*"):  # its clients' semaphores, orphaned
            leftover.unlink(missing_ok=True)


def test_thread_mode_reports_a_stream_closed_under_it(jack_server, loop):
    playback = Playback(loop, device="system", mode="thread")
    playback.start()
    playback._stream.abort()
    stats = playback.stats()
    assert not stats["running"] and "stopped on its own" in (stats["error"] or ""), (
        f"closed stream not reported: {stats}"
    )
    playback.stop()
    playback._stream.close()  # stop() leaves a dead stream open (its server may be gone); this one's ports would stay


def test_process_mode_keeps_playing_while_python_threads_hog_the_gil(jack_server, loop):
    def spin(stop: threading.Event) -> None:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # contend for the GIL, leave the CPU to audio
        while not stop.is_set():
            sum(i * i for i in range(1000))

    stop = threading.Event()
    with Playback(loop, device="system") as playback:
        spinners = [threading.Thread(target=spin, args=(stop,)) for _ in range(2)]
        for spinner in spinners:
            spinner.start()
        start_frames, started = playback.playhead_frames, time.monotonic()
        time.sleep(2.0)
        stop.set()
        for spinner in spinners:
            spinner.join()
        played, elapsed_s, underruns = (
            playback.playhead_frames - start_frames,
            time.monotonic() - started,
            playback.underruns,
        )
    assert underruns == 0, f"{underruns} underflows while two Python threads were busy"
    assert played / (elapsed_s * SR) > 0.95, f"played only {played} frames in {elapsed_s:.2f} s"


def test_a_recording_is_a_valid_wav_at_every_moment_and_a_cut_take_is_kept_aside(tmp_path):
    from flowjam.live.recording import WavStream, partial_path, recover_partial

    target = tmp_path / "take.wav"
    wav = WavStream(partial_path(target), channels=2, sample_rate=SR)
    tone = (0.25 * np.sin(np.arange(SR) * 2 * np.pi * 440 / SR)).astype(np.float32)
    wav.append(np.stack([tone, tone], axis=1))
    read, rate = read_audio(partial_path(target))  # the file is still open: as a SIGKILL would leave it
    assert rate == SR and read.shape == (2, SR)
    wav.append(np.zeros((100, 2), np.float32))
    assert read_audio(partial_path(target))[0].shape == (2, SR + 100)
    assert recover_partial(target) is None, "a take still being recorded was moved aside"
    wav.close()  # its recorder is gone, as after a SIGKILL: the lock with it
    kept = recover_partial(target)
    assert kept is not None and kept.name.startswith("take.recovered-") and not partial_path(target).exists()
    assert read_audio(kept)[0].shape == (2, SR + 100)

"""Takes and outputs that lose nothing: numbered takes, one recorder per take (an OS lock), a full disk that stops the
take but not the music, RF64 past 4 GB, temporaries of killed writers tidied, and an audio process that dies
quietly with its parent. The recordings go through the real callback body, drain and WAV writer."""

import errno
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile
from flowjam.engine.outputs import atomic_output, write_atomic
from flowjam.live.loop_buffer import RECORDED, LoopBuffer
from flowjam.live.playback import Playback
from flowjam.live.recording import HEADER_BYTES, RecordingDrain, WavStream, partial_path, wav_header
from flowjam.live.renderer import BlockRenderer

SR = 48_000
BLOCK = 1024
FRAME_BYTES = 4  # 16-bit stereo


class Performance:
    """A loop played block by block through the audio callback's body into a recording ring, and the recording
    drain that writes it to `path` (its thread not started: each play() drains once)."""

    def __init__(self, path: Path, seed: int):
        self.buffer = LoopBuffer(SR)
        self.buffer.fill(np.random.default_rng(seed).uniform(-0.5, 0.5, (2, SR)).astype(np.float32))
        self.ring = np.zeros((4 * SR, 2), np.float32)
        self.renderer = BlockRenderer(self.buffer, BLOCK, self.ring)
        self.drain = RecordingDrain(path, self.ring, self.buffer.counters, RECORDED, SR)
        self.played: list[np.ndarray] = []

    def play(self, blocks: int) -> None:
        out = np.empty((BLOCK, 2), np.float32)
        for _ in range(blocks):
            self.renderer.render(out, BLOCK)
            self.played.append(out.copy())
        self.drain.drain()

    def played_pcm(self) -> np.ndarray:
        return np.round(np.concatenate(self.played) * 32767).astype(np.int16)

    def finish(self) -> Path:
        try:
            return self.drain.finish()
        finally:
            self.drain.close_unfinished()
            self.buffer.unlink()


def read_pcm(path: Path) -> np.ndarray:
    return soundfile.read(path, dtype="int16")[0]


def recording_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "flowjam.recording"]


@pytest.fixture
def loop():
    buffer = LoopBuffer(SR)
    buffer.fill(np.random.default_rng(0).uniform(-0.5, 0.5, (2, SR)).astype(np.float32))
    yield buffer
    buffer.unlink()


# --- numbered takes --------------------------------------------------------------------------------------------------


def test_recording_to_a_finished_take_writes_the_next_number_and_says_so_once(tmp_path, loop, caplog):
    take = tmp_path / "take.wav"
    take.write_bytes(b"the first take")
    finished = []
    for _ in range(2):
        playback = Playback(loop, mode="null", record_path=str(take))
        playback.start()
        time.sleep(0.3)
        playback.stop()
        finished.append(playback.recording.path)
    assert [p.name for p in finished] == ["take-2.wav", "take-3.wav"], finished
    assert take.read_bytes() == b"the first take", "a finished take was overwritten"
    assert recording_warnings(caplog) == [
        "recording to take-2.wav (take.wav exists)",
        "recording to take-3.wav (take.wav exists)",
    ]
    for path in finished:
        assert len(read_pcm(path)) > 0.2 * SR, f"{path.name} does not hold what was played"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["take-2.wav", "take-3.wav", "take.wav"]


# --- one recorder per take -------------------------------------------------------------------------------------------


def test_two_recorders_to_one_path_each_keep_their_own_take(tmp_path, caplog):
    first = Performance(tmp_path / "take.wav", seed=1)
    second = Performance(tmp_path / "take.wav", seed=2)
    for _ in range(3):  # interleaved, as two live sessions would drain
        first.play(10)
        second.play(7)
    assert (first.finish().name, second.finish().name) == ("take.wav", "take-2.wav")
    assert np.array_equal(read_pcm(tmp_path / "take.wav"), first.played_pcm()), "the first take was disturbed"
    assert np.array_equal(read_pcm(tmp_path / "take-2.wav"), second.played_pcm())
    assert recording_warnings(caplog) == ["recording to take-2.wav (take.wav is being recorded by another process)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["take-2.wav", "take.wav"], "a take was moved or left over"


HOLDER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import numpy as np
    from flowjam.live.recording import WavStream
    wav = WavStream(Path(sys.argv[1]), 2, 48000)
    wav.append(np.full((4800, 2), 0.25, np.float32))
    print("recording", flush=True)
    sys.stdin.readline()
    wav.append(np.full((4800, 2), 0.25, np.float32))
    print(wav.frames, flush=True)
    sys.stdin.readline()
    """
)


def test_a_take_another_process_records_is_never_moved_and_a_dead_ones_is_recovered(tmp_path):
    take = tmp_path / "take.wav"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(partial_path(take))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "recording\n", "the other recorder did not start"
        beside = Performance(take, seed=3)
        beside.play(5)
        assert beside.finish().name == "take-2.wav"
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline() == "9600\n", "the other recorder could not go on writing its take"
        assert len(read_pcm(partial_path(take))) == 9600, "the other process's take was disturbed"
    finally:
        holder.kill()
        holder.wait()
    after_the_kill = Performance(take, seed=4)  # the holder died: its `.partial` is recovered, the name is free
    after_the_kill.play(5)
    assert after_the_kill.finish() == take
    recovered = list(tmp_path.glob("take.recovered-*.wav"))
    assert len(recovered) == 1 and len(read_pcm(recovered[0])) == 9600, "the killed take was not kept whole"
    assert np.array_equal(read_pcm(take), after_the_kill.played_pcm())


# --- a full disk -----------------------------------------------------------------------------------------------------


class DiskWithRoomFor:
    """A take's file on a disk with room for `size_limit` bytes of it: a write past that writes what fits, then fails
    with ENOSPC, as Linux does."""

    def __init__(self, file, size_limit: int):
        self.file, self.size_limit = file, size_limit

    def write(self, data) -> int:
        room = self.size_limit - self.file.tell()
        if room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.file.write(memoryview(data)[:room])

    def __getattr__(self, name: str):
        return getattr(self.file, name)


def test_a_full_disk_cuts_the_take_at_its_last_whole_frame_says_so_once_and_keeps_it(tmp_path, caplog):
    performance = Performance(tmp_path / "take.wav", seed=6)
    wav = performance.drain._wav
    wav._file = DiskWithRoomFor(wav._file, HEADER_BYTES + 3000 * FRAME_BYTES + 3)  # full 3 bytes into a frame
    for _ in range(3):
        performance.play(2)
    error = performance.drain.error
    assert error is not None and "No space left on device" in error and "free space on that disk" in error, error
    assert recording_warnings(caplog) == [error], "the full disk was not reported exactly once"
    assert (tmp_path / "take.wav.partial").stat().st_size == HEADER_BYTES + 3000 * FRAME_BYTES, "a cut frame is left"
    assert performance.finish() == tmp_path / "take.wav"
    assert np.array_equal(read_pcm(tmp_path / "take.wav"), performance.played_pcm()[:3000])


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs (a real disk that a recording fills in about a second); skips where mounting is refused."""
    folder = tmp_path / "disk"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


def test_live_on_a_disk_that_fills_up_plays_on_keeps_the_take_and_exits_2_saying_so(small_disk):
    (small_disk / "take.wav").write_bytes(b"an earlier take")
    result = subprocess.run(
        [sys.executable, "-m", "flowjam", "live", "--preset", "tiny", "--prompt", "ambient", "--seconds", "4"]
        + ["--record", str(small_disk / "take.wav"), "--osc-port", "0", "--no-audio"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    take = small_disk / "take-2.wav"
    assert result.stdout.startswith(f"recorded {take}:"), result.stdout
    assert result.stderr.count("recording to take-2.wav (take.wav exists)") == 1, result.stderr
    said = [line for line in result.stderr.splitlines() if "No space left on device" in line]
    assert len(said) == 2 and said[-1].startswith("flowjam live: error: recording to"), result.stderr  # warning, exit
    frames = int(result.stdout.rsplit("(", 1)[1].split()[0])
    assert take.stat().st_size == HEADER_BYTES + frames * FRAME_BYTES and len(read_pcm(take)) == frames
    playheads = [
        float(line.split("playhead")[1].split()[0]) for line in result.stderr.splitlines() if "STOPPED" in line
    ]
    assert playheads and playheads[-1] > frames / SR + 1.5, f"the music stopped with the take: {result.stderr}"


def test_a_take_that_cannot_be_opened_fails_the_start_and_leaves_no_audio_process(tmp_path, loop):
    (tmp_path / "take.wav.partial").mkdir()  # in the way of the take's file
    playback = Playback(loop, mode="null-process", record_path=str(tmp_path / "take.wav"))
    with pytest.raises(IsADirectoryError):
        playback.start()
    assert playback._process.exitcode is not None, "the audio process was left playing"


# --- RF64 past 4 GB --------------------------------------------------------------------------------------------------


def test_a_take_past_the_riff_limit_goes_on_as_rf64_and_reads_back_whole_at_every_step(tmp_path):
    path = tmp_path / "take.wav.partial"
    wav = WavStream(path, 2, SR, riff_limit_bytes=HEADER_BYTES - 8 + 1000 * FRAME_BYTES)
    audio = np.random.default_rng(5).uniform(-0.5, 0.5, (1500, 2)).astype(np.float32)
    wav.append(audio[:1000])
    assert path.read_bytes()[:4] == b"RIFF" and soundfile.info(path).frames == 1000
    wav.append(audio[1000:])
    assert path.read_bytes()[:4] == b"RF64" and soundfile.info(path).format == "RF64"
    assert np.array_equal(read_pcm(path), np.round(audio * 32767).astype(np.int16)), "RF64 does not hold every frame"
    wav.close()


def test_the_header_of_a_5_gb_take_is_rf64_with_64_bit_sizes_where_the_junk_was():
    frames = 5 * 2**30 // FRAME_BYTES
    small, large = wav_header(2, SR, 1000), wav_header(2, SR, frames)
    assert len(small) == len(large) == HEADER_BYTES, "the header must keep its size to be rewritten in place"
    assert small[:4] == b"RIFF" and small[12:20] == b"JUNK" + struct.pack("<I", 28)
    assert large[:12] == b"RF64" + b"\xff\xff\xff\xff" + b"WAVE"
    chunk, size, riff_bytes, data_bytes, sample_count, table = struct.unpack("<4sIQQQI", large[12:48])
    assert (chunk, size, table) == (b"ds64", 28, 0)
    assert (riff_bytes, data_bytes, sample_count) == (HEADER_BYTES - 8 + frames * 4, frames * 4, frames)
    assert large[48:72] == small[48:72], "the fmt chunk changed"
    assert large[72:] == b"data" + b"\xff\xff\xff\xff"


# --- temporaries of killed writers -----------------------------------------------------------------------------------

KILLED_WRITER = textwrap.dedent(
    """
    import os, signal, sys
    from flowjam.engine.outputs import atomic_output
    with atomic_output(sys.argv[1]) as temporary:
        temporary.write_bytes(b"half a song")
        if sys.argv[2] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        print("writing", flush=True)
        sys.stdin.readline()
    """
)


def test_a_write_removes_the_temporaries_killed_writers_left_and_never_a_live_writers(tmp_path):
    song, other = tmp_path / "song.wav", tmp_path / "other.wav"
    live = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(song), "wait"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert live.stdout.readline() == b"writing\n"
        for path in (song, other):
            killed = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(path), "kill"], capture_output=True)
            assert killed.returncode == -signal.SIGKILL, killed.stderr
        left = {p.name for p in tmp_path.glob(".*.tmp")}
        assert len(left) == 3, left
        write_atomic(song, b"a new song")
        kept = {p.name for p in tmp_path.glob(".*.tmp")}
        assert kept == {n for n in left if n.startswith(f".song.wav.{live.pid}.") or n.startswith(".other.wav.")}, (
            f"of {sorted(left)}, {sorted(kept)} were kept: only the live writer's and other.wav's should be"
        )
        live.stdin.write(b"\n")
        live.stdin.flush()
        assert live.wait(30) == 0, "the live writer could not finish its write"
    finally:
        live.kill()
    assert song.read_bytes() == b"half a song"  # the live writer renamed last
    with atomic_output(other):
        pass
    assert not list(tmp_path.glob(".*.tmp")), "a temporary was left behind"


# --- the audio process when its parent is killed ---------------------------------------------------------------------

KILLED_WHILE_STARTING = textwrap.dedent(
    """
    import os, signal, threading, time
    from flowjam.live.loop_buffer import LoopBuffer
    from flowjam.live.playback import Playback

    def kill_this_process_once_the_audio_process_runs(playback) -> None:
        while playback._process is None or playback._process.pid is None:
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGKILL)

    if __name__ == "__main__":
        playback = Playback(LoopBuffer(48_000), mode="null-process")
        threading.Thread(target=kill_this_process_once_the_audio_process_runs, args=(playback,), daemon=True).start()
        playback.start()
    """
)


def test_killing_the_engine_while_its_audio_process_starts_prints_no_traceback(tmp_path):
    script = tmp_path / "engine.py"
    script.write_text(KILLED_WHILE_STARTING)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert "Traceback" not in result.stderr, result.stderr  # the audio process wrote to the same stderr, then ended

"""Every start-up and input mistake ends the command with ONE line on stderr (`flowjam <command>: error: ...`), exit
code 2, no traceback and nothing written; outputs are replaced whole or not at all. Run as a user runs it:
`python -m flowjam ...` in a subprocess (tiny preset, CPU), the cases side by side to keep the file quick."""

import argparse
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from flowjam.engine.outputs import atomic_output, check_output_path
from flowjam.live.knobs import KnobRegistry
from flowjam.live.osc import OscBridge, OscConfig, SettingNames
from helpers import free_udp_port
from test_audio_io import BAD_WAVS, raw_wav
from test_checkpoints import bad_safetensors

ROOT_SKIP = "root writes through permission bits" if os.geteuid() == 0 else ""
HAS_CUDA = torch.cuda.is_available()


@dataclass(frozen=True)
class Case:
    command: str
    args: object  # (files) -> list of extra arguments
    expected: str  # part of the one error line
    skip: str = ""  # reason to skip here, if any


CASES = {
    # render: lengths, knobs, text inputs
    "render --seconds inf": Case("render", lambda f: ["--seconds", "inf"], "--seconds must be a finite number > 0"),
    "render --seconds nan": Case("render", lambda f: ["--seconds", "nan"], "--seconds must be a finite number > 0"),
    "render --seconds 0": Case("render", lambda f: ["--seconds", "0"], "--seconds must be a finite number > 0"),
    "render --seconds 1e6": Case("render", lambda f: ["--seconds", "1e6"], "at most 600 s = 10 min"),
    "render --seconds 1e9": Case("render", lambda f: ["--seconds", "1e9"], "use --seconds 600 or less"),
    "render --seconds 1e-9": Case("render", lambda f: ["--seconds", "1e-9"], "shorter than one latent frame"),
    "render --seed 2**64": Case("render", lambda f: ["--seed", str(2**64)], "--seed must be a whole number from 0"),
    "render --seed -1": Case("render", lambda f: ["--seed", "-1"], "--seed must be a whole number from 0"),
    "render --lyrics @folder": Case("render", lambda f: ["--lyrics", f"@{f.tmp}"], "is a folder, not a text file"),
    "render --lyrics @missing": Case("render", lambda f: ["--lyrics", f"@{f.tmp / 'no.txt'}"], "no such file"),
    "render --lyrics @/dev/zero": Case(
        "render", lambda f: ["--lyrics", "@/dev/zero"], "/dev/zero is a character device, not a text file"
    ),
    "render --lyrics @FIFO": Case(  # refused without opening it: opening a FIFO waits for a writer
        "render", lambda f: ["--lyrics", f"@{f.fifo}"], "take.fifo is a FIFO (named pipe), not a text file"
    ),
    "render --lyrics @2 MiB": Case(
        "render", lambda f: ["--lyrics", f"@{f.huge_text}"], "is too large for lyrics (2,097,152 bytes; at most"
    ),
    # render: the caption's metas, refused before the model loads (a broken --checkpoint would be refused after)
    **{
        f"render {' '.join(args)}": Case(
            "render", lambda f, args=args: [*args, "--checkpoint", str(f.weights["truncated"][0])], expected
        )
        for args, expected in [
            (("--bpm", "400"), "--bpm must be a number in 30..300, got 400"),
            (("--bpm", "nan"), "--bpm must be a number in 30..300, got nan"),
            (("--key", "H major"), "--key 'H major' is not a note A-G"),
            (("--time-signature", "4/0"), "--time-signature: time signature '4/0': the lower number is a note value"),
            (("--time-signature", "4/banana"), "time signature '4/banana' is not a number like 4 or '4/4'"),
            (("--time-signature", "5/4"), "numerator must be one of (2, 3, 4, 6)"),
            (("--language", "english"), "--language 'english' is not one of ACE-Step's codes"),
        ]
    },
    "render --lora missing": Case(
        "render", lambda f: ["--lora", f"{f.tmp / 'no_lora.safetensors'}:0.5"], "LoRA not found"
    ),
    "serve --lora missing": Case("serve", lambda f: ["--lora", f"{f.tmp / 'gone.safetensors'}:0.5"], "no such file"),
    "render --lora .pt": Case(
        "render", lambda f: ["--lora", str(f.tmp / "style.pt")], "are read from .safetensors only"
    ),
    **{
        f"{command} --lora {name}": Case(
            command, lambda f, name=name: ["--lora", str(f.weights[name][0])], f"{name}.safetensors {expected}"
        )
        for command in ("render", "serve")
        for name, expected in [
            ("text", "is not a .safetensors file (no valid header); download or export it again"),
            ("truncated", "is truncated (1,000 of 4,000 bytes of tensor data); download or export it again"),
        ]
    },
    "render --lora PATH:abc": Case(
        "render",
        lambda f: ["--lora", f"{f.tmp / 'style.safetensors'}:abc"],
        "style.safetensors:abc: strength 'abc' is not a number; write PATH:0.8",
    ),
    "render --lora PATH:5": Case(
        "render", lambda f: ["--lora", f"{f.tmp / 'style.safetensors'}:5"], "strength 5 is outside 0..2"
    ),
    "render --steps 0": Case("render", lambda f: ["--steps", "0"], "steps must be in 1..200, got 0"),
    "render --shift nan": Case("render", lambda f: ["--shift", "nan"], "shift must be in (0, 100], got nan"),
    "render --precision fp8 on a CPU": Case(
        "render", lambda f: ["--precision", "fp8"], "--precision: precision 'fp8' needs an NVIDIA GPU"
    ),
    # render: where the WAV goes
    "render --out folder": Case("render", lambda f: ["--out", str(f.outs)], "is a folder; give a file path"),
    "render --out missing folder": Case(
        "render", lambda f: ["--out", str(f.outs / "missing" / "x.wav")], "does not exist; create it"
    ),
    "render --out under a file": Case(
        "render", lambda f: ["--out", str(f.plain_file / "x.wav")], "is a file, not a folder"
    ),
    "render --out a FIFO": Case("render", lambda f: ["--out", str(f.fifo)], "is a device, pipe or socket"),
    "render --out read-only file": Case(
        "render", lambda f: ["--out", str(f.read_only_file)], "is read-only", ROOT_SKIP
    ),
    "render --out read-only folder": Case(
        "render",
        lambda f: ["--out", str(f.read_only_folder / "x.wav")],
        "is not writable",
        ROOT_SKIP,
    ),
    # render: device and weights
    "render --device bogus": Case("render", lambda f: ["--device", "bogus"], "unknown --device 'bogus'"),
    "render --device cuda": Case(
        "render", lambda f: ["--device", "cuda"], "use --device cpu", "CUDA is available here" if HAS_CUDA else ""
    ),
    **{
        f"render --checkpoint {name}": Case("render", lambda f, name=name: ["--checkpoint", str(f.weights[name][0])], x)
        for name, x in [
            ("empty", "is empty (0 bytes)"),
            ("text", "is not a .safetensors file"),
            ("truncated", "is truncated (1,000 of 4,000 bytes"),
            ("header only", "is truncated (0 of 4,000 bytes"),
        ]
    },
    **{
        f"render --cover {name}": Case("render", lambda f, name=name: ["--cover", str(f.wavs[name])], expected)
        for name, (_, expected) in BAD_WAVS.items()
        if name not in ("4,294,967,295 Hz", "999 Hz")  # the lines of "0 Hz" and "800 kHz": read_audio's own tests
    },
    "render --cover not audio": Case(
        "render", lambda f: ["--cover", str(f.plain_file)], "is not an audio file we read; give WAV, FLAC, OGG/Vorbis"
    ),
    # bench
    "bench sessions --gpus 0": Case("bench", lambda f: ["sessions", "--gpus", "0"], "--gpus 0: give 1 or more GPUs"),
    "bench sessions --gpus 2 on the CPU": Case("bench", lambda f: ["sessions", "--gpus", "2"], "add --device cuda"),
    "bench kernels on the CPU": Case(
        "bench", lambda f: ["kernels", "--device", "cpu"], "needs a CUDA GPU of compute capability 9.0+ with Triton"
    ),
    **{
        f"bench {' '.join(args)}": Case("bench", lambda f, args=args: list(args), expected)
        for args, expected in [
            (("dit", "--song-seconds", "10", "0"), "--song-seconds must be a finite number > 0 (at most 600 s), got 0"),
            (("dit", "--song-seconds", "nan"), "--song-seconds must be a finite number > 0 (at most 600 s), got nan"),
            (("dit", "--repeats", "0"), "--repeats 0 must be 1 or more"),
            (("tick", "--steps", "0"), "--steps 0 is outside 1..200"),
            (("ring", "--depth", "9"), "--depth 9 is outside 1..8"),
            (("lora", "--ticks", "-1"), "--ticks -1 must be 1 or more"),
            (("soak", "--minutes", "inf"), "--minutes must be a finite number > 0, got inf"),
            (("sync", "--bpm", "500"), "--bpm must be a number in 30..300, got 500"),
            (("sync", "--time-signature", "4/banana"), "is not a number like 4 or '4/4'"),
            (("sync", "--bars", "0"), "--bars 0 must be 1 or more"),
        ]
    },
    # serve, bridge, demo
    "serve --port 70000": Case("serve", lambda f: ["--port", "70000"], "--port 70000 is outside 0..65535"),
    "bridge --osc-port 70000": Case(
        "bridge", lambda f: ["--session", "jam", "--osc-port", "70000"], "--osc-port 70000 is outside 0..65535"
    ),
    "demo --depth 0": Case(
        "demo", lambda f: ["--depth", "0", "--out", str(f.outs / "demo.wav")], "--depth 0 is outside"
    ),
    "demo --seconds nan": Case(
        "demo", lambda f: ["--seconds", "nan", "--out", str(f.outs / "demo.wav")], "--seconds must be a finite number"
    ),
    # live
    "live --song-seconds inf": Case("live", lambda f: ["--song-seconds", "inf"], "--song-seconds must be a finite"),
    "live --song-seconds 1e5": Case("live", lambda f: ["--song-seconds", "1e5"], "use --song-seconds 600 or less"),
    "live --seconds nan": Case("live", lambda f: ["--seconds", "nan"], "--seconds must be a finite number > 0"),
    "live --seconds inf": Case("live", lambda f: ["--seconds", "inf"], "leave it out to play until Ctrl-C"),
    "live --seconds 0": Case("live", lambda f: ["--seconds", "0"], "--seconds must be a finite number > 0"),
    "live --prompt ''": Case("live", lambda f: ["--prompt", ""], "the prompt is empty"),
    "live --plugin --sync jack": Case(
        "live",
        lambda f: ["--plugin", "--sync", "jack"],
        "--plugin plays through the DAW, which is the output and the clock: drop --sync",
    ),
    "live --plugin --session 'a b'": Case(
        "live", lambda f: ["--plugin", "--session", "a b"], "--session: a plugin session name is 1-40 letters"
    ),
    "live --panel-port 9100": Case(
        "live", lambda f: ["--panel-port", "9100"], "--panel-port serves the DAW plugin's panel: give --plugin"
    ),
    "live --plugin --panel-port 70000": Case(
        "live", lambda f: ["--plugin", "--panel-port", "70000"], "--panel-port 70000 is outside 0..65535"
    ),
    "live --bars 2": Case("live", lambda f: ["--bars", "2"], "--bars needs a tempo: give --bpm, or follow a clock"),
    "live --bpm 400": Case("live", lambda f: ["--bpm", "400"], "--bpm must be a number in 30..300, got 400"),
    "live --bpm 120 --bars 0": Case("live", lambda f: ["--bpm", "120", "--bars", "0"], "--bars must be at least 1"),
    "live --time-signature 5": Case(
        "live", lambda f: ["--bpm", "120", "--time-signature", "5"], "numerator must be one of"
    ),
    "live --time-signature 4/0": Case(
        "live", lambda f: ["--bpm", "120", "--time-signature", "4/0"], "the lower number is a note value (2, 4, 8, 16)"
    ),
    "live --bpm 123 --bars 600": Case(
        "live",
        lambda f: ["--bpm", "123", "--bars", "600"],
        "--bars 600 at 123 BPM, 4 beats a bar, is a loop of 1170.73 s, longer than ACE-Step 1.5 generates (at most "
        "600 s); use --bars 307 or less",
    ),
    "live --sync-offset-ms nan": Case(
        "live",
        lambda f: ["--sync", "jack", "--sync-offset-ms", "nan"],
        "--sync-offset-ms nan ms is outside -1000..1000",
    ),
    "live --sync-offset-ms 1e12": Case(
        "live", lambda f: ["--sync", "jack", "--sync-offset-ms", "1e12"], "--sync-offset-ms 1e+12 ms is outside"
    ),
    "live --sync-offset-ms without --sync": Case(
        "live", lambda f: ["--sync-offset-ms", "20"], "--sync-offset-ms moves the loop against a followed clock"
    ),
    "live --click": Case("live", lambda f: ["--click"], "--click needs a tempo"),
    "live --sync midi": Case("live", lambda f: ["--sync", "midi"], "--sync midi reads the clock from --midi-port"),
    "live --bars --endless": Case("live", lambda f: ["--bpm", "120", "--bars", "2", "--endless"], "--endless has none"),
    "live --source-bpm": Case("live", lambda f: ["--source-bpm", "120"], "describe a --source: give one"),
    "live --depth 99": Case("live", lambda f: ["--depth", "99"], "--depth 99 is outside 1..8"),
    "live --depth 0": Case("live", lambda f: ["--depth", "0"], "--depth 0 is outside 1..8"),
    "live --blocksize 0": Case("live", lambda f: ["--blocksize", "0"], "--blocksize must be 32..8192 frames"),
    "live --steps 1000": Case("live", lambda f: ["--steps", "1000"], "--steps 1000 is outside 1..50"),
    "live --source truncated": Case("live", lambda f: ["--source", str(f.wavs["truncated"])], "truncated"),
    "live --audio-device bogus": Case("live", lambda f: ["--audio-device", "bogus"], "cannot open audio output"),
    "live OSC port in use": Case(
        "live", lambda f: ["--osc-port", str(f.busy_port)], "the port is in use by another program"
    ),
    "live --osc-port 70000": Case("live", lambda f: ["--osc-port", "70000"], "--osc-port 70000 is outside 0..65535"),
    "live --window-seconds 2": Case(
        "live", lambda f: ["--window-seconds", "2"], "--window-seconds 2 is outside 4..600 s; use 0 for the whole loop"
    ),
    "live --endless without a window": Case(
        "live", lambda f: ["--endless", "--window-seconds", "0"], "--endless needs a window: give --window-seconds"
    ),
    "live --endless with --source": Case(
        "live", lambda f: ["--endless", "--source", "song.flac"], "--endless is text-only: --source and --lm"
    ),
    "bench tick --endless without a window": Case(
        "bench", lambda f: ["tick", "--endless"], "--endless needs a window: give --window-seconds"
    ),
    "live --osc-host 999.1.1.1": Case(
        "live",
        lambda f: ["--osc-port", str(f.free_port), "--osc-host", "999.1.1.1"],
        "--osc-host '999.1.1.1' is not an IPv4 address (four numbers 0..255); give an address such as 127.0.0.1",
    ),
    "live --osc-host nosuch.invalid": Case(
        "live",
        lambda f: ["--osc-port", str(f.free_port), "--osc-host", "nosuch.invalid"],
        "--osc-host 'nosuch.invalid' does not resolve",
    ),
    "live --osc-feedback nosuch.invalid:9000": Case(
        "live",
        lambda f: ["--osc-port", str(f.free_port), "--osc-feedback", "nosuch.invalid:9000"],
        "--osc-feedback 'nosuch.invalid' does not resolve",
    ),
    "live --osc-feedback with --osc-port 0": Case(
        "live", lambda f: ["--osc-feedback", "127.0.0.1:9111"], "which --osc-port 0 turns off"
    ),
}


def base_arguments(case: Case, extra: list[str], out: Path) -> list[str]:
    """What the case is not about is given safe values: a fresh --out for render; no sound card, no OSC and one
    second of play for live; one host on any free port for serve; bench, bridge and demo as given. Later arguments override earlier ones."""
    if case.command == "render":
        return ["render", "--prompt", "ambient", "--out", str(out), *extra]
    if case.command == "serve":
        return ["serve", "--local", "--port", "0", *extra]
    if case.command in ("bench", "bridge", "demo"):
        return [case.command, *extra]
    audio = [] if "--audio-device" in extra else ["--no-audio"]
    return ["live", *audio, "--osc-port", "0", "--seconds", "1", *extra]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Every bad input, built once: broken WAVs and checkpoints, odd output places, a busy UDP port."""
    tmp = tmp_path_factory.mktemp("cli_errors")
    (tmp / "wavs").mkdir()
    (tmp / "weights").mkdir()
    wavs = {name: raw_wav(tmp / "wavs" / f"{name}.wav", **fields) for name, (fields, _) in BAD_WAVS.items()}
    outs = tmp / "outs"  # every render case writes (or rather must not write) here
    outs.mkdir()
    plain_file = tmp / "plain.txt"
    plain_file.write_text("not a folder")
    read_only_file = tmp / "read-only.wav"
    read_only_file.write_bytes(b"keep me")
    read_only_file.chmod(0o444)
    read_only_folder = tmp / "read-only"
    read_only_folder.mkdir(mode=0o555)
    fifo = tmp / "take.fifo"
    os.mkfifo(fifo)
    huge_text = tmp / "huge.txt"
    with huge_text.open("wb") as handle:
        handle.truncate(2 << 20)
    busy = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    busy.bind(("127.0.0.1", 0))
    yield SimpleNamespace(
        tmp=tmp,
        outs=outs,
        wavs=wavs,
        weights=bad_safetensors(tmp / "weights"),
        plain_file=plain_file,
        read_only_file=read_only_file,
        read_only_folder=read_only_folder,
        fifo=fifo,
        huge_text=huge_text,
        busy_port=busy.getsockname()[1],
        free_port=free_udp_port(),
    )
    busy.close()
    read_only_folder.chmod(0o755)


def run_flowjam(arguments: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flowjam", *arguments], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def outcomes(request, files):
    """The selected cases run side by side (each is mostly a Python start-up): name -> (arguments, result)."""
    selected = [
        item.callspec.params["name"]
        for item in request.session.items
        if getattr(item, "originalname", "") == "test_bad_input_ends_with_one_error_line_and_exit_2"
        and not CASES[item.callspec.params["name"]].skip
    ]
    arguments = {
        name: base_arguments(CASES[name], CASES[name].args(files), files.outs / f"case{i}.wav")
        for i, name in enumerate(selected)
    }
    results = run_forked(list(arguments.values()), files.tmp / "streams")
    return {name: (arguments[name], result) for name, result in zip(arguments, results, strict=True)}


def run_forked(commands: list[list[str]], streams: Path, timeout: float = 120) -> list[subprocess.CompletedProcess]:
    """Each `python -m flowjam ARGS` as a fresh process runs it, forked from one that imported torch and flowjam once
    (tests/cli_forks.py: a start-up each took most of a case's ~5 s), two at a time."""
    streams.mkdir(exist_ok=True)
    jobs = [
        {"argv": argv, "stdout": str(streams / f"{index}.out"), "stderr": str(streams / f"{index}.err")}
        for index, argv in enumerate(commands)
    ]
    forks = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("cli_forks.py")), str(max(2, os.cpu_count() or 1)), str(timeout)],
        input=json.dumps(jobs),
        capture_output=True,
        text=True,
        check=True,
        timeout=timeout * len(jobs),
    )
    codes = json.loads(forks.stdout)
    return [
        subprocess.CompletedProcess(
            ["python", "-m", "flowjam", *job["argv"]],
            -9 if code is None else code,
            Path(job["stdout"]).read_text(errors="replace"),
            Path(job["stderr"]).read_text(errors="replace"),
        )
        for job, code in zip(jobs, codes, strict=True)
    ]


@pytest.mark.parametrize("name", CASES)
def test_bad_input_ends_with_one_error_line_and_exit_2(name, outcomes, files):
    case = CASES[name]
    if case.skip:
        pytest.skip(case.skip)
    arguments, result = outcomes[name]
    shown = f"python -m flowjam {' '.join(arguments)}\nexit {result.returncode}\nstderr:\n{result.stderr}"
    assert "Traceback" not in result.stderr, shown
    lines = result.stderr.splitlines()
    assert len(lines) == 1, f"expected exactly one line on stderr\n{shown}"
    assert lines[0].startswith(f"flowjam {case.command}: error: "), shown
    assert case.expected in lines[0], f"the error should say {case.expected!r}\n{shown}"
    assert result.returncode == 2, shown
    assert not any(files.outs.iterdir()), f"a refused command left {list(files.outs.iterdir())}"
    assert files.read_only_file.read_bytes() == b"keep me"


# ---- outputs: checked before any work, replaced whole or not at all --------------------------------------------


def test_osc_port_in_use_names_the_address_and_the_setting_the_caller_calls_it():
    """A node gets the setting by its own name (no CLI flag in a ComfyUI dialog); the CLI passes its flags."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as busy:
        busy.bind(("127.0.0.1", 0))
        port = busy.getsockname()[1]
        errors = {}
        for names in (SettingNames(), SettingNames(port="--osc-port"), SettingNames(port="input 'port'")):
            with pytest.raises(OSError) as error:
                OscBridge(KnobRegistry(), OscConfig(port=port, names=names)).start()
            assert error.value.errno == errno.EADDRINUSE
            errors[names.port] = str(error.value)
    for setting, message in errors.items():
        assert f"cannot listen for OSC on 127.0.0.1:{port}: the port is in use" in message, message
        assert message.endswith(f"; choose another {setting}"), message
    assert "--" not in errors["OSC port"], errors


def test_a_bad_osc_host_names_the_setting_and_the_fix():
    names = SettingNames(host="input 'host'", feedback="input 'feedback'")
    for config, expected in [
        (OscConfig(host="999.1.1.1", port=0, names=names), "input 'host' '999.1.1.1' is not an IPv4 address"),
        (OscConfig(host="nosuch.invalid", port=0), "OSC host 'nosuch.invalid' does not resolve"),
        (OscConfig(port=0, feedback=("nosuch.invalid", 9000), names=names), "input 'feedback' 'nosuch.invalid'"),
    ]:
        with pytest.raises(ValueError) as error:
            OscBridge(KnobRegistry(), config).start()
        message = str(error.value)
        assert expected in message and message.endswith("a name this machine can look up"), message
        assert "\n" not in message


def test_render_to_a_fifo_is_refused_and_leaves_it_a_fifo(files):
    result = run_flowjam(["render", "--prompt", "ambient", "--seconds", "1", "--out", str(files.fifo)])
    assert result.returncode == 2 and "is a device, pipe or socket" in result.stderr, result.stderr
    assert files.fifo.is_fifo(), "the FIFO was replaced by a regular file"


def test_output_path_is_checked_before_any_work(tmp_path):
    assert check_output_path(tmp_path / "x.wav", "--out") == tmp_path / "x.wav"
    with pytest.raises(ValueError, match="is a folder"):
        check_output_path(tmp_path, "--out")
    with pytest.raises(ValueError, match=r"the folder .*missing does not exist"):
        check_output_path(tmp_path / "missing" / "x.wav", "--out")
    with pytest.raises(ValueError, match="is a device, pipe or socket"):
        check_output_path("/dev/null", "--out")
    assert Path("/dev/null").is_char_device()


def test_an_error_inside_an_atomic_write_keeps_the_previous_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "take.wav"
    path.write_bytes(b"previous take")
    with pytest.raises(RuntimeError, match="disk on fire"):
        with atomic_output(path) as temporary:
            temporary.write_bytes(b"half of the new ")
            raise RuntimeError("disk on fire")
    assert path.read_bytes() == b"previous take"
    assert [p.name for p in tmp_path.iterdir()] == ["take.wav"], "the temporary file was not removed"
    with atomic_output(path) as temporary:
        temporary.write_bytes(b"new take")
    assert path.read_bytes() == b"new take"
    assert [p.name for p in tmp_path.iterdir()] == ["take.wav"]


def test_sigkill_in_the_middle_of_a_write_keeps_the_previous_file(tmp_path):
    path = tmp_path / "take.wav"
    path.write_bytes(b"previous take")
    script = (
        "import os, signal, sys\n"
        "from flowjam.engine.outputs import atomic_output\n"
        "with atomic_output(sys.argv[1]) as temporary:\n"
        "    with open(temporary, 'wb') as handle:\n"
        "        handle.write(b'half of the new take'); handle.flush()\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    result = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, timeout=60)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert path.read_bytes() == b"previous take"
    leftovers = [p.name for p in tmp_path.iterdir() if p != path]
    assert all(name.startswith(".take.wav.") and name.endswith(".tmp") for name in leftovers), leftovers


def test_render_killed_while_it_runs_keeps_the_previous_out_file(tmp_path):
    out = tmp_path / "song.wav"
    out.write_bytes(b"previous song")
    process = subprocess.Popen(
        [sys.executable, "-m", "flowjam", "render", "--prompt", "ambient", "--seconds", "60", "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    seen = bytearray()
    started = threading.Event()

    def watch() -> None:  # the progress bar has no newlines: read byte by byte
        while chunk := process.stderr.read(1):
            seen.extend(chunk)
            if b"denoise" in seen:
                started.set()

    threading.Thread(target=watch, daemon=True).start()
    try:
        assert started.wait(90), f"render did not start denoising: {bytes(seen)!r}"
        time.sleep(0.2)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(30)
    assert out.read_bytes() == b"previous song", "a killed render must not touch the previous file"
    assert [p.name for p in tmp_path.iterdir()] == ["song.wav"]


# ---- Ctrl-C, missing tools, the flags' one meaning ---------------------------------------------------------------


@pytest.mark.parametrize(
    "command, marker",
    [
        (["render", "--prompt", "ambient", "--seconds", "120"], b"denoise"),  # the progress bar (stderr)
        (["demo", "--seconds", "120"], b"tick "),  # a tick line (stdout)
    ],
)
def test_ctrl_c_mid_work_ends_with_one_line_exit_130_and_no_file(command, marker, tmp_path):
    out = tmp_path / "take.wav"
    process = subprocess.Popen(
        [sys.executable, "-m", "flowjam", *command, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    seen = {"stdout": bytearray(), "stderr": bytearray()}
    started = threading.Event()

    def watch(name: str) -> None:  # the progress bar has no newlines: read byte by byte
        stream = getattr(process, name)
        while chunk := stream.read(1):
            seen[name].extend(chunk)
            if marker in seen[name]:
                started.set()

    watchers = [threading.Thread(target=watch, args=(name,), daemon=True) for name in seen]
    for watcher in watchers:
        watcher.start()
    try:
        assert started.wait(90), f"{command[0]} did not start working: {bytes(seen['stderr'])!r}"
        process.send_signal(signal.SIGINT)
        code = process.wait(30)
    finally:
        if process.poll() is None:
            process.kill()
    for watcher in watchers:
        watcher.join(10)
    stderr = bytes(seen["stderr"]).decode()
    assert "Traceback" not in stderr, stderr
    assert code == 130, f"exit {code}\n{stderr}"
    assert stderr.splitlines()[-1] == f"flowjam {command[0]}: stopped by Ctrl-C; nothing was written", stderr
    assert not stderr.splitlines()[-1].startswith("denoise"), "the message should start a line of its own"
    assert not out.exists() and list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())


def test_bench_sync_without_jack_installed_says_what_to_install_before_loading(tmp_path):
    """PATH holds no jackd (nor jack_wait): one line naming both and the package, exit 2, before the model loads
    (a broken --checkpoint would be refused after)."""
    broken = tmp_path / "broken.safetensors"
    broken.write_bytes(b"model weights go here\n")
    result = subprocess.run(
        [sys.executable, "-m", "flowjam", "bench", "sync", "--minutes", "0.1", "--checkpoint", str(broken)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PATH": str(tmp_path)},
    )
    shown = f"exit {result.returncode}\nstderr:\n{result.stderr}"
    assert "Traceback" not in result.stderr, shown
    assert result.stderr.splitlines() == [
        "flowjam bench: error: bench sync runs a JACK server of its own: jackd and jack_wait not found on PATH; "
        "install JACK (Debian: apt install jackd2)"
    ], shown
    assert result.returncode == 2, shown


def command_helps(parser: argparse.ArgumentParser, names: tuple[str, ...]) -> dict[str, str]:
    """flag dest -> help of the (sub)command `names`, e.g. ("bench", "sync")."""
    for name in names:
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = commands.choices[name]
    return {action.dest: action.help for action in parser._actions}


def test_a_flag_is_one_type_in_every_command_and_its_help_states_the_range():
    from flowjam.__main__ import build_parser

    parser = build_parser()
    for command in (["render", "--prompt", "x"], ["live"], ["bench", "sync"]):
        args = parser.parse_args([*command, "--bpm", "120.5", "--time-signature", "6/8"])
        assert args.bpm == 120.5 and args.time_signature == "6/8", (command, args)
        assert "30..300" in command_helps(parser, tuple(command[:2]) if command[0] == "bench" else (command[0],))["bpm"]
    steps = {names: command_helps(parser, names)["steps"] for names in [("render",), ("bench", "tick"), ("live",)]}
    assert "1..200" in steps[("render",)] and "1..200" in steps[("bench", "tick")], steps
    assert "1..50, the steps knob's range" in steps[("live",)], steps

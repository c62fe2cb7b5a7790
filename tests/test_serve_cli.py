"""The served instrument as a user runs it, every part its own process: `flowjam serve --local`, a session created
over HTTP, `flowjam bridge` turning real OSC datagrams into knob changes on it, `flowjam listen` recording it, and
Ctrl-C stopping the server cleanly."""

import re
import signal
import subprocess
import sys
import time
import wave

import pytest
from flowjam.serve.client import Client
from helpers import free_udp_port
from pythonosc.udp_client import SimpleUDPClient

START_S = 60.0


def flowjam(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "flowjam", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


@pytest.fixture
def served():
    server = flowjam("serve", "--local", "--port", "0")
    try:
        deadline = time.monotonic() + START_S
        url = None
        while url is None:
            assert time.monotonic() < deadline and server.poll() is None, "flowjam serve did not start"
            found = re.search(r"serving \S+ on (http://\S+)", server.stdout.readline())
            url = found.group(1) if found else None
        client = Client(url, timeout_s=20.0)
        while not client.health():
            time.sleep(0.05)
        yield server, client
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)


def test_a_controller_and_a_listener_play_a_served_session_and_ctrl_c_stops_the_server(served, tmp_path):
    server, client = served
    name = client.create("lofi hip hop, mellow piano", seconds=4.0, knobs={"depth": 2}, name="laptop")["session"]
    token_file = tmp_path / "laptop.token"  # what a user does with the token creating the session returned
    token_file.write_text(client.tokens[name] + "\n")
    where = ("--server", client.server, "--session", name, "--token-file", str(token_file))
    osc_port = free_udp_port()
    bridge = flowjam("bridge", *where, "--osc-port", str(osc_port), "--seconds", "8")
    out = tmp_path / "heard.wav"
    listen = flowjam("listen", *where, "--no-audio", "--out", str(out), "--seconds", "1")
    try:
        controller = SimpleUDPClient("127.0.0.1", osc_port)
        deadline = time.monotonic() + 20
        while client.status(name)["knobs"]["velocity_scale"] != pytest.approx(1.4):
            assert time.monotonic() < deadline, "the OSC message never reached the served session"
            controller.send_message(f"/flowjam/{name}/knob/velocity_scale", 1.4)
            time.sleep(0.2)
        listened, _ = listen.communicate(timeout=30)
        assert listen.returncode == 0, listened
        with wave.open(str(out)) as recorded:
            assert (recorded.getnframes(), recorded.getnchannels(), recorded.getframerate()) == (48_000, 2, 48_000)
        bridged, _ = bridge.communicate(timeout=30)
        assert bridge.returncode == 0, bridged
        assert re.search(r"forwarded [1-9]\d* requests", bridged), bridged
        assert client.tokens[name] not in bridged + listened, "a process printed the session's token"
    finally:
        for process in (bridge, listen):
            if process.poll() is None:
                process.kill()
    server.send_signal(signal.SIGINT)
    output, _ = server.communicate(timeout=20)
    assert server.returncode == 0, output
    assert "Traceback" not in output, output

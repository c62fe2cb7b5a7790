"""OSC bridge against real peers: liblo's oscsend/oscdump and python-osc clients over loopback UDP."""

import json
import logging
import math
import queue
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
from flowjam.live.knobs import KnobRegistry
from flowjam.live.osc import ECHO_HOLD_S, OscBridge, OscConfig
from flowjam.live.osc_wire import encode
from helpers import free_udp_port, wait_for
from pythonosc.osc_bundle_builder import IMMEDIATELY, OscBundleBuilder
from pythonosc.osc_message import OscMessage
from pythonosc.osc_message_builder import OscMessageBuilder
from pythonosc.udp_client import SimpleUDPClient

KNOB = "/flowjam/default/knob/"
NORM = "/flowjam/default/norm/"


def float32(value: float) -> float:
    return struct.unpack(">f", struct.pack(">f", value))[0]


def require(tool: str) -> None:
    if shutil.which(tool) is None:
        print(f"\nSKIPPED: {tool} not installed (Debian liblo-tools); .ci/run installs it", file=sys.stderr)
        pytest.skip(f"{tool} (Debian liblo-tools) is not installed")


def received(client_or_socket, quiet_s=0.3) -> list[tuple[float, str, list]]:
    """(arrival perf_counter, address, args) of every datagram until the socket has been quiet for quiet_s."""
    sock = getattr(client_or_socket, "_sock", client_or_socket)
    sock.settimeout(quiet_s)
    messages = []
    while True:
        try:
            message = OscMessage(sock.recv(65536))
        except TimeoutError:
            return messages
        messages.append((time.perf_counter(), message.address, message.params))


def read_lines(stream, lines: queue.Queue):
    for line in stream:
        lines.put(line)


def drain_oscdump(lines: queue.Queue, printed: list[list[str]], wait_s=0.2):
    """Append oscdump's lines as tokens, without its leading timetag: ['/address', 'f', '1.500000']."""
    try:
        while True:
            tokens = lines.get(timeout=wait_s).split()
            printed.append(tokens[1:] if tokens and not tokens[0].startswith("/") else tokens)
    except queue.Empty:
        pass


def args_printed(printed, address):
    return [tokens[1:] for tokens in printed if tokens and tokens[0] == address]


@pytest.fixture
def registry():
    return KnobRegistry()


@pytest.fixture
def make_bridge(registry):
    bridges = []

    def make(**config):
        hooks = {key: config.pop(key) for key in ("on_prompt", "on_transport", "status") if key in config}
        bridge = OscBridge(registry, OscConfig(port=0, **config), **hooks)
        bridge.start()
        bridges.append(bridge)
        return bridge

    yield make
    for bridge in bridges:
        bridge.stop()


@pytest.fixture
def controller():
    """A python-osc client for a bridge. listening=True binds it first, like a controller that listens on the port
    it sends from; otherwise it sends from a throwaway port, like oscsend."""
    clients = []

    def make(bridge, listening=True) -> SimpleUDPClient:
        client = SimpleUDPClient(*bridge.address, timeout=2.0)
        clients.append(client)
        if listening:
            client._sock.bind(("127.0.0.1", 0))
        return client

    yield make
    for client in clients:
        client.close()


def test_liblo_oscsend_sets_a_knob(registry, make_bridge):
    require("oscsend")
    bridge = make_bridge()
    subprocess.run(
        ["oscsend", "localhost", str(bridge.address[1]), KNOB + "velocity_scale", "f", "1.5"], check=True, timeout=5
    )
    wait_for(lambda: registry.get("velocity_scale") == 1.5, 3, "oscsend's velocity_scale 1.5 to apply")
    change = registry.changes_since(0)[-1]
    assert change.origin == "osc" and change.sent_at is not None and change.sent_at <= change.received_at


def test_python_client_plays_knobs_prompts_transport_and_reads_status(registry, make_bridge, controller):
    prompts, transport = [], []
    bridge = make_bridge(
        on_prompt=lambda slot, text: prompts.append((slot, text)),
        on_transport=transport.append,
        status=lambda: {"playing": bool(transport), "prompts": prompts},
    )
    client = controller(bridge)
    client.send_message(KNOB + "velocity_scale", 1.5)
    client.send_message(NORM + "guidance", 0.5)
    client.send_message(KNOB + "steps", 12)
    client.send_message("/flowjam/default/prompt", "dub techno")
    client.send_message("/flowjam/default/prompt/b", "ambient choir")
    client.send_message("/flowjam/default/transport", "play")
    client.send_message(KNOB + "steps", None)  # no argument: a query
    client.send_message(NORM + "guidance", None)
    client.send_message("/flowjam/default/status", None)
    replies = {address: args for _, address, args in received(client)}
    assert registry.get("velocity_scale") == 1.5 and registry.get("guidance") == 5.5 and registry.get("steps") == 12
    assert prompts == [("a", "dub techno"), ("b", "ambient choir")] and transport == ["play"]
    assert replies.get(KNOB + "steps") == [12.0], f"query reply missing or wrong: {replies}"
    assert replies.get(NORM + "guidance") == [0.5], f"norm query reply missing or wrong: {replies}"
    status = json.loads(replies["/flowjam/default/status"][0])
    assert status == {"playing": True, "prompts": [["a", "dub techno"], ["b", "ambient choir"]]}
    stats = bridge.stats()
    assert stats["applied"] == 9 and stats["rejected"] == {}, stats


def test_status_without_a_status_callback_reports_the_knobs(registry, make_bridge, controller):
    client = controller(make_bridge())
    registry.set("depth", 6)
    client.send_message("/flowjam/default/status", 1.0)  # a push button's press: arguments are ignored
    replies = [args for _, address, args in received(client) if address == "/flowjam/default/status"]
    assert len(replies) == 1, f"expected one status reply, got {replies}"
    status = json.loads(replies[0][0])
    assert status["session"] == "default" and status["knobs"] == registry.values()


def test_feedback_reaches_a_liblo_oscdump_listener(registry, make_bridge, controller):
    require("oscdump")
    port = free_udp_port()
    lines, printed = queue.Queue(), []
    with subprocess.Popen(
        ["oscdump", "-L", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as dump:
        reader = threading.Thread(target=read_lines, args=(dump.stdout, lines), daemon=True)
        reader.start()
        try:
            bridge = make_bridge(feedback=("localhost", port))
            deadline = time.monotonic() + 5
            while not args_printed(printed, KNOB + "velocity_scale"):  # oscdump needs a moment to bind its port
                assert time.monotonic() < deadline, f"oscdump printed no velocity_scale feedback, only {printed}"
                registry.set("velocity_scale", 1.5)
                drain_oscdump(lines, printed)
            controller(bridge, listening=False).send_message(NORM + "volume", 0.25)  # an OSC change, another port
            deadline = time.monotonic() + 3
            while not args_printed(printed, NORM + "volume"):
                assert time.monotonic() < deadline, f"oscdump printed no volume feedback, only {printed}"
                drain_oscdump(lines, printed)
        finally:
            dump.terminate()
            dump.wait(timeout=5)
            reader.join(timeout=5)
    assert args_printed(printed, KNOB + "velocity_scale")[0] == ["f", "1.500000"], printed
    assert args_printed(printed, NORM + "velocity_scale")[0] == ["f", "0.750000"], printed
    assert args_printed(printed, KNOB + "volume")[0] == ["f", "0.250000"], printed


def test_no_echo_to_the_address_moving_a_knob_until_it_rests(registry, make_bridge, controller):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as feedback:
        feedback.bind(("127.0.0.1", 0))
        bridge = make_bridge(feedback=feedback.getsockname())
        client = controller(bridge)
        for step in range(10):  # a hand on a fader for ~200 ms
            client.send_message(NORM + "guidance", step / 10)
            time.sleep(0.02)
        client.send_message(NORM + "guidance", 3.0)  # past the end: clamped to 1.0
        last_sent = time.perf_counter()
        to_mover = [(at, args) for at, address, args in received(client, 0.5) if address == NORM + "guidance"]
        to_display = [args for _, address, args in received(feedback, 0.1) if address == KNOB + "guidance"]
        assert len(to_mover) == 1, f"the moving controller must get exactly one value once it rests, got {to_mover}"
        at, args = to_mover[0]
        assert args == [1.0] and at - last_sent >= ECHO_HOLD_S * 0.9, f"echo after {at - last_sent:.3f} s: {args}"
        assert len(to_display) >= 2 and to_display[-1] == [10.0], f"the feedback port must follow: {to_display}"
        registry.set("volume", 0.3, origin="midi")  # someone else's change reaches the resting controller at once
        echoed = {address: args for _, address, args in received(client)}
        assert echoed.get(KNOB + "volume") == [float32(0.3)] and echoed.get(NORM + "volume") == [float32(0.3)], echoed


def test_bundles_apply_now_or_at_their_timetag_without_blocking_the_receiver(registry, make_bridge, controller):
    bridge = make_bridge()
    client = controller(bridge)
    now_bundle = OscBundleBuilder(IMMEDIATELY)
    for name, value in (("volume", 0.5), ("guidance", 3.0)):
        message = OscMessageBuilder(KNOB + name)
        message.add_arg(value)
        now_bundle.add_content(message.build())
    client.send(now_bundle.build())
    wait_for(lambda: registry.get("volume") == 0.5 and registry.get("guidance") == 3.0, 3, "immediate bundle")

    applied_at = {}
    registry.subscribe(lambda change: applied_at.setdefault(change.name, change.received_at))
    later = OscBundleBuilder(time.time() + 0.2)
    message = OscMessageBuilder(KNOB + "shift")
    message.add_arg(5.0)
    later.add_content(message.build())
    sent_at = time.perf_counter()
    client.send(later.build())
    client.send_message(KNOB + "denoise", 0.25)  # must not wait behind the timetagged bundle
    wait_for(lambda: "shift" in applied_at, 3, "the bundle timetagged 200 ms ahead")
    delay_s = applied_at["shift"] - sent_at
    assert applied_at["denoise"] - sent_at < 0.1, "a plain message waited behind a future bundle"
    assert 0.19 <= delay_s < 0.5, f"bundle timetagged 200 ms ahead applied after {delay_s * 1000:.0f} ms"
    assert registry.get("shift") == 5.0 and bridge.stats()["scheduled"] == 1


def test_bad_input_is_counted_logged_once_and_the_bridge_keeps_serving(registry, make_bridge, controller, caplog):
    bridge = make_bridge()
    client = controller(bridge)
    far = OscBundleBuilder(time.time() + 3600)
    far.add_content(OscMessageBuilder(KNOB + "volume").build())  # a sender whose clock is an hour off
    bad = [
        (KNOB + "velocity_scale", "loud"),  # string for a knob
        (KNOB + "velocity", 1.0),  # unknown knob
        (KNOB + "guidance", math.nan),
        (KNOB + "guidance", [1.0, 2.0]),  # two arguments
        ("/flowjam/default/volume", 1.0),  # unknown address
        ("/flowjam/other/knob/volume", 1.0),  # another session
        ("/flowjam/default/transport", "dance"),
        ("/flowjam/default/prompt", 3.0),
    ]
    garbage = [b"\x00\x01garbage", b"/flowjam/default/knob/volume", b"#bundle\x00\x01", far.build().dgram]
    with caplog.at_level(logging.WARNING, logger="flowjam.osc"):
        for _ in range(2):
            for address, value in bad:
                client.send_message(address, value)
            for datagram in garbage:
                client._sock.sendto(datagram, bridge.address)
            client.send_message(KNOB + "guidance", 1e9)  # out of range: clamped, applied, counted
        sent = 2 * (len(bad) + len(garbage) + 1)
        stats = wait_until_received(bridge, sent)
    assert stats["received"] == sent, f"{sent - stats['received']} of {sent} datagrams not received"
    assert registry.get("guidance") == 10.0 and stats["clamped"] == 2
    assert stats["rejected"] == {
        "not_a_number": 2,
        "unknown_knob": 2,
        "not_finite": 2,
        "wrong_arguments": 4,
        "unknown_address": 4,
        "unknown_transport": 2,
        "malformed": 6,
        "timetag_too_far": 2,
    }, stats["rejected"]
    logged = [record.getMessage() for record in caplog.records if "logged once" in record.getMessage()]
    reasons = [message.rsplit("[", 1)[1].split(":")[0] for message in logged]
    assert sorted(reasons) == sorted(set(stats["rejected"]) | {"clamped"}), f"each reason once: {reasons}"
    assert caplog.text.count("valid knobs: velocity_scale, ode_noise") == 1, "the unknown-knob log must list them"
    client.send_message(KNOB + "volume", 0.5)
    wait_for(lambda: registry.get("volume") == 0.5, 3, "the bridge to keep serving after bad input")


def wait_until_received(bridge: OscBridge, sent: int) -> dict:
    """The bridge's stats once it has read `sent` datagrams, or once 0.5 s passed without it reading more."""
    counts = []
    while not counts or counts[-1] < sent and counts[-20:] != counts[-1:] * 20:
        time.sleep(0.025)
        counts.append(bridge.stats()["received"])
    return bridge.stats()


def test_a_flood_of_50k_fader_moves_leaves_the_knob_at_the_last_value_sent(registry, make_bridge):
    """50,000 values for one knob, sent as fast as a socket takes them: none is lost (the receive buffer holds what
    the receiver cannot drain at once), the knob ends at the last value sent, and values a newer one replaced before
    they were applied are counted, not silently gone."""
    bridge = make_bridge()
    values = [i / 100_000 for i in range(1, 50_001)]  # rising: an older value applied last would show
    datagrams = [encode(KNOB + "volume", value) for value in values]
    started = time.monotonic()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
        for datagram in datagrams:
            sender.sendto(datagram, bridge.address)
    stats = wait_until_received(bridge, len(datagrams))
    assert stats["received"] == len(datagrams), (
        f"{len(datagrams) - stats['received']} of {len(datagrams)} datagrams lost "
        f"(receive buffer {stats['receive_buffer_bytes']} bytes)"
    )
    assert registry.get("volume") == 0.5, f"the knob stayed at {registry.get('volume')}, not the last value 0.5 sent"
    stats = bridge.stats()
    assert stats["applied"] + stats["coalesced"] == len(datagrams) and stats["rejected"] == {}, stats
    assert time.monotonic() - started < 10, f"the flood took {time.monotonic() - started:.1f} s"


def test_a_raising_handler_is_counted_and_the_bridge_keeps_serving(registry, make_bridge, controller):
    def broken(command):
        raise RuntimeError("engine not loaded")

    bridge = make_bridge(on_transport=broken)
    client = controller(bridge)
    client.send_message("/flowjam/default/transport", "play")
    client.send_message(KNOB + "volume", 0.1)
    wait_for(lambda: registry.get("volume") == float32(0.1), 3, "a knob after a failing handler")
    assert bridge.stats()["rejected"] == {"handler_error": 1}
    assert "engine not loaded" in bridge.stats()["last_error"]


def test_allow_hosts_drops_other_senders(registry, make_bridge, controller):
    closed = make_bridge(allow_hosts=("192.0.2.1",))  # TEST-NET: never us
    opened = make_bridge(allow_hosts=("localhost",))
    for bridge in (closed, opened):
        controller(bridge, listening=False).send_message(KNOB + "ode_noise", 0.5)
    wait_for(lambda: registry.get("ode_noise") == 0.5, 3, "the allowed sender")
    wait_for(lambda: closed.stats()["received"] == 1, 3, "the dropped datagram to arrive")
    assert closed.stats()["dropped_hosts"] == 1 and closed.stats()["applied"] == 0, closed.stats()
    assert opened.stats()["dropped_hosts"] == 0 and opened.stats()["applied"] == 1, opened.stats()


def test_stop_is_idempotent_and_frees_the_port(registry, controller):
    bridge = OscBridge(registry, OscConfig(port=0))
    bridge.stop()  # before start: nothing to do
    bridge.start()
    port = bridge.address[1]
    bridge.stop()
    bridge.stop()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("flowjam-osc")], "threads left running"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rebind:
        rebind.bind(("127.0.0.1", port))
    again = OscBridge(registry, OscConfig(port=port))
    again.start()
    try:
        controller(again, listening=False).send_message(KNOB + "volume", 0.6)
        wait_for(lambda: registry.get("volume") == float32(0.6), 3, "a bridge re-bound to the freed port")
    finally:
        again.stop()


def test_a_flood_of_malformed_bundles_is_counted_and_logged_once(caplog):
    """1,000 bundles whose element is neither a message nor a bundle: all counted as malformed, one log line from the
    bridge, none from python-osc (which warns through the root logger for each element it cannot identify)."""
    registry = KnobRegistry()
    bad_bundle = b"#bundle\x00" + b"\x00" * 8 + b"\x00\x00\x00\x04junk"
    with OscBridge(registry, OscConfig(port=0)) as bridge, caplog.at_level(logging.WARNING):
        sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for _ in range(1000):
            sender.sendto(bad_bundle, bridge.address)
        deadline = time.monotonic() + 10
        while bridge.stats()["received"] < 1000 and time.monotonic() < deadline:
            time.sleep(0.01)
        sender.close()
    assert bridge.stats()["received"] == 1000 and bridge.stats()["rejected"] == {"malformed": 1000}
    assert [r for r in caplog.records if "pythonosc" in r.pathname] == [], "python-osc logged a bad bundle"
    assert sum("malformed" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("depth", [0, 1, 2, 3])
def test_a_message_cut_short_is_rejected_not_read_as_zero(registry, make_bridge, controller, depth):
    """python-osc reads `knob/velocity_scale ,f` with no argument bytes as 0.0; the bridge refuses it, alone or in
    bundles nested `depth` deep, and keeps the knob where it was."""
    bridge = make_bridge()
    client = controller(bridge)
    client.send_message(KNOB + "velocity_scale", 1.25)
    wait_for(lambda: registry.get("velocity_scale") == 1.25, 3, "the knob's first value")
    whole = OscMessageBuilder(KNOB + "velocity_scale")
    whole.add_arg(0.5, OscMessageBuilder.ARG_TYPE_FLOAT)
    cut = whole.build().dgram[:-4]
    for _ in range(depth):
        cut = b"#bundle\x00" + b"\x00" * 7 + b"\x01" + len(cut).to_bytes(4, "big") + cut
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
        sender.sendto(cut, bridge.address)
    wait_for(lambda: bridge.stats()["received"] == 2, 3, "the cut message to arrive")
    assert bridge.stats()["rejected"] == {"malformed": 1}, bridge.stats()
    assert registry.get("velocity_scale") == 1.25, "a message cut short moved the knob"
    client.send_message(KNOB + "velocity_scale", 0.5)
    wait_for(lambda: registry.get("velocity_scale") == 0.5, 3, "a whole message after the cut ones")


def test_the_last_message_shown_cuts_a_long_argument(registry, make_bridge, controller):
    """A refused 60,000-character prompt is shown (stats' last_message, the live status line's `last`) as its first
    40 characters and an ellipsis, not in full."""
    bridge = make_bridge(on_prompt=lambda slot, text: None)
    client = controller(bridge, listening=False)
    client.send_message("/flowjam/default/prompt", "x" * 60_000)
    wait_for(lambda: bridge.stats()["rejected"].get("prompt_too_long"), 3, "the long prompt to be refused")
    last = bridge.stats()["last_message"]
    assert last.startswith("/flowjam/default/prompt 'xxxx") and "…" in last, last
    assert len(last) < 120, f"the last message shown is {len(last)} characters long"
    assert len(bridge.stats()["last_error"]) < 200, bridge.stats()["last_error"]


def test_live_survives_the_negative_size_bundle_and_ctrl_c_finishes_the_take(tmp_path):
    """The issue's datagram (a bundle element of size -8) sent to a running `flowjam live`: OSC still answers, a refused
    60,000-character prompt leaves a short status line, and Ctrl-C ends the run within 5 s with the take a whole WAV."""
    import signal

    import soundfile

    osc_port, record = free_udp_port(), tmp_path / "take.wav"
    command = [sys.executable, "-m", "flowjam", "live", "--preset", "tiny", "--prompt", "x", "--song-seconds", "8"]
    command += ["--no-audio", "--osc-port", str(osc_port), "--record", str(record)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=read_lines, args=(process.stderr, lines), daemon=True).start()
    controller = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    controller.bind(("127.0.0.1", 0))
    controller.settimeout(0.2)

    def answers(value: float, timeout_s: float) -> bool:
        """Whether the knob's feedback comes back with `value` after it is sent (again each 0.5 s)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            controller.sendto(encode(KNOB + "velocity_scale", value), ("127.0.0.1", osc_port))
            until = time.monotonic() + 0.5
            while time.monotonic() < until:
                try:
                    reply = OscMessage(controller.recv(65536))
                except TimeoutError:
                    continue
                if reply.address == KNOB + "velocity_scale" and reply.params == [float32(value)]:
                    return True
        return False

    try:
        assert answers(1.5, 120), "live never answered OSC (start-up on a loaded machine?)"
        controller.sendto(b"#bundle\0" + bytes(8) + struct.pack(">i", -8) + b"/x\0\0", ("127.0.0.1", osc_port))
        assert answers(0.75, 10), "OSC stopped answering after the negative-size bundle"
        controller.sendto(encode("/flowjam/default/prompt", "y" * 60_000), ("127.0.0.1", osc_port))
        status, shown = "", "last /flowjam/default/prompt 'yyy"
        deadline = time.monotonic() + 20
        while shown not in status and time.monotonic() < deadline:
            try:
                status = lines.get(timeout=1)
            except queue.Empty:
                pass
        assert shown in status, f"no status line showed the long prompt: {status!r}"
        assert len(status) < 600, f"a {len(status)}-character status line"
        process.send_signal(signal.SIGINT)
        stopped_at = time.monotonic()
        process.wait(timeout=30)
        stop_s = time.monotonic() - stopped_at
    finally:
        process.kill()
        controller.close()
    assert stop_s < 5, f"Ctrl-C took {stop_s:.1f} s to end the run"
    assert process.returncode == 0, "".join(lines.queue)
    assert not record.with_name("take.wav.partial").exists(), "the take was left unfinished"
    info = soundfile.info(record)
    assert info.samplerate == 48_000 and info.frames > 0, info

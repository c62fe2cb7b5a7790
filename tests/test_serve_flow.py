"""Flow control over a real server: a client that acknowledges what it takes never has more than ACK_WINDOW_FRAMES
of audio waiting anywhere between the host and itself (here the kernel's buffers are left large and the host's
queue long, so only the acknowledgements can bound it); one that never acknowledges is sent everything."""

import json
import threading
import time

import pytest
import uvicorn
from flowjam.serve.client import Client
from flowjam.serve.gateway import LocalRouter, listening_socket, make_app
from flowjam.serve.host import BLOCK_FRAMES, HostOptions
from flowjam.serve.protocol import ACK_WINDOW_FRAMES, SAMPLE_RATE, decode_chunk
from helpers import wait_for
from stall_probe import stall_and_drain
from websockets.sync.client import connect

STALL_S = 4.0


@pytest.fixture(scope="module")
def server():
    host = HostOptions(preset="tiny").build()
    router = LocalRouter(host, subscriber_chunks=400)  # 20 s: the host's queue never bounds the backlog here
    sock = listening_socket("127.0.0.1", 0, send_buffer_bytes=8 * 2**20)  # nor the kernel's
    app_server = uvicorn.Server(uvicorn.Config(make_app(router), log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=app_server.run, args=([sock],), daemon=True)
    thread.start()
    wait_for(lambda: app_server.started, 10, "uvicorn to start")
    client = Client(f"http://127.0.0.1:{sock.getsockname()[1]}", timeout_s=20.0)
    name = client.create("flow", seconds=4.0, knobs={"depth": 2})["session"]
    yield client, name
    client.end(name)
    app_server.should_exit = True
    thread.join(10.0)
    router.close()
    host.close()


def test_a_stalled_client_that_acknowledges_has_at_most_the_window_waiting(server):
    client, name = server
    stall = stall_and_drain(client, name, STALL_S)
    window_s = ACK_WINDOW_FRAMES / SAMPLE_RATE
    assert stall.waited_s <= window_s + 0.25, f"{stall.waited_s:.2f} s waited; the window is {window_s:g} s"
    assert stall.skipped_chunks >= (STALL_S - window_s) * SAMPLE_RATE / BLOCK_FRAMES - 8, "too little was dropped"
    assert stall.counted_dropped == stall.skipped_chunks, "the headers do not count the dropped chunks"


def test_a_client_that_never_acknowledges_is_sent_everything(server):
    client, name = server
    url = client.server.replace("http://", "ws://") + f"/sessions/{name}/stream"
    headers = {"Authorization": f"Bearer {client.tokens[name]}"}
    with connect(url, max_queue=None, additional_headers=headers) as websocket:

        def take():
            while True:
                message = websocket.recv(5.0)
                if isinstance(message, bytes):
                    return decode_chunk(message)
                json.loads(message)

        first = [take() for _ in range(4)]
        time.sleep(STALL_S)
        playhead = client.status(name)["sample"]
        taken = [take()]
        while taken[-1].sample < playhead - BLOCK_FRAMES:
            taken.append(take())
    samples = [chunk.sample for chunk in first + taken]
    assert samples == list(range(samples[0], samples[0] + BLOCK_FRAMES * len(samples), BLOCK_FRAMES))
    assert all(chunk.dropped == 0 for chunk in taken)
    assert (taken[-1].sample - first[-1].sample) >= (STALL_S - 0.5) * SAMPLE_RATE, "the stall's audio did not wait"


def test_a_client_whose_acknowledgements_arrive_late_is_sent_the_live_audio_again(server):
    """The client takes the whole window, then acknowledges it only after the live audio has moved more than a window
    past its last acknowledgement (a proxy under load delays acks so): the next chunk must still come, at the live
    playhead, with the skipped chunks counted (a window measured from the playhead left it waiting for ever)."""
    client, name = server
    url = client.server.replace("http://", "ws://") + f"/sessions/{name}/stream"
    headers = {"Authorization": f"Bearer {client.tokens[name]}"}
    with connect(url, max_queue=None, additional_headers=headers) as websocket:

        def take(timeout_s: float):
            while True:
                message = websocket.recv(timeout_s)
                if isinstance(message, bytes):
                    return decode_chunk(message)

        first = take(5.0)
        websocket.send(json.dumps({"ack": first.sample + first.frames}))  # flow control on
        taken = [take(5.0) for _ in range(ACK_WINDOW_FRAMES // BLOCK_FRAMES)]  # the whole window, unacknowledged
        with pytest.raises(TimeoutError):
            take(1.0)  # nothing more while the window waits
        time.sleep(ACK_WINDOW_FRAMES / SAMPLE_RATE + 0.5)  # the live audio runs more than a window ahead
        websocket.send(json.dumps({"ack": taken[-1].sample + taken[-1].frames}))
        after = take(5.0)
    assert after.sample > taken[-1].sample + ACK_WINDOW_FRAMES, "the next chunk is the live audio"
    assert after.dropped - taken[-1].dropped == (after.sample - taken[-1].sample) // BLOCK_FRAMES - 1

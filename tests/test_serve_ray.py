"""`flowjam serve` on Ray Serve for real: a local Ray cluster on this machine's CPUs, two replicas of the tiny preset
behind the gateway, six sessions created and played through the HTTP/WebSocket API, then one replica killed.

Runs only with FLOWJAM_RAY=1 and the `serve` extra installed (`.ci/test-serve`): 25-45 s on two cores, most of it
starting Ray and Serve."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import ADMIT_ANY_SPEED_MS, free_tcp_port, wait_for

if os.environ.get("FLOWJAM_RAY") != "1":
    pytest.skip(
        "Ray Serve test: set FLOWJAM_RAY=1 with the serve extra installed (.ci/test-serve)", allow_module_level=True
    )
ray = pytest.importorskip("ray")
deployment = pytest.importorskip("flowjam.serve.deployment")
client_module = pytest.importorskip("flowjam.serve.client")
host_module = pytest.importorskip("flowjam.serve.host")
MAX_LANES = pytest.importorskip("flowjam.engine.stream").MAX_LANES

Client, ServerError = client_module.Client, client_module.ServerError
access = pytest.importorskip("flowjam.serve.access")
connect = pytest.importorskip("websockets.sync.client").connect
InvalidStatus = pytest.importorskip("websockets.exceptions").InvalidStatus
KEY = "ray-test-server-key-0123456789"  # the ingress runs with a server key: creating and listing need it

PROMPT = "lofi hip hop, mellow piano, 80 bpm"
LOOP_S = 4.0
SESSIONS = 6
CHUNKS_TO_PLAY = 20  # 1 s of audio
SILENT_RUN = 10  # consecutive all-zero chunks that show volume 0 reached the audio
WAIT_S = 15.0  # the longest any expected thing may take to show up
CALL_WAIT_S = 45.0  # the longest a call may take: a create on a replica whose CPU ring already plays 7 sessions
LOST_WITHIN_S = 5.0  # a killed replica's sessions say so this soon
RESTART_WAIT_S = 90.0  # Serve's controller finds a dead replica by its health check (every 10 s), then starts one


@pytest.fixture(scope="module")
def server():
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    port = free_tcp_port()
    # two rings sharing two cores tick slowly: what matters here is routing, not real time
    options = host_module.HostOptions(preset="tiny", latent_interval_ms=ADMIT_ANY_SPEED_MS)
    policy = access.AccessPolicy.for_server("127.0.0.1", KEY)
    try:
        yield deployment.start_on_ray(options, 2, 0.0, None, "127.0.0.1", port, num_cpus=2, policy=policy)
    finally:
        deployment.stop_on_ray()


class Listener:
    """One session's stream read on a thread: its chunks, its events and when it closed."""

    def __init__(self, client: Client, session: str):
        self.session = session
        self.stream = client.stream(session)
        self.chunks: list = []
        self.events: list[dict] = []
        self.failure: BaseException | None = None
        self.closed_at: float | None = None
        self._thread = threading.Thread(target=self._read, name=f"listen-{session}", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            while (item := self.stream.receive(timeout_s=WAIT_S)) is not None:
                (self.events if isinstance(item, dict) else self.chunks).append(item)
        except BaseException as error:  # reported by the test, not lost on this thread
            self.failure = error
        self.closed_at = time.monotonic()

    def wait(self, done: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert self.failure is None, f"{self.session}: the stream failed while waiting for {what}: {self.failure!r}"
            assert time.monotonic() < deadline, f"{self.session}: no {what} within {timeout_s:g} s ({self.summary()})"
            time.sleep(0.05)

    def wait_chunks(self, count: int, after: int = 0) -> list:
        self.wait(lambda: len(self.chunks) >= after + count, f"{count} audio chunks")
        return self.chunks[after : after + count]

    def summary(self) -> str:
        return f"{len(self.chunks)} chunks, events {self.events}, close code {self.stream.close_code}"

    def close(self) -> None:
        self.stream.close()
        self._thread.join(WAIT_S)


def silent(chunk) -> bool:
    return not chunk.audio.any()


REPLICA_ACTOR = f"SERVE_REPLICA::{deployment.APP_NAME}#RingReplica#"  # + the replica id: Serve's actor name


def replica_actor(replica: str):
    """The Serve replica actor behind a replica id (Serve names them in its namespace)."""
    name = REPLICA_ACTOR + replica
    try:
        return ray.get_actor(name, namespace="serve")
    except ValueError:
        actors = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        raise AssertionError(f"no actor {name!r}; the named actors are {actors}") from None


def serve_logs(pattern: str, at_least: int) -> list[Path]:
    """This cluster's Serve log files named by `pattern` (Serve writes one per replica and per proxy)."""
    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    found = sorted(logs.glob(pattern))
    assert len(found) >= at_least, f"{len(found)} {pattern} under {logs}, expected at least {at_least}"
    return found


def replica_logs() -> list[Path]:
    """The log files of this cluster's RingReplicas."""
    return serve_logs(f"replica_{deployment.APP_NAME}_RingReplica_*.log", 2)


def status_code(call: Callable[[], object]) -> int:
    try:
        call()
    except ServerError as error:
        return error.status
    return 200


def test_sessions_keep_their_replica_and_outlive_another_replica(server):
    client = Client(server, timeout_s=CALL_WAIT_S, key=KEY)
    names = [f"jam-{index}" for index in range(SESSIONS)]
    placed = {name: client.create(PROMPT, seconds=LOOP_S, name=name)["replica"] for name in names}
    assert len(set(placed.values())) == 2, f"{SESSIONS} sessions should spread over both replicas: {placed}"
    assert {entry["session"]: entry["replica"] for entry in client.sessions()} == placed
    assert status_code(lambda: client.create(PROMPT, name=names[0])) == 400, "a name that plays is refused"
    # The ingress keeps strangers out as --local does: no token 401, a wrong one 403 (an unknown name alike), a web
    # page's WebSocket 403 even with the token.
    stranger = Client(server, timeout_s=WAIT_S, token="not-the-token")
    assert status_code(lambda: Client(server, timeout_s=WAIT_S).status(names[0])) == 401
    assert status_code(lambda: stranger.set_knobs(names[0], {"volume": 0.0})) == 403
    assert status_code(lambda: stranger.status("nobody")) == 403
    assert Client(server, timeout_s=WAIT_S).sessions() == [], "the list is the key holder's only"
    with pytest.raises(InvalidStatus) as refused:
        connect(
            f"ws{server.removeprefix('http')}/sessions/{names[0]}/stream",
            additional_headers={"Authorization": f"Bearer {client.tokens[names[0]]}", "Origin": "http://evil.example"},
            open_timeout=WAIT_S,
        )
    assert refused.value.response.status_code == 403
    with pytest.raises(ServerError) as bad_knob:
        client.set_knobs(names[0], {"volumes": 0.5})
    assert bad_knob.value.status == 400 and "volumes" in bad_knob.value.message
    assert "Traceback" not in bad_knob.value.message, "the replica's error reaches the client without Ray's wrapping"
    assert status_code(lambda: client.create(PROMPT, knobs={"dept": 2}, name="bad-depth")) == 400
    assert "bad-depth" not in {entry["session"] for entry in client.sessions()}

    listeners = {name: Listener(client, name) for name in names}
    try:
        for name, listener in listeners.items():
            samples = [chunk.sample for chunk in listener.wait_chunks(CHUNKS_TO_PLAY)]
            assert all(b > a for a, b in zip(samples, samples[1:])), f"{name}: sample index must grow: {samples}"
            listener.wait(lambda lst=listener: not all(silent(c) for c in lst.chunks), "sound before any knob moved")

        # A knob per session reaches its audio: volume 0 is exact silence, and sound comes back with the volume.
        # Half the sessions turn it over HTTP, half over their WebSocket (answered by an "applied" event).
        muted_from = {name: len(listener.chunks) for name, listener in listeners.items()}
        for index, name in enumerate(names):
            if index % 2:
                listeners[name].stream.set_knobs({"volume": 0.0})
            else:
                assert client.set_knobs(name, {"volume": 0.0}) == {"volume": 0.0}
        applied = {"event": "applied", "knobs": {"volume": 0.0}}
        for name in names[1::2]:
            listeners[name].wait(lambda lst=listeners[name]: applied in lst.events, "the applied event")
        for name, listener in listeners.items():
            listener.wait(lambda lst=listener, n=name: _silent_run(lst.chunks[muted_from[n] :]), "silence at volume 0")
            heard = listener.chunks[max(0, muted_from[name] - SILENT_RUN) : muted_from[name]]
            assert not all(silent(chunk) for chunk in heard), f"{name} was silent before volume 0"
        unmuted_from = {name: len(listener.chunks) for name, listener in listeners.items()}
        for name in names:
            client.set_knobs(name, {"volume": 0.8})
        for name, listener in listeners.items():
            listener.wait(
                lambda lst=listener, n=name: any(not silent(c) for c in lst.chunks[unmuted_from[n] :]), "sound again"
            )

        # Affinity: every call for a session reached the replica that created it.
        for _ in range(3):
            for name in names:
                status = client.status(name)
                assert status["replica"] == placed[name], f"{name} was served by {status['replica']}"
                assert status["knobs"]["volume"] == pytest.approx(0.8)

        # Full: each host plays MAX_LANES sessions; one more is refused by both replicas (503), and nothing is evicted.
        extras = [f"extra-{index}" for index in range(2 * MAX_LANES - SESSIONS)]
        for name in extras:
            client.create(PROMPT, seconds=LOOP_S, name=name)
        with pytest.raises(ServerError) as refused:
            client.create(PROMPT, seconds=LOOP_S, name="one-too-many")
        assert refused.value.status == 503
        assert all(replica in refused.value.message for replica in set(placed.values())), refused.value.message
        assert len(client.sessions()) == 2 * MAX_LANES
        for name in extras:
            client.end(name)
        assert {entry["session"]: entry["replica"] for entry in client.sessions()} == placed

        # Every refusal so far (400, 404, 503) was an answer, not a failure: the replicas' logs hold no traceback.
        for log in replica_logs():
            assert "Traceback" not in log.read_text(), f"{log.name} logged a refusal as a failure:\n{log.read_text()}"

        # One replica dies: its sessions are lost (stream event, then 410), the other replica's play on.
        victim = placed[names[0]]
        lost = [name for name in names if placed[name] == victim]
        kept = [name for name in names if placed[name] != victim]
        kept_from = {name: len(listeners[name].chunks) for name in kept}
        killed_at = time.monotonic()
        ray.kill(replica_actor(victim), no_restart=True)
        for name in lost:
            listener = listeners[name]
            listener.wait(lambda lst=listener: lst.closed_at is not None, "end of stream", LOST_WITHIN_S)
            assert listener.events[-1]["event"] == "lost", listener.summary()
            assert listener.stream.close_code == 1011, listener.summary()
        for name in lost:
            codes = []
            while time.monotonic() - killed_at < LOST_WITHIN_S and (not codes or codes[-1] != 410):
                codes.append(status_code(lambda n=name: client.status(n)))
            assert codes[-1] == 410, f"{name}: status after its replica died gave {codes}"
            assert time.monotonic() - killed_at < LOST_WITHIN_S
        for name in kept:
            samples = [chunk.sample for chunk in listeners[name].wait_chunks(CHUNKS_TO_PLAY, after=kept_from[name])]
            assert all(b > a for a, b in zip(samples, samples[1:])), f"{name} stuttered after the other replica died"
            assert client.status(name)["replica"] == placed[name]

        # A lost session can be created again, on a replica that lives.
        again = client.create(PROMPT, seconds=LOOP_S, name=lost[0])
        assert again["replica"] != victim
        listeners[lost[0]] = Listener(client, lost[0])
        listeners[lost[0]].wait_chunks(CHUNKS_TO_PLAY)

        # End everything: live sessions end (their streams say so), lost ones answer 410.
        for name in [*kept, lost[0]]:
            client.end(name)
            listener = listeners[name]
            listener.wait(lambda lst=listener: lst.closed_at is not None, "end of stream")
            assert listener.events and listener.events[-1]["event"] == "ended", listener.summary()
        for name in lost[1:]:
            assert status_code(lambda n=name: client.end(n)) == 410
        assert client.sessions() == []
    finally:
        for listener in listeners.values():
            listener.close()


def _silent_run(chunks: list) -> bool:
    run = 0
    for chunk in chunks:
        run = run + 1 if silent(chunk) else 0
        if run >= SILENT_RUN:
            return True
    return False


def test_a_stalled_client_behind_the_ray_proxy_finds_at_most_the_window_waiting(server):
    """Serve's proxy never blocks a send, so without acknowledgements a stalled client's audio piles up there; the
    gateway sends no chunk more than the window past the client's last acknowledgement."""
    from stall_probe import stall_and_drain

    window_s = pytest.importorskip("flowjam.serve.protocol").ACK_WINDOW_FRAMES / 48_000
    client = Client(server, timeout_s=CALL_WAIT_S, key=KEY)
    name = client.create(PROMPT, seconds=LOOP_S, name="stalled")["session"]
    try:
        stall = stall_and_drain(client, name, stall_s=2 * window_s)
    finally:
        client.end(name)
    assert stall.waited_s <= window_s + 0.25, f"{stall.waited_s:.2f} s waited; the window is {window_s:g} s"
    assert stall.skipped_chunks > 0 and stall.counted_dropped == stall.skipped_chunks, stall


def test_with_no_replica_running_health_and_create_say_so_until_serve_starts_them_again(server):
    """Every replica killed: /health answers 503 and a create 503, both naming the replicas' state, until Serve's
    controller has started new ones; then a session plays again."""
    client = Client(server, timeout_s=CALL_WAIT_S, key=KEY)
    wait_for(client.health, RESTART_WAIT_S, "a replica running", poll_s=0.2)
    replicas = [
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(REPLICA_ACTOR)
    ]
    assert replicas, "no replica actors"
    for name in replicas:  # the one the first test killed may be among them, and one still starting
        with contextlib.suppress(ValueError):
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
    reason = wait_for(client.not_ready, RESTART_WAIT_S, "/health to say that no replica runs", poll_s=0.05)
    with pytest.raises(ServerError) as refused:
        client.create(PROMPT, seconds=LOOP_S, name="early")
    if client.health():
        pytest.fail(f"the replicas came back before the create was answered ({refused.value})")
    assert refused.value.status == 503
    for said in (reason, refused.value.message):
        assert "no replica of RingReplica is running yet" in said and "GET /health" in said, said
    wait_for(client.health, RESTART_WAIT_S, "Serve to start the replicas again", poll_s=0.2)
    name = client.create(PROMPT, seconds=LOOP_S, name="again")["session"]
    listener = Listener(client, name)
    try:
        listener.wait_chunks(CHUNKS_TO_PLAY)
    finally:
        client.end(name)
        listener.close()
    # No client of this module gave up on a call in flight, so Serve's proxy closed none of its request generators
    # mid-request (what logs "async generator ignored GeneratorExit", docs/serve.md).
    for log in serve_logs("proxy_*.log", 1):
        assert "GeneratorExit" not in log.read_text(), f"{log.name}:\n{log.read_text()[-4000:]}"

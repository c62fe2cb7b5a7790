"""`flowjam serve` on Ray Serve: one RingReplica (a RingHost) per GPU, the Gateway ingress with the HTTP/WebSocket
API, and RayRouter, the gateway's SessionRouter over the replicas.

Session affinity. A session is a multiplexed "model" of Ray Serve whose id is the session name; only create loads
one (the multiplexed loader starts it on the replica's host), and the replica then reports its ids to the controller,
which hands them to every handle's router (ray/serve/multiplex.py `_ModelMultiplexWrapper._push_model_ids_info`,
ray/serve/_private/deployment_state.py `record_request_routing_info`). Ray's own router treats those ids as a
preference: with no replica known for an id, or the known one busy, or after 1-2 s of matching
(RAY_SERVE_MULTIPLEXED_MODEL_ID_MATCHING_TIMEOUT_S) it sends the request to any replica
(request_router.py `MultiplexMixin.apply_multiplex_routing`). So SessionRequestRouter replaces it: a request goes only
to the replica that reported its session, or, while no replica has (a create, a report still on its way, a replica
that died), to any replica. A replica without the session answers NotHere and RayRouter asks every replica
(`handle.broadcast`) where the session is: somewhere, it tries again until the report arrives; nowhere, the session
was lost with its replica (410) or never existed (404). Ray has no call to unload a multiplexed model, so ending a
session removes its id from the multiplex cache by hand (`_forget`); nothing is ever evicted, the cache holds far
more ids than a host holds sessions."""

from __future__ import annotations

import asyncio
import functools
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import MultiplexMixin, PendingRequest, RequestRouter, RunningReplica

from ..engine.stream import MAX_LANES
from . import refusals
from .access import AccessPolicy
from .errors import SessionLost, SessionRefused, UnknownSession
from .gateway import LocalRouter, make_app
from .host import HostOptions

APP_NAME = "flowjam"
SERVE_NAMESPACE = "serve"  # where Serve names its actors
MULTIPLEXED_SESSIONS = 16 * MAX_LANES  # the multiplex LRU never reaches this: a host refuses sessions past MAX_LANES
REPLICA_REQUESTS = 64 * MAX_LANES  # every audio stream is a request in flight for as long as it plays
GATEWAY_REQUESTS = 4096  # every WebSocket too
CALL_TIMEOUT_S = 30.0  # a control call a replica has not answered by then: 503, try again
CREATE_TIMEOUT_S = 120.0  # creating a session may compile or capture graphs on a GPU
FIND_S = 5.0  # how long calls keep looking for a session some replica holds (ids reach routers in ~0.1-0.5 s)
RETRY_S = 0.1
PLACEMENT_TIMEOUT_S = 10.0
SHUTDOWN_S = 2.0  # audio streams never finish on their own: a stopping replica waits this long, then goes
MULTIPLEX_WRAPPER = "__serve_multiplex_wrapper"  # where @serve.multiplexed keeps its cache on the instance
# Serve kills an HTTP proxy that has not answered its readiness check three times in a row, and its default 5 s a
# check is too short for a proxy starting on a busy 2-core machine (it failed `serve.start` once in CI): a local
# cluster started here gives it this long, unless the environment says otherwise.
PROXY_READY_ENV, PROXY_READY_S = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30"


class NotHere(LookupError):
    """A call for a session reached a replica that does not play it; RayRouter looks for the session and retries."""


REFUSALS: tuple[type[Exception], ...] = (NotHere, SessionLost, UnknownSession, SessionRefused, ValueError)


@dataclass(frozen=True)
class Refusal:
    """An expected refusal (no such session here, a bad value, no room) that a replica answers with instead of
    raising it: Ray Serve logs every exception a replica raises with its traceback, which for refusals the API
    answers every day (404, 400, 503) would bury the real errors. RayRouter raises it again on its side."""

    kind: str  # the name of one of REFUSALS
    message: str

    @staticmethod
    def of(error: Exception) -> Refusal:
        return Refusal(next(kind.__name__ for kind in REFUSALS if isinstance(error, kind)), str(error))

    def error(self) -> Exception:
        return {kind.__name__: kind for kind in REFUSALS}[self.kind](self.message)


def _answers_refusals(method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """A replica method whose REFUSALS come back as a Refusal (plain data: any ValueError subclass reaches the
    gateway as a ValueError with its message, whatever its own pickling)."""

    @functools.wraps(method)
    async def answer(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await method(self, *args, **kwargs)
        except REFUSALS as error:
            return Refusal.of(error)

    return answer


class SessionRequestRouter(MultiplexMixin, RequestRouter):
    """Strict session affinity: a request for a session goes to the replica that reported it and nowhere else; with
    no such replica, a create goes to the replica RayRouter picked and anything else to any replica (which answers
    NotHere unless the session is there and its report not yet here)."""

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is None or not pending_request.metadata.multiplexed_model_id:
            return [candidate_replicas]
        pending_request.routing_context.should_backoff = True  # nothing accepting: back off, never spin
        wanted = pending_request.kwargs.get("replica")
        holders = self._multiplexed_model_id_to_replica_ids.get(pending_request.metadata.multiplexed_model_id)
        if wanted is not None:
            chosen = [r for r in candidate_replicas if r.replica_id.unique_id == wanted] or candidate_replicas
        elif holders:
            chosen = [r for r in candidate_replicas if r.replica_id in holders]
        else:
            chosen = random.sample(candidate_replicas, len(candidate_replicas))
        return [chosen]


@serve.deployment(
    max_ongoing_requests=REPLICA_REQUESTS,
    request_router_config=RequestRouterConfig(request_router_class=SessionRequestRouter),
    logging_config={"enable_access_log": False},  # RayRouter's calls and lookups; the gateway logs every request
    graceful_shutdown_timeout_s=SHUTDOWN_S,
    graceful_shutdown_wait_loop_s=0.5,
)
class RingReplica:
    """One RingHost (one model on one device) serving the sessions created on it."""

    def __init__(self, options: HostOptions):
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.local = LocalRouter(options.build(), replica=self.replica_id)
        self._creating: dict[str, dict[str, Any]] = {}

    @_answers_refusals
    async def create(self, name: str, spec: dict[str, Any], replica: str | None = None) -> dict[str, Any]:
        """Start session `name` here -> {"session", "replica", "status"}, or {"refused": why, "replica"} when the
        host refuses it (full, or admission control), so that RayRouter can try another replica."""
        if replica is not None and replica != self.replica_id:
            raise NotHere(f"create for replica {replica} reached replica {self.replica_id}")
        if name in self._creating or name in self.local.host.names():
            raise ValueError(refusals.name_taken())
        self._creating[name] = spec
        try:
            started = await self._start(name)
        finally:
            del self._creating[name]
            if name not in self.local.host.names():
                self._forget(name)  # a refused or failed create was cached, and may have been reported meanwhile
        if isinstance(started, Refusal) and started.kind == SessionRefused.__name__:
            return {"refused": started.message, "replica": self.replica_id}
        return started

    @serve.multiplexed(max_num_models_per_replica=MULTIPLEXED_SESSIONS)
    async def _start(self, name: str) -> dict[str, Any] | Refusal:
        """The multiplexed loader: only create gets here (any other call checks `_here` first). A refusal is
        returned, not raised: Ray logs a loader's exceptions as failures with their tracebacks."""
        spec = self._creating.get(name)
        if spec is None:
            return Refusal.of(NotHere(f"no session {name!r} on replica {self.replica_id}"))
        try:
            return await self.local.create({**spec, "name": name})
        except REFUSALS as error:
            return Refusal.of(error)

    @_answers_refusals
    async def end(self, name: str) -> None:
        self._here(name)
        await self.local.end(name)
        self._forget(name)

    @_answers_refusals
    async def set_knobs(self, name: str, knobs: dict[str, Any]) -> dict[str, Any]:
        self._here(name)
        return await self.local.set_knobs(name, knobs)

    @_answers_refusals
    async def set_prompt(self, name: str, slot: str, text: str) -> None:
        self._here(name)
        await self.local.set_prompt(name, slot, text)

    @_answers_refusals
    async def status(self, name: str) -> dict[str, Any]:
        self._here(name)
        return {**await self.local.status(name), "replica": self.replica_id}

    async def audio(self, name: str) -> AsyncIterator[bytes | Refusal]:
        """The session's chunks; a refusal (not here, ended) as a last item, not raised (see Refusal)."""
        try:
            self._here(name)
            async for chunk in self.local.audio(name):
                yield chunk
        except REFUSALS as error:
            yield Refusal.of(error)

    def placement(self) -> dict[str, Any]:
        return {"replica": self.replica_id, "sessions": self.local.host.names()}

    def _here(self, name: str) -> None:
        if name not in self.local.host.names():
            raise NotHere(f"no session {name!r} on replica {self.replica_id}")

    def _forget(self, name: str) -> None:
        """Drop `name` from the multiplex cache and report the replica's ids again, so routers stop sending it here.
        Ray 2.60 has no public unload: this is the cache and the flag `_ModelMultiplexWrapper.load_model` uses."""
        wrapper = getattr(self, MULTIPLEX_WRAPPER, None)
        if wrapper is not None:
            wrapper.models.pop(name, None)
            wrapper._push_multiplexed_replica_info = True

    def __del__(self) -> None:
        self.local.close()
        self.local.host.close()


class RayRouter:
    """The gateway's SessionRouter over the RingReplica deployment (see the module docstring for affinity)."""

    def __init__(self, replicas: DeploymentHandle):
        self.replicas = replicas
        self._placed: dict[str, str] = {}  # sessions created here -> replica: missing everywhere, they were lost
        self._creating: set[str] = set()

    async def create(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Start the session on the replica with the fewest sessions; one that refuses it is not asked again."""
        name = spec["name"]
        if name in self._creating:
            raise ValueError(refusals.name_taken())
        self._creating.add(name)
        try:
            return await self._create(name, {key: value for key, value in spec.items() if key != "name"})
        finally:
            self._creating.discard(name)

    async def _create(self, name: str, spec: dict[str, Any]) -> dict[str, Any]:
        refused_by: dict[str, str] = {}  # replica -> its refusal
        deadline = time.monotonic() + CREATE_TIMEOUT_S
        while True:
            placement = await self._placement()
            if any(name in entry["sessions"] for entry in placement):
                raise ValueError(refusals.name_taken())
            counts = {entry["replica"]: len(entry["sessions"]) for entry in placement}
            free = [replica for replica in counts if replica not in refused_by]
            if not free or time.monotonic() > deadline:
                reasons = "; ".join(f"replica {replica}: {why}" for replica, why in refused_by.items())
                raise SessionRefused(f"no replica could take session {name!r} ({reasons or 'no replica is running'})")
            fewest = min(counts[replica] for replica in free)
            target = random.choice([replica for replica in free if counts[replica] == fewest])
            try:
                placed = await self._ask(name, "create", name, spec, replica=target, timeout_s=CREATE_TIMEOUT_S)
            except NotHere:  # the replica went away between the placement and the call
                await asyncio.sleep(RETRY_S)
                continue
            if "refused" in placed:
                refused_by[placed["replica"]] = placed["refused"]
                continue
            self._placed[name] = placed["replica"]
            return placed

    async def end(self, session: str) -> None:
        try:
            await self._call("end", session)
        except SessionLost:
            self._placed.pop(session, None)  # said once more, then forgotten
            raise
        self._placed.pop(session, None)

    async def set_knobs(self, session: str, knobs: dict[str, Any]) -> dict[str, Any]:
        return await self._call("set_knobs", session, knobs)

    async def set_prompt(self, session: str, slot: str, text: str) -> None:
        await self._call("set_prompt", session, slot, text)

    async def status(self, session: str) -> dict[str, Any]:
        return await self._call("status", session)

    async def sessions(self) -> list[dict[str, str]]:
        return [
            {"session": name, "replica": entry["replica"]}
            for entry in await self._placement()
            for name in entry["sessions"]
        ]

    async def audio(self, session: str) -> AsyncIterator[bytes]:
        """The session's chunks from its replica; SessionLost when the replica dies, UnknownSession when it ends."""
        deadline = time.monotonic() + FIND_S
        while True:
            stream = self.replicas.options(stream=True, multiplexed_model_id=session).audio.remote(session)
            try:
                async for chunk in stream:
                    if isinstance(chunk, Refusal):
                        raise chunk.error()
                    yield chunk
                return
            except Exception as error:
                cause = _cause(error)
                if isinstance(cause, RayActorError):
                    raise self._lost(session) from None
                if not isinstance(cause, NotHere):
                    raise cause from None
            finally:
                stream.cancel()  # the client went away (or the stream ended): stop the replica's generator
            await self._retry(session, deadline)

    async def _call(self, method: str, session: str, *args: Any) -> Any:
        """A control call on the session's replica, found again while its report is on the way."""
        deadline = time.monotonic() + FIND_S
        while True:
            try:
                return await self._ask(session, method, session, *args)
            except NotHere:
                await self._retry(session, deadline)

    async def _ask(self, session: str, method: str, *args: Any, timeout_s: float = CALL_TIMEOUT_S, **kwargs) -> Any:
        """One call routed by `session`, with the replica's own exception (not Ray's wrapper) raised; a replica that
        died under the call is NotHere."""
        response = getattr(self.replicas.options(multiplexed_model_id=session), method).remote(*args, **kwargs)
        try:
            answer = await asyncio.wait_for(response, timeout_s)
        except asyncio.TimeoutError:
            response.cancel()
            raise SessionRefused(
                f"the replica of session {session!r} did not answer {method} within {timeout_s:g} s; it is "
                "overloaded: try again"
            ) from None
        except Exception as error:
            cause = _cause(error)
            raise (NotHere(str(cause)) if isinstance(cause, RayActorError) else cause) from None
        if isinstance(answer, Refusal):
            raise answer.error()
        return answer

    async def _retry(self, session: str, deadline: float) -> None:
        """After a NotHere: SessionLost if the session was created here and no replica has it now, UnknownSession if
        it never was; else wait a moment for its replica's report to reach this router."""
        if not any(session in entry["sessions"] for entry in await self._placement()):
            if session in self._placed:
                raise self._lost(session)
            raise UnknownSession(f"no session {session!r} on any replica; create it with POST /sessions")
        if time.monotonic() > deadline:
            raise SessionRefused(f"session {session!r} plays on a replica this gateway cannot reach yet: try again")
        await asyncio.sleep(RETRY_S)

    def _lost(self, session: str) -> SessionLost:
        replica = self._placed.get(session, "?")
        return SessionLost(
            f"session {session!r} was lost: its replica {replica} stopped; create it again with POST /sessions"
        )

    async def not_ready(self) -> str | None:
        """None while a replica answers; else why none does (the replicas' state as Ray's controller tells it)."""
        return None if await self._answers() else await self._none_answers()

    async def _placement(self) -> list[dict[str, Any]]:
        """{"replica", "sessions"} of every replica that answers; SessionRefused naming the replicas' state if none
        does (all still starting, or all dead or failed)."""
        answers = await self._answers()
        if not answers:
            raise SessionRefused(await self._none_answers())
        return answers

    async def _answers(self) -> list[dict[str, Any]]:
        """The placement answers of the live replicas: a dead one answers with an error and is left out; none at all
        when the router knows no running replica (Ray's DeploymentUnavailableError, whose "failed to deploy" also
        covers replicas that are still starting)."""
        try:
            response = self.replicas.broadcast("placement")
            answers = await response.results_async(timeout_s=PLACEMENT_TIMEOUT_S, return_exceptions=True)
        except DeploymentUnavailableError:
            return []
        except TimeoutError:  # one replica hung: better "try again" than calling its sessions lost
            raise SessionRefused(
                f"a replica did not say which sessions it plays within {PLACEMENT_TIMEOUT_S:g} s: try again"
            ) from None
        return [answer for answer in answers if isinstance(answer, dict)]

    async def _none_answers(self) -> str:
        state = await asyncio.to_thread(_replica_state)
        return (
            f"no replica of {RingReplica.name} is running yet ({state}): a replica loads the model (and may compile "
            "graphs) first; GET /health answers ok once one runs"
        )


def _replica_state() -> str:
    """This app's RingReplica deployment as Ray's controller sees it: "<status>, <count> <replica state>, ...[; <its
    message>]" (a replica's constructor error is in the message)."""
    application = serve.status().applications.get(APP_NAME)
    deployment = None if application is None else application.deployments.get(RingReplica.name)
    if deployment is None:
        return f"the {APP_NAME} application has no {RingReplica.name} deployment yet"
    counts = {str(getattr(state, "value", state)): count for state, count in deployment.replica_states.items()}
    shown = ", ".join(f"{count} {state.lower()}" for state, count in sorted(counts.items())) or "no replicas"
    message = f"; {deployment.message}" if deployment.message else ""
    return f"{getattr(deployment.status, 'value', deployment.status)}, {shown}{message}"


def _cause(error: BaseException) -> BaseException:
    """The exception a replica raised, without the RayTaskError around it (whose text holds the remote traceback)."""
    cause = getattr(error, "cause", None) if isinstance(error, RayTaskError) else None
    return cause if isinstance(cause, BaseException) else error


@serve.deployment(
    max_ongoing_requests=GATEWAY_REQUESTS,
    ray_actor_options={"num_cpus": 0},
    graceful_shutdown_timeout_s=SHUTDOWN_S,
    graceful_shutdown_wait_loop_s=0.5,
)
@serve.ingress()
class Gateway:
    """The HTTP/WebSocket API (gateway.make_app) over the replicas."""

    def __init__(self, replicas: DeploymentHandle, policy: AccessPolicy):
        self.router = RayRouter(replicas)
        self.policy = policy

    def __serve_build_asgi_app__(self):
        return make_app(self.router, self.policy)


def replica_actor_name(replica: str) -> str:
    """The name of the Ray actor behind RingReplica `replica` (its id), in SERVE_NAMESPACE: what `ray.kill` takes."""
    return f"SERVE_REPLICA::{APP_NAME}#{RingReplica.name}#{replica}"


def build_app(
    options: HostOptions, replicas: int, gpus_per_replica: float, policy: AccessPolicy | None = None
) -> serve.Application:
    """The Ray Serve application; `policy`: the gateway's access rules (default: loopback, no key)."""
    if replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {replicas}")
    if options.device.startswith("cuda") and gpus_per_replica <= 0:
        raise ValueError("a cuda replica needs a GPU: pass --gpus-per-replica 1 (or a fraction to share one)")
    ring = RingReplica.options(num_replicas=replicas, ray_actor_options={"num_gpus": gpus_per_replica, "num_cpus": 1})
    return Gateway.bind(ring.bind(options), policy or AccessPolicy())


def start_on_ray(
    options: HostOptions,
    replicas: int,
    gpus_per_replica: float,
    address: str | None,
    host: str,
    port: int,
    num_cpus: int | None = None,
    policy: AccessPolicy | None = None,
) -> str:
    """Start (or join, `address="auto"`) a Ray cluster, run the app on it and return its URL once it answers.
    `num_cpus`: the CPUs a local cluster offers (each replica takes one; default: every core)."""
    app = build_app(options, replicas, gpus_per_replica, policy)
    if not ray.is_initialized():
        if address is None:
            os.environ.setdefault(PROXY_READY_ENV, PROXY_READY_S)  # the cluster's processes inherit it
            ray.init(num_cpus=num_cpus, include_dashboard=False, configure_logging=False)
        else:
            ray.init(address=address, configure_logging=False)
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name=APP_NAME, route_prefix="/")
    return f"http://{host}:{port}"


def stop_on_ray(joined: bool = False) -> None:
    """End every session and stop the app; then stop Serve and the local cluster, or, on a cluster this process
    `joined`, leave Serve and its other apps running and disconnect."""
    try:
        if joined:
            serve.delete(APP_NAME)
        else:
            serve.shutdown()
    finally:
        ray.shutdown()


def run_on_ray(
    options: HostOptions,
    replicas: int,
    gpus_per_replica: float,
    address: str | None,
    host: str,
    port: int,
    policy: AccessPolicy | None = None,
) -> None:
    """`flowjam serve` on Ray: run until Ctrl-C, then shut down."""
    url = start_on_ray(options, replicas, gpus_per_replica, address, host, port, policy=policy)
    print(f"flowjam serves {replicas} replica(s) of {options.preset} on Ray at {url} (Ctrl-C stops)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping: ending every session", flush=True)
    finally:
        stop_on_ray(joined=address is not None)

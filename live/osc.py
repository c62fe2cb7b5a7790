"""OSC bridge: controllers play the knob registry over UDP, and see its values come back.

Address space under `/flowjam/<session>/`:
    knob/<name> <number>    set a knob in its own units (clamped to its range); no argument = ask its value
    norm/<name> <0..1>      set a knob from a controller's 0..1 fader; no argument = ask its 0..1 value
    prompt <text>           prompt A (`prompt/a` too); `prompt/b <text>` sets prompt B; `prompt/negative <text>`
                            the negative prompt that CFG guides away from ("" = the null condition)
    transport <command>     play (fade in at the playhead) | stop (fade to silence, engine stays warm) | reset
                            (every knob to its default); play and stop are echoed as `transport <command>`
    target/capture          the loop as it sounds now becomes the target x0_target_strength pulls toward
    target/clear            back to the default target (the source audio, or none)
    status                  reply `status <json>` to the sender and the feedback port (arguments are ignored,
                            so a push button that sends 1 works)
    sync                    reply `sync <json>`: the grid (bpm, beats_per_bar, bars, the loop's bar.beat) and a
                            followed clock's tempo, transport, bar.beat and phase error; {} without a grid.
                            Following a clock, its tempo is sent as `tempo <bpm>` whenever it changes

Three threads, so the receive loop never waits. It drains one plain UDP socket each time it wakes and applies what
it read in arrival order, except that knob values are coalesced: of the values read for one knob, only the newest
is set. A flood of fader moves then costs a read per datagram and one set per knob, and the last value sent is the
one that stays. The socket's large SO_RCVBUF (the default holds about 250 small datagrams) takes the bursts a
receiver on a busy machine cannot drain at once, so the kernel does not drop the newest messages; without the
privilege to raise it (see udp.py), the quick reads keep up with a python-osc sender. A scheduler thread applies
bundles whose timetag lies in the future at their time; a sender thread sends replies and feedback from the same
socket, so controllers see replies come from the port they send to.

Feedback: every knob change, whatever its origin, is sent as `knob/<name> <value>` and `norm/<name> <0..1>` to the
configured feedback address and to the last OSC sender. Changes are coalesced per knob (latest wins) and sent at
most every FEEDBACK_INTERVAL_S, so a flood cannot queue up. A value is not echoed to an address that moved that
knob within the last ECHO_HOLD_S (a motorised fader would fight the hand); once it rests, that address gets the
knob's final value once, so a clamped or rounded value still shows. The hold matches addresses exactly (host and
port): a controller that sends from the port it listens on (TouchOSC, Open Stage Control, liblo apps) is covered
on its feedback port too; one that sends from a throwaway port still gets echoes on its feedback port.

Bad input never stops the bridge: each rejected message is counted by reason in stats(), and each reason is logged
once (logger "flowjam.osc").
"""

from __future__ import annotations

import errno
import json
import logging
import math
import select
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

from pythonosc.osc_message import OscMessage

from ..engine.params import MAX_PROMPT_CHARS
from .knobs import KnobChange, KnobError, KnobRegistry
from .osc_schedule import MAX_SCHEDULED, BundleScheduler
from .osc_wire import SHOWN_ADDRESS_CHARS, Bundle, clip, encode, one_number, parse, shown
from .udp import Address, is_loopback, lookup, resolve, resolve_hosts, set_receive_buffer, show

log = logging.getLogger("flowjam.osc")

ECHO_HOLD_S = 0.150  # no echo to an address that moved the knob this recently
FEEDBACK_INTERVAL_S = 0.010  # at most 100 feedback batches a second
MAX_AHEAD_S = 60.0  # bundles timetagged further ahead are rejected: the sender's clock is off
MAX_REPLIES = 1024
RECEIVE_POLL_S = 0.05  # how often the receive loop looks at the stop flag
MAX_BATCH = 1024  # datagrams read before what they hold is applied: bounds the delay a flood adds to a change
TRANSPORT_COMMANDS = ("play", "stop", "reset")
TARGET_COMMANDS = ("capture", "clear")
PROMPT_PATHS = {"prompt": "a", "prompt/a": "a", "prompt/b": "b", "prompt/negative": "negative"}


@dataclass(frozen=True)
class SettingNames:
    """What the user calls each OscConfig field, for the errors that name it: the CLI's flags, a node's inputs."""

    session: str = "OSC session"
    host: str = "OSC host"
    port: str = "OSC port"
    feedback: str = "OSC feedback"
    allow_hosts: str = "OSC allowed hosts"


@dataclass(frozen=True)
class OscConfig:
    session: str = "default"
    host: str = "127.0.0.1"  # listening beyond loopback ("0.0.0.0") must be asked for
    port: int = 9000  # 0 = any free port (see OscBridge.address)
    feedback: tuple[str, int] | None = None  # where a controller listens for values
    allow_hosts: tuple[str, ...] | None = None  # names or addresses; datagrams from others are dropped
    receive_buffer_bytes: int = 32 << 20  # ~80,000 small datagrams (each takes ~830 bytes of kernel memory)
    names: SettingNames = field(default=SettingNames(), compare=False)

    def __post_init__(self):
        if not self.session or any(c in self.session for c in " #*,/?[]{}"):
            raise ValueError(
                f"{self.names.session} {self.session!r} must be a non-empty word without / or OSC pattern "
                "characters (' #*,?[]{}'), e.g. 'default'"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"{self.names.port} {self.port} is outside 0..65535 (0 = any free port)")


class KnobSet(NamedTuple):
    """A knob value read from a datagram, waiting to be applied unless a newer one for the knob comes first."""

    address: str
    value: float
    sender: Address
    received_at: float


class OscBridge:
    """Serves one session's addresses; start() binds and runs the threads, stop() ends them.

    Knob changes from OSC carry origin "osc" and sent_at = when the datagram was read (a timetagged bundle's
    content: its due time), perf_counter domain, so `change.received_at - change.sent_at` is the bridge's delay."""

    def __init__(
        self,
        registry: KnobRegistry,
        config: OscConfig,
        on_prompt: Callable[[str, str], None] | None = None,
        on_transport: Callable[[str], None] | None = None,
        on_target: Callable[[str], None] | None = None,
        status: Callable[[], dict] | None = None,
        sync: Callable[[], dict] | None = None,
    ):
        self.registry = registry
        self._sync = sync
        self.config = config
        self._on_prompt = on_prompt
        self._on_transport = on_transport
        self._on_target = on_target
        self._status = status
        self._prefix = f"/flowjam/{config.session}/"
        self._lifecycle = threading.Lock()
        self._socket: socket.socket | None = None
        self._address: Address | None = None
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._unsubscribe: Callable[[], None] | None = None
        self._allowed: frozenset[str] | None = None
        self._feedback_address: Address | None = None
        self._last_sender: Address | None = None
        self._moved_at: dict[tuple[str, Address], float] = {}  # (knob, address) -> perf_counter of its last move
        # scheduler: future bundle contents
        self._scheduler = BundleScheduler(
            lambda message, sender, due: self._on_message(message.address, message.params, sender, due)
        )
        # sender: replies in order, feedback coalesced per knob, held-back echoes (sender thread only)
        self._send_ready = threading.Condition()
        self._replies: deque[tuple[bytes, Address]] = deque()
        self._pending: dict[str, KnobChange] = {}
        self._held: dict[tuple[str, Address], float] = {}  # (knob, address) -> when to send its final value
        # stats
        self._stats_lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._rejected: Counter[str] = Counter()
        self._logged_reasons: set[str] = set()
        self._last_message = ""
        self._last_error = ""
        self._receive_buffer_bytes = 0

    # lifecycle

    def start(self) -> None:
        with self._lifecycle:
            if self._socket is not None:
                raise RuntimeError("OSC bridge already started; stop() it first")
            names = self.config.names
            candidates = lookup(self.config.host, self.config.port, names.host)
            family, _, _, _, bind_address = min(candidates, key=lambda info: info[0] != socket.AF_INET)
            sock = socket.socket(family, socket.SOCK_DGRAM)
            try:
                self._receive_buffer_bytes = set_receive_buffer(sock, self.config.receive_buffer_bytes)
                self._bind(sock, bind_address)
                self._allowed = resolve_hosts(self.config.allow_hosts, names.allow_hosts)
                feedback = self.config.feedback
                self._feedback_address = resolve(feedback, family, names.feedback) if feedback else None
            except BaseException:
                sock.close()
                raise
            sock.setblocking(False)  # the receive loop waits in select() and then drains without blocking
            self._socket = sock
            self._address = sock.getsockname()[:2]
            if not is_loopback(self._address[0]):
                log.warning(
                    "OSC bridge listens on %s:%d, reachable from other machines%s",
                    *self._address,
                    "" if self._allowed else "; set allow_hosts to choose who may play",
                )
            self._stopping = threading.Event()
            self._unsubscribe = self.registry.subscribe(self._on_change)
            loops = {
                "receive": self._receive_loop,
                "schedule": partial(self._scheduler.run, self._stopping),
                "send": self._send_loop,
            }
            self._threads = [
                threading.Thread(target=loop, name=f"flowjam-osc-{name}", daemon=True) for name, loop in loops.items()
            ]
            for thread in self._threads:
                thread.start()

    def _bind(self, sock: socket.socket, bind_address: tuple) -> None:
        """Bind, or raise an OSError (with its errno) naming the address, the reason and the setting to change."""
        try:
            sock.bind(bind_address)
        except OSError as error:
            names = self.config.names
            other_port = f"choose another {names.port}"
            reason, fix = {
                errno.EADDRINUSE: ("the port is in use by another program (another flowjam?)", other_port),
                errno.EACCES: ("permission denied (ports below 1024 need privileges)", other_port),
                errno.EADDRNOTAVAIL: (
                    "no network interface here has that address",
                    f"set {names.host} to one of this machine's addresses, e.g. 127.0.0.1",
                ),
            }.get(error.errno, (error.strerror, f"check {names.host} and {names.port}"))
            raise OSError(error.errno, f"cannot listen for OSC on {show(bind_address[:2])}: {reason}; {fix}") from None

    def stop(self) -> None:
        """Stop the threads and close the socket (its port is free again). Safe to call twice."""
        with self._lifecycle:
            if self._socket is None:
                return
            self._unsubscribe()
            self._stopping.set()
            self._scheduler.wake()
            with self._send_ready:
                self._send_ready.notify_all()
            for thread in self._threads:
                if thread is not threading.current_thread():  # stop() from a handler: that loop ends by itself
                    thread.join()
            self._socket.close()
            self._socket = None
            self._threads = []
            self._scheduler.clear()
            self._replies.clear()
            self._pending.clear()
            self._held.clear()

    def __enter__(self) -> OscBridge:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    @property
    def address(self) -> Address:
        """The bound (host, port); the real port when the config asked for port 0."""
        if self._address is None:
            raise RuntimeError("OSC bridge not started yet: call start() first")
        return self._address

    def stats(self) -> dict:
        with self._stats_lock:
            return {
                "received": self._counts["received"],  # datagrams read, dropped ones included
                "applied": self._counts["applied"],  # messages acted on (sets, queries, prompts, ...)
                "coalesced": self._counts["coalesced"],  # knob values a newer one to the same knob replaced unapplied
                "rejected": dict(self._rejected),  # reason -> messages
                "clamped": self._counts["clamped"],  # applied, but outside the knob's range
                "dropped_hosts": self._counts["dropped_hosts"],
                "scheduled": self._counts["scheduled"],  # bundle messages held for a future timetag
                "feedback_sent": self._counts["feedback_sent"],
                "replies_dropped": self._counts["replies_dropped"],
                "receive_buffer_bytes": self._receive_buffer_bytes,
                "last_message": self._last_message,
                "last_error": self._last_error,
            }

    # receive thread

    def _receive_loop(self) -> None:
        sock = self._socket
        while not self._stopping.is_set():
            readable, _, _ = select.select([sock], [], [], RECEIVE_POLL_S)
            if readable:
                self._receive_batch(sock)

    def _receive_batch(self, sock: socket.socket) -> None:
        """Read what the socket holds (up to MAX_BATCH datagrams), then apply what is left of the knob values."""
        knob_sets: dict[str, KnobSet] = {}
        received = 0
        while received < MAX_BATCH:
            try:
                datagram, sender = sock.recvfrom(65536)
            except BlockingIOError:
                break
            except OSError as error:  # Windows reports an earlier send's ICMP "port unreachable" here
                if not self._stopping.is_set():
                    self._reject("socket_error", f"OSC receive failed: {error}")
                    time.sleep(RECEIVE_POLL_S)
                break
            received += 1
            self._on_datagram(datagram, sender[:2], time.perf_counter(), knob_sets)
        self._apply_knob_sets(knob_sets)
        self._count("received", received)  # after applying: a caller that sees the count sees its effects

    def _on_datagram(self, datagram: bytes, sender: Address, received_at: float, knob_sets: dict[str, KnobSet]) -> None:
        """A knob value waits in `knob_sets` (the newest per knob, in arrival order) until the batch ends or another
        message comes, which applies after the values read before it."""
        if self._allowed is not None and sender[0] not in self._allowed:
            self._count("dropped_hosts")
            self._log_once(
                "dropped_hosts", f"OSC from {sender[0]} dropped: not in allow_hosts {self.config.allow_hosts}"
            )
            return
        fader = one_number(datagram)
        knob = self._knob_of(*fader) if fader is not None else None
        if knob is not None:
            self._last_sender = sender
            if knob_sets.pop(knob, None) is not None:
                self._count("coalesced")
            knob_sets[knob] = KnobSet(fader[0], fader[1], sender, received_at)
            return
        try:
            packet = parse(datagram)
        except Exception as error:
            self._reject(
                "malformed", f"OSC datagram from {show(sender)} is not valid OSC ({len(datagram)} bytes): {error}"
            )
            return
        self._last_sender = sender
        self._apply_knob_sets(knob_sets)
        if isinstance(packet, Bundle):
            self._on_bundle(packet, sender, received_at, time.time())
        else:
            self._on_message(packet.address, packet.params, sender, received_at)

    def _knob_of(self, address: str, value: float) -> str | None:
        """The knob `address` sets to `value`, if a newer value makes this one moot: a known knob (knob/<name> or
        norm/<name>) and a finite number, so the set cannot be rejected. None for anything else."""
        if not address.startswith(self._prefix) or not math.isfinite(value):
            return None
        kind, _, name = address[len(self._prefix) :].partition("/")
        return name if kind in ("knob", "norm") and name in self.registry.specs else None

    def _apply_knob_sets(self, knob_sets: dict[str, KnobSet]) -> None:
        for knob_set in knob_sets.values():
            self._on_message(knob_set.address, [knob_set.value], knob_set.sender, knob_set.received_at)
        knob_sets.clear()

    def _on_bundle(self, bundle: Bundle, sender: Address, received_at: float, now_epoch: float) -> None:
        """Contents timetagged now or earlier (or "immediately") apply at once, later ones at their time."""
        ahead_s = bundle.timestamp - now_epoch if bundle.timestamp else 0.0
        for content in bundle.contents:
            if isinstance(content, Bundle):
                self._on_bundle(content, sender, received_at, now_epoch)
            elif ahead_s <= 0:
                self._on_message(content.address, content.params, sender, received_at)
            elif ahead_s > MAX_AHEAD_S:
                self._reject(
                    "timetag_too_far",
                    f"OSC bundle from {show(sender)} is timetagged {ahead_s:.0f} s "
                    f"ahead (limit {MAX_AHEAD_S:.0f} s): is the sender's clock set?",
                )
            else:
                self._schedule(received_at + ahead_s, content, sender)

    def _schedule(self, due: float, message: OscMessage, sender: Address) -> None:
        if self._scheduler.add(due, message, sender):
            self._count("scheduled")
        else:
            self._reject(
                "schedule_full",
                f"{MAX_SCHEDULED} timetagged OSC messages already wait; dropped {message.address} {shown(message.params)}",
            )

    def _on_message(self, address: str, args: list, sender: Address, received_at: float) -> None:
        """Apply one message; never raises (the receive and scheduler threads must keep going)."""
        try:
            self._dispatch(address, args, sender, received_at)
        except Exception as error:
            self._reject(
                "internal_error",
                f"OSC message {clip(address, SHOWN_ADDRESS_CHARS)} {shown(args)} failed: {error!r}",
                exc_info=True,
            )

    def _dispatch(self, address: str, args: list, sender: Address, received_at: float) -> None:
        with self._stats_lock:
            self._last_message = f"{clip(address, SHOWN_ADDRESS_CHARS)} {shown(args)} from {show(sender)}"
        path = address[len(self._prefix) :] if address.startswith(self._prefix) else None
        kind, _, name = (path or "").partition("/")
        if kind in ("knob", "norm") and name:
            self._on_knob(kind, name, args, sender, received_at)
        elif path in PROMPT_PATHS:
            if self._one_string(address, args):
                if len(args[0]) > MAX_PROMPT_CHARS:
                    self._reject(
                        "prompt_too_long", f"OSC {address}: a prompt takes at most {MAX_PROMPT_CHARS} characters"
                    )
                else:
                    self._call("prompt", self._on_prompt, PROMPT_PATHS[path], args[0])
        elif kind == "target" and name in TARGET_COMMANDS:
            self._call("target", self._on_target, name)
        elif path == "transport":
            if self._one_string(address, args):
                if args[0] in TRANSPORT_COMMANDS:
                    self._call("transport", self._on_transport, args[0])
                else:
                    self._reject(
                        "unknown_transport",
                        f"OSC {address} {shown(args)}: commands are {', '.join(TRANSPORT_COMMANDS)}",
                    )
        elif path == "status":
            self._on_status(sender)
        elif path == "sync":
            self._on_status(sender, "sync")
        else:
            self._reject(
                "unknown_address",
                f"unknown OSC address {clip(repr(address), SHOWN_ADDRESS_CHARS)}: this bridge answers {self._prefix}"
                "knob/<name>, norm/<name>, prompt, prompt/b, prompt/negative, transport, "
                "target/capture, target/clear, status, sync",
            )

    def _on_knob(self, kind: str, name: str, args: list, sender: Address, received_at: float) -> None:
        if len(args) > 1:
            self._reject("wrong_arguments", f"OSC {self._prefix}{kind}/{name} takes one number, got {shown(args)}")
            return
        try:
            if not args:  # a query: reply to the sender only
                value = self.registry.get(name) if kind == "knob" else self.registry.normalized(name)
                self._reply(encode(f"{self._prefix}{kind}/{name}", float(value)), sender)
            else:
                self._mark_moving(name, sender, received_at)
                setter = self.registry.set if kind == "knob" else self.registry.set_normalized
                change = setter(name, args[0], origin="osc", sent_at=received_at)
                if change.clamped:
                    self._count("clamped")
                    spec = self.registry.specs[name]
                    self._log_once(
                        "clamped",
                        f"OSC {kind}/{name} {args[0]!r} is outside the range and was clamped "
                        f"to {change.value:g} (knob range [{spec.minimum:g}, {spec.maximum:g}], "
                        "norm range [0, 1])",
                    )
        except KnobError as error:
            self._reject(error.reason, f"OSC {self._prefix}{kind}/{name}: {error}")
            return
        self._count("applied")

    def announce(self, path: str, value: str | float) -> None:
        """Send `/flowjam/<session>/<path> <value>` to the feedback address and the last sender (state a
        controller shows, such as the transport)."""
        if self._socket is None:
            return
        datagram = encode(self._prefix + path, value)
        for target in self._targets(self._last_sender):
            self._reply(datagram, target)

    def _on_status(self, sender: Address, path: str = "status") -> None:
        try:
            if path == "sync":
                payload = {} if self._sync is None else self._sync()
            elif self._status is not None:
                payload = self._status()
            else:
                payload = {"session": self.config.session, "knobs": self.registry.values()}
            reply = encode(self._prefix + path, json.dumps(payload, default=str))
        except Exception as error:
            self._reject("handler_error", f"status() failed: {error!r}", exc_info=True)
            return
        for target in self._targets(sender):
            self._reply(reply, target)
        self._count("applied")

    def _mark_moving(self, name: str, sender: Address, received_at: float) -> None:
        """Remember who moves which knob (for the echo hold); only this thread writes the table."""
        if len(self._moved_at) > 256:  # senders on throwaway ports (oscsend) would grow it forever
            self._moved_at = {key: at for key, at in self._moved_at.items() if received_at - at < ECHO_HOLD_S}
        self._moved_at[(name, sender)] = received_at

    def _one_string(self, address: str, args: list) -> bool:
        if len(args) == 1 and isinstance(args[0], str):
            return True
        self._reject("wrong_arguments", f"OSC {address} takes one string, got {shown(args)}")
        return False

    def _call(self, what: str, handler: Callable | None, *args) -> None:
        if handler is None:
            self._reject("no_handler", f"OSC {what} messages are ignored: this bridge was started without on_{what}")
            return
        try:
            handler(*args)
        except Exception as error:
            self._reject("handler_error", f"on_{what}({shown(list(args))}) raised {error!r}", exc_info=True)
            return
        self._count("applied")

    # sender thread

    def _on_change(self, change: KnobChange) -> None:
        """Registry subscriber (runs on the setter's thread): keep the newest change per knob for the sender."""
        with self._send_ready:
            was_idle = not self._pending
            older = self._pending.get(change.name)
            if older is None or older.seq < change.seq:
                self._pending[change.name] = change
            if was_idle:
                self._send_ready.notify()

    def _reply(self, datagram: bytes, target: Address) -> None:
        with self._send_ready:
            if len(self._replies) >= MAX_REPLIES:
                self._replies.popleft()
                self._count("replies_dropped")
            self._replies.append((datagram, target))
            self._send_ready.notify()

    def _send_loop(self) -> None:
        next_feedback = 0.0
        while True:
            with self._send_ready:
                while True:
                    if self._stopping.is_set():
                        return
                    now = time.perf_counter()
                    wake = min(self._held.values(), default=math.inf)
                    if self._pending:
                        wake = min(wake, next_feedback)
                    if self._replies or wake <= now:
                        break
                    self._send_ready.wait(None if wake == math.inf else wake - now)
                replies = list(self._replies)
                self._replies.clear()
                changes: list[KnobChange] = []
                if self._pending and now >= next_feedback:
                    changes = list(self._pending.values())
                    self._pending.clear()
                    next_feedback = now + FEEDBACK_INTERVAL_S
            for datagram, target in replies:
                self._send(datagram, target)
            for change in changes:
                for target in self._targets(self._last_sender):
                    self._feedback(change.name, change.value, target, time.perf_counter())
            for (name, target), due in list(self._held.items()):
                if due <= time.perf_counter():
                    del self._held[(name, target)]
                    self._feedback(name, self.registry.get(name), target, time.perf_counter())

    def _feedback(self, name: str, value: float, target: Address, now: float) -> None:
        moved_at = self._moved_at.get((name, target))
        if moved_at is not None and now - moved_at < ECHO_HOLD_S:  # being moved from there: send once it rests
            self._held[(name, target)] = moved_at + ECHO_HOLD_S
            return
        self._send(encode(f"{self._prefix}knob/{name}", float(value)), target)
        self._send(encode(f"{self._prefix}norm/{name}", self.registry.specs[name].to_normalized(value)), target)
        self._count("feedback_sent")

    def _targets(self, sender: Address | None) -> list[Address]:
        return list(dict.fromkeys(a for a in (self._feedback_address, sender) if a is not None))

    def _send(self, datagram: bytes, target: Address) -> None:
        try:
            self._socket.sendto(datagram, target)
        except OSError as error:
            self._reject("send_failed", f"OSC send to {show(target)} failed: {error}")

    # bookkeeping

    def _count(self, what: str, times: int = 1) -> None:
        with self._stats_lock:
            self._counts[what] += times

    def _reject(self, reason: str, message: str, exc_info: bool = False) -> None:
        with self._stats_lock:
            self._rejected[reason] += 1
            self._last_error = message
        self._log_once(reason, message, exc_info)

    def _log_once(self, reason: str, message: str, exc_info: bool = False) -> None:
        with self._stats_lock:
            first = reason not in self._logged_reasons
            self._logged_reasons.add(reason)
        if first:
            log.warning("%s [%s: logged once, counted in stats()]", message, reason, exc_info=exc_info)

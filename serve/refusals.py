"""Every refusal the server words itself, built from the caller's own facts only: what the caller's request or
session lacks and what the host as a whole can do (its rows, its measured tick, its target), never another session's
name or settings. Those sessions belong to other players (docs/serve.md, "Who may reach a session")."""

from __future__ import annotations

from ..engine.stream import AdmissionRefused

ELSEWHERE = "create the session on another replica, or later"


def name_taken() -> str:
    """A create whose name is in use: the same words whoever holds it."""
    return 'a session of that name is playing already: pick another name, or leave "name" out for a generated one'


def unknown_session(name: str) -> str:
    """The refusal for a session this host does not hold; it names no other session."""
    return f"no session {name!r} on this host; create one with POST /sessions"


def shutting_down() -> str:
    return f"this host is shutting down: {ELSEWHERE}"


def host_full(max_sessions: int) -> str:
    return f"this host plays {max_sessions} sessions already: {ELSEWHERE}"


def one_request_length(seconds: float) -> str:
    """A create whose request length differs from the ring's (one ring, one request length)."""
    return (
        f"this host generates {seconds:g} s per request (one ring, one request length): create the session with "
        f"window_seconds={seconds:g} (or a loop that long), or on another replica"
    )


def ms(value: float) -> str:
    """A time in milliseconds as a person reads it: whole above 10 ms, two significant digits below."""
    return f"{value:.0f} ms" if value >= 10 else f"{value:.2g} ms"


def behind(interval_ms: float, target_ms: float) -> str:
    """The ring already misses its real-time need: measured, not predicted."""
    return (
        f"this host is behind: a session playing here gets a fresh latent every ~{ms(interval_ms)}, over the "
        f"{ms(target_ms)} each needs; {ELSEWHERE}"
    )


def admission(error: AdmissionRefused, caller: str, depth: int | None = None) -> str:
    """Admission control's refusal of a new session (`depth` None) or of `caller`'s deeper `depth`, with the ring's
    numbers and the caller's own; a need that another session would miss is said without its name or settings."""
    what = f"depth {depth} refused" if depth is not None else "session refused"
    joined = f"at depth {depth}" if depth is not None else "with it"
    lane, need = error.missed, error.missed.need
    assert need is not None, "admission control refuses only for a lane's need"
    ring = (
        f"{what}: {joined} this host's ring would run {error.rows} rows a tick, measured to take "
        f"~{ms(error.predicted_ms)}"
    )
    if lane.name == caller:
        missed = (
            f"this session (depth {lane.depth}, {need.steps} steps) needs a tick within "
            f"{ms(need.max_tick_ms(lane.depth))} to get a latent every {ms(need.latent_interval_ms)}"
        )
    else:
        missed = f"another session playing here would no longer get a latent every {ms(need.latent_interval_ms)}"
    fix = "keep the depth lower" if depth is not None else f"lower its depth or steps, or {ELSEWHERE}"
    return f"{ring}, but {missed}; {fix}"

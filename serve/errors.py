"""What can go wrong with a served session, each mapped to one HTTP status by the gateway."""

from __future__ import annotations


class SessionRefused(ValueError):
    """No room: admission control (the GPU could not keep every session in real time) or every replica full (503)."""


class UnknownSession(KeyError):
    """No session of that name was ever created here, or it was ended (404)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown session"


class SessionLost(RuntimeError):
    """The session's replica stopped: the session is gone and can be created again on another replica (410)."""

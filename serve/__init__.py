"""Serving sessions to remote players: a host of sessions on one shared ring (`host.py`), the HTTP/WebSocket
gateway (`gateway.py`), its Ray Serve deployment (`deployment.py`), and the small clients a laptop runs
(`client.py`, `bridge.py`, `listen.py`); `protocol.py` is the wire format they share."""

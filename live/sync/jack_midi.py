"""A MIDI clock read from a JACK MIDI port with each message's frame in its cycle: a pulse's time is the moment its
frame is played (the cycle's start plus the frame's offset), not when a MIDI thread woke up to see it (python-rtmidi's JACK backend hands
over a cycle's messages at once, up to a period late). `--sync midi --midi-backend jack` follows the clock this way."""

from __future__ import annotations

from .midi_clock import CLOCK, CONTINUE, SONG_POSITION, START, STOP, MidiClockFollower
from .unavailable import JACK_SERVER, START_JACK, ClockUnavailable

_REALTIME = {0xF8: CLOCK, 0xFA: START, 0xFB: CONTINUE, 0xFC: STOP}
_SONG_POSITION = 0xF2
FRAME_WRAP = 1 << 32


class JackMidiClockError(ClockUnavailable):
    """No JACK here (no JACK-Client, no server, no such port); the message names the fix."""


class JackMidiClock:
    def __init__(self, follower: MidiClockFollower, source: str | None = None, client_name: str = "flowjam-clock"):
        """A JACK client with one MIDI input, `clock_in`, connected to the port named `source` (a JACK port name or a
        substring of one; None: connect it yourself, e.g. in the DAW's or QjackCtl's routing)."""
        try:
            import jack
        except ImportError as error:
            raise JackMidiClockError("midi", "JACK-Client", package="JACK-Client") from error
        try:
            self._client = jack.Client(client_name, no_start_server=True)
        except jack.JackOpenError as error:
            raise JackMidiClockError("midi", JACK_SERVER, action=START_JACK) from error
        self.follower = follower
        self.errors = 0
        self.missed_cycles = 0  # process cycles this client missed (its MIDI then is lost; the follower is told)
        self._next_frame: int | None = None  # the JACK frame the next cycle starts on if none is missed
        self._port = self._client.midi_inports.register("clock_in")
        self._client.set_process_callback(self._process)
        self._client.activate()
        if source is not None:
            self._connect(source)

    @property
    def port_name(self) -> str:
        return self._port.name

    def _connect(self, source: str) -> None:
        outputs = self._client.get_ports(is_midi=True, is_output=True)
        matches = [port for port in outputs if port.name == source] or [p for p in outputs if source in p.name]
        if not matches:
            names = ", ".join(port.name for port in outputs) or "none"
            self.close()
            raise JackMidiClockError(
                "midi", f"a JACK MIDI output matching {source!r}", action=f"JACK MIDI outputs: {names}"
            )
        self._client.connect(matches[0], self._port)

    def _process(self, frames: int) -> None:
        """In JACK's process thread: each message at the time of its frame (the cycle's start time, on the sync
        clock, is the transport position's time stamp). A cycle that starts later than the last one ended was
        missed (the client was late: an xrun), and its MIDI with it; one that starts earlier was read already."""
        _, position = self._client.transport_query_struct()
        start_s, rate = position.usecs / 1e6, position.frame_rate
        frame = self._client.last_frame_time
        if self._next_frame is not None:
            missed = (frame - self._next_frame) % FRAME_WRAP  # JACK's frame counter wraps at 32 bits
            if missed >= FRAME_WRAP // 2:  # a cycle read already: after a stall JACK may run the callback twice
                return
            if missed:
                self.missed_cycles += 1
                self.follower.lost(missed / rate)
        self._next_frame = (frame + frames) % FRAME_WRAP
        for offset, buffer in self._port.incoming_midi_events():
            data = bytes(buffer)
            status = data[0]
            kind = _REALTIME.get(status)
            try:
                at_s = start_s + offset / rate
                if kind is not None:
                    self.follower.handle(kind, at_s)
                elif status == _SONG_POSITION and len(data) == 3:
                    self.follower.handle(SONG_POSITION, at_s, data[1] | (data[2] << 7))
            except Exception:  # a malformed message is counted, the clock goes on
                self.errors += 1

    def close(self) -> None:
        self._client.deactivate()
        self._client.close()

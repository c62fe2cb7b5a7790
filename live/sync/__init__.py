"""Following a band's clock: a MIDI clock (`midi_clock.py`), JACK transport (`jack_transport.py`) and an Ableton Link
session (`link.py`), each giving a `ClockState` (tempo, transport, beats) at any moment."""

"""Following a band's clock: a MIDI clock (`midi_clock.py`, read frame-exact from JACK by `jack_midi.py`), JACK
transport (`jack_transport.py`) and an Ableton Link session (`link.py`), each giving a `ClockState`; `follow.py`
opens the one `--sync` names, `lock.py` keeps the loop on its bar lines, `grid.py` holds the bar arithmetic, and
`band.py` is the band `bench sync` plays with."""

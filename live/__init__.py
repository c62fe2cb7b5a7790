"""Real time: knob registry, runner thread, playback, OSC bridge, MIDI. Nothing here is imported by the engine."""

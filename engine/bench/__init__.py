"""Engine benchmarks that print numbers: DiT forwards and stream ticks against the FLOP bound, the 5 Hz LM."""

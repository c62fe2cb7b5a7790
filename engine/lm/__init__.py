"""Audio-code generation with the 5 Hz LM: prompt strings, sampling math, the batched decode engine, metadata."""

"""Everything around the 5 Hz LM network (models/lm.py): checkpoint loading, vocabulary, prompt strings, sampling
math, Phase 1 metadata, the batched Phase 2 code engine, the song writer that chains them, and its benchmark."""

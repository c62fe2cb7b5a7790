"""Audio in and out: files (read, write, resample), windowed VAE decodes, crossfaded stitching."""

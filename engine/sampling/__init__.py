"""Flow-matching sampling math, model-free: timestep schedules, the per-step solver, per-frame curves."""

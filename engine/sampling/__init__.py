"""Flow-matching sampling math, model-free: timestep schedules, the per-step solver, per-frame curves, and one
slot's step (guidance, then a solver step) as a function of its state (step.py)."""

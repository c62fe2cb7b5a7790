"""The ring of in-flight generations. `StreamPipeline` and the request types are the public face; import them from
here. One job per module:

- `requests.py`: what a stream is asked for and delivers (`SlotRequest`, `DCW`, `ExtraCondition`, `Finished`), the
  seeded noise, request validation.
- `pipeline.py`: `StreamPipeline`: configuration, submitting, the tick, the timestep-embedding cache, stats.
- `lanes.py`: slots and lanes (a session's share of the ring), admission control, `StreamLane`.
- `batch.py`: a tick's rows, their layout by condition, per-lane LoRA strengths.
- `graph_step.py`, `tick_graph.py`: the CUDA-graph path (static tensors, tick plans) and its capture and replay.
- `windows.py`: windows on a timeline (a request placed at the playhead, the timeline of written latents);
  `walker.py`: a stream's requests walking with the playhead on it.
- `backends.py`: how the DiT runs (eager, compiled, graphs); `pinned.py`: host-to-device copies.

Each slot's step (guidance, solver, x0 target) is model-free and lives in `engine/sampling/step.py`."""

from .lanes import MAX_DEPTH, MAX_LANES, AdmissionRefused, RealtimeNeed, StreamLane
from .pipeline import StreamPipeline
from .requests import DCW, ExtraCondition, Finished, SlotRequest, seeded_noise, step_seed
from .windows import Timeline, WindowPlace, place_window

__all__ = [
    "DCW",
    "MAX_DEPTH",
    "MAX_LANES",
    "AdmissionRefused",
    "ExtraCondition",
    "Finished",
    "RealtimeNeed",
    "SlotRequest",
    "StreamLane",
    "StreamPipeline",
    "Timeline",
    "WindowPlace",
    "place_window",
    "seeded_noise",
    "step_seed",
]

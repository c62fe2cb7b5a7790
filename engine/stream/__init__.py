"""The ring of in-flight generations: request types, the pipeline and its tick, lanes with admission control, and
the CUDA-graph path. `StreamPipeline` and the request types are the public face; import them from here."""

from .pipeline import (
    DCW,
    MAX_DEPTH,
    MAX_LANES,
    AdmissionRefused,
    ExtraCondition,
    Finished,
    RealtimeNeed,
    SlotRequest,
    StreamLane,
    StreamPipeline,
    seeded_noise,
    step_seed,
)

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
    "seeded_noise",
    "step_seed",
]

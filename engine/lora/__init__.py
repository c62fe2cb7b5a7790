"""LoRAs for the DiT decoder: reading the files users have (formats.py), what one holds (adapter.py), the deltas a
layer carries (deltas.py), playing strengths live (attached.py) either unmerged in every tick (unmerged.py) or
folded into the weights on the tick after a change (folded.py), and merging one that stays, exactly reversibly
(merged.py)."""

from .adapter import Kronecker, LoraAdapter, LowRank, check_fits
from .attached import LIVE_MODES, MAX_LORAS, STRENGTH_RANGE, LoraSet, lora_set, refresh_folds, structure_lock
from .formats import read_lora
from .merged import MergedLora, merge, unmerge
from .unmerged import LoraLinear

__all__ = [
    "LIVE_MODES",
    "MAX_LORAS",
    "STRENGTH_RANGE",
    "Kronecker",
    "LoraAdapter",
    "LoraLinear",
    "LoraSet",
    "LowRank",
    "MergedLora",
    "check_fits",
    "lora_set",
    "merge",
    "read_lora",
    "refresh_folds",
    "structure_lock",
    "unmerge",
]

"""LoRAs for the DiT decoder: reading the files users have (formats.py), what one holds (adapter.py), playing its
strength live without recompiling (unmerged.py) and merging one that stays, exactly reversibly (merged.py)."""

from .adapter import Kronecker, LoraAdapter, LowRank, check_fits
from .formats import read_lora
from .merged import MergedLora, merge, unmerge
from .unmerged import MAX_LORAS, STRENGTH_RANGE, LoraLinear, LoraSet, lora_set

__all__ = [
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
    "unmerge",
]

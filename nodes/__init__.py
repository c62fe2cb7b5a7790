"""flowjam's ComfyUI nodes: declarations in `spec.py` form, exposed through ComfyUI's V3 schema (`comfy_v3.py`)
when the running ComfyUI offers it, else as classic node classes (`comfy_v1.py`)."""

from __future__ import annotations

from .control_nodes import NODES as CONTROL_NODES
from .lm_nodes import NODES as LM_NODES
from .lora_nodes import NODES as LORA_NODES
from .model_nodes import NODES as MODEL_NODES
from .spec import NodeSpec
from .stream_nodes import NODES as STREAM_NODES

NODE_SPECS: tuple[NodeSpec, ...] = MODEL_NODES + LORA_NODES + LM_NODES + STREAM_NODES + CONTROL_NODES

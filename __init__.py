"""flowjam: ACE-Step 1.5 as a playable instrument (ComfyUI node pack + engine). Imports nothing heavy.

Inside a ComfyUI that offers the V3 schema API (`comfy_api.latest`), the nodes are registered through
`comfy_entrypoint`; elsewhere (older ComfyUI, or no ComfyUI at all) as classic NODE_CLASS_MAPPINGS."""

try:
    from comfy_api.latest import ComfyExtension as _ComfyExtension  # noqa: F401
except ImportError:
    from .nodes.comfy_v1 import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

    __all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
else:
    from .nodes.comfy_v3 import comfy_entrypoint

    __all__ = ["comfy_entrypoint", "WEB_DIRECTORY"]

WEB_DIRECTORY = "./web"

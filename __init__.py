"""flowjam: ACE-Step 1.5 as a playable instrument (ComfyUI node pack + engine). Imports nothing heavy."""

NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]

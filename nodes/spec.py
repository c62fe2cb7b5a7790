"""Node declarations independent of any ComfyUI API version: inputs, outputs, tooltips and a plain function.

`comfy_v3.py` turns them into ComfyUI V3 schema nodes (`comfy_api.latest.io`), `comfy_v1.py` into classic node
classes; the tests validate the declarations and call the functions with ComfyUI absent."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Socket types flowjam adds; AUDIO and LATENT are ComfyUI's own.
MODEL = "FLOWJAM_MODEL"
CONDITIONING = "FLOWJAM_CONDITIONING"
SOURCE = "FLOWJAM_SOURCE"
CURVE = "FLOWJAM_CURVE"
STREAM = "FLOWJAM_STREAM"
STRUCTURE = "FLOWJAM_STRUCTURE"
AUDIO = "AUDIO"
LATENT = "LATENT"
WIDGET_TYPES = ("FLOAT", "INT", "STRING", "BOOLEAN", "COMBO")
SOCKET_TYPES = (MODEL, CONDITIONING, SOURCE, STRUCTURE, CURVE, STREAM, AUDIO, LATENT)
WIDGET_VALUES = {  # a widget type -> the Python values it takes, and how an error names them
    "BOOLEAN": ((bool,), "true or false (a JSON boolean, not a string)"),
    "INT": ((int,), "a whole number"),
    "FLOAT": ((int, float), "a number"),
    "STRING": ((str,), "text"),
}
CATEGORY = "audio/flowjam"
RESULT_UI_KEY = "flowjam_result"  # web/flowjam.js shows the text a node sends under this key as a toast


class NodeInputError(ValueError):
    """Bad input to a node: the message names the node, the input and the fix.

    ComfyUI shows an error's type as `module.qualname`, and it imports a pack under its folder's full path, so this
    would read `/home/.../custom_nodes/flowjam.nodes.spec.NodeInputError`; the pack's name reads plainly."""

    __module__ = "flowjam"


@dataclass(frozen=True)
class Param:
    name: str
    type: str
    tooltip: str
    default: Any = None
    minimum: float | None = None
    maximum: float | None = None
    step: float | None = None
    options: tuple[str, ...] | Callable[[], tuple[str, ...]] = ()
    multiline: bool = False
    optional: bool = False
    legacy: tuple[str, ...] = ()  # COMBO values older saved graphs hold: accepted, no longer offered

    def choices(self) -> tuple[str, ...]:
        return tuple(self.options()) if callable(self.options) else tuple(self.options)

    def accepts(self, value: Any) -> bool:
        return value in self.choices() or value in self.legacy


@dataclass(frozen=True)
class Output:
    type: str
    name: str
    tooltip: str = ""


@dataclass(frozen=True)
class NodeSpec:
    node_id: str
    display_name: str
    category: str
    description: str
    inputs: tuple[Param, ...]
    outputs: tuple[Output, ...]
    function: Callable[..., tuple]
    output_node: bool = False
    always_run: bool = False  # live nodes re-execute on every queue so a re-queue updates the stream
    shows_result: bool = False  # its one STRING output is also sent to the browser, which shows it (web/flowjam.js)
    hidden_unique_id: bool = False  # the function also takes `unique_id`, the node's id in its graph (None without)

    def call(self, **values: Any) -> tuple:
        """Run the node function with defaults filled in for missing optional widget inputs, outside the
        torch.inference_mode ComfyUI runs nodes in: the models, LoRA strengths and stream state made here are
        updated in place later by the live threads, which inference tensors would refuse (grad stays off)."""
        import torch

        arguments = {p.name: values.get(p.name, p.default) for p in self.inputs}
        problem = self.type_problem(arguments)
        if problem:
            raise NodeInputError(problem)
        if self.hidden_unique_id:
            arguments["unique_id"] = values.get("unique_id")
        with torch.inference_mode(False), torch.no_grad():
            result = self.function(**arguments)
        if not isinstance(result, tuple) or len(result) != len(self.outputs):
            raise TypeError(
                f"{self.node_id} returned {type(result).__name__} of wrong arity for {len(self.outputs)} outputs"
            )
        return result

    def ui(self, result: tuple) -> dict[str, list] | None:
        """What ComfyUI sends the browser in its `executed` event for this node's `result` (None: nothing)."""
        return {RESULT_UI_KEY: [result[0]]} if self.shows_result else None

    def type_problem(self, values: dict[str, Any]) -> str | None:
        """Why an input's value is of the wrong kind (None: none is). A prompt posted to /prompt reaches the node
        as written: "false" in a BOOLEAN widget is a true string, a text where a socket wants a node's output is
        not that output."""
        node = self.display_name.removeprefix("flowjam ")
        for param in self.inputs:
            value = values.get(param.name)
            if value is None:
                continue
            if param.type in WIDGET_VALUES:
                kinds, wanted = WIDGET_VALUES[param.type]
                if not isinstance(value, kinds) or (param.type != "BOOLEAN" and isinstance(value, bool)):
                    return f"{node}: input '{param.name}' takes {wanted}, got {value!r}"
            elif param.type in SOCKET_TYPES and param.type != STREAM and isinstance(value, (str, int, float, bool)):
                return (
                    f"{node}: input '{param.name}' takes the {param.type} output of another node, got the value "
                    f'{value!r}; connect it to a node\'s output (in a /prompt body: ["<node id>", <output index>])'
                )
        return None

    def combo_problem(self, values: dict[str, Any]) -> str | None:
        """Why a COMBO value is refused (None: every one is an option or a legacy value): ComfyUI checks a classic
        combo's value only when no VALIDATE_INPUTS takes it, and a V3 combo's only in the browser."""
        for param in self.inputs:
            if param.type == "COMBO" and param.name in values and not param.accepts(values[param.name]):
                node = self.display_name.removeprefix("flowjam ")
                choices = ", ".join(param.choices())
                return f"{node}: input '{param.name}' must be one of {choices}, got {values[param.name]!r}"
        return None


def check_range(
    node: str, name: str, value: float, minimum: float | None = None, maximum: float | None = None
) -> float:
    """Validate a numeric input; the error names the node, the input and the allowed range."""
    bounds = f"{'-inf' if minimum is None else f'{minimum:g}'} .. {'inf' if maximum is None else f'{maximum:g}'}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise NodeInputError(f"{node}: input '{name}' is not a finite number ({value!r}); give one in {bounds}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise NodeInputError(f"{node}: input '{name}' = {value} is outside {bounds}")
    return value

"""Node declarations independent of any ComfyUI API version: inputs, outputs, tooltips and a plain function.

`comfy_v3.py` turns them into ComfyUI V3 schema nodes (`comfy_api.latest.io`), `comfy_v1.py` into classic node
classes; the tests validate the declarations and call the functions with ComfyUI absent."""

from __future__ import annotations

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
CATEGORY = "audio/flowjam"


class NodeInputError(ValueError):
    """Bad input to a node: the message names the node, the input and the fix."""


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

    def choices(self) -> tuple[str, ...]:
        return tuple(self.options()) if callable(self.options) else tuple(self.options)


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
    hidden_unique_id: bool = False

    def call(self, **values: Any) -> tuple:
        """Run the node function with defaults filled in for missing optional widget inputs."""
        arguments = {p.name: values.get(p.name, p.default) for p in self.inputs}
        result = self.function(**arguments)
        if not isinstance(result, tuple) or len(result) != len(self.outputs):
            raise TypeError(
                f"{self.node_id} returned {type(result).__name__} of wrong arity for {len(self.outputs)} outputs"
            )
        return result


def check_range(
    node: str, name: str, value: float, minimum: float | None = None, maximum: float | None = None
) -> float:
    """Validate a numeric input; the error names the node, the input and the allowed range."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or value != value
        or value in (float("inf"), float("-inf"))
    ):
        raise NodeInputError(f"{node}: input '{name}' must be a finite number, got {value!r}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        bounds = f"{'-inf' if minimum is None else minimum} .. {'inf' if maximum is None else maximum}"
        raise NodeInputError(f"{node}: input '{name}' = {value} is outside {bounds}")
    return value

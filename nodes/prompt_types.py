"""A posted prompt's true/false widgets checked as posted, before ComfyUI converts them.

ComfyUI's /prompt validation turns a BOOLEAN widget's value into `bool(value)` before any node sees it, so
`"endless": "false"` reached the Stream node as True and started an endless stream. `refuse_text_booleans` runs as
one of ComfyUI's on_prompt handlers (registered with the web routes): a flowjam node's BOOLEAN input given anything
but true or false is wrapped so that ComfyUI's own conversion raises, and /prompt answers 400 naming the input."""

from __future__ import annotations

from typing import Any


class RefusedBoolean(str):
    """A posted value a true/false widget refuses: reads as the text posted (in ComfyUI's error body), but its
    truth raises the node's message, so ComfyUI's BOOLEAN conversion refuses the prompt naming the input."""

    problem: str

    def __new__(cls, posted: Any, problem: str) -> RefusedBoolean:
        value = super().__new__(cls, posted if isinstance(posted, str) else repr(posted))
        value.problem = problem
        return value

    def __bool__(self) -> bool:
        raise ValueError(self.problem)


def refuse_text_booleans(json_data: Any) -> Any:
    """ComfyUI on_prompt handler: every flowjam node's BOOLEAN input whose posted value is not a JSON boolean (nor a
    link) becomes a `RefusedBoolean`; -> the same body."""
    from . import NODE_SPECS

    prompt = json_data.get("prompt") if isinstance(json_data, dict) else None
    if not isinstance(prompt, dict):
        return json_data
    specs = {spec.node_id: spec for spec in NODE_SPECS}
    for node in prompt.values():
        spec = specs.get(node.get("class_type")) if isinstance(node, dict) else None
        inputs = node.get("inputs") if spec is not None else None
        if not isinstance(inputs, dict):
            continue
        for param in spec.inputs:
            value = inputs.get(param.name)
            if isinstance(value, dict) and "__value__" in value:  # ComfyUI's wrapping of a widget value
                value = value["__value__"]
            if param.type != "BOOLEAN" or value is None or isinstance(value, (bool, list, RefusedBoolean)):
                continue
            inputs[param.name] = RefusedBoolean(value, spec.type_problem({param.name: value}))
    return json_data

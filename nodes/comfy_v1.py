"""Classic ComfyUI node classes (INPUT_TYPES / RETURN_TYPES / FUNCTION) built from the declarations.

Used when the running ComfyUI has no V3 schema API, and by the tests (these classes import without ComfyUI). Inside
a ComfyUI server, importing this module also adds the live panel's routes (the V3 path adds them in its entry
point)."""

from __future__ import annotations

import inspect
from typing import Any

from . import NODE_SPECS
from .spec import NodeSpec, Param


def widget(param: Param) -> tuple:
    """A Param as a classic INPUT_TYPES entry."""
    options: dict[str, Any] = {"tooltip": param.tooltip}
    if param.type == "COMBO":
        choices = list(param.choices())
        return choices, {**options, "default": param.default if param.default in choices else choices[0]}
    if param.default is not None:
        options["default"] = param.default
    for key, value in (("min", param.minimum), ("max", param.maximum), ("step", param.step)):
        if value is not None:
            options[key] = value
    if param.type == "STRING":
        options["multiline"] = param.multiline
    return param.type, options


def node_class(spec: NodeSpec) -> type:
    def input_types(cls) -> dict:
        required = {p.name: widget(p) for p in spec.inputs if not p.optional}
        optional = {p.name: widget(p) for p in spec.inputs if p.optional}
        hidden = {"hidden": {"unique_id": "UNIQUE_ID"}} if spec.hidden_unique_id else {}
        return {"required": required, "optional": optional, **hidden}

    def run(self, **values: Any) -> tuple | dict:
        result = spec.call(**values)
        ui = spec.ui(result)
        return result if ui is None else {"ui": ui, "result": result}

    attributes: dict[str, Any] = {
        "INPUT_TYPES": classmethod(input_types),
        "RETURN_TYPES": tuple(o.type for o in spec.outputs),
        "RETURN_NAMES": tuple(o.name for o in spec.outputs),
        "OUTPUT_TOOLTIPS": tuple(o.tooltip for o in spec.outputs),
        "FUNCTION": "run",
        "CATEGORY": spec.category,
        "DESCRIPTION": spec.description,
        "OUTPUT_NODE": spec.output_node,
        "run": run,
        "SPEC": spec,
    }
    if spec.always_run:
        attributes["IS_CHANGED"] = classmethod(lambda cls, **_: float("nan"))
    if any(p.legacy for p in spec.inputs):
        attributes["VALIDATE_INPUTS"] = legacy_validator(spec)
    return type(spec.node_id, (), attributes)


def legacy_validator(spec: NodeSpec) -> classmethod:
    """VALIDATE_INPUTS for the combos with legacy values. ComfyUI refuses a combo value outside the listed options
    unless VALIDATE_INPUTS names that input (it reads the names off the signature: naming only these keeps its own
    checks of every other input), so an old saved graph reaches the node, which says what to pick instead."""

    def validate(cls, **values: Any) -> bool | str:
        return spec.combo_problem(values) or True

    names = [p.name for p in spec.inputs if p.legacy]
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    validate.__signature__ = inspect.Signature([inspect.Parameter(n, kind) for n in ("cls", *names)])
    return classmethod(validate)


NODE_CLASS_MAPPINGS = {spec.node_id: node_class(spec) for spec in NODE_SPECS}
NODE_DISPLAY_NAME_MAPPINGS = {spec.node_id: spec.display_name for spec in NODE_SPECS}


def register_web_routes() -> bool:
    """The live panel's routes (nodes/web_routes.py) on ComfyUI's server when one runs this pack; -> whether they
    were added now (False without ComfyUI, or when the V3 entry point or an earlier call added them)."""
    try:
        from server import PromptServer
    except ImportError:
        return False
    if getattr(PromptServer, "instance", None) is None:
        return False
    from . import web_routes

    return web_routes.register()


register_web_routes()

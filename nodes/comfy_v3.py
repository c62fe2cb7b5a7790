"""ComfyUI V3 schema nodes (`comfy_api.latest.io.ComfyNode`) built from the declarations; needs ComfyUI."""

from __future__ import annotations

from typing import Any

from comfy_api.latest import ComfyExtension, io

from . import NODE_SPECS
from .spec import NodeInputError, NodeSpec, Output, Param

_SOCKETS = {"AUDIO": io.Audio, "LATENT": io.Latent, "STRING": io.String}


def _input(param: Param):
    common = dict(optional=param.optional, tooltip=param.tooltip)
    if param.type == "FLOAT":
        return io.Float.Input(
            param.name, default=param.default, min=param.minimum, max=param.maximum, step=param.step, **common
        )
    if param.type == "INT":
        return io.Int.Input(
            param.name, default=param.default, min=param.minimum, max=param.maximum, step=param.step, **common
        )
    if param.type == "STRING":
        return io.String.Input(param.name, default=param.default, multiline=param.multiline, **common)
    if param.type == "BOOLEAN":
        return io.Boolean.Input(param.name, default=param.default, **common)
    if param.type == "COMBO":
        choices = list(param.choices())
        return io.Combo.Input(
            param.name, options=choices, default=param.default if param.default in choices else choices[0], **common
        )
    return _SOCKETS.get(param.type, io.Custom(param.type)).Input(param.name, **common)


def _output(output: Output):
    return _SOCKETS.get(output.type, io.Custom(output.type)).Output(
        display_name=output.name, tooltip=output.tooltip or None
    )


def node_class(spec: NodeSpec) -> type:
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id=spec.node_id,
            display_name=spec.display_name,
            category=spec.category,
            description=spec.description,
            inputs=[_input(p) for p in spec.inputs],
            outputs=[_output(o) for o in spec.outputs],
            is_output_node=spec.output_node,
            not_idempotent=spec.always_run,
            hidden=[io.Hidden.unique_id] if spec.hidden_unique_id else [],
        )

    def execute(cls, **values: Any) -> io.NodeOutput:
        problem = spec.combo_problem(values)  # ComfyUI (0.3.6x) checks V3 combo values only in the browser
        if problem:
            raise NodeInputError(problem)
        if spec.hidden_unique_id:
            values["unique_id"] = cls.hidden.unique_id
        result = spec.call(**values)
        return io.NodeOutput(*result, ui=spec.ui(result))

    attributes: dict[str, Any] = {
        "define_schema": classmethod(define_schema),
        "execute": classmethod(execute),
        "SPEC": spec,
    }
    if spec.always_run:
        attributes["fingerprint_inputs"] = classmethod(lambda cls, **_: float("nan"))
    return type(spec.node_id, (io.ComfyNode,), attributes)


class FlowjamExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return [node_class(spec) for spec in NODE_SPECS]


async def comfy_entrypoint() -> FlowjamExtension:
    from . import web_routes

    web_routes.register()
    return FlowjamExtension()

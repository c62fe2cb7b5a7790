"""Validate and run ComfyUI UI-format workflows (the JSON the browser saves and loads by drag-and-drop) without
ComfyUI, and convert them to the API prompt format that ComfyUI's POST /prompt takes.

flowjam's nodes are the real classic node classes (`nodes.comfy_v1.NODE_CLASS_MAPPINGS`). ComfyUI's own LoadAudio,
SaveAudio and PreviewAudio are small stand-ins with the same inputs, outputs and widgets as ComfyUI's definitions
(comfy_extras/nodes_audio.py) that read and write WAV files through `engine.audio.files`; nothing else of ComfyUI is
imitated.

Widget serialisation, as the ComfyUI frontend does it (checked by loading the shipped workflows into frontends
1.27.10 and 1.58.1 and comparing their graphToPrompt output with `to_api_format`):
- `widgets_values` holds the node's widget inputs in declaration order, required before optional, sockets skipped
  (a node without widgets may omit it).
- An INT widget named "seed" or "noise_seed" (or one declaring `control_after_generate`) gets a frontend-only
  combo right after it, `control_after_generate` = fixed | increment | decrement | randomize, which is saved in
  `widgets_values` but never sent to the server. flowjam's workflows use "fixed" (a re-queued stream must keep its
  seed); this runner requires the value and drops it when executing or converting.
- LoadAudio (`audio_upload`) gets a frontend-only "upload" button, saved as "" after the file name (1.58); 1.27
  also saves the audio player widget ("audioUI") as null in between: [file, null, ""]. Both are accepted; the
  shipped workflows use the 1.58 layout. SaveAudio/PreviewAudio's player widget is not saved.
- flowjam's own frontend extension (web/flowjam.js) adds a live panel widget to FlowjamStream that frontends save
  as a trailing "": accepted, never written by the shipped workflows.
- `node["inputs"]` lists the socket inputs (a widget converted to an input also appears, with "widget": {"name"});
  a link to a widget input overrides the widget's value.
- A muted (mode 2) or bypassed (mode 4) node is left out of the prompt (graphToPrompt, 1.27.10); this runner neither
  runs nor converts one, and refuses one that feeds another node (the frontend would reroute a bypassed node's
  links, which is not imitated here).
- A classic COMBO value outside its options is refused (ComfyUI's "Value not in list") unless the class's
  VALIDATE_INPUTS names that input: then VALIDATE_INPUTS decides, as in ComfyUI's execution.validate_inputs.

Layout, as LiteGraph draws a node in frontend 1.27.10: `pos` is the top-left corner of the body and the title bar
(30 px) sits above it; a body shorter than its slots and widgets need grows to fit them when the graph loads. The
helpers at the end of this file measure that, and draw template thumbnails from the same boxes.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowjam.nodes.comfy_v1 import NODE_CLASS_MAPPINGS as FLOWJAM_CLASSES

WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")
CONTROL_AFTER_GENERATE = "control_after_generate"
CONTROL_VALUES = ("fixed", "increment", "decrement", "randomize")
SEED_NAMES = ("seed", "noise_seed")
VIRTUAL_NODES = ("Note", "MarkdownNote")  # frontend-only: never executed, never sent to the server
SKIPPED_MODES = {2: "muted", 4: "bypassed"}  # left out of the prompt by the frontend; 0 runs
AUDIO_EXTENSIONS = (".wav", ".flac", ".mp3", ".ogg", ".opus", ".m4a", ".aac", ".webm")


class WorkflowError(ValueError):
    """A workflow that ComfyUI would refuse to load or queue; the message lists every problem."""


@dataclass(frozen=True)
class Widget:
    name: str
    type: str  # INT, FLOAT, STRING, BOOLEAN, COMBO, or frontend-only: CONTROL, BUTTON, DOM
    options: dict[str, Any]
    choices: tuple[Any, ...] = ()
    frontend_only: bool = False  # saved in widgets_values, not an input of the node's function


FRONTEND_CONTROL = Widget(CONTROL_AFTER_GENERATE, "CONTROL", {}, CONTROL_VALUES, frontend_only=True)
UPLOAD_BUTTON = Widget("upload", "BUTTON", {}, frontend_only=True)
AUDIO_PLAYER = Widget("audioUI", "DOM", {}, frontend_only=True)
EXTENSION_WIDGETS = {"FlowjamStream": (Widget("flowjam_live_panel", "DOM", {}, frontend_only=True),)}  # web/flowjam.js


@dataclass(frozen=True)
class Socket:
    name: str
    type: str
    optional: bool


@dataclass(frozen=True)
class NodeDef:
    type: str
    sockets: tuple[Socket, ...]
    widgets: tuple[Widget, ...]  # in widgets_values order, frontend-only ones included: the layout written here
    outputs: tuple[str, ...]
    output_names: tuple[str, ...]
    output_node: bool
    cls: type
    alternatives: tuple[tuple[Widget, ...], ...] = ()  # other layouts frontends save (distinct lengths)
    validated: tuple[str, ...] = ()  # inputs the class's VALIDATE_INPUTS takes: ComfyUI lets it judge their values

    def widget_problem(self, widget: Widget, value: Any) -> str | None:
        """Why ComfyUI would refuse this saved widget value (None: fine)."""
        if widget.name in self.validated and not widget.frontend_only:
            verdict = self.cls.VALIDATE_INPUTS(**{widget.name: value})
            return None if verdict is True else str(verdict)
        return widget_problem(widget, value)

    def layout(self, values: list) -> tuple[Widget, ...] | None:
        """The widget layout a saved `widgets_values` follows (None: no known layout has that many values)."""
        return next((layout for layout in (self.widgets, *self.alternatives) if len(layout) == len(values)), None)

    def socket(self, name: str) -> Socket | None:
        return next((s for s in self.sockets if s.name == name), None)

    def widget(self, name: str) -> Widget | None:
        return next((w for w in self.widgets if w.name == name and not w.frontend_only), None)

    def widget_index(self, name: str, values: list | None = None) -> int:
        """Where widget `name` sits in `values` (default: in the layout written here)."""
        layout = self.widgets if values is None else self.layout(values)
        for index, widget in enumerate(layout or ()):
            if widget.name == name and not widget.frontend_only:
                return index
        raise KeyError(f"{self.type} has no widget {name!r} in a layout of {len(values or layout or ())} values")


def definition_of(node_type: str, cls: type) -> NodeDef:
    """A classic node class (INPUT_TYPES / RETURN_TYPES) as sockets and widgets, the way the frontend lays it out."""
    spec = cls.INPUT_TYPES()
    sockets: list[Socket] = []
    widgets: list[Widget] = []
    for section in ("required", "optional"):
        for name, entry in (spec.get(section) or {}).items():
            kind, options = entry[0], (entry[1] if len(entry) > 1 else {}) or {}
            if isinstance(kind, (list, tuple)):
                widgets.append(Widget(name, "COMBO", options, tuple(kind)))
            elif kind in WIDGET_TYPES:
                widgets.append(Widget(name, kind, options))
            else:
                sockets.append(Socket(name, kind, section == "optional"))
                continue
            if kind == "INT" and (options.get(CONTROL_AFTER_GENERATE) or name in SEED_NAMES):
                widgets.append(FRONTEND_CONTROL)
    alternatives = []
    uploads = [i for i, w in enumerate(widgets) if w.type == "COMBO" and w.options.get("audio_upload")]
    if uploads:  # LoadAudio: 1.58 [file, ""], 1.27 [file, null, ""], old saves [file]
        at = uploads[0] + 1
        alternatives = [widgets[:at] + [AUDIO_PLAYER, UPLOAD_BUTTON] + widgets[at:], list(widgets)]
        widgets = widgets[:at] + [UPLOAD_BUTTON] + widgets[at:]
    if node_type in EXTENSION_WIDGETS:
        alternatives.append(widgets + list(EXTENSION_WIDGETS[node_type]))
    outputs = tuple(cls.RETURN_TYPES)
    names = tuple(getattr(cls, "RETURN_NAMES", None) or outputs)
    validate = getattr(cls, "VALIDATE_INPUTS", None)
    return NodeDef(
        node_type,
        tuple(sockets),
        tuple(widgets),
        outputs,
        names,
        bool(getattr(cls, "OUTPUT_NODE", False)),
        cls,
        tuple(tuple(layout) for layout in alternatives),
        tuple(inspect.getfullargspec(validate).args[1:]) if validate else (),
    )


# ---- stand-ins for ComfyUI's audio nodes ---------------------------------------------------------------------------


def _check_audio(node: str, audio: Any) -> None:
    """What ComfyUI's save_audio relies on: {"waveform": [B, C (1 or 2), N] float tensor, "sample_rate": int}."""
    import torch

    if not isinstance(audio, dict) or not {"waveform", "sample_rate"} <= set(audio):
        raise TypeError(f"{node}: AUDIO must be a dict with waveform and sample_rate, got {type(audio).__name__}")
    waveform, rate = audio["waveform"], audio["sample_rate"]
    if not isinstance(waveform, torch.Tensor) or waveform.dim() != 3 or waveform.shape[1] not in (1, 2):
        raise TypeError(
            f"{node}: AUDIO waveform must be a [batch, 1 or 2, samples] tensor, got {getattr(waveform, 'shape', waveform)!r}"
        )
    if not waveform.dtype.is_floating_point:
        raise TypeError(f"{node}: AUDIO waveform must be float, got {waveform.dtype}")
    if isinstance(rate, bool) or not isinstance(rate, int) or rate <= 0:
        raise TypeError(f"{node}: AUDIO sample_rate must be a positive int, got {rate!r}")


def comfy_standins(input_dir: Path | None, output_dir: Path | None, temp_dir: Path | None) -> dict[str, type]:
    """LoadAudio / SaveAudio / PreviewAudio with ComfyUI's interfaces, reading and writing WAV in the given folders."""

    class LoadAudio:
        RETURN_TYPES = ("AUDIO",)
        FUNCTION = "load"
        CATEGORY = "audio"

        @classmethod
        def INPUT_TYPES(cls):
            files = (
                sorted(f for f in os.listdir(input_dir) if f.lower().endswith(AUDIO_EXTENSIONS)) if input_dir else []
            )
            return {"required": {"audio": (files, {"audio_upload": True})}}

        def load(self, audio: str):
            from flowjam.engine.audio.files import read_audio

            waveform, rate = read_audio(Path(input_dir) / audio)
            return ({"waveform": waveform.unsqueeze(0), "sample_rate": int(rate)},)

    class SaveAudio:
        RETURN_TYPES = ()
        FUNCTION = "save_flac"
        OUTPUT_NODE = True
        CATEGORY = "audio"
        folder, kind = output_dir, "output"

        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"audio": ("AUDIO",), "filename_prefix": ("STRING", {"default": "audio/ComfyUI"})}}

        def save_flac(self, audio, filename_prefix: str = "ComfyUI"):
            return self.save(audio, filename_prefix)

        def save(self, audio, filename_prefix: str):
            from flowjam.engine.audio.files import write_wav

            _check_audio(type(self).__name__, audio)
            if self.folder is None:
                raise RuntimeError(f"{type(self).__name__}: the runner was given no folder to write to")
            subfolder, _, stem = filename_prefix.rpartition("/")
            folder = Path(self.folder) / subfolder
            results = []
            for waveform in audio["waveform"]:
                counter = 1 + len(list(folder.glob(f"{stem}_*_.wav"))) if folder.is_dir() else 1
                write_wav(folder / f"{stem}_{counter:05}_.wav", waveform, audio["sample_rate"])
                results.append({"filename": f"{stem}_{counter:05}_.wav", "subfolder": subfolder, "type": self.kind})
            return {"ui": {"audio": results}}

    class PreviewAudio(SaveAudio):
        folder, kind = temp_dir, "temp"

        @classmethod
        def INPUT_TYPES(cls):
            return {"required": {"audio": ("AUDIO",)}}

        def save_flac(self, audio):
            return self.save(audio, "ComfyUI_temp")

    return {"LoadAudio": LoadAudio, "SaveAudio": SaveAudio, "PreviewAudio": PreviewAudio}


# ---- the runner ----------------------------------------------------------------------------------------------------


@dataclass
class Execution:
    outputs: dict[int, tuple] = field(default_factory=dict)  # node id -> the node's outputs
    inputs: dict[int, dict[str, Any]] = field(
        default_factory=dict
    )  # node id -> the keyword arguments it was called with
    ui: dict[int, dict] = field(default_factory=dict)  # output nodes' "ui" results (saved files)
    order: list[int] = field(default_factory=list)  # node ids in execution order


class WorkflowRunner:
    def __init__(self, input_dir: Path | None = None, output_dir: Path | None = None, temp_dir: Path | None = None):
        self.classes: dict[str, type] = {**FLOWJAM_CLASSES, **comfy_standins(input_dir, output_dir, temp_dir)}

    def definition(self, node_type: str) -> NodeDef:
        if node_type not in self.classes:
            raise WorkflowError(f"unknown node type {node_type!r}")
        return definition_of(node_type, self.classes[node_type])

    # -- validation --

    def problems(self, workflow: dict) -> list[str]:
        """Everything wrong with a UI-format workflow (empty: it loads and queues)."""
        problems: list[str] = []
        for key in ("last_node_id", "last_link_id", "nodes", "links", "groups", "config", "extra", "version"):
            if key not in workflow:
                problems.append(f"workflow has no {key!r}")
        if problems:
            return problems
        nodes = {}
        for node in workflow["nodes"]:
            if node["id"] in nodes:
                problems.append(f"node id {node['id']} is used twice")
            nodes[node["id"]] = node
        links = {}
        for link in workflow["links"]:
            if len(link) != 6:
                problems.append(f"link {link!r} must be [id, from_node, from_slot, to_node, to_slot, type]")
                continue
            if link[0] in links:
                problems.append(f"link id {link[0]} is used twice")
            links[link[0]] = link
        if nodes and workflow["last_node_id"] < max(nodes):
            problems.append(f"last_node_id {workflow['last_node_id']} is below node id {max(nodes)}")
        if links and workflow["last_link_id"] < max(links):
            problems.append(f"last_link_id {workflow['last_link_id']} is below link id {max(links)}")
        definitions = {}
        for node in workflow["nodes"]:
            if node["type"] in VIRTUAL_NODES:
                continue
            try:
                definitions[node["id"]] = self.definition(node["type"])
            except WorkflowError as error:
                problems.append(f"node {node['id']}: {error}")
                continue
            problems += [
                f"node {node['id']} ({node['type']}): {p}"
                for p in self._node_problems(node, definitions[node["id"]], links)
            ]
        for link_id, (_, source, source_slot, target, target_slot, link_type) in links.items():
            where = f"link {link_id}"
            if source not in definitions or target not in definitions:
                problems.append(f"{where} connects a node that does not exist or cannot run ({source} -> {target})")
                continue
            if not runs(nodes[source]) and runs(nodes[target]):
                problems.append(
                    f"{where}: {SKIPPED_MODES.get(nodes[source].get('mode'), 'skipped')} node {source} feeds node "
                    f"{target}; the frontend would reroute or drop that input, which this runner does not imitate"
                )
            produced = definitions[source].outputs
            if not 0 <= source_slot < len(produced):
                problems.append(f"{where}: node {source} has no output slot {source_slot}")
                continue
            target_inputs = nodes[target].get("inputs") or []
            if not 0 <= target_slot < len(target_inputs):
                problems.append(f"{where}: node {target} has no input slot {target_slot}")
                continue
            entry = target_inputs[target_slot]
            if entry.get("link") != link_id:
                problems.append(f"{where}: node {target} input {entry.get('name')!r} says link {entry.get('link')}")
            outputs = nodes[source].get("outputs") or []
            if source_slot >= len(outputs) or link_id not in (outputs[source_slot].get("links") or []):
                problems.append(f"{where}: node {source} output {source_slot} does not list it")
            definition = definitions[target]
            socket = definition.socket(entry.get("name"))
            widget = definition.widget(entry.get("name"))
            consumed = socket.type if socket else (widget.type if widget else None)
            if consumed is None:
                problems.append(f"{where}: {definition.type} has no input {entry.get('name')!r}")
            elif not link_type == produced[source_slot] == consumed:
                problems.append(
                    f"{where} is typed {link_type} from a {produced[source_slot]} output into a {consumed} input "
                    f"({nodes[source]['type']} -> {definition.type}.{entry.get('name')})"
                )
        for node in workflow["nodes"]:
            for entry in node.get("inputs") or []:
                if entry.get("link") is not None and entry["link"] not in links:
                    problems.append(
                        f"node {node['id']} input {entry.get('name')!r} points at missing link {entry['link']}"
                    )
            for slot, output in enumerate(node.get("outputs") or []):
                for link_id in output.get("links") or []:
                    if link_id not in links or links[link_id][1] != node["id"] or links[link_id][2] != slot:
                        problems.append(
                            f"node {node['id']} output {slot} lists link {link_id}, which does not start there"
                        )
        if not problems:
            try:
                self.order(workflow)
            except WorkflowError as error:
                problems.append(str(error))
        return problems

    def _node_problems(self, node: dict, definition: NodeDef, links: dict) -> list[str]:
        problems = []
        if node.get("mode", 0) not in (0, *SKIPPED_MODES):
            problems.append(f"mode {node.get('mode')} is not supported; use 0 (runs), 2 (muted) or 4 (bypassed)")
        properties = node.get("properties") or {}
        if properties.get("Node name for S&R") != node["type"]:
            problems.append(f"properties['Node name for S&R'] is {properties.get('Node name for S&R')!r}")
        entries = {}
        for entry in node.get("inputs") or []:
            name = entry.get("name")
            if name in entries:
                problems.append(f"input {name!r} is listed twice")
            entries[name] = entry
            socket, widget = definition.socket(name), definition.widget(name)
            if socket is None and widget is None:
                problems.append(f"input {name!r} is not an input of {definition.type}")
            elif socket is not None and entry.get("type") != socket.type:
                problems.append(f"input {name!r} is typed {entry.get('type')!r}, the node takes {socket.type}")
            elif widget is not None and entry.get("widget", {}).get("name") != name:
                problems.append(f'input {name!r} is a widget: it needs "widget": {{"name": {name!r}}}')
        for socket in definition.sockets:
            if not socket.optional and entries.get(socket.name, {}).get("link") is None:
                problems.append(f"required input {socket.name!r} ({socket.type}) is not connected")
        outputs = node.get("outputs") or []
        if [o.get("type") for o in outputs] != list(definition.outputs):
            problems.append(
                f"outputs are typed {[o.get('type') for o in outputs]}, the node returns {list(definition.outputs)}"
            )
        elif [o.get("name") for o in outputs] != list(definition.output_names):
            problems.append(
                f"outputs are named {[o.get('name') for o in outputs]}, the node names them {list(definition.output_names)}"
            )
        values = node.get("widgets_values", [])
        if not isinstance(values, list):
            return problems + [f"widgets_values must be a list, got {type(values).__name__}"]
        layout = definition.layout(values)
        if layout is None:
            names = [w.name for w in definition.widgets]
            return problems + [f"widgets_values has {len(values)} values for {len(names)} widgets {names}"]
        for widget, value in zip(layout, values):
            problem = definition.widget_problem(widget, value)
            if problem:
                problems.append(f"widget {widget.name!r}: {problem}")
        return problems

    def check(self, workflow: dict) -> None:
        problems = self.problems(workflow)
        if problems:
            raise WorkflowError("workflow does not load:\n  " + "\n  ".join(problems))

    def order(self, workflow: dict) -> list[int]:
        """Ids of the nodes that run, in execution order (dependencies first; ties by id, as the graph is stored)."""
        nodes = [n["id"] for n in workflow["nodes"] if runs(n)]
        needs = {n: set() for n in nodes}
        for _, source, _, target, _, _ in workflow["links"]:
            if target in needs:
                needs[target].add(source)
        order: list[int] = []
        while len(order) < len(nodes):
            ready = sorted(n for n in nodes if n not in order and needs[n] <= set(order))
            if not ready:
                raise WorkflowError(f"the graph has a cycle among nodes {sorted(set(nodes) - set(order))}")
            order.append(ready[0])
        return order

    # -- execution --

    def execute(self, workflow: dict) -> Execution:
        """Validate, then run every node once in dependency order by calling its class's FUNCTION."""
        self.check(workflow)
        nodes = {n["id"]: n for n in workflow["nodes"]}
        links = {link[0]: link for link in workflow["links"]}
        run = Execution(order=self.order(workflow))
        for node_id in run.order:
            node = nodes[node_id]
            definition = self.definition(node["type"])
            kwargs = widget_kwargs(definition, node.get("widgets_values", []))
            for entry in node.get("inputs") or []:
                if entry.get("link") is not None:
                    _, source, slot, _, _, _ = links[entry["link"]]
                    kwargs[entry["name"]] = run.outputs[source][slot]
            instance = definition.cls()
            result = getattr(instance, definition.cls.FUNCTION)(**kwargs)
            if isinstance(result, dict):
                run.ui[node_id] = result.get("ui", {})
                result = tuple(result.get("result", ()))
            if not isinstance(result, tuple) or len(result) != len(definition.outputs):
                raise WorkflowError(
                    f"node {node_id} ({node['type']}) returned {type(result).__name__} for {len(definition.outputs)} outputs"
                )
            run.inputs[node_id], run.outputs[node_id] = kwargs, result
        return run


def runs(node: dict) -> bool:
    """Whether the frontend sends this node to the server: not a note, not muted, not bypassed."""
    return node["type"] not in VIRTUAL_NODES and node.get("mode", 0) == 0


def widget_problem(widget: Widget, value: Any) -> str | None:
    """Why a saved widget value would not load or validate in ComfyUI (None: fine)."""
    if widget.type == "CONTROL":
        return None if value in CONTROL_VALUES else f"{value!r} is not one of {', '.join(CONTROL_VALUES)}"
    if widget.type in ("BUTTON", "DOM"):
        return (
            None
            if value in ("", None)
            else f"a frontend-only {widget.type.lower()} widget saves '' or null, got {value!r}"
        )
    if widget.type == "COMBO":
        return None if value in widget.choices else f"{value!r} is not among the options {list(widget.choices)}"
    if widget.type == "STRING":
        return None if isinstance(value, str) else f"needs a string, got {value!r}"
    if widget.type == "BOOLEAN":
        return None if isinstance(value, bool) else f"needs true or false, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return f"needs a number, got {value!r}"
    if widget.type == "INT" and value != int(value):
        return f"needs an integer, got {value!r}"
    low, high = widget.options.get("min"), widget.options.get("max")
    if (low is not None and value < low) or (high is not None and value > high):
        return f"{value} is outside {low} .. {high}"
    return None


def widget_kwargs(definition: NodeDef, values: list) -> dict[str, Any]:
    """Saved widget values as the node function's keyword arguments (frontend-only widgets dropped)."""
    layout = definition.layout(values)
    if layout is None:
        raise WorkflowError(f"{definition.type}: widgets_values has {len(values)} values, which no known layout has")
    return {w.name: v for w, v in zip(layout, values) if not w.frontend_only}


# ---- helpers for tests and for posting to a real ComfyUI -----------------------------------------------------------


def load_workflow(path: str | Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def with_widget(workflow: dict, node_type: str, name: str, value: Any, runner: WorkflowRunner | None = None) -> dict:
    """A copy of the workflow with widget `name` of every `node_type` node set to `value` (KeyError if none has it)."""
    runner = runner or WorkflowRunner()
    changed = copy.deepcopy(workflow)
    definition = runner.definition(node_type)
    targets = [n for n in changed["nodes"] if n["type"] == node_type]
    if not targets:
        raise KeyError(f"the workflow has no {node_type} node")
    for node in targets:
        node["widgets_values"][definition.widget_index(name, node["widgets_values"])] = value
    return changed


def to_api_format(workflow: dict, runner: WorkflowRunner | None = None) -> dict:
    """UI workflow -> ComfyUI's API prompt: {"<id>": {"class_type", "inputs": {name: value or ["<from id>", slot]},
    "_meta": {"title"}}}, with frontend-only widgets, notes, muted and bypassed nodes left out, as the frontend does."""
    runner = runner or WorkflowRunner()
    links = {link[0]: link for link in workflow["links"]}
    running = {node["id"] for node in workflow["nodes"] if runs(node)}
    prompt: dict[str, dict] = {}
    for node in sorted(workflow["nodes"], key=lambda n: n["id"]):
        if not runs(node):
            continue
        definition = runner.definition(node["type"])
        inputs: dict[str, Any] = widget_kwargs(definition, node.get("widgets_values") or [])
        for entry in node.get("inputs") or []:
            if entry.get("link") is not None:
                _, source, slot, _, _, _ = links[entry["link"]]
                if source not in running:
                    raise WorkflowError(
                        f"node {node['id']} takes {entry['name']!r} from node {source}, which does not run"
                    )
                inputs[entry["name"]] = [str(source), slot]
        title = node.get("title") or _display_name(node["type"])
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs, "_meta": {"title": title}}
    return prompt


def _display_name(node_type: str) -> str:
    from flowjam.nodes.comfy_v1 import NODE_DISPLAY_NAME_MAPPINGS

    names = {"LoadAudio": "Load Audio", "SaveAudio": "Save Audio (FLAC)", "PreviewAudio": "Preview Audio"}
    return NODE_DISPLAY_NAME_MAPPINGS.get(node_type) or names.get(node_type, node_type)


# ---- layout: the boxes the frontend draws, and template thumbnails drawn from them ---------------------------------

TITLE_HEIGHT = 30  # LiteGraph.NODE_TITLE_HEIGHT: the title bar is drawn above `pos`
SLOT_HEIGHT = 20  # NODE_SLOT_HEIGHT: one row per socket input or output, whichever side has more
WIDGET_HEIGHT = 20  # NODE_WIDGET_HEIGHT; computeSize adds 4 per widget, 8 below them and 6 at the bottom
DOM_MIN_HEIGHT = 50  # a DOM widget (multiline textarea, audio player) that names no minimum height
FLOWJAM_JS = Path(__file__).resolve().parent.parent / "web" / "flowjam.js"
AUDIO_PLAYER_NODES = ("LoadAudio", "SaveAudio", "PreviewAudio")  # the frontend's Comfy.AudioWidget adds audioUI
BADGE_BAND = 0.12  # a thumbnail's top and bottom bands, as a share of its height: empty, and the title
LINK_COLOURS = {
    "FLOWJAM_MODEL": "#b39ddb",
    "FLOWJAM_CONDITIONING": "#ffa931",
    "FLOWJAM_SOURCE": "#4db6ac",
    "FLOWJAM_CURVE": "#fff176",
    "FLOWJAM_STREAM": "#4fc3f7",
    "FLOWJAM_STRUCTURE": "#f06292",
    "AUDIO": "#81c784",
    "LATENT": "#ff9cf9",
}


def dom_min_height(widget: Widget) -> int:
    """A DOM widget's minimum height: the live panel's getMinHeight (web/flowjam.js's PANEL_HEIGHT), else 50."""
    if widget.name != "flowjam_live_panel":
        return DOM_MIN_HEIGHT
    found = re.search(r"const PANEL_HEIGHT = (\d+);", FLOWJAM_JS.read_text(encoding="utf-8"))
    if found is None:
        raise WorkflowError(f"{FLOWJAM_JS} no longer defines PANEL_HEIGHT; tell the layout helpers the panel's height")
    return int(found.group(1))


def drawn_widgets(definition: NodeDef) -> tuple[Widget, ...]:
    """Every widget the frontend draws on the node, saved or not (audio players, web/flowjam.js's live panel)."""
    extra = (AUDIO_PLAYER,) if definition.type in AUDIO_PLAYER_NODES and AUDIO_PLAYER not in definition.widgets else ()
    return definition.widgets + extra + EXTENSION_WIDGETS.get(definition.type, ())


def widget_height(widget: Widget) -> int:
    if widget.type == "DOM" or (widget.type == "STRING" and widget.options.get("multiline")):
        return dom_min_height(widget)
    return WIDGET_HEIGHT


def min_body_height(definition: NodeDef) -> int:
    """The body height LiteGraph's computeSize gives the node: a saved size below it grows to show every widget."""
    rows = max(len(definition.sockets), len(definition.outputs), 1)
    heights = [widget_height(w) for w in drawn_widgets(definition)]
    return rows * SLOT_HEIGHT + sum(h + 4 for h in heights) + (8 if heights else 0) + 6


def node_box(node: dict, definition: NodeDef | None) -> tuple[float, float, float, float]:
    """(left, top, right, bottom) as drawn: the title bar above `pos`, the body grown to fit its widgets."""
    (x, y), (width, height) = node["pos"], node["size"]
    if definition is not None:
        height = max(height, min_body_height(definition))
    return x, y - TITLE_HEIGHT, x + width, y + height


def layout_boxes(workflow: dict, runner: WorkflowRunner) -> dict[int, tuple[float, float, float, float]]:
    return {
        n["id"]: node_box(n, None if n["type"] in VIRTUAL_NODES else runner.definition(n["type"]))
        for n in workflow["nodes"]
    }


def overlaps(workflow: dict, runner: WorkflowRunner | None = None) -> list[str]:
    """Every pair of nodes whose drawn boxes overlap (empty: each node's title and widgets are in plain view)."""
    boxes = layout_boxes(workflow, runner or WorkflowRunner())
    types = {n["id"]: n["type"] for n in workflow["nodes"]}
    found = []
    ids = sorted(boxes)
    for index, a in enumerate(ids):
        for b in ids[index + 1 :]:
            (al, at, ar, ab), (bl, bt, br, bb) = boxes[a], boxes[b]
            if al < br and bl < ar and at < bb and bt < ab:
                found.append(f"node {a} ({types[a]}) {boxes[a]} overlaps node {b} ({types[b]}) {boxes[b]}")
    return found


def draw_thumbnail(workflow: dict, path: Path, runner: WorkflowRunner | None = None, pixels: int = 512) -> None:
    """A square JPEG of the graph (nodes as drawn, links by type, muted and bypassed nodes tinted as the frontend
    tints them), its title in the bottom band and nothing in the top one (frontend 1.58 lays a "Node graph" badge
    over a card's top-left corner): what ComfyUI's template browser shows for `<name>.jpg` beside `<name>.json`.
    Needs Pillow."""
    from PIL import Image, ImageDraw, ImageFont

    runner = runner or WorkflowRunner()
    boxes = layout_boxes(workflow, runner)
    nodes = {n["id"]: n for n in workflow["nodes"]}
    left, top = min(b[0] for b in boxes.values()), min(b[1] for b in boxes.values())
    right, bottom = max(b[2] for b in boxes.values()), max(b[3] for b in boxes.values())
    margin, band = pixels * 0.05, round(pixels * BADGE_BAND)
    scale = min((pixels - 2 * margin) / (right - left), (pixels - 2 * band) / (bottom - top))
    offset_x = (pixels - (right - left) * scale) / 2 - left * scale
    offset_y = band + (pixels - 2 * band - (bottom - top) * scale) / 2 - top * scale

    def at(x: float, y: float) -> tuple[float, float]:
        return offset_x + x * scale, offset_y + y * scale

    image = Image.new("RGB", (pixels, pixels), "#202020")
    draw = ImageDraw.Draw(image)
    text, size = template_heading(workflow), round(pixels * 0.05)
    while size > 10 and draw.textlength(text, font=ImageFont.load_default(size=size)) > pixels - 2 * margin:
        size -= 1
    draw.text((pixels / 2, pixels - margin), text, fill="#ffffff", font=ImageFont.load_default(size=size), anchor="md")
    font = ImageFont.load_default(size=max(9, round(TITLE_HEIGHT * scale * 0.6)))
    for _, source, source_slot, target, target_slot, link_type in workflow["links"]:
        start = at(boxes[source][2], nodes[source]["pos"][1] + (source_slot + 0.5) * SLOT_HEIGHT)
        end = at(boxes[target][0], nodes[target]["pos"][1] + (target_slot + 0.5) * SLOT_HEIGHT)
        draw.line(_spline(start, end), fill=LINK_COLOURS.get(link_type, "#9e9e9e"), width=max(2, round(3 * scale)))
    for node_id, (x0, y0, x1, y1) in boxes.items():
        node = nodes[node_id]
        body, title_bar = (node.get("bgcolor", "#353535"), node.get("color", "#222222"))
        if node.get("mode") == 4:
            body, title_bar = "#5a2f5a", "#4a1f4a"  # the frontend tints a bypassed node purple
        elif node.get("mode") == 2:
            body, title_bar = "#2a2a2a", "#1c1c1c"
        radius = max(2, round(8 * scale))
        draw.rounded_rectangle([*at(x0, y0), *at(x1, y1)], radius, fill=body, outline="#000000")
        draw.rounded_rectangle([*at(x0, y0), *at(x1, y0 + TITLE_HEIGHT)], radius, fill=title_bar)
        if node["type"] not in VIRTUAL_NODES:
            definition = runner.definition(node["type"])
            y = node["pos"][1] + max(len(definition.sockets), len(definition.outputs), 1) * SLOT_HEIGHT + 2
            for widget in definition.widgets:  # the saved ones: players and panels are left blank
                if not widget.frontend_only or widget.type == "CONTROL":
                    height = widget_height(widget)
                    draw.rounded_rectangle([*at(x0 + 12, y + 2), *at(x1 - 12, y + height)], radius, fill="#222222")
                    y += height + 4
        title = (node.get("title") or _display_name(node["type"])).removeprefix("flowjam ")
        text_x, text_y = at(x0 + 10, y0 + TITLE_HEIGHT / 2)
        width = (x1 - x0 - 14) * scale
        while title and draw.textlength(title, font=font) > width:
            title = title[:-2] + "…" if len(title) > 2 else ""
        draw.text((text_x, text_y), title, fill="#dddddd", font=font, anchor="lm")
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, "JPEG", quality=85, optimize=True)


def template_heading(workflow: dict) -> str:
    """The first heading of the workflow's Markdown note ("## flowjam: live cover" -> "flowjam: live cover")."""
    for node in workflow["nodes"]:
        if node["type"] == "MarkdownNote":
            for line in node["widgets_values"][0].splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return "flowjam"


def _spline(start: tuple[float, float], end: tuple[float, float], points: int = 32) -> list[tuple[float, float]]:
    """A link as LiteGraph draws one: a cubic Bezier leaving the output and entering the input horizontally, its
    handles a quarter of the distance long."""
    bend = 0.25 * math.dist(start, end)
    controls = (start, (start[0] + bend, start[1]), (end[0] - bend, end[1]), end)
    weights = [
        ((1 - t) ** 3, 3 * (1 - t) ** 2 * t, 3 * (1 - t) * t**2, t**3) for t in (i / points for i in range(points + 1))
    ]
    return [tuple(sum(w * c[axis] for w, c in zip(ws, controls)) for axis in (0, 1)) for ws in weights]


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) of a baseline or progressive JPEG, read from its frame header (None: not a JPEG)."""
    if data[:2] != b"\xff\xd8":
        return None
    at = 2
    while at + 9 < len(data):
        if data[at] != 0xFF:
            return None
        marker, length = data[at + 1], int.from_bytes(data[at + 2 : at + 4], "big")
        if marker in (0xC0, 0xC1, 0xC2):
            return int.from_bytes(data[at + 7 : at + 9], "big"), int.from_bytes(data[at + 5 : at + 7], "big")
        at += 2 + length
    return None


if __name__ == "__main__":
    import sys

    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent / "workflows"
    for workflow_path in sorted(folder.glob("*.json")):
        draw_thumbnail(load_workflow(workflow_path), workflow_path.with_suffix(".jpg"))
        print(f"drew {workflow_path.with_suffix('.jpg')}")

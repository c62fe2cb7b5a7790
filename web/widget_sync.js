// Which widgets of the graph set a stream's knob when the graph is queued again, and writing knob values into them,
// so a re-queue sends what the stream plays: the Stream node's own widget of that name, the `value` of a Shared curve
// node wired to that Stream for that knob, or for a lora/<name> knob the `strength` of the LoRA node feeding the
// Stream's model. Works on LiteGraph's node objects only (widgets, inputs, graph): no DOM and no ComfyUI import, so
// tests run it under node with plain objects (tests/test_panel_routes.py). ComfyUI imports every .js file of the
// pack as an extension: this one only defines functions.
import { choiceName } from "./panel_rows.js";

const LORA_PREFIX = "lora/"; // engine/params.py's LORA_KNOB_PREFIX
const PEFT_FILE = "adapter_model.safetensors"; // a PEFT folder's weights: its knob is named after the folder
const MAX_HOPS = 32; // how far up a chain of nodes (LoRA nodes, Reroutes) the search goes

export function widgetNamed(node, name) {
  return node.widgets?.find((w) => w.name === name);
}

// Whether input `name` (a socket, or a widget turned into one) is fed by a link: the node's isInputConnected (frontend
// 1.58 deprecates reading `input.link`), else, on a frontend without it (1.27's LiteGraph), the slot's `link`.
function inputLinked(node, name) {
  const index = node.inputs?.findIndex((input) => input.name === name || input.widget?.name === name) ?? -1;
  if (index < 0) return false;
  if (typeof node.isInputConnected === "function") return Boolean(node.isInputConnected(index));
  return node.inputs[index].link != null;
}

// The node feeding input `name`; a node without that input (a Reroute) passes on what its first input brings.
function inputNode(node, name) {
  const slot = node.findInputSlot?.(name) ?? -1;
  return node.getInputNode?.(slot >= 0 ? slot : 0) ?? null;
}

function upstreamStream(node) {
  for (let hop = 0; node && hop < MAX_HOPS; hop++) {
    if (node.type === "FlowjamStream") return node;
    node = inputNode(node, "stream");
  }
  return null;
}

// The knob a LoRA node's `lora` choice plays: lora/<file name without its extension>, or for a PEFT folder's
// adapter_model.safetensors lora/<folder name> (nodes/lora_nodes.py names it the same way).
export function loraKnob(file) {
  const parts = String(file ?? "").split(/[\\/]/);
  const last = parts[parts.length - 1];
  return LORA_PREFIX + (last === PEFT_FILE ? parts[parts.length - 2] ?? "" : last.replace(/\.[^.]*$/, ""));
}

function sharedCurveWidgets(streamNode, knob) {
  return (streamNode.graph?.findNodesByType?.("FlowjamSharedCurve", []) ?? [])
    .filter((n) => widgetNamed(n, "knob")?.value === knob && !inputLinked(n, "curve") && !inputLinked(n, "value"))
    .filter((n) => upstreamStream(n) === streamNode)
    .map((n) => widgetNamed(n, "value"))
    .filter(Boolean);
}

function loraWidgets(streamNode, knob) {
  const found = [];
  let node = inputNode(streamNode, "model");
  for (let hop = 0; node && hop < MAX_HOPS; hop++, node = inputNode(node, "model")) {
    const strength = widgetNamed(node, "strength");
    if (node.type === "FlowjamLora" && strength && !inputLinked(node, "strength")) {
      if (loraKnob(widgetNamed(node, "lora")?.value) === knob) found.push(strength);
    }
  }
  return found;
}

// The widgets whose value sets `knob` when the Stream node `node` is queued again. A widget fed by a link is left
// alone (the link sets it); a Shared curve with a curve connected plays its curve on a re-queue, whatever was moved.
export function knobWidgets(node, knob) {
  const own = widgetNamed(node, knob);
  if (own) return inputLinked(node, knob) ? [] : [own];
  return knob.startsWith(LORA_PREFIX) ? loraWidgets(node, knob) : sharedCurveWidgets(node, knob);
}

// Write `value` into those widgets; -> the value they hold after their own rounding (what the stream should get).
export function writeWidgets(node, knob, value) {
  const widgets = knobWidgets(node, knob);
  for (const widget of widgets) {
    if (widget.value === value) continue;
    widget.value = value;
    widget.callback?.(value); // ComfyUI's number widgets round to their step here
  }
  if (!widgets.length) return value;
  const graph = node.graph?.rootGraph ?? node.graph; // the canvas draws the root graph, a subgraph inside it
  graph?.setDirtyCanvas?.(true, false);
  return widgets[widgets.length - 1].value;
}

// A stream's knob value as its widget holds it: a choice knob by the choice's name, an integer knob rounded.
export function widgetValue(row, value) {
  if (row.control === "select") return choiceName(row, value);
  return row.integer ? Math.round(value) : value;
}

// Write every knob the stream changed since `heard` (a move from OSC, MIDI, another browser's panel, or a re-queue)
// into the widgets that set it on a re-queue, so the next queue keeps what the stream plays. A knob the stream did not
// change leaves its widgets alone: a value typed there waits for the queue. The first values heard only set `heard`
// (a graph just loaded keeps its own). `rows`: the panel's rows by knob name (panel_rows.js); `skip`: knobs to leave
// alone now (moved by hand a moment ago, or driven by a curve). Updates `heard`; -> the knobs written.
export function followStream(node, rows, heard, knobs, skip = new Set()) {
  const written = [];
  for (const [name, value] of Object.entries(knobs)) {
    const row = rows[name];
    if (!row || skip.has(name)) continue;
    const before = heard[name];
    heard[name] = value;
    if (before === undefined || before === value || !knobWidgets(node, name).length) continue;
    writeWidgets(node, name, widgetValue(row, value));
    written.push(name);
  }
  return written;
}

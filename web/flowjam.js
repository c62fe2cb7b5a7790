// flowjam live panel: knobs, meters and the playhead of a running stream, drawn on the Stream node.
// Talks to flowjam's routes on ComfyUI's own server; turning a knob posts it straight to the stream (no re-queue)
// and writes the same value into the widget that sets that knob on a re-queue (the Stream node's own widget, or the
// `value` of a Shared curve node wired to this Stream for that knob), so the graph re-queues what you hear.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const PANEL_KNOBS = ["velocity_scale", "denoise", "prompt_blend", "ode_noise", "guidance", "volume", "cfg_mode"];
const POLL_RUNNING_MS = 250; // while the stream plays
const POLL_ABSENT_MAX_MS = 5000; // no stream: the poll interval doubles from POLL_RUNNING_MS up to this
const HAND_MS = 500; // a knob moved this recently keeps the hand's value (the poll never fights the hand)
const PANEL_HEIGHT = 210; // meters (two lines), playhead and seven knob rows
const FIELD_SEPARATOR = " · ";
const WAKE_EVENTS = ["execution_start", "execution_success"]; // a queued graph may have just started the stream
const CURVE_TITLE = "driven by a curve (Shared curve node): disconnect the curve to play it here";
const ONE_LINE = "white-space: nowrap; overflow: hidden; text-overflow: ellipsis;";
const CSS = {
  panel: "font: 11px monospace; color: #ddd; padding: 4px; display: grid; gap: 3px; align-content: start; "
    + "overflow: hidden; box-sizing: border-box;",
  // label column: 19ch holds the longest knob name (x0_target_strength) in the panel's monospace font
  row: "display: grid; grid-template-columns: 19ch minmax(4em, 1fr) 5ch; gap: 4px; align-items: center;",
  select: "min-width: 0; font: inherit; color: inherit; background: #222; border: 1px solid #555;",
  slider: "min-width: 0;",
  value: "text-align: right; white-space: nowrap;",
};

function streamName(node) {
  const widget = node.widgets?.find((w) => w.name === "session_id");
  return String(widget?.value || "default").trim();
}

// ---- the panel's elements ---------------------------------------------------------------------------------------

function element(tag, css = "", text = "") {
  const el = document.createElement(tag);
  el.style.cssText = css;
  el.textContent = text;
  return el;
}

function buildRow(name, onMove) {
  const row = element("label", CSS.row);
  const label = element("span", ONE_LINE, name);
  const choice = name === "cfg_mode";
  const input = document.createElement(choice ? "select" : "input");
  if (!choice) {
    input.type = "range";
    input.step = "any";
  }
  input.dataset.knob = name;
  input.style.cssText = choice ? CSS.select : CSS.slider;
  const value = element("span", CSS.value);
  input.addEventListener(choice ? "change" : "input", () => onMove(name, choice ? input.value : Number(input.value)));
  row.append(label, input, value);
  return { row, label, input, value, choice, movedAt: 0, pending: undefined, sending: false };
}

function buildPanel(onMove) {
  const root = element("div", CSS.panel);
  root.className = "flowjam-panel";
  const meters = element("div");
  const lines = [element("div", ONE_LINE), element("div", ONE_LINE)]; // each line breaks between fields, never inside
  meters.append(...lines);
  const playhead = document.createElement("progress");
  playhead.max = 1;
  playhead.value = 0;
  playhead.style.width = "100%";
  root.append(meters, playhead);
  const rows = {};
  for (const name of PANEL_KNOBS) {
    rows[name] = buildRow(name, onMove);
    root.append(rows[name].row);
  }
  const state = { running: false, specs: null, delayMs: 0, timer: null, polling: false, removed: false };
  return { root, lines, playhead, rows, ...state };
}

function showLines(panel, first, second = "", title = "") {
  panel.lines[0].textContent = first;
  panel.lines[1].textContent = second;
  panel.lines[0].parentElement.title = title;
}

// ---- widgets that set a knob on a re-queue -----------------------------------------------------------------------

function widgetNamed(node, name) {
  return node.widgets?.find((w) => w.name === name);
}

function inputLinked(node, name) {
  const named = (input) => input.name === name || input.widget?.name === name;
  return node.inputs?.some((input) => named(input) && input.link != null) ?? false;
}

function upstreamStream(node) {
  for (let hop = 0; node && hop < 16; hop++) {
    if (node.type === "FlowjamStream") return node;
    const slot = node.findInputSlot?.("stream") ?? -1;
    node = node.getInputNode?.(slot >= 0 ? slot : 0); // a Reroute passes the stream through its one input
  }
  return null;
}

function sharedCurveWidgets(streamNode, knob) {
  const graph = streamNode.graph ?? app.graph;
  return (graph?.findNodesByType?.("FlowjamSharedCurve", []) ?? [])
    .filter((n) => widgetNamed(n, "knob")?.value === knob && !inputLinked(n, "curve") && !inputLinked(n, "value"))
    .filter((n) => upstreamStream(n) === streamNode)
    .map((n) => widgetNamed(n, "value"))
    .filter(Boolean);
}

// The widgets whose value sets `knob` when the graph is queued again. A widget fed by a link is left alone (the
// link sets it); a Shared curve with a curve connected plays its curve on a re-queue, whatever the panel did.
function knobWidgets(node, knob) {
  const own = widgetNamed(node, knob);
  if (own) return inputLinked(node, knob) ? [] : [own];
  return sharedCurveWidgets(node, knob);
}

// Write `value` into those widgets; -> the value they hold after their own rounding (what the stream should get).
function writeWidgets(node, knob, value) {
  const widgets = knobWidgets(node, knob);
  for (const widget of widgets) {
    if (widget.value === value) continue;
    widget.value = value;
    widget.callback?.(value); // ComfyUI's number widgets round to their step here
  }
  if (!widgets.length) return value;
  app.graph?.setDirtyCanvas?.(true, false);
  return widgets[widgets.length - 1].value;
}

// ---- talking to the stream ---------------------------------------------------------------------------------------

async function postPending(node, panel, row) {
  row.sending = true;
  while (row.pending !== undefined && panel.running) {
    const body = JSON.stringify({ name: row.input.dataset.knob, value: row.pending });
    row.pending = undefined;
    try {
      const response = await api.fetchApi(`/flowjam/session/${encodeURIComponent(streamName(node))}/knob`, {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body,
      });
      if (response.status === 404) {
        panel.running = false; // stopped between two polls: post no more, and let the next poll say so
        wake(node, panel);
      }
    } catch {
      break; // the server is gone; the poll shows it
    }
  }
  row.pending = undefined;
  row.sending = false;
}

function moveKnob(node, panel, name, value) {
  const row = panel.rows[name];
  if (!panel.running || row.input.disabled) return; // never post to a stream that is not there
  row.movedAt = Date.now();
  row.pending = writeWidgets(node, name, row.choice ? value : clampToSpec(panel.specs?.[name], value));
  showValue(row, row.pending);
  if (!row.sending) postPending(node, panel, row);
}

function clampToSpec(spec, value) {
  if (!spec) return value;
  const clamped = Math.min(spec.max, Math.max(spec.min, value));
  return spec.integer ? Math.round(clamped) : clamped;
}

// ---- showing the status ------------------------------------------------------------------------------------------

function showValue(row, value) {
  row.value.textContent = row.choice || typeof value !== "number" ? "" : value.toFixed(2);
}

function applySpecs(panel, specs) {
  if (!specs || panel.specs) return;
  panel.specs = specs;
  for (const [name, row] of Object.entries(panel.rows)) {
    const spec = specs[name];
    if (!spec) continue;
    row.label.title = spec.description ?? "";
    if (row.choice) {
      row.input.replaceChildren(...spec.choices.map((choice) => new Option(choice, choice)));
    } else {
      row.input.min = spec.min;
      row.input.max = spec.max;
      row.input.step = spec.integer ? "1" : "any";
    }
  }
}

function setRowEnabled(row, enabled, title) {
  row.input.disabled = !enabled;
  row.row.style.opacity = enabled ? "1" : "0.5";
  row.row.title = title;
}

function setRowValue(row, value) {
  if (row.choice) {
    row.input.value = typeof value === "number" ? row.input.options[value]?.value ?? "" : value;
  } else {
    row.input.value = value;
  }
}

// No stream: every knob disabled, resting at the value the Stream node would start it with.
function showAbsent(node, panel, status) {
  const name = streamName(node);
  panel.running = false;
  const others = (status.sessions ?? []).filter((s) => s !== name);
  const elsewhere = others.length ? `running here: ${others.join(", ")}` : "";
  showLines(panel, `no stream "${name}" — queue the graph`, elsewhere);
  panel.playhead.value = 0;
  for (const [knob, row] of Object.entries(panel.rows)) {
    setRowEnabled(row, false, "no stream — queue the graph to start it");
    const start = widgetNamed(node, knob)?.value ?? panel.specs?.[knob]?.default;
    if (start !== undefined) setRowValue(row, start);
    row.value.textContent = row.choice ? "" : "–";
  }
}

function meterLines(s) {
  const fixed = (value, digits) => Number(value).toFixed(digits);
  const first = [`tick ${fixed(s.tick_ms, 1)} ms`, `decode ${fixed(s.decode_ms, 1)} ms`];
  first.push(`lead ${fixed(s.lead_s, 2)} s`);
  const second = [`playhead ${fixed(s.playhead_s, 1)} s`, `underruns ${s.underruns ?? 0}`];
  if (s.errors) second.push(`errors ${s.errors}`);
  return [first.join(FIELD_SEPARATOR), second.join(FIELD_SEPARATOR)];
}

function showRunning(panel, s) {
  panel.running = true;
  const [first, second] = meterLines(s);
  showLines(panel, first, second, s.last_error ? `last error: ${s.last_error}` : "");
  panel.playhead.value = s.loop_s ? s.playhead_s / s.loop_s : 0;
  const curves = new Set(s.curves ?? []);
  for (const [name, row] of Object.entries(panel.rows)) {
    const curve = curves.has(name);
    setRowEnabled(row, !curve, curve ? CURVE_TITLE : "");
    if (Date.now() - row.movedAt < HAND_MS) continue;
    const value = name === "cfg_mode" ? s.cfg_mode : s.knobs?.[name];
    if (value === undefined) continue;
    setRowValue(row, value);
    if (curve) row.value.textContent = "curve";
    else showValue(row, value);
  }
}

// -> whether the stream runs (the poll backs off while it does not).
async function refresh(node, panel) {
  const response = await api.fetchApi(`/flowjam/session/${encodeURIComponent(streamName(node))}`);
  if (!response.ok) {
    showAbsent(node, panel, {});
    showLines(panel, `flowjam: the status route answered ${response.status}`, "is flowjam installed on this server?");
    return false;
  }
  const status = await response.json();
  applySpecs(panel, status.specs);
  if (status.running) showRunning(panel, status);
  else showAbsent(node, panel, status);
  return Boolean(status.running);
}

// ---- polling -----------------------------------------------------------------------------------------------------

function schedule(node, panel, delayMs) {
  clearTimeout(panel.timer);
  if (!panel.removed) panel.timer = setTimeout(() => poll(node, panel), delayMs);
}

async function poll(node, panel) {
  if (panel.polling || panel.removed) return;
  panel.polling = true;
  let running = false;
  try {
    running = await refresh(node, panel);
  } catch {
    panel.running = false;
    showLines(panel, "flowjam: ComfyUI's server does not answer", "retrying…");
  }
  panel.polling = false;
  const backedOff = Math.min(POLL_ABSENT_MAX_MS, Math.max(POLL_RUNNING_MS, panel.delayMs * 2));
  panel.delayMs = running ? POLL_RUNNING_MS : backedOff;
  schedule(node, panel, panel.delayMs);
}

// Poll soon and start the back-off over (a graph was queued, or a post found no stream).
function wake(node, panel) {
  panel.delayMs = 0;
  if (!panel.polling) schedule(node, panel, 0);
}

// ---- the extension -----------------------------------------------------------------------------------------------

function fitPanel(node) {
  const [width, height] = node.computeSize();
  if (node.size[0] < width || node.size[1] < height) {
    node.setSize([Math.max(node.size[0], width), Math.max(node.size[1], height)]);
  }
}

function attachPanel(node) {
  const panel = buildPanel((name, value) => moveKnob(node, panel, name, value));
  showLines(panel, "flowjam: looking for the stream…");
  const options = { serialize: false, getMinHeight: () => PANEL_HEIGHT };
  node.addDOMWidget("flowjam_live_panel", "flowjam_panel", panel.root, options);
  fitPanel(node);
  const onWake = () => wake(node, panel);
  for (const type of WAKE_EVENTS) api.addEventListener(type, onWake);
  const removed = node.onRemoved;
  node.onRemoved = function () {
    panel.removed = true;
    clearTimeout(panel.timer);
    for (const type of WAKE_EVENTS) api.removeEventListener(type, onWake);
    return removed?.apply(this, arguments);
  };
  schedule(node, panel, 0);
}

app.registerExtension({
  name: "flowjam.livePanel",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData.name !== "FlowjamStream") return;
    const created = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const result = created?.apply(this, arguments);
      attachPanel(this);
      return result;
    };
    const configure = nodeType.prototype.onConfigure;
    nodeType.prototype.onConfigure = function () {
      const result = configure?.apply(this, arguments);
      fitPanel(this); // a saved graph restores its own (smaller) size: grow the node so the panel fits inside it
      return result;
    };
  },
});

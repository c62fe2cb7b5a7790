// flowjam live panel: knobs, meters and the playhead of a running stream, drawn on the Stream node.
// Its rows are built from the knob specs flowjam's routes send (the parameter registry plus a running stream's
// lora/<name> knobs; see panel_rows.js): a knob added to the registry shows here with no change to this file.
// The server pushes every stream's status as a "flowjam.status" event (nodes/web_routes.py, about 4 a second while
// a stream runs); GET /flowjam/session/<name> brings the specs, and is a slow fallback where no event comes.
// Turning a knob posts it straight to the stream (no re-queue) and writes the same value into the widget that sets
// that knob on a re-queue (widget_sync.js: the Stream node's own widget, a wired Shared curve's `value`, a LoRA node's
// `strength`); a knob the stream changed otherwise (OSC, MIDI, another browser) is written there too when its status
// comes, so the graph re-queues what you hear. A Stream stop's result shows as a toast. Colours come from ComfyUI's
// theme (its palette variables).
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { choiceName, movedValue, panelRows, shownValue } from "./panel_rows.js";
import { CSS, statusView } from "./panel_status.js";
import { followStream, widgetNamed, writeWidgets } from "./widget_sync.js";

const STATUS_EVENT = "flowjam.status"; // nodes/web_routes.py's STATUS_EVENT
const FALLBACK_POLL_MS = 2000; // GET the status when no event came for this long (older ComfyUI, no stream)
const HAND_MS = 500; // a knob moved this recently keeps the hand's value (the status never fights the hand)
const PANEL_HEIGHT = 210; // the panel's least height: meters (two lines), playhead and about seven rows; more scroll
const WAKE_EVENTS = ["execution_start", "execution_success"]; // a queued graph may have just started the stream
const RESULT_KEY = "flowjam_result"; // nodes/spec.py's RESULT_UI_KEY: a node's result text to show
const TOAST_MS = 6000;
const CURVE_TITLE = "driven by a curve (Shared curve node): disconnect the curve to play it here";
const panels = new Set(); // every live panel on the canvas; the server's events reach each of them

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

// A row for one knob spec (panel_rows.js): a select for a choice knob, a number box for a wide integer knob, else a
// slider; `onMove(value)` gets what the hand set.
function buildRow(spec, onMove) {
  const row = element("label", CSS.row);
  const label = element("span", CSS.line, spec.name);
  label.title = spec.title ? `${spec.name}: ${spec.title}` : spec.name;
  const input = document.createElement(spec.control === "select" ? "select" : "input");
  if (spec.control === "select") {
    input.replaceChildren(...spec.choices.map((choice) => new Option(choice, choice)));
  } else {
    input.type = spec.control;
    input.min = spec.min;
    input.max = spec.max;
    input.step = spec.step;
  }
  input.dataset.knob = spec.name;
  input.style.cssText = spec.control === "range" ? CSS.slider : CSS.control;
  const value = element("span", CSS.value);
  const event = spec.control === "range" ? "input" : "change"; // a number box sends once typed, not per keystroke
  input.addEventListener(event, () => onMove(spec.control === "select" ? input.value : Number(input.value)));
  row.append(label, input, value);
  return { spec, row, input, value, movedAt: 0, pending: undefined, sending: false };
}

function buildPanel(node) {
  const root = element("div", CSS.panel);
  root.className = "flowjam-panel";
  const meters = element("div", CSS.meters);
  const lines = [0, 1, 2].map(() => element("div", CSS.line)); // each line breaks between fields, never inside
  meters.append(...lines);
  const notice = element("div", CSS.notice); // why the stream is silent, and the fix: wrapped, never widening
  notice.hidden = true;
  const playhead = document.createElement("progress");
  playhead.max = 1;
  playhead.value = 0;
  playhead.style.cssText = "width: 100%; min-width: 0; accent-color: var(--fg-color, #fff);";
  const rowsBox = element("div", CSS.rows);
  root.append(meters, notice, playhead, rowsBox);
  const times = { eventAt: 0, askedAt: 0, timer: null }; // the last event, the last specs asked for, the poll
  const heard = {}; // the knob values the stream last reported (widget_sync.js's followStream)
  return { node, root, lines, notice, playhead, rowsBox, rows: {}, heard, running: false, fetching: false, ...times };
}

// Whether `byKnob` (specs or values, keyed by knob name) names exactly the knobs the panel has rows for.
function sameKnobs(panel, byKnob) {
  const names = Object.keys(byKnob);
  return names.length === Object.keys(panel.rows).length && names.every((name) => name in panel.rows);
}

// Rows for `specs`, rebuilt only when the set of knobs changes (a LoRA loaded into or gone from the stream).
function setRows(panel, specs) {
  if (sameKnobs(panel, specs)) return;
  const rows = panelRows(specs).map((spec) => [spec.name, buildRow(spec, (v) => moveKnob(panel, spec.name, v))]);
  panel.rows = Object.fromEntries(rows);
  panel.rowsBox.replaceChildren(...rows.map(([, row]) => row.row));
}

function showLines(panel, first, second = "", title = "", css = "", third = "") {
  panel.lines[0].textContent = first;
  panel.lines[1].textContent = second;
  panel.lines[1].style.cssText = CSS.line + css;
  panel.lines[2].textContent = third;
  panel.lines[0].parentElement.title = title;
}

function showNotice(panel, text) {
  panel.notice.textContent = text ?? "";
  panel.notice.hidden = !text;
}

// ---- talking to the stream ---------------------------------------------------------------------------------------

async function postPending(panel, row) {
  row.sending = true;
  while (row.pending !== undefined && panel.running) {
    const body = JSON.stringify({ name: row.spec.name, value: row.pending });
    row.pending = undefined;
    try {
      const response = await api.fetchApi(`/flowjam/session/${encodeURIComponent(streamName(panel.node))}/knob`, {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body,
      });
      if (response.status === 404) {
        panel.running = false; // stopped since the last status: post no more, and ask what runs now
        fetchStatus(panel);
      }
    } catch {
      break; // the server is gone; the next status shows it
    }
  }
  row.pending = undefined;
  row.sending = false;
}

function moveKnob(panel, name, value) {
  const row = panel.rows[name];
  if (!panel.running || row.input.disabled) return; // never post to a stream that is not there
  row.movedAt = Date.now();
  row.pending = writeWidgets(panel.node, name, movedValue(row.spec, value));
  row.value.textContent = shownValue(row.spec, row.pending);
  if (!row.sending) postPending(panel, row);
}

// ---- showing the status ------------------------------------------------------------------------------------------

function setRowEnabled(row, enabled, title) {
  row.input.disabled = !enabled;
  row.row.style.opacity = enabled ? "1" : "0.5";
  row.row.title = title;
}

function setRowValue(row, value) {
  row.input.value = row.spec.control === "select" ? choiceName(row.spec, value) : value;
}

// No stream: every knob disabled, resting at the value the Stream node would start it with.
function showAbsent(panel, sessions = []) {
  const name = streamName(panel.node);
  panel.running = false;
  panel.heard = {}; // a stream started later is heard afresh
  const others = sessions.filter((s) => s !== name);
  const elsewhere = others.length ? `running here: ${others.join(", ")}` : "";
  showLines(panel, `no stream "${name}" — queue the graph`, elsewhere);
  showNotice(panel, null);
  panel.playhead.value = 0;
  for (const row of Object.values(panel.rows)) {
    setRowEnabled(row, false, "no stream — queue the graph to start it");
    setRowValue(row, widgetNamed(panel.node, row.spec.name)?.value ?? row.spec.start);
    row.value.textContent = row.spec.control === "select" ? "" : "–";
  }
}

function showRunning(panel, s) {
  panel.running = true;
  const view = statusView(s);
  const title = [view.notice, s.last_error && `last error: ${s.last_error}`].filter(Boolean).join("\n");
  showLines(panel, view.lines[0], view.lines[1], title, s.errors ? CSS.error : "", view.lines[2]);
  showNotice(panel, view.notice); // no audio: why, and the fix, in its own wrapped line
  panel.playhead.hidden = view.progress === null; // endless: no loop to place the playhead in
  panel.playhead.value = view.progress ?? 0;
  const knobs = s.knobs ?? {};
  if (!sameKnobs(panel, knobs) && Date.now() - panel.askedAt > FALLBACK_POLL_MS) {
    panel.askedAt = Date.now(); // a LoRA came or went: its row comes with the specs (asked at most every 2 s)
    fetchStatus(panel);
  }
  const curves = new Set(s.curves ?? []);
  const held = new Set(); // knobs whose widgets stay as they are: in the hand now, or driven by a curve
  for (const [name, row] of Object.entries(panel.rows)) {
    const curve = curves.has(name);
    setRowEnabled(row, !curve, curve ? CURVE_TITLE : "");
    const typing = row.spec.control === "number" && document.activeElement === row.input;
    const moving = Date.now() - row.movedAt < HAND_MS || typing;
    if (moving || curve) held.add(name);
    if (moving || knobs[name] === undefined) continue;
    setRowValue(row, knobs[name]);
    row.value.textContent = curve ? "curve" : shownValue(row.spec, knobs[name]);
  }
  const specs = Object.fromEntries(Object.entries(panel.rows).map(([name, row]) => [name, row.spec]));
  followStream(panel.node, specs, panel.heard, knobs, held);
}

// A stream's status from the route (with `specs`) or from an event (without; the rows stay as they are).
function showStatus(panel, status, sessions) {
  if (status.specs) setRows(panel, status.specs);
  if (status.running) showRunning(panel, status);
  else showAbsent(panel, status.sessions ?? sessions);
}

async function fetchStatus(panel) {
  if (panel.fetching || !panels.has(panel)) return;
  panel.fetching = true;
  try {
    const response = await api.fetchApi(`/flowjam/session/${encodeURIComponent(streamName(panel.node))}`);
    if (response.ok) {
      showStatus(panel, await response.json(), []);
    } else {
      showAbsent(panel);
      showLines(panel, `flowjam: the status route answered ${response.status}`, "is flowjam installed on this server?");
    }
  } catch {
    panel.running = false;
    showLines(panel, "flowjam: ComfyUI's server does not answer", "retrying…");
  } finally {
    panel.fetching = false;
  }
}

// ---- events pushed by the server, and the fallback poll ----------------------------------------------------------

function onStatusEvent(event) {
  const sessions = event.detail?.sessions ?? {};
  for (const panel of panels) {
    panel.eventAt = Date.now();
    if (!Object.keys(panel.rows).length && Date.now() - panel.askedAt > FALLBACK_POLL_MS) {
      panel.askedAt = Date.now(); // no rows yet (the first ask failed, or came before the server answered): the
      fetchStatus(panel); // events carry no specs, and while they come the fallback poll never asks
    }
    const status = sessions[streamName(panel.node)];
    if (status) showStatus(panel, status, Object.keys(sessions));
    else showAbsent(panel, Object.keys(sessions));
  }
}

// A node's result text (a Stream stop's "stopped jam", or why nothing was stopped) as a toast.
function onExecuted(event) {
  for (const text of event.detail?.output?.[RESULT_KEY] ?? []) {
    app.extensionManager?.toast?.add({ severity: "info", summary: "flowjam", detail: String(text), life: TOAST_MS });
  }
}

function onWake() {
  for (const panel of panels) fetchStatus(panel);
}

async function poll(panel) {
  if (Date.now() - panel.eventAt >= FALLBACK_POLL_MS) await fetchStatus(panel);
  if (panels.has(panel)) panel.timer = setTimeout(() => poll(panel), FALLBACK_POLL_MS);
}

// ---- the extension -----------------------------------------------------------------------------------------------

function fitPanel(node) {
  const [width, height] = node.computeSize();
  if (node.size[0] < width || node.size[1] < height) {
    node.setSize([Math.max(node.size[0], width), Math.max(node.size[1], height)]);
  }
}

function attachPanel(node) {
  const panel = buildPanel(node);
  showLines(panel, "flowjam: looking for the stream…");
  const options = { serialize: false, getMinHeight: () => PANEL_HEIGHT };
  node.addDOMWidget("flowjam_live_panel", "flowjam_panel", panel.root, options);
  fitPanel(node);
  panels.add(panel);
  const removed = node.onRemoved;
  node.onRemoved = function () {
    panels.delete(panel);
    clearTimeout(panel.timer);
    return removed?.apply(this, arguments);
  };
  panel.timer = setTimeout(() => poll(panel), 0); // after a loaded graph has set the node's session_id
}

// Listened for as the module loads: the frontend opens its websocket before it calls the extensions' setup(), and
// it logs "Unknown message type" for an event no listener was registered for (a stream already running on load).
api.addEventListener(STATUS_EVENT, onStatusEvent);

app.registerExtension({
  name: "flowjam.livePanel",
  setup() {
    for (const type of WAKE_EVENTS) api.addEventListener(type, onWake);
    api.addEventListener("executed", onExecuted);
  },
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

// flowjam live panel: knobs, meters and the playhead of a running stream, drawn on the Stream node.
// Talks to flowjam's routes on ComfyUI's own server; turning a knob posts it straight to the stream (no re-queue).
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const PANEL_KNOBS = ["velocity_scale", "denoise", "prompt_blend", "ode_noise", "guidance", "volume"];
const POLL_MS = 250;
const PANEL_HEIGHT = 200; // meters (two lines), playhead and six slider rows

function sessionName(node) {
  const widget = node.widgets?.find((w) => w.name === "session_id");
  return (widget?.value || "default").trim();
}

function buildPanel(node) {
  const root = document.createElement("div");
  root.className = "flowjam-panel";
  root.style.cssText = "font: 11px monospace; color: #ddd; padding: 4px; display: grid; gap: 3px; align-content: start; overflow: hidden; box-sizing: border-box;";
  const meters = document.createElement("div");
  meters.textContent = "flowjam: waiting for the stream…";
  const playhead = document.createElement("progress");
  playhead.max = 1;
  playhead.value = 0;
  playhead.style.width = "100%";
  root.append(meters, playhead);
  const sliders = {};
  for (const name of PANEL_KNOBS) {
    const row = document.createElement("label");
    row.style.cssText = "display: grid; grid-template-columns: 7.5em 1fr 3.5em; gap: 4px; align-items: center;";
    const label = document.createElement("span");
    label.textContent = name;
    const input = document.createElement("input");
    input.type = "range";
    input.step = "any";
    input.dataset.knob = name;
    const value = document.createElement("span");
    input.addEventListener("input", () => {
      input.dataset.moving = String(Date.now());
      value.textContent = Number(input.value).toFixed(2);
      api.fetchApi(`/flowjam/session/${encodeURIComponent(sessionName(node))}/knob`, {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ name, value: Number(input.value) }),
      });
    });
    row.append(label, input, value);
    root.append(row);
    sliders[name] = { input, value };
  }
  return { root, meters, playhead, sliders };
}

async function refresh(node, panel) {
  const response = await api.fetchApi(`/flowjam/session/${encodeURIComponent(sessionName(node))}`);
  if (!response.ok) {
    panel.meters.textContent = `flowjam: no stream named "${sessionName(node)}" (queue the graph)`;
    return;
  }
  const s = await response.json();
  panel.meters.textContent = `tick ${s.tick_ms} ms · decode ${s.decode_ms} ms · lead ${s.lead_s} s · playhead ${s.playhead_s} s · underruns ${s.underruns ?? 0}`;
  panel.playhead.value = s.loop_s ? s.playhead_s / s.loop_s : 0;
  for (const [name, { input, value }] of Object.entries(panel.sliders)) {
    const spec = s.specs?.[name];
    if (!spec) continue;
    input.min = spec.min;
    input.max = spec.max;
    const moving = Date.now() - Number(input.dataset.moving || 0) < 500; // never fight the hand
    if (!moving && s.knobs?.[name] !== undefined) {
      input.value = s.knobs[name];
      value.textContent = Number(s.knobs[name]).toFixed(2);
    }
  }
}

function fitPanel(node) {
  const [width, height] = node.computeSize();
  if (node.size[0] < width || node.size[1] < height) node.setSize([Math.max(node.size[0], width), Math.max(node.size[1], height)]);
}

app.registerExtension({
  name: "flowjam.livePanel",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData.name !== "FlowjamStream") return;
    const created = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const result = created?.apply(this, arguments);
      const panel = buildPanel(this);
      this.addDOMWidget("flowjam_live_panel", "flowjam_panel", panel.root, { serialize: false, getMinHeight: () => PANEL_HEIGHT });
      fitPanel(this);
      const timer = setInterval(() => refresh(this, panel).catch(() => {}), POLL_MS);
      const removed = this.onRemoved;
      this.onRemoved = function () {
        clearInterval(timer);
        return removed?.apply(this, arguments);
      };
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

// What the live panel shows of a stream's status, and how it is styled: pure data and functions with no DOM and no
// ComfyUI, imported by flowjam.js and tested under node (tests/test_panel_routes.py). ComfyUI imports every .js file
// of the pack as an extension: this one only defines values and functions.

const FIELD_SEPARATOR = " · ";

// The panel is one column as wide as the node, whatever its text: `minmax(0, 1fr)` and `min-width: 0` keep a long
// line from widening the column (a grid item's least width is otherwise its content's), and the notice (why the
// stream is silent, with its fix) wraps inside that width instead of running on in one line. The notice is drawn in
// the theme's input text on the theme's input background (the contrast the palette was made for), marked by a rule
// in the theme's error colour: the error colour itself, as text, is too faint on the node (2:1 to 3:1).
export const CSS = {
  panel: "font: 11px monospace; color: var(--input-text, #ddd); padding: 4px; display: grid; gap: 3px; "
    + "grid-template-columns: minmax(0, 1fr); grid-template-rows: auto auto auto minmax(0, 1fr); height: 100%; "
    + "overflow: hidden; box-sizing: border-box; min-width: 0;",
  meters: "min-width: 0;",
  line: "min-width: 0; white-space: nowrap; overflow: hidden; text-overflow: ellipsis;",
  notice: "min-width: 0; white-space: normal; overflow-wrap: anywhere; max-height: 5.5em; overflow-y: auto; "
    + "color: var(--input-text, #ddd); background: var(--comfy-input-bg, #222); "
    + "border-left: 3px solid var(--error-text, #ff4444); padding: 2px 4px;",
  rows: "display: grid; gap: 3px; align-content: start; overflow-y: auto; min-height: 0; min-width: 0;",
  // label column: 19ch holds the longest registry knob name (x0_target_strength) in the panel's monospace font
  row: "display: grid; grid-template-columns: 19ch minmax(4em, 1fr) 8ch; gap: 4px; align-items: center; "
    + "min-width: 0;",
  control: "min-width: 0; font: inherit; color: var(--input-text, #ddd); background: var(--comfy-input-bg, #222); "
    + "border: 1px solid var(--border-color, #4e4e4e); border-radius: 2px;",
  slider: "min-width: 0; accent-color: var(--fg-color, #fff);",
  value: "text-align: right; white-space: nowrap; color: var(--descrip-text, #999);",
  error: "color: var(--input-text, #ddd); font-weight: bold;",
};

// A running stream's status -> {lines: [meters, meters, what it plays], notice, progress}. `notice`: why it plays
// silently (its fix included), or null; `progress`: the playhead's place in the loop (0..1), or null in endless
// play, whose buffer is a ring rolling forward, not the song.
export function statusView(s) {
  const fixed = (value, digits) => Number(value).toFixed(digits);
  const first = [`tick ${fixed(s.tick_ms, 1)} ms`, `decode ${fixed(s.decode_ms, 1)} ms`, `lead ${fixed(s.lead_s, 2)} s`];
  const second = [`playhead ${fixed(s.playhead_s, 1)} s`, `underruns ${s.underruns ?? 0}`];
  if (s.errors) second.push(`errors ${s.errors}`);
  const progress = s.endless || !s.loop_s ? null : (s.playhead_s % s.loop_s) / s.loop_s;
  return {
    lines: [first.join(FIELD_SEPARATOR), second.join(FIELD_SEPARATOR), s.loop ?? ""],
    notice: s.output_warning || null,
    progress,
  };
}

// The live panel's rows, built from the knob specs flowjam's status route sends (engine/params.py's registry, plus a
// running stream's lora/<name> knobs): one row per spec, in the registry's order. Pure functions with no DOM and no
// ComfyUI, imported by flowjam.js and tested under node (tests/test_panel_routes.py).
// ComfyUI imports every .js file of the pack as an extension: this one only defines functions.

const TYPED_INTEGER_VALUES = 1000; // an integer knob with more values than this (a seed) is typed, not slid

// specs: {name: {min, max, default, integer, unit, choices, description}} -> [{name, control, ...}]; control is
// "select" (a choice knob), "number" (an integer knob too wide to slide) or "range".
export function panelRows(specs) {
  return Object.entries(specs ?? {}).map(([name, spec]) => {
    const choices = [...(spec.choices ?? [])];
    const integer = Boolean(spec.integer);
    const wide = integer && spec.max - spec.min > TYPED_INTEGER_VALUES;
    return {
      name,
      control: choices.length ? "select" : wide ? "number" : "range",
      min: spec.min,
      max: spec.max,
      step: integer ? "1" : "any",
      integer,
      choices,
      unit: spec.unit ?? "",
      start: spec.default,
      title: spec.description ?? "",
    };
  });
}

// The choice a select shows for a knob value (the index the stream holds) or a widget value (the choice's name).
export function choiceName(row, value) {
  return typeof value === "number" ? row.choices[Math.round(value)] ?? "" : String(value ?? "");
}

// What a move sends to the stream: a choice by its name, a number inside the range (integer knobs rounded).
export function movedValue(row, value) {
  if (row.control === "select") return choiceName(row, value);
  const clamped = Math.min(row.max, Math.max(row.min, Number(value)));
  return row.integer ? Math.round(clamped) : clamped;
}

// The text beside the control: the value with its unit ("8 steps", "0.70"); a typed number shows only its unit, a
// select nothing (the control shows the value itself).
export function shownValue(row, value) {
  if (row.control === "select" || typeof value !== "number" || !Number.isFinite(value)) return "";
  if (row.control === "number") return row.unit;
  const number = row.integer ? String(Math.round(value)) : value.toFixed(2);
  return row.unit ? `${number} ${row.unit}` : number;
}

// Runs the script of live/plugin_panel.html under node against a running panel (node's own fetch, the page's URL as
// its base), with a minimal document holding the page's elements: the page loads the state and builds a row per knob;
// then the volume slider moves to 0.25, prompt B is applied with its button and an empty prompt A with Ctrl+Enter.
// Prints what the page showed as JSON.
//   node panel_page.js PAGE.html PANEL_URL
"use strict";
const fs = require("fs");
const [html, base] = [fs.readFileSync(process.argv[2], "utf8"), process.argv[3]];
const script = html.match(/<script>([\s\S]*)<\/script>/)[1];

class Element {
  constructor(tag) {
    Object.assign(this, {tag, children: [], listeners: {}, dataset: {}, value: "", textContent: "", className: ""});
  }
  append(...children) {
    this.children.push(...children);
  }
  addEventListener(kind, listener) {
    (this.listeners[kind] ||= []).push(listener);
  }
  async fire(kind, event = {}) {
    for (const listener of this.listeners[kind] || []) await listener(event);
  }
}

const elements = {};
for (const [, tag, id, rest] of html.matchAll(/<(\w+) id="([^"]+)"([^>]*)>/g)) {
  const element = new Element(tag);
  const slot = rest.match(/data-slot="(\w+)"/);
  if (slot) element.dataset.slot = slot[1];
  elements[id] = element;
}
const buttons = [...html.matchAll(/<button data-for="([^"]+)">/g)].map(([, target]) => {
  const button = new Element("button");
  button.dataset.for = target;
  return button;
});
const document = {
  getElementById: (id) => elements[id],
  createElement: (tag) => new Element(tag),
  querySelectorAll: (selector) =>
    selector === "textarea" ? Object.values(elements).filter((e) => e.tag === "textarea") : buttons,
};
const pageFetch = (route, options) => fetch(new URL(route, base), options);
const page = new Function("document", "fetch", "setInterval", script + "\nreturn {rows, poll};")(
  document, pageFetch, () => 0);

(async () => {
  await page.poll();
  const shownPromptA = elements["prompt-a"].value;
  const volume = page.rows.volume;
  volume.input.value = "0.25";
  await volume.input.fire("input");
  await page.poll();  // the page's next look at the state (its own first poll may have answered after the move)
  const shownVolume = volume.output.textContent;
  elements["prompt-b"].value = "glass harmonica";
  await buttons.find((b) => b.dataset.for === "prompt-b").fire("click");
  const afterB = elements.message.textContent;
  elements["prompt-a"].value = " ";
  await elements["prompt-a"].fire("keydown", {key: "Enter", ctrlKey: true, preventDefault() {}});
  for (let waited = 0; elements.message.textContent === afterB && waited < 100; ++waited)  // its POST is not awaited
    await new Promise((resolve) => setTimeout(resolve, 50));
  console.log(JSON.stringify({
    knobs: Object.keys(page.rows),
    shownPromptA,
    shownVolume,
    afterB,
    afterEmptyA: elements.message.textContent,
    messageClass: elements.message.className,
  }));
})().catch((error) => {
  console.error(error);
  process.exit(1);
});

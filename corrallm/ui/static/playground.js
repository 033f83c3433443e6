// corrallm dashboard: the STT playground (SPEC §11 D1, §12 U4). Posts the form to
// /v1/audio/transcriptions with the caller's own API key and draws the answer: segments
// per speaker for a diarized one, the text for a plain one, the OpenAI error message for a
// refusal. A transcript is untrusted text, so answers reach the page through DOM nodes and
// textContent only, never innerHTML.
(() => {
  "use strict";
  const section = document.getElementById("playground");
  if (!section) return;
  // sessionStorage, not a cookie: the key stays in this tab and is never sent by itself.
  const KEY_STORE = "corrallm.playground.key";
  const COLOURS = 6; // .spk-0 … .spk-5 and .seg-0 … .seg-5 in dashboard.css
  let formatChosen = false; // once the user picks a format, changing model keeps it

  const byId = (id) => document.getElementById(id);

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (name === "class") node.className = value;
      else node.setAttribute(name, value);
    }
    node.append(...children.map((c) => (c instanceof Node ? c : String(c))));
    return node;
  }

  function stored(value) {
    try {
      if (value === undefined) return sessionStorage.getItem(KEY_STORE) || "";
      if (value) sessionStorage.setItem(KEY_STORE, value);
      else sessionStorage.removeItem(KEY_STORE);
    } catch (err) {
      // Storage can be disabled; the key then lives in the field only.
    }
    return value;
  }

  function diarizes() {
    const option = byId("pg-model")?.selectedOptions[0];
    return option?.dataset.diarizes === "true";
  }

  function defaultFormat() {
    const format = byId("pg-format");
    if (format && !formatChosen) format.value = diarizes() ? "diarized_json" : "json";
  }

  function init() {
    const key = byId("pg-key");
    if (key && !key.value) key.value = stored();
    defaultFormat();
  }

  function status(text) {
    const line = byId("pg-status");
    if (line) line.textContent = text;
  }

  // -- rendering -------------------------------------------------------------------------
  const seconds = (v) => (Number.isFinite(Number(v)) ? Math.max(0, Number(v)) : 0);

  // 83.25 -> "1:23.3"; rounded to tenths first so 59.96 reads 1:00.0, not 0:60.0.
  function clock(value) {
    const tenths = Math.round(seconds(value) * 10);
    const minutes = Math.floor(tenths / 600);
    const rest = ((tenths - minutes * 600) / 10).toFixed(1).padStart(4, "0");
    return `${minutes}:${rest}`;
  }

  function table(caption, heads, rows, cls) {
    return el("div", { class: "table-wrap" },
      el("table", { class: cls },
        el("caption", {}, caption),
        el("thead", {}, el("tr", {}, ...heads.map((h) => el("th", { scope: "col" }, h)))),
        el("tbody", {}, ...rows)));
  }

  function swatch(index) {
    return el("span", { class: `swatch seg-${index % COLOURS}`, "aria-hidden": "true" });
  }

  function showDiarized(answer) {
    const segments = answer.segments.filter((s) => s && typeof s === "object");
    const speakers = new Map(); // label -> index (first appearance), segments, seconds
    for (const seg of segments) {
      const label = String(seg.speaker ?? "unknown");
      if (!speakers.has(label)) speakers.set(label, { index: speakers.size, count: 0, total: 0 });
      const s = speakers.get(label);
      s.count += 1;
      s.total += Math.max(0, seconds(seg.end) - seconds(seg.start));
    }
    const count = Number.isInteger(answer.num_speakers) ? answer.num_speakers : speakers.size;
    const summary = [...speakers].map(([label, s]) =>
      el("tr", { "data-speaker": label },
        el("th", { scope: "row" }, swatch(s.index), label),
        el("td", { "data-field": "segments" }, s.count),
        el("td", { "data-field": "seconds" }, `${s.total.toFixed(1)} s`)));
    const rows = segments.map((seg) => {
      const label = String(seg.speaker ?? "unknown");
      const index = speakers.get(label).index;
      return el("tr", { class: `pg-seg spk-${index % COLOURS}`, "data-speaker": label },
        el("th", { scope: "row" }, swatch(index), label),
        el("td", { class: "pg-time" }, `${clock(seg.start)}\u2013${clock(seg.end)}`),
        el("td", { class: "pg-text" }, String(seg.text ?? "")));
    });
    return [
      el("p", { class: "summary" },
        el("strong", { "data-field": "num_speakers" }, count),
        ` speaker${count === 1 ? "" : "s"} · ${segments.length} segment${segments.length === 1 ? "" : "s"}`),
      table("Speakers", ["Speaker", "Segments", "Speaking time"], summary, "pg-speakers"),
      table("Segments", ["Speaker", "Time", "Text"], rows, "pg-segments"),
      el("details", {}, el("summary", {}, "Full transcript"),
        el("p", { class: "pg-text" }, String(answer.text ?? ""))),
    ];
  }

  function show(answer) {
    if (answer && typeof answer === "object" && Array.isArray(answer.segments)
        && answer.segments.some((s) => s && s.speaker !== undefined)) {
      return showDiarized(answer);
    }
    if (typeof answer === "string") return [el("p", { class: "pg-text", "data-pg-text": "" }, answer)];
    if (answer && typeof answer.text === "string") {
      return [el("p", { class: "pg-text", "data-pg-text": "" }, answer.text)];
    }
    return [el("pre", { class: "log" }, JSON.stringify(answer, null, 2))];
  }

  function refusal(status, answer) {
    const message = answer?.error?.message
      || (typeof answer === "string" && answer.trim()) || "no message";
    return [el("p", { class: "error", role: "alert", "data-pg-error": "" },
      `Refused (${status}): ${message}`)];
  }

  // -- the form --------------------------------------------------------------------------
  section.addEventListener("submit", async (event) => {
    const form = event.target.closest("#pg-form");
    if (!form) return;
    event.preventDefault();
    const key = byId("pg-key").value.trim();
    stored(key);
    const result = byId("pg-result");
    const button = byId("pg-submit");
    button.disabled = true;
    result.replaceChildren();
    result.setAttribute("aria-busy", "true");
    status("Transcribing… (a cold model loads first)");
    const started = performance.now();
    try {
      const response = await fetch("/v1/audio/transcriptions", {
        method: "POST",
        body: new FormData(form), // the key field has no name: it goes in the header only
        headers: key ? { authorization: `Bearer ${key}` } : {},
        credentials: "omit", // the admin cookie is not an API key
      });
      const json = (response.headers.get("content-type") || "").includes("json");
      const answer = json ? await response.json().catch(() => null) : await response.text();
      result.replaceChildren(...(response.ok ? show(answer) : refusal(response.status, answer)));
      const took = ((performance.now() - started) / 1000).toFixed(1);
      status(response.ok ? `Answered in ${took} s.` : "");
    } catch (err) {
      result.replaceChildren(el("p", { class: "error", role: "alert", "data-pg-error": "" },
        `The request failed: ${err.message}`));
      status("");
    } finally {
      result.removeAttribute("aria-busy");
      button.disabled = false;
    }
  });

  section.addEventListener("change", (event) => {
    if (event.target.id === "pg-format") formatChosen = true;
    if (event.target.id === "pg-model") defaultFormat();
  });
  section.addEventListener("input", (event) => {
    if (event.target.id === "pg-key") stored(event.target.value.trim());
  });

  // -- live updates: only the model list changes, the form and the answer stay -----------
  section.addEventListener("fragment", (event) => {
    const fresh = new DOMParser().parseFromString(event.detail, "text/html");
    const select = byId("pg-model");
    const options = fresh.querySelector("[data-pg-models]");
    if (!select || !options) {
      // No form on one side: nothing typed here to keep, so take the fragment whole.
      section.querySelector(".body").replaceChildren(...fresh.body.childNodes);
      init();
      return;
    }
    const sig = (s) => [...s.options].map((o) => `${o.value}:${o.dataset.diarizes}`).join();
    if (sig(select) === sig(options)) return;
    const chosen = select.value;
    select.replaceChildren(...options.childNodes);
    if ([...select.options].some((o) => o.value === chosen)) select.value = chosen;
    else defaultFormat();
  });

  init();
})();

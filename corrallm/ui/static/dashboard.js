// corrallm dashboard: live updates over the SSE stream /api/v1/events (the EventSource
// sends the corrallm_token cookie), section fragments re-fetched from /ui/section/<name>,
// actions through the REST API with fetch. No framework, no build step.
(() => {
  "use strict";
  const notice = document.getElementById("notice");
  const live = document.getElementById("live");
  const pending = new Set();
  let timer = null;
  // Sections re-fetched on every load pass (the peers' state has no event of its own here)
  // keep their DOM while the server renders the same fragment, so a selection survives.
  const POLLED = new Set(["nodes"]);
  const shown = new Map();

  function say(text) { notice.textContent = text; }

  async function refresh(name) {
    const section = document.getElementById(name);
    if (!section) return;
    const response = await fetch(`/ui/section/${name}?${section.dataset.params || ""}`,
      { credentials: "same-origin" });
    if (response.status === 401) { location.href = "/signin"; return; }
    if (!response.ok) return;
    const html = await response.text();
    if (POLLED.has(name)) {
      if (shown.get(name) === html) return;
      shown.set(name, html);
    }
    // A section holding what the user is doing (the playground's form and answer) takes
    // the new fragment itself and keeps its state; replacing its body would wipe both.
    if ("stateful" in section.dataset) {
      section.dispatchEvent(new CustomEvent("fragment", { detail: html }));
      return;
    }
    const body = section.querySelector(".body");
    const focused = document.activeElement && body.contains(document.activeElement)
      ? document.activeElement.id : null;
    const typed = {};
    body.querySelectorAll("input[id]").forEach((i) => { if (i.value) typed[i.id] = i.value; });
    body.innerHTML = html;
    for (const [id, value] of Object.entries(typed)) {
      const input = document.getElementById(id);
      if (input) input.value = value;
    }
    if (focused && document.getElementById(focused)) document.getElementById(focused).focus();
    if (name === "logs") scrollLog();
    tick();
  }

  // Rows reach the store in its writer's next batch (once a second): a section read from
  // the store is read again after it.
  const STORE_FLUSH_MS = 1300;
  function later(ms, ...names) { setTimeout(() => schedule(...names), ms); }

  function schedule(...names) {
    names.forEach((n) => pending.add(n));
    if (timer) return;
    timer = setTimeout(() => {
      timer = null;
      const names = [...pending];
      pending.clear();
      names.forEach((n) => refresh(n).catch(() => {}));
    }, 200);
  }

  // -- live events ---------------------------------------------------------------------
  const events = new EventSource("/api/v1/events");
  events.onopen = () => { live.dataset.state = "live"; live.textContent = "live"; };
  events.onerror = () => { live.dataset.state = "down"; live.textContent = "reconnecting…"; };
  const on = (kind, fn) => events.addEventListener(kind, (e) => fn(JSON.parse(e.data)));

  on("lifecycle", () => schedule("overview", "residency", "economics", "logs", "playground"));
  on("usage", () => {
    schedule("usage", "lanes", "activity");
    later(STORE_FLUSH_MS, "usage", "lanes", "activity");
  });
  on("request", () => schedule("requests"));
  on("reservation", () => schedule("lanes"));
  // X4/X6: a peer went down or came back (its <model>@<peer> backends are in the overview).
  on("peer", () => schedule("nodes", "overview"));
  on("queue_depth", () => schedule("usage"));
  on("admission", (data) => {
    let lanesStale = false;
    // Ages and tokens so far move while anything is held: the live table follows each pass.
    if (data.backends.some((b) => b.in_flight || b.waiting)
        || document.querySelector("#requests tr[data-request]")) schedule("requests");
    // A peer's own lifecycle and load reach this gateway without an event: follow each pass.
    if (document.querySelector("#nodes [data-peer]")) schedule("nodes");
    for (const b of data.backends) {
      const row = document.querySelector(`#overview tr[data-backend="${CSS.escape(b.backend)}"]`);
      if (!row) continue;
      for (const field of ["in_flight", "waiting"]) {
        const cell = row.querySelector(`[data-field="${field}"]`);
        if (cell && cell.textContent !== String(b[field])) {
          cell.textContent = String(b[field]);
          lanesStale = true;
        }
      }
    }
    if (lanesStale) schedule("lanes");
  });
  on("log", (data) => {
    const pre = document.querySelector("#logs pre.log");
    if (!pre || pre.dataset.logBackend !== data.backend) return;
    const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
    pre.append(document.createTextNode(data.line + "\n"));
    if (/n_ctx|n_slots/.test(data.line)) schedule("logs");
    if (atEnd) scrollLog();
  });

  function scrollLog() {
    const pre = document.querySelector("#logs pre.log");
    if (pre) pre.scrollTop = pre.scrollHeight;
  }

  // -- actions ---------------------------------------------------------------------------
  const ACTIONS = {
    load: { path: "models/load", confirm: null },
    unload: { path: "models/unload", confirm: "Unload %s? Its in-flight requests finish first." },
    pause: { path: "models/pause", confirm: "Pause %s? It is unloaded and kept out of service." },
    resume: { path: "models/unpause", confirm: null },
  };

  document.addEventListener("click", async (event) => {
    const button = event.target.closest(
      "button[data-action], button[data-range], button[data-capture]");
    if (!button) return;
    if (button.dataset.range) {
      document.getElementById("usage").dataset.params = `range=${button.dataset.range}`;
      refresh("usage");
      return;
    }
    if (button.dataset.capture) { openCapture(button.dataset.capture); return; }
    if (button.dataset.action === "cancel") { cancelRequest(button); return; }
    const model = button.dataset.model;
    const action = ACTIONS[button.dataset.action];
    if (action.confirm && !window.confirm(action.confirm.replace("%s", model))) return;
    const body = { model };
    if (button.dataset.action === "pause") {
      const until = document.querySelector(`input[data-until-for="${CSS.escape(model)}"]`);
      if (until && until.value.trim()) body.until = until.value.trim();
    }
    button.disabled = true;
    say(`${button.dataset.action} ${model}…`);
    try {
      const response = await fetch(`/api/v1/${action.path}`, {
        method: "POST",
        credentials: "same-origin",
        headers: { "content-type": "application/json" },
        body: JSON.stringify(body),
      });
      const data = await response.json().catch(() => ({}));
      say(response.ok ? `${button.dataset.action} ${model}: done`
        : `${button.dataset.action} ${model} refused: ${(data.error || {}).message || response.status}`);
    } catch (err) {
      say(`${button.dataset.action} ${model} failed: ${err}`);
    } finally {
      button.disabled = false;
      schedule("overview", "residency", "economics");
    }
  });

  // O1: end one held request; a queued one gets 503 cancelled, a running one is cancelled
  // upstream. The row goes when its `request` event (ended) re-fetches the table.
  async function cancelRequest(button) {
    const id = button.dataset.request;
    const what = `request ${id} (${button.dataset.model})`;
    if (!window.confirm(`Cancel ${what}? A queued request is answered 503 cancelled; `
      + "a running one is cut off upstream.")) return;
    button.disabled = true;
    say(`cancel ${what}…`);
    try {
      const response = await fetch(`/api/v1/requests/${encodeURIComponent(id)}/cancel`, {
        method: "POST", credentials: "same-origin",
      });
      const data = await response.json().catch(() => ({}));
      say(response.ok ? `cancel ${what}: cancelled while ${data.state}`
        : `cancel ${what} refused: ${(data.error || {}).message || response.status}`);
    } catch (err) {
      say(`cancel ${what} failed: ${err}`);
    } finally {
      button.disabled = false;
      schedule("requests");
    }
  }

  // O2: one capture, rendered by the server (escaped) into the page's dialog.
  const dialog = document.getElementById("capture-dialog");
  const dialogBody = dialog.querySelector("[data-capture-body]");
  let opener = null;

  async function openCapture(id) {
    opener = id;
    say(`capture ${id}…`);
    let response;
    try {
      response = await fetch(`/ui/section/capture?id=${encodeURIComponent(id)}`,
        { credentials: "same-origin" });
    } catch (err) {
      say(`capture ${id} failed: ${err}`);
      return;
    }
    if (response.status === 401) { location.href = "/signin"; return; }
    const text = await response.text();
    if (response.ok) {
      dialogBody.innerHTML = text;
      say("");
    } else {
      const p = document.createElement("p");
      p.className = "error";
      p.textContent = text;  // the gateway's words, as text
      dialogBody.replaceChildren(p);
      say(`capture ${id}: ${response.status}`);
    }
    if (!dialog.open) dialog.showModal();
    dialogBody.scrollTop = 0;
  }

  dialog.addEventListener("close", () => {
    dialogBody.replaceChildren();
    // Back to the button that opened it (the activity table may have been re-rendered).
    const back = opener && document.querySelector(`button[data-capture="${CSS.escape(opener)}"]`);
    if (back) back.focus();
    opener = null;
  });

  document.addEventListener("change", (event) => {
    if (!event.target.matches("[data-logs-select]")) return;
    document.getElementById("logs").dataset.params =
      `model=${encodeURIComponent(event.target.value)}`;
    refresh("logs");
  });

  // -- reservation countdowns ------------------------------------------------------------
  function tick() {
    document.querySelectorAll("[data-expires]").forEach((el) => {
      const left = Math.max(0, Math.round((Date.parse(el.dataset.expires) - Date.now()) / 1000));
      el.textContent = left > 0 ? `${left} s` : "expired";
    });
  }
  setInterval(tick, 1000);
  tick();
  scrollLog();
})();

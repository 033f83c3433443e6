// corrallm dashboard: the Keys section (SPEC §22 T2). Creates, rotates and revokes keys
// through the REST API with the admin cookie. A new secret exists only in the API's answer:
// it is shown once in the page (with a copy button), never stored by the page, and gone
// once dismissed or the page is left. Rotating and revoking each ask for confirmation.
(() => {
  "use strict";
  const section = document.getElementById("keys");
  if (!section) return;
  const byId = (id) => document.getElementById(id);

  function status(text) {
    const line = byId("key-status");
    if (line) line.textContent = text;
  }

  async function call(method, path, body) {
    const response = await fetch(`/api/v1/${path}`, {
      method,
      credentials: "same-origin",
      headers: body ? { "content-type": "application/json" } : {},
      body: body ? JSON.stringify(body) : undefined,
    });
    if (response.status === 401) { location.href = "/signin"; return null; }
    const data = await response.json().catch(() => ({}));
    if (!response.ok) throw new Error((data.error || {}).message || `HTTP ${response.status}`);
    return data;
  }

  // -- the list: re-read after each change; the form and a shown secret stay ------------
  function takeList(html) {
    const fresh = new DOMParser().parseFromString(html, "text/html");
    const list = fresh.querySelector("[data-keys-list]");
    const here = section.querySelector("[data-keys-list]");
    if (list && here) here.replaceWith(document.importNode(list, true));
  }

  async function refresh() {
    const response = await fetch("/ui/section/keys", { credentials: "same-origin" });
    if (response.ok) takeList(await response.text());
  }

  // dashboard.js hands a stateful section its new fragment instead of replacing it.
  section.addEventListener("fragment", (event) => takeList(event.detail));

  // -- the secret, shown once ---------------------------------------------------------
  function showSecret(name, secret) {
    section.querySelector("[data-secret-name]").textContent = name;
    byId("key-secret").value = secret;
    byId("key-copied").textContent = "";
    byId("key-secret-box").hidden = false;
    byId("key-secret").focus();
    byId("key-secret").select();
  }

  function hideSecret() {
    byId("key-secret").value = "";
    byId("key-secret-box").hidden = true;
  }

  async function copySecret() {
    const input = byId("key-secret");
    const said = byId("key-copied");
    try {
      if (!navigator.clipboard) throw new Error("no clipboard");
      await navigator.clipboard.writeText(input.value);
      said.textContent = "Copied.";
    } catch (err) {
      // No clipboard API (or no permission): select it all for Ctrl+C / ⌘C.
      input.focus();
      input.select();
      said.textContent = "Selected: press Ctrl+C (⌘C) to copy.";
    }
  }

  // -- actions ---------------------------------------------------------------------------
  section.addEventListener("submit", async (event) => {
    if (event.target.id !== "key-form") return;
    event.preventDefault();
    const form = event.target;
    const name = byId("key-name").value.trim();
    const models = byId("key-models").value.split(",").map((m) => m.trim()).filter(Boolean);
    const body = { name, group: byId("key-group").value };
    if (models.length) body.models = models;
    const button = byId("key-create");
    button.disabled = true;
    status(`creating ${name}…`);
    try {
      const made = await call("POST", "keys", body);
      if (!made) return;
      form.reset();
      status(`${made.name} created.`);
      showSecret(made.name, made.secret);
      await refresh();
    } catch (err) {
      status(`not created: ${err.message}`);
    } finally {
      button.disabled = false;
    }
  });

  section.addEventListener("click", async (event) => {
    const button = event.target.closest("button");
    if (!button) return;
    if (button.id === "key-copy") { copySecret(); return; }
    if (button.id === "key-secret-done") { hideSecret(); return; }
    const action = button.dataset.keyAction;
    if (!action) return;
    const name = button.dataset.key;
    const question = action === "rotate"
      ? `Rotate key ${name}? Its current secret is refused at once; the new one is shown once.`
      : `Revoke key ${name}? Requests with its secret are refused from now on.`;
    if (!window.confirm(question)) return;
    button.disabled = true;
    status(`${action} ${name}…`);
    try {
      const path = `keys/${encodeURIComponent(name)}`;
      if (action === "rotate") {
        const rotated = await call("POST", `${path}/rotate`);
        if (!rotated) return;
        status(`${name} rotated: its old secret is refused.`);
        showSecret(name, rotated.secret);
      } else {
        if (!(await call("DELETE", path))) return;
        status(`${name} revoked.`);
        if (section.querySelector("[data-secret-name]").textContent === name) hideSecret();
      }
      await refresh();
    } catch (err) {
      status(`${action} ${name} refused: ${err.message}`);
      button.disabled = false;
    }
  });
})();

// The onceq console: a client of the admin API (/v1), nothing else.
//
// Every string that comes from a queue (payloads, attributes, errors,
// queue names, labels) reaches the page as a text node: the page is built
// with el() below, which never parses HTML. The host's Content-Security-
// Policy allows this file and app.css only.
"use strict";

const state = { me: null, timer: null };

// ---- DOM helpers --------------------------------------------------------

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (k === "class") e.className = v;
    else e.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return e;
}

function svg(tag, attrs, ...children) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
  for (const c of children) e.append(c);
  return e;
}

function show(...nodes) {
  const main = document.getElementById("main");
  main.replaceChildren(...nodes.flat().filter((n) => n !== null && n !== undefined && n !== false));
}

function flash(text, error) {
  const f = document.getElementById("flash");
  f.replaceChildren(el("div", { class: error ? "error" : "" }, text));
  setTimeout(() => { if (f.firstChild && f.firstChild.textContent === text) f.replaceChildren(); }, 6000);
}

const fmt = {
  n: (x) => (x === null || x === undefined ? "–" : Number(x).toLocaleString("en")),
  rate: (x) => (x === null || x === undefined ? "–" : x < 10 ? x.toFixed(1) : Math.round(x).toLocaleString("en")),
  ms: (x) => (x === null || x === undefined ? "–" : x < 1000 ? `${Math.round(x)} ms` : x < 120000 ? `${(x / 1000).toFixed(1)} s` : `${Math.round(x / 60000)} min`),
  time: (us) => (us ? new Date(us / 1000).toISOString().replace("T", " ").replace("Z", "") : "–"),
  short: (s, n) => (s.length > n ? s.slice(0, n) + "…" : s),
};

function can(action, queue) {
  const me = state.me;
  if (!me || me.open) return false;
  const roles = { read: ["viewer", "operator", "deployer", "admin"], operate: ["operator", "admin"], deploy: ["deployer", "admin"] };
  if (!roles[action].includes(me.role)) return false;
  return me.queues.some((p) => {
    const re = new RegExp("^" + p.split("*").map((s) => s.replace(/[.*+?^${}()|[\]\\]/g, "\\$&")).join(".*") + "$");
    return re.test(queue);
  });
}

// ---- the API ------------------------------------------------------------

async function api(method, path, body, headers) {
  const h = Object.assign({}, headers || {});
  if (method !== "GET" && state.me && state.me.csrf) h["X-Onceq-CSRF"] = state.me.csrf;
  if (body !== undefined && !(body instanceof Blob) && !(body instanceof ArrayBuffer)) {
    h["Content-Type"] = "application/json";
    body = JSON.stringify(body);
  }
  const r = await fetch(path, { method, headers: h, body, credentials: "same-origin" });
  let data = null;
  try { data = await r.json(); } catch (_) { /* no body */ }
  if (r.status === 401 && !path.startsWith("/console/")) { state.me = null; location.hash = "#/login"; }
  if (!r.ok) throw new Error((data && data.error) || `HTTP ${r.status}`);
  return data;
}

const q = (params) => {
  const s = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== undefined && v !== null && v !== "") s.set(k, v);
  return s.toString();
};

// ---- routing ------------------------------------------------------------

function route() {
  clearInterval(state.timer);
  const hash = location.hash || "#/";
  const [path, query] = hash.slice(1).split("?");
  const params = Object.fromEntries(new URLSearchParams(query || ""));
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  for (const a of document.querySelectorAll("nav a")) {
    a.classList.toggle("active", a.getAttribute("href") === "#/" + (parts[0] || ""));
  }
  if (!state.me && parts[0] !== "login") return session().then(route);
  const pages = { login, queue, message, handlers, outbox, audit };
  const page = pages[parts[0]] || overview;
  Promise.resolve(page(parts.slice(1), params)).catch((e) => show(el("p", { class: "bad" }, e.message)));
}

async function session() {
  try {
    state.me = await api("GET", "/console/session");
  } catch (_) {
    state.me = null;
    location.hash = "#/login";
    return;
  }
  whoami();
}

function whoami() {
  const who = document.getElementById("who");
  if (!state.me) return who.replaceChildren();
  const me = state.me;
  who.replaceChildren(
    el("span", { id: "me" }, me.open ? "read-only (no token configured)" : `${me.name} · ${me.role}`),
    me.open ? null : el("button", { id: "logout", onclick: logout }, "Log out"),
  );
}

async function logout() {
  await api("POST", "/console/logout");
  state.me = null;
  whoami();
  location.hash = "#/login";
}

function login() {
  const input = el("input", { id: "token", type: "password", autocomplete: "off", placeholder: "admin token" });
  const form = el("form", { class: "login", onsubmit: async (ev) => {
    ev.preventDefault();
    try {
      state.me = await api("POST", "/console/login", { token: input.value });
      whoami();
      location.hash = "#/";
    } catch (e) { flash(e.message, true); }
  } },
  el("h1", {}, "Log in"),
  el("p", { class: "muted" }, "With an admin token of this host ([[admin.tokens]] or admin.token). The session lasts 8 hours."),
  input, el("button", { class: "primary", type: "submit", id: "login" }, "Log in"));
  show(form);
  input.focus();
}

// ---- charts ---------------------------------------------------------------

function rates(samples, field) {
  const out = [];
  for (let i = 1; i < samples.length; i++) {
    const dt = samples[i].t - samples[i - 1].t;
    out.push({ t: samples[i].t, v: dt > 0 ? Math.max(0, samples[i][field] - samples[i - 1][field]) / dt : 0 });
  }
  return out;
}

function line(points, w, h, max, cls) {
  if (points.length < 2) return null;
  const t0 = points[0].t, t1 = points[points.length - 1].t || t0 + 1;
  const pts = points.map((p) => `${((p.t - t0) / Math.max(1, t1 - t0)) * w},${h - (p.v / (max || 1)) * (h - 2) - 1}`).join(" ");
  return svg("polyline", { points: pts, class: cls || "" });
}

function spark(samples) {
  const r = rates(samples, "processed");
  const max = Math.max(1, ...r.map((p) => p.v));
  const s = svg("svg", { class: "spark", viewBox: "0 0 120 24", preserveAspectRatio: "none" });
  const l = line(r, 120, 24, max);
  if (l) s.append(l);
  return s;
}

function chart(samples) {
  const p = rates(samples, "processed"), f = rates(samples, "failures");
  const max = Math.max(1, ...p.map((x) => x.v), ...f.map((x) => x.v));
  const s = svg("svg", { class: "chart", viewBox: "0 0 600 120", preserveAspectRatio: "none" });
  for (const [pts, cls] of [[p, "processed"], [f, "failed"]]) {
    const l = line(pts, 600, 120, max, cls);
    if (l) s.append(l);
  }
  return el("div", {}, s, el("div", { class: "muted" }, `processed (blue) and failed (red) per second on this host, last hour; peak ${fmt.rate(max)}/s`));
}

// ---- pages ----------------------------------------------------------------

async function overview() {
  const render = async () => {
    const o = await api("GET", "/v1/overview");
    const hist = await Promise.all(o.queues.map((x) => x.here ? api("GET", "/v1/history?" + q({ queue: x.stats.queue })).catch(() => null) : null));
    const rows = o.queues.map((x, i) => {
      const s = x.stats, h = x.here;
      const name = s.queue;
      return el("tr", { "data-queue": name },
        el("td", {}, el("a", { href: "#/queue/" + encodeURIComponent(name) }, name), " ",
          x.paused ? el("span", { class: "badge", title: "paused by " + (x.paused_by || "?") }, "paused") : null),
        el("td", { class: "num ready" }, fmt.n(s.ready)),
        el("td", { class: "num" }, fmt.n(s.delayed)),
        el("td", { class: "num" }, fmt.n(s.leased)),
        el("td", { class: "num dead" }, s.dead ? el("a", { href: `#/queue/${encodeURIComponent(name)}?state=dead` }, fmt.n(s.dead)) : "0"),
        el("td", { class: "num" }, fmt.n(s.processed)),
        el("td", { class: "num" }, h ? fmt.rate(h.processed_per_s) : "–"),
        el("td", { class: "num" }, h ? fmt.rate(h.failed_per_s) : "–"),
        el("td", { class: "num" }, fmt.ms(x.oldest_ready_ms)),
        el("td", { class: "num" }, h && h.p50_ms !== null ? `${fmt.ms(h.p50_ms)} / ${fmt.ms(h.p99_ms)}` : "–"),
        el("td", {}, hist[i] ? spark(hist[i].samples) : null),
        el("td", {}, can("operate", name)
          ? el("button", { class: x.paused ? "primary" : "", "data-action": x.paused ? "resume" : "pause", onclick: () => pause(name, !x.paused) }, x.paused ? "Resume" : "Pause")
          : null),
      );
    });
    const outbox = o.outbox.map((c) => el("tr", { "data-connector": c.stats.connector },
      el("td", {}, el("a", { href: "#/queue/" + encodeURIComponent("onceq.outbox." + c.stats.connector) }, c.stats.connector)),
      el("td", { class: "num" }, fmt.n(c.stats.pending)),
      el("td", { class: "num" }, fmt.n(c.stats.in_flight)),
      el("td", { class: "num" }, fmt.n(c.retrying)),
      el("td", { class: "num" }, fmt.n(c.stats.dead)),
      el("td", { class: "num" }, fmt.n(c.stats.delivered)),
      el("td", {}, fmt.time(c.stats.last_delivered_at)),
      el("td", { class: "bad" }, c.last_error ? fmt.short(c.last_error, 120) : ""),
    ));
    const hosts = (o.hosts || []).map((x) => el("tr", { "data-host": x.host.id, class: x.gone ? "muted" : "" },
      el("td", {}, x.host.name, " ", el("span", { class: "muted" }, `pid ${x.host.pid}`)),
      el("td", {}, x.host.version),
      el("td", {}, x.host.queues.join(", ")),
      el("td", { class: "num" }, fmt.n(x.host.in_flight)),
      el("td", { class: "num" }, fmt.n(x.host.finished)),
      el("td", {}, fmt.time(x.host.started_at)),
      el("td", { class: x.gone ? "bad" : "" }, x.gone ? `gone? not seen for ${fmt.ms(x.seen_ago_ms)}` : `${fmt.ms(x.seen_ago_ms)} ago`),
    ));
    show(
      el("h1", {}, "Queues"),
      el("p", { class: "muted" }, `store: ${o.store} · counts from the database; rates, latency and charts from this host · refreshed every 2 s`),
      el("table", { id: "queues" },
        el("thead", {}, el("tr", {}, ["queue", "ready", "delayed", "leased", "dead", "processed", "/s", "failed/s", "oldest ready", "p50 / p99", "last hour", ""].map((t, i) => el("th", { class: i > 0 && i < 10 ? "num" : "" }, t)))),
        el("tbody", {}, rows.length ? rows : el("tr", {}, el("td", { colspan: 12, class: "muted" }, "no queues yet")))),
      el("h2", {}, "Outbox"),
      el("table", { id: "connectors" },
        el("thead", {}, el("tr", {}, ["connector", "pending", "in flight", "retrying", "dead", "delivered", "last delivery", "last error"].map((t) => el("th", {}, t)))),
        el("tbody", {}, outbox.length ? outbox : el("tr", {}, el("td", { colspan: 8, class: "muted" }, "no intents yet")))),
      el("h2", {}, "Hosts seen in the last hour"),
      el("table", { id: "hosts" },
        el("thead", {}, el("tr", {}, ["host", "version", "serves", "in flight", "finished", "started", "last seen"].map((t) => el("th", {}, t)))),
        el("tbody", {}, hosts.length ? hosts : el("tr", {}, el("td", { colspan: 7, class: "muted" }, "no host has said it is serving")))),
    );
  };
  await render();
  state.timer = setInterval(() => { if (!document.hidden) render().catch(() => {}); }, 2000);
}

async function pause(name, yes) {
  try {
    await api("POST", `/v1/queues/${encodeURIComponent(name)}/${yes ? "pause" : "resume"}`);
    flash(`${name} ${yes ? "paused: nothing is leased from it until resumed" : "resumed"}`);
    route();
  } catch (e) { flash(e.message, true); }
}

const FILTERS = ["field", "value", "contains", "attr", "error", "since", "until", "id"];
// Set by a click on a reason group (not a form field).
const HIDDEN_FILTERS = ["reason"];

async function queue([name], params) {
  const st = params.state || "ready";
  const tabs = el("div", { class: "tabs" }, ["ready", "delayed", "leased", "dead"].map((s) =>
    el("a", { href: `#/queue/${encodeURIComponent(name)}?${q({ state: s })}`, class: s === st ? "active" : "", "data-state": s }, s)));
  const inputs = {};
  const form = el("form", { class: "search", id: "search", onsubmit: (ev) => {
    ev.preventDefault();
    const p = { state: st };
    for (const k of FILTERS) p[k] = inputs[k].value.trim();
    location.hash = `#/queue/${encodeURIComponent(name)}?${q(p)}`;
  } },
  FILTERS.map((k) => {
    inputs[k] = el("input", { name: k, value: params[k] || "", placeholder: { field: "customer.id", value: "42", attr: "name=value", since: "2026-12-01T00:00:00Z" }[k] || "" });
    return el("label", {}, k === "field" ? "payload field" : k === "error" ? "error text" : k === "contains" ? "payload contains" : k, inputs[k]);
  }),
  el("button", { class: "primary", type: "submit" }, "Search"));

  const page = await api("GET", `/v1/queues/${encodeURIComponent(name)}/messages?` + q(Object.assign({ limit: 50 }, params, { state: st })));
  const dead = st === "dead";
  const picked = new Set();
  const rows = page.messages.map((m) => el("tr", { "data-id": m.id },
    dead && can("operate", name) ? el("td", {}, el("input", { type: "checkbox", onchange: (ev) => { ev.target.checked ? picked.add(m.id) : picked.delete(m.id); } })) : null,
    el("td", {}, el("a", { href: "#/message/" + encodeURIComponent(m.id), class: "id" }, fmt.short(m.id, 14))),
    el("td", {}, fmt.time(m.enqueued_at)),
    el("td", {}, fmt.time(m.at)),
    el("td", { class: "num" }, m.deliveries),
    el("td", { class: "num" }, m.failures),
    el("td", { class: "payload" }, m.payload_base64 ? "base64:" + m.payload_base64 : m.payload_text),
    el("td", { class: "bad" }, m.error ? fmt.short(m.error, 100) : ""),
  ));
  const filter = {};
  for (const k of FILTERS.concat(HIDDEN_FILTERS)) if (params[k] && k !== "id") filter[k] = params[k];
  const bulk = (action, ids) => async () => {
    try {
      const body = ids ? { queue: name, action, ids: [...ids] } : { queue: name, action, filter };
      const dry = await api("POST", "/v1/dead/bulk", Object.assign({ dry_run: true }, body));
      if (!dry.matched) return flash("nothing matches", true);
      if (!confirm(`${action} ${dry.matched} dead letter${dry.matched === 1 ? "" : "s"} of ${name}?`)) return;
      const done = await api("POST", "/v1/dead/bulk", body);
      flash(`${action === "replay" ? "replayed" : "discarded"} ${done.settled} of ${done.matched}`);
      route();
    } catch (e) { flash(e.message, true); }
  };
  const actions = dead && can("operate", name) ? el("div", { class: "bar" },
    el("button", { id: "replay-selected", onclick: () => picked.size ? bulk("replay", picked)() : flash("select some first", true) }, "Replay selected"),
    el("button", { class: "danger", id: "discard-selected", onclick: () => picked.size ? bulk("discard", picked)() : flash("select some first", true) }, "Discard selected"),
    el("button", { id: "replay-matching", onclick: bulk("replay") }, "Replay all matching"),
    el("button", { class: "danger", id: "discard-matching", onclick: bulk("discard") }, "Discard all matching"),
  ) : null;
  let reasons = null;
  if (dead) {
    const r = await api("GET", "/v1/dead/reasons?" + q({ queue: name }));
    reasons = el("div", {}, el("h2", {}, "Dead letters by reason"),
      el("table", { id: "reasons" }, el("tbody", {}, r.reasons.map((g) => el("tr", {},
        el("td", { class: "num" }, fmt.n(g.count)),
        el("td", {}, el("a", { href: `#/queue/${encodeURIComponent(name)}?${q({ state: "dead", reason: g.reason })}` }, fmt.short(g.reason, 160))),
        el("td", { class: "muted" }, "newest " + fmt.time(g.newest_at))))),
      ), r.complete ? null : el("p", { class: "muted" }, `of the newest ${fmt.n(r.scanned)}`));
  }
  const next = page.next ? el("a", { id: "next", href: `#/queue/${encodeURIComponent(name)}?${q(Object.assign({}, params, { state: st, after: page.next }))}` }, "next page →") : null;
  const hist = await api("GET", "/v1/history?" + q({ queue: name })).catch(() => null);
  show(
    el("h1", {}, "Queue ", el("span", { id: "queue-name" }, name)),
    hist && hist.samples.length > 1 ? chart(hist.samples) : null,
    tabs, form, reasons, actions,
    el("table", { id: "messages" },
      el("thead", {}, el("tr", {}, (dead && can("operate", name) ? [""] : []).concat(["id", "enqueued", dead ? "died" : st === "leased" ? "lease expires" : "visible", "deliveries", "failures", "payload", dead ? "reason" : "last error"]).map((t) => el("th", {}, t)))),
      el("tbody", {}, rows.length ? rows : el("tr", {}, el("td", { colspan: 8, class: "muted" }, "no messages")))),
    el("p", { class: "muted", id: "scanned" }, `${page.messages.length} shown, ${fmt.n(page.scanned)} read`, page.next ? " · " : "", next),
  );
}

function pretty(m) {
  if (m.payload_base64) return el("div", {}, el("p", { class: "muted" }, "not UTF-8: the exact bytes, base64"), el("pre", { id: "payload" }, m.payload_base64));
  try { return el("pre", { id: "payload" }, JSON.stringify(JSON.parse(m.payload_text), null, 2)); } catch (_) { return el("pre", { id: "payload" }, m.payload_text); }
}

async function message([id]) {
  const d = await api("GET", "/v1/messages/" + encodeURIComponent(id));
  const m = d.message;
  const parts = [el("h1", {}, "Message ", el("span", { class: "id" }, id))];
  if (m) {
    parts.push(
      el("div", { class: "cards" },
        el("div", { class: "card" }, "queue", el("b", {}, el("a", { href: "#/queue/" + encodeURIComponent(m.queue) }, m.queue))),
        el("div", { class: "card" }, "state", el("b", { id: "state" }, m.state)),
        el("div", { class: "card" }, "deliveries / failures", el("b", {}, `${m.deliveries} / ${m.failures}`)),
        el("div", { class: "card" }, "enqueued", el("b", {}, fmt.time(m.enqueued_at))),
        el("div", { class: "card" }, m.state === "dead" ? "died" : m.state === "leased" ? "lease expires" : "visible", el("b", {}, fmt.time(m.at))),
        m.handler_version ? el("div", { class: "card" }, "handler version", el("b", {}, m.handler_version)) : null),
      m.error ? el("div", {}, el("h2", {}, m.state === "dead" ? "Reason" : "Last error"), el("pre", { class: "bad", id: "error" }, m.error)) : null,
      el("h2", {}, "Payload"), pretty(m),
      el("h2", {}, "Attributes"),
      m.attributes.length ? el("table", { id: "attributes" }, el("tbody", {}, m.attributes.map(([k, v]) => el("tr", {}, el("td", {}, k), el("td", {}, v))))) : el("p", { class: "muted" }, "none"),
    );
    if (m.state === "dead" && can("operate", m.queue)) {
      const act = (a) => async () => {
        try { await api("POST", `/v1/dead/${encodeURIComponent(id)}/${a}`); flash(`${a === "replay" ? "replayed" : "discarded"} ${id}`); route(); } catch (e) { flash(e.message, true); }
      };
      parts.push(el("div", { class: "bar" }, el("button", { onclick: act("replay") }, "Replay"), el("button", { class: "danger", onclick: act("discard") }, "Discard")));
    }
  } else {
    parts.push(el("p", { class: "muted" }, "Processed (gone from its queue); what it produced is below."));
  }
  if (d.produced_by) parts.push(el("p", {}, "Produced by ", el("a", { href: "#/message/" + encodeURIComponent(d.produced_by.id) }, d.produced_by.id), " on ", d.produced_by.queue));
  parts.push(el("h2", {}, "Follow-ups and intents it produced (still queued or dead)"),
    d.produced.length ? el("table", { id: "produced" }, el("tbody", {}, d.produced.map((p) => el("tr", {},
      el("td", {}, el("a", { href: "#/message/" + encodeURIComponent(p.id) }, fmt.short(p.id, 14))), el("td", {}, p.queue), el("td", {}, p.state), el("td", { class: "payload" }, p.payload_text))))) : el("p", { class: "muted" }, "none"));
  show(parts);
}

async function handlers() {
  const o = await api("GET", "/v1/overview");
  const sections = [];
  for (const x of o.queues.filter((x) => x.here)) {
    const name = x.stats.queue;
    const versions = await api("GET", `/v1/queues/${encodeURIComponent(name)}/versions`);
    const outcomes = x.here.versions || {};
    const rows = versions.map((v) => el("tr", { class: v.active ? "active" : "" },
      el("td", { class: "id" }, v.version, v.active ? el("span", { class: "badge" }, "active") : null),
      el("td", {}, v.label || ""), el("td", {}, v.source), el("td", {}, fmt.time(v.at_ms * 1000)), el("td", {}, v.by || ""),
      el("td", {}, v.signer ? v.signer.key_id || JSON.stringify(v.signer) : ""),
      el("td", { class: "num" }, fmt.n((outcomes[v.version] || {}).processed || 0)),
      el("td", { class: "num" }, fmt.n((outcomes[v.version] || {}).dead_lettered || 0)),
      el("td", { class: "drain" }, v.active ? "serving" : (outcomes[v.version] || {}).in_flight ? `draining: ${fmt.n(outcomes[v.version].in_flight)} in flight` : "idle")));
    const file = el("input", { type: "file", accept: ".wasm", name: "component" });
    const sig = el("input", { type: "file", accept: ".minisig", name: "signature" });
    const label = el("input", { name: "label", placeholder: "label (v2, a git sha)" });
    const deploy = can("deploy", name) ? el("form", { class: "search", "data-queue": name, onsubmit: async (ev) => {
      ev.preventDefault();
      if (!file.files[0]) return flash("choose a component (.wasm)", true);
      const headers = {};
      if (sig.files[0]) headers["Onceq-Signature"] = btoa(await sig.files[0].text());
      try {
        const d = await api("POST", `/v1/queues/${encodeURIComponent(name)}/deploy?` + q({ label: label.value.trim() }), file.files[0], headers);
        flash(`deployed ${d.version} to ${name}`);
        route();
      } catch (e) { flash(e.message, true); }
    } }, el("label", {}, "component", file), el("label", {}, "signature (optional)", sig), el("label", {}, "label", label),
    el("button", { class: "primary", type: "submit" }, "Deploy"),
    el("button", { type: "button", class: "rollback", onclick: async () => {
      if (!confirm(`Roll ${name} back to its previous version?`)) return;
      try { const d = await api("POST", `/v1/queues/${encodeURIComponent(name)}/rollback`); flash(`rolled ${name} back to ${d.version}`); route(); } catch (e) { flash(e.message, true); }
    } }, "Roll back")) : null;
    sections.push(el("section", { "data-queue": name },
      el("h2", {}, name, " ", el("span", { class: "muted" }, `in flight here: ${x.here.in_flight}`)),
      el("table", {}, el("thead", {}, el("tr", {}, ["version", "label", "source", "deployed", "by", "signer", "processed here", "dead-lettered here", "state here"].map((t) => el("th", {}, t)))), el("tbody", {}, rows)),
      deploy));
  }
  show(el("h1", {}, "Handlers"), el("p", { class: "muted" }, "A deploy is checked like onceq deploy (a valid component, its imports, the signature when required), then switched to; messages in flight finish on the version they started with."), sections);
}

async function outbox(_, params) {
  const o = await api("GET", "/v1/overview");
  const key = el("input", { name: "key", value: params.key || "", placeholder: "idempotency key contains" });
  const sections = [];
  for (const c of o.outbox) {
    const name = c.stats.connector;
    const delivered = await api("GET", "/v1/outbox/delivered?" + q({ connector: name, key: params.key, limit: 50 }));
    sections.push(el("section", {},
      el("h2", {}, name),
      el("p", {}, `pending ${fmt.n(c.stats.pending)} · in flight ${fmt.n(c.stats.in_flight)} · retrying ${fmt.n(c.retrying)} · dead `,
        el("a", { href: `#/queue/${encodeURIComponent("onceq.outbox." + name)}?state=dead` }, fmt.n(c.stats.dead)),
        ` · delivered ${fmt.n(c.stats.delivered)} · last delivery ${fmt.time(c.stats.last_delivered_at)}`),
      c.last_error ? el("pre", { class: "bad" }, c.last_error) : null,
      el("table", {}, el("thead", {}, el("tr", {}, ["idempotency key", "delivered", "key kept until"].map((t) => el("th", {}, t)))),
        el("tbody", {}, delivered.map((d) => el("tr", {}, el("td", {}, d.idempotency_key), el("td", {}, fmt.time(d.delivered_at)), el("td", {}, fmt.time(d.key_kept_until))))))));
  }
  show(el("h1", {}, "Outbox"),
    el("form", { class: "search", onsubmit: (ev) => { ev.preventDefault(); location.hash = "#/outbox?" + q({ key: key.value.trim() }); } }, el("label", {}, "delivered key", key), el("button", { class: "primary" }, "Search")),
    sections.length ? sections : el("p", { class: "muted" }, "no intents yet"));
}

async function audit() {
  const list = await api("GET", "/v1/audit?limit=200");
  show(el("h1", {}, "Audit trail"),
    el("table", { id: "audit" }, el("thead", {}, el("tr", {}, ["when", "who", "action", "queue", "subject", "signer", "result"].map((t) => el("th", {}, t)))),
      el("tbody", {}, list.map((e) => el("tr", {}, el("td", {}, fmt.time(e.at)), el("td", {}, e.actor), el("td", {}, e.action), el("td", {}, e.queue || ""), el("td", { class: "id" }, e.subject), el("td", {}, e.signer || ""), el("td", { class: e.result === "ok" ? "ok" : "bad" }, e.result))))));
}

window.addEventListener("hashchange", route);
window.addEventListener("DOMContentLoaded", route);

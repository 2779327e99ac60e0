// The GPU map: polls map/data (the allocator's view, answered 304 while nothing changed) and draws
// every node's cards as bars filled by the pods on them. Everything shown comes from the cluster's
// objects (names are anyone's text), so it is written with textContent, never as HTML.
"use strict";

const POLL_MS = 2000;
const STALE_MS = 10000; // no answer for this long: the header says the view is stale
const PAGE = 200; // node rows drawn per group before "show more"
const HOT = 80; // a card this busy (percent utilisation) is hot

const state = { doc: null, etag: null, lastOk: 0, open: new Map(), shown: new Map() };
const $ = (id) => document.getElementById(id);

function el(tag, props, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else if (k.startsWith("data-") || k === "title" || k === "aria-label") e.setAttribute(k, v);
    else e[k] = v;
  }
  for (const c of children) if (c) e.append(c);
  return e;
}

// A stable colour per pod, so one pod reads the same on every card.
function colour(pod) {
  let h = 0;
  for (const ch of pod) h = (h * 31 + ch.charCodeAt(0)) >>> 0;
  return `hsl(${h % 360} 55% 55%)`;
}

function mib(n) {
  return n >= 1024 ? `${(n / 1024).toFixed(n % 1024 ? 1 : 0)} GiB` : `${n} MiB`;
}

function cardsKey(node) {
  const count = new Map();
  for (const c of node.cards) count.set(c.model, (count.get(c.model) || 0) + 1);
  if (!count.size) return "no cards";
  return [...count].map(([m, n]) => `${n} × ${m}`).join(" + ");
}

function nodeMatches(node, query, filter) {
  if (query) {
    const q = query.toLowerCase();
    const named = node.name.toLowerCase().includes(q) ||
      node.cards.some((c) => holders(c).some((p) => p.toLowerCase().includes(q)));
    if (!named) return false;
  }
  const free = node.cards.reduce((s, c) => s + (c.healthy ? c.percentFree : 0), 0);
  switch (filter) {
    case "room": return node.agentReady && free > 0;
    case "busy": return node.cards.length > 0 && free === 0;
    case "unhealthy": return !node.agentReady || node.cards.some((c) => !c.healthy);
    case "fragmented": return node.fragmentation > 0;
    case "hot": return node.cards.some((c) => c.load >= HOT);
    default: return true;
  }
}

// What holds a card: its pods' shares, then its ResourceClaims' allocations ("claim ns/name").
function held(c) {
  const claims = (c.claims || []).map((h) => ({ pod: `claim ${h.claim}`, percent: h.percent, memoryMiB: h.memoryMiB }));
  return c.shares.concat(claims);
}

function holders(c) {
  return c.pods.concat((c.claims || []).map((h) => `claim ${h.claim}`));
}

function drawCard(node, c) {
  const bar = el("div", { class: "bar", title: `${c.percentUsed}% used, ${c.percentFree}% free` });
  const mem = el("div", { class: "bar mem", title: `${mib(c.memoryMiB - c.memoryFreeMiB)} of ${mib(c.memoryMiB)} used` });
  for (const s of held(c)) {
    const tip = `${s.pod}: ${s.percent}%, ${mib(s.memoryMiB)}`;
    bar.append(el("div", { class: "seg", title: tip, style: `width:${Math.min(s.percent, 100)}%;background:${colour(s.pod)}` }));
    const w = c.memoryMiB ? (100 * s.memoryMiB) / c.memoryMiB : 0;
    mem.append(el("div", { class: "seg", title: tip, style: `width:${Math.min(w, 100)}%;background:${colour(s.pod)}` }));
  }
  const health = c.healthy ? "" : " unhealthy";
  const attrs = { class: `card${health}`, "data-uuid": c.uuid, "data-pods": holders(c).join(" "), "data-used": String(c.percentUsed) };
  let load = null;
  if (c.load !== null && c.load !== undefined) {
    // What the card really does (Prometheus, last minute), beside what is granted on it.
    attrs["data-load"] = String(c.load);
    load = el("div", { class: "bar load", title: `${c.load}% busy (utilisation, last minute)` },
      el("div", { class: "seg", style: `width:${c.load}%;background:${heat(c.load)}` }));
  }
  const right = load ? `${c.percentUsed}% · ${c.load}% busy` : `${c.percentUsed}%`;
  return el("div", attrs,
    el("div", { class: "label" }, el("span", { text: `#${c.index} ${c.model}${health}` }), el("span", { text: right })),
    bar, mem, load);
}

// Green when idle, red when hot.
function heat(load) {
  return `hsl(${Math.round(120 - 1.2 * load)} 70% 45%)`;
}

function drawNode(node) {
  const cpu = `${((node.cpuMilli - node.cpuFreeMilli) / 1000).toFixed(1)}/${(node.cpuMilli / 1000).toFixed(1)} CPU`;
  const info = [cpu, `frag ${node.fragmentation}`];
  if (!node.agentReady) info.unshift("agent not ready");
  const cards = el("div", { class: "cards" });
  for (const c of node.cards) cards.append(drawCard(node, c));
  if (!node.cards.length) cards.append(el("span", { class: "empty", text: "no cards" }));
  return el("div", { class: `node${node.agentReady ? "" : " notserving"}`, "data-node": node.name },
    el("div", {}, el("div", { class: "name", text: node.name }), el("div", { class: "info", text: info.join(" · ") })),
    cards);
}

function drawGroup(key, nodes, open) {
  const used = nodes.reduce((s, n) => s + n.cards.reduce((t, c) => t + c.percentUsed, 0), 0);
  const total = nodes.reduce((s, n) => s + 100 * n.cards.length, 0);
  const frag = nodes.reduce((s, n) => s + n.fragmentation, 0);
  const meta = `${nodes.length} node${nodes.length === 1 ? "" : "s"}` +
    (total ? ` · ${Math.round((100 * used) / total)}% used · frag ${frag.toFixed(1)}` : "");
  const section = el("section", { class: open ? "" : "closed", "data-group": key });
  const h2 = el("h2", {}, el("span", { text: key }), el("span", { class: "meta", text: meta }));
  h2.onclick = () => { state.open.set(key, !open); render(); };
  const body = el("div", { class: "body" });
  if (open) {
    const limit = state.shown.get(key) || PAGE;
    for (const n of nodes.slice(0, limit)) body.append(drawNode(n));
    if (nodes.length > limit) {
      const more = el("button", { class: "more", text: `show ${Math.min(PAGE, nodes.length - limit)} more of ${nodes.length - limit}` });
      more.onclick = () => { state.shown.set(key, limit + PAGE); render(); };
      body.append(more);
    }
  }
  section.append(h2, body);
  return section;
}

function drawWaiting(doc) {
  const body = $("waiting").querySelector(".body");
  body.replaceChildren();
  const shown = doc.waiting.length;
  $("waiting-meta").textContent = doc.waitingTotal > shown ? `${doc.waitingTotal} (oldest ${shown} shown)` : String(doc.waitingTotal);
  if (!shown) { body.append(el("div", { class: "empty", text: "none" })); return; }
  const table = el("table", {}, el("tr", {}, ...["pod", "asks", "since", "why it waits"].map((h) => el("th", { text: h }))));
  for (const w of doc.waiting) {
    const why = w.fitsOn > 0
      ? `fits on ${w.fitsOn} node${w.fitsOn === 1 ? "" : "s"}: waiting for the scheduler (or for what is not the GPU's)`
      : Object.entries(w.reasons).map(([r, n]) => `${n} × ${r}`).join(" · ") || "no node";
    table.append(el("tr", { "data-waiting": w.pod }, el("td", { text: w.pod }), el("td", { text: w.asks }),
      el("td", { text: w.since }), el("td", { text: why })));
  }
  body.append(table);
}

function render() {
  const doc = state.doc;
  if (!doc) return;
  const query = $("search").value.trim();
  const filter = $("filter").value;
  const grouping = $("group").value;
  const cards = doc.nodes.reduce((s, n) => s + n.cards.length, 0);
  const used = doc.nodes.reduce((s, n) => s + n.cards.reduce((t, c) => t + c.percentUsed, 0), 0);
  const read = doc.nodes.reduce((s, n) => s + n.cards.filter((c) => c.load !== null && c.load !== undefined).length, 0);
  const hot = doc.nodes.reduce((s, n) => s + n.cards.filter((c) => c.load >= HOT).length, 0);
  const load = read ? `load of ${read} cards read, ${hot} hot` : "no load reading";
  $("summary").textContent = `${doc.nodes.length} nodes · ${cards} cards · ${cards ? Math.round(used / cards) : 0}% used · ${load} · ${doc.waitingTotal} waiting`;
  drawWaiting(doc);
  const groups = new Map();
  for (const n of doc.nodes) {
    if (!nodeMatches(n, query, filter)) continue;
    const key = grouping === "model" ? cardsKey(n) : "all nodes";
    if (!groups.has(key)) groups.set(key, []);
    groups.get(key).push(n);
  }
  const total = [...groups.values()].reduce((s, g) => s + g.length, 0);
  const out = [];
  for (const [key, nodes] of [...groups].sort((a, b) => a[0].localeCompare(b[0]))) {
    // Open by default while the page stays readable, or when a search narrowed it.
    const open = state.open.has(key) ? state.open.get(key) : total <= 300 || query !== "";
    out.push(drawGroup(key, nodes, open));
  }
  if (!out.length) out.push(el("div", { class: "empty", text: "no node matches" }));
  $("groups").replaceChildren(...out);
}

async function poll() {
  try {
    const headers = state.etag ? { "If-None-Match": state.etag } : {};
    const r = await fetch("map/data", { headers, cache: "no-store" });
    if (r.status === 200) {
      state.doc = await r.json();
      state.etag = r.headers.get("ETag");
      render();
    } else if (r.status !== 304) {
      throw new Error(`map/data: ${r.status}`);
    }
    state.lastOk = Date.now();
  } catch (e) {
    console.warn(e);
  }
  const age = Date.now() - state.lastOk;
  const updated = $("updated");
  updated.textContent = state.lastOk ? `updated ${new Date(state.lastOk).toLocaleTimeString()}` : "no answer yet";
  updated.className = age > STALE_MS ? "stale" : "";
  if (age > STALE_MS && state.lastOk) updated.textContent += " (stale)";
  setTimeout(poll, POLL_MS);
}

for (const id of ["search", "filter", "group"]) $(id).addEventListener("input", render);
$("waiting").querySelector("h2").onclick = () => $("waiting").classList.toggle("closed");
poll();

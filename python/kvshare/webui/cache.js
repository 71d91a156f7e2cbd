// The cache view: totals, each tier against its budget, the savings chart, the tree of shared
// prefixes, the sessions and the checkpoints, from one GET /webui/state.
import { el, fmtBytes, fmtInt, fmtPct } from "./api.js";
import { drawSavings } from "./chart.js";

const $ = (id) => document.getElementById(id);

function card(label, value, id) {
  return el("div", { class: "card", id }, el("div", { class: "value", text: value }),
            el("div", { class: "label", text: label }));
}

function renderTotals(state) {
  const s = state.savings;
  const running = state.sessions.filter((x) => x.running).length;
  $("totals").replaceChildren(
    card("sessions running (yours)", fmtInt(running), "total-running"),
    card("prompt tokens reused", fmtInt(s.cached_tokens), "total-cached"),
    card("prefill seconds saved (est.)", s.seconds_saved.toFixed(2), "total-seconds"),
    card("token hit rate", fmtPct(s.hit_rate), "total-hit-rate"),
    card("requests with a hit", `${fmtInt(s.hits)} / ${fmtInt(s.requests)}`, "total-hits"),
    card("prefill ms / token", state.engine.prefill_ms_per_token.toFixed(3), "total-rate"));
}

function tierRow(t) {
  const budget = t.budget_bytes || 0;
  const used = t.used_bytes || 0;
  const bar = el("div", { class: "bar" });
  if (budget) {
    const u = el("div", { class: "used" });
    u.style.width = Math.min(100, (100 * used) / budget) + "%";
    bar.append(u);
    if (t.cached_bytes) {
      const c = el("div", { class: "cached" });
      c.style.width = Math.min(100, (100 * t.cached_bytes) / budget) + "%";
      bar.append(c);
    }
  }
  const parts = [`${fmtBytes(used)} of ${budget ? fmtBytes(budget) : "no budget reported"}`];
  if (t.name === "pool") {
    parts.push(`${fmtInt(t.used_blocks)} blocks held, ${fmtInt(t.shared_blocks)} shared, ` +
               `${fmtInt(t.cached_blocks)} cached`);
  } else {
    if (t.entries !== undefined) parts.push(`${fmtInt(t.entries)} entries`);
    if (t.hit_rate !== null) parts.push(`hit rate ${fmtPct(t.hit_rate)}`);
    if (t.tokens_served) parts.push(`${fmtInt(t.tokens_served)} tokens restored`);
  }
  return el("div", { class: "tier", "data-tier": t.name },
            el("span", { class: "name", text: t.name }), bar,
            el("span", { class: "figures", text: parts.join(" · ") }));
}

function treeNode(node, sessionsById) {
  const n = node.sessions.length;
  const box = el("div", { class: "node" + (n > 1 ? " shared" : ""), "data-sessions": String(n),
                          "data-tokens": String(node.tokens), "data-start": String(node.start) });
  box.append(el("span", { class: "count", text: n > 1 ? `${n} sessions share` : "1 session" }),
             ` ${fmtInt(node.tokens)} tokens (${fmtInt(node.start)}–${fmtInt(node.start + node.tokens)})`);
  const held = el("span", { class: "held" });
  for (const t of node.held) held.append(el("span", { class: "pill " + t, text: t }));
  box.append(held);
  const ids = node.sessions.slice(0, 6).map((id) => short(id)).join(", ") +
    (n > 6 ? `, +${n - 6}` : "");
  box.append(el("span", { class: "ids", text: ids }));
  if (node.text !== undefined) box.append(el("span", { class: "text", text: node.text }));
  const li = el("li", {}, box);
  if (node.children.length) {
    li.append(el("ul", {}, ...node.children.map((c) => treeNode(c, sessionsById))));
  }
  return li;
}

function short(id) {
  return id.length > 14 ? id.slice(0, 9) + "…" + id.slice(-4) : id;
}

function renderTree(state) {
  const byId = new Map(state.sessions.map((s) => [s.id, s]));
  const box = $("tree");
  if (!state.tree.length) {
    box.replaceChildren(el("p", { class: "dim", text: "No sessions yet (prompts shorter than one block are not drawn)." }));
    return;
  }
  const ordered = [...state.tree].sort((a, b) => b.sessions.length - a.sessions.length);
  box.replaceChildren(el("ul", {}, ...ordered.map((n) => treeNode(n, byId))));
}

function renderSessions(state) {
  const rows = state.sessions.slice(0, 64).map((s) => el("tr", { "data-id": s.id },
    el("td", { text: short(s.id), title: s.id }),
    el("td", { text: s.tenant || "–" }),
    el("td", { text: s.running ? "running" : (s.finish_reason || "ended") }),
    el("td", { class: "num", text: fmtInt(s.prompt_tokens) }),
    el("td", { class: "num", text: s.cached_tokens === undefined ? "…" : fmtInt(s.cached_tokens) }),
    el("td", { class: "num", text: s.ttft_ms === undefined ? "…" : s.ttft_ms.toFixed(0) + " ms" }),
    el("td", { text: (s.restored_from || []).join(", ") || "–" })));
  document.querySelector("#sessions tbody").replaceChildren(...rows);
}

function renderCheckpoints(state) {
  const c = state.checkpoints;
  const box = $("checkpoints");
  if (!c) {
    box.replaceChildren(el("p", { class: "dim", text: "None: this model has no recurrent layers." }));
    return;
  }
  box.replaceChildren(el("p", { text:
    `${fmtInt(c.count)} checkpoints (${fmtInt(c.live_count)} in use), ` +
    `${fmtBytes(c.unique_bytes)} of ${fmtBytes(c.budget_bytes)} · saved ${fmtInt(c.saved)}, ` +
    `restored ${fmtInt(c.restored)}, evicted ${fmtInt(c.evicted)}` }));
}

export function renderCache(state) {
  renderTotals(state);
  $("tiers").replaceChildren(...state.tiers.map(tierRow));
  drawSavings($("chart"), state.savings.history, state.savings.bucket_s, state.server.time);
  $("chart-legend").textContent = "bars: tokens reused · line: seconds saved (est.)";
  renderTree(state);
  renderSessions(state);
  renderCheckpoints(state);
}

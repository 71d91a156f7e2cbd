// The chat playground over the server's own POST /v1/chat/completions: streamed (SSE), with
// a system prompt, tools, sampling settings, tool calls shown as such, and for each reply its
// cached prompt tokens and time to first token.
import { AuthError, el, errorText, fmtInt, headers } from "./api.js";

const $ = (id) => document.getElementById(id);
let history = [];  // the conversation as OpenAI messages (without the system prompt)
let controller = null;

function num(id, parse) {
  const v = $(id).value.trim();
  return v === "" ? undefined : parse(v);
}

function tools() {
  const text = $("tools").value.trim();
  $("tools-error").textContent = "";
  if (!text) return undefined;
  let parsed;
  try {
    parsed = JSON.parse(text);
  } catch (e) {
    throw new Error("Tools are not valid JSON: " + e.message);
  }
  if (!Array.isArray(parsed)) throw new Error("Tools must be a JSON array");
  return parsed.length ? parsed : undefined;
}

function requestBody() {
  const system = $("system").value.trim();
  const body = {
    messages: (system ? [{ role: "system", content: system }] : []).concat(history),
    stream: true, stream_options: { include_usage: true },
    temperature: num("temperature", parseFloat), top_p: num("top_p", parseFloat),
    top_k: num("top_k", (v) => parseInt(v, 10)), min_p: num("min_p", parseFloat),
    max_tokens: num("max_tokens", (v) => parseInt(v, 10)), seed: num("seed", (v) => parseInt(v, 10)),
  };
  const t = tools();
  if (t) body.tools = t;
  return body;
}

function messageBox(role, text) {
  const box = el("div", { class: "msg " + role }, el("span", { class: "role", text: role }));
  if (text) box.append(el("span", { class: "content", text }));
  $("transcript").append(box);
  return box;
}

function toolCallBox(call) {
  return el("div", { class: "toolcall", "data-name": call.function.name || "" },
            el("div", { text: "tool call " + (call.id || "") + ": " + (call.function.name || "") }),
            el("div", { class: "args", text: call.function.arguments || "" }));
}

// The parts of one streamed reply, as deltas arrive.
class Reply {
  constructor(box) {
    this.box = box;
    this.reasoning = el("span", { class: "reasoning" });
    this.content = el("span", { class: "content" });
    this.calls = el("div", { class: "calls" });
    this.meta = el("span", { class: "meta", text: "waiting for the first token…" });
    box.append(this.reasoning, this.content, this.calls, this.meta);
    this.text = "";
    this.toolCalls = [];
    this.t0 = performance.now();
    this.ttft = null;
    this.usage = null;
    this.timings = null;
    this.finish = null;
  }

  add(chunk) {
    if (chunk.usage) this.usage = chunk.usage;
    if (chunk.timings) this.timings = chunk.timings;
    for (const choice of chunk.choices || []) {
      const d = choice.delta || {};
      if ((d.content || d.reasoning_content || d.tool_calls) && this.ttft === null) {
        this.ttft = performance.now() - this.t0;
      }
      if (d.reasoning_content) this.reasoning.textContent += d.reasoning_content;
      if (d.content) {
        this.text += d.content;
        this.content.textContent = this.text;
      }
      for (const tc of d.tool_calls || []) this.addCall(tc);
      if (choice.finish_reason) this.finish = choice.finish_reason;
    }
  }

  addCall(tc) {
    const i = tc.index || 0;
    const call = this.toolCalls[i] ||
      (this.toolCalls[i] = { id: "", type: "function", function: { name: "", arguments: "" } });
    if (tc.id) call.id = tc.id;
    if (tc.function && tc.function.name) call.function.name += tc.function.name;
    if (tc.function && tc.function.arguments) call.function.arguments += tc.function.arguments;
    this.calls.replaceChildren(...this.toolCalls.filter(Boolean).map(toolCallBox));
  }

  done() {
    const u = this.usage || {};
    const cached = u.prompt_tokens_details ? u.prompt_tokens_details.cached_tokens : undefined;
    this.meta.dataset.cached = cached === undefined ? "" : String(cached);
    const parts = [];
    if (cached !== undefined) parts.push(`cached ${fmtInt(cached)} of ${fmtInt(u.prompt_tokens)} prompt tokens`);
    if (this.ttft !== null) parts.push(`TTFT ${this.ttft.toFixed(0)} ms`);
    if (this.timings) parts.push(`prefill ${this.timings.prompt_ms.toFixed(0)} ms`);
    if (u.completion_tokens !== undefined) parts.push(`${fmtInt(u.completion_tokens)} tokens`);
    if (this.timings && this.timings.predicted_per_second) {
      parts.push(`${this.timings.predicted_per_second.toFixed(1)} tokens/s`);
    }
    if (this.finish) parts.push(this.finish);
    this.meta.textContent = parts.join(" · ");
    const msg = { role: "assistant", content: this.text };
    const calls = this.toolCalls.filter(Boolean);
    if (calls.length) msg.tool_calls = calls;
    return msg;
  }
}

async function readSSE(resp, onData) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        const obj = JSON.parse(data);
        if (obj.error) throw new Error(obj.error.message || JSON.stringify(obj.error));
        onData(obj);
      }
    }
  }
}

// The pending tool calls of the last reply: the next message answers them.
function pendingCalls() {
  const last = history[history.length - 1];
  return last && last.role === "assistant" && last.tool_calls ? last.tool_calls : null;
}

async function send(onAuthError) {
  const text = $("message").value;
  if (!text.trim() || controller) return;
  $("chat-error").textContent = "";
  let body;
  const calls = pendingCalls();
  const added = calls ? calls.map((c) => ({ role: "tool", tool_call_id: c.id, content: text }))
                      : [{ role: "user", content: text }];
  history.push(...added);
  try {
    body = requestBody();
  } catch (e) {
    history.splice(history.length - added.length, added.length);
    $("tools-error").textContent = e.message;
    return;
  }
  for (const m of added) messageBox(m.role, m.content);
  $("message").value = "";
  const reply = new Reply(messageBox("assistant", ""));
  controller = new AbortController();
  $("send").hidden = true;
  $("stop").hidden = false;
  try {
    const resp = await fetch("v1/chat/completions", {
      method: "POST", signal: controller.signal,
      headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(body) });
    if (resp.status === 401) throw new AuthError(await errorText(resp));
    if (!resp.ok) throw new Error(await errorText(resp));
    await readSSE(resp, (chunk) => reply.add(chunk));
    history.push(reply.done());
  } catch (e) {
    reply.done();
    if (e.name !== "AbortError") {
      history.splice(history.length - added.length, added.length);
      $("chat-error").textContent = e.message;
      if (e instanceof AuthError) onAuthError(e);
    }
  } finally {
    controller = null;
    $("send").hidden = false;
    $("stop").hidden = true;
    $("send").textContent = pendingCalls() ? "Send tool result" : "Send";
  }
}

export function initChat(onAuthError) {
  $("send").addEventListener("click", () => send(onAuthError));
  $("stop").addEventListener("click", () => controller && controller.abort());
  $("message").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      send(onAuthError);
    }
  });
  $("clear").addEventListener("click", () => {
    history = [];
    $("transcript").replaceChildren();
    $("send").textContent = "Send";
  });
}

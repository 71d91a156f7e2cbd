// The page: two views (cache, chat), the API key when the server asks for one, and the
// cache view's polling of GET /webui/state.
import { AuthError, apiKey, getJSON, setApiKey } from "./api.js";
import { renderCache } from "./cache.js";
import { initChat } from "./chat.js";

// A new session shows within one interval plus a poll's round trip (a few ms on the server;
// docs/webui.md, Cost).
const POLL_MS = 500;
const $ = (id) => document.getElementById(id);
let view = "cache";
let timer = null;

function showLogin(message) {
  $("main").hidden = true;
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  $("logout").hidden = !apiKey();
  $("api-key").focus();
}

function showMain(state) {
  $("login").hidden = true;
  $("main").hidden = false;
  $("model").textContent = `${state.server.model} · block ${state.server.block_size} tokens`;
  $("who").textContent = state.server.tenant ? "tenant: " + state.server.tenant : "";
  $("logout").hidden = !state.server.auth;
}

async function poll() {
  clearTimeout(timer);
  try {
    const state = await getJSON("webui/state");
    showMain(state);
    if (view === "cache") {
      renderCache(state);
      // when the state now drawn was taken (server clock) and drawn (browser clock): what the
      // browser tests split a change's latency by
      $("view-cache").dataset.stateTime = String(state.server.time);
      $("view-cache").dataset.drawnTime = String(Date.now() / 1000);
    }
    $("cache-error").textContent = "";
  } catch (e) {
    if (e instanceof AuthError) {
      showLogin(apiKey() ? "That key was refused: " + e.message : "");
      return;  // no polling without a key: nothing is shown until one is accepted
    }
    $("cache-error").textContent = "Cannot read the server's state: " + e.message;
  }
  timer = setTimeout(poll, POLL_MS);
}

function select(name) {
  view = name;
  for (const tab of document.querySelectorAll(".tab")) {
    tab.classList.toggle("active", tab.dataset.view === name);
  }
  $("view-cache").hidden = name !== "cache";
  $("view-chat").hidden = name !== "chat";
  if (name === "cache") poll();
}

function login() {
  setApiKey($("api-key").value.trim());
  $("api-key").value = "";
  poll();
}

document.addEventListener("DOMContentLoaded", () => {
  for (const tab of document.querySelectorAll(".tab")) {
    tab.addEventListener("click", () => { location.hash = tab.dataset.view; });
  }
  // the view is the URL's fragment (#cache, #chat), so a link or a reload keeps it
  window.addEventListener("hashchange", () => select(location.hash === "#chat" ? "chat" : "cache"));
  $("login-button").addEventListener("click", login);
  $("api-key").addEventListener("keydown", (e) => { if (e.key === "Enter") login(); });
  $("logout").addEventListener("click", () => {
    setApiKey("");
    clearTimeout(timer);
    showLogin("");
  });
  initChat((e) => showLogin(e.message));
  const wanted = location.hash.replace("#", "");
  select(wanted === "chat" ? "chat" : "cache");
  if (wanted === "chat") poll();
});

// The server's API as the page calls it: relative paths (so a --root-path mount works) and
// the API key, kept in this tab's session storage only, sent as a bearer token.
const KEY = "kvshare.apiKey";

export class AuthError extends Error {}

export function apiKey() {
  return sessionStorage.getItem(KEY) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
}

export function headers(extra = {}) {
  const h = { ...extra };
  const key = apiKey();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

// The error message of a failed response, whichever API shape it has.
export async function errorText(resp) {
  try {
    const body = await resp.json();
    const e = body.error || body;
    return (e && (e.message || e.detail)) || JSON.stringify(body);
  } catch (_) {
    return resp.status + " " + resp.statusText;
  }
}

export async function getJSON(path) {
  const resp = await fetch(path, { headers: headers(), cache: "no-store" });
  if (resp.status === 401) throw new AuthError(await errorText(resp));
  if (!resp.ok) throw new Error(await errorText(resp));
  return resp.json();
}

// A DOM element with text content (never HTML: prompt text and replies are data).
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) {
    if (c !== null && c !== undefined) node.append(c);
  }
  return node;
}

export function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + units[i];
}

export function fmtInt(n) {
  return n === null || n === undefined ? "–" : Math.round(n).toLocaleString("en-US");
}

export function fmtPct(x) {
  return x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%";
}

// The savings chart: cached tokens per bucket as bars, estimated seconds saved as a line,
// over the last 15 minutes, drawn on a canvas.
const CSS = getComputedStyle(document.documentElement);

function color(name, fallback) {
  return (CSS.getPropertyValue(name) || fallback).trim();
}

export function drawSavings(canvas, history, bucketS, now) {
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || canvas.width, h = canvas.clientHeight || canvas.height;
  canvas.width = w * ratio;
  canvas.height = h * ratio;
  const ctx = canvas.getContext("2d");
  ctx.scale(ratio, ratio);
  ctx.clearRect(0, 0, w, h);
  const n = 90;  // buckets shown (15 minutes of 10 s)
  const last = now - (now % bucketS);
  const byStart = new Map(history.map((b) => [b.t, b]));
  const rows = [];
  for (let i = n - 1; i >= 0; i--) rows.push(byStart.get(last - i * bucketS) || null);
  const pad = { l: 52, r: 52, t: 10, b: 22 };
  const pw = w - pad.l - pad.r, ph = h - pad.t - pad.b;
  const maxTok = Math.max(1, ...rows.map((r) => (r ? r.cached_tokens : 0)));
  const maxSec = Math.max(0.001, ...rows.map((r) => (r ? r.seconds_saved : 0)));
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = color("--dim", "#6b7380");
  ctx.strokeStyle = color("--line", "#dde1e7");
  ctx.beginPath();
  ctx.moveTo(pad.l, pad.t + ph + 0.5);
  ctx.lineTo(pad.l + pw, pad.t + ph + 0.5);
  ctx.stroke();
  ctx.textAlign = "right";
  ctx.fillText(Math.round(maxTok).toLocaleString("en-US") + " tok", pad.l - 4, pad.t + 9);
  ctx.fillText("0", pad.l - 4, pad.t + ph);
  ctx.textAlign = "left";
  ctx.fillText(maxSec.toFixed(maxSec < 1 ? 3 : 1) + " s", pad.l + pw + 4, pad.t + 9);
  ctx.textAlign = "center";
  ctx.fillText("-15 min", pad.l + 10, h - 6);
  ctx.fillText("-5 min", pad.l + pw * (2 / 3), h - 6);
  ctx.fillText("now", pad.l + pw - 8, h - 6);
  const bw = pw / n;
  ctx.fillStyle = "#9dbbf0";
  rows.forEach((r, i) => {
    if (!r || !r.cached_tokens) return;
    const bh = (r.cached_tokens / maxTok) * ph;
    ctx.fillRect(pad.l + i * bw + 1, pad.t + ph - bh, Math.max(1, bw - 2), bh);
  });
  ctx.strokeStyle = color("--ok", "#1e7b34");
  ctx.lineWidth = 1.5;
  ctx.beginPath();
  rows.forEach((r, i) => {
    const y = pad.t + ph - ((r ? r.seconds_saved : 0) / maxSec) * ph;
    const x = pad.l + (i + 0.5) * bw;
    if (i === 0) ctx.moveTo(x, y);
    else ctx.lineTo(x, y);
  });
  ctx.stroke();
}

// pagedllm KV-cache map: live (SSE feed) or replay (frames embedded in the page).
// A snapshot's pools are packed one byte per block (state | min(ref, 31) << 3),
// deflated and base64-encoded; all block tables are one deflated int32 blob.
"use strict";

const STATES = ["free", "used", "shared", "cached", "swapped", "copied", "reserved"];
const STATE_LABELS = {
  free: "free", used: "in use", reserved: "reserved (no token yet)", shared: "shared (ref > 1)",
  cached: "cached, revivable", swapped: "swapped out (CPU)", copied: "copied this step",
};
const COLORS = {
  free: "#e9edf2", used: "#3b82f6", reserved: "#bcd4fb", cached: "#4ade80",
  swapped: "#a78bfa", copied: "#ef4444",
};
const LEGEND_ORDER = ["free", "used", "reserved", "shared", "cached", "copied", "swapped"];
const $ = (id) => document.getElementById(id);

function sharedColor(ref) {
  // orange, darker with more references (2 .. 8+)
  const k = Math.min(Math.max(ref - 2, 0), 6);
  return `hsl(30, 95%, ${68 - k * 6}%)`;
}

function cellColor(state, ref) {
  const name = STATES[state];
  return name === "shared" ? sharedColor(ref) : COLORS[name];
}

async function inflate(b64) {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
  return new Uint8Array(await new Response(stream).arrayBuffer());
}

async function decodeSnapshot(s) {
  const [device, cpu, tableBytes] = await Promise.all([inflate(s.device), inflate(s.cpu), inflate(s.tables)]);
  const tables = new Int32Array(tableBytes.buffer, tableBytes.byteOffset, tableBytes.byteLength / 4);
  const requests = s.requests.map((r) => ({
    ...r,
    seqs: r.seqs.map(([seqId, offset, numBlocks, numSlots, swapped]) => ({
      seqId, numSlots, swapped: !!swapped, table: Array.from(tables.subarray(offset, offset + numBlocks)),
    })),
  }));
  return { ...s, device, cpu, requests };
}

// ---- the pool grid ---------------------------------------------------------------

class PoolGrid {
  constructor(canvas, maxHeight) {
    this.canvas = canvas;
    this.maxHeight = maxHeight;
    this.cells = new Uint8Array(0);
    this.layout = { cell: 10, gap: 1, cols: 1 };
  }

  computeLayout(n) {
    const width = Math.max(this.canvas.parentElement.clientWidth, 200);
    let cell = Math.floor(Math.sqrt((width * this.maxHeight) / Math.max(n, 1)));
    cell = Math.max(3, Math.min(cell, 22));
    const gap = cell >= 7 ? 1 : 0;
    const cols = Math.max(1, Math.floor(width / (cell + gap)));
    return { cell, gap, cols, rows: Math.ceil(n / cols), width };
  }

  indexAt(x, y) {
    const { cell, gap, cols } = this.layout;
    const col = Math.floor(x / (cell + gap)), row = Math.floor(y / (cell + gap));
    if (col >= cols) return -1;
    const i = row * cols + col;
    return i < this.cells.length ? i : -1;
  }

  center(i) {
    const { cell, gap, cols } = this.layout;
    return [(i % cols) * (cell + gap) + cell / 2, Math.floor(i / cols) * (cell + gap) + cell / 2];
  }

  draw(cells, highlight) {
    this.cells = cells;
    const n = cells.length;
    this.layout = this.computeLayout(n);
    const { cell, gap, cols, rows } = this.layout;
    const dpr = window.devicePixelRatio || 1;
    const w = cols * (cell + gap), h = Math.max(rows * (cell + gap), cell);
    this.canvas.width = w * dpr; this.canvas.height = h * dpr;
    this.canvas.style.width = `${w}px`; this.canvas.style.height = `${h}px`;
    const ctx = this.canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    const dim = highlight && highlight.blocks.size > 0;
    for (let i = 0; i < n; i++) {
      const b = cells[i];
      ctx.globalAlpha = dim && !highlight.blocks.has(i) ? 0.28 : 1;
      ctx.fillStyle = cellColor(b & 7, b >> 3);
      ctx.fillRect((i % cols) * (cell + gap), Math.floor(i / cols) * (cell + gap), cell, cell);
    }
    ctx.globalAlpha = 1;
    this.canvas.dataset.numBlocks = String(n);
    this.canvas.dataset.drawn = String(n);
    if (dim) this.drawHighlight(ctx, highlight);
  }

  drawHighlight(ctx, hl) {
    const { cell } = this.layout;
    ctx.lineWidth = 1;
    ctx.strokeStyle = "#1e3a8a";
    for (const i of hl.blocks) {
      const [cx, cy] = this.center(i);
      ctx.strokeRect(cx - cell / 2 + 0.5, cy - cell / 2 + 0.5, cell - 1, cell - 1);
    }
    const table = hl.table;
    if (!table || !table.length) return;
    // The selected sequence's block table: a path through its blocks in logical order.
    ctx.strokeStyle = "rgba(17, 24, 39, 0.75)";
    ctx.lineWidth = Math.max(1, cell / 8);
    ctx.beginPath();
    table.forEach((b, k) => { const [x, y] = this.center(b); if (k) ctx.lineTo(x, y); else ctx.moveTo(x, y); });
    ctx.stroke();
    ctx.textAlign = "center"; ctx.textBaseline = "middle";
    ctx.font = `600 ${Math.max(7, Math.floor(cell * 0.55))}px system-ui, sans-serif`;
    table.forEach((b, k) => {
      const [x, y] = this.center(b);
      if (k < hl.numHits) { ctx.fillStyle = "#15803d"; ctx.fillRect(x - cell / 2, y - cell / 2, cell, Math.max(2, cell / 5)); }
      if (cell >= 12) {
        ctx.fillStyle = "#fff"; ctx.strokeStyle = "#111827"; ctx.lineWidth = 2.5;
        ctx.strokeText(String(k), x, y); ctx.fillText(String(k), x, y);
      }
    });
    ctx.lineWidth = 1;
  }
}

// ---- time series ----------------------------------------------------------------

const SERIES = [
  { key: "kv_usage", title: "KV blocks in use", fmt: (v) => `${(100 * v).toFixed(1)}%`, max: 1 },
  { key: "shared_saving", title: "Slots saved by sharing", fmt: (v) => `${(100 * v).toFixed(1)}%`, max: 1 },
  { key: "prefix_hit_rate", title: "Prefix-cache hit rate", fmt: (v) => `${(100 * v).toFixed(1)}%`, max: 1 },
  { key: "preemptions", title: "Preemptions", fmt: (v) => v.toFixed(0) },
  { key: "batch_size", title: "Batch: running requests", fmt: (v) => v.toFixed(0) },
  { key: "gen_tok_s", title: "Output tokens / s", fmt: (v) => v.toFixed(1) },
];

class Charts {
  constructor(root) {
    this.root = root;
    this.items = SERIES.map((s) => {
      const el = document.createElement("div");
      el.className = "chart";
      el.innerHTML = `<div class="head"><span>${s.title}</span><span class="v" id="chart-${s.key}">–</span></div><canvas height="70"></canvas>`;
      root.appendChild(el);
      return { ...s, canvas: el.querySelector("canvas"), value: el.querySelector(".v") };
    });
  }

  draw(points, xKey, cursor) {
    for (const s of this.items) this.drawOne(s, points, xKey, cursor);
  }

  drawOne(s, points, xKey, cursor) {
    const c = s.canvas, dpr = window.devicePixelRatio || 1;
    c.style.width = "100%"; c.style.height = "70px";
    const w = Math.max(c.clientWidth, 100), h = 70;
    c.width = w * dpr; c.height = h * dpr;
    const ctx = c.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.fillStyle = "#f8fafc"; ctx.fillRect(0, 0, w, h);
    const pts = points.filter((p) => p[s.key] !== null && p[s.key] !== undefined);
    const last = cursor !== undefined ? points[cursor] : points[points.length - 1];
    s.value.textContent = last && last[s.key] != null ? s.fmt(last[s.key]) : "–";
    if (pts.length < 1) return;
    const x0 = points[0][xKey], x1 = Math.max(points[points.length - 1][xKey], x0 + 1e-9);
    const ymax = s.max || Math.max(1, ...pts.map((p) => p[s.key])) * 1.1;
    const X = (x) => 2 + ((x - x0) / (x1 - x0)) * (w - 4), Y = (y) => h - 4 - (y / ymax) * (h - 16);
    ctx.strokeStyle = "#2563eb"; ctx.lineWidth = 1.5; ctx.beginPath();
    pts.forEach((p, k) => { if (k) ctx.lineTo(X(p[xKey]), Y(p[s.key])); else ctx.moveTo(X(p[xKey]), Y(p[s.key])); });
    ctx.stroke();
    ctx.fillStyle = "#6b7785"; ctx.font = "10px system-ui, sans-serif"; ctx.textBaseline = "top";
    ctx.fillText(s.fmt(ymax), 3, 2);
    if (cursor !== undefined && points[cursor]) {
      ctx.strokeStyle = "#ef4444"; ctx.lineWidth = 1; ctx.beginPath();
      ctx.moveTo(X(points[cursor][xKey]), 0); ctx.lineTo(X(points[cursor][xKey]), h); ctx.stroke();
    }
  }
}

// ---- the page --------------------------------------------------------------------

const COUNTERS = [
  ["num_used_blocks", "blocks in use"], ["num_shared_blocks", "shared blocks"],
  ["num_cached_blocks", "cached blocks"], ["num_slots_saved_by_sharing", "slots saved by sharing"],
  ["slot_utilization", "slots holding tokens", (v) => `${(100 * v).toFixed(1)}%`],
  ["prefix_cache_hits", "prefix-cache hit tokens"], ["prefix_cache_queries", "prefix-cache query tokens"],
  ["num_preemptions_total", "preemptions"], ["num_running_seqs", "running sequences"],
  ["num_generation_tokens_total", "output tokens"], ["num_prompt_tokens_total", "prompt tokens"],
  ["peak_used_blocks", "peak blocks in use"],
];

class Dashboard {
  constructor() {
    this.grid = new PoolGrid($("grid"), Math.min(560, window.innerHeight * 0.55));
    this.cpuGrid = new PoolGrid($("cpu-grid"), 120);
    this.charts = new Charts($("charts"));
    this.snapshot = null;
    this.selected = null; // { id, seqIndex }
    this.points = [];
    this.buildLegend();
    this.bindHover();
    window.addEventListener("resize", () => this.render());
  }

  buildLegend() {
    $("legend").innerHTML = LEGEND_ORDER.map((name) => {
      const color = name === "shared" ? `linear-gradient(90deg, ${sharedColor(2)}, ${sharedColor(8)})` : COLORS[name];
      return `<span class="item"><span class="sw" style="background:${color}"></span>${STATE_LABELS[name]} <span class="n" id="count-${name}">0</span></span>`;
    }).join("");
    $("counters").innerHTML = COUNTERS.map(([key, label]) =>
      `<div class="counter"><div class="k">${label}</div><div class="v" id="stat-${key}">–</div></div>`).join("");
  }

  setSettings(settings) {
    $("model").textContent = `${settings.model || ""} · ${settings.device || ""} · ${settings.dtype || ""}`;
    $("settings").innerHTML = Object.entries(settings).map(([k, v]) =>
      `<tr><td>${k}</td><td class="mono" id="setting-${k}">${v === null ? "–" : String(v)}</td></tr>`).join("");
  }

  async show(raw) {
    const snapshot = await decodeSnapshot(raw);
    this.snapshot = snapshot;
    this.owners = null;
    this.render();
  }

  counts() {
    const counts = Object.fromEntries(STATES.map((s) => [s, 0]));
    for (const b of this.snapshot.device) counts[STATES[b & 7]]++;
    counts.swapped = 0;
    for (const b of this.snapshot.cpu) if ((b & 7) === 4) counts.swapped++;
    return counts;
  }

  render() {
    const s = this.snapshot;
    if (!s) return;
    const counts = this.counts();
    for (const name of LEGEND_ORDER) $(`count-${name}`).textContent = String(counts[name]);
    $("grid").dataset.shared = String(counts.shared);
    $("grid").dataset.used = String(counts.used + counts.shared + counts.copied + counts.reserved);
    $("pool-size").textContent = `${s.num_blocks} blocks × ${s.block_size} slots`;
    this.grid.draw(s.device, this.highlight(false));
    const hasCpu = s.num_cpu_blocks > 0;
    $("cpu-title").hidden = !hasCpu; $("cpu-wrap").hidden = !hasCpu;
    if (hasCpu) {
      $("cpu-size").textContent = `${s.num_cpu_blocks} blocks`;
      this.cpuGrid.draw(s.cpu, this.highlight(true));
    }
    for (const [key, , fmt] of COUNTERS) {
      const v = s.counters[key];
      $(`stat-${key}`).textContent = v === undefined ? "–" : fmt ? fmt(v) : String(v);
    }
    this.renderRequests();
  }

  selectedRequest() {
    if (!this.selected || !this.snapshot) return null;
    return this.snapshot.requests.find((r) => r.id === this.selected.id) || null;
  }

  highlight(cpu) {
    const r = this.selectedRequest();
    const blocks = new Set();
    if (!r) return { blocks };
    const seqs = r.seqs.filter((q) => q.swapped === cpu);
    for (const q of seqs) for (const b of q.table) blocks.add(b);
    const seq = r.seqs[Math.min(this.selected.seqIndex, r.seqs.length - 1)];
    const table = seq && seq.swapped === cpu ? seq.table : null;
    const numHits = cpu ? 0 : Math.floor(r.cached / this.snapshot.block_size);
    return { blocks, table, numHits };
  }

  renderRequests() {
    const s = this.snapshot;
    const groups = { running: [], swapped: [], waiting: [] };
    for (const r of s.requests) groups[r.status].push(r);
    const totals = { running: s.counters.num_running_reqs, swapped: s.counters.num_swapped_reqs, waiting: s.counters.num_waiting_reqs };
    const html = Object.entries(groups).map(([status, list]) => {
      const total = totals[status] ?? list.length;
      const rows = list.map((r) => {
        const blocks = r.seqs.reduce((n, q) => n + q.table.length, 0);
        const kind = r.kind === "beam" ? `beam ×${r.n}` : r.n > 1 ? `n=${r.n}` : "";
        const sel = this.selected && this.selected.id === r.id ? " selected" : "";
        return `<div class="req${sel}" data-id="${encodeURIComponent(r.id)}"><span class="id">${escapeHtml(r.id)}</span>` +
          `<span class="blocks">${blocks} blk</span><span class="meta">${r.num_tokens} tok · prompt ${r.prompt_len}` +
          `${r.cached ? ` · ${r.cached} cached` : ""}${kind ? ` · ${kind}` : ""} · ${r.seqs.length} seq</span></div>`;
      }).join("");
      return `<div class="queue"><h3>${status} <span id="queue-${status}">${total}</span></h3>${rows}</div>`;
    }).join("");
    $("requests").innerHTML = html;
    for (const el of $("requests").querySelectorAll(".req")) {
      el.addEventListener("click", () => this.select(decodeURIComponent(el.dataset.id), 0));
    }
    this.renderSelection();
  }

  renderSelection() {
    const r = this.selectedRequest();
    const box = $("selection");
    if (!r) {
      box.className = "selection dim";
      box.textContent = this.selected ? "The selected request has finished." : "Click a request to see its blocks in logical order.";
      return;
    }
    box.className = "selection";
    const hits = Math.floor(r.cached / this.snapshot.block_size);
    const chips = r.seqs.map((q, k) =>
      `<span class="chip${k === this.selected.seqIndex ? " on" : ""}" data-k="${k}">${r.kind === "beam" ? "beam" : "sample"} ${k} · seq ${q.seqId} · ${q.table.length} blk${q.swapped ? " (swapped)" : ""}</span>`).join("");
    const seq = r.seqs[Math.min(this.selected.seqIndex, r.seqs.length - 1)];
    box.innerHTML = `<b class="mono">${escapeHtml(r.id)}</b> · ${r.status}<br>` +
      `${hits ? `${hits} prefix-cache hit block(s) (green bar) · ` : ""}block table: ` +
      `<span class="mono" id="selected-table">${seq ? seq.table.join(" → ") : "(no blocks)"}</span><div class="chips">${chips}</div>`;
    for (const el of box.querySelectorAll(".chip")) el.addEventListener("click", () => this.select(r.id, Number(el.dataset.k)));
  }

  select(id, seqIndex) {
    this.selected = this.selected && this.selected.id === id && this.selected.seqIndex === seqIndex ? null : { id, seqIndex };
    this.render();
  }

  ownersOf(block, cpu) {
    const found = [];
    for (const r of this.snapshot.requests) {
      for (const q of r.seqs) {
        if (q.swapped !== cpu) continue;
        const k = q.table.indexOf(block);
        if (k >= 0) found.push(`${r.id} seq ${q.seqId} #${k}`);
      }
    }
    return found;
  }

  bindHover() {
    for (const [grid, cpu] of [[this.grid, false], [this.cpuGrid, true]]) {
      const tip = $("tooltip");
      grid.canvas.addEventListener("mousemove", (ev) => {
        if (!this.snapshot) return;
        const rect = grid.canvas.getBoundingClientRect();
        const x = ev.clientX - rect.left, y = ev.clientY - rect.top;
        const i = grid.indexAt(x, y);
        if (i < 0) { tip.hidden = true; return; }
        const b = grid.cells[i], state = STATES[b & 7], ref = b >> 3;
        const owners = this.ownersOf(i, cpu);
        tip.textContent = `${cpu ? "CPU " : ""}block ${i} · ${STATE_LABELS[state]} · ref ${ref >= 31 ? "31+" : ref}` +
          (owners.length ? ` · ${owners.slice(0, 3).join(", ")}${owners.length > 3 ? ` +${owners.length - 3}` : ""}` : "");
        const wrapRect = tip.parentElement.getBoundingClientRect();
        tip.style.left = `${ev.clientX - wrapRect.left + 12}px`;
        tip.style.top = `${ev.clientY - wrapRect.top + 12}px`;
        tip.hidden = false;
        tip.dataset.block = String(i);
      });
      grid.canvas.addEventListener("mouseleave", () => { tip.hidden = true; });
    }
  }
}

function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

// ---- live mode -----------------------------------------------------------------

function startLive(dash) {
  const key = new URLSearchParams(location.search).get("api_key");
  const path = location.pathname.replace(/\/+$/, "") + "/feed";
  const feed = new EventSource(path + (key ? `?api_key=${encodeURIComponent(key)}` : ""));
  let lastTime = 0, busy = false, pending = null;
  $("charts-title").textContent = "Last 5 minutes";
  feed.addEventListener("hello", (ev) => {
    const hello = JSON.parse(ev.data);
    dash.setSettings(hello.settings);
    dash.points = hello.history;
    dash.charts.draw(dash.points, "t");
  });
  const apply = async (msg) => {
    busy = true;
    try {
      await dash.show(msg.snapshot);
      if (msg.point && (!dash.points.length || msg.point.t > dash.points[dash.points.length - 1].t)) {
        dash.points.push(msg.point);
        if (dash.points.length > 300) dash.points.shift();
      }
      dash.charts.draw(dash.points, "t");
      lastTime = Date.now();
      document.body.dataset.frames = String(Number(document.body.dataset.frames || 0) + 1);
    } finally {
      busy = false;
      if (pending) { const next = pending; pending = null; apply(next); }
    }
  };
  feed.addEventListener("snapshot", (ev) => {
    const msg = JSON.parse(ev.data);
    if (busy) pending = msg; else apply(msg);
  });
  feed.addEventListener("feed-error", (ev) => { $("status").textContent = JSON.parse(ev.data).message; $("status").className = "status bad"; });
  feed.onerror = () => { $("status").textContent = "feed lost: reconnecting…"; $("status").className = "status bad"; };
  setInterval(() => {
    if (!lastTime) return;
    const age = (Date.now() - lastTime) / 1000;
    if (age < 5) { $("status").textContent = `live · updated ${age.toFixed(1)} s ago`; $("status").className = "status"; }
  }, 250);
}

// ---- replay mode ---------------------------------------------------------------

function startReplay(dash, data) {
  $("replay-controls").hidden = false;
  $("charts-title").textContent = "Over the run (red line: this step)";
  const runSelect = $("replay-run"), slider = $("replay-step"), play = $("replay-play");
  runSelect.innerHTML = data.runs.map((r, k) => `<option value="${k}">${escapeHtml(r.name)}</option>`).join("");
  let run = data.runs[0], timer = null, showing = Promise.resolve();
  const showStep = (k) => {
    slider.value = String(k);
    const frame = run.frames[k];
    $("replay-label").textContent = `step ${frame.step} of ${run.frames[run.frames.length - 1].step} (frame ${k + 1}/${run.frames.length})`;
    showing = showing.then(() => dash.show(frame.snapshot)).then(() => dash.charts.draw(run.points, "step", frame.step));
    $("status").textContent = `replay · ${run.name}`;
  };
  const pickRun = (k) => {
    run = data.runs[k];
    dash.setSettings(run.settings);
    slider.max = String(run.frames.length - 1);
    showStep(0);
  };
  runSelect.addEventListener("change", () => pickRun(Number(runSelect.value)));
  slider.addEventListener("input", () => showStep(Number(slider.value)));
  play.addEventListener("click", () => {
    if (timer) { clearInterval(timer); timer = null; play.textContent = "▶ play"; return; }
    play.textContent = "❚❚ pause";
    timer = setInterval(() => {
      const next = Number(slider.value) + 1;
      if (next >= run.frames.length) { clearInterval(timer); timer = null; play.textContent = "▶ play"; return; }
      showStep(next);
    }, 120);
  });
  pickRun(0);
}

window.addEventListener("DOMContentLoaded", () => {
  const dash = new Dashboard();
  window.pagedllmDashboard = dash;
  if (document.body.dataset.mode === "replay") startReplay(dash, JSON.parse($("replay-data").textContent));
  else startLive(dash);
});

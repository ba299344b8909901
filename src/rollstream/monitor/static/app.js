// rollstream run page: draws reward, throughput, histograms, any metric, the rollout
// timeline, the ledger, summary.json and the config. Same code for the live dashboard
// (window.ROLLSTREAM.mode === "live": polls api/poll for increments) and the report
// ("static": the whole payload is embedded). No dependencies; SVG is built as escaped markup.
(function () {
  "use strict";
  const BOOT = window.ROLLSTREAM || { mode: "static", data: null };
  const MAX_SPANS = 4000; // the timeline draws the most recent spans only
  const COLORS = ["#2f6fde", "#e8590c", "#2b8a3e", "#ae3ec9", "#1098ad", "#f59f00"];
  const VERSION_STOPS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  const S = {
    name: "", metrics: [], spans: [], ledger: null, state: null, config: null, summary: null,
    tiles: [],
    metricsNext: 0, spansNext: 0, numBad: 0, metricKey: null, histKey: null,
  };

  // ---------- helpers ----------
  function esc(v) {
    return String(v).replace(/[&<>"']/g, (c) => ({
      "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;",
    })[c]);
  }
  function $(id) { return document.getElementById(id); }
  function isNum(v) { return typeof v === "number" && isFinite(v); }
  function fmt(v, digits) {
    if (!isNum(v)) return "–";
    const a = Math.abs(v);
    if (digits !== undefined) return v.toFixed(digits);
    if (a !== 0 && (a >= 1e5 || a < 1e-3)) return v.toExponential(2);
    if (Number.isInteger(v)) return v.toLocaleString("en-US");
    return a >= 100 ? v.toFixed(0) : a >= 10 ? v.toFixed(1) : v.toFixed(3);
  }
  // the summary's and the tiles' numbers: whole ones in full, others to 4 significant digits
  // (docs/monitoring.md; tests/monitor/page_check.py formats the same way)
  function fmtFull(v) {
    if (!isNum(v)) return "–";
    if (Number.isInteger(v)) return v.toLocaleString("en-US");
    const a = Math.abs(v);
    if (a >= 1e4) return Math.round(v).toLocaleString("en-US");
    if (a >= 1e-3) return String(Number(v.toPrecision(4)));
    return v.toExponential(3);
  }
  function niceTicks(lo, hi, count) {
    if (!(hi > lo)) { hi = lo + 1; }
    const raw = (hi - lo) / Math.max(count, 1);
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
    const ticks = [];
    for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) {
      ticks.push(Math.abs(t) < step * 1e-9 ? 0 : t);
    }
    return ticks;
  }
  function scale(d0, d1, r0, r1) {
    const k = d1 > d0 ? (r1 - r0) / (d1 - d0) : 0;
    return (v) => r0 + (v - d0) * k;
  }
  function widthOf(el, fallback) { return Math.max(el.clientWidth || 0, 0) || fallback; }
  function emptySvg(w, h, text) {
    return `<svg width="${w}" height="${h}"><text class="empty" x="${w / 2}" y="${h / 2}" ` +
      `text-anchor="middle">${esc(text)}</text></svg>`;
  }

  // ---------- data ----------
  function ingest(p) {
    if (!p) return;
    S.name = p.name || S.name;
    for (const m of p.metrics || []) S.metrics.push(m);
    for (const s of p.spans || []) S.spans.push(s);
    if (isNum(p.metrics_next)) S.metricsNext = p.metrics_next;
    if (isNum(p.spans_next)) S.spansNext = p.spans_next;
    S.ledger = p.ledger || S.ledger;
    S.state = p.state || S.state;
    S.config = p.config !== undefined ? p.config : S.config;
    S.summary = p.summary !== undefined ? p.summary : S.summary;
    S.tiles = p.tiles || S.tiles;
    S.engines = p.engines || null;  // a live run's engines now (none in a report)
    S.nodes = p.nodes || null;  // the same engines by node
    S.numBad = p.num_bad_lines || 0;
  }
  function series(kind, name) {
    const pts = [];
    for (const m of S.metrics) {
      if (m.kind === kind && isNum(m[name]) && isNum(m.step)) pts.push([m.step, m[name]]);
    }
    return pts;
  }
  function metricKeys() {
    const keys = new Set();
    for (const m of S.metrics) {
      if (m.kind === "hist") continue;
      for (const k in m) {
        if (k !== "kind" && k !== "step" && k !== "t_s" && isNum(m[k])) keys.add(m.kind + "/" + k);
      }
    }
    return Array.from(keys).sort();
  }
  function histTotals() {
    const out = {};
    for (const m of S.metrics) {
      if (m.kind !== "hist" || !Array.isArray(m.counts) || !Array.isArray(m.edges)) continue;
      const t = out[m.name];
      if (!t || t.edges.length !== m.edges.length) {
        out[m.name] = { edges: m.edges.slice(), counts: m.counts.slice() };
      } else {
        m.counts.forEach((c, i) => { t.counts[i] += c; });
      }
    }
    return out;
  }
  function last(kind, name) {
    const k = S.state && S.state.kinds && S.state.kinds[kind];
    return k ? k[name] : undefined;
  }

  // ---------- charts ----------
  function lineChart(el, lines, opts) {
    const w = widthOf(el, 600), h = 240, m = { l: 56, r: 14, t: 22, b: 34 };
    const pts = lines.flatMap((l) => l.points);
    if (!pts.length) { el.innerHTML = emptySvg(w, h, opts.empty || "no data yet"); return; }
    let x0 = Math.min(...pts.map((p) => p[0])), x1 = Math.max(...pts.map((p) => p[0]));
    let y0 = Math.min(...pts.map((p) => p[1])), y1 = Math.max(...pts.map((p) => p[1]));
    if (x1 === x0) { x0 -= 1; x1 += 1; }
    if (y1 === y0) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
    const pad = (y1 - y0) * 0.05; y0 -= pad; y1 += pad;
    const xs = scale(x0, x1, m.l, w - m.r), ys = scale(y0, y1, h - m.b, m.t);
    let svg = `<svg width="${w}" height="${h}" class="line-chart" data-chart="${esc(opts.id)}">`;
    svg += `<g class="axis">`;
    for (const t of niceTicks(y0, y1, 5)) {
      svg += `<line class="grid-line" x1="${m.l}" x2="${w - m.r}" y1="${ys(t)}" y2="${ys(t)}"/>` +
        `<text x="${m.l - 6}" y="${ys(t) + 4}" text-anchor="end">${esc(fmt(t))}</text>`;
    }
    for (const t of niceTicks(x0, x1, Math.max(2, Math.floor(w / 90)))) {
      svg += `<line x1="${xs(t)}" x2="${xs(t)}" y1="${h - m.b}" y2="${h - m.b + 4}"/>` +
        `<text x="${xs(t)}" y="${h - m.b + 16}" text-anchor="middle">${esc(fmt(t))}</text>`;
    }
    svg += `<line x1="${m.l}" x2="${w - m.r}" y1="${h - m.b}" y2="${h - m.b}"/>` +
      `<text x="${(m.l + w - m.r) / 2}" y="${h - 4}" text-anchor="middle">${esc(opts.xLabel || "step")}</text></g>`;
    lines.forEach((l, i) => {
      if (!l.points.length) return;
      const c = l.color || COLORS[i % COLORS.length];
      const d = l.points.map((p, j) => `${j ? "L" : "M"}${xs(p[0]).toFixed(1)},${ys(p[1]).toFixed(1)}`).join("");
      if (l.line !== false) {
        svg += `<path class="series" data-series="${esc(l.label)}" d="${d}" fill="none" stroke="${c}" stroke-width="1.8"/>`;
      }
      if (l.dots || l.points.length < 40) {
        for (const p of l.points) {
          svg += `<circle class="pt" data-series="${esc(l.label)}" cx="${xs(p[0]).toFixed(1)}" cy="${ys(p[1]).toFixed(1)}" r="${l.dots ? 3.5 : 2}" fill="${c}">` +
            `<title>${esc(l.label)} @ ${esc(fmt(p[0]))}: ${esc(fmt(p[1]))}</title></circle>`;
        }
      }
      const lx = m.l + 8 + i * 150;
      svg += `<rect x="${lx}" y="6" width="12" height="4" fill="${c}"/>` +
        `<text x="${lx + 16}" y="12" font-size="11" fill="#444">${esc(l.label)}</text>`;
    });
    if (opts.note) {
      svg += `<text class="chart-note" x="${(m.l + w - m.r) / 2}" y="${m.t + 14}" text-anchor="middle">${esc(opts.note)}</text>`;
    }
    el.innerHTML = svg + "</svg>";
  }

  function bucketLabels(edges) {
    const labels = edges.map((e, i) => {
      const prev = i ? edges[i - 1] : null;
      const intStep = Number.isInteger(e) && (prev === null || e - prev === 1);
      if (intStep || prev === null) return (prev === null ? "≤" : "") + fmt(e);
      return `${fmt(prev)}–${fmt(e)}`;
    });
    if (edges.length && edges.every(Number.isInteger) && edges[0] === 0) labels[0] = "0";
    labels.push(">" + fmt(edges[edges.length - 1]));
    return labels;
  }
  function barChart(el, labels, counts, opts) {
    const w = widthOf(el, 600), h = 240, m = { l: 48, r: 10, t: 14, b: 40 };
    let hi = counts.length - 1;
    while (hi > 0 && !counts[hi]) hi--;
    let lo = 0;
    while (lo < hi && !counts[lo] && opts.trimLeft) lo++;
    const cs = counts.slice(lo, hi + 1), ls = labels.slice(lo, hi + 1);
    const total = cs.reduce((a, b) => a + b, 0);
    if (!total) { el.innerHTML = emptySvg(w, h, opts.empty || "no data yet"); return; }
    const ymax = Math.max(...cs), ys = scale(0, ymax * 1.08, h - m.b, m.t);
    const bw = (w - m.l - m.r) / cs.length;
    let svg = `<svg width="${w}" height="${h}" class="bar-chart" data-chart="${esc(opts.id)}"><g class="axis">`;
    for (const t of niceTicks(0, ymax * 1.08, 4)) {
      svg += `<line class="grid-line" x1="${m.l}" x2="${w - m.r}" y1="${ys(t)}" y2="${ys(t)}"/>` +
        `<text x="${m.l - 6}" y="${ys(t) + 4}" text-anchor="end">${esc(fmt(t))}</text>`;
    }
    const every = Math.ceil(cs.length / Math.max(1, Math.floor((w - m.l) / 42)));
    ls.forEach((l, i) => {
      if (i % every) return;
      svg += `<text x="${m.l + (i + 0.5) * bw}" y="${h - m.b + 15}" text-anchor="middle">${esc(l)}</text>`;
    });
    svg += `<text x="${(m.l + w - m.r) / 2}" y="${h - 6}" text-anchor="middle">${esc(opts.xLabel || "")}</text></g>`;
    cs.forEach((c, i) => {
      const y = ys(c);
      svg += `<rect class="hist-bar" data-bucket="${esc(ls[i])}" data-count="${c}" x="${(m.l + i * bw + 1).toFixed(1)}" ` +
        `y="${y.toFixed(1)}" width="${Math.max(bw - 2, 1).toFixed(1)}" height="${(h - m.b - y).toFixed(1)}" ` +
        `fill="${COLORS[0]}"><title>${esc(ls[i])}: ${c} (${(100 * c / total).toFixed(1)}%)</title></rect>`;
    });
    el.innerHTML = svg + "</svg>";
  }

  // ---------- timeline ----------
  function versionColor(v, v0, v1) {
    const f = v1 > v0 ? Math.min(Math.max((v - v0) / (v1 - v0), 0), 1) : 0.5;
    const x = f * (VERSION_STOPS.length - 1), i = Math.min(Math.floor(x), VERSION_STOPS.length - 2);
    const a = VERSION_STOPS[i], b = VERSION_STOPS[i + 1], t = x - i;
    return `rgb(${a.map((c, k) => Math.round(c + (b[k] - c) * t)).join(",")})`;
  }
  function drawTimeline() {
    const el = $("timeline"), spans = S.spans.slice(-MAX_SPANS);
    const w = widthOf(el, 1200);
    if (!spans.length) {
      el.innerHTML = emptySvg(w, 80, "no rollout spans yet");
      $("timeline-legend").innerHTML = ""; $("timeline-note").textContent = ""; return;
    }
    const rows = new Map();
    for (const s of spans) rows.set(`${s.engine_id}\u0000${s.slot}`, [s.engine_id, s.slot]);
    const keys = Array.from(rows.values()).sort((a, b) =>
      String(a[0]).localeCompare(String(b[0]), undefined, { numeric: true }) || a[1] - b[1]);
    const rowOf = new Map(keys.map((k, i) => [`${k[0]}\u0000${k[1]}`, i]));
    let t0 = Infinity, t1 = -Infinity, v0 = Infinity, v1 = -Infinity;
    for (const s of spans) {
      t0 = Math.min(t0, s.t_start_s); t1 = Math.max(t1, s.t_end_s);
      v0 = Math.min(v0, s.version_start); v1 = Math.max(v1, s.version_end);
    }
    if (t1 <= t0) t1 = t0 + 1;
    const rh = Math.max(6, Math.min(18, Math.floor(560 / keys.length))), gap = rh > 8 ? 2 : 1;
    const label = (k) => `${/^\d+$/.test(String(k[0])) ? "engine " + k[0] : k[0]} · ${k[1]}`;
    const labelW = Math.max(...keys.map((k) => label(k).length)) * 6.2 + 10;
    const m = { l: labelW, r: 12, t: 6, b: 30 }, h = m.t + keys.length * rh + m.b;
    const xs = scale(t0, t1, m.l, w - m.r);
    let svg = `<svg width="${w}" height="${h}" class="timeline-chart"><g class="axis">`;
    let prevEngine = null;
    keys.forEach((k, i) => {
      const y = m.t + i * rh;
      if (k[0] !== prevEngine && i) svg += `<line x1="0" x2="${w - m.r}" y1="${y}" y2="${y}" stroke-dasharray="3,3"/>`;
      if (rh >= 10 || k[0] !== prevEngine) {
        svg += `<text x="4" y="${y + rh - gap - 2}">${esc(label(k))}</text>`;
      }
      prevEngine = k[0];
    });
    for (const t of niceTicks(t0, t1, Math.max(2, Math.floor(w / 100)))) {
      const x = xs(t);
      svg += `<line class="grid-line" x1="${x}" x2="${x}" y1="${m.t}" y2="${h - m.b}"/>` +
        `<text x="${x}" y="${h - m.b + 14}" text-anchor="middle">${esc(fmt(t))}</text>`;
    }
    svg += `<text x="${(m.l + w - m.r) / 2}" y="${h - 2}" text-anchor="middle">time (s)</text></g><g class="spans">`;
    let numIntr = 0, numFail = 0;
    for (const s of spans) {
      const y = m.t + rowOf.get(`${s.engine_id}\u0000${s.slot}`) * rh + gap / 2;
      const x = xs(s.t_start_s), bh = rh - gap;
      const full = xs(s.t_end_s) - x, bw = full > 4 ? full - 1 : Math.max(full, 1.5); // 1px between back-to-back samples
      const tip = `${s.sample_uid} · engine ${s.engine_id} slot ${s.slot} · ` +
        `${fmt(s.t_start_s, 2)}–${fmt(s.t_end_s, 2)} s · v${s.version_start}` +
        (s.version_end !== s.version_start ? `→v${s.version_end}` : "") +
        ` · ${s.num_tokens} tokens · ${s.outcome}`;
      svg += `<rect class="span-bar" data-uid="${esc(s.sample_uid)}" data-engine="${esc(s.engine_id)}" ` +
        `data-slot="${esc(s.slot)}" data-version="${esc(s.version_start)}" data-version-end="${esc(s.version_end)}" ` +
        `data-outcome="${esc(s.outcome)}" x="${x.toFixed(1)}" y="${y.toFixed(1)}" width="${bw.toFixed(1)}" ` +
        `height="${bh}" fill="${versionColor(s.version_start, v0, v1)}"` +
        (s.outcome === "failed" ? ` stroke="#c92a2a" stroke-width="1.5" stroke-dasharray="2,1"` : "") +
        `><title>${esc(tip)}</title></rect>`;
      if (s.version_end !== s.version_start) {
        svg += `<rect x="${x.toFixed(1)}" y="${y.toFixed(1)}" width="${bw.toFixed(1)}" height="${Math.max(bh / 3, 1).toFixed(1)}" ` +
          `fill="${versionColor(s.version_end, v0, v1)}" pointer-events="none"/>`;
      }
      if (s.outcome === "interrupted") {
        numIntr++;
        const xe = (x + bw).toFixed(1);
        svg += `<path class="interrupt-mark" data-uid="${esc(s.sample_uid)}" d="M${xe},${(y - 1).toFixed(1)}V${(y + bh + 1).toFixed(1)}" ` +
          `stroke="#e03131" stroke-width="2" pointer-events="none"/>`;
      } else if (s.outcome === "failed") numFail++;
    }
    el.innerHTML = svg + "</g></svg>";
    const grad = VERSION_STOPS.map((c) => `rgb(${c.join(",")})`).join(",");
    $("timeline-legend").innerHTML =
      `<span>version v${esc(v0)}<span class="grad" style="background:linear-gradient(90deg,${grad})"></span>v${esc(v1)}</span>` +
      `<span><span class="sw" style="background:#e03131;width:3px"></span>interrupted (${numIntr})</span>` +
      `<span><span class="sw" style="border:1.5px dashed #c92a2a"></span>failed (${numFail})</span>` +
      `<span>top stripe: version at the end of a span</span>`;
    $("timeline-note").textContent = (S.spans.length > spans.length ?
      `showing the last ${spans.length} of ${S.spans.length} spans; ` : `${spans.length} spans; `) +
      `${keys.length} engine slots; hover a bar for its sample`;
  }

  // ---------- tables ----------
  function table(head, rows) {
    return "<table><tr>" + head.map((h) => `<th>${esc(h)}</th>`).join("") + "</tr>" +
      rows.map((r) => "<tr>" + r.map((c) => isNum(c) ? `<td class="n">${esc(fmt(c))}</td>` : `<td>${esc(c)}</td>`).join("") + "</tr>").join("") +
      "</table>";
  }
  function drawEngines() {
    $("engines-card").hidden = !S.engines;
    if (!S.engines) return;
    $("engines").innerHTML = table(["engine", "member", "health", "routing", "version", "in flight", "node"],
      S.engines.map((e) => [e.engine_id, e.member, e.health, e.routing, e.version, e.in_flight,
        e.node_id === null ? "–" : e.node_id.slice(0, 8)]));
  }
  function mb(n) { return (n / 1e6).toFixed(n >= 1e7 ? 1 : 3) + " MB"; }
  function drawCluster() {
    $("cluster-card").hidden = !S.nodes;
    if (!S.nodes) return;
    $("cluster").innerHTML = table(["node", "address", "host", "engines", "transport", "dtype",
      "last sync", "bytes last sync", "bytes in total"],
      S.nodes.map((n) => [n.node_id === null ? "(joining)" : n.node_id, n.address || "–",
        n.hostname || "–",
        n.engines.map((e) => `${e.engine_id} ${e.member} ${e.health}/${e.routing} v${e.version}`).join("; "),
        n.transports.join(", ") || "–", n.dtypes.join(", ") || "–",
        n.sync_version === null ? "–" : "v" + n.sync_version, mb(n.sync_bytes_last),
        mb(n.sync_bytes_total)]));
  }
  function drawLedger() {
    const L = S.ledger, el = $("ledger");
    if (!L || !L.num_samples) { el.innerHTML = `<p class="note">no ledger lines yet</p>`; return; }
    const statuses = Object.keys(L.by_status).sort();
    let html = table(["status", "samples"], statuses.map((s) => [s, L.by_status[s]]).concat([["total", L.num_samples]]));
    html += table(["source"].concat(statuses, ["reward mean"]), Object.entries(L.by_source).map(([src, v]) =>
      [src].concat(statuses.map((s) => v.by_status[s] || 0), [isNum(v.reward_mean) ? v.reward_mean : "–"])));
    const reasons = [];
    for (const [status, rs] of Object.entries(L.reasons)) {
      for (const [reason, n] of Object.entries(rs)) reasons.push([status, reason, n]);
    }
    if (reasons.length) html += table(["status", "reason", "samples"], reasons);
    html += `<p class="note">${esc(fmt(L.num_tokens))} tokens, ${esc(fmt(L.num_interrupts))} interruptions</p>`;
    el.innerHTML = html;
  }
  // summary.json: a number in full in its own cell; a long JSON value folded (click to open,
  // wrapped inside the card), so no value widens the table past its card
  function drawSummary() {
    const el = $("summary");
    if (!S.summary) { el.innerHTML = `<p class="note">summary.json not written yet</p>`; return; }
    el.innerHTML = `<table class="kv">` + Object.entries(S.summary).map(([k, v]) => {
      let cell;
      if (isNum(v)) cell = `<td class="n">${esc(fmtFull(v))}</td>`;
      else if (v !== null && typeof v === "object") cell = `<td>${folded(v)}</td>`;
      else cell = `<td>${esc(v === null ? "null" : String(v))}</td>`;
      return `<tr data-key="${esc(k)}"><th scope="row">${esc(k)}</th>${cell}</tr>`;
    }).join("") + "</table>";
  }
  function folded(v) {
    const line = JSON.stringify(v);
    if (line.length <= 48) return `<code>${esc(line)}</code>`;
    const n = Array.isArray(v) ? `[${v.length} items]` : `{${Object.keys(v).length} keys}`;
    return `<details><summary>${esc(n)}</summary><pre class="json">${esc(JSON.stringify(v, null, 2))}</pre></details>`;
  }
  // the run's tiles come defined from the server (monitor/tiles.py: the run's totals once it
  // ended, its last steps while it goes); the rest read the latest lines, and say which step
  function drawTiles() {
    const live = !S.summary;
    const at = (kind) => {
      const k = S.state && S.state.kinds && S.state.kinds[kind];
      return k && isNum(k.step) ? `step ${k.step}` : "";
    };
    const tiles = [
      ["step", S.state ? S.state.step : undefined, live ? "now" : "run"],
      ["train reward", last("train", "reward_mean"), at("train")],
      ["eval reward", last("eval", "reward"), at("eval")],
      ...S.tiles.map((t) => [t.key, t.value, t.scope]),
      ...(live ? [["in flight", last("rollout", "in_flight"), "now"]] : []),
      ["length pred. error", last("rollout", "len_pred_err"), at("rollout")],
      ["last reconfigure", lastReconfig(), "run"],
    ];
    $("tiles").innerHTML = tiles.map(([k, v, scope]) =>
      `<div class="tile" data-scope="${esc(scope)}" data-value="${esc(isNum(v) ? v : "")}" data-tile="${esc(k)}">` +
      `<div class="k">${esc(k)}</div><div class="v">${esc(typeof v === "string" ? v : fmtFull(v))}</div>` +
      `<div class="s">${esc(scope)}</div></div>`).join("");
  }
  function lastReconfig() {  // the latest `reconfig` line: what changed at which step
    const lines = S.metrics.filter((m) => m.kind === "reconfig" && isNum(m.step));
    if (!lines.length) return "none";
    const m = lines[lines.length - 1];
    if (m.rejected) return `step ${m.step}: refused`;
    const keys = Object.keys(m).filter((k) => !["kind", "step", "t_s"].includes(k) && !k.endsWith(".old"));
    return `step ${m.step}: ` + keys.map((k) => `${k} ${fmt(m[k + ".old"])}→${fmt(m[k])}`).join(", ");
  }

  // ---------- selects ----------
  function syncSelect(el, options, current) {
    const have = Array.from(el.options).map((o) => o.value).join("\n");
    if (have !== options.map((o) => o[0]).join("\n")) {
      el.innerHTML = options.map(([v, t]) => `<option value="${esc(v)}">${esc(t)}</option>`).join("");
    }
    if (current !== null && options.some((o) => o[0] === current)) el.value = current;
    return el.value || null;
  }
  function drawHist() {
    const totals = histTotals(), options = Object.keys(totals).sort().map((k) => [k, k]);
    if (S.ledger && S.ledger.staleness && Object.keys(S.ledger.staleness).length) {
      options.push(["ledger:staleness", "staleness (ledger)"]);
    }
    const fallback = totals.staleness ? "staleness" : options.length ? options.find((o) => o[0] === "ledger:staleness") ? "ledger:staleness" : options[0][0] : null;
    S.histKey = syncSelect($("hist-select"), options, S.histKey || fallback);
    const el = $("chart-hist");
    if (S.histKey === "ledger:staleness") {
      const st = S.ledger.staleness, hi = Math.max(...Object.keys(st).map(Number));
      const labels = [], counts = [];
      for (let i = Math.min(0, ...Object.keys(st).map(Number)); i <= hi; i++) { labels.push(String(i)); counts.push(st[i] || 0); }
      barChart(el, labels, counts, { id: "hist", xLabel: "staleness (steps) of trained samples" });
      $("hist-note").textContent = "from the ledger: trained_at_step − min_trained_version";
    } else if (S.histKey && totals[S.histKey]) {
      const t = totals[S.histKey];
      barChart(el, bucketLabels(t.edges), t.counts, { id: "hist", xLabel: S.histKey, trimLeft: !S.histKey.startsWith("staleness") });
      $("hist-note").textContent = `observed values of ${S.histKey}, summed over the run`;
    } else {
      el.innerHTML = emptySvg(widthOf(el, 600), 240, "no histogram yet"); $("hist-note").textContent = "";
    }
  }
  function drawMetric() {
    const keys = metricKeys();
    const fallback = keys.includes("train/loss") ? "train/loss" : keys[0] || null;
    S.metricKey = syncSelect($("metric-select"), keys.map((k) => [k, k]), S.metricKey || fallback);
    if (!S.metricKey) { lineChart($("chart-metric"), [], { id: "metric" }); return; }
    const [kind, name] = [S.metricKey.slice(0, S.metricKey.indexOf("/")), S.metricKey.slice(S.metricKey.indexOf("/") + 1)];
    lineChart($("chart-metric"), [{ label: S.metricKey, points: series(kind, name) }], { id: "metric" });
  }

  // ---------- render loop ----------
  function render() {
    $("run-name").textContent = S.name;
    drawTiles();
    // one dot per evaluation; with only the start and the end there is no curve to draw
    const evals = series("eval", "reward"), onlyEnds = !!S.summary && evals.length === 2;
    lineChart($("chart-reward"), [
      { label: "train reward_mean", points: series("train", "reward_mean") },
      { label: "eval reward", points: evals, dots: true, line: !onlyEnds, color: COLORS[1] },
    ], { id: "reward", note: onlyEnds ?
      "held-out reward measured only at the start and the end: no curve (set eval.every)" : "" });
    lineChart($("chart-throughput"), [
      { label: "generated tokens/s", points: series("rollout", "gen_tok_s"), color: COLORS[2] },
    ], { id: "throughput" });
    drawHist();
    drawMetric();
    drawTimeline();
    drawEngines();
    drawCluster();
    drawLedger();
    drawSummary();
    $("config").textContent = S.config || "(config.yaml not found)";
  }
  function setStatus(text, cls) {
    const el = $("status");
    el.textContent = text; el.className = "badge " + (cls || "");
  }
  async function poll() {
    const url = `${BOOT.api || ""}api/poll?metrics_since=${S.metricsNext}&spans_since=${S.spansNext}`;
    try {
      const r = await fetch(url, { cache: "no-store" });
      if (!r.ok) throw new Error(`HTTP ${r.status}`);
      ingest(await r.json());
      render();
      const done = S.summary ? "finished" : "live";
      setStatus(`${done} · step ${S.state && S.state.step !== null ? S.state.step : "–"} · updated ${new Date().toLocaleTimeString()}`, "live");
    } catch (e) {
      setStatus(`disconnected (${e.message}); retrying`, "down");
    }
    setTimeout(poll, BOOT.poll_ms || 2000);
  }

  document.getElementById("hist-select").addEventListener("change", (e) => { S.histKey = e.target.value; drawHist(); });
  document.getElementById("metric-select").addEventListener("change", (e) => { S.metricKey = e.target.value; drawMetric(); });
  let resizeTimer = null;
  window.addEventListener("resize", () => { clearTimeout(resizeTimer); resizeTimer = setTimeout(render, 150); });
  if (BOOT.mode === "live") {
    poll();
  } else {
    ingest(BOOT.data);
    render();
    setStatus(`report · ${BOOT.generated || ""}${S.numBad ? ` · ${S.numBad} malformed lines skipped` : ""}`);
  }
})();

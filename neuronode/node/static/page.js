// The neuronode status page: reads api/status and api/history every few seconds and draws the
// node, its members and its curves. Everything a peer can name (ids, addresses, log lines) is
// put in the page as text (textContent, setAttribute), never parsed as markup.
"use strict";

(function () {
  const SVG_NS = "http://www.w3.org/2000/svg";
  const REFRESH_MS = 5000;
  const CHART = { width: 480, height: 232, left: 62, right: 14, top: 30, bottom: 34 };  // legend above the plot

  // ---- building blocks -------------------------------------------------------------------

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function svgEl(tag, attrs, text) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function byId(id) {
    return document.getElementById(id);
  }

  function isNum(value) {
    return typeof value === "number" && Number.isFinite(value);
  }

  function fmtNum(value, digits) {
    if (!isNum(value)) return "–";
    if (Math.abs(value) >= 1e4) return Math.round(value).toLocaleString("en-US");
    return value.toFixed(digits === undefined ? 3 : digits);
  }

  function fmtBytes(value) {
    if (!isNum(value)) return "–";
    const units = ["B", "kB", "MB", "GB", "TB"];
    let n = value;
    let unit = 0;
    while (Math.abs(n) >= 1000 && unit < units.length - 1) {
      n /= 1000;
      unit += 1;
    }
    return (unit === 0 ? String(Math.round(n)) : n.toFixed(n >= 100 ? 0 : 1)) + " " + units[unit];
  }

  function fmtDuration(seconds) {
    if (!isNum(seconds)) return "–";
    const s = Math.max(0, Math.floor(seconds));
    const d = Math.floor(s / 86400);
    const h = Math.floor((s % 86400) / 3600);
    const m = Math.floor((s % 3600) / 60);
    if (d) return d + " d " + h + " h";
    if (h) return h + " h " + String(m).padStart(2, "0") + " min";
    if (m) return m + " min " + String(s % 60).padStart(2, "0") + " s";
    return s + " s";
  }

  function fmtAgo(seconds) {
    if (!isNum(seconds) || seconds < 0) return "never";
    return seconds < 1 ? "just now" : fmtDuration(seconds) + " ago";
  }

  // ---- this node ---------------------------------------------------------------------------

  const WARNINGS = {
    min_peers: (s) => "Waiting for --min-peers " + s.min_peers + ": " + aliveMembers(s) +
      " member(s) alive, this node included. A round closes only with " + s.min_peers + " contributors.",
    diverged: () => "Diverged: this node's parameters differ from the swarm's. It catches up with the " +
      "swarm's state on its own; if this stays, check that every member runs the same flags.",
    unreachable: (s) => "Not reachable from the internet: peers cannot dial this node, so it takes part " +
      "through sessions to reachable members (carried by " + (s.sessions || []).join(", ") + ").",
    isolated: () => "Not reachable from the internet, and no reachable member carries this node: it " +
      "hears nothing from the swarm. Forward the --listen port, or check that a reachable member is up.",
  };

  function aliveMembers(status) {
    return 1 + (status.peers || []).filter((p) => p.alive).length;
  }

  function renderWarnings(status) {
    const list = byId("warning-list");
    list.replaceChildren();
    for (const code of status.warnings || []) {
      const say = WARNINGS[code];
      list.appendChild(el("li", { "data-code": code, class: code === "unreachable" ? "notice" : "warning" },
        say ? say(status) : code));
    }
    byId("warnings").hidden = list.childElementCount === 0;
  }

  function renderNode(status) {
    byId("node-id").textContent = status.node_id || "";
    document.title = "neuronode · round " + status.round + " · " + (status.phase || "");
    const target = status.rounds_target ? " of " + status.rounds_target : "";
    const reach = { yes: "yes", no: "no (behind NAT: sessions)", unknown: "not known yet" };
    const facts = [
      ["round", "round", status.round + target],
      ["phase", "phase", status.phase],
      ["digest", "parameter digest", status.param_digest],
      ["agreement", "replica agreement", status.agreement],
      ["loss", "loss / val_loss", fmtNum(status.loss) + " / " + fmtNum(status.val_loss)],
      ["tokens", "tokens per second", fmtNum(status.tokens_per_s, 0)],
      ["round-tokens", "tokens per round", status.tokens_per_round ? fmtNum(status.tokens_per_round, 0) : "–"],
      ["eta", "rounds end in", status.rounds_eta_s == null ? (status.rounds_target ? "not known yet" : "runs until stopped")
        : "about " + fmtDuration(status.rounds_eta_s)],
      ["contributors", "contributors last round", status.last_round_contributors],
      ["peers", "peers alive", (status.peers || []).filter((p) => p.alive).length + " of " + (status.peers || []).length],
      ["codec", "codec", status.codec],
      ["averaging", "averaging", status.averaging],
      ["uptime", "uptime", fmtDuration(status.uptime_s)],
      ["reachable", "reachable", reach[status.reachable] || status.reachable],
      ["advertise", "address", status.advertise || "learning it from peers"],
      ["traffic", "sent / received", fmtBytes(status.bytes_sent) + " / " + fmtBytes(status.bytes_received)],
      ["swarm", "swarm", status.swarm_id],
    ];
    const dl = byId("node-facts");
    dl.replaceChildren();
    for (const [key, label, value] of facts) {
      const row = el("div", { class: "fact", id: "fact-" + key });
      row.appendChild(el("dt", {}, label));
      row.appendChild(el("dd", key === "digest" ? { id: "digest", class: "mono" } : {}, value));
      dl.appendChild(row);
    }
  }

  // ---- members -----------------------------------------------------------------------------

  function addressOf(member, status) {
    if (!member.reachable) {
      const carriers = member.carried_by || [];
      return "behind NAT, carried by " + (carriers.length ? carriers.join(", ") : "no member yet");
    }
    if (member.self) return member.address || "learning it from peers";
    if (!status.addresses_shown) return "hidden (the page is reachable beyond this machine)";
    return member.address || "–";
  }

  function aliveText(member) {
    if (member.banned) return "banned";
    if (member.self || member.alive) return "alive";
    return member.left ? "left" : "silent";
  }

  function countedCell(member, rounds) {
    const cell = el("td", { class: "counted" });
    (member.counted || []).forEach((counted, i) => {
      cell.appendChild(el("span", {
        class: counted ? "mark yes" : "mark no",
        title: "round " + rounds[i] + ": " + (counted ? "counted" : "left out"),
      }, counted ? "■" : "□"));
    });
    const n = (member.counted || []).filter(Boolean).length;
    cell.appendChild(el("span", { class: "muted" }, " " + n + "/" + (member.counted || []).length));
    return cell;
  }

  function renderMembers(status) {
    const body = byId("member-rows");
    body.replaceChildren();
    const rounds = status.recent_rounds || [];
    if (rounds.length) byId("counted-head").textContent = "counted in rounds " + rounds[0] + "–" + rounds[rounds.length - 1];
    for (const member of status.members || []) {
      const row = el("tr", { class: "member", "data-alive": aliveText(member) });
      const id = el("td", { class: "member-id mono", title: member.node_id }, member.node_id);
      if (member.self) id.appendChild(el("span", { class: "badge" }, "this node"));
      row.appendChild(id);
      row.appendChild(el("td", { class: "address" }, addressOf(member, status)));
      row.appendChild(el("td", {}, member.round));
      row.appendChild(el("td", {}, member.reachable ? "yes" : "no"));
      row.appendChild(el("td", { class: "alive " + aliveText(member) }, aliveText(member)));
      row.appendChild(el("td", {}, member.self ? "–" : fmtAgo(member.last_seen_s)));
      row.appendChild(countedCell(member, rounds));
      const flags = [member.late ? "late" : "", member.banned ? "banned" : ""].filter(Boolean).join(", ");
      row.appendChild(el("td", { class: flags ? "warning-text" : "" }, flags || "–"));
      row.appendChild(el("td", { class: "agreement " + member.agreement }, member.agreement));
      body.appendChild(row);
    }
  }

  function renderEvents(status) {
    const list = byId("events");
    list.replaceChildren();
    const events = (status.events || []).slice().reverse();
    if (!events.length) list.appendChild(el("li", { class: "muted" }, "none since the node started"));
    for (const e of events) {
      const item = el("li", { class: "event", "data-event": e.event });
      item.appendChild(el("time", {}, new Date(e.time_s * 1000).toLocaleTimeString()));
      item.appendChild(el("span", { class: "event-name" }, e.event));
      if (e.round_id !== null && e.round_id !== undefined) item.appendChild(el("span", {}, "round " + e.round_id));
      if (e.peer_id) item.appendChild(el("span", { class: "mono" }, e.peer_id));
      if (e.message) item.appendChild(el("span", { class: "message" }, e.message));
      list.appendChild(item);
    }
  }

  // ---- charts (SVG drawn here: one circle per round and series, so they can be counted) ----

  function niceStep(span, count) {
    const raw = span / Math.max(count, 1);
    const power = Math.pow(10, Math.floor(Math.log10(raw)));
    const steps = [1, 2, 2.5, 5, 10];
    return power * steps.find((s) => s * power >= raw);
  }

  // The y range: nice steps around the values, from 0 when none is negative and the range
  // would otherwise start below 0; counts (bytes) never get steps below 1.
  function domain(values, whole) {
    let lo = Math.min(...values);
    let hi = Math.max(...values);
    if (lo === hi) {
      const pad = Math.abs(lo) > 0 ? Math.abs(lo) * 0.1 : 1;
      lo = lo >= 0 ? Math.max(0, lo - pad) : lo - pad;
      hi += pad;
    }
    const step = Math.max(niceStep(hi - lo, 4), whole ? 1 : 0);
    const nonNegative = Math.min(...values) >= 0;
    lo = Math.floor(lo / step) * step;
    return { lo: nonNegative ? Math.max(0, lo) : lo, hi: Math.ceil(hi / step) * step, step };
  }

  function lineChart(svg, rounds, series, format, whole) {
    const { width, height, left, right, top, bottom } = CHART;
    svg.replaceChildren();
    svg.setAttribute("viewBox", "0 0 " + width + " " + height);
    svg.setAttribute("role", "img");
    const xs = rounds.map((r) => r.round);
    const ys = [];
    for (const s of series) for (const r of rounds) if (isNum(r[s.key])) ys.push(r[s.key]);
    if (!ys.length) {
      svg.appendChild(svgEl("text", { x: width / 2, y: height / 2, class: "empty", "text-anchor": "middle" },
        "no completed round yet"));
      return;
    }
    const xd = xs.length > 1 ? { lo: Math.min(...xs), hi: Math.max(...xs) } : { lo: xs[0] - 1, hi: xs[0] + 1 };
    const yd = domain(ys, whole);
    const px = (x) => left + ((x - xd.lo) / (xd.hi - xd.lo)) * (width - left - right);
    const py = (y) => height - bottom - ((y - yd.lo) / (yd.hi - yd.lo)) * (height - top - bottom);

    const grid = svgEl("g", { class: "grid" });
    for (let y = yd.lo; y <= yd.hi + yd.step / 2; y += yd.step) {
      grid.appendChild(svgEl("line", { x1: left, x2: width - right, y1: py(y), y2: py(y) }));
      grid.appendChild(svgEl("text", { x: left - 6, y: py(y) + 4, "text-anchor": "end" }, format(y)));
    }
    const xStep = Math.max(1, Math.ceil(niceStep(xd.hi - xd.lo, 6)));
    for (let x = Math.ceil(xd.lo / xStep) * xStep; x <= xd.hi; x += xStep) {
      grid.appendChild(svgEl("text", { x: px(x), y: height - bottom + 16, "text-anchor": "middle" }, x));
    }
    grid.appendChild(svgEl("text", { x: width - right, y: height - 4, "text-anchor": "end" }, "round"));
    svg.appendChild(grid);

    series.forEach((s, index) => {
      const group = svgEl("g", { class: "series series-" + s.key, "data-series": s.key });
      let run = [];
      const flush = () => {
        if (run.length > 1) group.appendChild(svgEl("polyline", { points: run.join(" "), class: "line" }));
        run = [];
      };
      for (const r of rounds) {
        if (!isNum(r[s.key])) {
          flush();
          continue;
        }
        run.push(px(r.round).toFixed(1) + "," + py(r[s.key]).toFixed(1));
      }
      flush();
      for (const r of rounds) {
        if (!isNum(r[s.key])) continue;
        const dot = svgEl("circle", { cx: px(r.round), cy: py(r[s.key]), r: 3, class: "point", "data-round": r.round });
        dot.appendChild(svgEl("title", {}, s.label + ", round " + r.round + ": " + format(r[s.key])));
        group.appendChild(dot);
      }
      svg.appendChild(group);
      const legend = svgEl("g", { class: "legend series-" + s.key });
      const lx = left + index * 130;
      legend.appendChild(svgEl("rect", { x: lx, y: 4, width: 10, height: 10 }));
      legend.appendChild(svgEl("text", { x: lx + 14, y: 13 }, s.label));
      svg.appendChild(legend);
    });
  }

  function renderCharts(history) {
    const rounds = (history.rounds || []).slice().sort((a, b) => a.round - b.round);
    const plain = (v) => fmtNum(v, Math.abs(v) < 10 ? 2 : 0);
    lineChart(byId("chart-loss"), rounds, [{ key: "loss", label: "loss" }, { key: "val_loss", label: "val_loss" }], plain);
    lineChart(byId("chart-tokens"), rounds, [{ key: "tokens_per_s", label: "tokens/s" }], (v) => fmtNum(v, 0));
    lineChart(byId("chart-sync"), rounds, [{ key: "sync_s", label: "sync seconds" }], plain);
    lineChart(byId("chart-bytes"), rounds,
      [{ key: "bytes_sent", label: "sent" }, { key: "bytes_received", label: "received" }], fmtBytes, true);
  }

  // ---- refresh -----------------------------------------------------------------------------

  function render(status, history) {
    renderWarnings(status);
    renderNode(status);
    renderCharts(history);
    renderMembers(status);
    renderEvents(status);
  }

  async function getJSON(path) {
    const response = await fetch(path, { cache: "no-store" });
    if (!response.ok) throw new Error(path + " answered HTTP " + response.status);
    return response.json();
  }

  async function refresh() {
    const updated = byId("updated");
    try {
      const [status, history] = await Promise.all([getJSON("api/status"), getJSON("api/history")]);
      render(status, history);
      updated.textContent = "updated " + new Date().toLocaleTimeString() + " · every " + REFRESH_MS / 1000 + " s";
      document.body.dataset.state = "live";
    } catch (err) {
      updated.textContent = "cannot reach the node (" + err.message + "); trying again";
      document.body.dataset.state = "offline";
    }
  }

  refresh();
  setInterval(refresh, REFRESH_MS);
})();

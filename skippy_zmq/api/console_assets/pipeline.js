// skippy_zmq console: the pipeline view. Draws what GET /v1/console/status says (the chain with its
// hop times, the driver's numbers, one table row per stage, a tokens/s history); fetches nothing.
// Whatever the status does not know (null) shows as "—".
"use strict";

(function () {
  const SVG_NS = "http://www.w3.org/2000/svg";   // XML namespace name, not a URL that is fetched
  const HISTORY = 120;                             // status polls the tokens/s chart keeps (2 min at 1 s)
  const $ = (id) => document.getElementById(id);
  const rates = [];                                // the driver's tokens/s at each poll (null: not known)

  const DASH = "—";

  function known(value) {
    return value !== null && value !== undefined;
  }

  const UNITS = ["B", "KiB", "MiB", "GiB", "TiB"];

  function unitOf(n) {   // the unit n is best written in (an index into UNITS)
    let unit = 0;
    while (n >= 1024 && unit < UNITS.length - 1) {
      n /= 1024;
      unit += 1;
    }
    return unit;
  }

  function bytes(n) {
    if (!known(n)) return DASH;
    const unit = unitOf(n);
    const value = n / 1024 ** unit;
    return `${value >= 100 || unit === 0 ? value.toFixed(0) : value.toFixed(1)} ${UNITS[unit]}`;
  }

  function num(value, digits) {
    return known(value) ? Number(value).toFixed(digits) : DASH;
  }

  function pct(value) {
    return known(value) ? `${(100 * value).toFixed(0)}%` : DASH;
  }

  function layers(range) {
    return range ? `${range[0]}–${range[1] - 1}` : DASH;
  }

  function renderDriver(driver) {
    const spec = driver.speculation || {};
    const prefix = driver.prefix_cache;
    const items = [
      ["tokens/s", num(driver.tokens_per_s, 1)],
      ["running", known(driver.running) ? driver.running : DASH],
      ["queued", known(driver.queued) ? driver.queued : DASH],
      ["batches in flight", known(driver.batches_in_flight) ? driver.batches_in_flight : DASH],
      ["prefix cache hits", prefix ? pct(prefix.hit_rate) : DASH],
      ["speculation accepted", spec.enabled === false ? "off" : pct(spec.acceptance)],
    ];
    const list = $("driver-stats");
    list.replaceChildren(...items.flatMap(([name, value]) => {
      const dt = document.createElement("dt");
      const dd = document.createElement("dd");
      dt.textContent = name;
      dd.textContent = String(value);
      return [dt, dd];
    }));
  }

  function field(tag, name, text, title) {
    const node = document.createElement(tag);
    node.textContent = text;
    node.dataset.field = name;
    if (title) node.title = title;
    return node;
  }

  function bytesPair(used, plan) {   // "1.5 / 2.0 GiB": both in the larger one's unit
    if (!known(plan)) return bytes(used);
    if (!known(used)) return `${DASH} / ${bytes(plan)}`;
    const unit = unitOf(Math.max(used, plan));
    const scale = 1024 ** unit;
    return `${(used / scale).toFixed(1)} / ${(plan / scale).toFixed(1)} ${UNITS[unit]}`;
  }

  function stageRow(s) {
    const tr = document.createElement("tr");
    tr.dataset.stage = s.id;
    tr.className = s.up ? "up" : "down";
    const m = s.memory;
    const lanes = known(s.lanes_in_use) ? `${s.lanes_in_use} / ${known(s.lanes) ? s.lanes : DASH}` : DASH;
    const where = document.createElement("td");
    where.append(field("span", "host", s.host || DASH), " · ", field("span", "device", s.device || DASH));
    tr.append(
      field("td", "id", s.id, s.up ? "up" : "not ready"), where,
      field("td", "layers", layers(s.layers), s.layers ? `layers [${s.layers[0]}, ${s.layers[1]})` : ""),
      field("td", "weights", bytes(m.weights)), field("td", "kv", bytes(m.kv)), field("td", "cache", bytes(m.cache)),
      field("td", "rss", bytesPair(m.rss, m.plan), known(m.budget) ? `budget ${bytes(m.budget)}` : ""),
      field("td", "step", num(s.step_ms, 2)), field("td", "tps", num(s.tokens_per_s, 1)),
      field("td", "lanes", lanes), field("td", "hits", s.cache ? pct(s.cache.hit_rate) : DASH));
    return tr;
  }

  function renderStages(stages) {
    $("stages").tBodies[0].replaceChildren(...stages.map(stageRow));
  }

  function svg(tag, attrs, text) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, String(value));
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function hopLabel(hop) {
    return hop && known(hop.ms) ? `${hop.ms.toFixed(2)} ms` : DASH;
  }

  // driver -> s0 -> s1 -> ... -> back to the driver, each arrow labelled with its hop time
  function renderChain(stages, hops) {
    const boxW = 116, boxH = 44, gap = 70, top = 12;
    const names = ["driver", ...stages.map((s) => s.id)];
    const width = names.length * boxW + (names.length - 1) * gap + 16;
    const height = top + boxH + 46;
    const picture = svg("svg", { viewBox: `0 0 ${width} ${height}`, role: "img", class: "chain",
      "aria-label": "the chain: driver to each stage and back to the driver" });
    const defs = svg("defs", {});
    const marker = svg("marker", { id: "arrow", viewBox: "0 0 8 8", refX: 7, refY: 4, markerWidth: 7,
      markerHeight: 7, orient: "auto-start-reverse" });
    marker.appendChild(svg("path", { d: "M0,0 L8,4 L0,8 z", class: "arrow-head" }));
    defs.appendChild(marker);
    picture.appendChild(defs);
    const x = (i) => 8 + i * (boxW + gap);
    names.forEach((name, i) => {
      const stage = stages[i - 1];
      const kind = i === 0 ? "driver" : (stage.up ? "stage" : "stage down");
      picture.appendChild(svg("rect", { x: x(i), y: top, width: boxW, height: boxH, rx: 8, class: `box ${kind}` }));
      picture.appendChild(svg("text", { x: x(i) + boxW / 2, y: top + 19, class: "box-name" }, name));
      const sub = i === 0 ? "HTTP + scheduler" : (stage.layers ? `layers ${layers(stage.layers)}` : (stage.device || ""));
      picture.appendChild(svg("text", { x: x(i) + boxW / 2, y: top + 35, class: "box-sub" }, sub));
      if (i > 0) {
        const hop = hops.find((h) => h.from === names[i - 1] && h.to === name);
        picture.appendChild(svg("line", { x1: x(i - 1) + boxW, y1: top + boxH / 2, x2: x(i) - 2, y2: top + boxH / 2,
          class: "hop", "marker-end": "url(#arrow)" }));
        picture.appendChild(svg("text", { x: x(i) - gap / 2, y: top + boxH / 2 - 6, class: "hop-label" }, hopLabel(hop)));
      }
    });
    if (hops.length) {   // a pipeline: the last stage's token goes straight back to the driver
      const back = hops.find((h) => h.from === names[names.length - 1] && h.to === "driver");
      const x0 = x(names.length - 1) + boxW / 2, x1 = x(0) + boxW / 2, y0 = top + boxH, yb = top + boxH + 26;
      picture.appendChild(svg("path", { d: `M${x0},${y0} L${x0},${yb} L${x1},${yb} L${x1},${y0 + 2}`,
        class: "hop back", "marker-end": "url(#arrow)" }));
      picture.appendChild(svg("text", { x: (x0 + x1) / 2, y: yb + 14, class: "hop-label" },
        `token back to driver: ${hopLabel(back)}`));
    }
    $("chain").replaceChildren(picture);
  }

  // the driver's tokens/s over the last polls; gaps where it was not known
  function renderRate(tokensPerS) {
    rates.push(tokensPerS);
    if (rates.length > HISTORY) rates.shift();
    const width = Math.max(200, $("rate-chart").clientWidth), height = 84, top = 16, bottom = 4;
    const peak = Math.max(1, ...rates.filter(known));
    const x = (i) => (width * (HISTORY - rates.length + i)) / (HISTORY - 1);   // the latest at the right edge
    const y = (v) => top + (height - top - bottom) * (1 - v / peak);
    let d = "";
    rates.forEach((v, i) => {
      if (!known(v)) return;
      d += `${i > 0 && known(rates[i - 1]) ? "L" : "M"}${x(i).toFixed(1)},${y(v).toFixed(1)} `;
    });
    const picture = svg("svg", { viewBox: `0 0 ${width} ${height}`, class: "rate", role: "img",
      "aria-label": "tokens per second over the last two minutes" });
    picture.appendChild(svg("line", { x1: 0, y1: height - bottom, x2: width, y2: height - bottom, class: "axis" }));
    picture.appendChild(svg("path", { d: d || "M0,0", class: d ? "rate-line" : "rate-line empty" }));
    picture.appendChild(svg("text", { x: 2, y: 11, class: "rate-label" },
      `driver tokens/s, last ${HISTORY} s (peak ${num(peak, 1)})`));
    $("rate-chart").replaceChildren(picture);
  }

  function render(status) {
    renderDriver(status.driver);
    renderStages(status.stages);
    renderChain(status.stages, status.hops);
    renderRate(status.driver.tokens_per_s);
  }

  window.SkippyPipeline = { render };
})();

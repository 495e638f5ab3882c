// skippy_zmq console: chat over /v1/chat/completions (streamed) and a live view of the pipeline
// from /v1/console/status. Served by the driver itself; no outside assets. Model text reaches
// the page only as text nodes (markdown.js builds DOM nodes; no HTML string is ever parsed).
"use strict";

(function () {
  const KEY_STORE = "skippy.console.apiKey";
  const STATUS_URL = "/v1/console/status";
  const CHAT_URL = "/v1/chat/completions";
  const POLL_MS = 1000;
  const SVG_NS = "http://www.w3.org/2000/svg";   // XML namespace name, not a URL that is fetched
  const $ = (id) => document.getElementById(id);

  const state = { history: [], controller: null, model: null, polls: 0 };

  // ------------------------------------------------------------------ API key

  function apiKey() {
    return sessionStorage.getItem(KEY_STORE) || "";
  }

  function headers(extra) {
    const out = Object.assign({}, extra || {});
    const key = apiKey();
    if (key) out.Authorization = `Bearer ${key}`;
    return out;
  }

  function showAuth(message) {
    const banner = $("auth-banner");
    banner.textContent = message;
    banner.hidden = !message;
  }

  function unauthorized() {
    showAuth(apiKey()
      ? "401: the server refused this API key. Enter the right key above and press “Use key”."
      : "401: this server needs an API key. Enter it above and press “Use key”.");
  }

  function setupKeyForm() {
    $("api-key").value = apiKey();
    $("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const key = $("api-key").value.trim();
      if (key) sessionStorage.setItem(KEY_STORE, key);
      else sessionStorage.removeItem(KEY_STORE);
      showAuth("");
      poll();
    });
    $("key-clear").addEventListener("click", () => {
      sessionStorage.removeItem(KEY_STORE);
      $("api-key").value = "";
      poll();
    });
  }

  // ------------------------------------------------------------------ formatting

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

  // ------------------------------------------------------------------ pipeline view

  async function poll() {
    clearTimeout(state.timer);
    try {
      const response = await fetch(STATUS_URL, { headers: headers(), cache: "no-store" });
      if (response.status === 401) {
        unauthorized();
        $("updated").textContent = "needs an API key";
      } else if (!response.ok) {
        $("updated").textContent = `status: HTTP ${response.status}`;
      } else {
        showAuth("");
        renderStatus(await response.json());
      }
    } catch (err) {
      $("updated").textContent = `status unavailable (${err.message})`;
    }
    state.timer = setTimeout(poll, POLL_MS);
  }

  function renderStatus(status) {
    state.model = status.model;
    state.polls += 1;
    $("model").textContent = status.model;
    $("ready").textContent = status.ready ? "ready" : "not ready";
    $("ready").className = status.ready ? "pill ok" : "pill warn";
    const updated = $("updated");
    updated.textContent = `updated ${new Date(status.time * 1000).toLocaleTimeString()}`;
    updated.dataset.polls = String(state.polls);
    renderDriver(status.driver);
    renderStages(status.stages);
    renderChain(status.stages, status.hops);
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

  // ------------------------------------------------------------------ chat

  function settings() {
    const body = {};
    const number = (id) => {
      const raw = $(id).value.trim();
      return raw === "" ? null : Number(raw);
    };
    for (const id of ["temperature", "top_p", "max_tokens", "seed"]) {
      const value = number(id);
      if (value !== null && Number.isFinite(value)) body[id] = value;
    }
    return body;
  }

  function addMessage(role) {
    const wrap = document.createElement("div");
    wrap.className = `msg ${role}`;
    const who = document.createElement("div");
    who.className = "who";
    who.textContent = role === "user" ? "you" : "model";
    wrap.appendChild(who);
    $("messages").appendChild(wrap);
    return wrap;
  }

  function userMessage(text) {
    const wrap = addMessage("user");
    const content = document.createElement("div");
    content.className = "content";
    content.textContent = text;
    wrap.appendChild(content);
  }

  class AssistantView {
    constructor() {
      this.wrap = addMessage("assistant");
      this.wrap.dataset.state = "streaming";
      this.reasoningBox = document.createElement("details");
      this.reasoningBox.className = "reasoning";
      this.reasoningBox.hidden = true;
      const summary = document.createElement("summary");
      summary.textContent = "reasoning";
      this.reasoningText = document.createElement("div");
      this.reasoningText.className = "reasoning-text";
      this.reasoningBox.append(summary, this.reasoningText);
      this.content = document.createElement("div");
      this.content.className = "content";
      this.meta = document.createElement("div");
      this.meta.className = "meta";
      this.wrap.append(this.reasoningBox, this.content, this.meta);
      this.text = "";
      this.reasoning = "";
      this.lengths = [];   // the rendered text's length at each repaint: how the answer grew
      this.frame = 0;
    }

    push(delta) {
      if (delta.reasoning_content) this.reasoning += delta.reasoning_content;
      if (delta.content) this.text += delta.content;
      if (!this.frame) this.frame = requestAnimationFrame(() => this.paint());
    }

    paint() {
      this.frame = 0;
      if (this.reasoning) {
        this.reasoningBox.hidden = false;
        this.reasoningText.textContent = this.reasoning;
      }
      window.SkippyMarkdown.render(this.text, this.content);
      const length = this.content.textContent.length;
      if (length !== this.lengths[this.lengths.length - 1]) this.lengths.push(length);
      this.wrap.dataset.lengths = this.lengths.join(",");
      $("messages").scrollTop = $("messages").scrollHeight;
    }

    finish(outcome, note) {
      if (this.frame) cancelAnimationFrame(this.frame);
      this.paint();
      this.meta.textContent = note;
      this.wrap.dataset.state = outcome;
    }
  }

  // Server-sent events from a fetch body: yields each `data:` payload as it arrives.
  async function* sseData(body, signal) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        let end;
        while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
          const event = buffer.slice(0, end);
          buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
          const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
          if (data.length) yield data.join("\n");
        }
      }
    } finally {
      if (signal.aborted) reader.cancel().catch(() => {});
      reader.releaseLock();
    }
  }

  async function errorText(response) {
    try {
      const body = await response.json();
      return (body.error && body.error.message) || JSON.stringify(body);
    } catch (err) {
      return response.statusText;
    }
  }

  async function send(prompt) {
    const system = $("system").value.trim();
    state.history.push({ role: "user", content: prompt });
    userMessage(prompt);
    const view = new AssistantView();
    const controller = new AbortController();
    state.controller = controller;
    setBusy(true);
    const started = performance.now();
    let finish = null, usage = null;
    try {
      const messages = system ? [{ role: "system", content: system }, ...state.history] : state.history;
      const response = await fetch(CHAT_URL, {
        method: "POST", signal: controller.signal,
        headers: headers({ "Content-Type": "application/json", Accept: "text/event-stream" }),
        body: JSON.stringify({ model: state.model || "default", messages, stream: true,
          stream_options: { include_usage: true }, ...settings() }),
      });
      if (response.status === 401) {
        unauthorized();
        view.finish("error", "401: API key missing or refused");
        state.history.pop();
        return;
      }
      if (!response.ok) {
        view.finish("error", `HTTP ${response.status}: ${await errorText(response)}`);
        state.history.pop();
        return;
      }
      for await (const data of sseData(response.body, controller.signal)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message || "the server reported an error");
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          if (choice.delta) view.push(choice.delta);
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
      state.history.push({ role: "assistant", content: view.text });
      const seconds = (performance.now() - started) / 1000;
      const tokens = usage ? `${usage.completion_tokens} tokens, ` : "";
      view.finish("done", `${finish || "ended"} · ${tokens}${seconds.toFixed(1)} s`);
    } catch (err) {
      if (controller.signal.aborted) {
        state.history.push({ role: "assistant", content: view.text });
        view.finish("stopped", "stopped");
      } else {
        state.history.pop();
        view.finish("error", `error: ${err.message}`);
      }
    } finally {
      state.controller = null;
      setBusy(false);
    }
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
    $("chat-note").textContent = busy ? "streaming…" : "";
  }

  function setupChat() {
    const form = $("chat-form");
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      const prompt = $("prompt").value.trim();
      if (!prompt || state.controller) return;
      $("prompt").value = "";
      send(prompt);
    });
    $("prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey) {
        event.preventDefault();
        form.requestSubmit();
      }
    });
    $("stop").addEventListener("click", () => state.controller && state.controller.abort());
    $("new-chat").addEventListener("click", () => {
      if (state.controller) state.controller.abort();
      state.history = [];
      $("messages").replaceChildren();
    });
  }

  document.addEventListener("DOMContentLoaded", () => {
    setupKeyForm();
    setupChat();
    poll();
  });
})();

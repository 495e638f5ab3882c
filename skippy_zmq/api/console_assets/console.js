// skippy_zmq console: chat over /v1/chat/completions (streamed) and a live view of the pipeline
// from /v1/console/status. Served by the driver itself; no outside assets. Model text reaches
// the page only as text nodes (markdown.js builds DOM nodes; no HTML string is ever parsed).
"use strict";

(function () {
  const KEY_STORE = "skippy.console.apiKey";
  const STATUS_URL = "/v1/console/status";
  const CHAT_URL = "/v1/chat/completions";
  const POLL_MS = 1000;
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
    window.SkippyPipeline.render(status);
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

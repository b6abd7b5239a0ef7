// swaserve playground: chat with streaming, sampling controls, per-token logprobs, cached
// tokens per turn, the model's reasoning (reasoning_content) and tool calls, and a live view of
// the KV page pool (GET /v1/memory). Plain JavaScript, no build step, no external resources:
// every request goes to the server that served it.
(() => {
  "use strict";

  const KEY_STORAGE = "swaserve.playground.apiKey";
  const POLL_MS = 500;
  const SERIES_LEN = 120; // 60 s of samples
  const TOP_LOGPROBS = 5;
  const NO_TEMPLATE_NOTICE =
    "This model has no chat template, so the playground sends the conversation as plain " +
    "text (\u201cUser: \u2026\u201d / \u201cAssistant:\u201d lines) to /v1/completions. " +
    "Start the server with --chat-template FILE for real chat turns.";

  const EXAMPLE_TOOLS = [
    {
      type: "function",
      function: {
        name: "get_weather",
        description: "The current weather in a city.",
        parameters: {
          type: "object",
          properties: {
            city: { type: "string", description: "the city's name" },
            unit: { type: "string", enum: ["celsius", "fahrenheit"] },
          },
          required: ["city"],
        },
      },
    },
  ];

  const $ = (id) => document.getElementById(id);
  const fmt = (n) => (typeof n === "number" && isFinite(n) ? n.toLocaleString("en-US") : "\u2013");

  const state = {
    apiKey: sessionStorage.getItem(KEY_STORAGE) || "",
    model: null,
    maxModelLen: null,
    mode: "chat", // "completions" once the model turns out to have no chat template
    history: [], // the finished turns as the API takes them: {role, content[, tool_calls]}
    busy: false,
    abort: null,
    polling: false,
    keyRefused: false, // the last request got a 401: wait for another key before polling
    series: [],
    groupsKey: "",
    groupPeak: 1, // group bars are drawn to this scale: the most pages one group held so far
  };

  // ---- HTTP ------------------------------------------------------------------------------

  function headers(json) {
    const h = {};
    if (json) h["Content-Type"] = "application/json";
    if (state.apiKey) h.Authorization = "Bearer " + state.apiKey;
    return h;
  }

  async function apiError(resp) {
    let message = resp.status + " " + resp.statusText;
    try {
      const body = await resp.json();
      if (body && body.error && body.error.message) message = body.error.message;
    } catch (_) {
      // not JSON: keep the status line
    }
    const err = new Error(message);
    err.status = resp.status;
    return err;
  }

  function setStatus(level, text) {
    $("status").dataset.level = level;
    $("status-text").textContent = text;
  }

  function keyStatus(text, level) {
    const el = $("key-status");
    el.textContent = text;
    el.className = "hint" + (level ? " " + level : "");
  }

  async function connect() {
    try {
      const resp = await fetch("v1/models", { headers: headers(false), cache: "no-store" });
      if (resp.status === 401) {
        state.model = null;
        state.keyRefused = true;
        $("model-info").textContent = "API key needed";
        kvMessage("Enter the server's API key (Connection) to see the KV pool.");
        setStatus("warn", "API key needed");
        keyStatus(
          state.apiKey
            ? "The server refused this key."
            : "This server needs its --api-key: enter it above.",
          "bad",
        );
        return false;
      }
      if (!resp.ok) throw await apiError(resp);
      state.keyRefused = false;
      const card = (await resp.json()).data[0];
      state.model = card.id;
      state.maxModelLen = card.max_model_len;
      const info = $("model-info");
      info.textContent = "";
      const b = document.createElement("b");
      b.textContent = card.id;
      info.append(b, " \u00b7 context " + fmt(card.max_model_len) + " tokens");
      $("max-tokens").max = String(card.max_model_len);
      keyStatus(state.apiKey ? "Key accepted. Kept in this tab only." : "No key needed.", "ok");
      setStatus("ok", "ready");
      return true;
    } catch (e) {
      setStatus("bad", "server unreachable");
      $("model-info").textContent = "not connected";
      return false;
    }
  }

  function saveKey() {
    state.apiKey = $("api-key").value.trim();
    state.keyRefused = false;
    if (state.apiKey) sessionStorage.setItem(KEY_STORAGE, state.apiKey);
    else sessionStorage.removeItem(KEY_STORAGE);
    connect().then(pollMemory);
  }

  // ---- KV panel --------------------------------------------------------------------------

  function setKV(key, value, text) {
    for (const el of document.querySelectorAll('[data-kv="' + key + '"]')) {
      const shown = text !== undefined ? text : fmt(value);
      if (el.textContent !== shown) {
        el.textContent = shown;
        el.classList.remove("bump");
        void el.offsetWidth; // restart the highlight
        el.classList.add("bump");
        setTimeout(() => el.classList.remove("bump"), 120);
      }
      if (value !== undefined) el.dataset.value = String(value);
    }
  }

  function setWidth(el, part, total) {
    const frac = total > 0 ? Math.min(1, part / total) : 0;
    el.style.width = (100 * frac).toFixed(3) + "%";
    el.classList.toggle("nonzero", part > 0);
  }

  function kvMessage(text) {
    const el = $("kv-message");
    el.hidden = !text;
    el.textContent = text || "";
    $("kv-live").classList.toggle("stale", !!text);
    $("kv-live").textContent = text ? "paused" : "live";
  }

  async function pollMemory() {
    if (state.polling || document.hidden || state.keyRefused) return;
    state.polling = true;
    try {
      const resp = await fetch("v1/memory", { headers: headers(false), cache: "no-store" });
      if (resp.status === 401) {
        state.keyRefused = true;
        kvMessage("Enter the server's API key (Connection) to see the KV pool.");
        setStatus("warn", "API key needed");
        return;
      }
      if (!resp.ok) throw await apiError(resp);
      const mem = await resp.json();
      kvMessage("");
      renderMemory(mem);
      if (!state.model) await connect();
      else if ($("status").dataset.level !== "ok") setStatus("ok", "ready");
    } catch (e) {
      kvMessage(e.status === 503 ? e.message : "Cannot reach the server.");
      setStatus("bad", e.status === 503 ? "engine core stopped" : "server unreachable");
    } finally {
      state.polling = false;
    }
  }

  function renderMemory(m) {
    const total = m.pages_total || 0;
    const free = m.pages_free || 0;
    const req = m.pages_held_by_requests || 0;
    const cache = m.pages_held_by_others || 0;
    setKV("pages_used", total - free);
    setKV("pages_total", total);
    setKV("page_size", m.page_size);
    setKV("pages_held_by_requests", req);
    setKV("pages_held_by_others", cache);
    setKV("pages_free", free);
    setWidth($("pool-req"), req, total);
    setWidth($("pool-cache"), cache, total);
    for (const key of [
      "cache_hit_tokens", "cache_pages", "evictions", "host_pages", "disk_pages",
      "host_loads", "host_stores", "num_running", "num_waiting", "num_preemptions",
      "num_requests",
    ]) {
      setKV(key, m[key] || 0);
    }
    const q = m.cache_query_tokens || 0;
    setKV("hit_rate", q ? m.cache_hit_tokens / q : 0,
      q ? (100 * (m.cache_hit_tokens || 0) / q).toFixed(1) + "%" : "\u2013");
    renderGroups(m.groups || [], m.page_size || 0);
    state.series.push({ req, cache });
    if (state.series.length > SERIES_LEN) state.series.shift();
    drawSpark();
  }

  function renderGroups(groups, pageSize) {
    const box = $("groups");
    const key = groups.map((g) => g.index + g.kind + g.window).join("|");
    if (key !== state.groupsKey) {
      state.groupsKey = key;
      box.textContent = "";
      for (const g of groups) {
        const row = document.createElement("div");
        row.className = "group";
        const head = document.createElement("div");
        head.className = "group-head";
        const name = document.createElement("span");
        name.className = "group-name";
        const kind = document.createElement("span");
        kind.className = "kind";
        kind.textContent = g.window ? " \u00b7 sliding window " + fmt(g.window) : " \u00b7 full attention";
        name.title = g.window
          ? "layers that attend to the last " + fmt(g.window) + " tokens only"
          : "layers that attend to the whole context";
        name.append("group " + g.index, kind);
        const num = document.createElement("span");
        const b = document.createElement("b");
        b.dataset.kv = "group" + g.index + "_pages_used";
        num.append(b, " pages");
        head.append(name, num);
        const bar = document.createElement("div");
        bar.className = "bar";
        const seg = document.createElement("span");
        seg.className = "seg " + (g.window ? "swa" : "req");
        seg.id = "group-seg-" + g.index;
        bar.append(seg);
        row.append(head, bar);
        if (g.window) {
          const note = document.createElement("div");
          note.className = "group-note";
          note.id = "group-note-" + g.index;
          row.append(note);
        }
        box.append(row);
      }
      if (!groups.length) box.textContent = "no groups reported";
    }
    state.groupPeak = Math.max(state.groupPeak, ...groups.map((g) => g.pages_used));
    $("group-peak").textContent = fmt(state.groupPeak);
    const full = groups.filter((g) => !g.window).map((g) => g.pages_used);
    const fullMax = full.length ? Math.max(...full) : null;
    for (const g of groups) {
      setKV("group" + g.index + "_pages_used", g.pages_used);
      setWidth($("group-seg-" + g.index), g.pages_used, state.groupPeak);
      const note = $("group-note-" + g.index);
      if (note) {
        const retired = fullMax === null ? 0 : Math.max(0, fullMax - g.pages_used);
        note.textContent = retired
          ? "\u2212" + fmt(retired) + " pages retired: " +
            fmt(retired * pageSize) + " tokens left the window"
          : "keeps at most one window (" + fmt(g.window) + " tokens) per request";
        note.dataset.retired = String(retired);
      }
    }
  }

  function drawSpark() {
    const canvas = $("spark");
    const dpr = window.devicePixelRatio || 1;
    const w = canvas.clientWidth || 340;
    const h = canvas.clientHeight || 64;
    if (canvas.width !== Math.round(w * dpr)) {
      canvas.width = Math.round(w * dpr);
      canvas.height = Math.round(h * dpr);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    const s = state.series;
    const peak = Math.max(1, ...s.map((p) => p.req + p.cache));
    $("spark-peak").textContent = fmt(peak);
    const css = getComputedStyle(document.documentElement);
    ctx.strokeStyle = css.getPropertyValue("--line");
    ctx.beginPath();
    ctx.moveTo(0, h - 0.5);
    ctx.lineTo(w, h - 0.5);
    ctx.stroke();
    if (s.length < 2) return;
    const x = (i) => w - (s.length - 1 - i) * (w / (SERIES_LEN - 1));
    const y = (v) => h - 2 - (v / peak) * (h - 6);
    const area = (value, color) => {
      ctx.beginPath();
      ctx.moveTo(x(0), h);
      s.forEach((p, i) => ctx.lineTo(x(i), y(value(p))));
      ctx.lineTo(x(s.length - 1), h);
      ctx.closePath();
      ctx.globalAlpha = 0.25;
      ctx.fillStyle = color;
      ctx.fill();
      ctx.globalAlpha = 1;
      ctx.beginPath();
      s.forEach((p, i) => (i ? ctx.lineTo(x(i), y(value(p))) : ctx.moveTo(x(i), y(value(p)))));
      ctx.strokeStyle = color;
      ctx.lineWidth = 1.5;
      ctx.stroke();
    };
    area((p) => p.req + p.cache, css.getPropertyValue("--cache").trim());
    area((p) => p.req, css.getPropertyValue("--accent").trim());
  }

  // ---- turns: stream deltas, tool calls, tools (pure: no DOM) ----------------------------

  function emptyTurn() {
    return { reasoning: "", content: "", toolCalls: [] };
  }

  // One chat stream delta applied to the turn so far: the next turn and what the delta added.
  // `turn`: {reasoning, content, toolCalls: [{index, id, type, name, arguments}]}, not changed.
  // Tool calls add up per `index`: the first delta of a call brings its id and name, later ones
  // more of its arguments (a named tool_choice streams them in pieces; "auto" and "required"
  // calls come whole, one delta each).
  function applyDelta(turn, delta) {
    const added = { reasoning: "", content: "", calls: [] };
    const next = { reasoning: turn.reasoning, content: turn.content, toolCalls: turn.toolCalls };
    if (!delta) return { turn: next, added };
    const thought = delta.reasoning_content || delta.reasoning; // vLLM has used both names
    if (typeof thought === "string" && thought) {
      added.reasoning = thought;
      next.reasoning += thought;
    }
    if (typeof delta.content === "string" && delta.content) {
      added.content = delta.content;
      next.content += delta.content;
    }
    const pieces = Array.isArray(delta.tool_calls) ? delta.tool_calls : [];
    if (pieces.length) next.toolCalls = turn.toolCalls.slice();
    pieces.forEach((piece, k) => {
      const index = typeof piece.index === "number" ? piece.index : k;
      const fn = piece.function || {};
      const at = next.toolCalls.findIndex((c) => c.index === index);
      const prev = at >= 0
        ? next.toolCalls[at]
        : { index, id: "", type: "function", name: "", arguments: "" };
      const name = typeof fn.name === "string" && fn.name && fn.name !== prev.name
        ? prev.name + fn.name
        : prev.name;
      const call = {
        index,
        id: prev.id || piece.id || "",
        type: prev.type || piece.type || "function",
        name,
        arguments: prev.arguments + (typeof fn.arguments === "string" ? fn.arguments : ""),
      };
      if (at >= 0) next.toolCalls[at] = call;
      else next.toolCalls.push(call);
      if (!added.calls.includes(index)) added.calls.push(index);
    });
    if (pieces.length) next.toolCalls.sort((a, b) => a.index - b.index);
    return { turn: next, added };
  }

  function callId(call) {
    return call.id || "call_" + call.index;
  }

  // The turn as the next request's history holds it: content and tool calls. The reasoning
  // stays out (OpenAI's and vLLM's practice: earlier turns are sent without it).
  function assistantMessage(turn) {
    if (!turn.toolCalls.length) return { role: "assistant", content: turn.content };
    return {
      role: "assistant",
      content: turn.content || null,
      tool_calls: turn.toolCalls.map((c) => ({
        id: callId(c),
        type: "function",
        function: { name: c.name, arguments: c.arguments },
      })),
    };
  }

  // A call's arguments for its card: pretty-printed JSON, or the text as it came.
  function formatArgs(text) {
    try {
      return { json: true, text: JSON.stringify(JSON.parse(text), null, 2) };
    } catch (_) {
      return { json: false, text };
    }
  }

  // The Tools editor's text: {tools: a list, or null for none} or {error}.
  function parseTools(text) {
    if (!text.trim()) return { tools: null, error: null };
    let tools;
    try {
      tools = JSON.parse(text);
    } catch (e) {
      return { tools: null, error: "not valid JSON: " + e.message };
    }
    if (!Array.isArray(tools)) {
      return { tools: null, error: 'a JSON list of tools is needed: [{"type": "function", ...}]' };
    }
    for (let i = 0; i < tools.length; i++) {
      const t = tools[i];
      if (!t || t.type !== "function" || !t.function || typeof t.function.name !== "string") {
        return {
          tools: null,
          error: "tools[" + i + '] must be {"type": "function", "function": {"name": ...}}',
        };
      }
    }
    return { tools: tools.length ? tools : null, error: null };
  }

  // ---- messages --------------------------------------------------------------------------

  function scrollDown(force) {
    const t = $("transcript");
    if (force || t.scrollHeight - t.scrollTop - t.clientHeight < 120) t.scrollTop = t.scrollHeight;
  }

  function addMessage(role) {
    $("empty-state").hidden = true;
    const msg = document.createElement("div");
    msg.className = "msg " + role;
    const who = document.createElement("div");
    who.className = "who";
    const names = { user: "you", tool: "tool result" };
    who.textContent = names[role] || state.model || "model";
    const body = document.createElement("div");
    body.className = "msg-body";
    msg.append(who, body);
    $("messages").append(msg);
    scrollDown(true);
    return msg;
  }

  function visible(tok) {
    return tok.replace(/ /g, "\u2423").replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5") || "\u2205";
  }

  // One assistant turn: text arrives in pieces, each with the logprobs of its tokens; a chat
  // turn's deltas may also carry reasoning (a "Thinking" block above the answer, open while it
  // streams) and tool calls (a card each, below the answer).
  class AssistantView {
    constructor() {
      this.el = addMessage("assistant");
      this.body = this.el.querySelector(".msg-body");
      this.el.dataset.state = "streaming";
      this.reset();
    }

    reset() {
      this.body.textContent = "";
      this.body.hidden = false;
      this.body.classList.toggle("shade", $("shade").checked);
      for (const el of this.el.querySelectorAll(".thinking, .tool-calls")) el.remove();
      delete this.el.dataset.phase;
      this.thinking = null;
      this.calls = null;
      this.turn = emptyTurn();
      this.answered = new Set(); // indices of the calls whose result was sent
      this.text = "";
      this.pending = [];
      this.updates = 0;
    }

    // A chat stream delta (applyDelta) with the logprobs of its tokens.
    delta(d, toks) {
      const { turn, added } = applyDelta(this.turn, d);
      this.turn = turn;
      if (added.reasoning) this.think(added.reasoning);
      if (added.calls.length) {
        this.endThinking();
        this.pending = []; // the call's tokens: not the answer's
        for (const i of added.calls) this.showCall(turn.toolCalls.find((c) => c.index === i));
      }
      if (added.content) {
        this.endThinking();
        this.append(added.content, toks);
      } else if (!added.reasoning && !added.calls.length) {
        this.append("", toks); // tokens whose text comes later
      } else if (added.reasoning && !this.text) {
        this.pending = []; // the reasoning's tokens: not the answer's
      }
    }

    think(text) {
      if (!this.thinking) {
        const box = document.createElement("details");
        box.className = "thinking";
        box.open = true;
        const summary = document.createElement("summary");
        const label = document.createElement("span");
        label.className = "thinking-label";
        label.textContent = "Thinking\u2026";
        const size = document.createElement("span");
        size.className = "thinking-size";
        summary.append(label, size);
        const body = document.createElement("div");
        body.className = "thinking-body";
        box.append(summary, body);
        this.el.insertBefore(box, this.body);
        this.thinking = { box, label, size, body };
        if (!this.el.dataset.phase) this.el.dataset.phase = "thinking";
      }
      this.thinking.body.append(text);
      this.thinking.size.textContent = " \u00b7 " + fmt(countWords(this.turn.reasoning)) + " words";
      scrollDown(false);
    }

    // The answer (or a tool call) started, or the turn ended: the reasoning folds away.
    endThinking() {
      if (this.el.dataset.phase === "answer") return;
      this.el.dataset.phase = "answer";
      if (this.thinking) {
        this.thinking.box.open = false;
        this.thinking.label.textContent = "Thinking";
      }
    }

    showCall(call) {
      if (!this.calls) {
        this.calls = document.createElement("div");
        this.calls.className = "tool-calls";
        this.body.after(this.calls);
      }
      let card = this.calls.querySelector('.tool-call[data-index="' + call.index + '"]');
      if (!card) {
        card = document.createElement("div");
        card.className = "tool-call";
        card.dataset.index = String(call.index);
        const head = document.createElement("div");
        head.className = "tool-head";
        const tag = document.createElement("span");
        tag.className = "tool-tag";
        tag.textContent = "tool call";
        const name = document.createElement("code");
        name.className = "tool-name";
        const id = document.createElement("span");
        id.className = "tool-id";
        head.append(tag, name, id);
        const args = document.createElement("pre");
        args.className = "tool-args";
        card.append(head, args);
        this.calls.append(card);
      }
      card.dataset.name = call.name;
      card.querySelector(".tool-name").textContent = call.name || "?";
      card.querySelector(".tool-id").textContent = call.id;
      const args = formatArgs(call.arguments);
      const pre = card.querySelector(".tool-args");
      pre.textContent = args.text;
      pre.classList.toggle("raw", !args.json);
      pre.title = args.json ? "arguments (JSON)" : "arguments, as the model wrote them (not JSON)";
      scrollDown(false);
    }

    // Under each call: a field for the tool's result, sent as a "tool" message; once every
    // call of the turn has its result, the model goes on.
    offerResults() {
      for (const call of this.turn.toolCalls) {
        const card = this.calls.querySelector('.tool-call[data-index="' + call.index + '"]');
        const form = document.createElement("form");
        form.className = "tool-result";
        form.autocomplete = "off";
        const input = document.createElement("input");
        input.type = "text";
        input.placeholder = "the tool's result, e.g. {\"temperature\": 21}";
        input.setAttribute("aria-label", "result of " + call.name);
        const button = document.createElement("button");
        button.type = "submit";
        button.textContent = "Send result";
        form.append(input, button);
        form.addEventListener("submit", (e) => {
          e.preventDefault();
          if (state.busy || form.dataset.closed) return;
          this.sendResult(call, input.value, form);
        });
        card.append(form);
      }
    }

    sendResult(call, content, form) {
      state.history.push({ role: "tool", tool_call_id: callId(call), content });
      closeResult(form, "result sent");
      form.dataset.sent = "1";
      addToolMessage(call, content);
      this.answered.add(call.index);
      const left = this.turn.toolCalls.length - this.answered.size;
      if (left === 0) runTurn(0);
    }

    // `text`: the new text; `toks`: [{token, logprob, top: [{token, logprob}]}] of the tokens
    // it came from. Tokens whose text is still held back (half a character) wait for the next.
    append(text, toks) {
      this.pending.push(...toks);
      if (!text) return;
      this.text += text;
      this.updates += 1;
      this.el.dataset.updates = String(this.updates);
      const toksNow = this.pending;
      this.pending = [];
      if (!toksNow.length) {
        this.body.append(text);
      } else if (toksNow.map((t) => t.token).join("") === text) {
        for (const t of toksNow) this.body.append(this.span(t.token, [t]));
      } else {
        this.body.append(this.span(text, toksNow));
      }
      scrollDown(false);
    }

    span(text, toks) {
      const el = document.createElement("span");
      el.className = "tok";
      el.textContent = text;
      el.toks = toks;
      const p = Math.exp(Math.min(...toks.map((t) => t.logprob)));
      el.style.setProperty("--u", (1 - p).toFixed(3));
      return el;
    }

    finish(info) {
      this.endThinking();
      if (!this.text && (this.turn.toolCalls.length || this.turn.reasoning)) {
        this.pending = []; // the end-of-turn token after a call or a reasoning: no answer to mark
        this.body.hidden = true;
      }
      if (this.calls) {
        for (const call of this.turn.toolCalls) this.showCall(call);
        if (state.mode === "chat") this.offerResults();
      }
      for (const t of this.pending) {
        const s = this.span(t.token, [t]); // e.g. the end-of-turn token: no text of its own
        s.classList.add("special");
        this.body.append(s);
      }
      this.pending = [];
      this.el.dataset.state = info.stopped ? "stopped" : "done";
      const meta = document.createElement("div");
      meta.className = "msg-meta";
      const chip = (text, cls, title) => {
        const c = document.createElement("span");
        c.className = "chip" + (cls ? " " + cls : "");
        c.textContent = text;
        if (title) c.title = title;
        meta.append(c);
        return c;
      };
      const u = info.usage;
      if (u) {
        const cached = (u.prompt_tokens_details && u.prompt_tokens_details.cached_tokens) || 0;
        const c = chip(
          fmt(cached) + " of " + fmt(u.prompt_tokens) + " prompt tokens cached",
          cached ? "cached" : "",
          "usage.prompt_tokens_details.cached_tokens: prompt tokens whose KV came from the " +
            "prefix cache instead of being computed",
        );
        c.dataset.cached = String(cached);
        c.classList.add("cached-chip");
        chip(fmt(u.completion_tokens) + " tokens");
      }
      if (info.ttft !== null) chip("first token " + info.ttft.toFixed(2) + " s");
      if (u && info.ttft !== null && u.completion_tokens > 1 && info.elapsed > info.ttft) {
        const rate = (u.completion_tokens - 1) / (info.elapsed - info.ttft);
        chip(rate.toFixed(1) + " tokens/s");
      }
      if (info.stopped) chip("stopped", "warn");
      else if (info.finish) chip("finish: " + info.finish, info.finish === "length" ? "warn" : "",
        info.finish === "length" ? "hit max_tokens (or the context)" : "");
      chip(info.endpoint);
      this.el.append(meta);
      scrollDown(false);
    }

    fail(message) {
      this.el.dataset.state = "error";
      this.endThinking();
      this.body.hidden = false;
      this.body.textContent = message;
    }
  }

  function countWords(text) {
    const words = text.trim().split(/\s+/);
    return words[0] ? words.length : 0;
  }

  function closeResult(form, note) {
    form.dataset.closed = "1";
    for (const el of form.elements) el.disabled = true;
    form.title = note;
  }

  function addUserMessage(text) {
    const msg = addMessage("user");
    msg.querySelector(".msg-body").textContent = text;
    return msg;
  }

  function addToolMessage(call, content) {
    const msg = addMessage("tool");
    msg.querySelector(".who").textContent = "tool result \u00b7 " + (call.name || "?");
    msg.dataset.toolCallId = callId(call);
    msg.querySelector(".msg-body").textContent = content;
    return msg;
  }

  // ---- requests --------------------------------------------------------------------------

  function numberField(id, integer) {
    const raw = $(id).value.trim();
    if (raw === "") return null;
    const v = Number(raw);
    if (!isFinite(v) || (integer && !Number.isInteger(v))) {
      throw new Error(id + ": " + raw + " is not a" + (integer ? "n integer" : " number"));
    }
    return v;
  }

  function samplingBody() {
    const body = {
      temperature: numberField("temperature", false),
      top_p: numberField("top-p", false),
      max_tokens: numberField("max-tokens", true),
      stream: true,
      stream_options: { include_usage: true },
    };
    const seed = numberField("seed", true);
    if (seed !== null) body.seed = seed;
    // the answer held to a JSON object by a grammar (docs/serving.md, Structured outputs)
    if ($("json-mode").checked) body.response_format = { type: "json_object" };
    for (const k of Object.keys(body)) if (body[k] === null) delete body[k];
    if (state.model) body.model = state.model;
    return body;
  }

  function chatRequest() {
    const body = samplingBody();
    const system = $("system").value.trim();
    body.messages = (system ? [{ role: "system", content: system }] : []).concat(state.history);
    if ($("logprobs").checked) {
      body.logprobs = true;
      body.top_logprobs = TOP_LOGPROBS;
    }
    const { tools, error } = parseTools($("tools").value);
    if (error) throw new Error("Tools: " + error); // send() checks first: not reached
    if (tools) {
      body.tools = tools;
      body.tool_choice = $("tool-choice").value;
    }
    return ["v1/chat/completions", body];
  }

  function completionRequest() {
    const body = samplingBody();
    const system = $("system").value.trim();
    const lines = state.history.map(
      (m) => (m.role === "user" ? "User: " : m.role === "tool" ? "Tool: " : "Assistant: ") +
        (m.content || ""),
    );
    body.prompt = (system ? system + "\n\n" : "") + lines.join("\n") + "\nAssistant:";
    body.stop = ["\nUser:", "\nAssistant:"];
    if ($("logprobs").checked) body.logprobs = TOP_LOGPROBS;
    return ["v1/completions", body];
  }

  function chatTokens(lp) {
    if (!lp || !lp.content) return [];
    return lp.content.map((e) => ({
      token: e.token,
      logprob: e.logprob,
      top: (e.top_logprobs || []).map((a) => ({ token: a.token, logprob: a.logprob })),
    }));
  }

  function completionTokens(lp) {
    if (!lp || !lp.tokens) return [];
    return lp.tokens.map((token, i) => ({
      token,
      logprob: lp.token_logprobs[i],
      top: Object.entries((lp.top_logprobs || [])[i] || {}).map(([t, v]) => ({ token: t, logprob: v })),
    }));
  }

  // POSTs one streaming request and feeds the view; resolves with what the turn needs.
  async function streamTurn(view, signal, mode) {
    const [url, body] = mode === "chat" ? chatRequest() : completionRequest();
    const t0 = performance.now();
    let ttft = null;
    const resp = await fetch(url, {
      method: "POST",
      headers: headers(true),
      body: JSON.stringify(body),
      signal,
    });
    if (!resp.ok) throw await apiError(resp);
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    let usage = null;
    let finish = null;
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
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message || "the request failed");
          if (chunk.usage) usage = chunk.usage;
          for (const c of chunk.choices || []) {
            if (c.index !== 0) continue;
            if (mode === "chat") {
              const d = c.delta || {};
              const toks = chatTokens(c.logprobs);
              const any = d.content || d.reasoning_content || d.reasoning ||
                (d.tool_calls && d.tool_calls.length) || toks.length;
              if (any && ttft === null) ttft = (performance.now() - t0) / 1000;
              view.delta(d, toks);
            } else {
              const text = c.text || "";
              const toks = completionTokens(c.logprobs);
              if (text || toks.length) {
                if (ttft === null) ttft = (performance.now() - t0) / 1000;
                view.delta({ content: text }, toks);
              }
            }
            if (c.finish_reason) finish = c.finish_reason;
          }
        }
      }
    }
    return {
      usage,
      finish,
      ttft,
      elapsed: (performance.now() - t0) / 1000,
      endpoint: "/" + url,
    };
  }

  function setBusy(busy) {
    state.busy = busy;
    $("send").disabled = busy;
    $("clear").disabled = busy;
    $("stop").hidden = !busy;
  }

  function showNoTemplate() {
    const n = $("notice");
    n.textContent = NO_TEMPLATE_NOTICE;
    n.hidden = false;
    $("endpoint").textContent = "POST /v1/completions, streaming (no chat template)";
  }

  // The Tools editor's state shown under it; false while its text is not a list of tools.
  function checkTools() {
    const { tools, error } = parseTools($("tools").value);
    const err = $("tools-error");
    err.hidden = !error;
    err.textContent = error || "";
    $("tools").setAttribute("aria-invalid", error ? "true" : "false");
    $("tools-summary").textContent = error
      ? ""
      : tools
        ? tools.length + (tools.length === 1 ? " tool: " : " tools: ") +
          tools.map((t) => t.function.name).join(", ")
        : "No tools: requests send none.";
    return !error;
  }

  function send(text) {
    if (state.busy || !text.trim()) return false;
    if (!checkTools()) {
      $("tools").focus();
      return false; // the inline error says why; nothing is sent
    }
    state.history.push({ role: "user", content: text });
    addUserMessage(text);
    runTurn(1);
    return true;
  }

  // One assistant turn on the history as it stands; `added`: how many messages the caller just
  // put at its end (the user's), taken back if the turn fails or is stopped before any output.
  async function runTurn(added) {
    for (const f of document.querySelectorAll(".tool-result:not([data-closed])")) {
      closeResult(f, "the conversation went on without this result");
    }
    const view = new AssistantView();
    const ctrl = new AbortController();
    state.abort = ctrl;
    setBusy(true);
    const takeBack = () => state.history.splice(state.history.length - added, added);
    try {
      let info;
      try {
        info = await streamTurn(view, ctrl.signal, state.mode);
      } catch (e) {
        if (state.mode === "chat" && e.status === 400 && /no chat template/i.test(e.message)) {
          state.mode = "completions";
          showNoTemplate();
          view.reset();
          info = await streamTurn(view, ctrl.signal, state.mode);
        } else {
          throw e;
        }
      }
      state.history.push(assistantMessage(view.turn));
      view.finish(info);
    } catch (e) {
      if (e.name === "AbortError") {
        const kept = view.text || view.turn.toolCalls.length;
        if (kept) state.history.push(assistantMessage(view.turn));
        else takeBack();
        view.finish({ usage: null, finish: null, ttft: null, elapsed: 0, stopped: true,
          endpoint: state.mode === "chat" ? "/v1/chat/completions" : "/v1/completions" });
      } else {
        takeBack(); // the turn did not happen: it is not sent again
        view.fail(e.message);
        if (e.status === 401) connect();
      }
    } finally {
      state.abort = null;
      setBusy(false);
      pollMemory();
      $("input").focus();
    }
  }

  // ---- tooltip ---------------------------------------------------------------------------

  function tooltipFor(toks) {
    const tip = $("tooltip");
    tip.textContent = "";
    toks.slice(0, 4).forEach((t, k) => {
      if (k) {
        const sep = document.createElement("div");
        sep.className = "tt-sep";
        tip.append(sep);
      }
      const head = document.createElement("div");
      head.className = "tt-head";
      const tok = document.createElement("span");
      tok.className = "tt-tok";
      tok.textContent = visible(t.token);
      const p = document.createElement("span");
      p.className = "tt-p";
      p.textContent = (100 * Math.exp(t.logprob)).toFixed(1) + "%  \u00b7  logprob " +
        t.logprob.toFixed(3);
      head.append(tok, p);
      tip.append(head);
      if (t.top.length) {
        const sub = document.createElement("div");
        sub.className = "tt-sub";
        sub.textContent = "top " + t.top.length + " alternatives (before temperature / top_p)";
        tip.append(sub);
        let chosenShown = false;
        for (const a of [...t.top].sort((x, y) => y.logprob - x.logprob)) {
          const row = document.createElement("div");
          row.className = "alt";
          if (a.token === t.token && !chosenShown) {
            row.classList.add("chosen");
            chosenShown = true;
          }
          const name = document.createElement("div");
          name.className = "alt-tok";
          const fill = document.createElement("i");
          fill.className = "alt-fill";
          fill.style.width = (100 * Math.exp(a.logprob)).toFixed(1) + "%";
          const label = document.createElement("span");
          label.textContent = visible(a.token);
          name.append(fill, label);
          const pr = document.createElement("div");
          pr.className = "alt-p";
          pr.textContent = (100 * Math.exp(a.logprob)).toFixed(1) + "%";
          row.append(name, pr);
          tip.append(row);
        }
        if (!chosenShown) {
          const note = document.createElement("div");
          note.className = "tt-sub";
          note.textContent = "the sampled token is not among them";
          tip.append(note);
        }
      }
    });
    if (toks.length > 4) {
      const more = document.createElement("div");
      more.className = "tt-sub";
      more.textContent = "+ " + (toks.length - 4) + " more tokens";
      tip.append(more);
    }
  }

  function showTooltip(el) {
    const tip = $("tooltip");
    tooltipFor(el.toks);
    tip.hidden = false;
    const r = el.getBoundingClientRect();
    const tw = tip.offsetWidth;
    const th = tip.offsetHeight;
    let left = Math.min(r.left, window.innerWidth - tw - 8);
    let top = r.bottom + 6;
    if (top + th > window.innerHeight - 8) top = r.top - th - 6;
    tip.style.left = Math.max(8, left) + "px";
    tip.style.top = Math.max(8, top) + "px";
    el.classList.add("active");
  }

  function hideTooltip(el) {
    $("tooltip").hidden = true;
    if (el) el.classList.remove("active");
  }

  // ---- wiring ----------------------------------------------------------------------------

  function linkSlider(rangeId, numberId) {
    const range = $(rangeId);
    const num = $(numberId);
    range.addEventListener("input", () => (num.value = range.value));
    num.addEventListener("input", () => (range.value = num.value));
  }

  function init() {
    $("api-key").value = state.apiKey;
    $("key-form").addEventListener("submit", (e) => {
      e.preventDefault();
      saveKey();
    });
    linkSlider("temperature-range", "temperature");
    linkSlider("top-p-range", "top-p");
    $("shade").addEventListener("change", () => {
      for (const b of document.querySelectorAll(".msg.assistant .msg-body")) {
        b.classList.toggle("shade", $("shade").checked);
      }
    });
    $("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      const text = $("input").value;
      if (!text.trim() || state.busy) return;
      if (send(text)) $("input").value = "";
    });
    $("input").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        $("composer").requestSubmit();
      }
    });
    $("stop").addEventListener("click", () => state.abort && state.abort.abort());
    $("clear").addEventListener("click", () => {
      if (state.busy) return;
      state.history = [];
      for (const m of document.querySelectorAll("#messages .msg")) m.remove();
      $("empty-state").hidden = false;
      $("input").focus();
    });
    $("tools").addEventListener("input", checkTools);
    $("tools-example").addEventListener("click", () => {
      $("tools").value = JSON.stringify(EXAMPLE_TOOLS, null, 2);
      checkTools();
    });
    checkTools();
    for (const b of document.querySelectorAll(".suggestion")) {
      b.addEventListener("click", () => send(b.textContent));
    }
    const transcript = $("transcript");
    transcript.addEventListener("mouseover", (e) => {
      const el = e.target.closest && e.target.closest(".tok");
      if (el && el.toks) showTooltip(el);
    });
    transcript.addEventListener("mouseout", (e) => {
      const el = e.target.closest && e.target.closest(".tok");
      if (el) hideTooltip(el);
    });
    transcript.addEventListener("scroll", () => hideTooltip(document.querySelector(".tok.active")));
    document.addEventListener("visibilitychange", () => document.hidden || pollMemory());
    window.addEventListener("resize", drawSpark);
    connect().then(pollMemory);
    setInterval(pollMemory, POLL_MS);
    $("input").focus();
  }

  // For tests and the console: the page's pure parts.
  window.swaservePlayground = Object.freeze({
    applyDelta, emptyTurn, assistantMessage, formatArgs, parseTools,
  });
  init();
})();

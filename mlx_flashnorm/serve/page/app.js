// The chat page of `python -m mlx_flashnorm.server`: plain JavaScript, no dependencies.
// Conversations and settings live in this browser's localStorage; answers stream from
// POST v1/chat/completions (server-sent events read from fetch's body), and Stop aborts the
// request, which closes the connection: the server then drops the request.
"use strict";

(() => {
  const STORE = "mlx-flashnorm.chat";
  const KEY = "mlx-flashnorm.api-key";
  const DEFAULTS = {system: "", temperature: "0.7", maxTokens: "512"};
  const $ = (id) => document.getElementById(id);

  let state = restore();
  let running = null; // {controller, reply, view}: the answer streaming now
  let retryAfterKey = false; // a message waits for the API key

  function restore() {
    let saved = null;
    try {
      saved = JSON.parse(localStorage.getItem(STORE));
    } catch (e) {
      saved = null;
    }
    if (!saved || !Array.isArray(saved.conversations)) {
      saved = {conversations: [], current: null, settings: {}};
    }
    saved.settings = Object.assign({}, DEFAULTS, saved.settings);
    return saved;
  }

  function save() {
    try {
      localStorage.setItem(STORE, JSON.stringify(state));
    } catch (e) {
      showError("this browser did not keep the conversation: " + e.message);
    }
  }

  function current() {
    return state.conversations.find((c) => c.id === state.current) || null;
  }

  function startConversation() {
    const conversation = {id: Date.now().toString(36) + Math.random().toString(36).slice(2, 6),
                          title: "New chat", messages: []};
    state.conversations.unshift(conversation);
    state.current = conversation.id;
    return conversation;
  }

  // --- the server -------------------------------------------------------------------------

  function headers() {
    const h = {"Content-Type": "application/json"};
    const key = localStorage.getItem(KEY);
    if (key) {
      h.Authorization = "Bearer " + key;
    }
    return h;
  }

  async function errorMessage(response) {
    try {
      const body = await response.json();
      if (body && body.error && body.error.message) {
        return body.error.message;
      }
    } catch (e) {
      // not JSON: the status says it
    }
    return `the server answered ${response.status} ${response.statusText}`;
  }

  function askForKey() {
    const refused = Boolean(localStorage.getItem(KEY));
    $("key-note").textContent = refused
      ? "The server refused this API key: enter the one it was started with (--api-key)."
      : "This server needs its API key (--api-key).";
    $("key-form").hidden = false;
    $("api-key").value = "";
    $("api-key").focus();
  }

  async function loadModel() {
    let response;
    try {
      response = await fetch("v1/models", {headers: headers()});
    } catch (e) {
      showError("cannot reach the server: " + e.message);
      return false;
    }
    if (response.status === 401) {
      $("model-name").textContent = "(API key needed)";
      askForKey();
      return false;
    }
    if (!response.ok) {
      showError(await errorMessage(response));
      return false;
    }
    const body = await response.json();
    const model = body.data && body.data[0];
    $("model-name").textContent = model ? model.id : "(no model)";
    return true;
  }

  // The data of each server-sent event of a stream, handed to onData; returns at [DONE].
  async function readEvents(stream, onData) {
    const reader = stream.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) {
        return;
      }
      buffer += decoder.decode(value, {stream: true}).replace(/\r\n/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const lines = buffer.slice(0, end).split("\n");
        buffer = buffer.slice(end + 2);
        const data = lines.filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).trim()).join("\n");
        if (data === "[DONE]") {
          reader.cancel().catch(() => {});
          return;
        }
        if (data) {
          onData(JSON.parse(data));
        }
      }
    }
  }

  function requestBody(conversation) {
    const messages = [];
    const s = state.settings;
    if (s.system.trim()) {
      messages.push({role: "system", content: s.system});
    }
    for (const m of conversation.messages) {
      messages.push({role: m.role, content: m.content});
    }
    const body = {messages, stream: true, stream_options: {include_usage: true}};
    if (String(s.temperature).trim() !== "") {
      body.temperature = Number(s.temperature);
    }
    if (String(s.maxTokens).trim() !== "") {
      body.max_tokens = Number(s.maxTokens);
    }
    return body;
  }

  // Stream an answer to the conversation, which ends with the user's message.
  async function answer(conversation) {
    const body = requestBody(conversation);
    const reply = {role: "assistant", content: ""};
    conversation.messages.push(reply);
    render();
    const controller = new AbortController();
    running = {controller, reply, view: $("messages").lastElementChild};
    showRunning(true);
    let first = null; // when the first text came
    try {
      const response = await fetch("v1/chat/completions", {
        method: "POST", headers: headers(), body: JSON.stringify(body),
        signal: controller.signal});
      if (!response.ok) {
        conversation.messages.pop(); // no answer: the user's message waits
        if (response.status === 401) {
          retryAfterKey = true;
          askForKey();
        } else {
          showError(await errorMessage(response));
        }
        return;
      }
      await readEvents(response.body, (data) => {
        if (data.error) {
          throw new Error(data.error.message || "the server failed");
        }
        if (data.usage) {
          reply.tokens = data.usage.completion_tokens;
        }
        const choice = data.choices && data.choices[0];
        if (!choice) {
          return;
        }
        if (choice.delta && choice.delta.content) {
          first = first === null ? performance.now() : first;
          reply.content += choice.delta.content;
          showReply();
        }
        if (choice.finish_reason) {
          reply.finish = choice.finish_reason;
        }
      });
      if (reply.tokens && first !== null) {
        const seconds = (performance.now() - first) / 1000;
        reply.speed = reply.tokens > 1 && seconds > 0 ? (reply.tokens - 1) / seconds : null;
      }
    } catch (e) {
      if (e.name === "AbortError") {
        reply.finish = "stopped";
      } else {
        controller.abort();
        reply.finish = "error";
        showError(e.message);
      }
    } finally {
      running = null;
      showRunning(false);
      save();
      render();
    }
  }

  // --- the page ---------------------------------------------------------------------------

  function showError(message) {
    $("error").textContent = message;
    $("error").hidden = false;
  }

  function hideError() {
    $("error").hidden = true;
    $("error").textContent = "";
  }

  function showRunning(on) {
    $("send").hidden = on;
    $("stop").hidden = !on;
    $("new-chat").disabled = on;
    for (const b of document.querySelectorAll("#conversations button")) {
      b.disabled = on;
    }
  }

  function note(m) {
    const parts = [];
    if (m.finish === "stopped") {
      parts.push("stopped");
    } else if (m.finish === "length") {
      parts.push("cut at max tokens");
    } else if (m.finish === "error") {
      parts.push("failed");
    }
    if (m.tokens) {
      parts.push(`${m.tokens} tokens`);
    }
    if (m.speed) {
      parts.push(`${m.speed.toFixed(1)} tokens/s`);
    }
    return parts.join(" · ");
  }

  function messageView(m) {
    const view = document.createElement("div");
    view.className = "message " + m.role;
    const text = document.createElement("div");
    text.className = "content";
    text.textContent = m.content;
    view.append(text);
    const meta = document.createElement("div");
    meta.className = "meta";
    meta.textContent = note(m);
    view.append(meta);
    return view;
  }

  function nearBottom(box) {
    return box.scrollHeight - box.scrollTop - box.clientHeight < 80;
  }

  function showReply() {
    const box = $("messages");
    const follow = nearBottom(box);
    running.view.querySelector(".content").textContent = running.reply.content;
    if (follow) {
      box.scrollTop = box.scrollHeight;
    }
  }

  function render() {
    const list = $("conversations");
    list.replaceChildren();
    for (const c of state.conversations) {
      const item = document.createElement("li");
      item.classList.toggle("current", c.id === state.current);
      const open = document.createElement("button");
      open.type = "button";
      open.className = "open";
      open.textContent = c.title;
      open.title = c.title;
      open.disabled = Boolean(running);
      open.addEventListener("click", () => {
        state.current = c.id;
        save();
        render();
      });
      const remove = document.createElement("button");
      remove.type = "button";
      remove.className = "delete";
      remove.textContent = "×";
      remove.title = "delete this conversation";
      remove.disabled = Boolean(running);
      remove.addEventListener("click", () => {
        state.conversations = state.conversations.filter((x) => x.id !== c.id);
        if (state.current === c.id) {
          state.current = state.conversations.length ? state.conversations[0].id : null;
        }
        save();
        render();
      });
      item.append(open, remove);
      list.append(item);
    }
    const box = $("messages");
    box.replaceChildren();
    const conversation = current();
    if (!conversation || !conversation.messages.length) {
      const empty = document.createElement("p");
      empty.className = "empty";
      empty.textContent = "Start a conversation below.";
      box.append(empty);
      return;
    }
    for (const m of conversation.messages) {
      box.append(messageView(m));
    }
    box.scrollTop = box.scrollHeight;
  }

  function send() {
    if (running) {
      return;
    }
    const text = $("prompt").value.trim();
    let conversation = current();
    const last = conversation && conversation.messages[conversation.messages.length - 1];
    if (!text && !(last && last.role === "user")) {
      return; // (an empty send asks again for a message left unanswered)
    }
    hideError();
    if (text) {
      conversation = conversation || startConversation();
      if (!conversation.messages.length) {
        conversation.title = text.length > 40 ? text.slice(0, 40) + "..." : text;
      }
      conversation.messages.push({role: "user", content: text});
      $("prompt").value = "";
      save();
    }
    answer(conversation);
  }

  function bindSetting(id, name) {
    const input = $(id);
    input.value = state.settings[name];
    input.addEventListener("input", () => {
      state.settings[name] = input.value;
      save();
    });
  }

  function start() {
    bindSetting("system-prompt", "system");
    bindSetting("temperature", "temperature");
    bindSetting("max-tokens", "maxTokens");
    $("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      send();
    });
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        send();
      }
    });
    $("stop").addEventListener("click", () => running && running.controller.abort());
    $("new-chat").addEventListener("click", () => {
      const c = current();
      if (!c || c.messages.length) {
        startConversation();
      }
      save();
      render();
      $("prompt").focus();
    });
    $("error").addEventListener("click", hideError);
    $("change-key").addEventListener("click", () => {
      $("key-note").textContent = "The API key this page sends (empty: none).";
      $("key-form").hidden = false;
      $("api-key").value = localStorage.getItem(KEY) || "";
      $("api-key").focus();
    });
    $("key-form").addEventListener("submit", async (e) => {
      e.preventDefault();
      const key = $("api-key").value.trim();
      if (key) {
        localStorage.setItem(KEY, key);
      } else {
        localStorage.removeItem(KEY);
      }
      $("key-form").hidden = true;
      hideError();
      if (await loadModel() && retryAfterKey) {
        retryAfterKey = false;
        send();
      }
    });
    window.addEventListener("pagehide", () => {
      if (running) { // a reload or a closed tab ends the answer: keep what came
        running.reply.finish = "stopped";
      }
      save();
    });
    render();
    loadModel();
  }

  start();
})();

// The Chat tab: a conversation streamed from /v1/chat/completions.

import { ApiError, asCurl, copyText, streamEvents } from "./api.js";

const PATH = "v1/chat/completions";
const $ = (id) => document.getElementById(id);

export class Chat {
  constructor({ onUnauthorized }) {
    this.history = []; // the conversation's messages as the API takes them (no system prompt)
    this.controller = null;
    this.onUnauthorized = onUnauthorized;
    $("composer").addEventListener("submit", (event) => {
      event.preventDefault();
      this.send();
    });
    $("prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        this.send();
      }
    });
    $("stop").addEventListener("click", () => this.controller?.abort());
    $("new-chat").addEventListener("click", () => this.clear());
    $("copy-curl").addEventListener("click", () => copyText($("curl").textContent));
  }

  setModels(ids) {
    const select = $("model");
    const chosen = select.value;
    select.replaceChildren(...ids.map((id) => new Option(id, id)));
    if (ids.includes(chosen)) select.value = chosen;
  }

  clear() {
    this.controller?.abort();
    this.history = [];
    $("messages").replaceChildren();
    $("prompt").focus();
  }

  async send() {
    const prompt = $("prompt");
    const text = prompt.value.trim();
    if (!text || this.controller) return;
    let body;
    try {
      body = this.request([...this.history, { role: "user", content: text }]);
    } catch (error) {
      return showSettingsError(error.message);
    }
    showSettingsError("");
    prompt.value = "";
    this.history.push({ role: "user", content: text });
    appendMessage("user").content.textContent = text;
    $("curl").textContent = asCurl(PATH, body);
    await this.stream(body, new Answer(appendMessage("assistant")));
  }

  /** The request body from the settings; a malformed JSON box is an error here, not a 400. */
  request(messages) {
    const form = new FormData($("settings"));
    const system = form.get("system").trim();
    const body = {
      model: form.get("model"),
      messages: system ? [{ role: "system", content: system }, ...messages] : messages,
      stream: true,
      stream_options: { include_usage: true },
    };
    for (const name of ["temperature", "top_p"]) numberField(body, form, name, Number.parseFloat);
    for (const name of ["top_k", "max_tokens", "seed"]) numberField(body, form, name, (v) => Number.parseInt(v, 10));
    const schema = jsonField(form, "json_schema", "JSON schema");
    if (schema !== undefined) {
      const name = typeof schema.title === "string" && /^[\w-]{1,64}$/.test(schema.title) ? schema.title : "answer";
      body.response_format = { type: "json_schema", json_schema: { name, schema, strict: true } };
    }
    const tools = jsonField(form, "tools", "Tools");
    if (tools !== undefined) {
      if (!Array.isArray(tools)) throw new Error("Tools: an array of tools, as OpenAI's `tools` field takes");
      body.tools = tools;
      body.tool_choice = form.get("tool_choice");
    }
    return body;
  }

  async stream(body, answer) {
    const history = this.history; // "New chat" during the stream starts another
    this.controller = new AbortController();
    setBusy(true);
    try {
      for await (const event of streamEvents(PATH, body, this.controller.signal)) answer.add(event);
      answer.finish();
    } catch (error) {
      if (error.name === "AbortError") answer.finish({ stopped: true });
      else {
        answer.fail(error);
        if (!answer.message()) history.pop(); // the turn failed: it is not part of the conversation
        if (error instanceof ApiError && error.status === 401) this.onUnauthorized(error);
      }
    } finally {
      this.controller = null;
      setBusy(false);
      const message = answer.message();
      if (message) history.push(message);
    }
  }
}

/** One assistant answer as its chunks arrive: reasoning, content, tool calls, usage. */
class Answer {
  constructor(view) {
    this.view = view;
    this.started = performance.now();
    this.firstToken = null;
    this.content = "";
    this.reasoning = "";
    this.toolCalls = [];
    this.usage = null;
    this.finishReason = null;
  }

  add(event) {
    if (event.usage) this.usage = event.usage;
    const choice = event.choices?.[0];
    if (!choice) return;
    const delta = choice.delta || {};
    if (choice.finish_reason) this.finishReason = choice.finish_reason;
    if (!delta.content && !delta.reasoning_content && !delta.tool_calls) return;
    this.firstToken ??= performance.now();
    if (delta.reasoning_content) {
      this.reasoning += delta.reasoning_content;
      this.view.reasoning.hidden = false;
      this.view.reasoningText.textContent = this.reasoning;
    }
    if (delta.content) {
      this.content += delta.content;
      this.view.content.textContent = this.content;
    }
    for (const call of delta.tool_calls || []) this.addToolCall(call);
    this.view.item.scrollIntoView({ block: "end" });
  }

  addToolCall(part) {
    const call = (this.toolCalls[part.index ?? this.toolCalls.length] ??= {
      id: part.id, type: "function", function: { name: "", arguments: "" },
    });
    if (part.id) call.id = part.id;
    call.function.name += part.function?.name || "";
    call.function.arguments += part.function?.arguments || "";
    this.view.tools.replaceChildren(...this.toolCalls.map(toolCallView));
  }

  finish({ stopped = false } = {}) {
    const ended = performance.now();
    this.view.item.classList.toggle("stopped", stopped);
    this.view.item.dataset.finish = stopped ? "stopped" : this.finishReason || "";
    this.view.usage.textContent = usageLine(this.usage, this.started, this.firstToken, ended, this.finishReason);
    const copy = Object.assign(document.createElement("button"), { type: "button", className: "small secondary", textContent: "Copy" });
    copy.addEventListener("click", () => copyText(this.content || JSON.stringify(this.toolCalls, null, 2)));
    this.view.actions.append(copy);
  }

  fail(error) {
    this.view.item.dataset.finish = "error";
    const line = Object.assign(document.createElement("p"), { className: "error" });
    line.setAttribute("role", "alert");
    line.textContent = error instanceof ApiError ? `Error ${error.status}: ${error.message}` : `Error: ${error.message}`;
    this.view.item.append(line);
  }

  /** What the conversation keeps of this answer (a stopped answer's text so far included). */
  message() {
    if (!this.content && !this.toolCalls.length) return null;
    const message = { role: "assistant", content: this.content };
    if (this.toolCalls.length) message.tool_calls = this.toolCalls;
    return message;
  }
}

function usageLine(usage, started, firstToken, ended, finishReason) {
  const parts = [];
  if (usage) {
    const cached = usage.prompt_tokens_details?.cached_tokens ?? 0;
    const reasoning = usage.completion_tokens_details?.reasoning_tokens;
    const completion = `${usage.completion_tokens} completion tokens${reasoning ? ` (${reasoning} reasoning)` : ""}`;
    parts.push(`${usage.prompt_tokens} prompt (${cached} cached)`, completion);
  }
  if (firstToken !== null) {
    parts.push(`first token ${((firstToken - started) / 1000).toFixed(2)} s`);
    const tokens = usage?.completion_tokens;
    const seconds = (ended - firstToken) / 1000;
    if (tokens > 1 && seconds > 0) parts.push(`${((tokens - 1) / seconds).toFixed(1)} tokens/s`);
  }
  if (finishReason) parts.push(`finish: ${finishReason}`);
  return parts.join(" · ");
}

function toolCallView(call) {
  const view = Object.assign(document.createElement("div"), { className: "tool-call" });
  view.textContent = `${call.function.name}(${call.function.arguments})`;
  view.title = call.id ? `tool call ${call.id}` : "tool call";
  return view;
}

function appendMessage(role) {
  const item = Object.assign(document.createElement("li"), { className: `message ${role}` });
  const label = Object.assign(document.createElement("div"), { className: "role", textContent: role });
  const reasoning = Object.assign(document.createElement("details"), { className: "reasoning", hidden: true });
  const summary = Object.assign(document.createElement("summary"), { textContent: "Reasoning" });
  const reasoningText = document.createElement("div");
  reasoning.append(summary, reasoningText);
  const content = Object.assign(document.createElement("div"), { className: "content" });
  const tools = Object.assign(document.createElement("div"), { className: "tools" });
  const usage = Object.assign(document.createElement("div"), { className: "usage" });
  const actions = Object.assign(document.createElement("div"), { className: "actions" });
  item.append(label, reasoning, content, tools, usage, actions);
  $("messages").append(item);
  item.scrollIntoView({ block: "end" });
  return { item, reasoning, reasoningText, content, tools, usage, actions };
}

function numberField(body, form, name, parse) {
  const raw = String(form.get(name) ?? "").trim();
  if (!raw) return;
  const value = parse(raw);
  if (!Number.isFinite(value)) throw new Error(`${name}: not a number`);
  body[name] = value;
}

function jsonField(form, name, label) {
  const raw = String(form.get(name) ?? "").trim();
  if (!raw) return undefined;
  try {
    return JSON.parse(raw);
  } catch (error) {
    throw new Error(`${label}: not valid JSON (${error.message})`);
  }
}

function showSettingsError(text) {
  const box = $("settings-error");
  box.textContent = text;
  box.hidden = !text;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

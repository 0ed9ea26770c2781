// The public API as any client speaks it: the key as a Bearer token, errors in the API's
// own shape, and server-sent events read from a POST's body. Paths are relative to the
// page, so the page works under a proxy's prefix too.

const KEY_ITEM = "llm-playground-api-key";

export function apiKey() {
  return sessionStorage.getItem(KEY_ITEM) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY_ITEM, key);
  else sessionStorage.removeItem(KEY_ITEM);
}

export function absolute(path) {
  return new URL(path, document.baseURI).href;
}

function headers(json) {
  const result = json ? { "Content-Type": "application/json" } : {};
  const key = apiKey();
  if (key) result.Authorization = `Bearer ${key}`;
  return result;
}

/** An error the API answered: its HTTP status and its body's error object. */
export class ApiError extends Error {
  constructor(status, error) {
    super(error?.message || `HTTP ${status}`);
    this.status = status;
    this.error = error || {};
  }
}

async function refusal(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    return new ApiError(response.status, body.error ?? { message: body.detail ?? text });
  } catch {
    return new ApiError(response.status, { message: text || response.statusText });
  }
}

export async function getJson(path) {
  const response = await fetch(path, { headers: headers(false) });
  if (!response.ok) throw await refusal(response);
  return response.json();
}

export async function getText(path) {
  const response = await fetch(path, { headers: headers(false), cache: "no-store" });
  if (!response.ok) throw await refusal(response);
  return response.text();
}

/** Each event's JSON of a streamed POST; an error event mid-stream is thrown as ApiError. */
export async function* streamEvents(path, body, signal) {
  const response = await fetch(path, { method: "POST", headers: headers(true), body: JSON.stringify(body), signal });
  if (!response.ok) throw await refusal(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let pending = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    pending += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = pending.indexOf("\n\n")) >= 0) {
      const data = eventData(pending.slice(0, end));
      pending = pending.slice(end + 2);
      if (data === null) continue; // a comment: the server's keep-alive
      if (data === "[DONE]") return;
      const event = JSON.parse(data);
      if (event.error) throw new ApiError(event.error.code || 500, event.error);
      yield event;
    }
  }
}

function eventData(block) {
  const lines = block.split("\n").filter((line) => line.startsWith("data:"));
  return lines.length ? lines.map((line) => line.slice(5).replace(/^ /, "")).join("\n") : null;
}

/** The request as a curl command to paste into a shell (the key as $API_KEY, not its value). */
export function asCurl(path, body) {
  const quote = (text) => `'${text.replaceAll("'", "'\\''")}'`;
  const parts = [`curl -N ${quote(absolute(path))}`, `-H 'Content-Type: application/json'`];
  if (apiKey()) parts.push(`-H "Authorization: Bearer $API_KEY"`);
  parts.push(`-d ${quote(JSON.stringify(body, null, 2))}`);
  return parts.join(" \\\n  ");
}

export async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    await navigator.clipboard.writeText(text);
    return;
  }
  const area = Object.assign(document.createElement("textarea"), { value: text });
  document.body.append(area);
  area.select();
  document.execCommand("copy");
  area.remove();
}

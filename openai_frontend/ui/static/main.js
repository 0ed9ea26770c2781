// The page: its two tabs, the API key (asked for when /v1/models answers 401) and the
// served models (/v1/models: the base model and any LoRA adapters).

import { ApiError, apiKey, getJson, setApiKey } from "./api.js";
import { Chat } from "./chat.js";
import { Engine } from "./engine.js";

const $ = (id) => document.getElementById(id);
const chat = new Chat({ onUnauthorized: (error) => askForKey(error.message) });
const engine = new Engine();

function selectTab(tab) {
  for (const other of document.querySelectorAll("[role=tab]")) {
    const selected = other === tab;
    other.setAttribute("aria-selected", String(selected));
    other.tabIndex = selected ? 0 : -1;
    $(other.getAttribute("aria-controls")).hidden = !selected;
  }
  engine.show(tab.id === "tab-engine");
  history.replaceState(null, "", tab.id === "tab-engine" ? "#engine" : "#chat");
}

function setUpTabs() {
  const tabs = [...document.querySelectorAll("[role=tab]")];
  for (const tab of tabs) {
    tab.addEventListener("click", () => selectTab(tab));
    tab.addEventListener("keydown", (event) => {
      const step = { ArrowRight: 1, ArrowLeft: -1 }[event.key];
      if (!step) return;
      const next = tabs[(tabs.indexOf(tab) + step + tabs.length) % tabs.length];
      next.focus();
      selectTab(next);
    });
  }
  if (location.hash === "#engine") selectTab($("tab-engine"));
}

/** /v1/models; a 401 asks for a key (again, with the API's message, after a wrong one). */
async function loadModels() {
  const state = $("server-state");
  try {
    const listing = await getJson("v1/models");
    const ids = listing.data.map((model) => model.id);
    chat.setModels(ids);
    state.textContent = `${ids[0] ?? "no model"}${ids.length > 1 ? ` and ${ids.length - 1} more` : ""}`;
    return true;
  } catch (error) {
    if (error instanceof ApiError && error.status === 401) {
      $("key-button").hidden = false;
      askForKey(apiKey() ? error.message : "");
    } else {
      state.textContent = `The server did not answer: ${error.message}`;
    }
    return false;
  }
}

function askForKey(message) {
  const dialog = $("key-dialog");
  $("key-error").textContent = message;
  $("key-error").hidden = !message;
  $("key-input").value = apiKey();
  if (!dialog.open) dialog.showModal();
  $("key-input").focus();
}

function setUpKeyDialog() {
  $("key-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    setApiKey($("key-input").value.trim());
    $("key-dialog").close();
    if (await loadModels()) $("prompt").focus();
  });
  $("key-cancel").addEventListener("click", () => $("key-dialog").close());
  $("key-button").addEventListener("click", () => askForKey(""));
}

setUpTabs();
setUpKeyDialog();
engine.start();
loadModels();

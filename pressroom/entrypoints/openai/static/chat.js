// The chat page: a client of the server's own OpenAI API, like any other (no build step, nothing fetched
// from elsewhere). Model output is only ever set as textContent, never parsed as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const turns = [];  // the conversation sent with each request: {role, content}, the system prompt apart
let controller = null;  // aborts the answer being streamed (Stop, New chat)
const cards = new Map();  // model id -> its /v1/models entry (input_modalities: whether it takes images)
let images = [];  // the images attached to the next message: {name, url}, url a data URL

function headers() {
  const key = $("api-key").value.trim();
  return key ? { "Content-Type": "application/json", Authorization: `Bearer ${key}` }
    : { "Content-Type": "application/json" };
}

function setStatus(text, isError = false) {
  $("status").textContent = text;
  $("status").classList.toggle("error", isError);
}

async function errorMessage(response) {
  try {
    return (await response.json()).error.message;  // the server's errors are OpenAI-shaped
  } catch {
    return `HTTP ${response.status}`;
  }
}

async function loadModels() {
  const response = await fetch("v1/models", { headers: headers() });
  if (response.status === 401) {
    setStatus("This server needs an API key: enter it in the API key field.", true);
    $("api-key").focus();
    return;
  }
  if (!response.ok) {
    setStatus(await errorMessage(response), true);
    return;
  }
  const models = (await response.json()).data;
  cards.clear();
  for (const m of models) cards.set(m.id, m);
  $("model").replaceChildren(...models.map((m) => new Option(m.id, m.id)));
  offerImages();
  setStatus("");
}

// ---- images: picked or pasted, sent as image_url parts (data URLs) to a model that takes them ----

function takesImages() {
  return cards.get($("model").value)?.input_modalities?.includes("image") ?? false;
}

function offerImages() {
  $("attach").hidden = !takesImages();
  if (!takesImages()) setImages([]);
}

function setImages(list) {
  images = list;
  $("attachments").replaceChildren(...images.map((image) => {
    const item = document.createElement("li");
    item.textContent = image.name;
    const remove = Object.assign(document.createElement("button"), { type: "button", textContent: "×" });
    remove.setAttribute("aria-label", `Remove ${image.name}`);
    remove.addEventListener("click", () => setImages(images.filter((i) => i !== image)));
    item.append(remove);
    return item;
  }));
}

function dataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function attach(files) {
  const picked = [...files].filter((f) => f.type.startsWith("image/"));
  if (!picked.length) return;
  if (!takesImages()) {
    setStatus("This model takes no images.", true);
    return;
  }
  const urls = await Promise.all(picked.map(dataUrl));
  setImages([...images, ...picked.map((f, i) => ({ name: f.name || "pasted image", url: urls[i] }))]);
}

function pasteImages(event) {
  const files = [...(event.clipboardData?.files ?? [])].filter((f) => f.type.startsWith("image/"));
  if (!files.length || !takesImages()) return;  // text pastes as usual
  event.preventDefault();
  attach(files).catch((error) => setStatus(error.message, true));
}

function userContent(text, attached) {
  if (!attached.length) return text;
  const parts = attached.map((image) => ({ type: "image_url", image_url: { url: image.url } }));
  return text ? [...parts, { type: "text", text }] : parts;
}

function addMessage(role, text, imageNames = []) {
  const item = document.createElement("li");
  item.className = `message ${role}`;
  const who = document.createElement("span");
  who.className = "role";
  who.textContent = role === "user" ? "You" : "Assistant";
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  item.append(who);
  if (imageNames.length) {
    const shown = document.createElement("div");
    shown.className = "images";
    shown.append(...imageNames.map((name) => Object.assign(document.createElement("span"), { textContent: name })));
    item.append(shown);
  }
  item.append(content);
  $("log").append(item);
  item.scrollIntoView({ block: "end" });
  return item;
}

function chatRequest() {
  const system = $("system").value.trim();
  const body = { messages: system ? [{ role: "system", content: system }, ...turns] : [...turns], stream: true };
  if ($("model").value) body.model = $("model").value;
  // An empty field leaves the server's default
  if (!Number.isNaN($("temperature").valueAsNumber)) body.temperature = $("temperature").valueAsNumber;
  if (!Number.isNaN($("max-tokens").valueAsNumber)) body.max_tokens = $("max-tokens").valueAsNumber;
  return body;
}

// The payloads of a response's server-sent events, as they arrive
async function* eventData(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    const events = buffer.split("\n\n");
    buffer = events.pop();  // an event not yet complete
    for (const event of events) {
      for (const line of event.split("\n")) {
        if (line.startsWith("data:")) yield line.slice(5).trimStart();
      }
    }
  }
}

async function streamAnswer(item, signal) {
  const response = await fetch("v1/chat/completions", {
    method: "POST", headers: headers(), body: JSON.stringify(chatRequest()), signal,
  });
  if (!response.ok) throw new Error(await errorMessage(response));
  const content = item.querySelector(".content");
  let reasoning = null;
  for await (const data of eventData(response)) {
    if (data === "[DONE]") break;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new Error(chunk.error.message);  // a stream that failed midway
    const delta = chunk.choices[0]?.delta ?? {};
    if (delta.reasoning) {  // a reasoning model's thinking: shown, but not sent back
      reasoning ??= item.insertBefore(Object.assign(document.createElement("div"), { className: "reasoning" }),
        content);
      reasoning.textContent += delta.reasoning;
    }
    if (delta.content) content.textContent += delta.content;
  }
  return content.textContent;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("log").setAttribute("aria-busy", String(busy));
}

async function send(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  const attached = images;
  if ((!text && !attached.length) || controller) return;
  $("prompt").value = "";
  setImages([]);
  turns.push({ role: "user", content: userContent(text, attached) });
  const asked = addMessage("user", text, attached.map((image) => image.name));
  const item = addMessage("assistant", "");
  controller = new AbortController();
  setBusy(true);
  setStatus("");
  try {
    turns.push({ role: "assistant", content: await streamAnswer(item, controller.signal) });
  } catch (error) {
    if (!item.isConnected) return;  // New chat cleared the conversation while this answer streamed
    const partial = item.querySelector(".content").textContent;
    if (error.name === "AbortError" && partial) {  // stopped: the partial answer stays in the conversation
      item.classList.add("stopped");
      turns.push({ role: "assistant", content: partial });
    } else {  // nothing to keep: the turn is taken back and the message returned to the box to retry
      turns.pop();
      asked.remove();
      item.remove();
      $("prompt").value = text;
      setImages(attached);
      if (error.name !== "AbortError") setStatus(error.message, true);
    }
  } finally {
    controller = null;
    setBusy(false);
    item.scrollIntoView({ block: "end" });
  }
}

function newChat() {
  controller?.abort();
  turns.length = 0;
  setImages([]);
  $("log").replaceChildren();
  $("prompt").focus();
}

$("composer").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("composer").requestSubmit();
  }
});
$("prompt").addEventListener("paste", pasteImages);
$("model").addEventListener("change", offerImages);
$("attach").addEventListener("click", () => $("image-file").click());
$("image-file").addEventListener("change", () => {
  attach($("image-file").files).catch((error) => setStatus(error.message, true)).finally(() => {
    $("image-file").value = "";  // the same file may be picked again
  });
});
$("stop").addEventListener("click", () => controller?.abort());
$("clear").addEventListener("click", newChat);
$("settings").addEventListener("submit", (event) => event.preventDefault());
// The key lives only in this tab's session, and is sent only to this server
$("api-key").value = sessionStorage.getItem("pressroom-api-key") ?? "";
$("api-key").addEventListener("change", () => {
  sessionStorage.setItem("pressroom-api-key", $("api-key").value.trim());
  loadModels();
});
loadModels().catch((error) => setStatus(`Could not list the models: ${error.message}`, true));

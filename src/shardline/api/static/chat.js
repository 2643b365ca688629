// The chat page: a conversation kept on the page, answers streamed from /v1/chat/completions.
// Plain JavaScript, no build step. Each answer shows its tokens, time to first token and
// tokens per second; an answer being written can be stopped, the last one regenerated.
"use strict";

const KEY = "shardline-api-key";  // localStorage: asked once when /v1 answers 401
const $ = (id) => document.getElementById(id);
const state = { model: null, history: [], controller: null };

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = localStorage.getItem(KEY);
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

function showError(text) { $("error").textContent = text || ""; }

function askForKey() {
  $("key-dialog").hidden = false;
  $("api-key").focus();
}

async function loadModel() {
  const r = await fetch("/v1/models", { headers: headers() });
  if (r.status === 401) { askForKey(); return false; }
  if (!r.ok) { showError(`cannot list models: HTTP ${r.status}`); return false; }
  state.model = (await r.json()).data[0].id;
  $("model").textContent = state.model;
  return true;
}

function settings() {
  const num = (id) => $(id).value === "" ? null : Number($(id).value);
  const body = { temperature: num("temperature"), top_p: num("top-p"), max_tokens: num("max-tokens"),
                 speculative: $("speculative").checked };
  const seed = num("seed");
  if (seed !== null) body.seed = seed;
  return body;
}

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  const t = document.createElement("div");
  t.className = "text";
  t.textContent = text;
  div.append(t);
  $("messages").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
  $("regenerate").disabled = on || !state.history.some((m) => m.role === "assistant");
}

// Server-sent events from a fetch body: "data: {...}" lines, "data: [DONE]" at the end.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function answer() {
  if (!state.model && !(await loadModel())) return;
  const div = bubble("assistant", "");
  const text = div.querySelector(".text");
  const stats = document.createElement("div");
  stats.className = "stats";
  div.append(stats);
  div.dataset.state = "streaming";
  state.controller = new AbortController();
  busy(true);
  showError("");
  const start = performance.now();
  let first = null, tokens = 0, content = "";
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: state.controller.signal,
      body: JSON.stringify({ model: state.model, messages: state.history, stream: true,
                             stream_options: { include_usage: true }, ...settings() }),
    });
    if (r.status === 401) { askForKey(); throw new Error("this server needs an API key"); }
    if (!r.ok) throw new Error((await r.json()).error?.message || `HTTP ${r.status}`);
    for await (const chunk of events(r)) {
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      const delta = chunk.choices?.[0]?.delta?.content;
      if (delta) {
        first ??= performance.now();
        content += delta;
        text.textContent = content;
      }
    }
    div.dataset.state = "done";
  } catch (e) {
    div.dataset.state = e.name === "AbortError" ? "stopped" : "error";
    if (e.name !== "AbortError") showError(e.message);
  } finally {
    const end = performance.now();
    const rate = first !== null && tokens > 1 ? ((tokens - 1) / ((end - first) / 1000)).toFixed(1) : "–";
    stats.textContent = `${tokens} tokens · first token ${first === null ? "–" : Math.round(first - start)} ms · ` +
                        `${rate} tok/s${div.dataset.state === "stopped" ? " · stopped" : ""}`;
    if (content) state.history.push({ role: "assistant", content });
    state.controller = null;
    busy(false);
  }
}

function send() {
  const text = $("prompt").value.trim();
  if (!text || state.controller) return;
  $("prompt").value = "";
  state.history.push({ role: "user", content: text });
  bubble("user", text);
  answer();
}

function regenerate() {
  if (state.controller || state.history.at(-1)?.role !== "assistant") return;
  state.history.pop();
  const answers = document.querySelectorAll(".msg.assistant");
  answers[answers.length - 1].remove();
  answer();
}

$("send").onclick = send;
$("stop").onclick = () => state.controller?.abort();
$("regenerate").onclick = regenerate;
$("clear").onclick = () => { if (!state.controller) { state.history = []; $("messages").replaceChildren(); busy(false); } };
$("prompt").addEventListener("keydown", (e) => { if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); } });
$("key-save").onclick = async () => {
  localStorage.setItem(KEY, $("api-key").value.trim());
  $("key-dialog").hidden = true;
  $("api-key").value = "";
  await loadModel();
};
loadModel();

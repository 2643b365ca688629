// The fleet page: the chain of stages, live (GET /fleet.json every second).
"use strict";

const $ = (id) => document.getElementById(id);
const fmt = (v, unit) => v === null || v === undefined ? "–" : `${v}${unit || ""}`;

function stageBox(s) {
  const box = document.createElement("div");
  box.className = "stage";
  box.dataset.where = s.where;
  box.dataset.health = s.health;
  const title = s.index === 0 ? "coordinator" : s.where;
  const layers = s.layers ? `${s.layers[0]}–${s.layers[1]}` : "–";
  box.innerHTML = `<h3></h3><span class="health"></span><dl>
    <dt>layers</dt><dd class="layers"></dd><dt>device</dt><dd class="device"></dd>
    <dt>precision</dt><dd class="precision"></dd>
    <dt>graph / token</dt><dd class="graph"></dd><dt>KV held</dt><dd class="kv"></dd></dl>
    <div class="muted why"></div>`;
  box.querySelector("h3").textContent = title;
  box.querySelector(".health").textContent = s.health === "up" ? "up" : "down";
  box.querySelector(".layers").textContent = layers;
  box.querySelector(".device").textContent = fmt(s.device);
  box.querySelector(".precision").textContent = s.precision;
  box.querySelector(".graph").textContent = fmt(s.graph_ms_per_token, " ms");
  box.querySelector(".kv").textContent = `${s.kv_mb} MB`;
  box.querySelector(".why").textContent = s.why;
  return box;
}

function hopBox(h) {
  const hop = document.createElement("div");
  hop.className = "hop";
  hop.textContent = `wire ${fmt(h.wire_ms, " ms")}`;
  return hop;
}

function render(f) {
  $("model").textContent = f.model;
  $("status").textContent = f.status;
  $("rate").textContent = f.tokens_per_s;
  $("streams").textContent = `${f.streams.active} / ${f.streams.max}`;
  $("waiting").textContent = f.streams.waiting;
  $("groups").textContent = f.streams.decode_groups;
  // prefill's share of the stages' time; past half while streams decode, it holds them back
  $("prefill").textContent = `${Math.round(100 * f.prefill.share)}%`
    + (f.prefill.holding_decode ? " — holding decoding streams back" : "");
  $("prefill").classList.toggle("error", f.prefill.holding_decode);
  $("acceptance").textContent = f.speculation.acceptance === null ? "–"
    : `${Math.round(100 * f.speculation.acceptance)}% of ${f.speculation.drafted}`;
  $("memory").textContent = `${f.memory_mb} MB`;
  const parts = [];
  f.stages.forEach((s, i) => {
    if (i > 0 && f.hops[i - 1]) parts.push(hopBox(f.hops[i - 1]));
    parts.push(stageBox(s));
  });
  $("chain").replaceChildren(...parts);
  $("error").textContent = f.error || "";
  $("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
}

async function poll() {
  try {
    const r = await fetch("/fleet.json", { cache: "no-store" });
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    render(await r.json());
  } catch (e) {
    $("error").textContent = `the server does not answer: ${e.message}`;
  } finally {
    setTimeout(poll, 1000);
  }
}
poll();

// The status page: reads /v1/status every few seconds and draws it; its buttons POST to
// /admin/... . Every figure shown from the data carries its path in /v1/stats
// (data-path, a JSON array) and its raw value (data-value), so a test can check each one.
// Text only goes through textContent: nothing from the server is parsed as HTML.
"use strict";

const REFRESH_MS = 2000;
const KEY_ITEM = "serve_app_api_key"; // sessionStorage: this tab only, gone when it closes
let last = null;
let busy = false;
let wantsAdmin = null; // the notice of a control refused for want of an admin key
let noticeUntil = 0; // a control's outcome stays on the notice line until then (ms)
const OUTCOME_MS = 8000;

// ---- small helpers ---------------------------------------------------------------------

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") el.className = v;
    else if (k === "style") {  // through the CSSOM: the page's CSP allows no inline styles
      for (const decl of v.split(";")) {
        const at = decl.indexOf(":");
        if (at > 0) el.style.setProperty(decl.slice(0, at).trim(), decl.slice(at + 1).trim());
      }
    }
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : String(c));
  }
  return el;
}

function at(obj, path) {
  let v = obj;
  for (const p of path) {
    if (v === undefined || v === null) return undefined;
    v = v[p];
  }
  return v;
}

// A figure from the data: its text, with its path and raw value for checking
// (``volatile``: it changes between two reads even when nothing is served).
function fig(path, format, volatile) {
  const value = at(last, path);
  const text = value === undefined || value === null ? "–" : (format || String)(value);
  return h("span", {"data-path": JSON.stringify(path), "data-value": JSON.stringify(value ?? null),
                    "data-volatile": volatile}, text);
}

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = Number(n);
  while (Math.abs(v) >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return `${v >= 100 || i === 0 ? v.toFixed(0) : v.toFixed(1)} ${units[i]}`;
}
const rate = (n) => `${bytes(n)}/s`;
const pct = (x) => `${(100 * x).toFixed(1)}%`;
const secs = (s) => (s < 1 ? `${(1000 * s).toFixed(0)} ms` : `${s.toFixed(2)} s`);
const num = (n) => Number(n).toLocaleString("en-US");
const tps = (n) => `${Number(n).toFixed(1)} tok/s`;
const when = (t) => new Date(t * 1000).toLocaleTimeString();

function kv(label, ...value) {
  return h("div", {class: "kv"}, h("span", {}, label), h("span", {}, ...value));
}

function bar(parts, total, over) {
  const el = h("div", {class: "bar", role: "img"});
  for (const [value, color, title] of parts) {
    if (!value || !total) continue;
    el.append(h("div", {style: `width:${Math.min(100, (100 * value) / total)}%;background:var(${color})`,
                        title: `${title}: ${bytes(value)}`}));
  }
  if (over) el.append(h("div", {class: "over", title: "over the budget"}));
  return el;
}

function legend(items) {
  return h("div", {class: "legend"},
           items.map(([color, label]) => h("span", {}, h("i", {style: `background:var(${color})`}), label)));
}

function notice(text, error) {
  const el = document.getElementById("notice");
  el.hidden = !text;
  el.textContent = text || "";
  el.className = error ? "error" : "";
}

// ---- talking to the server ---------------------------------------------------------------

function headers(json) {
  const out = {};
  const key = sessionStorage.getItem(KEY_ITEM);
  if (key) out.Authorization = `Bearer ${key}`;
  if (json) out["Content-Type"] = "application/json";
  return out;
}

async function errorText(resp) {
  try {
    const body = await resp.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (e) {
    return `${resp.status} ${resp.statusText}`;
  }
}

async function errorCode(resp) {
  try {
    const body = await resp.clone().json();
    return body.error && body.error.code;
  } catch (e) {
    return null;
  }
}

// Without a key that works, nothing of the last data stays on the page (nor its controls).
function clearPage() {
  last = null;
  for (const id of ["memory", "models", "cache", "nodes", "bench", "errors"]) {
    document.getElementById(id).replaceChildren();
  }
}

function askForKey(why) {
  clearPage();
  document.getElementById("key-form").hidden = false;
  document.getElementById("forget-key").hidden = !sessionStorage.getItem(KEY_ITEM);
  notice(why, true);
}

const KEYS_ON = (document.querySelector('meta[name="serve-app-api-keys"]') || {}).content === "on";

async function refresh() {
  if (KEYS_ON && !sessionStorage.getItem(KEY_ITEM)) {
    askForKey("this server needs an API key to show its status");
    return;
  }
  let resp;
  try {
    resp = await fetch("v1/status", {headers: headers(false), cache: "no-store"});
  } catch (e) {
    notice("the server does not answer (stopped?); retrying", true);
    return;
  }
  if (resp.status === 401) {
    askForKey(sessionStorage.getItem(KEY_ITEM) ? "that API key was refused; enter another"
                                                : "this server needs an API key to show its status");
    return;
  }
  if (!resp.ok) {
    notice(`status: ${await errorText(resp)}`, true);
    return;
  }
  last = await resp.json();
  document.getElementById("key-form").hidden = wantsAdmin === null;
  document.getElementById("forget-key").hidden = !sessionStorage.getItem(KEY_ITEM);
  if (wantsAdmin !== null) notice(wantsAdmin, true);
  else if (!busy && Date.now() >= noticeUntil) notice("");
  render();
}

// A control's outcome, kept for a few seconds: the refresh that follows every control
// would otherwise clear it at once.
function outcome(text, error) {
  noticeUntil = Date.now() + OUTCOME_MS;
  notice(text, error);
}

async function post(path, body, what) {
  busy = true;
  notice(`${what}…`);
  try {
    const resp = await fetch(path, {method: "POST", headers: headers(true),
                                    body: JSON.stringify(body || {})});
    if (resp.status === 401) {
      askForKey("this needs an API key: enter it above, then try again");
      return null;
    }
    if (resp.status === 403 && (await errorCode(resp)) === "admin_key_required") {
      // The data stays (this key may read it); the form takes an admin key instead.
      wantsAdmin = `${what} needs an admin key: enter one above, then try again`;
      return null;
    }
    if (!resp.ok) {
      outcome(`${what} failed: ${await errorText(resp)}`, true);
      return null;
    }
    outcome(`${what}: done`);
    return await resp.json();
  } catch (e) {
    outcome(`${what} failed: ${e}`, true);
    return null;
  } finally {
    busy = false;
    refresh();
  }
}

// ---- the sections ---------------------------------------------------------------------------

function renderServer() {
  const s = last.server || {};
  const up = s.uptime_s === undefined ? "" : ` · up ${secs(s.uptime_s)}`;
  document.getElementById("server").replaceChildren(
    `version `, fig(["server", "version"]), up,
    s.api_keys ? (s.admin_keys ? " · API keys on · the controls need an admin key"
                               : " · API keys on")
               : " · no API keys (anyone who reaches this port may use it)");
  document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
}

function modelsOn(node) {
  return Object.keys(last.models || {}).filter(
    (n) => at(last, ["models", n, "replica", "node_id"]) === node);
}

function renderMemory() {
  const nodes = at(last, ["memory", "nodes"]) || {};
  const out = [];
  const plan = at(last, ["memory", "plan"]);
  if (plan) {
    out.push(h("div", {class: "row"}, "budget ", fig(["memory", "plan", "budget_bytes"], bytes),
               " of ", fig(["memory", "plan", "total_memory_bytes"], bytes), " ",
               h("span", {class: "muted"}, plan.budget_origin || "")));
  } else {
    out.push(h("p", {class: "muted"}, "no memory plan"));
  }
  for (const [node, m] of Object.entries(nodes)) {
    const parts = [];
    for (const name of modelsOn(node)) {
      const mem = at(last, ["models", name, "replica", "memory"]) || {};
      if (!mem.loaded) continue;
      parts.push([mem.planned ? mem.planned.weights_bytes : 0, "--weights", `${name} weights`]);
      const kvb = mem.kv_budget_bytes || 0;
      const used = Math.min(mem.kv_in_use_bytes || 0, kvb);
      parts.push([used, "--kvuse", `${name} KV in use`]);
      parts.push([kvb - used, "--kv", `${name} KV budget`]);
    }
    parts.push([m.hot_bytes, "--hot", "hot tier"]);
    parts.push([m.staging_bytes, "--staging", "SSD write buffer"]);
    const base = ["memory", "nodes", node];
    out.push(h("div", {class: "node-memory", "data-node": node},
      Object.keys(nodes).length > 1 ? h("div", {class: "muted"}, `node ${node.slice(0, 12)}`) : null,
      bar(parts, m.budget_bytes, m.planned_bytes > m.budget_bytes),
      h("div", {class: "row"}, "planned ", fig([...base, "planned_bytes"], bytes), " of budget ",
        fig([...base, "budget_bytes"], bytes), " · KV in use ",
        fig([...base, "kv_in_use_bytes"], bytes),
        m.advisory ? h("span", {class: "muted"}, " · advisory (no Metal limits set here)") : null)));
  }
  out.push(legend([["--weights", "weights"], ["--kvuse", "KV in use"], ["--kv", "KV budget"],
                   ["--hot", "hot tier"], ["--staging", "SSD write buffer"]]));
  document.getElementById("memory").replaceChildren(...out);
}

function controls(name) {
  const pool = at(last, ["pool", "models", name]);
  if (!pool) return h("div", {class: "muted"}, "no model pool: every model stays loaded");
  const loaded = pool.status === "loaded";
  const path = `admin/models/${encodeURIComponent(name)}`;
  const cacheOn = at(last, ["models", name, "cache", "enabled"]);
  return h("div", {class: "row controls"},
    h("button", {type: "button", disabled: loaded || pool.state === "loading", "data-action": "load",
                 onclick: () => post(`${path}/load`, {}, `loading ${name}`)}, "Load"),
    h("button", {type: "button", disabled: !loaded || pool.pinned, "data-action": "unload",
                 onclick: () => post(`${path}/unload`, {}, `unloading ${name}`)}, "Unload"),
    pool.pinned
      ? h("button", {type: "button", disabled: Boolean(pool.pin_locked), "data-action": "unpin",
                     title: pool.pin_locked || "", onclick: () => post(`${path}/unpin`, {}, `unpinning ${name}`)},
          "Unpin")
      : h("button", {type: "button", "data-action": "pin",
                     onclick: () => post(`${path}/pin`, {}, `pinning ${name}`)}, "Pin"),
    h("button", {type: "button", disabled: cacheOn === false, "data-action": "clear-cache",
                 onclick: () => {
                   if (confirm(`Forget every cached prefix of ${name} (RAM and SSD, every node)?`)) {
                     post(`${path}/cache/clear`, {}, `clearing the cache of ${name}`);
                   }
                 }}, "Clear cache"));
}

function renderModel(name) {
  const m = ["models", name];
  const phase = at(last, [...m, "phase"]) || {};
  const pool = at(last, ["pool", "models", name]);
  const e = [...m, "engine"];
  const r = [...m, "recent"];
  const c = [...m, "cache"];
  const mem = [...m, "replica", "memory"];
  const hasEngine = at(last, e) !== undefined;
  const pooling = at(last, [...m, "pooling"]);
  const p = [...m, "pooling"];
  if (pooling) {  // an embedding or rerank model: no engine, its requests and model calls
    return h("div", {class: "model", "data-model": name},
      h("div", {class: "row"}, h("h3", {}, name),
        h("span", {class: `badge ${phase.phase}`, "data-role": "phase"}, fig([...m, "phase", "phase"])),
        h("span", {class: "badge vision", "data-role": "task"},
          pooling.task === "rerank" ? "reranks" : "embeds"),
        phase.reason ? h("span", {class: "muted"}, fig([...m, "phase", "reason"])) : null),
      h("div", {class: "grid"},
        kv("requests", fig([...p, "requests"], num)),
        kv("inputs", fig([...p, "inputs"], num)),
        kv("tokens", fig([...p, "tokens"], num)),
        kv("model calls", fig([...p, "batches"], num)),
        kv("seconds in model calls", fig([...p, "batch_seconds"], secs)),
        kv("failed", fig([...p, "failed"], num))),
      controls(name));
  }
  return h("div", {class: "model", "data-model": name},
    h("div", {class: "row"}, h("h3", {}, name),
      h("span", {class: `badge ${phase.phase}`, "data-role": "phase"}, fig([...m, "phase", "phase"])),
      pool ? h("span", {class: `badge ${pool.status}`, "data-role": "pool-status"},
               fig(["pool", "models", name, "status"])) : null,
      pool && pool.pinned ? h("span", {class: "badge pinned"}, "pinned") : null,
      (phase.input_modalities || []).includes("image")
        ? h("span", {class: "badge vision", "data-role": "vision"}, "takes images") : null,
      phase.reason ? h("span", {class: "muted"}, fig([...m, "phase", "reason"])) : null,
      pool && pool.last_error ? h("span", {class: "muted"}, fig(["pool", "models", name, "last_error"])) : null),
    h("div", {class: "grid"},
      kv("in flight", fig([...e, "in_flight"], num)),
      kv("running in the batch", fig([...e, "running_batch_size"], num)),
      kv("waiting for KV", fig([...e, "kv_waiting"], num)),
      kv("weights", fig([...mem, "planned", "weights_bytes"], bytes)),
      kv("KV in use / budget", fig([...e, "kv_in_use_bytes"], bytes), " / ",
         fig([...mem, "kv_budget_bytes"], bytes)),
      kv("hot-tier share", fig([...mem, "planned", "hot_share_bytes"], bytes)),
      at(last, [...m, "kv_cache"]) === undefined ? null
        : kv("K/V a token", fig([...m, "kv_cache", "kv_bytes_per_token"], bytes), " (",
             h("span", {"data-role": "kv-format"}, fig([...m, "kv_cache", "kv_format"])), ")"),
      kv("process memory", fig([...mem, "process_rss_bytes"], bytes, true)),
      kv("requests, last minute", fig([...r, "requests"], num)),
      kv("output, last minute", fig([...r, "output_tokens_per_s"], tps)),
      kv("decode per stream", fig([...r, "decode_tokens_per_s"], tps)),
      kv("time to first token", fig([...r, "ttft_mean_s"], secs),
         at(last, [...r, "ttft_max_s"]) ? [" mean, ", fig([...r, "ttft_max_s"], secs), " max"] : ""),
      kv("requests finished", fig([...e, "finished"], num)),
      kv("failed / rejected", fig([...e, "failed"], num), " / ", fig([...e, "rejected"], num)),
      kv("tokens generated", fig([...e, "generated_tokens"], num)),
      kv("prompt tokens", fig([...e, "prompt_tokens"], num)),
      kv("prompt tokens from cache", fig([...c, "hit_rate"], pct)),
      at(last, [...m, "images"]) === undefined ? null
        : kv("images encoded / from feature cache / from prefix cache",
             fig([...m, "images", "encoded"], num), " / ",
             fig([...m, "images", "from_feature_cache"], num), " / ",
             fig([...m, "images", "from_prefix_cache"], num))),
    hasEngine ? null : h("div", {class: "muted"}, "not loaded: no engine figures"),
    controls(name));
}

function renderModels() {
  document.getElementById("models").replaceChildren(...Object.keys(last.models || {}).map(renderModel));
}

function stores() {
  // One store per node: the first model served there reports it.
  const out = new Map();
  for (const name of Object.keys(last.models || {})) {
    const node = at(last, ["models", name, "replica", "node_id"]);
    if (node && at(last, ["models", name, "cache_store"]) && !out.has(node)) out.set(node, name);
  }
  return out;
}

function renderCache() {
  const out = [];
  for (const [node, name] of stores()) {
    const s = ["models", name, "cache_store"];
    const store = at(last, s);
    const ssd = store.ssd || {};
    const ssdUsed = (ssd.block_bytes || 0) + (ssd.sidecar_bytes || 0);
    out.push(h("div", {class: "store", "data-node": node},
      stores().size > 1 ? h("div", {class: "muted"}, `node ${node.slice(0, 12)}`) : null,
      h("div", {class: "row"}, "hot tier (RAM): ", fig([...s, "bytes"], bytes), " of ",
        fig([...s, "budget_bytes"], bytes), ", ", fig([...s, "blocks"], num), " blocks"),
      bar([[store.bytes, "--hot", "hot"]], store.budget_bytes),
      ssd.disabled
        ? h("div", {class: "muted"}, "SSD tier off: ", fig([...s, "ssd", "disabled"]))
        : [h("div", {class: "row"}, "SSD: ", fig([...s, "ssd", "block_bytes"], bytes), " blocks + ",
             fig([...s, "ssd", "sidecar_bytes"], bytes), " state of ",
             fig([...s, "ssd", "budget_bytes"], bytes), " in ", fig([...s, "ssd", "dir"])),
           bar([[ssdUsed, "--weights", "SSD"]], ssd.budget_bytes),
           h("div", {class: "row"}, "SSD writes, last hour: ", fig([...s, "ssd", "written_last_hour"], bytes),
             " of ", fig([...s, "ssd", "write_budget_per_hour"], bytes), " an hour"),
           bar([[ssd.written_last_hour, "--hot", "written"]], ssd.write_budget_per_hour)]));
  }
  const rows = [];
  for (const name of Object.keys(last.models || {})) {
    const c = ["models", name, "cache"];
    const cache = at(last, c);
    if (!cache) continue;
    if (!cache.enabled) {
      rows.push(h("tr", {}, h("td", {}, name), h("td", {colspan: 4, class: "muted"},
                                                  "off: ", fig([...c, "disabled_reason"]))));
      continue;
    }
    const seen = (cache.hit_tokens || 0) + (cache.missed_tokens || 0);
    const tiers = Object.keys(cache.hit_tokens_by_tier || {}).map((t) => h("div", {},
      `${t} `, fig([...c, "hit_tokens_by_tier", t], num),
      seen ? ` (${pct(cache.hit_tokens_by_tier[t] / seen)})` : ""));
    const misses = Object.keys(cache.misses_by_reason || {}).map((why) => h("div", {},
      `${why.replaceAll("_", " ")}: `, fig([...c, "misses_by_reason", why], num)));
    const busts = (cache.recent_cache_busts || []).slice(0, 3).map((b) => h("div", {class: "muted"},
      JSON.stringify(b)));
    rows.push(h("tr", {"data-model": name}, h("td", {}, name),
      h("td", {}, fig([...c, "hit_rate"], pct), h("div", {class: "muted"},
        fig([...c, "hit_tokens"], num), " of ", String(seen), " prompt tokens")),
      h("td", {}, tiers.length ? tiers : "–"),
      h("td", {}, misses.length ? misses : "–",
        cache.last_miss_reason ? h("div", {class: "muted"}, "last: ", fig([...c, "last_miss_reason"])) : null),
      h("td", {}, busts.length ? busts : "–")));
  }
  out.push(h("table", {}, h("thead", {}, h("tr", {}, h("th", {}, "model"), h("th", {}, "hit rate"),
    h("th", {}, "hits by tier"), h("th", {}, "misses by reason"), h("th", {}, "recent cache busts"))),
    h("tbody", {}, rows)));
  document.getElementById("cache").replaceChildren(...out);
}

function renderNodes() {
  const nodes = last.nodes || [];
  document.getElementById("nodes-section").hidden = nodes.length < 2;
  document.getElementById("nodes").replaceChildren(h("table", {},
    h("thead", {}, h("tr", {}, ["node", "address", "alive", "CPUs", "models"].map((t) => h("th", {}, t)))),
    h("tbody", {}, nodes.map((n, i) => h("tr", {"data-node": n.node_id},
      h("td", {}, n.node_id.slice(0, 12), n.head ? " (head)" : ""),
      h("td", {}, fig(["nodes", i, "address"])),
      h("td", {}, fig(["nodes", i, "alive"], (a) => (a ? "yes" : "no"))),
      h("td", {}, fig(["nodes", i, "cpus"])),
      h("td", {}, modelsOn(n.node_id).join(", ") || "–"))))));
}

function renderBench() {
  const select = document.getElementById("bench-model");
  const names = Object.keys(last.models || {});
  const chosen = select.value;
  if (select.options.length !== names.length) {
    select.replaceChildren(...names.map((n) => h("option", {value: n}, n)));
    if (chosen) select.value = chosen;
  }
  const rows = Object.keys(last.benchmarks || {}).map((name) => {
    const b = ["benchmarks", name];
    const res = at(last, b);
    return h("tr", {"data-model": name}, h("td", {}, name),
      h("td", {}, res.ssd ? fig([...b, "ssd", "write_bytes_per_s"], rate) : "–"),
      h("td", {}, res.ssd ? [fig([...b, "ssd", "read_bytes_per_s"], rate),
                             res.ssd.read_bypassed_page_cache ? "" : " (page cache)"] : "–"),
      h("td", {}, res.model_speed ? fig([...b, "model_speed", "prefill_tokens_per_s"], tps) : "–"),
      h("td", {}, res.model_speed ? fig([...b, "model_speed", "decode_tokens_per_s"], tps) : "–"),
      h("td", {}, when(res.at), (res.notes || []).map((n) => h("div", {class: "muted"}, n))));
  });
  document.getElementById("bench").replaceChildren(rows.length ? h("table", {},
    h("thead", {}, h("tr", {}, ["model", "SSD write", "SSD read", "prefill", "decode", "run at"]
      .map((t) => h("th", {}, t)))), h("tbody", {}, rows))
    : h("p", {class: "muted"}, "not run yet: it runs only when asked"));
}

function renderErrors() {
  const errors = last.errors || {recent: []};
  const rows = errors.recent.map((e, i) => {
    const p = ["errors", "recent", i];
    return h("tr", {}, h("td", {}, when(e.at)), h("td", {}, fig([...p, "status"])),
      h("td", {}, fig([...p, "path"])), h("td", {}, e.model || "–"),
      h("td", {}, fig([...p, "code"])),
      h("td", {class: "err-msg"}, e.message === null ? h("span", {class: "muted"},
        `about the request's body${e.param ? ` (${e.param})` : ""}: not kept`) : fig([...p, "message"])));
  });
  document.getElementById("errors").replaceChildren(
    h("div", {class: "row"}, fig(["errors", "total"], num), " errors since the server started"),
    rows.length ? h("table", {}, h("thead", {}, h("tr", {},
      ["time", "status", "path", "model", "code", "message"].map((t) => h("th", {}, t)))),
      h("tbody", {}, rows)) : h("p", {class: "muted"}, "none"));
}

function render() {
  renderServer();
  renderMemory();
  renderModels();
  renderCache();
  renderNodes();
  renderBench();
  renderErrors();
  document.body.dataset.rendered = String(Number(document.body.dataset.rendered || 0) + 1);
}

// ---- wiring ---------------------------------------------------------------------------------

document.getElementById("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const input = document.getElementById("key");
  if (input.value) sessionStorage.setItem(KEY_ITEM, input.value.trim());
  input.value = "";
  wantsAdmin = null;
  refresh();
});
document.getElementById("forget-key").addEventListener("click", () => {
  sessionStorage.removeItem(KEY_ITEM);
  wantsAdmin = null;
  clearPage();
  refresh();
});
document.getElementById("bench-run").addEventListener("click", async (ev) => {
  const button = ev.target;
  button.disabled = true;
  try {
    await post("admin/benchmark", {model: document.getElementById("bench-model").value},
               "running the self-benchmark");
  } finally {
    button.disabled = false;
  }
});
refresh();
setInterval(() => { if (!busy) refresh(); }, REFRESH_MS);

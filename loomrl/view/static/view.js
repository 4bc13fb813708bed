// loomrl view: the page. Plain JavaScript over the JSON API (loomrl/view/app.py); charts are uPlot (vendored).
// State lives in `view` (window.loomrlView), so that tests can read what the charts hold.
"use strict";

const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f"];
// With several runs a line takes its run's colour (the run's badge in the header) and a chart's metrics are told apart
// by dash; with one run the colours tell its metrics apart, and the badge is neutral.
const DASHES = [undefined, [8, 4], [2, 3], [12, 3, 2, 3], [1, 5], [6, 2, 1, 2, 1, 2]];
const SOLO = "#444";
// Steps are whole numbers: the step axis ticks at these increments only (uPlot's default ones include fractions).
const STEP_INCRS = [1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 2500, 5000, 10000, 20000, 50000, 100000];
const SPLIT_SUCCESS = /^eval\/[^/]+\/success$/;
const WHOLE = (u, lo, hi) => [0, Math.max(1, Math.ceil(hi))];  // steps and counts: from 0, never an axis of 0..100 for all-0
const natural = s => s.replace(/\d+/g, d => d.padStart(9, "0"));  // staleness/lag_2 before staleness/lag_10
const POLL_MS = Number(new URLSearchParams(location.search).get("poll") || 2000);

// A chart: a title and the metric names it draws (a string: that name; a RegExp: every name it matches), per run;
// `range`: a fixed y range (rates), or a function of the data's (uPlot's scale range), so that a run at 0 throughout
// does not get an axis of its own making; `omit(key, names)`: leave out a metric the run logs that only repeats another;
// `absentIsZero`: a training step that does not log a metric the run logs elsewhere counted 0 of it.
const CURVES = [
  { id: "reward", title: "reward (train, mean over scored rollouts)", keys: ["rollout/reward_mean"] },
  // eval/success is over every held-out split together: with one split it is that split's own number, drawn once
  { id: "success", title: "success: train correct rate; held-out by split (eval/<split>/…) and over all splits (eval/success)",
    keys: ["rollout/correct_rate", SPLIT_SUCCESS, "eval/success"], range: [0, 1],
    omit: (key, names) => key === "eval/success" && [...names].filter(n => SPLIT_SUCCESS.test(n)).length === 1 },
  { id: "terms", title: "reward terms (mean)", keys: [/^reward\/[^/]+$/] },
  { id: "loss", title: "loss", keys: ["train/loss"] },
  { id: "kl", title: "KL (approx, policy vs sampler)", keys: ["train/approx_kl", "train/kl"] },
  { id: "entropy", title: "entropy", keys: ["train/entropy"] },
  { id: "grad_norm", title: "grad norm", keys: ["train/grad_norm"] },
  // mixture-of-experts runs (trainer.router_replay, moe_aux_loss_coef: loomrl/trainer/moe_step.py)
  { id: "moe_agreement", title: "MoE: router agreement, engine vs trainer (share of expert choices)", keys: ["train/moe/router_agreement"], range: [0, 1] },
  { id: "moe_gap", title: "MoE: engine-trainer logprob gap with router replay and without", keys: ["train/moe/logprob_gap", "train/moe/logprob_gap_no_replay"] },
  { id: "moe_aux", title: "MoE: load-balancing loss", keys: ["train/moe/aux_loss"] },
  // trainer.lora.publish=adapter: the adapter version the engines were confirmed serving, and what a publish sent
  { id: "adapter_version", title: "LoRA adapter version the engines serve (confirmed by fingerprint)", keys: ["weight_sync/adapter_version"], range: WHOLE },
  { id: "adapter_bytes", title: "LoRA adapter bytes per publish", keys: ["weight_sync/adapter_bytes"] },
  // the lag in steps and how many groups had each lag are different units: two charts, not one axis
  { id: "lag", title: "policy lag of the step's groups (steps): largest and mean", keys: ["staleness_max", "derived/staleness_mean"], range: WHOLE },
  { id: "lag_groups", title: "the step's groups by policy lag (count of groups with lag 0, 1, …)", keys: [/^staleness\/lag_\d+$/], range: WHOLE,
    absentIsZero: true },  // a step logs only the lags it saw: no line means no group at that lag
  { id: "tps", title: "tokens/s (generated per step second; trained per train second)", keys: ["derived/generated_tokens_per_s", "derived/trained_tokens_per_s"] },
  { id: "step_time", title: "step time split (s): rollout, train, rollout idle (waiting)", keys: ["time/step_s", "time/rollout_s", "time/train_s", "time/rollout_idle_s"] },
];
const POOLS = [
  { id: "engine_busy_frac", title: "engine busy: share of the step's wall time computing", keys: ["engine/busy_frac"], range: [0, 1] },
  { id: "engine_busy", title: "engine busy time (s per step)", keys: ["engine/busy_s"] },
  { id: "engine_queue", title: "engine queue: requests waiting for admission (the step's mean)", keys: ["engine/queue_depth"] },
  { id: "queue", title: "queue depth: groups buffered when the step began; buffer wait (s)", keys: ["buffer/depth", "buffer/wait_s_mean", "buffer/wait_s_max"] },
  { id: "inflight", title: "groups in flight", keys: ["admission/inflight_groups", "admission/inflight_groups_max", "admission/launched_groups"] },
  { id: "prefix", title: "prefix-cache hit rate (share of prompt tokens)", keys: ["engine/prefix_hit_rate"], range: [0, 1] },
  { id: "env_health", title: "env pool health: created, destroyed, kills, failures", keys: [/^env_pool\/(created|destroyed|kills|health_failures|create_failures|reset_failures)$/] },
  { id: "env_wait", title: "env pool acquire waits; concurrency cap waits (s)", keys: [/^env_pool\/acquire_wait_s_(total|max)$/, "rollout/cap_wait_s_total"] },
  { id: "reward_latency", title: "reward latency (s)", keys: [/^reward(_pool)?\/.*(latency|_s_|wait)/] },
  { id: "judge", title: "judge", keys: [/^judge\//] },
  { id: "endings", title: "rollouts by ending (failures by status)", keys: [/^rollout\/status_/] },
  { id: "restarts", title: "retries and restarts", keys: ["runtime/trainer_restarts", /retr(y|ies)/, "groups_stale", "groups_skipped"] },
];

const view = window.loomrlView = { runs: [], charts: {}, polls: 0 };

async function api(path, params) {
  const url = path + "?" + new URLSearchParams(Object.entries(params || {}).filter(([, v]) => v !== "" && v != null));
  const r = await fetch(url);
  if (!r.ok) throw new Error(`${url}: ${r.status} ${await r.text()}`);
  return r.json();
}

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "style") e.style.cssText = v; else if (k.startsWith("on")) e.addEventListener(k.slice(2), v); else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(c == null ? "" : String(c)));
  return e;
}

const fmt = (v, d = 3) => v == null ? "–" : (Math.abs(v) >= 1000 || (v !== 0 && Math.abs(v) < 1e-3) ? v.toExponential(2) : v.toFixed(d));

// -- metrics ------------------------------------------------------------------------------------------------------
function derive(r) {  // rates the run does not log as such
  if (r.kind === "train") {
    const lags = Object.keys(r).filter(k => /^staleness\/lag_\d+$/.test(k));
    const n = lags.reduce((a, k) => a + r[k], 0);
    if (n > 0) r["derived/staleness_mean"] = lags.reduce((a, k) => a + Number(k.slice(14)) * r[k], 0) / n;
    if (r["engine/generated_tokens"] != null && r["time/step_s"]) r["derived/generated_tokens_per_s"] = r["engine/generated_tokens"] / r["time/step_s"];
    if (r["train/tokens"] != null && r["train/seconds"]) r["derived/trained_tokens_per_s"] = r["train/tokens"] / r["train/seconds"];
  }
  return r;
}

function addRecords(run, records) {
  for (const r of records) {
    if (r.kind === "rollback") {  // the run went back to a checkpoint: later train records were undone
      run.records = run.records.filter(x => !(x.kind === "train" && x.step > r.step));
    } else run.records.push(derive(r));
  }
}

function seriesOf(chart) {  // [{run, key}] present in the runs' records, in a stable order
  const out = [];
  view.runs.forEach((run, ri) => {
    const names = new Set();
    for (const r of run.records) for (const k of Object.keys(r)) if (typeof r[k] === "number") names.add(k);
    const found = [];
    const sorted = [...names].sort((a, b) => natural(a) < natural(b) ? -1 : natural(a) > natural(b) ? 1 : 0);
    for (const key of chart.keys) {
      if (typeof key === "string") { if (names.has(key)) found.push(key); }
      else for (const n of sorted) if (key.test(n) && !found.includes(n)) found.push(n);
    }
    for (const k of found) if (!(chart.omit && chart.omit(k, names))) out.push({ run, ri, key: k });
  });
  return out;
}

function chartData(series, def) {
  const steps = new Set();
  const maps = series.map(({ run, key }) => {
    const m = new Map();
    for (const r of run.records) {
      const v = typeof r[key] === "number" ? r[key] : def.absentIsZero && r.kind === "train" ? 0 : null;
      if (v != null) { m.set(r.step, v); steps.add(r.step); }
    }
    return m;
  });
  const xs = [...steps].sort((a, b) => a - b);
  return [xs, ...maps.map(m => xs.map(x => m.has(x) ? m.get(x) : null))];
}

function drawCharts(defs, containerId) {
  const box = document.getElementById(containerId);
  if (!box.offsetParent) return;  // hidden tab: drawn when shown
  const multi = view.runs.length > 1;
  for (const def of defs) {
    let card = document.getElementById("chart-" + def.id);
    if (!card) {
      card = el("div", { class: "chart", id: "chart-" + def.id }, el("h3", {}, def.title), el("div", { class: "plot" }));
      box.append(card);
    }
    const plot = card.querySelector(".plot");
    const series = seriesOf(def);
    const sig = series.map(s => s.ri + ":" + s.key).join("|");
    const data = chartData(series, def);
    const old = view.charts[def.id];
    if (!series.length) {
      if (old) { old.uplot.destroy(); delete view.charts[def.id]; }
      plot.replaceChildren(el("div", { class: "empty" }, "not logged by " + (multi ? "these runs" : "this run")));
      continue;
    }
    if (old && old.sig === sig) { old.uplot.setData(data); continue; }
    if (old) old.uplot.destroy();
    plot.replaceChildren();
    const keys = [...new Set(series.map(s => s.key))];
    const opts = {
      width: Math.max(300, plot.clientWidth || 400), height: 190,
      scales: { x: { time: false }, ...(def.range ? { y: { range: def.range } } : {}) },
      axes: [{ incrs: STEP_INCRS, values: (u, vals) => vals.map(v => v == null ? "" : String(v)) }, { size: 60, values: (u, vals) => vals.map(v => v == null ? "" : Math.abs(v) >= 1e4 || (v !== 0 && Math.abs(v) < 1e-2) ? v.toExponential(1) : +v.toPrecision(3)) }],
      legend: { live: true, markers: { dash: (u, i) => u.series[i].dash ? (u.series[i].dash[0] <= 2 ? "dotted" : "dashed") : "solid" } },
      series: [{ label: "step" }, ...series.map(s => ({
        label: (multi ? s.run.key + " · " : "") + s.key, spanGaps: true, width: 1.5,
        stroke: multi ? s.run.color : PALETTE[keys.indexOf(s.key) % PALETTE.length],
        dash: multi ? DASHES[keys.indexOf(s.key) % DASHES.length] : undefined, points: { show: true, size: 4 },
      }))],
    };
    view.charts[def.id] = { sig, uplot: new uPlot(opts, data, plot) };
  }
}

function redraw() {
  drawCharts(CURVES, "charts-curves");
  drawCharts(POOLS, "charts-pools");
  if (document.getElementById("tab-timeline").classList.contains("on")) drawTimeline();
}

async function poll() {
  let changed = false;
  for (const run of view.runs) {
    try {
      const m = await api("/api/metrics", { run: run.key, since: run.next });
      if (m.next < run.next) { run.records = []; run.next = 0; continue; }  // the file was rewritten: read again
      if (m.records.length) { addRecords(run, m.records); changed = true; }
      run.next = m.next;
    } catch (e) { console.warn(e); }
  }
  view.polls += 1;
  if (changed) redraw();
  const live = view.runs.filter(r => r.live).map(r => r.key);
  document.getElementById("live").textContent = live.length ? "following: " + live.join(", ") : "";
}

// -- timeline -----------------------------------------------------------------------------------------------------
async function drawTimeline() {
  const run = view.runs.find(r => r.key === $("t-run").value) || view.runs[0];
  const t = await api("/api/timeline", { run: run.key });
  const note = document.getElementById("timeline-note");
  const box = document.getElementById("timeline");
  if (!t.recorded) {
    note.textContent = `${run.key}: no groups.jsonl (a run made before loomrl recorded group lifecycles); no timeline.`;
    box.replaceChildren();
    return;
  }
  const stepTime = new Map(run.records.filter(r => r.kind === "train").map(r => [r.step, r.time]));
  const groups = t.groups.slice(-200);
  const starts = groups.map(g => g.launched).filter(x => x != null);
  const t0 = Math.min(...starts), t1 = Math.max(...groups.map(g => stepTime.get(g.step) || g.finished));
  const x = s => (100 * (s - t0) / Math.max(t1 - t0, 1e-9)).toFixed(3) + "%";
  const w = (a, b) => (100 * Math.max(b - a, 0) / Math.max(t1 - t0, 1e-9)).toFixed(3) + "%";
  note.textContent = `${run.key}: the last ${groups.length} group attempts, ${(t1 - t0).toFixed(1)} s. Coloured: admitted → scored, ` +
    "its colour the policy version it was admitted at, labelled with the versions its tokens came from; where the run records " +
    "it, split by its slowest member's time into generating (the version's colour), waiting on tools (env reset and tool " +
    "calls, amber) and scoring (purple), the rest (light) other waits; grey: scored, waiting for the trainer; the end mark: " +
    "trained (green) or left out (orange) at the step named.";
  box.replaceChildren(...groups.map(g => {
    const lane = el("div", { class: "lane" });
    if (g.launched != null) lane.append(...lifeSegments(g, x, w));
    const end = stepTime.get(g.step);
    if (end != null) {
      lane.append(el("div", { class: "seg", title: "waiting for the trainer", style: `left:${x(g.finished)};width:${w(g.finished, end)};background:#bbb` }));
      lane.append(el("div", { class: "seg", title: `${g.fate} at step ${g.step}`,
        style: `left:${x(end)};width:4px;background:${g.fate === "trained" ? "#17803d" : "#d9822b"}` }));
    }
    const what = g.step != null ? `${g.fate} @${g.step}` : g.ended;
    return el("div", { class: "lane-row" }, el("span", { class: "lane-label" }, `pos ${g.position}#${g.attempt} ${what}`), lane);
  }));
}

// A group's admitted → scored bar: whole, or (groups.jsonl lines with `slowest`, runtime/group_log.py) split in
// proportion to its slowest member's generation, tool (env reset + steps) and scoring seconds, the rest drawn as other
// waits; parts that add up to more than the bar (clocks differ a little) are scaled to fit it.
function lifeSegments(g, x, w) {
  const hue = `hsl(${(g.version_at_launch * 67) % 360},55%,45%)`;
  const label = `v${g.policy_version_min}–${g.policy_version_max}`;
  const span = g.finished - g.launched;
  const s = g.slowest;
  if (!s) return [el("div", { class: "seg", title: `generating ${span.toFixed(2)} s`, style: `left:${x(g.launched)};width:${w(g.launched, g.finished)};background:${hue}` }, label)];
  const parts = [["generating", s.gen_s, hue], ["waiting on tools", s.reset_s + s.env_s, "#d9a42b"], ["scoring", s.reward_s, "#8e5bb5"]];
  const scale = Math.min(1, span / Math.max(parts.reduce((a, p) => a + p[1], 0), 1e-9));
  const why = `slowest member: generating ${s.gen_s.toFixed(2)} s, tools ${s.env_s.toFixed(2)} s, env reset ${s.reset_s.toFixed(2)} s, ` +
    `scoring ${s.reward_s.toFixed(2)} s, of ${span.toFixed(2)} s`;
  const out = [];
  let at = g.launched;
  for (const [what, secs, colour] of parts) {
    const end = at + secs * scale;
    out.push(el("div", { class: "seg", "data-part": what, title: `${what} ${secs.toFixed(2)} s (${why})`,
      style: `left:${x(at)};width:${w(at, end)};background:${colour}` }, what === "generating" ? label : ""));
    at = end;
  }
  if (at < g.finished) out.push(el("div", { class: "seg", "data-part": "other", title: `other waits ${(g.finished - at).toFixed(2)} s (${why})`,
    style: `left:${x(at)};width:${w(at, g.finished)};background:${hue};opacity:0.35` }));
  return out;
}

// -- trajectories -------------------------------------------------------------------------------------------------
const $ = id => document.getElementById(id);

async function fillSteps() {
  const run = $("f-run").value, store = $("f-store").value;
  const sel = $("f-step");
  if (store !== "trajectories") { sel.replaceChildren(el("option", { value: "" }, "all")); sel.disabled = true; return; }
  const asked = view.stepsAsked = (view.stepsAsked || 0) + 1;
  const s = await api("/api/steps", { run });
  if (asked !== view.stepsAsked) return;  // a later call (another run chosen meanwhile) fills the list
  const keep = sel.value;  // read now, not before the wait: a step chosen meanwhile is the one to keep
  const sig = `${run}:${s.steps.length}:${s.pending}`;
  if (sel.dataset.sig === sig && !sel.disabled) return;  // unchanged: an open list is left alone
  sel.dataset.sig = sig;
  sel.disabled = false;
  sel.replaceChildren(el("option", { value: "" }, "all"));
  for (const st of s.steps) {
    const skipped = Object.entries(st.skipped).map(([k, v]) => `${k} ${v}`).join(", ");
    sel.append(el("option", { value: st.step }, `step ${st.step}: trained ${st.trained}` + (skipped ? `, left out ${skipped}` : "") + (st.stale ? `, stale ${st.stale}` : "")));
  }
  sel.append(el("option", { value: "-1" }, `not consumed yet (${s.pending})`));
  if ([...sel.options].some(o => o.value === keep)) sel.value = keep;
}

function fateLine(m) {
  if (m.fate === "trained") return `trained at step ${m.fate_step}`;
  if (m.fate === "skipped" || m.fate === "stale") return `left out at step ${m.fate_step}: ${m.fate_reason || m.fate}`;
  return "not in the ledger: waiting in the buffer, or the run ended before a step took it";
}

async function showGroups() {
  const params = { run: $("f-run").value, store: $("f-store").value, step: $("f-step").value, status: $("f-status").value,
    task: $("f-task").value, min_reward: $("f-min").value, max_reward: $("f-max").value };
  // Answers can come back out of order (a run switched, then a step chosen at once): only the latest request's
  // answer is drawn, or a slower earlier one would replace it with the groups of filters no longer chosen.
  const asked = view.groupsAsked = (view.groupsAsked || 0) + 1;
  const g = await api("/api/groups", params);
  if (asked !== view.groupsAsked) return;
  $("f-count").textContent = `${g.total} groups` + (g.total > g.groups.length ? `, first ${g.groups.length} shown` : "");
  $("adv-note").textContent = "advantage: " + (g.groups[0] ? g.groups[0].advantage_source : "") + `. This run's rule: ${g.advantage_rule}.`;
  $("groups").replaceChildren(...g.groups.map(card => el("div", { class: "group", "data-group": card.group_id },
    el("h4", {}, `${card.task_id} · ${card.group_id} · mean ${fmt(card.reward_mean)}` + (card.step != null ? ` · step ${card.step}` : "")),
    ...card.members.map(m => {
      const terms = Object.entries(m.terms).map(([k, v]) => `${k} ${fmt(v)}`).join(", ");
      return el("div", { class: "member", "data-id": m.trajectory_id, title: fateLine(m), onclick: () => openTrajectory(m.trajectory_id) },
        el("span", {}, `r ${fmt(m.reward)}  A ${fmt(m.advantage, 2)}`),
        el("span", { class: "fate-" + m.fate }, `${m.status} · ${m.fate}`),
        el("span", { class: "terms" }, (terms || "no terms") + ` · v${m.versions[0]}–${m.versions[1]} · ${m.n_turns} turns, ${m.total_tokens} tok`));
    }))));
}

const COLOURS = {
  mask: { legend: "blue: sampled by the policy (loss mask 1); plain: prompt and observations (mask 0)",
    of: (c, i) => c.loss_mask[i] ? "#cfe2ff" : "" },
  logprob: { legend: "sampled tokens by their probability under the sampler: red low → green high",
    of: (c, i) => c.loss_mask[i] ? `hsl(${Math.round(120 * Math.exp(c.logprobs[i]))},70%,78%)` : "" },
  version: { legend: "sampled tokens by the policy version that sampled them (hue per version)",
    of: (c, i) => c.versions[i] >= 0 ? `hsl(${(c.versions[i] * 67) % 360},60%,80%)` : "" },
  advantage: { legend: "sampled tokens by the trajectory's advantage: green positive, red negative",
    of: (c, i, adv) => c.loss_mask[i] && adv != null ? `hsla(${adv >= 0 ? 120 : 0},70%,60%,${Math.min(Math.abs(adv) / 2, 1).toFixed(2)})` : "" },
  // only offered when the trajectory has a train record (c.gap: per token, null where not trained)
  gap: { legend: "sampled tokens by |trainer − engine| logprob as trained: green 0 → red ≥ 0.5 nats", needs: "gap",
    of: (c, i) => c.gap && c.gap[i] != null ? `hsl(${Math.round(120 * Math.max(0, 1 - c.gap[i] / 0.5))},70%,72%)` : "" },
};

function tokensOf(ctx, mode, adv, loading) {
  // the run's tokenizer is still loading: a placeholder, not ids that read as the text (the page asks again)
  if (loading) return el("div", { class: "tokens decoding muted" }, `decoding… (${ctx.token_ids.length} tokens; the run's tokenizer is loading)`);
  const box = el("div", { class: "tokens" });
  const colour = COLOURS[mode].of;
  const spans = ctx.token_ids.map((id, i) => {
    const s = el("span", { class: "tok", "data-i": i,
      title: `#${i} id ${id} · mask ${ctx.loss_mask[i]} · logprob ${fmt(ctx.logprobs[i])} · version ${ctx.versions[i]}` +
        (ctx.gap && ctx.gap[i] != null ? ` · gap ${fmt(ctx.gap[i], 4)}` : "") },
    ctx.pieces ? ctx.pieces[i] : `[${id}]`);
    const bg = colour(ctx, i, adv);
    if (bg) s.style.background = bg;
    return s;
  });
  box.append(...spans);
  return box;
}

// A web episode's screenshots are fetched only when their step scrolls into view (the list never carries them).
const shotLoader = new IntersectionObserver(entries => entries.forEach(e => {
  if (!e.isIntersecting) return;
  e.target.src = e.target.dataset.src;
  shotLoader.unobserve(e.target);
}));

function shotOf(shotUrl, i, label) {
  const img = el("img", { class: "shot", "data-src": shotUrl(i), "data-i": i, alt: label, title: label + " (click: full size)",
    onclick: () => window.open(shotUrl(i), "_blank") });
  shotLoader.observe(img);
  return img;
}

const LONG_OBS = 800;  // characters: a longer observation (a whole page's text) is folded, its first line showing

function obsOf(text) {
  if (text.length <= LONG_OBS) return el("div", { class: "obs" }, text);
  return el("details", { class: "obs" }, el("summary", {}, `${text.split("\n")[0].slice(0, 120)} … (${text.length} characters)`), text);
}

function callOf(c, shotUrl) {
  const failed = c.error || c.tool_error;
  return el("div", { class: "call" }, el("span", { class: "action" }, "action: " + c.action),
    failed ? el("span", { class: "fate-skipped" }, " (" + failed + ")") : "",
    c.screenshot != null ? shotOf(shotUrl, c.screenshot, `the page after ${c.action}`) : "");
}

function turnsOf(turns, shotUrl) {
  return turns.map((t, i) => el("div", { class: "turn" },
    el("b", {}, `turn ${i + 1}` + (t.finish_reason ? ` (${t.finish_reason})` : "") + (Object.keys(t.reward_terms || {}).length ? ` terms ${JSON.stringify(t.reward_terms)}` : "")),
    t.think ? el("div", { class: "muted" }, t.think) : "",
    el("div", {}, t.act),
    ...(t.tool_calls || []).map(c => callOf(c, shotUrl)),
    t.obs ? obsOf(t.obs) : "",
    t.error ? el("div", { class: "fate-skipped" }, "error: " + t.error) : ""));
}

function envOf(env, shotUrl) {  // a web episode's verdict (its env_record) and the page it started on
  if (!env) return [];
  const verdict = env.solved == null ? "" : (env.solved ? "solved" : "not solved");
  return [el("div", { class: "env-record" }, el("b", {}, "environment: "),
      [verdict, env.reason, env.url ? "at " + env.url : ""].filter(Boolean).join(" · ") || "(its record has no verdict)"),
    env.screenshots ? el("div", { class: "turn" }, el("b", {}, "after reset"), shotOf(shotUrl, 0, "the page after reset")) : ""];
}

async function openTrajectory(id) {
  view.openId = id;
  document.querySelectorAll(".member.open").forEach(m => m.classList.remove("open"));
  document.querySelector(`.member[data-id="${id}"]`)?.classList.add("open");
  const where = { run: $("f-run").value, id, store: $("f-store").value };
  const d = await api("/api/trajectory", where);
  const shotUrl = i => "/api/screenshot?" + new URLSearchParams({ ...where, i });
  const t = d.trajectory;
  const box = $("trajectory");
  box.classList.add("on");
  const fate = d.fate ? fateLine({ fate: d.fate.fate, fate_step: d.fate.step, fate_reason: d.fate.reason })
    : ($("f-store").value === "trajectories" ? fateLine({ fate: "pending" }) : "an evaluation episode: never trained");
  const offered = Object.keys(COLOURS).filter(k => !COLOURS[k].needs || d.contexts.some(c => c[COLOURS[k].needs]));
  const mode = el("select", { id: "colour-by" }, ...offered.map(k => el("option", { value: k }, k)));
  mode.value = offered.includes(view.colourBy) ? view.colourBy : "mask";
  const render = () => {
    view.colourBy = mode.value;
    legend.textContent = COLOURS[mode.value].legend + ". " + d.tokenizer + ". Engine-vs-trainer logprob gap: " + d.logprob_gap + ".";
    tokens.replaceChildren(...d.contexts.map(c => el("div", {}, c.reason ? el("div", { class: "muted" }, `earlier context (${c.reason})`) : "", tokensOf(c, mode.value, d.advantage, d.tokenizer_loading))));
  };
  mode.addEventListener("change", render);
  const legend = el("div", { class: "legend" });
  const tokens = el("div", { id: "token-view" });
  box.replaceChildren(
    el("h3", {}, `${t.trajectory_id} · ${t.task_id} · ${t.status} · reward ${fmt(t.total_reward)} · advantage ${fmt(d.advantage, 3)}` +
      (d.advantage_source ? ` (${d.advantage_source})` : "")),
    el("div", { class: "ledger" }, "ledger: " + fate),
    el("div", { class: "question" }, el("b", {}, `task${t.split ? " (" + t.split + ")" : ""}: `), t.prompt || "(no question stored)"),
    el("div", { class: "muted" }, `terms ${JSON.stringify(t.reward_components)} · answer ${t.answer} · final answer ${t.final_answer ?? "–"}` +
      ` · versions ${t.policy_version_min}–${t.policy_version_max} · attempts ${t.attempts}` + (t.error ? ` · error ${t.error}` : "")),
    ...envOf(d.env, shotUrl),
    el("h4", {}, "turns"), ...d.contexts.flatMap(c => turnsOf(c.turns, shotUrl)),
    el("h4", {}, "tokens, coloured by ", mode), legend, tokens);
  render();
  if (d.tokenizer_loading && view.openId === id) setTimeout(() => view.openId === id && openTrajectory(id), 1500);
}

async function initTrajectories() {
  $("f-run").replaceChildren(...view.runs.map(r => el("option", { value: r.key }, r.key)));
  const stores = () => {
    const run = view.runs.find(r => r.key === $("f-run").value);
    $("f-store").replaceChildren(...run.stores.map(s => el("option", { value: s }, s)));
  };
  stores();
  $("f-run").addEventListener("change", async () => { stores(); await fillSteps(); showGroups(); });
  $("f-store").addEventListener("change", async () => { await fillSteps(); showGroups(); });
  $("f-step").addEventListener("change", showGroups);
  $("f-apply").addEventListener("click", showGroups);
  await fillSteps();
  const steps = [...$("f-step").options].map(o => o.value).filter(v => v !== "" && v !== "-1");
  if (steps.length) $("f-step").value = steps[steps.length - 1];  // the latest step first
  await showGroups();
}

// -- start --------------------------------------------------------------------------------------------------------
function showTab(name) {
  document.querySelectorAll("nav button").forEach(b => b.classList.toggle("on", b.dataset.tab === name));
  document.querySelectorAll(".tab").forEach(t => t.classList.toggle("on", t.id === "tab-" + name));
  if (name === "trajectories" && !view.trajectoriesReady) { view.trajectoriesReady = true; initTrajectories(); }
  redraw();
}

async function start() {
  const runs = await api("/api/runs");
  const multi = runs.length > 1;
  view.runs = runs.map((r, i) => ({ ...r, records: [], next: 0, color: multi ? PALETTE[i % PALETTE.length] : SOLO }));
  $("runs").replaceChildren(...view.runs.map(r => el("span", { class: "run-chip", style: `background:${r.color}`,
    title: `${r.path}\n${JSON.stringify(r.config)}` + (multi ? "\nits lines in the charts have this colour" : "") }, r.key)));
  document.querySelectorAll("nav button").forEach(b => b.addEventListener("click", () => showTab(b.dataset.tab)));
  $("t-run").replaceChildren(...view.runs.map(r => el("option", { value: r.key }, r.key)));
  $("t-run").addEventListener("change", drawTimeline);
  await poll();
  redraw();
  view.ready = true;
  const tick = async () => {
    await poll();
    const following = view.runs.some(r => r.live);
    if (following && view.trajectoriesReady && $("tab-trajectories").classList.contains("on")) await fillSteps();  // new steps
    if (view.polls % 5 === 0) {  // a run that ends writes summary.json: it is no longer followed live
      const fresh = await api("/api/runs");
      for (const r of fresh) { const run = view.runs.find(x => x.key === r.key); if (run) { run.live = r.live; run.stores = r.stores; } }
    }
    setTimeout(tick, POLL_MS);
  };
  setTimeout(tick, POLL_MS);
  const tab = new URLSearchParams(location.search).get("tab");
  if (tab) showTab(tab);
}

start();

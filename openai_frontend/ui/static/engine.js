// The Engine tab: this server's /metrics read every INTERVAL_MS and drawn with uPlot.
// Gauges are drawn as read; counters as rates over RATE_S; latency percentiles from the
// histograms' buckets over WINDOW_S, as Prometheus' histogram_quantile computes them.

import { getText } from "./api.js";
import { buckets, byLabel, parseMetrics, quantile, total } from "./prom.js";

const INTERVAL_MS = 1500;
const RATE_S = 6;
const WINDOW_S = 60;
const KEEP_POINTS = 240;
const COUNT_STEPS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000]; // whole ticks
const COLORS = ["#1f6feb", "#d97706", "#16a34a", "#9333ea", "#dc2626", "#0891b2", "#4b5563", "#db2777"];

const fixed = (digits) => (v) => (v === null || v === undefined ? "–" : v.toFixed(digits));
const percent = (v) => (v === null || v === undefined ? "–" : `${(100 * v).toFixed(1)}%`);
const millis = (v) => (v === null || v === undefined ? "–" : `${(1000 * v).toFixed(v < 0.01 ? 1 : 0)} ms`);
const seconds = (v) => (v === null || v === undefined ? "–" : v < 1 ? millis(v) : `${v.toFixed(2)} s`);

/** What each chart draws: its series' names and their values at a scrape (`now`, with `past(s)`). */
const CHARTS = [
  {
    id: "requests", title: "Requests running and waiting", format: fixed(0), counts: true,
    series: () => ["running", "waiting"],
    values: ({ now }) => [total(now, "vllm:num_requests_running"), total(now, "vllm:num_requests_waiting")],
  },
  {
    id: "kv", title: "KV cache blocks in use", format: fixed(0), counts: true,
    series: () => ["blocks in use"],
    values: ({ now }) => [total(now, "llm_kv_blocks_used")],
    note: ({ now }) => {
      const all = total(now, "llm_kv_blocks_total");
      return all ? `of ${all} (${percent(total(now, "vllm:kv_cache_usage_perc"))})` : "";
    },
  },
  {
    id: "prefix", title: "Prefix-cache hit rate", format: percent,
    series: () => [`last ${WINDOW_S} s`],
    values: ({ now, past }) => [ratio(now, past(WINDOW_S), "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")],
  },
  {
    id: "tokens", title: "Generated tokens/s", format: fixed(1),
    series: () => ["tokens/s"],
    values: (at) => [rate(at, "llm_generated_tokens_total")],
  },
  {
    id: "ttft", title: "Time to first token", format: seconds,
    series: () => ["p50", "p90", "p99"],
    values: (at) => percentiles(at, "vllm:time_to_first_token_seconds"),
  },
  {
    id: "itl", title: "Inter-token latency", format: millis,
    series: () => ["p50", "p90", "p99"],
    values: (at) => percentiles(at, "vllm:inter_token_latency_seconds"),
  },
  {
    id: "preemptions", title: "Preemptions per second", format: fixed(2),
    series: () => ["preemptions/s"],
    values: (at) => [rate(at, "vllm:num_preemptions_total")],
    note: ({ now }) => `${total(now, "vllm:num_preemptions_total") ?? 0} in all`,
  },
  {
    id: "tenants", title: "Requests per second by tenant", format: fixed(2),
    series: ({ now }) => [...byLabel(now, "llm_tenant_requests_total", "tenant").keys()].sort(),
    label: (tenant) => tenant || "open (no API keys)",
    values: (at, names) => names.map((tenant) => rate(at, "llm_tenant_requests_total", { tenant })),
  },
]; // prettier-ignore

function ratio(now, before, part, whole) {
  const dWhole = delta(now, before, whole);
  return dWhole > 0 ? delta(now, before, part) / dWhole : null;
}

/** A counter's change since an earlier scrape (its value so far when there is none). */
function delta(now, before, name, where) {
  const a = total(now, name, where);
  const b = before ? total(before.scrape, name, where) : 0;
  return a === null ? null : a - (b ?? 0);
}

/** A counter's rate per second over the last RATE_S (null until there are two scrapes). */
function rate({ now, past, time }, name, where) {
  const before = past(RATE_S);
  if (!before || time <= before.time) return null;
  const change = delta(now, before, name, where);
  return change === null ? null : Math.max(0, change) / (time - before.time);
}

function percentiles({ now, past }, name) {
  const before = past(WINDOW_S);
  const current = buckets(now, name);
  const earlier = before ? buckets(before.scrape, name) : [];
  return [0.5, 0.9, 0.99].map((q) => quantile(q, current, earlier));
}

export class Engine {
  constructor() {
    this.scrapes = []; // {time (s), scrape}, oldest first
    this.cards = new Map(CHARTS.map((chart) => [chart.id, new Card(chart)]));
    this.visible = false;
    document.getElementById("interval").textContent = `${INTERVAL_MS / 1000} s`;
    document.getElementById("window").textContent = `${RATE_S} s (rates) and ${WINDOW_S} s (percentiles, hit rate)`;
  }

  start() {
    this.tick();
    this.timer = setInterval(() => this.tick(), INTERVAL_MS);
  }

  show(visible) {
    this.visible = visible;
    if (visible) for (const card of this.cards.values()) card.draw();
  }

  async tick() {
    const state = document.getElementById("engine-state");
    let scrape;
    try {
      scrape = parseMetrics(await getText("metrics"));
    } catch (error) {
      state.textContent = `/metrics did not answer: ${error.message}`;
      return;
    }
    const up = total(scrape, "llm_frontend_engine_metrics_up");
    state.textContent = up === 0 ? "The engine's figures are missing: Triton's metrics port did not answer." : "";
    const time = Date.now() / 1000;
    this.scrapes.push({ time, scrape });
    while (this.scrapes.length && this.scrapes[0].time < time - WINDOW_S - 5) this.scrapes.shift();
    const at = { now: scrape, time, past: (s) => this.before(time - s) };
    for (const card of this.cards.values()) card.add(time, at, this.visible);
  }

  /** The newest scrape at or before `time`; else the oldest kept (null if it is this one). */
  before(time) {
    let found = null;
    for (const entry of this.scrapes) if (entry.time <= time) found = entry;
    found ??= this.scrapes[0];
    return found === this.scrapes[this.scrapes.length - 1] ? null : found;
  }
}

/** One chart: its points (time and each series' values) and its uPlot, made when first shown. */
class Card {
  constructor(chart) {
    this.chart = chart;
    this.names = [];
    this.data = [[]];
    this.plot = null;
    this.element = Object.assign(document.createElement("figure"), { className: "chart" });
    this.element.dataset.chart = chart.id;
    this.element.dataset.points = "0";
    const title = Object.assign(document.createElement("h2"), { textContent: chart.title });
    this.output = document.createElement("output");
    this.area = Object.assign(document.createElement("div"), { className: "plot" });
    this.element.append(title, this.output, this.area);
    document.getElementById("charts").append(this.element);
    new ResizeObserver(() => this.resize()).observe(this.area);
  }

  add(time, at, visible) {
    const names = this.chart.series(at);
    if (JSON.stringify(names) !== JSON.stringify(this.names)) this.rename(names);
    const values = this.chart.values(at, names);
    this.data[0].push(time);
    values.forEach((value, i) => this.data[i + 1].push(value));
    if (this.data[0].length > KEEP_POINTS) this.data.forEach((column) => column.shift());
    this.element.dataset.points = String(this.data[0].length);
    this.element.dataset.last = JSON.stringify(values);
    const shown = names.map((name, i) => `${this.label(name)} ${this.chart.format(values[i])}`).join(" · ");
    this.output.textContent = [shown || "no series yet", this.chart.note?.(at)].filter(Boolean).join(" ");
    if (visible) this.draw();
  }

  /** A series appeared (a new tenant): keep the others' points, the new one's start empty. */
  rename(names) {
    const old = new Map(this.names.map((name, i) => [name, this.data[i + 1]]));
    const length = this.data[0].length;
    this.data = [this.data[0], ...names.map((name) => old.get(name) ?? new Array(length).fill(null))];
    this.names = names;
    this.plot?.destroy();
    this.plot = null;
  }

  label(name) {
    return this.chart.label ? this.chart.label(name) : name;
  }

  draw() {
    const width = this.area.clientWidth;
    if (!width || typeof uPlot === "undefined") return;
    if (!this.plot) this.plot = new uPlot(this.options(width), this.data, this.area);
    else this.plot.setData(this.data);
  }

  resize() {
    if (this.plot && this.area.clientWidth) this.plot.setSize({ width: this.area.clientWidth, height: 140 });
    else this.draw();
  }

  options(width) {
    const format = this.chart.format;
    return {
      width, height: 140,
      scales: { x: { time: true }, y: { range: (u, min, max) => [Math.min(0, min ?? 0), max > 0 ? max * 1.1 : 1] } },
      legend: { live: false },
      axes: [{}, { size: 64, values: (u, ticks) => ticks.map(format), ...(this.chart.counts ? { incrs: COUNT_STEPS } : {}) }],
      series: [{}, ...this.names.map((label, i) => ({
        label: this.label(label), stroke: COLORS[i % COLORS.length], width: 2, points: { show: false }, value: (u, v) => format(v),
      }))],
    }; // prettier-ignore
  }
}

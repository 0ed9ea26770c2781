// Prometheus text exposition, read the way Prometheus reads it: samples with labels,
// sums over series, and histogram_quantile's interpolation within a bucket.

const SAMPLE = /^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)/;
const LABEL = /([a-zA-Z_]\w*)="((?:[^"\\]|\\.)*)"/g;

/** A scrape: name -> [{labels, value}]. */
export function parseMetrics(text) {
  const samples = new Map();
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const found = SAMPLE.exec(line);
    if (!found) continue;
    const labels = {};
    for (const [, key, value] of (found[2] || "").matchAll(LABEL)) labels[key] = unescape(value);
    const list = samples.get(found[1]) ?? [];
    list.push({ labels, value: Number.parseFloat(found[3]) });
    samples.set(found[1], list);
  }
  return samples;
}

function unescape(value) {
  return value.replace(/\\(.)/g, (_, c) => (c === "n" ? "\n" : c));
}

/** The sum of a metric's series (those whose labels match `where`); null when absent. */
export function total(scrape, name, where = {}) {
  const list = scrape.get(name);
  if (!list) return null;
  let sum = 0;
  for (const { labels, value } of list) {
    if (Object.entries(where).every(([key, want]) => labels[key] === want)) sum += value;
  }
  return sum;
}

/** A metric's sums by one label's value. */
export function byLabel(scrape, name, label) {
  const sums = new Map();
  for (const { labels, value } of scrape.get(name) ?? []) {
    if (labels[label] === undefined) continue;
    sums.set(labels[label], (sums.get(labels[label]) ?? 0) + value);
  }
  return sums;
}

/** A histogram's cumulative buckets [[le, count]], summed over its series, ascending. */
export function buckets(scrape, name) {
  const sums = byLabel(scrape, `${name}_bucket`, "le");
  return [...sums.entries()]
    .map(([le, count]) => [le === "+Inf" ? Infinity : Number.parseFloat(le), count])
    .sort((a, b) => a[0] - b[0]);
}

/** The q-quantile of what a histogram observed between two scrapes' buckets (null: nothing). */
export function quantile(q, now, before) {
  const earlier = new Map(before.map(([le, count]) => [le, count]));
  const window = now.map(([le, count]) => [le, count - (earlier.get(le) ?? 0)]);
  const observed = window.length ? window[window.length - 1][1] : 0;
  if (observed <= 0) return null;
  const rank = q * observed;
  let lower = 0;
  let below = 0;
  for (const [le, count] of window) {
    if (count >= rank) {
      if (le === Infinity) return lower; // past the last finite bound: that bound, as Prometheus does
      const within = count - below;
      return within > 0 ? lower + ((le - lower) * (rank - below)) / within : le;
    }
    lower = le;
    below = count;
  }
  return lower;
}

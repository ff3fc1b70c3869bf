// The browser half of gradflow's live charts (gradflow/ui/live_chart.py).
//
// Streamlit calls `render` on every rerun that changes a chart's update
// (gradflow/ui/figure_delta.py has the format). What a chart holds lives in
// this module, keyed by the chart's key, not in the element Streamlit mounts
// it in: another view or page and back mounts a new element, and the page
// still holds the arrays it was sent. An update names the revision it
// applies to; one that does not match what is held is not applied, and the
// server is asked for the whole figure instead (the `resend` state), so a
// chart is never drawn with columns missing.

const held = new Map(); // chart key -> {revision, config, layout, traces, arrays}
const plots = new Map(); // chart key -> the div it was last drawn in
const asked = new Map(); // chart key -> {revision, at, setStateValue, retry} of the last resend request
const RESEND_AFTER_MS = 3000;
const RESEND_RETRY_MAX_MS = 12000;
let plotly; // Promise of window.Plotly, loaded once per page

function runScript(src, name = src) {
  return new Promise((resolve, reject) => {
    const script = document.createElement("script");
    script.src = src;
    script.onload = () => resolve(window.Plotly);
    script.onerror = () => reject(new Error(`could not load ${name}`));
    document.head.appendChild(script);
  });
}

// Plotly.js gzipped as a file (`plotly.min.js.gz`, application/gzip): the
// server sends it as it is on disk instead of compressing 1.4 MB for every
// page (gradflow/ui/live_chart.py says why), and the page unpacks it here.
async function runGzippedScript(gzipSrc) {
  const response = await fetch(gzipSrc);
  if (!response.ok) throw new Error(`could not load ${gzipSrc} (${response.status})`);
  const text = await new Response(response.body.pipeThrough(new DecompressionStream("gzip"))).text();
  const url = URL.createObjectURL(new Blob([text], { type: "text/javascript" }));
  try {
    return await runScript(url, gzipSrc);
  } finally {
    URL.revokeObjectURL(url);
  }
}

// `src`: plotly.min.js; `gzipSrc` (optional): the same, gzipped, tried first.
function loadPlotly(src, gzipSrc) {
  const gzipped = gzipSrc && typeof DecompressionStream === "function";
  plotly ??= (gzipped ? runGzippedScript(gzipSrc).catch(() => runScript(src)) : runScript(src))
    .catch((error) => {
      plotly = undefined;
      throw error;
    });
  return plotly;
}

// Plotly.js loaded before any chart of this page needs it (a queued page near
// the front of the queue, gradflow/ui/board.py): the same promise the charts
// wait on, so the page evaluates it once.
export function preloadPlotly(src, gzipSrc) {
  loadPlotly(src, gzipSrc).catch(() => {});
}

const TYPED = {
  f8: Float64Array, f4: Float32Array, i4: Int32Array, i2: Int16Array,
  i1: Int8Array, u4: Uint32Array, u2: Uint16Array, u1: Uint8Array,
};

// An encoded array -> a JS array (rank 1) or an array of row arrays (rank 2).
function decode(encoded) {
  if (!("bdata" in encoded)) return encoded.values;
  const bytes = Uint8Array.from(atob(encoded.bdata), (c) => c.charCodeAt(0));
  const flat = Array.from(new TYPED[encoded.dtype](bytes.buffer));
  if (encoded.shape.length === 1) return flat;
  const width = encoded.shape[encoded.shape.length - 1];
  return Array.from({ length: encoded.shape[0] }, (_, row) => flat.slice(row * width, (row + 1) * width));
}

// Columns `from` on (last axis) replaced by `tail`.
function splice(old, from, tail, rank) {
  if (from === 0 || old === undefined) return tail;
  if (rank === 1) return old.slice(0, from).concat(tail);
  return tail.map((row, index) => old[index].slice(0, from).concat(row));
}

function apply(state, update) {
  const next = update.base === null
    ? { config: update.config, layout: {}, traces: [], arrays: {} }
    : { ...state, layout: { ...state.layout }, arrays: { ...state.arrays } };
  next.revision = update.revision;
  Object.assign(next.layout, update.layout ?? {});
  for (const key of update.layout_drop ?? []) delete next.layout[key];
  if (update.traces) next.traces = update.traces;
  for (const [name, change] of Object.entries(update.arrays ?? {})) {
    next.arrays[name] = splice(next.arrays[name], change.from, decode(change), change.shape.length);
  }
  for (const name of update.drop ?? []) delete next.arrays[name];
  return next;
}

// On a touch screen a one-finger swipe over a chart zoomed it (Plotly's
// default drag), and the zoom stayed through the live updates: a student who
// meant to scroll the page lost sight of the layers where gradients vanish.
// A tap still shows a value and a double tap resets; nothing drags.
// (The toolbar goes too: see `figure`.)
const TOUCH = typeof matchMedia === "function" && matchMedia("(pointer: coarse)").matches;

// Panels side by side (the Compare page's heatmaps, `compare_heatmaps`) on a
// narrow screen: a phone gave each of two about 60 px and printed the runs'
// titles over each other. Below PANEL_MIN_PX a panel, they stand one per row,
// in the layout the figure carries for that (`meta.gradflow_narrow`).
const PANEL_MIN_PX = 300;

function narrowed(whole, width) {
  const meta = whole.layout.meta;
  const narrow = meta?.gradflow_narrow;
  if (!narrow || !(width > 0) || width / (meta.gradflow_columns || 1) >= PANEL_MIN_PX) return whole;
  return { ...whole, layout: { ...whole.layout, ...narrow } };
}

function figure(state) {
  const data = state.traces.map((trace) => ({ ...trace }));
  for (const [name, values] of Object.entries(state.arrays)) {
    const dot = name.indexOf(".");
    const trace = data[Number(name.slice(0, dot))];
    if (trace) trace[name.slice(dot + 1)] = values;
  }
  // New array objects every time, and datarevision: Plotly.react redraws.
  const layout = { ...state.layout, datarevision: state.revision };
  if (!TOUCH) return { data, layout, config: state.config };
  layout.dragmode = false;
  // Plotly's toolbar never hides on a touch screen, and it sat over every
  // chart's title; the page's Export button downloads the figures.
  return { data, layout, config: { ...state.config, displayModeBar: false } };
}

// Ask the server for the whole figure (the page holds `revision`, and an
// update for another came): at most once per RESEND_AFTER_MS, and again,
// at doubling intervals, until a figure is applied. The rerun that answers
// can be lost as well: on a loaded server a tick's run can start before the
// last run's messages were sent, and Streamlit then drops them. Streamlit
// does not call `render` again with an update equal to the last one (an
// unchanged figure), so without the timer such a chart stays blank.
function askForWholeFigure(key, revision, setStateValue, wait = RESEND_AFTER_MS) {
  const last = asked.get(key);
  if (last && last.revision === revision && Date.now() - last.at < RESEND_AFTER_MS) {
    last.setStateValue = setStateValue; // of the chart's newest mount
    return;
  }
  clearTimeout(last?.retry);
  const request = { revision, at: Date.now(), setStateValue };
  request.retry = setTimeout(() => {
    // Still waiting (`settle` ends the wait) and still on the page.
    if (asked.get(key) !== request || !plots.get(key)?.isConnected) return;
    asked.delete(key);
    askForWholeFigure(key, revision, request.setStateValue, Math.min(2 * wait, RESEND_RETRY_MAX_MS));
  }, wait);
  asked.set(key, request);
  // Hidden at the default console level; a bench (bench/bench_classroom.py) counts them.
  console.debug(`gradflow: chart ${key} holds revision ${revision}; asking the server for the whole figure`);
  setStateValue("resend", { held: revision, at: request.at });
}

function settle(key) {
  clearTimeout(asked.get(key)?.retry);
  asked.delete(key);
}

// The plot width (px) of each heatmap's x axis, once Plotly has laid it out.
function heatmapWidths(div, data) {
  const widths = {};
  data.forEach((trace, index) => {
    if (trace.type !== "heatmap") return;
    const axis = `xaxis${(trace.xaxis ?? "x").slice(1)}`;
    const length = div._fullLayout?.[axis]?._length;
    if (length > 0) widths[index] = Math.floor(length);
  });
  return widths;
}

// A heatmap with more columns than its plot has pixels: Plotly skips the
// columns narrower than a pixel, and which it skips depends on the width, so
// a one-step spike the server's max per block kept vanished at some window
// widths. Merge `factor` columns into one, keeping each row's largest value
// (and its raw value for the hover), and say so in the axis title, or, for
// panels side by side (the Compare page), in the figure's subtitle: there the
// axis title of a narrow panel ran into its neighbour's, and the block the
// server had made (said in the subtitle) was not counted.
function mergeColumns(trace, layout, factor, base) {
  const n = trace.x.length;
  const starts = Array.from({ length: Math.ceil(n / factor) }, (_, i) => i * factor);
  const largest = (row, from) => {
    let best = -1;
    for (let j = from; j < Math.min(from + factor, n); j++) {
      const value = row[j];
      if (value === null || Number.isNaN(value)) continue; // NaN: the markers trace draws it
      if (best < 0 || value > row[best]) best = j;
    }
    return best < 0 ? from : best;
  };
  const picks = trace.z.map((row) => starts.map((from) => largest(row, from)));
  const merged = { ...trace, x: starts.map((from) => trace.x[from]) };
  merged.z = trace.z.map((row, r) => picks[r].map((j) => row[j]));
  if (Array.isArray(trace.customdata)) {
    merged.customdata = trace.customdata.map((row, r) => picks[r].map((j) => row[j]));
  }
  const axisKey = `xaxis${(trace.xaxis ?? "x").slice(1)}`;
  const axis = { ...(layout[axisKey] ?? {}) };
  const title = typeof axis.title === "string" ? { text: axis.title } : { ...(axis.title ?? {}) };
  const blockWords = /max over up to (\d+) steps/;
  const block = blockWords.exec(title.text ?? "");
  if (block || !layout.meta?.gradflow_columns) {
    title.text = `step (each column: max over up to ${(block ? Number(block[1]) : 1) * factor} steps)`;
    axis.title = title;
    layout[axisKey] = axis;
    return merged;
  }
  // Read from the layout as received, not as an earlier panel rewrote it.
  const top = typeof base.title === "string" ? { text: base.title } : { ...(base.title ?? {}) };
  const given = blockWords.exec(top.text ?? "");
  const steps = (given ? Number(given[1]) : 1) * factor;
  if (given) {
    top.text = top.text.replace(blockWords, `max over up to ${steps} steps`);
  } else {
    top.text = `${top.text ?? ""}<br><sup>each column: max over up to ${steps} steps</sup>`;
    layout.margin = { ...(base.margin ?? {}), t: (base.margin?.t ?? 100) + 25 };
  }
  layout.title = top;
  return merged;
}

function fitToWidths(drawn, widths) {
  const layout = { ...drawn.layout };
  let changed = false;
  const data = drawn.data.map((trace, index) => {
    const width = widths[index];
    if (!width || trace.type !== "heatmap" || !Array.isArray(trace.x) || trace.x.length <= width) {
      return trace;
    }
    changed = true;
    return mergeColumns(trace, layout, Math.ceil(trace.x.length / width), drawn.layout);
  });
  return changed ? { data, layout, config: drawn.config } : null;
}

// For a screen reader: the chart is a figure named by its title, and
// Plotly's SVG text (every tick label, read as one jumble) is hidden; the
// caption below says what it shows, and Export gives its numbers as CSV.
function nameForScreenReaders(div, layout) {
  const title = layout.title?.text ?? layout.title ?? "";
  // An inert document: the title's markup is read as text, never run or loaded.
  const text = new DOMParser().parseFromString(String(title).replace(/<br\s*\/?>/gi, ". "), "text/html")
    .body.textContent.trim();
  div.setAttribute("role", "figure");
  div.setAttribute("aria-label", `${text || "Chart"}. Its numbers: Export, CSV.`);
  for (const svg of div.querySelectorAll("svg")) svg.setAttribute("aria-hidden", "true");
}

function draw(div, key, plotlySrc, plotlyGzipSrc) {
  if (div.gradflowPending) return; // the queued draw will take the newest state
  div.gradflowPending = true;
  div.gradflowDrawn = (div.gradflowDrawn ?? Promise.resolve())
    .then(() => loadPlotly(plotlySrc, plotlyGzipSrc))
    .then(async (Plotly) => {
      div.gradflowPending = false;
      const whole = narrowed(figure(held.get(key)), div.clientWidth);
      // The figure as received, before any merging to the plot's width.
      div.gradflowWhole = whole;
      div.style.minHeight = "";
      // The widths of the last draw first (no second draw at every tick),
      // then again with the widths this draw laid out, if they differ.
      const first = fitToWidths(whole, div.gradflowWidths ?? {}) ?? whole;
      await Plotly.react(div, first.data, first.layout, first.config);
      div.gradflowWidths = heatmapWidths(div, whole.data);
      const fitted = fitToWidths(whole, div.gradflowWidths);
      if (fitted && fitted.data.some((trace, i) => trace.x?.length !== first.data[i].x?.length)) {
        await Plotly.react(div, fitted.data, fitted.layout, fitted.config);
      }
      nameForScreenReaders(div, whole.layout);
      return div;
    })
    .catch((error) => {
      div.gradflowPending = false;
      div.textContent = `The chart could not be drawn (${error.message}). Reload the page to try again.`;
    });
}

function chartDiv(parentElement, key, height) {
  let div = parentElement.querySelector(":scope > div.gradflow-live-chart");
  if (!div) {
    const old = plots.get(key);
    if (old && !old.isConnected) window.Plotly?.purge(old);
    div = document.createElement("div");
    div.className = "gradflow-live-chart";
    div.style.width = "100%";
    // Keep the chart's space while Plotly loads, so nothing below it moves.
    div.style.minHeight = `${height ?? 450}px`;
    parentElement.appendChild(div);
  }
  plots.set(key, div);
  return div;
}

export function render({ data: update, parentElement, setStateValue }, plotlySrc, plotlyGzipSrc) {
  const { key } = update;
  let state = held.get(key);
  if (update.base === null || update.base === state?.revision) {
    state = apply(state, update);
    held.set(key, state);
    settle(key);
  } else if (update.revision !== state?.revision) {
    askForWholeFigure(key, state?.revision ?? null, setStateValue);
  }
  const div = chartDiv(parentElement, key, state?.layout.height);
  if (state) draw(div, key, plotlySrc, plotlyGzipSrc);
  else loadPlotly(plotlySrc, plotlyGzipSrc).catch(() => {});
  return () => {
    if (!div.isConnected) window.Plotly?.purge(div);
  };
}

/* Lesson 8.7: the four calculators, the KV chart (SVG built here, no library) and the numbers of
 * Predict's worked answers.
 *
 * K3Lesson.formulas holds each calculator's formulas exactly as the page prints them; their twins
 * for the page without JS are in templates/lesson_derive.html. Inputs come from the forms, whose
 * defaults are the official K3 figures, labelled assumptions, and the bits per value the mxfp gate
 * measured in this build (never typed in here).
 */
(function () {
  "use strict";
  const K = window.K3Lesson;
  if (!K || !K.root) return;

  K.formulas = {
    // 1. active vs total parameters
    active(v) {
      const pExpert = 3 * v.latent * v.expert_width; // w1, w3: d_lat × d_ff; w2: d_ff × d_lat
      const routedTotal = v.moe_layers * v.routed * pExpert;
      const routedActive = v.moe_layers * v.selected * pExpert;
      return {
        p_expert: pExpert,
        routed_total: routedTotal,
        routed_active: routedActive,
        selected_frac: v.selected / v.routed,
        rest_total: v.total_b * 1e9 - routedTotal,
        rest_active: v.active_b * 1e9 - routedActive,
        active_frac: v.active_b / v.total_b,
        flops: 2 * v.active_b * 1e9, // 2 FLOPs per active parameter per token, weights only
      };
    },
    // 2. weight storage, bytes
    weights(v) {
      const n = v.n_b * 1e9;
      const r = v.routed_b * 1e9;
      return {
        bf16: (n * 16) / 8,
        fp8: (n * v.b_fp8) / 8,
        mxfp4: (n * v.b4) / 8,
        mixed: (r * v.b4) / 8 + ((n - r) * v.b_rest) / 8,
      };
    },
    // 3. expert all-to-all, bytes per token
    a2a(v) {
      const perLayer = (v.selected * (1 - v.local_frac) * v.width * (v.b_dispatch + v.b_combine)) / 8;
      return { per_layer: perLayer, per_token: v.moe_layers * perLayer, bandwidth: v.moe_layers * perLayer * v.tps };
    },
    // 4. KV cache and state per sequence, bytes
    kv(v) {
      const mla = K.kvAt(v, v.context);
      return { mla: mla.mla, kda: mla.kda, k3: mla.mla + mla.kda, mha: mla.mha, ratio: mla.mha / (mla.mla + mla.kda) };
    },
  };

  /** The three memories at context length T. */
  K.kvAt = function (v, T) {
    return {
      mla: T * v.mla_layers * (v.kv_lora + v.rope) * v.cache_bytes,
      kda: v.kda_layers * v.heads * (v.d_k * v.d_v + v.conv * (2 * v.d_k + v.d_v)) * v.state_bytes,
      mha: T * v.mha_layers * v.heads * (v.qk_head + v.v_head) * v.mha_bytes,
    };
  };

  // -- number formats for the calculators ---------------------------------------------------------
  // K.fmt (lesson.js) with three repairs, mirrored by lesson_parts.html's fmt(): a value that rounds
  // up to 1000 of a unit moves to the next unit (999.6e9 B is "1.00 TB"); a ratio or share below 1
  // keeps 3 significant digits instead of printing 0; and beyond the largest unit at most 3
  // significant digits are printed, as a power of ten, never digits float cannot hold.
  const UNITS = {
    bytes: [[1e12, " TB"], [1e9, " GB"], [1e6, " MB"], [1e3, " kB"], [1, " B"]],
    count: [[1e12, "T"], [1e9, "B"], [1e6, "M"], [1e3, "K"], [1, ""]],
    flops: [[1e12, " TFLOP"], [1e9, " GFLOP"], [1e6, " MFLOP"], [1, " FLOP"]],
  };
  const p3 = (x) => Number(x.toPrecision(3)); // 3 significant digits, as a number
  function sig(r) {
    const a = Math.abs(r);
    if (a < 10) return r.toFixed(2);
    if (a < 100) return r.toFixed(1);
    if (a < 1e6) return Math.round(r).toLocaleString("en-US");
    const e = Math.floor(Math.log10(a));
    return `${p3(r / 10 ** e).toFixed(2)} × 10^${e}`;
  }
  function scaled(x, units) {
    const a = Math.abs(x);
    for (let i = 0; i < units.length; i++) {
      const [scale, unit] = units[i];
      if (Math.abs(p3(a / scale)) >= 1 || i === units.length - 1) return sig(p3(x / scale)) + unit;
    }
    return String(x);
  }
  function fmt(x, kind) {
    if (x === null || x === undefined || !Number.isFinite(x)) return K.fmt(x, kind);
    if (kind === "bytes") return scaled(x, UNITS.bytes);
    if (kind === "rate") return scaled(x, UNITS.bytes) + "/s";
    if (kind === "count") return scaled(x, UNITS.count);
    if (kind === "flops") return scaled(x, UNITS.flops);
    if (kind === "ratio") return (Math.abs(x) < 1 ? String(p3(x)) : sig(p3(x))) + "×";
    if (kind === "pct") {
      const v = 100 * x;
      return (v !== 0 && Math.abs(v) < 0.01 ? String(p3(v)) : v.toFixed(2)) + " %";
    }
    return K.fmt(x, kind);
  }
  K.calcFmt = fmt;

  // -- reading and checking a calculator form ----------------------------------------------------
  // Each input carries its range: data-min, data-max, data-integer, and optionally data-min-ref /
  // data-max-ref naming another input of the form whose current value is the bound.
  const num = (x) => (Number.isInteger(x) ? x.toLocaleString("en-US") : String(x));
  const labelOf = (el) => {
    const l = el.labels && el.labels[0];
    return (l ? K.$$(".tag", l).reduce((t, tag) => t.replace(tag.textContent, ""), l.textContent) : el.name).trim();
  };

  /** The range of `el` now: {lo, hi, integer, text}, bounds from other inputs resolved. */
  function rangeOf(el, form, raw) {
    const bound = (ref, fixed) => {
      if (!ref) return { x: fixed, by: "" };
      const other = form.elements[ref];
      const y = other ? Number(raw(other)) : NaN;
      // the other input bounds this one only while it is inside its own stated range
      const usable = other && raw(other) !== "" && Number.isFinite(y) &&
        y >= Number(other.dataset.min) && y <= Number(other.dataset.max);
      return usable ? { x: y, by: ref } : { x: fixed, by: "" };
    };
    const lo = bound(el.dataset.minRef, Number(el.dataset.min));
    const hi = bound(el.dataset.maxRef, Number(el.dataset.max));
    const integer = el.dataset.integer === "true";
    const refLabel = (b) => (b.by ? ` (${labelOf(form.elements[b.by])})` : "");
    const text = `${integer ? "integer " : ""}from ${num(lo.x)}${refLabel(lo)} to ${num(hi.x)}${refLabel(hi)}`;
    return { lo: lo.x, hi: hi.x, integer, text };
  }

  /** null if `el` holds a value inside its range, else the problem in words. */
  function problemOf(el, x, raw, r) {
    if (el.validity && el.validity.badInput) return "is not a number";
    if (raw === "") return "is empty";
    if (!Number.isFinite(x)) return "is not a number";
    if (x < r.lo) return `is ${num(x)}, below the minimum`;
    if (x > r.hi) return `is ${num(x)}, above the maximum`;
    if (r.integer && !Number.isInteger(x)) return `is ${num(x)}, not an integer`;
    return null;
  }

  function inputs(form, useDefaults) {
    const v = {};
    const errors = [];
    let missing = false;
    const raw = (el) => String(useDefaults ? el.defaultValue : el.value).trim();
    K.$$("input[type=number]", form).forEach((el) => {
      const text = raw(el);
      if (text === "" && el.disabled) missing = true; // a measurement this build does not have
      const x = text === "" ? NaN : Number(text);
      if (useDefaults) {
        v[el.name] = x;
        return;
      }
      const r = rangeOf(el, form, raw);
      if (el.dataset.minRef || el.dataset.maxRef) {
        el.min = String(r.lo);
        el.max = String(r.hi);
      }
      const problem = el.disabled ? null : problemOf(el, x, text, r);
      el.setAttribute("aria-invalid", problem ? "true" : "false");
      if (problem) errors.push(`${labelOf(el)} ${problem}: enter ${r.integer ? "an" : "a value"} ${r.text}.`);
      v[el.name] = problem ? NaN : x;
    });
    return { v, missing, errors };
  }

  // Results that valid inputs can still make meaningless: name -> reason in words, or nothing.
  const MEANINGLESS = {
    active(v, res) {
      const why = {};
      if (res.rest_total < 0) {
        why.rest_total = `N − P_routed would be below zero: the routed experts alone (L · E · P_expert = ${fmt(res.routed_total, "count")}) hold more parameters than the total N (${fmt(v.total_b * 1e9, "count")}), so these shapes contradict N. No figure is printed.`;
      }
      if (res.rest_active < 0) {
        why.rest_active = `N_active − P_routed,active would be below zero: the selected routed experts alone (${fmt(res.routed_active, "count")}) exceed the active parameters per token (${fmt(v.active_b * 1e9, "count")}), so these inputs contradict each other. No figure is printed.`;
      }
      return why;
    },
  };

  function show(node, text) {
    if (!node) return;
    node.textContent = text;
    node.hidden = !text;
  }

  function update(form) {
    const { v, missing, errors } = inputs(form, false);
    const calc = form.dataset.calc;
    const bad = errors.length > 0;
    const res = bad ? {} : K.formulas[calc](v);
    const why = bad || !MEANINGLESS[calc] ? {} : MEANINGLESS[calc](v, res);
    K.$$("output[name]", form).forEach((out) => {
      const x = res[out.name];
      const ok = Number.isFinite(x) && !why[out.name];
      out.dataset.value = ok ? String(x) : "";
      out.textContent = ok ? fmt(x, out.dataset.fmt) : missing && !bad ? K.fmt(null) : "—";
    });
    show(document.getElementById(`${form.id}-msg`), bad ? `No result: ${errors.join(" ")}` : "");
    show(document.getElementById(`${form.id}-why`), Object.values(why).join(" "));
    if (calc === "kv") drawKv(form, v, bad);
  }

  /** The defaults of calculator `name`, read from its form (so page and script share them). */
  K.defaults = (name) => inputs(document.getElementById(`calc-${name}`), true).v;

  // -- Predict's worked numbers -------------------------------------------------------------------
  function digitsOfBinomial(n, k) {
    let c = 1n;
    for (let i = 0n; i < BigInt(k); i++) c = (c * (BigInt(n) - i)) / (i + 1n); // exact at each step
    return c.toString().length;
  }

  K.derive = function () {
    const f = K.facts;
    const w = K.formulas.weights(K.defaults("weights"));
    const a = K.formulas.active(K.defaults("active"));
    const x = K.formulas.a2a(K.defaults("a2a"));
    const kv = K.formulas.kv(K.defaults("kv"));
    const has4 = K.b4 !== null;
    const has8 = K.b8 !== null;
    return {
      bf16_tb: w.bf16 / 1e12,
      b4: K.b4,
      b8: K.b8,
      mixed_tb: has4 ? w.mixed / 1e12 : null,
      mxfp4_all_tb: has4 ? w.mxfp4 / 1e12 : null,
      flops_gf: a.flops / 1e9,
      active_pct: 100 * a.active_frac,
      routed_active_b: a.routed_active / 1e9,
      active_rest_b: a.rest_active / 1e9,
      routed_pct: 100 * a.selected_frac,
      combo_digits: digitsOfBinomial(f.routed, f.selected),
      a2a_mb: has8 ? x.per_token / 1e6 : null,
      mla_gb: kv.mla / 1e9,
      kda_gb: kv.kda / 1e9,
      mha_tb: kv.mha / 1e12,
      mha_ratio: kv.ratio,
    };
  };

  // -- the KV chart: log-log SVG, built here ------------------------------------------------------
  const SERIES = [
    { key: "mha", name: "Plain MHA in every layer (counterfactual)", cls: "s-mha" },
    { key: "mla", name: "MLA latent cache", cls: "s-mla" },
    { key: "kda", name: "KDA state (constant)", cls: "s-kda" },
    { key: "k3", name: "K3 total (MLA + KDA)", cls: "s-k3" },
  ];
  const TABLE_T = [4096, 32768, 131072, 1048576];

  function tokens(T) {
    const units = [[2 ** 30, "G"], [2 ** 20, "M"], [2 ** 10, "K"]];
    for (const [s, u] of units) if (T >= s && T % s === 0) return `${T / s}${u}`;
    return T.toLocaleString("en-US");
  }

  // axis labels at powers of ten: "10 TB", "100 GB", "1 MB"
  function tickBytes(x) {
    for (const [s, u] of [[1e12, "TB"], [1e9, "GB"], [1e6, "MB"], [1e3, "kB"], [1, "B"]]) {
      if (x >= s) return `${Number((x / s).toPrecision(3))} ${u}`;
    }
    return `${Number(x.toPrecision(3))} B`;
  }

  function drawKv(form, v, bad) {
    const box = document.getElementById("kv-chart");
    const table = document.getElementById("kv-table");
    if (!box) return;
    const T = v.context;
    const mem = (t) => {
      const m = K.kvAt(v, t);
      return { mha: m.mha, mla: m.mla, kda: m.kda, k3: m.mla + m.kda };
    };
    // table: the fixed lengths plus the chosen one
    const tbody = K.el("tbody", {});
    if (bad) {
      // an input out of its range: no number anywhere, the message above says which input
      tbody.append(K.el("tr", {}, K.el("th", { scope: "row" }, "—"), [1, 2, 3, 4].map(() => K.el("td", {}, "—"))));
      table.replaceChild(tbody, K.$("tbody", table));
      box.replaceChildren(K.el("p", { class: "none" }, "No chart: an input above is outside its valid range."));
      return;
    }
    const ts = Array.from(new Set([...TABLE_T, T].filter((t) => Number.isFinite(t) && t >= 1))).sort((a, b) => a - b);
    for (const t of ts) {
      const m = mem(t);
      tbody.append(
        K.el("tr", { class: t === T ? "current" : null },
          K.el("th", { scope: "row" }, t.toLocaleString("en-US"), t === T ? " (chosen)" : ""),
          K.el("td", {}, fmt(m.mla, "bytes")),
          K.el("td", {}, fmt(m.kda, "bytes")),
          K.el("td", {}, fmt(m.k3, "bytes")),
          K.el("td", {}, fmt(m.mha, "bytes")))
      );
    }
    table.replaceChild(tbody, K.$("tbody", table));

    box.replaceChildren();
    if (!Number.isFinite(T) || T < 1) {
      box.append(K.el("p", { class: "none" }, "Enter a valid context length to draw the chart."));
      return;
    }
    const W = 720, H = 320, L = 78, R = 20, TOP = 16, B = 46;
    const pw = W - L - R, ph = H - TOP - B;
    // x range: 2^10 (or less, to include a short T) to 2^20 (or more, to include a long T); the
    // input's maximum 2^30 bounds it, and tick labels are thinned to at most 8
    const e0 = Math.min(10, Math.floor(Math.log2(T))), e1 = Math.max(20, Math.ceil(Math.log2(T)));
    const tickStep = 2 * Math.max(1, Math.ceil((e1 - e0) / 16));
    const xs = [];
    for (let e = e0; e <= e1; e++) xs.push(2 ** e);
    if (!xs.includes(T)) xs.push(T);
    xs.sort((a, b) => a - b);
    const pts = xs.map((t) => ({ t, m: mem(t) }));
    const ys = pts.flatMap((p) => SERIES.map((s) => p.m[s.key])).filter((y) => Number.isFinite(y) && y > 0);
    if (!ys.length) {
      box.append(K.el("p", { class: "none" }, "Nothing to draw: every memory is zero or invalid."));
      return;
    }
    const d0 = Math.floor(Math.log10(Math.min(...ys)));
    const d1 = Math.max(d0 + 1, Math.ceil(Math.log10(Math.max(...ys))));
    const px = (t) => L + (pw * (Math.log2(t) - e0)) / (e1 - e0);
    const py = (y) => TOP + ph - (ph * (Math.log10(y) - d0)) / (d1 - d0);
    const m = mem(T);
    const label = `Memory per sequence against context length, log-log. At T = ${T.toLocaleString("en-US")} tokens: MLA cache ${fmt(m.mla, "bytes")}, KDA state ${fmt(m.kda, "bytes")}, K3 total ${fmt(m.k3, "bytes")}, plain MHA ${fmt(m.mha, "bytes")}.`;
    const svg = K.el("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": label, class: "kv-svg" },
      K.el("title", {}, label),
      K.el("rect", { x: L, y: TOP, width: pw, height: ph, class: "plot" }));
    const dStep = Math.max(1, Math.ceil((d1 - d0) / 8)); // at most 9 labels on the bytes axis
    for (let d = d0; d <= d1; d += dStep) {
      const y = py(10 ** d);
      svg.append(K.el("line", { x1: L, x2: L + pw, y1: y, y2: y, class: "grid" }),
        K.el("text", { x: L - 6, y: y + 4, class: "tick", "text-anchor": "end" }, tickBytes(10 ** d)));
    }
    for (let e = e1 - tickStep * Math.floor((e1 - e0) / tickStep); e <= e1; e += tickStep) {
      const x = px(2 ** e);
      svg.append(K.el("line", { x1: x, x2: x, y1: TOP, y2: TOP + ph, class: "grid" }),
        K.el("text", { x, y: TOP + ph + 16, class: "tick", "text-anchor": "middle" }, tokens(2 ** e)));
    }
    svg.append(K.el("text", { x: L + pw / 2, y: H - 8, class: "axis", "text-anchor": "middle" }, "context length T, tokens (log₂)"));
    svg.append(K.el("text", { x: 14, y: TOP + ph / 2, class: "axis", "text-anchor": "middle", transform: `rotate(-90 14 ${TOP + ph / 2})` }, "bytes per sequence (log₁₀)"));
    for (const s of SERIES) {
      const line = pts.filter((p) => p.m[s.key] > 0).map((p) => `${px(p.t).toFixed(1)},${py(p.m[s.key]).toFixed(1)}`);
      svg.append(K.el("polyline", { points: line.join(" "), class: `series ${s.cls}` }));
    }
    const xT = px(T);
    svg.append(K.el("line", { x1: xT, x2: xT, y1: TOP, y2: TOP + ph, class: "marker" }),
      K.el("text", { x: Math.min(xT + 4, L + pw - 4), y: TOP + 12, class: "tick", "text-anchor": xT > L + pw - 90 ? "end" : "start" }, `T = ${tokens(T)}`));
    const legend = K.el("ul", { class: "chart-legend" },
      SERIES.map((s) => K.el("li", {}, K.el("span", { class: `swatch ${s.cls}`, "aria-hidden": "true" }), ` ${s.name}: ${fmt(m[s.key], "bytes")}`)));
    box.append(svg, legend);
  }

  // -- start: every calculator once, then Predict's numbers from the calculators' defaults ------
  K.$$("form.calc").forEach((form) => {
    form.addEventListener("input", () => update(form));
    form.addEventListener("submit", (e) => e.preventDefault());
    update(form);
  });
  const worked = K.derive();
  K.$$("output[data-k]").forEach((out) => {
    const x = worked[out.dataset.k];
    out.dataset.value = x === null ? "" : String(x);
    out.textContent = K.fmt(x, out.dataset.fmt);
  });
})();

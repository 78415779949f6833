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

  // -- reading and writing a calculator form ---------------------------------------------------
  function inputs(form, useDefaults) {
    const v = {};
    let missing = false;
    K.$$("input[type=number]", form).forEach((el) => {
      const raw = useDefaults ? el.defaultValue : el.value;
      if (raw === "" && el.disabled) missing = true; // a measurement this build does not have
      const x = raw === "" ? NaN : Number(raw);
      const ok = useDefaults || (el.checkValidity() && Number.isFinite(x));
      if (!useDefaults) el.setAttribute("aria-invalid", ok ? "false" : "true");
      v[el.name] = ok ? x : NaN;
    });
    return { v, missing };
  }

  function update(form) {
    const { v, missing } = inputs(form, false);
    const res = K.formulas[form.dataset.calc](v);
    K.$$("output[name]", form).forEach((out) => {
      const x = res[out.name];
      const ok = Number.isFinite(x);
      out.dataset.value = ok ? String(x) : "";
      out.textContent = ok ? K.fmt(x, out.dataset.fmt) : missing ? K.fmt(null) : "—";
    });
    if (form.dataset.calc === "kv") drawKv(form, v);
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

  function drawKv(form, v) {
    const box = document.getElementById("kv-chart");
    const table = document.getElementById("kv-table");
    if (!box) return;
    const T = v.context;
    const mem = (t) => {
      const m = K.kvAt(v, t);
      return { mha: m.mha, mla: m.mla, kda: m.kda, k3: m.mla + m.kda };
    };
    // table: the fixed lengths plus the chosen one
    const ts = Array.from(new Set([...TABLE_T, T].filter((t) => Number.isFinite(t) && t >= 1))).sort((a, b) => a - b);
    const tbody = K.el("tbody", {});
    for (const t of ts) {
      const m = mem(t);
      tbody.append(
        K.el("tr", { class: t === T ? "current" : null },
          K.el("th", { scope: "row" }, t.toLocaleString("en-US"), t === T ? " (chosen)" : ""),
          K.el("td", {}, K.fmt(m.mla, "bytes")),
          K.el("td", {}, K.fmt(m.kda, "bytes")),
          K.el("td", {}, K.fmt(m.k3, "bytes")),
          K.el("td", {}, K.fmt(m.mha, "bytes")))
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
    const e0 = 10, e1 = Math.max(20, Math.ceil(Math.log2(T)));
    const xs = [];
    for (let e = e0; e <= e1; e++) xs.push(2 ** e);
    if (!xs.includes(T) && T >= 2 ** e0) xs.push(T);
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
    const label = `Memory per sequence against context length, log-log. At T = ${T.toLocaleString("en-US")} tokens: MLA cache ${K.fmt(m.mla, "bytes")}, KDA state ${K.fmt(m.kda, "bytes")}, K3 total ${K.fmt(m.k3, "bytes")}, plain MHA ${K.fmt(m.mha, "bytes")}.`;
    const svg = K.el("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": label, class: "kv-svg" },
      K.el("title", {}, label),
      K.el("rect", { x: L, y: TOP, width: pw, height: ph, class: "plot" }));
    for (let d = d0; d <= d1; d++) {
      const y = py(10 ** d);
      svg.append(K.el("line", { x1: L, x2: L + pw, y1: y, y2: y, class: "grid" }),
        K.el("text", { x: L - 6, y: y + 4, class: "tick", "text-anchor": "end" }, tickBytes(10 ** d)));
    }
    for (let e = e0; e <= e1; e += 2) {
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
      SERIES.map((s) => K.el("li", {}, K.el("span", { class: `swatch ${s.cls}`, "aria-hidden": "true" }), ` ${s.name}: ${K.fmt(m[s.key], "bytes")}`)));
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

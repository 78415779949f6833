/* Lesson 8.7: shared helpers, Predict, the evaluation checklist and Verify's re-check.
 *
 * Loaded with `defer` before lesson-calc.js, lesson-matrix.js and lesson-license.js, which add to
 * the same `window.K3Lesson` namespace. The page is complete static HTML; these scripts only
 * enhance it. CSP is default-src 'self': no inline script, no style attributes, no eval.
 */
(function () {
  "use strict";
  const K = (window.K3Lesson = window.K3Lesson || {});

  // -- DOM helpers ------------------------------------------------------------------------------
  K.$ = (sel, root) => (root || document).querySelector(sel);
  K.$$ = (sel, root) => Array.from((root || document).querySelectorAll(sel));

  /** el("a", {href: "/x/", class: "k"}, "text", child): attributes by setAttribute, never style. */
  K.el = function (tag, attrs, ...children) {
    const svg = ["svg", "g", "line", "polyline", "rect", "text", "title", "desc", "path", "circle"];
    const node = svg.includes(tag)
      ? document.createElementNS("http://www.w3.org/2000/svg", tag)
      : document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === false || v === null || v === undefined) continue;
      if (k === "style") throw new Error("no style attributes under this page's CSP");
      node.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined || c === false) continue;
      node.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return node;
  };

  // -- number formats: the twins of lesson_parts.html's fmt() ------------------------------------
  // 3 significant figures in the chosen unit: < 10 -> 2 decimals, < 100 -> 1, else 0 with commas.
  function sig(x) {
    const a = Math.abs(x);
    if (a < 10) return x.toFixed(2);
    if (a < 100) return x.toFixed(1);
    return Math.round(x).toLocaleString("en-US");
  }
  const UNITS = {
    bytes: [[1e12, " TB"], [1e9, " GB"], [1e6, " MB"], [1e3, " kB"], [1, " B"]],
    count: [[1e12, "T"], [1e9, "B"], [1e6, "M"], [1e3, "K"], [1, ""]],
    flops: [[1e12, " TFLOP"], [1e9, " GFLOP"], [1e6, " MFLOP"], [1, " FLOP"]],
  };
  function scaled(x, units) {
    const a = Math.abs(x);
    for (let i = 0; i < units.length; i++) {
      const [scale, unit] = units[i];
      if (a >= scale || i === units.length - 1) return sig(x / scale) + unit;
    }
    return String(x);
  }
  /** kind: bytes | rate | count | flops | pct | ratio | fixed:N. null = not measured. */
  K.fmt = function (x, kind) {
    if (x === null || x === undefined) return "not measured in this build";
    if (!Number.isFinite(x)) return "—";
    if (kind === "bytes") return scaled(x, UNITS.bytes);
    if (kind === "rate") return scaled(x, UNITS.bytes) + "/s";
    if (kind === "count") return scaled(x, UNITS.count);
    if (kind === "flops") return scaled(x, UNITS.flops);
    if (kind === "pct") return (100 * x).toFixed(2) + " %";
    if (kind === "ratio") return Math.round(x).toLocaleString("en-US") + "×";
    if (kind && kind.startsWith("fixed:")) return x.toFixed(Number(kind.slice(6)));
    return String(x);
  };

  // -- storage: localStorage may be absent or full; the page still works without it ------------
  K.store = {
    get(key, fallback) {
      try {
        const raw = window.localStorage.getItem(key);
        return raw === null ? fallback : JSON.parse(raw);
      } catch (e) {
        return fallback;
      }
    },
    set(key, value) {
      try {
        window.localStorage.setItem(key, JSON.stringify(value));
        return true;
      } catch (e) {
        return false;
      }
    },
    remove(key) {
      try {
        window.localStorage.removeItem(key);
      } catch (e) {
        /* nothing stored, nothing to remove */
      }
    },
  };

  // -- the build's facts, from the lesson root's data attributes ---------------------------------
  const root = document.getElementById("lesson");
  if (!root) return;
  K.root = root;
  K.facts = JSON.parse(root.dataset.facts);
  K.measured = (v) => (v === "" || v === undefined ? null : Number(v));
  K.b4 = K.measured(root.dataset.b4);
  K.b8 = K.measured(root.dataset.b8);

  // progressive enhancement: show the controls, hide the notes written for the page without JS
  K.$$(".js-only").forEach((n) => n.removeAttribute("hidden"));
  K.$$(".no-js-note").forEach((n) => n.setAttribute("hidden", ""));
  root.classList.add("js");

  // -- Predict ----------------------------------------------------------------------------------
  const PRED_KEY = "k3.lesson-8.7.predictions.v1";
  const preds = K.store.get(PRED_KEY, {});

  function setRevealed(box, on) {
    const answer = K.$(".answer", box);
    const button = K.$("button.reveal", box);
    answer.hidden = !on;
    button.setAttribute("aria-expanded", on ? "true" : "false");
    button.textContent = on ? "Hide the worked answer" : "Reveal the worked answer";
  }

  K.$$(".predict").forEach((box) => {
    const id = box.dataset.prompt;
    const text = K.$("textarea", box);
    const hint = K.$(".hint", box);
    const echo = K.$(".echo", box);
    const saved = preds[id] || {};
    text.value = saved.text || "";
    echo.textContent = text.value;
    setRevealed(box, Boolean(saved.revealed && text.value.trim()));
    text.addEventListener("input", () => {
      preds[id] = Object.assign(preds[id] || {}, { text: text.value });
      K.store.set(PRED_KEY, preds);
      if (text.value.trim()) hint.textContent = "";
    });
    K.$("button.reveal", box).addEventListener("click", () => {
      const open = K.$(".answer", box).hidden === false;
      if (!open && !text.value.trim()) {
        hint.textContent = "Write your prediction first: one sentence is enough.";
        text.focus();
        return;
      }
      echo.textContent = text.value.trim();
      hint.textContent = "";
      setRevealed(box, !open);
      preds[id] = Object.assign(preds[id] || {}, { text: text.value, revealed: !open });
      K.store.set(PRED_KEY, preds);
    });
  });

  // -- Audit an evaluation claim ------------------------------------------------------------------
  const evalForm = document.getElementById("eval-form");
  if (evalForm) {
    const out = document.getElementById("eval-verdict");
    const update = () => {
      const boxes = K.$$("input[type=checkbox]", evalForm);
      const missing = boxes
        .filter((b) => !b.checked)
        .map((b) => K.$(`label[for="${b.id}"]`, evalForm).textContent.split(":")[0]);
      out.textContent = missing.length
        ? `Not comparable yet: ${missing.length} of ${boxes.length} settings unmatched (${missing.join(", ")}). A difference in score may come from the setup, not the model.`
        : `Comparable on all ${boxes.length} settings: a difference in score can be put down to the models, within run-to-run noise.`;
    };
    evalForm.addEventListener("change", update);
    evalForm.addEventListener("submit", (e) => e.preventDefault());
    update();
  }

  // -- Verify: re-check the rendered evidence against census.json ----------------------------------
  const recheck = document.getElementById("recheck");
  if (recheck) {
    recheck.addEventListener("click", async () => {
      const result = document.getElementById("recheck-result");
      result.textContent = "Fetching census.json…";
      let census;
      try {
        const resp = await fetch("/census.json", { cache: "no-store" });
        if (!resp.ok) throw new Error(`HTTP ${resp.status}`);
        census = await resp.json();
      } catch (e) {
        result.textContent = `Could not read census.json (${e.message}).`;
        return;
      }
      const problems = K.compareWithCensus(census);
      const commit = census.provenance.git_commit.slice(0, 12);
      result.textContent = problems.length
        ? `Differs from census.json (commit ${commit}): ${problems.join("; ")}.`
        : `Matches census.json: ${census.innovations.length} innovations, ${census.gates.length} gates, commit ${commit}.`;
      result.dataset.ok = problems.length ? "false" : "true";
    });
  }

  /** Every difference between the Verify table on the page and a census.json object. */
  K.compareWithCensus = function (census) {
    const problems = [];
    if (census.provenance.git_commit !== root.dataset.commit) {
      problems.push("census.json comes from another build: reload the page");
    }
    const rows = new Map(K.$$("#verify-table tbody tr").map((tr) => [tr.dataset.innovation, tr]));
    const gates = new Map(census.gates.map((g) => [g.id, g]));
    for (const inno of census.innovations) {
      const tr = rows.get(inno.id);
      if (!tr) {
        problems.push(`${inno.id} is missing from the page`);
        continue;
      }
      rows.delete(inno.id);
      const want = {
        level: inno.level,
        claim: inno.claim,
        killed: String(inno.killed),
        gates: `${inno.gates_passed}/${inno.gates_total}`,
        checks: `${inno.checks_passed}/${inno.checks_total}`,
      };
      for (const [k, v] of Object.entries(want)) {
        if (tr.dataset[k] !== v) problems.push(`${inno.id} ${k}: page ${tr.dataset[k]}, census ${v}`);
      }
      const shown = K.$$("li[data-gate]", tr).map((li) => li.dataset.gate);
      if (shown.join(",") !== inno.gates.join(",")) problems.push(`${inno.id}: gate list differs`);
      K.$$("li[data-gate]", tr).forEach((li) => {
        const g = gates.get(li.dataset.gate);
        if (!g || g.status !== li.dataset.status) problems.push(`${li.dataset.gate}: status differs`);
      });
    }
    for (const id of rows.keys()) problems.push(`${id} is on the page but not in the census`);
    return problems;
  };
})();

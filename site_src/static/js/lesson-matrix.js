/* Lesson 8.7: the five-layer audit matrix (add, edit, delete, filter, localStorage, export as
 * JSON, CSV and Markdown) and Transfer (the matrix applied to Kimi K2 or DeepSeek-V3).
 *
 * The seed rows are the static table the template rendered; this script reads them from the DOM,
 * keeps the learner's version in localStorage, and re-renders the table from that list. The
 * Verify column is never stored: it is rebuilt from this build's census as rendered on the page.
 */
(function () {
  "use strict";
  const K = window.K3Lesson;
  const app = document.getElementById("matrix-app");
  if (!K || !K.root || !app) return;

  const KEY = app.dataset.storageKey;
  const FIELDS = ["model", "layer", "claim", "source", "evidence", "boundary", "dependency", "falsify", "innovation"];
  const HEAD = {
    model: "Model", layer: "Layer", claim: "Claim", source: "Source", evidence: "Evidence class",
    boundary: "Measurement boundary", dependency: "Depends on", falsify: "Falsification test",
    innovation: "Covered by gates for",
  };
  const table = document.getElementById("matrix-table");
  const form = document.getElementById("matrix-form");
  const filter = document.getElementById("matrix-filter");
  const count = document.getElementById("matrix-count");
  const msg = document.getElementById("mx-msg");

  const optionLabels = (sel) => Object.fromEntries(K.$$(`${sel} option`).map((o) => [o.value, o.textContent]));
  const LAYERS = optionLabels("#mx-layer");
  const CLASSES = optionLabels("#mx-evidence");

  // the live census, as the Verify table rendered it: id -> {title, level, gates, checks}
  const LIVE = new Map(K.$$("#verify-table tbody tr").map((tr) => [tr.dataset.innovation, {
    title: tr.dataset.title, level: tr.dataset.level, gates: tr.dataset.gates, checks: tr.dataset.checks,
  }]));

  // -- the seed, from the static table ------------------------------------------------------------
  const text = (tr, f) => {
    const n = K.$(`[data-f="${f}"]`, tr);
    return n ? n.textContent.trim() : "";
  };
  const SEED = K.$$("tbody tr", table).map((tr) => ({
    id: tr.dataset.id,
    origin: "seed",
    model: tr.dataset.model,
    layer: tr.dataset.layer,
    claim: text(tr, "claim"),
    source: text(tr, "source"),
    evidence: tr.dataset.evidence,
    boundary: text(tr, "boundary"),
    dependency: text(tr, "dependency"),
    falsify: text(tr, "falsify"),
    innovation: tr.dataset.innovation,
    artifact: tr.dataset.artifact,
    artifact_value: tr.dataset.artifactValue,
    artifact_gate: tr.dataset.artifactGate,
  }));
  const SEED_BY_ID = new Map(SEED.map((r) => [r.id, r]));

  // -- state: {version, rows, deleted}; seed rows added by a later build are merged in -----------
  function load() {
    const saved = K.store.get(KEY, null);
    if (!saved || saved.version !== 1 || !Array.isArray(saved.rows)) return { rows: SEED.map((r) => ({ ...r })), deleted: [] };
    const have = new Set(saved.rows.map((r) => r.id));
    const deleted = new Set(saved.deleted || []);
    const rows = saved.rows.map((r) => {
      const seed = SEED_BY_ID.get(r.id);
      // a measured artifact is this build's, never the stored copy's
      return seed
        ? { ...r, artifact: seed.artifact, artifact_value: seed.artifact_value, artifact_gate: seed.artifact_gate }
        : { ...r, artifact: "", artifact_value: "" };
    });
    for (const s of SEED) if (!have.has(s.id) && !deleted.has(s.id)) rows.push({ ...s });
    return { rows, deleted: [...deleted] };
  }
  let state = load();
  let storageOk = true;
  function save() {
    storageOk = K.store.set(KEY, { version: 1, rows: state.rows, deleted: state.deleted });
  }

  // -- rendering ----------------------------------------------------------------------------------
  function liveCell(r) {
    const cell = K.el("td", { class: "verify-cell" });
    const live = r.innovation && LIVE.get(r.innovation);
    if (live) {
      cell.append(K.el("span", { class: "live", "data-innovation": r.innovation, "data-level": live.level, "data-gates": live.gates, "data-checks": live.checks },
        K.el("a", { href: `/innovations/${r.innovation}/` }, r.innovation), " ",
        K.el("span", { class: "live-level" }, K.el("span", { class: `badge lvl-${live.level.toLowerCase()}` }, live.level)), " ",
        K.el("span", { class: "live-counts" }, "gates ", K.el("span", { class: "live-gates" }, live.gates), ", checks ", K.el("span", { class: "live-checks" }, live.checks))));
    } else {
      cell.append(K.el("span", { class: "none" }, "no gate covers this row"));
    }
    if (r.artifact) {
      const [gate, key] = r.artifact.split(":");
      const val = r.artifact_value === "" ? null : Number(r.artifact_value);
      cell.append(K.el("div", { class: "artifact" }, "measured: ", K.el("strong", {}, K.fmt(val, "fixed:2")), ` ${key.replaceAll("_", " ")} (`,
        r.artifact_gate === "present" ? K.el("a", { href: `/gates/${gate}/` }, gate) : `${gate}: not in this build`, ")"));
    }
    return cell;
  }

  function matches(r, f) {
    if (f.layer && r.layer !== f.layer) return false;
    if (f.evidence && r.evidence !== f.evidence) return false;
    if (f.model && r.model !== f.model) return false;
    if (f.text) {
      const hay = FIELDS.map((k) => r[k] || "").join(" ").toLowerCase();
      if (!hay.includes(f.text.toLowerCase())) return false;
    }
    return true;
  }

  function render() {
    const f = Object.fromEntries(new FormData(filter).entries());
    const thead = K.el("thead", {}, K.el("tr", {},
      ["Claim (model · layer; source)", "Evidence class", "Measurement boundary; depends on", "Falsification test", "Verify (this build)", "Actions"].map((h) => K.el("th", { scope: "col" }, h))));
    const tbody = K.el("tbody", {});
    let shown = 0;
    for (const r of state.rows) {
      if (!matches(r, f)) continue;
      shown++;
      const short = r.claim.length > 40 ? r.claim.slice(0, 40) + "…" : r.claim;
      tbody.append(K.el("tr", { id: `mrow-${r.id}`, "data-id": r.id, "data-origin": r.origin, "data-layer": r.layer, "data-evidence": r.evidence, "data-model": r.model, "data-innovation": r.innovation || "" },
        K.el("td", { class: "c-claim" },
          K.el("span", { "data-f": "claim" }, r.claim), r.origin === "mine" ? K.el("span", { class: "mine" }, " (yours)") : null,
          K.el("span", { class: "meta" }, K.el("span", { "data-f": "model" }, r.model), " · ", K.el("span", { "data-f": "layer" }, LAYERS[r.layer] || r.layer)),
          r.source ? K.el("span", { class: "src" }, "Source: ", K.el("span", { "data-f": "source" }, r.source)) : null),
        K.el("td", { "data-f": "evidence" }, K.el("span", { class: `tag tag-${r.evidence}` }, CLASSES[r.evidence] || r.evidence)),
        K.el("td", {}, K.el("span", { "data-f": "boundary" }, r.boundary),
          r.dependency ? K.el("span", { class: "dep" }, " Depends on: ", K.el("span", { "data-f": "dependency" }, r.dependency)) : null),
        K.el("td", { "data-f": "falsify" }, r.falsify),
        liveCell(r),
        K.el("td", { class: "actions" },
          K.el("button", { type: "button", "data-act": "edit", "data-id": r.id, "aria-label": `Edit row: ${short}` }, "Edit"), " ",
          K.el("button", { type: "button", "data-act": "delete", "data-id": r.id, "aria-label": `Delete row: ${short}` }, "Delete"))));
    }
    table.replaceChild(thead, K.$("thead", table));
    table.replaceChild(tbody, K.$("tbody", table));
    K.$("caption", table).textContent = `The audit matrix: ${state.rows.length} rows (${state.rows.filter((r) => r.origin === "mine").length} yours). The Verify column is this build's live gate status.`;
    count.textContent = `Showing ${shown} of ${state.rows.length} rows.` + (storageOk ? "" : " Edits cannot be saved in this browser: storage is unavailable.");
  }

  // -- add / edit / delete ------------------------------------------------------------------------
  function formRow() {
    const d = Object.fromEntries(new FormData(form).entries());
    const row = {};
    for (const k of FIELDS) row[k] = (d[k] || "").trim();
    return { id: d.id, row };
  }

  function resetForm() {
    form.reset();
    form.elements.id.value = "";
    K.$("#matrix-form-h").textContent = "Add a row";
    K.$("#mx-submit").textContent = "Add row";
    K.$("#mx-cancel").hidden = true;
  }

  form.addEventListener("submit", (e) => {
    e.preventDefault();
    const { id, row } = formRow();
    if (!row.claim) {
      msg.textContent = "A row needs a claim.";
      form.elements.claim.focus();
      return;
    }
    if (id) {
      const i = state.rows.findIndex((r) => r.id === id);
      if (i >= 0) state.rows[i] = { ...state.rows[i], ...row };
      msg.textContent = "Row saved.";
    } else {
      const newId = `mine-${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 7)}`;
      state.rows.push({ id: newId, origin: "mine", ...row, artifact: "", artifact_value: "" });
      msg.textContent = "Row added.";
    }
    save();
    resetForm();
    render();
  });

  K.$("#mx-cancel").addEventListener("click", () => {
    resetForm();
    msg.textContent = "Editing cancelled.";
  });

  table.addEventListener("click", (e) => {
    const b = e.target.closest("button[data-act]");
    if (!b) return;
    const i = state.rows.findIndex((r) => r.id === b.dataset.id);
    if (i < 0) return;
    const r = state.rows[i];
    if (b.dataset.act === "delete") {
      state.rows.splice(i, 1);
      if (r.origin === "seed") state.deleted.push(r.id);
      save();
      render();
      msg.textContent = "Row deleted.";
      return;
    }
    for (const k of FIELDS) form.elements[k].value = r[k] || "";
    form.elements.id.value = r.id;
    K.$("#matrix-form-h").textContent = "Edit the row";
    K.$("#mx-submit").textContent = "Save changes";
    K.$("#mx-cancel").hidden = false;
    form.elements.claim.focus();
  });

  filter.addEventListener("input", render);
  filter.addEventListener("submit", (e) => e.preventDefault());

  /** Add rows from elsewhere on the page (Transfer); returns how many were new. */
  K.matrixAdd = function (rows) {
    const have = new Set(state.rows.map((r) => r.id));
    let added = 0;
    for (const r of rows) {
      if (have.has(r.id)) continue;
      state.rows.push({ origin: "mine", artifact: "", artifact_value: "", innovation: "", ...r });
      added++;
    }
    save();
    render();
    return added;
  };

  // -- export -------------------------------------------------------------------------------------
  function exportRows() {
    return state.rows.map((r) => {
      const out = { id: r.id, origin: r.origin };
      for (const k of FIELDS) out[k] = r[k] || "";
      const live = r.innovation && LIVE.get(r.innovation);
      if (live) out.live_status = { level: live.level, gates: live.gates, checks: live.checks };
      if (r.artifact) out.measured = { artifact: r.artifact, value: r.artifact_value === "" ? null : Number(r.artifact_value) };
      return out;
    });
  }
  const csvCell = (s) => (/[",\n\r]/.test(s) ? `"${s.replaceAll('"', '""')}"` : s);
  const mdCell = (s) => s.replaceAll("\\", "\\\\").replaceAll("|", "\\|").replace(/\s*\n\s*/g, " ");
  const EXPORTS = {
    json: {
      mime: "application/json",
      text: (rows) => JSON.stringify({ lesson: "8.7", build_commit: K.root.dataset.commit, rows }, null, 2) + "\n",
    },
    csv: {
      mime: "text/csv",
      text: (rows) => [["id", "origin", ...FIELDS, "live_level"].join(","),
        ...rows.map((r) => [r.id, r.origin, ...FIELDS.map((k) => r[k]), r.live_status ? r.live_status.level : ""].map((c) => csvCell(String(c))).join(","))].join("\r\n") + "\r\n",
    },
    md: {
      mime: "text/markdown",
      text: (rows) => {
        const cols = [...FIELDS.filter((k) => k !== "innovation"), "verify"];
        const head = cols.map((k) => (k === "verify" ? "Verify (this build)" : HEAD[k]));
        const lines = [`| ${head.join(" | ")} |`, `|${cols.map(() => " --- ").join("|")}|`];
        for (const r of rows) {
          const verify = r.live_status ? `${r.innovation}: ${r.live_status.level}, gates ${r.live_status.gates}, checks ${r.live_status.checks}` : "";
          const vals = cols.map((k) => (k === "verify" ? verify : k === "layer" ? LAYERS[r[k]] || r[k] : k === "evidence" ? CLASSES[r[k]] || r[k] : r[k]));
          lines.push(`| ${vals.map((v) => mdCell(String(v))).join(" | ")} |`);
        }
        return lines.join("\n") + "\n";
      },
    },
  };
  let blobUrl = null;
  K.$$("button[data-export]").forEach((b) =>
    b.addEventListener("click", () => {
      const kind = b.dataset.export;
      const text = EXPORTS[kind].text(exportRows());
      const area = document.getElementById("mx-export-text");
      area.value = text;
      area.dataset.kind = kind;
      const link = document.getElementById("mx-download");
      if (blobUrl) URL.revokeObjectURL(blobUrl);
      blobUrl = URL.createObjectURL(new Blob([text], { type: EXPORTS[kind].mime }));
      const name = `k3-audit-matrix.${kind}`;
      link.href = blobUrl;
      link.download = name;
      link.textContent = `Download ${name}`;
      link.hidden = false;
    })
  );

  // reset asks twice: a first click arms it, a second within the same focus confirms
  const resetBtn = document.getElementById("mx-reset");
  resetBtn.addEventListener("click", () => {
    if (resetBtn.dataset.armed !== "true") {
      resetBtn.dataset.armed = "true";
      resetBtn.textContent = "Click again to discard your edits";
      return;
    }
    K.store.remove(KEY);
    state = load();
    resetBtn.dataset.armed = "false";
    resetBtn.textContent = "Reset to the seed rows";
    resetForm();
    render();
    msg.textContent = "Matrix reset to the seed rows.";
  });
  resetBtn.addEventListener("blur", () => {
    resetBtn.dataset.armed = "false";
    resetBtn.textContent = "Reset to the seed rows";
  });

  render();

  // -- Transfer -----------------------------------------------------------------------------------
  const tr = document.getElementById("transfer-controls");
  const ttable = document.getElementById("transfer-table");
  if (tr && ttable) {
    const models = optionLabels("#tr-model");
    const sources = { k2: ttable.dataset.k2Source, v3: ttable.dataset.v3Source };
    const showTransfer = () => {
      const which = tr.elements.model.value;
      const ncOnly = tr.elements.nc.checked;
      K.$$("[data-col]", ttable).forEach((c) => (c.hidden = which !== "both" && c.dataset.col !== which));
      K.$$("tbody tr", ttable).forEach((row) => {
        const cols = which === "both" ? ["k2", "v3"] : [which];
        row.hidden = ncOnly && !cols.some((c) => row.dataset[`nc${c.toUpperCase()}`] === "true");
      });
    };
    tr.addEventListener("change", showTransfer);
    tr.addEventListener("submit", (e) => e.preventDefault());
    K.$("#tr-add").addEventListener("click", () => {
      const which = tr.elements.model.value;
      const cols = which === "both" ? ["k2", "v3"] : [which];
      const rows = [];
      for (const c of cols) {
        K.$$("tbody tr", ttable).forEach((row, i) => {
          const cell = K.$(`td[data-col="${c}"]`, row);
          const field = K.$("th", row).textContent.trim();
          const note = cell.dataset.note;
          rows.push({
            id: `transfer-${c}-${i}`,
            model: models[c],
            layer: row.dataset.layer,
            claim: `${field}: ${cell.dataset.value}`,
            source: sources[c] || "",
            evidence: "official",
            boundary: note ? `not directly comparable with Kimi K3: ${note}` : "directly comparable with Kimi K3's row",
            dependency: "",
            falsify: "compare with the Kimi K3 row for the same field, under the same boundary",
          });
        });
      }
      const n = K.matrixAdd(rows);
      document.getElementById("tr-msg").textContent = n ? `${n} rows added to the audit matrix.` : "Those rows are already in the matrix.";
    });
    showTransfer();
  }
})();

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
  // Stored data is validated before use: a row that is not an object, lacks an id, or has a field
  // that is not a string (null included) is skipped and reported on the page, never rendered.
  const ORIGINS = ["seed", "mine"];
  function readStored() {
    let raw = null;
    try {
      raw = window.localStorage.getItem(KEY);
    } catch (e) {
      return { saved: null, problem: null };
    }
    if (raw === null) return { saved: null, problem: null };
    try {
      return { saved: JSON.parse(raw), problem: null };
    } catch (e) {
      return { saved: null, problem: "the stored matrix is not valid JSON" };
    }
  }
  const clip = (v) => (String(v).length > 40 ? String(v).slice(0, 40) + "…" : String(v));
  function rowProblem(r, seen) {
    if (!r || typeof r !== "object" || Array.isArray(r)) return "it is not an object";
    if (typeof r.id !== "string" || !r.id) return "it has no id";
    if (seen.has(r.id)) return `its id "${clip(r.id)}" repeats an earlier row's`;
    if (!ORIGINS.includes(r.origin)) return "its origin is neither seed nor mine";
    for (const k of FIELDS) {
      if (r[k] === null) return `its field "${k}" is null`;
      if (typeof r[k] !== "string") return `its field "${k}" is ${r[k] === undefined ? "missing" : `a ${typeof r[k]}, not text`}`;
    }
    if (!r.claim.trim()) return "its claim is empty";
    if (!(r.layer in LAYERS)) return `its layer "${clip(r.layer)}" is unknown`;
    if (!(r.evidence in CLASSES)) return `its evidence class "${clip(r.evidence)}" is unknown`;
    return null;
  }
  let loadReport = null; // {whole} or {skipped, total, reasons} when stored data had to be skipped
  function load() {
    const fresh = { rows: SEED.map((r) => ({ ...r })), deleted: [] };
    const { saved, problem } = readStored();
    loadReport = null;
    if (problem) {
      loadReport = { whole: problem };
      return fresh;
    }
    if (saved === null) return fresh;
    if (!saved || typeof saved !== "object" || saved.version !== 1 || !Array.isArray(saved.rows)) {
      loadReport = { whole: "the stored matrix has an unknown format" };
      return fresh;
    }
    const seen = new Set();
    const reasons = [];
    const rows = [];
    saved.rows.forEach((r, i) => {
      const why = rowProblem(r, seen);
      if (why) {
        reasons.push(`row ${i + 1}: ${why}`);
        return;
      }
      seen.add(r.id);
      const row = { id: r.id, origin: r.origin };
      for (const k of FIELDS) row[k] = r[k];
      const seed = SEED_BY_ID.get(r.id);
      // a measured artifact is this build's, never the stored copy's
      rows.push(seed
        ? { ...row, artifact: seed.artifact, artifact_value: seed.artifact_value, artifact_gate: seed.artifact_gate }
        : { ...row, artifact: "", artifact_value: "" });
    });
    const deleted = new Set(Array.isArray(saved.deleted) ? saved.deleted.filter((d) => typeof d === "string") : []);
    for (const s of SEED) if (!seen.has(s.id) && !deleted.has(s.id)) rows.push({ ...s });
    if (reasons.length) loadReport = { skipped: reasons.length, total: saved.rows.length, reasons };
    return { rows, deleted: [...deleted] };
  }
  let state = load();
  let storageOk = true;

  // the load report: a visible alert above the table, rewritten once storage no longer holds the bad data
  const loadMsg = K.el("p", { id: "mx-load-msg", class: "mx-load-msg", role: "alert", hidden: true });
  K.$(".table-wrap", app).before(loadMsg);
  function showLoadReport(dropped) {
    if (!loadReport) {
      loadMsg.hidden = true;
      loadMsg.textContent = "";
      return;
    }
    const tail = dropped
      ? " They have now been dropped from this browser's storage."
      : " They stay in this browser's storage until your next change to the matrix, which drops them.";
    loadMsg.textContent = loadReport.whole
      ? `Your stored matrix could not be used (${loadReport.whole}), so the seed rows are shown.${dropped ? " The unreadable data has now been replaced." : " It stays in this browser's storage until your next change to the matrix, which replaces it."}`
      : `${loadReport.skipped} of ${loadReport.total} stored ${loadReport.total === 1 ? "row was" : "rows were"} skipped because ${loadReport.skipped === 1 ? "it is" : "they are"} malformed (${loadReport.reasons.join("; ")}).${tail}`;
    loadMsg.hidden = false;
  }
  showLoadReport(false);

  function save() {
    storageOk = K.store.set(KEY, { version: 1, rows: state.rows, deleted: state.deleted });
    if (storageOk && loadReport) showLoadReport(true);
    return storageOk;
  }
  const notStored = () => (storageOk ? "" : " It is not stored: this browser's storage is unavailable.");

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
        K.el("td", { "data-f": "evidence", "data-label": "Evidence class" }, K.el("span", { class: `tag tag-${r.evidence}` }, CLASSES[r.evidence] || r.evidence)),
        K.el("td", { "data-label": "Measurement boundary" }, K.el("span", { "data-f": "boundary" }, r.boundary),
          r.dependency ? K.el("span", { class: "dep" }, " Depends on: ", K.el("span", { "data-f": "dependency" }, r.dependency)) : null),
        K.el("td", { "data-f": "falsify", "data-label": "Falsification test" }, r.falsify),
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

  const CANCEL_TEXT = K.$("#mx-cancel").textContent;
  function resetForm() {
    form.reset();
    form.elements.id.value = "";
    K.$("#matrix-form-h").textContent = "Add a row";
    K.$("#mx-submit").textContent = "Add row";
    K.$("#mx-cancel").textContent = CANCEL_TEXT;
    K.$("#mx-cancel").hidden = true;
  }

  function addRow(row) {
    const newId = `mine-${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 7)}`;
    state.rows.push({ id: newId, origin: "mine", ...row, artifact: "", artifact_value: "" });
  }

  form.addEventListener("submit", (e) => {
    e.preventDefault();
    const { id, row } = formRow();
    if (!row.claim) {
      msg.textContent = "A row needs a claim.";
      form.elements.claim.focus();
      return;
    }
    const i = id ? state.rows.findIndex((r) => r.id === id) : -1;
    let said;
    if (i >= 0) {
      state.rows[i] = { ...state.rows[i], ...row };
      said = "Row saved.";
    } else if (id) {
      // the row under edit is gone (deleted, or the matrix was reset): keep the text as a new row
      addRow(row);
      said = "The row you were editing no longer exists, so your text was added as a new row.";
    } else {
      addRow(row);
      said = "Row added.";
    }
    save();
    resetForm();
    render();
    msg.textContent = said + notStored();
  });

  K.$("#mx-cancel").addEventListener("click", () => {
    const wasEditing = Boolean(form.elements.id.value);
    resetForm();
    msg.textContent = wasEditing ? "Editing cancelled." : "Text discarded.";
  });

  // after a delete, focus goes to the next row's Edit button, else the previous row's, else the form
  function focusAfterDelete(index) {
    const edits = K.$$("tbody button[data-act='edit']", table);
    const next = edits[index] || edits[index - 1];
    (next || form.elements.claim).focus();
  }

  table.addEventListener("click", (e) => {
    const b = e.target.closest("button[data-act]");
    if (!b) return;
    const i = state.rows.findIndex((r) => r.id === b.dataset.id);
    if (i < 0) return;
    const r = state.rows[i];
    if (b.dataset.act === "delete") {
      const shownIndex = K.$$("tbody button[data-act='delete']", table).indexOf(b);
      state.rows.splice(i, 1);
      if (r.origin === "seed") state.deleted.push(r.id);
      save();
      render();
      let said = "Row deleted.";
      if (form.elements.id.value === r.id) {
        // the deleted row was open in the form: its text stays there, now as a new row to add
        form.elements.id.value = "";
        K.$("#matrix-form-h").textContent = "Add a row (the row you were editing was deleted)";
        K.$("#mx-submit").textContent = "Add row";
        K.$("#mx-cancel").textContent = "Discard this text";
        K.$("#mx-cancel").hidden = false;
        said = "Row deleted. You were editing it: your text is still in the form, and Add row keeps it as a new row.";
      }
      msg.textContent = said + notStored();
      focusAfterDelete(shownIndex);
      return;
    }
    for (const k of FIELDS) form.elements[k].value = r[k] || "";
    form.elements.id.value = r.id;
    K.$("#matrix-form-h").textContent = "Edit the row";
    K.$("#mx-submit").textContent = "Save changes";
    K.$("#mx-cancel").textContent = CANCEL_TEXT;
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
  // CSV injection (OWASP): a cell that begins with = + - @ tab or carriage return is prefixed with a
  // single quote so a spreadsheet reads it as text; such a cell, and any with a quote, comma or line
  // break, is quoted with its double quotes doubled.
  const csvCell = (s) => {
    const t = /^[=+\-@\t\r]/.test(s) ? `'${s}` : s;
    return t !== s || /[",\n\r]/.test(t) ? `"${t.replaceAll('"', '""')}"` : t;
  };
  // Markdown: HTML is escaped (a renderer shows it as text), as are pipes, backslashes and line breaks
  const mdCell = (s) => s.replaceAll("\\", "\\\\").replaceAll("&", "&amp;").replaceAll("<", "&lt;").replaceAll(">", "&gt;")
    .replaceAll("|", "\\|").replace(/\s*[\r\n]\s*/g, " ");
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
    showLoadReport(false);
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

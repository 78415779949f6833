/* Lesson 8.7: the licensing decision helper.
 *
 * It walks the clauses of site_src/data/lesson_license.toml (paraphrases of K3-SPEC.md section 8)
 * and ends in "Needs separate commercial review: yes/no, because …". The thresholds come from
 * the form's data attributes, which the template fills from the same data file. A study aid, not
 * legal advice: the exact LICENSE text at the release commit decides.
 */
(function () {
  "use strict";
  const K = window.K3Lesson;
  const form = document.getElementById("license-form");
  if (!K || !form) return;

  const T = {
    maas: Number(form.dataset.maas), // US$M revenue in any 12 months, strictly more than
    mau: Number(form.dataset.mau), // millions of monthly active users, strictly more than
    revm: Number(form.dataset.revm), // US$M monthly revenue, strictly more than
  };
  const usd = (x) => `US$${x.toLocaleString("en-US")}M`;

  /**
   * inp: {license: k3|k2|mit|apache, use: internal|product|maas|unsure,
   *       revenue_12m, mau, revenue_month}; money in US$ millions, users in millions.
   * Returns {review, because, display: null | {required, name, because}, steps[], warnings[]}.
   */
  K.licenseDecide = function (inp) {
    const warnings = [];
    // one month's revenue is part of some 12 months' revenue, so the 12-month figure is at least it
    let rev12 = inp.revenue_12m;
    if (inp.revenue_month > inp.revenue_12m) {
      warnings.push(`the monthly revenue (${usd(inp.revenue_month)}) exceeds the 12-month revenue (${usd(inp.revenue_12m)}); the helper uses ${usd(inp.revenue_month)} for both`);
      rev12 = inp.revenue_month;
    }
    const overMau = inp.mau > T.mau;
    const overRevm = inp.revenue_month > T.revm;
    const displayWhy = overMau
      ? `more than ${T.mau}M monthly active users (here ${inp.mau}M)`
      : overRevm
        ? `more than ${usd(T.revm)} monthly revenue (here ${usd(inp.revenue_month)})`
        : `not more than ${T.mau}M monthly active users and not more than ${usd(T.revm)} monthly revenue`;
    const steps = [];
    const r = { warnings, steps };

    if (inp.license === "mit" || inp.license === "apache") {
      const name = inp.license === "mit" ? "Plain MIT" : "Apache-2.0";
      const keep = inp.license === "mit" ? "keep the copyright and permission notice" : "keep the license, the NOTICE file and change notices";
      steps.push(`${name}: a permissive grant; ${keep}.`);
      r.review = false;
      r.because = `${name} has no revenue, user or use thresholds: ${keep}`;
      r.display = null;
      return r;
    }

    if (inp.license === "k2") {
      steps.push("Kimi K2 modified MIT: the MIT grant, plus one display clause.");
      const commercial = inp.use !== "internal";
      const required = commercial && (overMau || overRevm);
      steps.push(commercial ? `Display clause: ${required ? "applies" : "does not apply"}, ${displayWhy}.` : "Display clause: internal use is not a commercial product or service.");
      r.review = false;
      r.because = "Kimi K2's modified MIT license has the display clause only: there is no separate-agreement clause";
      r.display = { required, name: "Kimi K2", because: commercial ? displayWhy : "internal use" };
      return r;
    }

    // Kimi K3 License
    steps.push("Kimi K3 License: an MIT-like grant, with a Model-as-a-Service clause, a display clause and an internal-use exemption.");
    if (inp.use === "internal") {
      steps.push("Exemption: internal use is exempt, so neither extra clause applies.");
      r.review = false;
      r.because = "internal use is exempt from the K3 License's Model-as-a-Service and display clauses";
      r.display = { required: false, name: "Kimi K3", because: "internal use is exempt" };
      return r;
    }
    const over = rev12 > T.maas;
    const revText = `${over ? "more" : "not more"} than ${usd(T.maas)} revenue in any 12 months (here ${usd(rev12)})`;
    if (inp.use === "maas") {
      steps.push(`Model as a Service: you are a MaaS licensee with ${revText}.`);
      r.review = over;
      r.because = over
        ? `a Model-as-a-Service licensee with more than ${usd(T.maas)} revenue in any 12 months (here ${usd(rev12)}) must sign a separate agreement with Moonshot AI before commercial use`
        : `the revenue is not more than ${usd(T.maas)} in any 12 months (here ${usd(rev12)}), so the separate-agreement clause does not apply yet; check again as revenue grows`;
    } else if (inp.use === "product") {
      steps.push("Model as a Service: a product built on the model is not MaaS as long as it does not offer the model itself as a service.");
      r.review = false;
      r.because = "the separate-agreement clause binds only Model-as-a-Service licensees, and this use is a product built on the model";
    } else {
      steps.push(`Model as a Service: unclear, with ${revText}.`);
      r.review = over;
      r.because = over
        ? `whether the offering is Model as a Service decides the separate-agreement clause, and the revenue is more than ${usd(T.maas)} in 12 months (here ${usd(rev12)}): read the LICENSE's definitions at the release commit`
        : `even as Model as a Service the revenue is not more than ${usd(T.maas)} in any 12 months (here ${usd(rev12)})`;
    }
    const required = overMau || overRevm;
    steps.push(`Display clause: ${required ? "applies" : "does not apply"}, ${displayWhy}.`);
    r.display = { required, name: "Kimi K3", because: displayWhy };
    return r;
  };

  function read() {
    const n = (name) => {
      const el = form.elements[name];
      const x = Number(el.value);
      return el.value !== "" && Number.isFinite(x) && x >= 0 ? x : NaN;
    };
    return {
      license: form.elements.license.value,
      use: form.elements.use.value,
      revenue_12m: n("revenue_12m"),
      mau: n("mau"),
      revenue_month: n("revenue_month"),
    };
  }

  function update() {
    const inp = read();
    const steps = document.getElementById("license-steps");
    const display = document.getElementById("license-display");
    const verdict = document.getElementById("license-verdict");
    const bad = ["revenue_12m", "mau", "revenue_month"].filter((k) => Number.isNaN(inp[k]));
    ["revenue_12m", "mau", "revenue_month"].forEach((k) => form.elements[k].setAttribute("aria-invalid", bad.includes(k) ? "true" : "false"));
    if (bad.length) {
      steps.replaceChildren();
      display.textContent = "";
      verdict.textContent = "Enter a number of zero or more in every field.";
      verdict.dataset.review = "";
      return;
    }
    const r = K.licenseDecide(inp);
    steps.replaceChildren(...r.steps.map((s) => K.el("li", {}, s)), ...r.warnings.map((w) => K.el("li", { class: "warn" }, `Check the inputs: ${w}.`)));
    display.textContent = r.display
      ? `Display "${r.display.name}" prominently: ${r.display.required ? "required" : "not required"}, because ${r.display.because}.`
      : "Display clause: none in this license.";
    display.dataset.required = r.display && r.display.required ? "yes" : "no";
    verdict.textContent = `Needs separate commercial review: ${r.review ? "yes" : "no"}, because ${r.because}.`;
    verdict.dataset.review = r.review ? "yes" : "no";
  }

  form.addEventListener("input", update);
  form.addEventListener("change", update);
  form.addEventListener("submit", (e) => e.preventDefault());

  // "Load scenario n": fill the form from a worked scenario's row
  K.$$("#license-scenarios button.try").forEach((b) =>
    b.addEventListener("click", () => {
      const row = K.$(`#license-scenarios tr[data-scenario="${b.dataset.scenario}"]`);
      for (const k of ["license", "use", "revenue_12m", "mau", "revenue_month"]) form.elements[k].value = row.dataset[k];
      update();
      form.elements.license.focus();
    })
  );
  update();
})();

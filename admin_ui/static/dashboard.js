/* loraplex admin dashboard: poll /admin/dashboard.json and update the numbers, residency and chart. */
"use strict";

(function () {
  function pick(obj, path) {
    return path.split(".").reduce(function (o, k) { return o == null ? undefined : o[k]; }, obj);
  }

  function format(value, kind) {
    if (kind === "health") return value ? "Engine healthy" : "Engine restarting";
    if (value === null || value === undefined) return "—";
    if (kind === "percent") return Math.round(value * 100) + "%";
    if (kind === "rate") return value < 10 ? value.toFixed(2) : Math.round(value).toString();
    return String(value);
  }

  function cell(text, cls) {
    const td = document.createElement("td");
    if (cls) {
      const span = document.createElement("span");
      span.className = cls;
      span.textContent = text;
      td.appendChild(span);
    } else {
      td.textContent = text;
    }
    return td;
  }

  function renderResidency(tbody, rows) {
    tbody.textContent = "";
    if (!rows.length) {
      const tr = document.createElement("tr");
      tr.className = "empty-row";
      const td = cell("No adapters loaded yet. They load when activated or first requested.");
      td.colSpan = 6;
      tr.appendChild(td);
      tbody.appendChild(tr);
      return;
    }
    rows.forEach(function (r) {
      const tr = document.createElement("tr");
      tr.appendChild(cell(r.name + (r.active ? "" : " (not active)")));
      tr.appendChild(cell(r.tier, "tier-badge tier-" + r.tier));
      tr.appendChild(cell(r.rank == null ? "—" : String(r.rank)));
      tr.appendChild(cell(String(r.pages)));
      tr.appendChild(cell(r.pinned ? "yes" : "no"));
      const code = document.createElement("code");
      code.textContent = r.digest.slice(0, 12);
      const td = document.createElement("td");
      td.appendChild(code);
      tr.appendChild(td);
      tbody.appendChild(tr);
    });
  }

  function update(root, data) {
    root.ownerDocument.querySelectorAll("[data-field]").forEach(function (el) {
      el.textContent = format(pick(data, el.dataset.field), el.dataset.format);
      if (el.dataset.format === "health") {
        el.classList.toggle("badge-ok", !!data.healthy);
        el.classList.toggle("badge-bad", !data.healthy);
      }
    });
    root.querySelectorAll("progress[data-value]").forEach(function (el) {
      el.max = pick(data, el.dataset.max) || 1;
      el.value = pick(data, el.dataset.value) || 0;
    });
    const tbody = root.querySelector("[data-residency]");
    if (tbody) renderResidency(tbody, data.residency || []);
    const chart = root.querySelector("[data-chart]");
    if (chart && typeof data.chart_svg === "string") {
      chart.innerHTML = data.chart_svg; /* server-rendered, escaped */
      if (chart.dataset.pinned === "true") chart.scrollLeft = chart.scrollWidth; /* still at "now" (admin.js) */
    }
  }

  function start() {
    const root = document.getElementById("dashboard");
    if (!root) return;
    const url = root.dataset.pollUrl;
    const every = parseInt(root.dataset.pollMs, 10) || 2000;
    async function tick() {
      if (!document.hidden) {
        try {
          const res = await fetch(url, { headers: { Accept: "application/json" }, credentials: "same-origin" });
          if (res.status === 401) { window.location.assign("/admin/login?next=/admin"); return; }
          if (res.ok) {
            update(root, await res.json());
            root.dataset.updated = String(Date.now());
          }
        } catch (e) { /* server restarting: try again next tick */ }
      }
      setTimeout(tick, every);
    }
    setTimeout(tick, every);
  }

  document.addEventListener("DOMContentLoaded", start);
})();

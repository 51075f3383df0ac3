/* loraplex admin: behaviour shared by every page (confirmations, copy buttons, table filter, charts at "now"). */
"use strict";

(function () {
  function copyText(text, button) {
    function done(ok) {
      const old = button.textContent;
      button.textContent = ok ? "Copied" : "Press Ctrl+C";
      setTimeout(function () { button.textContent = old; }, 1500);
    }
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(function () { done(true); }, function () { done(false); });
      return;
    }
    const area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.className = "offscreen";
    document.body.appendChild(area);
    area.select();
    let ok = false;
    try { ok = document.execCommand("copy"); } catch (e) { ok = false; }
    document.body.removeChild(area);
    done(ok);
  }

  document.addEventListener("click", function (ev) {
    const confirmer = ev.target.closest("[data-confirm]");
    if (confirmer && !window.confirm(confirmer.getAttribute("data-confirm"))) {
      ev.preventDefault();
      return;
    }
    const copier = ev.target.closest("[data-copy]");
    if (copier) {
      const source = document.querySelector(copier.getAttribute("data-copy"));
      if (source) copyText(source.value !== undefined && source.tagName === "INPUT" ? source.value : source.textContent, copier);
    }
  });

  /* Instant filtering of the adapters table (the form still works without JavaScript). */
  function setupFilter() {
    const input = document.querySelector("[data-filter-input]");
    const status = document.querySelector("[data-filter-status]");
    const table = document.getElementById("adapters-table");
    if (!input || !status || !table) return;
    function apply() {
      const q = input.value.trim().toLowerCase();
      const s = status.value;
      let shown = 0;
      table.querySelectorAll("tbody tr[data-name]").forEach(function (row) {
        const hit = (!q || row.dataset.search.indexOf(q) >= 0) && (!s || row.dataset.status === s);
        row.hidden = !hit;
        if (hit) shown += 1;
      });
      const empty = table.querySelector("[data-empty]");
      if (empty) empty.hidden = shown > 0;
    }
    input.addEventListener("input", apply);
    status.addEventListener("change", apply);
  }

  /* A chart wider than its box (on a phone) opens scrolled to its right end, where "now" is, and stays
     there through live redraws and resizes until the user scrolls back (data-pinned, read by dashboard.js). */
  function atEnd(box) { return box.scrollLeft + box.clientWidth >= box.scrollWidth - 2; }
  function pin(box) { if (box.dataset.pinned === "true") box.scrollLeft = box.scrollWidth; }
  function setupCharts() {
    const boxes = document.querySelectorAll(".chart-box");
    boxes.forEach(function (box) {
      box.dataset.pinned = "true";
      pin(box);
      box.addEventListener("scroll", function () { box.dataset.pinned = String(atEnd(box)); }, { passive: true });
    });
    window.addEventListener("resize", function () { boxes.forEach(pin); });
  }

  document.addEventListener("DOMContentLoaded", setupFilter);
  document.addEventListener("DOMContentLoaded", setupCharts);
})();

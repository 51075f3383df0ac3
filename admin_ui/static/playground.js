/* loraplex admin playground: one streamed completion per chosen model, shown side by side. */
"use strict";

(function () {
  async function stream(url, csrf, payload, column) {
    const text = column.querySelector(".output-text");
    const state = column.querySelector(".output-state");
    const meta = column.querySelector(".output-meta");
    state.textContent = "streaming";
    let res;
    try {
      res = await fetch(url, {
        method: "POST",
        credentials: "same-origin",
        headers: { "Content-Type": "application/json", Accept: "text/event-stream", "X-CSRF-Token": csrf },
        body: JSON.stringify(payload),
      });
    } catch (e) {
      state.textContent = "failed";
      meta.textContent = "the connection failed";
      return;
    }
    if (!res.ok || !res.body) {
      let message = "HTTP " + res.status;
      try { message = (await res.json()).error.message; } catch (e) { /* keep the status */ }
      state.textContent = "failed";
      state.className = "badge badge-bad output-state";
      meta.textContent = message;
      return;
    }
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const chunk = await reader.read();
      if (chunk.done) break;
      buffer += decoder.decode(chunk.value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        event.split("\n").forEach(function (line) {
          if (line.indexOf("data: ") !== 0) return;
          const msg = JSON.parse(line.slice(6));
          if (msg.text) text.textContent += msg.text;
          if (msg.error) {
            state.textContent = "failed";
            state.className = "badge badge-bad output-state";
            meta.textContent = msg.error;
          }
          if (msg.done) {
            state.textContent = "done";
            state.className = "badge badge-ok output-state";
            const rate = msg.seconds > 0 ? " · " + (msg.tokens / msg.seconds).toFixed(1) + " tok/s" : "";
            meta.textContent = msg.tokens + " tokens in " + msg.seconds.toFixed(2) + " s" + rate + " · " + msg.finish_reason;
            column.dataset.done = "1";
          }
        });
      }
    }
  }

  function setup() {
    const form = document.getElementById("playground-form");
    if (!form) return;
    const outputs = document.querySelector("[data-outputs]");
    const template = document.getElementById("output-template");
    const error = form.querySelector("[data-form-error]");
    const run = form.querySelector("[data-run]");
    const csrf = document.querySelector("meta[name=csrf-token]").content;

    form.addEventListener("submit", async function (ev) {
      ev.preventDefault();
      const targets = Array.prototype.filter.call(form.querySelectorAll("input[name=target]"), function (c) { return c.checked; });
      const prompt = form.elements.prompt.value;
      error.hidden = true;
      if (!targets.length || !prompt.trim()) {
        error.textContent = !targets.length ? "Choose at least one model." : "Type a prompt.";
        error.hidden = false;
        return;
      }
      outputs.textContent = "";
      outputs.dataset.columns = String(Math.min(targets.length, 4));
      run.disabled = true;
      const jobs = targets.map(function (t) {
        const column = template.content.firstElementChild.cloneNode(true);
        column.querySelector(".output-title").textContent = t.dataset.label;
        column.dataset.target = t.value || "(base)";
        outputs.appendChild(column);
        const payload = {
          adapter: t.value || null,
          prompt: prompt,
          max_tokens: parseInt(form.elements.max_tokens.value, 10) || 48,
          temperature: parseFloat(form.elements.temperature.value) || 0,
        };
        return stream(form.dataset.generateUrl, csrf, payload, column);
      });
      await Promise.allSettled(jobs);
      run.disabled = false;
    });
  }

  document.addEventListener("DOMContentLoaded", setup);
})();

/* loraplex admin: drag-and-drop upload with a progress bar; the validator's messages beside the form. */
"use strict";

(function () {
  function setup() {
    const form = document.getElementById("upload-form");
    if (!form) return;
    const zone = form.querySelector("[data-dropzone]");
    const input = form.querySelector("input[type=file]");
    const list = form.querySelector("[data-file-list]");
    const bar = form.querySelector("[data-progress]");
    const barText = form.querySelector("[data-progress-text]");
    const errors = form.querySelector("[data-errors]");
    const nameInput = form.querySelector("input[name=name]");
    const submit = form.querySelector("button[type=submit]");

    function showFiles() {
      list.textContent = "";
      Array.prototype.forEach.call(input.files, function (f) {
        const li = document.createElement("li");
        li.textContent = f.name + " (" + Math.max(1, Math.round(f.size / 1024)) + " KiB)";
        list.appendChild(li);
      });
      zone.classList.toggle("has-files", input.files.length > 0);
      const first = input.files[0];
      if (first && !nameInput.value && /\.zip$/i.test(first.name)) {
        nameInput.value = first.name.replace(/\.zip$/i, "").toLowerCase().replace(/[^a-z0-9._-]+/g, "-").replace(/^[^a-z0-9]+/, "").slice(0, 64);
      }
    }

    function showErrors(messages, title) {
      errors.textContent = "";
      if (!messages.length) { errors.hidden = true; return; }
      const p = document.createElement("p");
      p.className = "form-errors-title";
      p.textContent = title || "The adapter was refused:";
      const ul = document.createElement("ul");
      messages.forEach(function (m) {
        const li = document.createElement("li");
        li.textContent = m;
        ul.appendChild(li);
      });
      errors.appendChild(p);
      errors.appendChild(ul);
      errors.hidden = false;
    }

    ["dragenter", "dragover"].forEach(function (type) {
      zone.addEventListener(type, function (ev) { ev.preventDefault(); zone.classList.add("dragging"); });
    });
    ["dragleave", "drop"].forEach(function (type) {
      zone.addEventListener(type, function () { zone.classList.remove("dragging"); });
    });
    zone.addEventListener("drop", function (ev) {
      ev.preventDefault();
      if (ev.dataTransfer && ev.dataTransfer.files.length) {
        input.files = ev.dataTransfer.files;
        showFiles();
      }
    });
    input.addEventListener("change", showFiles);

    form.addEventListener("submit", function (ev) {
      ev.preventDefault();
      showErrors([]);
      const data = new FormData(form);
      const xhr = new XMLHttpRequest();
      xhr.open("POST", form.action);
      xhr.setRequestHeader("Accept", "application/json");
      xhr.setRequestHeader("X-CSRF-Token", data.get("csrf_token") || "");
      bar.hidden = false;
      bar.value = 0;
      barText.textContent = "Uploading…";
      submit.disabled = true;
      xhr.upload.addEventListener("progress", function (e) {
        if (e.lengthComputable) {
          bar.value = Math.round((100 * e.loaded) / e.total);
          barText.textContent = e.loaded < e.total ? "Uploading… " + bar.value + "%" : "Validating against the base model…";
        }
      });
      xhr.addEventListener("load", function () {
        submit.disabled = false;
        let body = null;
        try { body = JSON.parse(xhr.responseText); } catch (e) { body = null; }
        if (xhr.status === 401) { window.location.assign("/admin/login?next=/admin/adapters"); return; }
        if (body && body.ok) {
          bar.value = 100;
          barText.textContent = body.message;
          window.location.assign(body.redirect);
          return;
        }
        bar.hidden = true;
        barText.textContent = "";
        const messages = body && body.messages ? body.messages
          : [(body && body.error && body.error.message) || "upload failed (HTTP " + xhr.status + ")"];
        showErrors(messages);
        errors.focus();
      });
      xhr.addEventListener("error", function () {
        submit.disabled = false;
        bar.hidden = true;
        barText.textContent = "";
        showErrors(["the connection failed; is the server up?"], "Upload failed:");
      });
      xhr.send(data);
    });
  }

  document.addEventListener("DOMContentLoaded", setup);
})();

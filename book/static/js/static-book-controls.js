/* Copyright the From All-Reduce to FSDP authors; part of the course, not vendored.
 *
 * The rendered book has no kernel. Its widgets are drawn from the widget state the page embeds,
 * and only what that state links in the browser works there: a recorded panel's ToggleButtons,
 * each jslink-ed to the stack of recorded runs it switches (labs/viz/recorded.py). Every other
 * control (the "Run on real ranks" button, the sliders, checkboxes, dropdowns and text boxes
 * beside it) would need a kernel: it looked live and did nothing. Here each one is disabled and
 * its row says so. JupyterLab never loads this file, so the notebook's controls stay live.
 *
 * Loaded by myst-nb (nb_ipywidgets_js in _config.yml) only on pages that embed widgets; the
 * embed script draws the widgets after the window's load event, so a MutationObserver catches
 * each control as it appears.
 */
(function () {
  "use strict";
  var NOTE = "runs in a Jupyter kernel; open the notebook to use it";
  // Controls that work without a kernel, through links in the page's widget state.
  var WORKS_IN_PAGE = ".labs-recorded-panel > .widget-toggle-buttons";
  // Parts of a widget view a reader operates (noUi-target: a slider's track and handle;
  // contenteditable: a slider's readout).
  var CONTROLS = "button, input, select, textarea, .noUi-target, [contenteditable]";
  var DONE = "labs-kernel-only";
  var NOTE_CLASS = "labs-kernel-note";

  function disable(el) {
    if (el.matches(".noUi-target")) {
      el.setAttribute("disabled", ""); // noUiSlider ignores a target that has the attribute
    } else if (el.matches("[contenteditable]")) {
      el.setAttribute("contenteditable", "false");
    } else {
      el.disabled = true;
    }
    el.setAttribute("aria-disabled", "true");
    el.title = NOTE;
    el.classList.add(DONE);
  }

  function addNote(control) {
    var row = control.closest(".widget-hbox, .widget-vbox, .widget-box") ||
      control.closest(".widget-subarea");
    if (!row || row.querySelector(":scope > ." + NOTE_CLASS)) {
      return;
    }
    var note = document.createElement("span");
    note.className = NOTE_CLASS;
    note.textContent = NOTE;
    row.appendChild(note);
    row.classList.add("labs-kernel-row"); // the note takes a line of its own under the row
  }

  function settle() {
    document.querySelectorAll(".widget-subarea").forEach(function (area) {
      area.querySelectorAll(CONTROLS).forEach(function (el) {
        if (el.classList.contains(DONE) || el.closest(WORKS_IN_PAGE) ||
            el.closest(".jp-OutputArea")) {
          return; // done, switched in the page, or part of an output (not a control)
        }
        disable(el);
        addNote(el);
      });
    });
  }

  new MutationObserver(settle).observe(document.documentElement, { childList: true, subtree: true });
  settle();
})();

/* Copyright the From All-Reduce to FSDP authors; part of the course, not vendored.
 *
 * ipywidgets 8 (@jupyter-widgets/controls and base) typesets widget descriptions with the
 * MathJax 2 API, `MathJax.Hub.Queue(["Typeset", MathJax.Hub, el])`. The book loads MathJax 3,
 * which has no `Hub`, so every widget label threw "Cannot read properties of undefined
 * (reading 'Queue')" and $math$ in a label stayed raw. This maps the call onto MathJax 3.
 *
 * Loaded by myst-nb (nb_ipywidgets_js in _config.yml) only on pages that embed widgets, with
 * `defer` so it runs after the deferred MathJax script and before the widgets render (the
 * embed script renders on the window `load` event).
 */
(function () {
  "use strict";
  var mj = window.MathJax;
  // No MathJax on this page, MathJax 2 (has its own Hub), or still the config object.
  if (!mj || mj.Hub || typeof mj.version !== "string") {
    return;
  }
  mj.Hub = {
    Queue: function (job) {
      var el = Array.isArray(job) ? job[2] : undefined;
      var ready = (mj.startup && mj.startup.promise) || Promise.resolve();
      return ready
        .then(function () {
          if (typeof mj.typesetPromise === "function") {
            return mj.typesetPromise(el ? [el] : undefined);
          }
        })
        .catch(function (err) {
          console.warn("MathJax could not typeset a widget label:", err);
        });
    },
  };
})();

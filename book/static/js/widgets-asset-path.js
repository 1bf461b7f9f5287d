/* Copyright the From All-Reduce to FSDP authors; part of the course, not vendored.
 *
 * Where the widget bundle finds its own files (the Font Awesome fonts its CSS names). Webpack
 * builds embed-amd.js to take its public path from the AMD module's URI, and RequireJS makes
 * that URI from the module's name and the page's folder: on notebooks/05_ddp.html the fonts
 * were looked for in notebooks/@jupyter-widgets/ and notebooks/@jupyter-widgets/html-manager/
 * dist/, where nothing is, and six requests failed on every widget page. Mapping the
 * @jupyter-widgets names onto the folder of embed-amd.js puts the public path there, beside
 * the fonts vendored with it (book/static/vendor/README.md).
 *
 * Loaded by myst-nb (nb_ipywidgets_js in _config.yml) after require.js and before
 * embed-amd.js, not deferred: the embed script's modules must find this configuration.
 */
(function () {
  "use strict";
  if (typeof window.require !== "function" || typeof window.require.config !== "function") {
    return;
  }
  var here = document.currentScript && document.currentScript.src;
  if (!here) {
    return;
  }
  // this file is _static/js/; the bundle and its fonts are in _static/vendor/html-manager/
  var bundle = new URL("../vendor/html-manager", here).href;
  window.require.config({
    paths: {
      "@jupyter-widgets/html-manager/dist": bundle,
      "@jupyter-widgets": bundle,
    },
  });
})();

/* Copyright the From All-Reduce to FSDP authors; part of the course, not vendored.
 *
 * Search excerpts for the book opened from disk. Sphinx's searchtools.js cuts each hit's
 * excerpt from the hit's page, which it fetch()-es; a browser refuses fetch() of a file: URL,
 * so offline every hit showed its title only. book/ext/offline_search.py keeps the text of
 * every page in _static/search-pages.js (window.LABS_SEARCH_PAGES, docname -> HTML, loaded
 * before this file on the search page only); here the search's fetch() of a page is answered
 * from it. Served over HTTP the pages are fetched as usual.
 */
(function () {
  "use strict";
  var pages = window.LABS_SEARCH_PAGES;
  if (window.location.protocol !== "file:" || !pages || typeof window.fetch !== "function") {
    return;
  }
  var root = new URL(document.documentElement.dataset.content_root || "./", window.location.href);
  var suffix = (window.DOCUMENTATION_OPTIONS && DOCUMENTATION_OPTIONS.FILE_SUFFIX) || ".html";
  var fetchFromDisk = window.fetch.bind(window);

  function docname(url) {
    if (url.protocol !== "file:" || url.pathname.indexOf(root.pathname) !== 0) {
      return null;
    }
    var rest = decodeURIComponent(url.pathname.slice(root.pathname.length));
    return rest.slice(-suffix.length) === suffix ? rest.slice(0, -suffix.length) : null;
  }

  window.fetch = function (input, init) {
    var url = new URL(typeof input === "string" ? input : input.url, window.location.href);
    var name = docname(url);
    if (name !== null && Object.prototype.hasOwnProperty.call(pages, name)) {
      return Promise.resolve(new Response(pages[name], {
        status: 200, headers: { "Content-Type": "text/html; charset=utf-8" },
      }));
    }
    return fetchFromDisk(input, init);
  };
})();

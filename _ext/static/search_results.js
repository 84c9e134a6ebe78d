// The search page of the course website (_ext/site_search.py says why).
// 1. Sphinx fetches each result's page for the text around the word found; a browser refuses
//    that for pages opened from disk, so the pages' text comes from _static/page_texts.js.
// 2. A result that is an index entry (a glossary term) is titled with its entry, not with its
//    page's title alone.
// 3. The search page keeps its own search form: the sidebar's search button goes.
(function () {
  "use strict";
  var texts = window.DPCOURSE_PAGE_TEXTS || {};
  var realFetch = window.fetch ? window.fetch.bind(window) : null;
  window.fetch = function (resource, options) {
    var url = String(resource && resource.url ? resource.url : resource);
    var key = url.replace(/^(\.\/)+/, "").split("#")[0];
    if (Object.prototype.hasOwnProperty.call(texts, key)) {
      return Promise.resolve(new Response(texts[key], {headers: {"Content-Type": "text/html"}}));
    }
    return realFetch(resource, options);
  };
  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll(".bd-sidebar-primary .search-button-field").forEach(function (b) {
      b.remove();
    });
    if (typeof Search === "undefined" || !Search._performSearch) return;
    var perform = Search._performSearch;
    Search._performSearch = function () {
      var results = perform.apply(this, arguments);
      var index = Search._index || {};
      var names = {};
      Object.keys(index.indexentries || {}).forEach(function (entry) {
        index.indexentries[entry].forEach(function (found) {
          if (found[1]) names[index.filenames[found[0]] + "#" + found[1]] = entry;
        });
      });
      results.forEach(function (r) {
        var entry = names[r[5] + r[2]];
        if (entry && r[1].indexOf(" > ") < 0) r[1] = r[1] + " > " + entry;
      });
      return results;
    };
  });
})();

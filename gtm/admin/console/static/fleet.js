// Swap in the map and the tables every second; the server renders them (one template for the
// first page and every refresh), so this script only fetches and replaces.
(function () {
  "use strict";
  var live = document.getElementById("live");
  if (!live) { return; }
  var busy = false;
  function refresh() {
    if (busy || document.hidden) { return; }
    busy = true;
    fetch(live.dataset.src, { credentials: "same-origin", headers: { "accept": "text/html" } })
      .then(function (r) {
        if (r.redirected || r.status === 401) { window.location = "/console/signin?expired=1"; return null; }
        return r.ok ? r.text() : null;
      })
      .then(function (html) {
        if (html !== null) { live.innerHTML = html; live.dataset.updated = String(Date.now()); }
      })
      .catch(function () { /* the next tick tries again */ })
      .finally(function () { busy = false; });
  }
  setInterval(refresh, 1000);
})();

// The page's view switches (harness/publishing/site.py writes the buttons and selects). Without this script every
// section shows all four frameworks; with it, one choice holds for every section at once: a tab shows one
// framework everywhere, "Side by side" shows the two selected ones everywhere. Narrow screens start on a tab.
(function () {
  "use strict";
  var narrow = window.matchMedia("(max-width: 899px)").matches;
  var state = {view: narrow ? "pytorch" : "all", left: "pytorch", right: "jax"};

  function shown() {
    if (state.view === "all") { return null; }
    if (state.view === "pair") { return state.left === state.right ? [state.left] : [state.left, state.right]; }
    return [state.view];
  }

  function render() {
    var frameworks = shown();
    document.body.setAttribute("data-view", frameworks === null ? "all" : frameworks.length === 2 ? "pair" : "one");
    document.querySelectorAll(".fw").forEach(function (column) {
      var place = frameworks === null ? 0 : frameworks.indexOf(column.getAttribute("data-fw"));
      column.hidden = place < 0;
      column.style.order = String(place);
    });
    document.querySelectorAll(".tab").forEach(function (tab) {
      tab.setAttribute("aria-pressed", String(tab.getAttribute("data-fw") === state.view));
    });
    document.getElementById("compare").setAttribute("aria-pressed", String(state.view === "pair"));
  }

  document.querySelectorAll(".tab").forEach(function (tab) {
    tab.addEventListener("click", function () { state.view = tab.getAttribute("data-fw"); render(); });
  });
  var left = document.getElementById("left"), right = document.getElementById("right");
  left.value = state.left;
  right.value = state.right;
  function pair() { state.left = left.value; state.right = right.value; state.view = "pair"; render(); }
  left.addEventListener("change", pair);
  right.addEventListener("change", pair);
  document.getElementById("compare").addEventListener("click", pair);
  render();
}());

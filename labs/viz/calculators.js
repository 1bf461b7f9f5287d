// The memory calculators of chapters 6 and 7, computed in the reader's browser.
//
// labs/viz/calculators.py writes this file into the page with one call per calculator:
// labsCalculators.zero(rootId, config) or labsCalculators.budget(rootId, config). The
// arithmetic is that of labs.experiments.zero.bytes_per_parameter and
// labs.experiments.recipe.memory_budget (with labs.activations.activation_bytes); every
// number it shows also sits, unrounded, in a data-value attribute, which
// tests/test_book_panels.py compares with labs' own functions for the same inputs.
(function () {
  "use strict";
  if (window.labsCalculators) {
    return; // a page with two calculators carries this file twice
  }

  function el(tag, attrs, text) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    if (text !== undefined) { node.textContent = text; }
    return node;
  }

  // Python's "{:g}": six significant digits, no trailing zeros.
  function g(x) { return String(Number(x.toPrecision(6))); }

  function field(root, name) { return root.querySelector("[name=" + name + "]"); }

  // A positive whole number from an input, or an Error naming the input.
  function positiveInt(root, name, label) {
    var text = field(root, name).value.trim();
    var value = Number(text);
    if (!/^[0-9]+$/.test(text) || !(value >= 1)) {
      throw new Error(label + " must be a whole number of at least 1, got '" + text + "'.");
    }
    return value;
  }

  function positiveNumber(root, name, label) {
    var text = field(root, name).value.trim();
    var value = Number(text);
    if (text === "" || !isFinite(value) || !(value > 0)) {
      throw new Error(label + " must be a number above 0, got '" + text + "'.");
    }
    return value;
  }

  function cell(row, text, value, name) {
    var td = el("td", value === undefined ? {} : {"data-value": String(value),
                                                   "data-name": name}, text);
    row.appendChild(td);
    return td;
  }

  function table(header) {
    var t = el("table", {"class": "labs-calc-table"});
    var head = el("tr");
    header.forEach(function (h) { head.appendChild(el("th", {}, h)); });
    t.appendChild(head);
    return t;
  }

  // One horizontal bar of stacked parts: [[label, value, colour], ...], scaled to `max`.
  function bar(label, parts, max) {
    var line = el("div", {"class": "labs-calc-bar"});
    line.appendChild(el("span", {"class": "labs-calc-bar-label"}, label));
    var track = el("span", {"class": "labs-calc-bar-track"});
    parts.forEach(function (p) {
      if (p[1] <= 0) { return; }
      var piece = el("span", {"title": p[0] + ": " + g(p[1])});
      piece.style.width = (100 * p[1] / max) + "%";
      piece.style.background = p[2];
      track.appendChild(piece);
    });
    line.appendChild(track);
    return line;
  }

  function legend(parts) {
    var box = el("div", {"class": "labs-calc-legend"});
    parts.forEach(function (p) {
      var key = el("span", {"class": "labs-calc-key"});
      key.style.background = p[1];
      box.appendChild(key);
      box.appendChild(document.createTextNode(" " + p[0] + "  "));
    });
    return box;
  }

  function wire(root, compute) {
    var out = root.querySelector(".labs-calc-out");
    function redraw() {
      out.textContent = "";
      try {
        compute(out);
      } catch (err) {
        out.appendChild(el("p", {"class": "labs-calc-error"}, "Cannot compute: " + err.message));
      }
    }
    root.querySelectorAll("input, select").forEach(function (input) {
      input.addEventListener("input", redraw);
      input.addEventListener("change", redraw);
    });
    redraw();
  }

  // Chapter 6: bytes per parameter and GB per rank at every ZeRO stage
  // (labs.experiments.zero.bytes_per_parameter). config.recipes: {name: [params, grads,
  // optimizer]} bytes per parameter unsharded; config.stages: [[name, stage], ...].
  function zero(rootId, config) {
    var root = document.getElementById(rootId);
    wire(root, function (out) {
      var billions = positiveNumber(root, "parameters", "parameters (billions)");
      var n = positiveInt(root, "world_size", "world size");
      var memory = positiveNumber(root, "memory_gb", "GB per GPU");
      var recipe = field(root, "recipe").value;
      var unsharded = config.recipes[recipe];
      var parameters = billions * 1e9;
      var t = table(["stage", "params", "grads", "optimizer (+ master)", "bytes / param",
                     "GB per rank", "max params (B) in " + g(memory) + " GB"]);
      var rows = config.stages.map(function (s) {
        var stage = s[1];
        var p = stage >= 3 ? unsharded[0] / n : unsharded[0];
        var gr = stage >= 2 ? unsharded[1] / n : unsharded[1];
        var o = stage >= 1 ? unsharded[2] / n : unsharded[2];
        var total = p + gr + o;
        var row = el("tr", {"data-stage": s[0]});
        cell(row, s[0]);
        cell(row, g(p), p, "params");
        cell(row, g(gr), gr, "grads");
        cell(row, g(o), o, "optimizer");
        cell(row, g(total), total, "bytes_per_param");
        cell(row, (parameters * total / 1e9).toFixed(2), parameters * total / 1e9, "gb_per_rank");
        cell(row, (memory * 1e9 / total / 1e9).toFixed(2), memory / total, "max_params_b");
        t.appendChild(row);
        return [s[0], [["parameters", parameters * p / 1e9, config.colours[0]],
                       ["gradients", parameters * gr / 1e9, config.colours[1]],
                       ["optimizer", parameters * o / 1e9, config.colours[2]]],
                parameters * total / 1e9];
      });
      out.appendChild(t);
      var max = Math.max.apply(null, rows.map(function (r) { return r[2]; }));
      out.appendChild(el("p", {"class": "labs-calc-caption"},
                         "GB per rank, model state only (" + g(billions) + " B parameters, N = " +
                         n + "; the dashed line: " + g(memory) + " GB)"));
      var chart = el("div", {"class": "labs-calc-chart"});
      rows.forEach(function (r) { chart.appendChild(bar(r[0], r[1], Math.max(max, memory))); });
      var limit = el("div", {"class": "labs-calc-limit"});
      limit.style.left = "calc(10em + (100% - 10em) * " + (memory / Math.max(max, memory)) + ")";
      chart.appendChild(limit);
      out.appendChild(chart);
      out.appendChild(legend([["parameters", config.colours[0]],
                              ["gradients", config.colours[1]],
                              ["optimizer (+ master)", config.colours[2]]]));
    });
  }

  // labs.activations.activation_bytes, in bytes.
  function activationBytes(b, t, d, h, l, v, e, checkpointing) {
    var tokens = b * t;
    var outside = 8 * t + tokens * (2 * d + 2 + v) * e + e;
    if (checkpointing) {
      return tokens * l * d * e + outside;
    }
    var perBlock = tokens * (16 * d + h * t + 4) * e + t * t;
    return l * perBlock + outside;
  }

  // Chapter 7: labs.experiments.recipe.memory_budget: what a rank holds at the peak of a step.
  function budget(rootId, config) {
    var root = document.getElementById(rootId);
    wire(root, function (out) {
      var d = positiveInt(root, "width", "width");
      var h = positiveInt(root, "heads", "heads");
      var l = positiveInt(root, "blocks", "blocks");
      var t = positiveInt(root, "sequence", "sequence");
      var b = positiveInt(root, "micro_batch", "micro-batch");
      var v = positiveInt(root, "vocab", "vocabulary");
      var n = positiveInt(root, "world_size", "world size");
      var k = positiveInt(root, "accumulation", "micro-batches");
      var e = field(root, "dtype").value === "bf16" ? 2 : 4;
      var ckpt = field(root, "checkpointing").checked;
      if (d % h !== 0) {
        throw new Error("width " + d + " must divide into " + h + " heads of equal size.");
      }
      var block = 12 * d * d + 13 * d;
      var rootUnit = (v + t) * d + 2 * d;
      var pad = function (x) { return Math.ceil(x / n) * n; };
      var padded = l * pad(block) + pad(rootUnit);
      var shard = padded / n;
      var rows = [
        ["parameters", 4 * shard, config.how.parameters],
        ["optimizer state", 8 * shard, config.how.optimizer],
        ["gradients", k > 1 ? 4 * padded : 0, k > 1 ? config.how.gradients_kept
                                                     : config.how.gradients_none],
        ["activations", activationBytes(b, t, d, h, l, v, e, ckpt),
         ckpt ? config.how.activations_ckpt : config.how.activations],
        ["communication buffers", (ckpt ? 3 : 1) * e * pad(block),
         ckpt ? config.how.buffers_ckpt : config.how.buffers]
      ];
      if (ckpt) {  // the block being recomputed for its backward: its activations again
        rows.push(["recomputed block", b * t * (16 * d + h * t + 4) * e + t * t,
                   config.how.recomputed]);
      }
      var total = rows.reduce(function (s, r) { return s + r[1]; }, 0);
      var params = l * block + rootUnit;
      var summary = el("p", {"class": "labs-calc-summary"});
      summary.appendChild(document.createTextNode(
        Number((params / 1e9).toPrecision(3)) + " B parameters, world size " + n + ", " +
        (e === 2 ? "bf16" : "fp32") + " compute, micro-batch " + b + " x " + t + " tokens, " +
        (ckpt ? "with" : "without") + " checkpointing: "));
      var strong = el("strong", {"data-name": "total_gib", "data-value": String(total)},
                      (total / Math.pow(2, 30)).toFixed(2) + " GiB per rank at the peak");
      summary.appendChild(strong);
      out.appendChild(summary);
      var tab = table(["held per rank", "GiB", "closed form"]);
      rows.forEach(function (r) {
        var row = el("tr", {"data-row": r[0]});
        cell(row, r[0]);
        cell(row, (r[1] / Math.pow(2, 30)).toFixed(3), r[1], "bytes");
        cell(row, r[2]);
        tab.appendChild(row);
      });
      out.appendChild(tab);
      var chart = el("div", {"class": "labs-calc-chart"});
      chart.appendChild(bar("GiB at the peak", rows.map(function (r, i) {
        return [r[0], r[1] / Math.pow(2, 30), config.colours[i % config.colours.length]];
      }), total / Math.pow(2, 30)));
      out.appendChild(chart);
      out.appendChild(legend(rows.map(function (r, i) {
        return [r[0], config.colours[i % config.colours.length]];
      })));
    });
  }

  window.labsCalculators = {zero: zero, budget: budget, activationBytes: activationBytes};
})();

// The bank explorer's pages. Every bank text reaches the page through textContent (never as
// markup), and the token lives in sessionStorage: this tab only, gone when it closes.
"use strict";
(function () {
  const body = document.body;
  const base = body.dataset.base;
  const page = body.dataset.page;
  const TOKEN_KEY = "crl-explorer-token";
  const statusEl = document.getElementById("status");

  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }
  function textCell(text) {  // <bdi>: an RTL override inside a text cannot reorder the row around it
    const td = el("td", null, "text");
    td.appendChild(el("bdi", text));
    return td;
  }
  function num(v, digits) {
    if (v === null || v === undefined) return "–";
    return digits === undefined ? String(v) : Number(v).toFixed(digits);
  }
  function entryLink(id) {
    const a = el("a", "#" + String(id));
    a.href = base + "/entry/" + encodeURIComponent(String(Number(id)));
    return a;
  }
  function setStatus(text, isError) {
    statusEl.textContent = text || "";
    statusEl.className = isError ? "status error" : "status";
  }

  function askToken(message) {
    return new Promise(function (resolve) {
      const form = document.getElementById("token-form");
      const input = document.getElementById("token-input");
      document.getElementById("token-error").textContent = message || "";
      form.hidden = false;
      input.focus();
      form.onsubmit = function (ev) {
        ev.preventDefault();
        sessionStorage.setItem(TOKEN_KEY, input.value.trim());
        input.value = "";
        form.hidden = true;
        resolve();
      };
    });
  }

  async function api(path, asBlob) {
    for (;;) {
      const headers = {};
      const token = sessionStorage.getItem(TOKEN_KEY);
      if (token) headers["Authorization"] = "Bearer " + token;
      const resp = await fetch(base + "/api" + path, { headers: headers, cache: "no-store" });
      if (resp.status === 401) {
        sessionStorage.removeItem(TOKEN_KEY);
        setStatus("No data without the service's token.", true);
        await askToken(token ? "That token was refused." : "");
        setStatus("");
        continue;
      }
      if (!resp.ok) {
        let detail = resp.statusText;
        try { detail = JSON.stringify((await resp.json()).detail); } catch (e) { /* not JSON */ }
        throw new Error(resp.status + ": " + detail);
      }
      return asBlob ? resp.blob() : resp.json();
    }
  }

  async function summary() {
    const s = await api("/summary");
    document.getElementById("summary").textContent =
      s.entries + " entries" + (s.quarantined ? " (" + s.quarantined + " quarantined)" : "") +
      (s.snapshots && s.snapshots.length ? " · " + s.snapshots.length + " snapshots, latest " + s.snapshots[0].name : "") +
      (s.read_only ? " · read-only" : "") + (s.embedder ? " · " + s.embedder : "");
    return s;
  }

  // ---------------------------------------------------------------- bank
  async function bankPage() {
    const params = new URLSearchParams(location.search);
    const state = {
      sort: params.get("sort") || "id", order: params.get("order") || "asc",
      page: Number(params.get("page") || 1), per_page: Number(params.get("per_page") || 50),
      q: params.get("q") || "", min_retrievals: Number(params.get("min_retrievals") || 0),
      step_min: params.get("step_min") || "", step_max: params.get("step_max") || "",
      credited: params.get("credited") === "true",
    };
    const f = {
      q: document.getElementById("f-q"), min: document.getElementById("f-min-retrievals"),
      smin: document.getElementById("f-step-min"), smax: document.getElementById("f-step-max"),
      credited: document.getElementById("f-credited"), per: document.getElementById("f-per-page"),
    };
    f.q.value = state.q; f.min.value = state.min_retrievals; f.smin.value = state.step_min;
    f.smax.value = state.step_max; f.credited.checked = state.credited; f.per.value = String(state.per_page);

    function query() {
      const p = new URLSearchParams();
      for (const k of ["sort", "order", "page", "per_page", "q", "min_retrievals", "step_min", "step_max"]) {
        if (state[k] !== "" && state[k] !== null) p.set(k, String(state[k]));
      }
      if (state.credited) p.set("credited", "true");
      return p.toString();
    }
    async function load() {
      const qs = query();
      history.replaceState(null, "", "?" + qs);
      setStatus("Loading…");
      const data = await api("/entries?" + qs);
      setStatus("");
      const tbody = document.querySelector("#entries tbody");
      tbody.replaceChildren();
      document.getElementById("entries").classList.toggle("no-utility", !data.has_utility);
      for (const e of data.entries) {
        const tr = el("tr");
        tr.dataset.id = String(e.id);
        const idCell = el("td"); idCell.appendChild(entryLink(e.id)); tr.appendChild(idCell);
        if (e.pinned) idCell.appendChild(el("span", " pinned", "note pinned"));  // a user's entry: the extractor never rewrites it
        const t = textCell(e.text + (e.text_length > e.text.length ? " …" : ""));
        tr.appendChild(t);
        tr.appendChild(el("td", num(e.rbar, 3), "num rbar"));
        tr.appendChild(el("td", num(e.episodes), "num"));
        tr.appendChild(el("td", num(e.retrievals), "num retrievals"));
        tr.appendChild(el("td", num(e.train_count), "num"));
        tr.appendChild(el("td", e.last_trained < 0 ? "never" : num(e.last_trained), "num"));
        tr.appendChild(el("td", num(e.version), "num"));
        tr.appendChild(el("td", num(e.created_step), "num"));
        tr.appendChild(el("td", num(e.utility, 3), "num utility"));
        tbody.appendChild(tr);
      }
      document.getElementById("page-info").textContent =
        "page " + data.page + " of " + data.pages + " · " + data.total + " entries · sorted by " + data.sort + " " + data.order;
      document.getElementById("prev").disabled = data.page <= 1;
      document.getElementById("next").disabled = data.page >= data.pages;
      for (const b of document.querySelectorAll("#entries th button")) {
        b.classList.toggle("sorted", b.dataset.sort === data.sort);
        b.dataset.order = b.dataset.sort === data.sort ? data.order : "";
      }
    }
    for (const b of document.querySelectorAll("#entries th button")) {
      b.addEventListener("click", function () {
        state.order = state.sort === b.dataset.sort && state.order === "desc" ? "asc" :
          (state.sort === b.dataset.sort ? "desc" : (b.dataset.sort === "id" ? "asc" : "desc"));
        state.sort = b.dataset.sort; state.page = 1; load().catch(fail);
      });
    }
    document.getElementById("prev").addEventListener("click", function () { state.page -= 1; load().catch(fail); });
    document.getElementById("next").addEventListener("click", function () { state.page += 1; load().catch(fail); });
    document.getElementById("filters").addEventListener("submit", function (ev) {
      ev.preventDefault();
      state.q = f.q.value; state.min_retrievals = Number(f.min.value || 0); state.step_min = f.smin.value;
      state.step_max = f.smax.value; state.credited = f.credited.checked; state.per_page = Number(f.per.value);
      state.page = 1; load().catch(fail);
    });
    await load();
  }

  // ---------------------------------------------------------------- entry
  function fieldRows(table, rows) {
    table.replaceChildren();
    for (const [k, v] of rows) {
      const tr = el("tr"); tr.appendChild(el("th", k)); tr.appendChild(el("td", v)); table.appendChild(tr);
    }
  }
  const KIND = { add: "Add", update: "Update", merge: "Merge", merged_away: "Merged into another entry",
                 discard: "Discarded by a Merge", delete: "Deleted",
                 evict: "Evicted (bank capacity)" };

  async function entryPage() {
    const id = body.dataset.entryId;
    const d = await api("/entries/" + encodeURIComponent(id));
    const e = d.entry;
    const last = d.events.length ? d.events[d.events.length - 1] : null;
    document.getElementById("entry-text").textContent =
      e ? e.text : (last && last.detail && last.detail.text ? last.detail.text : "");
    const o = d.origin;
    const writer = o ? o.written_by + (o.model_step !== null && o.model_step !== undefined ? " (model step " + o.model_step + ")" : "") +
      " at step " + o.step + ", " + new Date(o.written_at * 1000).toISOString().replace("T", " ").slice(0, 19) + " UTC" : "not recorded (written before writers were kept)";
    fieldRows(document.getElementById("entry-fields"), e ? [
      ["state", o && o.quarantined ? "quarantined: hidden from retrieval (crl-experience quarantine --undo brings it back)" : "in the bank"],
      ["written by", writer], ["r̄(m)", d.rbar ? num(d.rbar.rbar, 3) + " over " + d.rbar.episodes + " episodes in " + d.rbar.steps + " steps" : "not credited"],
      ["retrievals c(m)", num(e.retrievals)], ["c_train", num(e.train_count)], ["t_last", e.last_trained < 0 ? "never" : num(e.last_trained)],
      ["version", num(e.version)], ["created step", num(e.created_step)], ["EDGE utility", num(e.utility, 3)],
      ["tags", e.tags.join(", ")],
      ["distilled from", e.source || "(no episode: written by a user, a config or a Merge)"],
      ["retrieved by", e.retrieved_by === e.text ? "its text" : e.retrieved_by],
      ["pinned", e.pinned ? "yes: a user's entry, which the extractor may cite but never rewrite, merge or delete" : "no"],
    ] : [["state", "no longer in the bank (" + (last ? KIND[last.kind] || last.kind : "?") + ")"],
         ["r̄(m)", d.rbar ? num(d.rbar.rbar, 3) + " over " + d.rbar.episodes + " episodes" : "not credited"]]);
    const hist = document.getElementById("history");
    hist.replaceChildren();
    for (const ev of d.events) {
      const li = el("li", null, "event " + ev.kind);
      li.dataset.kind = ev.kind;
      li.appendChild(el("strong", (KIND[ev.kind] || ev.kind) + " at step " + ev.step));
      if (ev.version !== null && ev.version !== undefined) li.appendChild(el("span", " · version " + ev.version, "note"));
      if (ev.detail && ev.detail.derived) li.appendChild(el("span", " · from created_step (written before the event log)", "note"));
      if (ev.detail && ev.detail.sources) {
        const s = el("div", "from entries: ");
        for (const src of ev.detail.sources) { s.appendChild(entryLink(src)); s.appendChild(document.createTextNode(" ")); }
        li.appendChild(s);
      }
      if (ev.detail && ev.detail.into !== undefined) {
        const s = el("div", "into entry "); s.appendChild(entryLink(ev.detail.into)); li.appendChild(s);
      }
      const t = ev.text !== undefined ? ev.text : (ev.detail && ev.detail.text);
      if (t !== undefined && t !== null) li.appendChild(el("pre", t, "text"));
      hist.appendChild(li);
    }
    const ctb = document.querySelector("#credits tbody");
    ctb.replaceChildren();
    for (const c of d.credits) {
      const tr = el("tr");
      tr.appendChild(el("td", num(c.step))); tr.appendChild(el("td", num(c.rbar, 3))); tr.appendChild(el("td", num(c.episodes)));
      ctb.appendChild(tr);
    }
    const etb = document.querySelector("#episodes tbody");
    etb.replaceChildren();
    const note = document.getElementById("episodes-note");
    if (d.episodes === null) note.textContent = "The run kept no episodes here (no trajectories.jsonl beside the bank).";
    else note.textContent = d.episodes.length + " episodes.";
    for (const ep of d.episodes || []) {
      const tr = el("tr", null, ep.success ? "win" : "loss");
      for (const v of [ep.step, ep.outcome, ep.success ? "yes" : "no", ep.env_id, ep.seed, ep.actions, ep.version]) tr.appendChild(el("td", num(v)));
      tr.appendChild(textCell(ep.task));
      etb.appendChild(tr);
    }
    const p = d.provenance;
    document.getElementById("provenance-note").textContent = p ?
      "extractor version " + num(p.extractor_version) + " · " + p.tokens + " answer tokens" :
      "No sample: a seed entry, an import, or written by hand.";
    document.getElementById("provenance-prompt").textContent = p ? p.prompt : "";
    document.getElementById("provenance-response").textContent = p ? p.response : "";
  }

  // ---------------------------------------------------------------- search
  async function searchPage() {
    const form = document.getElementById("search-form");
    form.addEventListener("submit", function (ev) {
      ev.preventDefault();
      run().catch(fail);
    });
    async function run() {
      const q = document.getElementById("search-q").value;
      const k = document.getElementById("search-k").value || "1";
      setStatus("Searching…");
      const d = await api("/search?" + new URLSearchParams({ q: q, k: k }).toString());
      setStatus(d.picked.length ? "" : "The bank is empty.");
      const s = d.settings;
      document.getElementById("search-settings").textContent = "k = " + s.k + ", over-fetch " + s.overfetch +
        " × k, λ = " + s.diversity_lambda + ", recency window " + s.recency_window_s + " s";
      const tbody = document.querySelector("#results tbody");
      tbody.replaceChildren();
      const rows = d.candidates.slice().sort(function (a, b) {
        return (a.rank === null ? 1e9 : a.rank) - (b.rank === null ? 1e9 : b.rank) || b.score - a.score;
      });
      for (const c of rows) {
        const tr = el("tr", null, c.rank !== null ? "picked" : "");
        tr.dataset.id = String(c.id);
        tr.appendChild(el("td", c.rank === null ? "–" : c.rank));
        const idc = el("td"); idc.appendChild(entryLink(c.id)); tr.appendChild(idc);
        tr.appendChild(textCell(c.text));
        tr.appendChild(el("td", num(c.similarity, 4), "num"));
        tr.appendChild(el("td", num(c.retrievals), "num"));
        tr.appendChild(el("td", c.recent ? "yes" : "no"));
        tr.appendChild(el("td", num(c.score, 4), "num"));
        tbody.appendChild(tr);
      }
    }
  }

  // ---------------------------------------------------------------- over training
  async function trainingPage() {
    const t = await api("/timeline");
    document.getElementById("training-note").textContent = t.steps.length ?
      "Steps " + t.steps[0] + " to " + t.steps[t.steps.length - 1] + " from the bank's event log." :
      "No step logged yet.";
    for (const name of ["bank_size", "ops", "rbar"]) {
      const blob = await api("/plots/" + name + ".svg", true);
      const img = document.getElementById("chart-" + name);
      img.src = URL.createObjectURL(blob);  // an SVG shown as an image runs no script
    }
  }

  function fail(err) { setStatus(String(err && err.message ? err.message : err), true); }

  const pages = { bank: bankPage, entry: entryPage, search: searchPage, training: trainingPage };
  summary().then(function () { return pages[page](); }).then(function () {
    body.dataset.ready = "true";
  }).catch(fail);
})();

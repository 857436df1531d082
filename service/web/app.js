/* privacy-ledger dashboard: plain JavaScript, no framework, no build step, no external assets.
 *
 * Pages (hash routes): #/signin, #/datasets, #/datasets/{id}, #/certificates/{id}, #/jobs,
 * #/jobs/{id}, #/models, #/models/{name}, #/models/{name}/{version}, #/audit, #/audit/{dataset}. Every number comes from HTTP API v1 (docs/DASHBOARD.md lists the calls); ledger
 * numbers are shown exactly as the ledger answers them (decimal strings); charts turn them into
 * floats only for geometry. Charts are SVG built here (docs/DASHBOARD.md says why).
 *
 * The API key lives in sessionStorage only: never localStorage, never a cookie. A 401 clears it
 * and returns to the sign-in page; a network error is shown in the banner and polling retries.
 * Text from the API is always inserted as text (textContent), never as HTML.
 */
(function () {
  "use strict";

  const KEY_STORAGE = "privacy-ledger.api-key";
  const BATCH_PAGE = 200;        // batches per heatmap page
  const RELEASE_PAGE = 20;       // releases per timeline page
  const TASK_BAR_PAGE = 40;      // task bars per page
  const JOB_POLL_MS = 1000;      // job page refresh
  const JOBS_POLL_MS = 1500;     // jobs list refresh
  const SVG_NS = "http://www.w3.org/2000/svg";

  const view = document.getElementById("view");
  const banner = document.getElementById("banner");
  const nav = document.getElementById("nav");
  const signoutButton = document.getElementById("signout");
  const live = document.getElementById("live");

  // Each render bumps the generation; async work from an older render is dropped and its
  // timers are cleared, so a slow answer never paints over the page the user moved to.
  let generation = 0;
  let timers = [];

  // ------------------------------------------------------------------------------------------
  // The key: this tab's session only

  function getKey() {
    return window.sessionStorage.getItem(KEY_STORAGE);
  }

  function setKey(key) {
    window.sessionStorage.setItem(KEY_STORAGE, key);
  }

  function clearKey() {
    window.sessionStorage.removeItem(KEY_STORAGE);
  }

  // ------------------------------------------------------------------------------------------
  // HTTP

  class ApiError extends Error {
    constructor(status, body) {
      const code = body && body.error ? body.error : "http_" + status;
      const message = body && body.message ? body.message : "the server answered " + status + ".";
      super(message);
      this.status = status;
      this.code = code;
      this.body = body;
    }
  }

  class NetworkError extends Error {}

  let pendingSignInMessage = null;

  async function request(path, options, key) {
    const headers = { Accept: "application/json", Authorization: "Bearer " + key };
    const init = { method: options.method || "GET", headers, cache: "no-store", credentials: "omit" };
    if (options.body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(options.body);
    }
    let response;
    let text;
    try {
      response = await fetch(path, init);
      text = await response.text();
    } catch (error) {
      throw new NetworkError(
        "Network error: the ledger at " + window.location.origin + " did not answer (" +
          (error && error.message ? error.message : String(error)) + ")."
      );
    }
    let body = null;
    if (text) {
      try {
        body = JSON.parse(text);
      } catch (error) {
        body = null;
      }
    }
    if (!response.ok) {
      throw new ApiError(response.status, body);
    }
    return body;
  }

  /** A v1 call with the session's key. 401: the key is dropped and the sign-in page shown. */
  async function api(path, options) {
    const key = getKey();
    if (!key) {
      goSignIn("Sign in with an API key.");
      throw new ApiError(401, { error: "unauthorized", message: "no API key in this session." });
    }
    try {
      const body = await request(path, options || {}, key);
      hideBanner("network");
      return body;
    } catch (error) {
      if (error instanceof ApiError && error.status === 401) {
        clearKey();
        goSignIn("Signed out: the server refused the key (401: " + error.message + ")");
      }
      throw error;
    }
  }

  function goSignIn(message) {
    pendingSignInMessage = message;
    if (window.location.hash !== "#/signin") {
      window.location.hash = "#/signin";
    } else {
      render();
    }
  }

  // ------------------------------------------------------------------------------------------
  // DOM helpers (text only: values from the API never become HTML)

  function h(tag, attrs, ...children) {
    const node = document.createElement(tag);
    setAttrs(node, attrs);
    append(node, children);
    return node;
  }

  function s(tag, attrs, ...children) {
    const node = document.createElementNS(SVG_NS, tag);
    setAttrs(node, attrs);
    append(node, children);
    return node;
  }

  function setAttrs(node, attrs) {
    if (!attrs) return;
    for (const [name, value] of Object.entries(attrs)) {
      if (value === null || value === undefined || value === false) continue;
      if (name === "onclick" || name === "onsubmit" || name === "oninput") {
        node.addEventListener(name.slice(2), value);
      } else if (name === "text") {
        node.textContent = String(value);
      } else {
        node.setAttribute(name, value === true ? "" : String(value));
      }
    }
  }

  function append(node, children) {
    for (const child of children.flat(Infinity)) {
      if (child === null || child === undefined || child === false) continue;
      node.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
    }
  }

  /** Replace a node's children (``null`` / ``false`` children are skipped, never shown). */
  function fill(node, ...children) {
    node.replaceChildren();
    append(node, children);
    return node;
  }

  function add(node, ...children) {
    append(node, children);
    return node;
  }

  function title(text) {
    return s("title", { text });
  }

  function showBanner(message, kind) {
    banner.textContent = message;
    banner.dataset.kind = kind || "error";
    banner.hidden = false;
  }

  function hideBanner(kind) {
    if (!kind || banner.dataset.kind === kind) {
      banner.hidden = true;
      banner.textContent = "";
      delete banner.dataset.kind;
    }
  }

  /** Show an error from an API call; 401 is handled by ``api`` (back to sign-in). */
  function showError(error) {
    if (error instanceof ApiError && error.status === 401) return;
    if (error instanceof NetworkError) {
      showBanner(error.message, "network");
    } else if (error instanceof ApiError) {
      showBanner("Error " + error.status + " (" + error.code + "): " + error.message, "api");
    } else {
      showBanner("Unexpected error: " + (error && error.message ? error.message : String(error)), "bug");
      console.error(error);
    }
  }

  // ------------------------------------------------------------------------------------------
  // Numbers

  function num(text) {
    const value = Number.parseFloat(text);
    return Number.isFinite(value) ? value : 0;
  }

  /**
   * A ledger number (a decimal string) shown with 4 significant digits. `way` is "up" for what
   * was spent or held (a shown spend is never below the ledger's) and "down" for what remains;
   * otherwise the nearest. The exact value goes in `title` (hover) and `data-full` (copy), see
   * `exact` and the copy handler below.
   */
  function sig(text, way) {
    if (text === null || text === undefined || text === "") return "—";
    const str = String(text).trim();
    if (/^infinity$/i.test(str)) return "∞";
    // Rounded on the decimal digits themselves, never through a binary float: the exact value
    // 0.49980000000000001 shown "up" is 0.4999 (a float reads it as 0.4998, below the bound).
    const m = /^(-?)([0-9]*)\.?([0-9]*)(?:e([-+]?[0-9]+))?$/i.exec(str);
    if (!m || m[2] + m[3] === "") return str;
    const all = m[2] + m[3];
    const significant = all.replace(/^0+/, "");
    if (significant === "" || /^0*$/.test(significant)) return "0";
    let adjusted = significant.length - 1 + Number(m[4] || 0) - m[3].length;
    let kept = (significant + "000").slice(0, 4);
    const dropped = significant.slice(4);
    const negative = m[1] === "-";
    const towardLarger = way === "up" ? !negative : way === "down" ? negative : dropped !== "" && dropped[0] >= "5";
    if (towardLarger && /[1-9]/.test(dropped)) {
      kept = String(Number(kept) + 1);
      if (kept.length > 4) { kept = kept.slice(0, 4); adjusted += 1; }
    }
    let body;
    if (adjusted >= 6 || adjusted < -4) {
      body = (kept[0] + "." + kept.slice(1)).replace(/\.?0+$/, "") + "e" + adjusted;
    } else if (adjusted >= 3) {
      body = kept + "0".repeat(adjusted - 3);
    } else if (adjusted >= 0) {
      body = (kept.slice(0, adjusted + 1) + "." + kept.slice(adjusted + 1)).replace(/\.?0+$/, "");
    } else {
      body = ("0." + "0".repeat(-adjusted - 1) + kept).replace(/0+$/, "");
    }
    return (negative ? "-" : "") + body;
  }

  /**
   * What remains of a budget, shown at the budget's own precision (its 4th significant digit),
   * rounded down: a residue such as 2.998e-11 of a budget of 50 reads 0 (a remaining figure is
   * never shown above the ledger's). The exact value stays on hover and copy (`remainingOf`).
   */
  function remainingText(text, budgetText) {
    const value = num(text);
    const budget = num(budgetText);
    if (budget > 0 && value >= 0) {
      const step = Math.pow(10, Math.floor(Math.log10(budget)) - 3);
      if (value < step) return "0";
    }
    return sig(text, "down");
  }

  function remainingOf(tag, attrs, value, budget) {
    const full = value === null || value === undefined ? "" : String(value);
    return h(tag, Object.assign({}, attrs, { title: full, "data-full": full, text: remainingText(value, budget) }));
  }

  /** An element showing `value` with 4 significant digits, the exact value on hover and copy. */
  function exact(tag, attrs, value, way) {
    const full = value === null || value === undefined ? "" : String(value);
    return h(tag, Object.assign({}, attrs, { title: full, "data-full": full, text: sig(value, way) }));
  }

  // Copying shown numbers copies their exact values: each `data-full` element in the selection
  // is replaced by its full value.
  document.addEventListener("copy", (event) => {
    const selection = window.getSelection();
    if (!selection || selection.rangeCount === 0 || selection.isCollapsed) return;
    const range = selection.getRangeAt(0);
    const start = range.commonAncestorContainer;
    const inside = (start.nodeType === 1 ? start : start.parentElement).closest("[data-full]");
    let text;
    if (inside) {
      text = inside.getAttribute("data-full");
    } else {
      const fragment = range.cloneContents();
      const numbers = fragment.querySelectorAll("[data-full]");
      if (numbers.length === 0) return;  // nothing shortened in the selection: the browser copies
      for (const node of numbers) node.textContent = node.getAttribute("data-full");
      text = fragment.textContent;
    }
    event.clipboardData.setData("text/plain", text);
    event.preventDefault();
  });

  /** Short label for chart axes and bar ends (the exact value is in the element's title). */
  function short(value) {
    if (value === 0) return "0";
    const abs = Math.abs(value);
    if (abs >= 1e4 || abs < 1e-3) return value.toExponential(2);
    return String(Number.parseFloat(value.toPrecision(4)));
  }

  function niceTicks(max, count) {
    if (!(max > 0)) return [0, 1];
    const raw = max / count;
    const magnitude = Math.pow(10, Math.floor(Math.log10(raw)));
    const step = [1, 2, 2.5, 5, 10].map((m) => m * magnitude).find((v) => v >= raw) || raw;
    const ticks = [];
    for (let v = 0; v <= max + step * 1e-9; v += step) ticks.push(Number.parseFloat(v.toPrecision(12)));
    if (ticks[ticks.length - 1] < max) ticks.push(Number.parseFloat((ticks[ticks.length - 1] + step).toPrecision(12)));
    return ticks;
  }

  function when(iso) {
    if (!iso) return "—";
    return iso.replace("T", " ").replace(/\.\d+/, "").replace(/\+00:00$|Z$/, "") + " UTC";
  }

  function releaseText(release) {
    if (!release) return "—";
    return release.model + " v" + release.version;
  }

  function mix(a, b, t) {
    const x = Math.max(0, Math.min(1, t));
    const c = a.map((v, i) => Math.round(v + (b[i] - v) * x));
    return "rgb(" + c.join(",") + ")";
  }

  const SPENT_LOW = [226, 240, 235];
  const SPENT_HIGH = [15, 81, 66];

  /** Heatmap colour of a batch at ``fraction`` of the budget: a square-root scale, so that
   * small spends stay distinguishable from each other and from none (monotone: darker = more). */
  function heatColour(fraction) {
    return mix(SPENT_LOW, SPENT_HIGH, Math.sqrt(Math.max(0, Math.min(1, fraction))));
  }

  // ------------------------------------------------------------------------------------------
  // Router

  function route() {
    const hash = window.location.hash.replace(/^#/, "") || "/";
    const parts = hash.split("/").filter(Boolean).map(decodeURIComponent);
    return parts;
  }

  function clearTimers() {
    for (const id of timers) window.clearTimeout(id);
    timers = [];
    live.hidden = true;
  }

  function later(gen, ms, fn) {
    if (gen !== generation) return;
    timers.push(window.setTimeout(() => { if (gen === generation) fn(); }, ms));
  }

  function render() {
    generation += 1;
    const gen = generation;
    clearTimers();
    const parts = route();
    const key = getKey();
    signoutButton.hidden = !key;
    nav.hidden = !key;
    if (parts[0] !== "signin" && !key) {
      window.location.hash = "#/signin";
      return;
    }
    for (const link of nav.querySelectorAll("a")) {
      link.classList.toggle("active", link.dataset.nav === parts[0]);
    }
    if (parts[0] !== "signin") hideBanner("api");
    fill(view);
    let page;
    if (parts[0] === "signin") page = signInPage(gen);
    else if (parts[0] === "datasets" && parts[1]) page = datasetPage(gen, parts[1]);
    else if (parts[0] === "certificates" && parts[1]) page = certificatePage(gen, parts[1]);
    else if (parts[0] === "jobs" && parts[1]) page = jobPage(gen, parts[1]);
    else if (parts[0] === "models" && parts[1] && parts[2]) page = modelVersionPage(gen, parts[1], parts[2]);
    else if (parts[0] === "models" && parts[1]) page = modelPage(gen, parts[1]);
    else if (parts[0] === "models") page = modelsPage(gen, 0);
    else if (parts[0] === "audit") page = auditPage(gen, parts[1] || null);
    else if (parts[0] === "jobs") page = jobsPage(gen);
    else if (parts.length === 0 || parts[0] === "datasets") page = datasetsPage(gen);
    else page = Promise.resolve(add(view, h("p", { class: "empty", text: "No such page: #" + parts.join("/") })));
    Promise.resolve(page).catch((error) => {
      if (gen === generation) showError(error);
    });
  }

  signoutButton.addEventListener("click", () => {
    clearKey();
    goSignIn("Signed out.");
  });

  // ------------------------------------------------------------------------------------------
  // Sign in

  function signInPage() {
    const message = pendingSignInMessage;
    pendingSignInMessage = null;
    hideBanner();
    const input = h("input", {
      id: "api-key", type: "password", name: "api-key", autocomplete: "off", required: true,
      placeholder: "pl_…", spellcheck: "false",
    });
    const status = h("p", { id: "signin-message", class: message ? (message.includes("401") ? "notice error" : "notice") : "notice hidden", text: message || "" });
    const submit = h("button", { id: "signin-submit", type: "submit", text: "Sign in" });
    const form = h("form", { class: "signin", onsubmit: onSubmit },
      h("h1", { text: "Sign in" }),
      h("p", { class: "muted", text: "An API key of any scope (viewer is enough). It is kept in this tab's session storage only and sent as a Bearer token to this server." }),
      h("label", { for: "api-key", text: "API key" }),
      input,
      submit,
      status);
    add(view, form);
    input.focus();

    async function onSubmit(event) {
      event.preventDefault();
      const key = input.value.trim();
      if (!key) return;
      submit.disabled = true;
      status.className = "notice";
      status.textContent = "Checking the key…";
      try {
        await request("/v1/datasets?limit=1", {}, key);
        setKey(key);
        input.value = "";
        window.location.hash = "#/datasets";
      } catch (error) {
        status.className = "notice error";
        if (error instanceof ApiError && error.status === 401) {
          status.textContent = "The server refused this key (401): " + error.message;
        } else {
          status.textContent = error.message;
        }
      } finally {
        submit.disabled = false;
      }
    }
  }

  // ------------------------------------------------------------------------------------------
  // Datasets list

  async function datasetsPage(gen, offset) {
    offset = offset || 0;
    const limit = 100;
    const page = await api("/v1/spend?limit=" + limit + "&offset=" + offset);
    if (gen !== generation) return;
    fill(view);
    add(view, h("h1", { text: "Datasets" }));
    if (page.count === 0) {
      add(view, h("p", { class: "empty", text: "No datasets yet. Create one with POST /v1/datasets (an admin key)." }));
      return;
    }
    const rows = page.data.map((d) => {
      const budget = num(d.epsilon_budget);
      const fraction = budget > 0 ? num(d.epsilon_spent) / budget : 0;
      const heldFraction = budget > 0 ? num(d.epsilon_held) / budget : 0;
      const share = isShare(d.epsilon_spent_is);
      const guarantee = d.guarantee || {};
      return h("tr", { "data-dataset-id": d.id, class: d.archived_at ? "archived" : null },
        h("td", { class: "name" }, h("a", { href: "#/datasets/" + encodeURIComponent(d.id), text: d.name }),
          d.archived_at ? [" ", archivedBadge(d.archived_at)] : null),
        h("td", { class: "rule" }, h("span", { class: "chip rule-" + d.rule, text: d.rule }), " ", h("span", { class: "muted", text: d.accountant })),
        exact("td", { class: "num budget" }, d.epsilon_budget),
        exact("td", { class: "num delta-budget" }, d.delta_budget),
        h("td", { class: "num records", text: d.records === undefined || d.records === null ? "—" : String(d.records) }),
        h("td", { class: "num guarantee", "data-full": guarantee.epsilon || "", "data-delta": guarantee.delta || "" },
          exact("span", { class: "guarantee-epsilon" }, guarantee.epsilon, "up"),
          h("span", { class: "muted small block guarantee-delta" }, "δ ", exact("span", {}, guarantee.delta, "up"))),
        h("td", { class: "num spent" + (share ? " budget-share" : ""), title: d.epsilon_spent, "data-full": d.epsilon_spent, "data-is": d.epsilon_spent_is || "" },
          sig(d.epsilon_spent, "up"), share ? h("span", { class: "muted small block share-note", text: "budget share, not a DP guarantee" }) : null),
        remainingOf("td", { class: "num remaining" }, d.epsilon_remaining, d.epsilon_budget),
        exact("td", { class: "num held" }, d.epsilon_held, "up"),
        h("td", { class: "meter-cell" }, meter(fraction, heldFraction, d.epsilon_spent + " of " + d.epsilon_budget + " of the budget used")),
        h("td", { class: "last-release" },
          h("span", { text: releaseText(d.last_release) }),
          d.last_release_at ? h("span", { class: "muted small block", text: when(d.last_release_at) }) : null),
        h("td", { class: "mono small id dataset-id", text: d.id }));
    });
    add(view, h("table", { id: "datasets-table", class: "table" },
      h("thead", {}, h("tr", {},
        h("th", { text: "Name" }), h("th", { text: "Rule" }), h("th", { class: "num", text: "Budget ε" }),
        h("th", { class: "num", text: "Budget δ" }), h("th", { class: "num", title: "records registered (the sum of the batches' sizes)", text: "Records" }),
        h("th", { class: "num", id: "th-guarantee", title: "the (ε, δ)-DP guarantee of everything released from the dataset so far, valid under adaptive stopping", text: "Guarantee (ε, δ)" }),
        h("th", { class: "num", id: "th-spent", title: "how much of the budget is used (max over batches); on a Rényi-filter budget the filter's progress: a budget share, not a DP guarantee", text: "Budget used ε" }),
        h("th", { class: "num", text: "Remaining ε" }),
        h("th", { class: "num", text: "Held ε" }), h("th", { text: "Used" }), h("th", { text: "Last release" }), h("th", { text: "Id" }))),
      h("tbody", {}, rows)));
    add(view, h("p", { id: "datasets-note", class: "legend", text: "Guarantee: the (ε, δ)-DP guarantee of everything released from the dataset so far (valid whatever was chosen after seeing earlier outputs). Budget used: what the budget has consumed — where it says so, a budget share (a Rényi filter's progress), not a DP guarantee. Remaining is rounded down, every ε and δ up." }));
    add(view, pager(offset, limit, page.count, "datasets", (next) => datasetsPage(gen, next).catch(showError)));
  }

  /** An archived dataset takes no new work; its ledger and certificates stay (POST /v1/datasets/{id}/archive). */
  function archivedBadge(at) {
    return h("span", { class: "chip archived-badge", title: "archived " + when(at) + ": no new tasks, batches, reservations or jobs; its ledger and certificates stay (ledger datasets unarchive NAME makes it active again)", text: "archived" });
  }

  function meter(fraction, heldFraction, label) {
    const width = 120;
    const spentWidth = Math.max(0, Math.min(1, fraction)) * width;
    const heldWidth = Math.max(0, Math.min(1 - Math.min(1, fraction), heldFraction)) * width;
    return s("svg", { class: "meter", width, height: 10, viewBox: "0 0 " + width + " 10", role: "img", "aria-label": label },
      title(label),
      s("rect", { class: "meter-free", x: 0, y: 0, width, height: 10, rx: 3 }),
      s("rect", { class: "meter-spent", x: 0, y: 0, width: spentWidth, height: 10, rx: 3 }),
      s("rect", { class: "meter-held", x: spentWidth, y: 0, width: heldWidth, height: 10 }));
  }

  function pager(offset, limit, count, name, go) {
    if (count <= limit) return null;
    const last = Math.min(offset + limit, count);
    return h("div", { class: "pager", id: name + "-pager" },
      h("button", { type: "button", id: name + "-prev", disabled: offset === 0, onclick: () => go(Math.max(0, offset - limit)), text: "‹ Previous" }),
      h("span", { class: "pager-range", id: name + "-range", text: (offset + 1) + "–" + last + " of " + count }),
      h("button", { type: "button", id: name + "-next", disabled: last >= count, onclick: () => go(offset + limit), text: "Next ›" }));
  }

  // ------------------------------------------------------------------------------------------
  // One dataset

  async function datasetPage(gen, id) {
    const path = "/v1/datasets/" + encodeURIComponent(id);
    const [dataset, spend, batches, releases] = await Promise.all([
      api(path),
      api(path + "/spend"),
      api(path + "/batch-spend?limit=" + BATCH_PAGE + "&offset=0"),
      api(path + "/releases?limit=" + RELEASE_PAGE + "&offset=0"),
    ]);
    const history = spend.rule === "lifelong" ? await api(path + "/epsilon-history") : null;
    const allReleases = releases.count > releases.data.length ? await api(path + "/releases?limit=1000&offset=0") : releases;
    if (gen !== generation) return;
    fill(view);
    const budget = dataset.budget || {};
    add(view, 
      h("p", { class: "crumbs" }, h("a", { href: "#/datasets", text: "Datasets" }), " / ", dataset.name),
      h("h1", { id: "dataset-name" }, dataset.name, dataset.archived_at ? [" ", archivedBadge(dataset.archived_at)] : null),
      h("p", { class: "subtitle" },
        h("span", { class: "chip rule-" + spend.rule, text: spend.rule }), " ",
        h("span", { text: "accountant " + spend.accountant + " · budget ε " + spend.epsilon_budget + ", δ " + spend.delta_budget }),
        spend.geometric ? h("span", { text: " · levels first " + spend.geometric.first + ", ratio " + spend.geometric.ratio + " (infinite-horizon bound " + spend.geometric.infinite_horizon_bound + ")" }) : null,
        h("span", { class: "muted", text: " · " + dataset.id })));
    // The API's warnings about the dataset (a budget δ of at least 1/N for its records).
    const warnings = dataset.warnings || [];
    if (warnings.length) {
      add(view, h("div", { id: "dataset-warnings", class: "warning", role: "alert" },
        ...warnings.map((w) => h("p", { "data-code": w.code, text: "⚠ " + w.message }))));
    }

    add(view, section("Budget", "budget", gauge(spend), stats(spend)));
    add(view, section("ε over releases", "epsilon-over-time", epsilonOverReleases(allReleases, spend)));
    add(view, section("Spend per task", "tasks", taskBars(spend, 0)));
    const heat = h("div", { id: "heatmap-panel" });
    add(view, section("Spend per batch", "batches", heat));
    const levels = spend.rule === "geometric" ? h("div", { id: "levels-panel" }) : null;
    if (levels) add(view, section("Geometric levels per block", "levels", levels));
    drawBatchPage(batches);
    if (history) add(view, section("Lifelong: the guarantee against naive sequential ε", "lifelong", lifelongCurve(history)));
    const timeline = h("div", { id: "timeline-panel" });
    add(view, section("Releases", "releases", timeline));
    drawReleases(releases);

    function drawBatchPage(answer) {
      fill(heat, heatmap(answer, budget), pager(answer.offset, answer.limit, answer.count, "heatmap", loadBatches));
      if (levels) fill(levels, levelGrid(answer), pager(answer.offset, answer.limit, answer.count, "levels", loadBatches));
    }

    function loadBatches(offset) {
      api(path + "/batch-spend?limit=" + BATCH_PAGE + "&offset=" + offset)
        .then((answer) => { if (gen === generation) drawBatchPage(answer); })
        .catch(showError);
    }

    function drawReleases(answer) {
      fill(timeline, releaseTimeline(answer), pager(answer.offset, answer.limit, answer.count, "releases", (offset) => {
        api(path + "/releases?limit=" + RELEASE_PAGE + "&offset=" + offset)
          .then((next) => { if (gen === generation) drawReleases(next); })
          .catch(showError);
      }));
    }
  }

  /** Whether a spend view's `epsilon_spent` is a budget share rather than the guarantee (the
   * API's `epsilon_spent_is` / `epsilon_is` says which). */
  function isShare(meaning) {
    return typeof meaning === "string" && meaning.indexOf("not a DP guarantee") >= 0;
  }

  function section(heading, id, ...children) {
    return h("section", { class: "card", id: "section-" + id }, h("h2", { text: heading }), children);
  }

  function stats(spend) {
    const item = (label, value, id) => h("div", { class: "stat" }, h("div", { class: "stat-label", text: label }), h("div", { class: "stat-value", id, text: value }));
    const number = (label, value, id, way) => h("div", { class: "stat" }, h("div", { class: "stat-label", text: label }), exact("div", { class: "stat-value", id }, value, way));
    return h("div", { class: "stats" },
      spend.guarantee ? h("div", { class: "stat", title: spend.guarantee.covers || "" }, h("div", { class: "stat-label", text: "guarantee (every release so far)" }),
        h("div", { class: "stat-value", id: "stat-guarantee" }, "ε ", exact("span", {}, spend.guarantee.epsilon, "up"), ", δ ", exact("span", {}, spend.guarantee.delta, "up"))) : null,
      number(isShare(spend.epsilon_spent_is) ? "budget used (filter progress, not a guarantee)" : "ε spent", spend.epsilon_spent, "stat-spent", "up"),
      number("ε held (open reservations)", spend.epsilon_held, "stat-held", "up"),
      h("div", { class: "stat" }, h("div", { class: "stat-label", text: "ε remaining" }), remainingOf("div", { class: "stat-value", id: "stat-remaining" }, spend.epsilon_remaining, spend.epsilon_budget)),
      number("naive sequential ε", spend.naive_sequential_epsilon, "stat-naive", "up"),
      number("δ spent", spend.delta_spent, "stat-delta", "up"),
      item("releases (commits)", String(spend.charges_committed), "stat-commits"),
      item("open reservations", String(spend.reservations_open), "stat-open"),
      item("last release", releaseText(spend.last_release), "stat-last-release"));
  }

  /** Budget gauge: spent | held | free on one bar of the budget's width. */
  function gauge(spend) {
    const budget = num(spend.epsilon_budget);
    const spent = num(spend.epsilon_spent);
    const held = num(spend.epsilon_held);
    const total = Math.max(budget, spent + held) || 1;
    const W = 720, H = 58, left = 0, barY = 8, barH = 26;
    const x = (v) => left + (v / total) * W;
    const spentW = x(spent) - left;
    const heldW = Math.max(0, Math.min(x(spent + held), W) - x(spent));
    const label = "spent " + sig(spend.epsilon_spent, "up") + " · held " + sig(spend.epsilon_held, "up") + " · remaining " + remainingText(spend.epsilon_remaining, spend.epsilon_budget) + " of ε " + sig(spend.epsilon_budget);
    const exactLabel = "spent " + spend.epsilon_spent + " · held " + spend.epsilon_held + " · remaining " + spend.epsilon_remaining + " of ε " + spend.epsilon_budget;
    const percent = budget > 0 ? Math.round((spent / budget) * 1000) / 10 : 0;
    const ticks = niceTicks(total, 6).filter((t) => t <= total * 1.0001);
    return h("div", { class: "gauge" },
      h("p", { id: "gauge-label", class: "gauge-label", title: exactLabel, "data-full": exactLabel, text: label }),
      s("svg", { id: "gauge", viewBox: "0 0 " + (W + 2) + " " + H, class: "chart", role: "img", "aria-label": label,
        "data-spent": spend.epsilon_spent, "data-held": spend.epsilon_held, "data-budget": spend.epsilon_budget },
        title(label),
        s("rect", { class: "gauge-free", x: left, y: barY, width: W, height: barH, rx: 4 }),
        s("rect", { class: "gauge-spent", x: left, y: barY, width: spentW, height: barH, rx: 4 }, title("spent ε " + spend.epsilon_spent)),
        s("rect", { class: "gauge-held", x: x(spent), y: barY, width: heldW, height: barH }, title("held ε " + spend.epsilon_held)),
        s("line", { class: "gauge-budget", x1: x(budget), x2: x(budget), y1: barY - 4, y2: barY + barH + 4 }),
        ticks.map((t) => s("text", { class: "tick", x: x(t), y: H - 4, "text-anchor": t === 0 ? "start" : (x(t) > W - 10 ? "end" : "middle"), text: short(t) }))),
      h("p", { class: "legend" },
        h("span", { class: "swatch swatch-spent" }), "spent (" + percent + "% of the budget) ",
        h("span", { class: "swatch swatch-held" }), "held by open reservations ",
        h("span", { class: "swatch swatch-free" }), "free"));
  }

  /** Spend per task: one bar each (ledger ε), with a mark at the naive sequential ε. */
  function taskBars(spend, offset) {
    const wrapper = h("div", { id: "task-bars-panel" });
    const tasks = spend.tasks || [];
    if (tasks.length === 0) {
      add(wrapper, h("p", { class: "empty", text: "No tasks yet." }));
      return wrapper;
    }
    draw(offset);
    return wrapper;

    function draw(start) {
      const shown = tasks.slice(start, start + TASK_BAR_PAGE);
      const share = isShare(spend.epsilon_spent_is);
      const budget = num(spend.epsilon_budget);
      const largest = Math.max(budget, ...shown.map((t) => Math.max(num(t.epsilon_spent), num(t.naive_sequential_epsilon)))) || 1;
      // The axis ends at its last tick, a round number at or above every value: no mark beyond it.
      const ticks = niceTicks(largest, 5);
      const top = ticks[ticks.length - 1];
      const labelW = 170, valueW = 170, W = 760, rowH = 24, barH = 15;
      const plotW = W - labelW - valueW;
      const H = shown.length * rowH + 26;
      const x = (v) => labelW + (v / top) * plotW;
      const rows = shown.map((t, i) => {
        const y = i * rowH + 4;
        const naive = num(t.naive_sequential_epsilon);
        const spent = num(t.epsilon_spent);
        const text = "task " + t.name + ": " + (share ? "budget used ε " : "ε ") + t.epsilon_spent + " (naive sequential " + t.naive_sequential_epsilon + ")" +
          (t.guarantee ? "; guarantee ε " + t.guarantee.epsilon + ", δ " + t.guarantee.delta : "");
        return s("g", { class: "task-row", "data-task-id": t.id },
          s("text", { class: "bar-label", x: labelW - 8, y: y + barH - 3, "text-anchor": "end", text: clip(t.name, 24) }),
          s("rect", { class: "bar", x: labelW, y, width: Math.max(1, x(spent) - labelW), height: barH, rx: 2,
            "data-task-id": t.id, "data-epsilon": t.epsilon_spent }, title(text)),
          naive > spent ? s("line", { class: "naive-mark", x1: x(naive), x2: x(naive), y1: y - 2, y2: y + barH + 2 }, title("naive sequential ε " + t.naive_sequential_epsilon)) : null,
          s("text", { class: "bar-value", x: W - valueW + 12, y: y + barH - 3, "data-full": t.epsilon_spent,
            text: sig(t.epsilon_spent, "up") + (naive > spent ? " (naive " + sig(t.naive_sequential_epsilon, "up") + ")" : "") },
            title(text)));
      });
      const axisY = shown.length * rowH + 8;
      fill(wrapper, 
        s("svg", { id: "task-bars", class: "chart", viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": "ε spent per task" },
          ticks.map((t) => s("line", { class: "grid", x1: x(t), x2: x(t), y1: 0, y2: axisY })),
          s("line", { class: "budget-line", x1: x(budget), x2: x(budget), y1: 0, y2: axisY }, title("budget ε " + spend.epsilon_budget)),
          rows,
          s("line", { class: "axis", x1: labelW, x2: x(top), y1: axisY, y2: axisY }),
          ticks.map((t) => s("text", { class: "tick", x: x(t), y: axisY + 14, "text-anchor": t === top ? "end" : "middle", text: short(t) }))),
        h("p", { class: "legend" },
          h("span", { class: "swatch swatch-spent" }), share ? "budget used by the task's batches (max over its batches; the Rényi filter's progress: a budget share, not a DP guarantee — the guarantee is on hover) " : "ledger ε of the task's batches (max over its batches; the guarantee of their releases) ",
          h("span", { class: "swatch swatch-naive" }), "naive sequential ε ",
          h("span", { class: "swatch swatch-budget" }), "budget"),
        pager(start, TASK_BAR_PAGE, tasks.length, "tasks", draw));
    }
  }

  function clip(text, n) {
    return text.length > n ? text.slice(0, n - 1) + "…" : text;
  }

  /** Spend per batch: one cell per batch, a row per task, colour = ε spent / budget. */
  function heatmap(answer, budgetDoc) {
    const budget = num(answer.epsilon_budget);
    const data = answer.data;
    if (data.length === 0) return h("p", { class: "empty", text: "No batches yet." });
    const groups = [];
    for (const b of data) {
      const last = groups[groups.length - 1];
      if (last && last.task_id === b.task_id) last.items.push(b);
      else groups.push({ task_id: b.task_id, task_name: b.task_name, items: [b] });
    }
    const perRow = 40, cell = 15, gap = 2, labelW = 170, W = labelW + perRow * (cell + gap) + 10;
    let y = 4;
    const rows = [];
    for (const g of groups) {
      const lines = Math.ceil(g.items.length / perRow);
      rows.push(s("text", { class: "bar-label", x: labelW - 8, y: y + cell - 3, "text-anchor": "end", text: clip(g.task_name, 24) }));
      g.items.forEach((b, i) => {
        const cx = labelW + (i % perRow) * (cell + gap);
        const cy = y + Math.floor(i / perRow) * (cell + gap);
        const spent = num(b.epsilon_spent);
        const held = num(b.epsilon_held);
        const fill = spent > 0 ? heatColour(budget > 0 ? spent / budget : 0) : "rgb(244,246,245)";
        const tip = g.task_name + " / " + b.name + ": ε spent " + b.epsilon_spent + ", held " + b.epsilon_held +
          ", naive " + b.naive_sequential_epsilon + ", reads " + b.reads + ", " + b.size + " records";
        rows.push(s("rect", { class: "cell" + (held > 0 ? " cell-held" : ""), x: cx, y: cy, width: cell, height: cell, rx: 2, fill,
          "data-batch-id": b.id, "data-epsilon": b.epsilon_spent }, title(tip)));
      });
      y += lines * (cell + gap) + 6;
    }
    const H = y + 4;
    return h("div", { class: "heatmap" },
      s("svg", { id: "heatmap", class: "chart", viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": "ε spent per batch" }, rows),
      h("div", { class: "legend" },
        s("svg", { class: "gradient", width: 160, height: 12, viewBox: "0 0 160 12" },
          s("defs", {}, s("linearGradient", { id: "heat-gradient" },
            [0, 0.25, 0.5, 0.75, 1].map((f) => s("stop", { offset: String(f), "stop-color": heatColour(f * f) })))),
          s("rect", { x: 0, y: 0, width: 160, height: 12, rx: 2, fill: "url(#heat-gradient)" })),
        h("span", { text: " ε spent, 0 → budget " + answer.epsilon_budget + " (square-root scale) · " }),
        h("span", { class: "swatch swatch-outline" }), h("span", { text: " batch with an open reservation · batches in task order; hover a cell for its numbers" })));
  }

  /** Geometric rule: levels in use per block (batch), each level's allowance first·ratioᵏ. */
  function levelGrid(answer) {
    const geometric = answer.geometric || {};
    const allowances = geometric.allowances || {};
    const blocks = answer.data;
    if (blocks.length === 0) return h("p", { class: "empty", text: "No blocks yet." });
    const maxUsed = Math.max(-1, ...blocks.flatMap((b) => b.levels));
    const columns = Math.max(4, maxUsed + 2);
    const first = num(geometric.first), ratio = num(geometric.ratio);
    const cell = 44, cellH = 22, gap = 4, labelW = 210, sumW = 170, headH = 32;
    const W = labelW + columns * (cell + gap) + sumW;
    const H = headH + blocks.length * (cellH + gap) + 4;
    const head = [];
    for (let k = 0; k < columns; k += 1) {
      const allowance = allowances[String(k)] || short(first * Math.pow(ratio, k));
      head.push(s("text", { class: "tick", x: labelW + k * (cell + gap) + cell / 2, y: 12, "text-anchor": "middle", text: "k=" + k }));
      head.push(s("text", { class: "tick small", x: labelW + k * (cell + gap) + cell / 2, y: 24, "text-anchor": "middle", text: short(num(allowance)) }));
    }
    const rows = blocks.map((b, i) => {
      const y = headH + i * (cellH + gap);
      const used = new Set(b.levels);
      const cells = [];
      for (let k = 0; k < columns; k += 1) {
        const allowance = allowances[String(k)] || String(first * Math.pow(ratio, k));
        cells.push(s("rect", { class: used.has(k) ? "level used" : "level free", x: labelW + k * (cell + gap), y, width: cell, height: cellH, rx: 3, "data-level": k },
          title("block " + b.name + ", level " + k + " (allowance " + allowance + "): " + (used.has(k) ? "used" : "free"))));
      }
      return s("g", { class: "block", "data-batch-id": b.id, "data-levels": b.levels.join(",") },
        s("text", { class: "bar-label", x: labelW - 8, y: y + cellH - 7, "text-anchor": "end", text: clip(b.task_name + " / " + b.name, 28) }),
        cells,
        s("text", { class: "bar-value", x: labelW + columns * (cell + gap) + 8, y: y + cellH - 7, text: "ε " + b.epsilon_spent + " · " + b.levels.length + (b.levels.length === 1 ? " level" : " levels") }));
    });
    return h("div", {},
      s("svg", { id: "levels", class: "chart-natural", width: W, height: H, viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": "geometric levels used per block" }, head, rows),
      h("p", { class: "legend" }, h("span", { class: "swatch swatch-spent" }), "level used (held or committed) ",
        h("span", { class: "swatch swatch-free" }), "free · level k allows ε first·ratioᵏ and is used once; a block's total over an infinite horizon ≤ " + (geometric.infinite_horizon_bound || "first/(1−ratio)")));
  }

  /**
   * Lifelong: the guarantee, the ledger's ε and the naive sequential ε after each task. The
   * guarantee (every release so far, valid under adaptive stopping) is the primary series; where
   * the ledger's ε is a Rényi filter's progress (`epsilon_is`) it is drawn as a budget share, not
   * a DP guarantee, else it is the guarantee itself.
   */
  function lifelongCurve(history) {
    const points = history.data;
    if (points.length === 0) return h("p", { class: "empty", text: "No releases yet." });
    const share = isShare(history.epsilon_is);
    const guaranteeOf = (p) => (p.guarantee ? p.guarantee.epsilon : p.epsilon);
    const W = 760, H = 300, L = 56, R = 170, T = 14, B = 40;
    const budget = num(history.epsilon_budget);
    const xMax = Math.max(history.tasks, points[points.length - 1].task_index, 2);
    const yTop = Math.max(budget, ...points.map((p) => num(p.naive_sequential_epsilon)), ...points.map((p) => num(p.epsilon)), ...points.map((p) => num(guaranteeOf(p)))) * 1.08 || 1;
    const x = (i) => L + ((i - 1) / (xMax - 1)) * (W - L - R);
    const y = (v) => T + (1 - v / yTop) * (H - T - B);
    const line = (value) => points.map((p, i) => (i ? "L" : "M") + x(p.task_index).toFixed(1) + " " + y(num(value(p))).toFixed(1)).join(" ");
    const yTicks = niceTicks(yTop, 5).filter((t) => t <= yTop);
    const xStep = Math.max(1, Math.ceil(xMax / 12));
    const xTicks = [];
    for (let i = 1; i <= xMax; i += xStep) xTicks.push(i);
    const last = points[points.length - 1];
    const lastGuarantee = last.guarantee || { epsilon: last.epsilon, delta: "" };
    const ledgerName = share ? "budget used (filter progress, not a DP guarantee)" : "ledger ε (= the guarantee)";
    const ratio = num(lastGuarantee.epsilon) > 0 ? num(last.naive_sequential_epsilon) / num(lastGuarantee.epsilon) : 0;
    const caption = "After task " + last.task_index + " (" + last.task_name + "): guarantee ε " + sig(lastGuarantee.epsilon, "up") +
      (lastGuarantee.delta !== "" ? ", δ " + sig(lastGuarantee.delta, "up") : "") +
      " · naive sequential ε " + sig(last.naive_sequential_epsilon, "up") + (ratio ? " (" + short(ratio) + "× the guarantee)" : "") +
      (share ? " · budget used " + sig(last.epsilon, "up") + " (filter progress, not a DP guarantee)" : "");
    const exactCaption = "guarantee ε " + lastGuarantee.epsilon + (lastGuarantee.delta !== "" ? ", δ " + lastGuarantee.delta : "") +
      " · ledger ε " + last.epsilon + " · naive sequential ε " + last.naive_sequential_epsilon;
    const guaranteeY = y(num(lastGuarantee.epsilon));
    const ledgerY = y(num(last.epsilon));
    // One column of end labels, at least 14 px apart: "budget 50" never over "guarantee 50".
    const endLabels = layoutLabels([
      { y: y(budget), cls: "budget-text", full: history.epsilon_budget, text: "budget " + sig(history.epsilon_budget), tip: "budget ε " + history.epsilon_budget },
      { y: y(num(last.naive_sequential_epsilon)), cls: "naive-text", full: last.naive_sequential_epsilon, text: "naive " + sig(last.naive_sequential_epsilon, "up"), tip: "naive sequential ε " + last.naive_sequential_epsilon },
      { y: guaranteeY, cls: "guarantee-text", full: lastGuarantee.epsilon, text: "guarantee " + sig(lastGuarantee.epsilon, "up"), tip: "guarantee ε " + lastGuarantee.epsilon },
      share ? { y: ledgerY, cls: "ledger-text share-text", full: last.epsilon, text: "used " + sig(last.epsilon, "up") + " (share)", tip: "budget used ε " + last.epsilon + ": the filter's progress, a budget share, not a DP guarantee" } : null,
    ].filter(Boolean), T + 4, H - B - 2);
    return h("div", {},
      s("svg", { id: "lifelong-curve", class: "chart", viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": caption },
        yTicks.map((t) => [s("line", { class: "grid", x1: L, x2: W - R, y1: y(t), y2: y(t) }), s("text", { class: "tick", x: L - 6, y: y(t) + 4, "text-anchor": "end", text: short(t) })]),
        xTicks.map((i) => s("text", { class: "tick", x: x(i), y: H - B + 16, "text-anchor": "middle", text: String(i) })),
        s("text", { class: "axis-title", x: (L + W - R) / 2, y: H - 6, "text-anchor": "middle", text: "tasks" }),
        s("text", { class: "axis-title", x: 12, y: T + (H - T - B) / 2, "text-anchor": "middle", transform: "rotate(-90 12 " + (T + (H - T - B) / 2) + ")", text: "ε" }),
        s("line", { class: "budget-line", x1: L, x2: W - R, y1: y(budget), y2: y(budget) }, title("budget ε " + history.epsilon_budget)),
        s("path", { class: "series-naive", d: line((p) => p.naive_sequential_epsilon) }),
        share ? s("path", { class: "series-ledger series-share", d: line((p) => p.epsilon) }) : null,
        s("path", { class: "series-guarantee", d: line(guaranteeOf) }),
        points.map((p) => s("circle", { class: "pt-naive", cx: x(p.task_index), cy: y(num(p.naive_sequential_epsilon)), r: 3.5,
          "data-task-index": p.task_index, "data-epsilon": p.naive_sequential_epsilon }, title("task " + p.task_index + ": naive sequential ε " + p.naive_sequential_epsilon))),
        points.map((p) => s("circle", { class: "pt-ledger" + (share ? " pt-share" : ""), cx: x(p.task_index), cy: y(num(p.epsilon)), r: share ? 3 : 0,
          "data-task-index": p.task_index, "data-epsilon": p.epsilon }, title("task " + p.task_index + ": " + ledgerName + " " + p.epsilon))),
        points.map((p) => s("circle", { class: "pt-guarantee", cx: x(p.task_index), cy: y(num(guaranteeOf(p))), r: 3.5,
          "data-task-index": p.task_index, "data-epsilon": guaranteeOf(p), "data-delta": p.guarantee ? p.guarantee.delta : "" },
          title("task " + p.task_index + ": guarantee ε " + guaranteeOf(p) + (p.guarantee ? ", δ " + p.guarantee.delta : "") + " (every release so far)"))),
        endLabels.map((l) => s("text", { class: "series-label " + l.cls, x: l.cls === "budget-text" ? W - R + 6 : x(last.task_index) + 8, y: l.at + 4, "data-full": l.full, text: l.text }, title(l.tip)))),
      h("p", { id: "curve-caption", class: "caption", title: exactCaption, text: caption }),
      h("p", { class: "legend" },
        h("span", { class: "swatch swatch-guarantee" }), "guarantee ε of every release so far (valid under adaptive stopping; replays of committed noise are post-processing: L2DP-ML Thm. 2) ",
        share ? [h("span", { class: "swatch swatch-share" }), "budget used: the Rényi filter's progress, a budget share, not a DP guarantee "] : null,
        h("span", { class: "swatch swatch-naive" }), "naive sequential ε (every read counted as fresh: grows with tasks, Thm. 1)"));
  }

  /** Release timeline: newest first, each with its certificate's headline and a link to it. */
  function releaseTimeline(answer) {
    if (answer.count === 0) return h("p", { class: "empty", text: "No releases yet." });
    return h("ol", { id: "timeline", class: "timeline" }, answer.data.map((r) =>
      h("li", { class: "release", "data-certificate-id": r.certificate_id },
        h("div", { class: "release-head" },
          h("a", { class: "release-name", href: "#/certificates/" + encodeURIComponent(r.certificate_id), text: r.model + " v" + r.version }),
          h("span", { class: "muted small", text: " " + when(r.created_at) })),
        h("div", { class: "release-body" },
          r.guarantee ? h("span", { class: "chip", title: r.guarantee.epsilon, "data-full": r.guarantee.epsilon, text: "guarantee ε " + sig(r.guarantee.epsilon, "up") }) : null,
          h("span", { class: "chip", title: r.charge.epsilon + " (a budget share, not a guarantee)", "data-full": r.charge.epsilon, text: "budget share ε " + sig(r.charge.epsilon, "up") }),
          h("span", { class: "chip", title: r.epsilon, "data-full": r.epsilon, text: "ε after " + sig(r.epsilon, "up") }),
          r.delta && r.delta !== "0" ? h("span", { class: "chip", title: r.delta, "data-full": r.delta, text: "δ after " + sig(r.delta, "up") }) : null,
          h("span", { class: r.within_budget ? "chip ok" : "chip bad", text: r.within_budget ? "within budget" : "over budget" }),
          h("span", { class: "muted small theorem", title: r.theorem || "", text: clip(r.theorem || "", 110) })),
        h("a", { class: "small", href: "#/certificates/" + encodeURIComponent(r.certificate_id), text: "open certificate " + r.certificate_id + " ›" }))));
  }

  // ------------------------------------------------------------------------------------------
  // A certificate: rule, theorem, inputs, result; verify on the server

  async function certificatePage(gen, id) {
    const stored = await api("/v1/certificates/" + encodeURIComponent(id));
    const audited = await privacyAuditOf(stored.release);
    if (gen !== generation) return;
    const cert = stored.certificate || {};
    const inputs = cert.inputs || {};
    const result = cert.result || {};
    const verifyResult = h("span", { id: "verify-result", class: "verify-result", text: "not verified yet" });
    const verifyButton = h("button", { id: "verify-button", type: "button", onclick: verify, text: "Verify" });
    const signature = cert.signature || null;
    const signatureResult = h("span", {
      id: "signature-result",
      class: "verify-result" + (signature ? "" : " bad"),
      text: signature ? "signed by key " + signature.key_id + " — not checked yet" : "unsigned — nothing shows this server issued it",
    });
    fill(view, 
      h("p", { class: "crumbs" },
        h("a", { href: "#/datasets", text: "Datasets" }), " / ",
        h("a", { href: "#/datasets/" + encodeURIComponent(stored.dataset_id), text: stored.dataset_id }), " / certificate"),
      h("h1", { text: stored.release ? "Certificate for " + releaseText(stored.release) : "Certificate of an " + (stored.outcome || "aborted") + " reservation: charged, nothing released" }),
      h("section", { class: "card", id: "section-verify" },
        h("h2", { text: "Verification" }),
        h("p", { class: "muted", text: "Asks the server to re-check this certificate offline from its own contents (accountant.certificates.verify): the content hash, the budget, every batch's reserve and commit recomputed under the rule, and the result; and its Ed25519 signature under the server's keys (/.well-known/privacy-ledger/signing-keys), which a forgery with consistent inputs and a recomputed hash cannot have." }),
        h("div", { class: "verify-row" }, verifyButton, verifyResult),
        h("div", { class: "verify-row" }, h("span", { class: "muted", text: "Signature" }), signatureResult)),
      h("section", { class: "card", id: "section-summary" },
        h("h2", { text: "Rule and theorem" }),
        dl([
          ["Rule", cert.rule, "cert-rule"],
          ["Accountant", cert.accountant, "cert-accountant"],
          ["Theorem", cert.theorem, "cert-theorem"],
          ["Released", (stored.release ? releaseText(stored.release) : "nothing (" + (stored.outcome || "aborted") + ")") + " · " + when(stored.created_at)],
          ["Certificate id", stored.id],
          ["Reservation", stored.reservation_id],
          ["Content hash", stored.content_hash, "cert-hash"],
          ["Signed by key", signature ? signature.key_id + " (" + signature.algorithm + ")" : "unsigned", "cert-signer"],
        ])),
      h("section", { class: "card", id: "section-result" },
        h("h2", { text: "Result" }),
        dl([
          ["guarantee of the release (every release from the batches read, adaptive stopping included)", result.guarantee ? h("span", {}, "ε ", exact("span", {}, result.guarantee.epsilon, "up"), ", δ ", exact("span", {}, result.guarantee.delta, "up")) : "not stated (certificate version " + cert.version + "): see the model version's DP statement", "cert-guarantee"],
          ["spend after (max over the batches read; for a Rényi filter its progress)", exact("span", {}, result.epsilon, "up"), "cert-epsilon"],
          ["δ after", exact("span", {}, result.delta, "up")],
          ["naive sequential ε after", exact("span", {}, result.naive_epsilon, "up")],
          ["budget share of this release (not a guarantee)", result.charge ? h("span", {}, "ε ", exact("span", {}, result.charge.epsilon, "up"), ", δ ", exact("span", {}, result.charge.delta, "up")) : null, "cert-charge"],
          ["audited ε lower bound (one run)", audited ? auditText(audited.certified) : null, "cert-audit"],
          ["audit", audited ? audited.canaries + " canaries, " + audited.correct + " of " + audited.guesses + " guesses right" : null, "cert-audit-counts"],
          ["budget", result.budget ? h("span", {}, "ε ", exact("span", {}, result.budget.epsilon), ", δ ", exact("span", {}, result.budget.delta)) : null],
          ["within budget", result.within_budget === undefined ? null : String(result.within_budget), "cert-within"],
          ["infinite-horizon bound", result.infinite_horizon_bound],
          ["levels", result.levels ? (Array.isArray(result.levels) ? result.levels.join(", ") : Object.entries(result.levels).map(([b, k]) => b + ": " + k).join(", ")) : null],
        ])),
      h("section", { class: "card", id: "section-inputs" },
        h("h2", { text: "Inputs" }),
        h("h3", { text: "Budget" }), budgetInWords(inputs.budget || {}, cert),
        h("details", { class: "internals", id: "cert-budget-details" }, h("summary", { text: "the budget's internals (JSON: delta_weights, orders, …)" }), pre(inputs.budget, "cert-budget")),
        h("h3", { text: "Charge (the mechanism event, and its noise commitment)" }), pre(inputs.charge, "cert-event"),
        inputs.partial_event ? [h("h3", { text: "Partial event (the run released so far)" }), pre(inputs.partial_event)] : null,
        h("h3", { text: "Batches touched" + (inputs.batch_set ? " (" + inputs.batch_set.count + ", by class)" : "") }),
        batchTable(inputs.classes || inputs.batches || [])),
      h("section", { class: "card" },
        h("h2", { text: "Libraries" }), dl(Object.entries(cert.libraries || {}).map(([k, v]) => [k, v]))),
      h("details", { class: "card" }, h("summary", { text: "Raw certificate JSON" }), pre(cert, "cert-json")));

    async function verify() {
      verifyButton.disabled = true;
      verifyResult.className = "verify-result pending";
      verifyResult.textContent = "verifying…";
      try {
        const answer = await api("/v1/certificates/" + encodeURIComponent(id) + "/verify", { method: "POST" });
        if (gen !== generation) return;
        verifyResult.className = "verify-result " + (answer.ok ? "ok" : "bad");
        verifyResult.textContent = (answer.ok ? "valid" : "INVALID") + " — " + answer.reason;
        const checked = answer.signature || {};
        signatureResult.className = "verify-result " + (checked.status === "valid" ? "ok" : "bad");
        signatureResult.dataset.status = checked.status || "";
        signatureResult.textContent = checked.status === "valid"
          ? "signed by key " + checked.key_id + " (" + checked.key_status + ") — valid"
          : (checked.key_id ? "key " + checked.key_id + " — " : "") + String(checked.status || "unknown").toUpperCase().replace("_", " ") + " — " + checked.reason;
      } catch (error) {
        verifyResult.className = "verify-result bad";
        verifyResult.textContent = "could not verify: " + error.message;
        showError(error);
      } finally {
        verifyButton.disabled = false;
      }
    }
  }

  /** The audited lower bound of a dp_sgd_audit release (null for any other release). */
  async function privacyAuditOf(release) {
    if (!release || !release.model || !/^[1-9][0-9]*$/.test(String(release.version))) return null;
    try {
      const version = await api("/v1/models/" + encodeURIComponent(release.model) + "/versions/" + encodeURIComponent(release.version));
      return version.privacy_audit || null;
    } catch (error) {
      if (error instanceof ApiError && error.status === 401) throw error;
      return null; // released by an external trainer: no registry version, no audit
    }
  }

  function auditText(certified) {
    const lower = Number.parseFloat(certified.epsilon_lower.toPrecision(4));
    return "ε ≥ " + lower + " at confidence " + certified.confidence + " (δ " + certified.delta + ") — certified ε ≤ " + certified.epsilon_upper +
      (certified.consistent ? "" : " — CONTRADICTED: the lower bound exceeds the certified bound");
  }

  function dl(items) {
    return h("dl", { class: "facts" }, items.filter(([, v]) => v !== null && v !== undefined && v !== "").map(([k, v, id]) =>
      [h("dt", { text: k }), v instanceof Node ? h("dd", { id: id || null }, v) : h("dd", { id: id || null, text: v })]));
  }

  function pre(value, id) {
    return h("pre", { class: "json", id: id || null, text: JSON.stringify(value === undefined ? null : value, null, 2) });
  }

  function batchTable(batches) {
    if (batches.length === 0) return h("p", { class: "empty", text: "none" });
    const st = (state, key) => (state && state[key] !== undefined ? state[key] : "—");
    const cost = (c, key) => (c && c[key] !== undefined && c[key] !== null ? String(c[key]) : "—");
    return h("div", { class: "scroll" }, h("table", { class: "table compact", id: "cert-batches" },
      h("thead", {}, h("tr", {},
        ["batch or class", "ε spent at reserve", "reserved ε", "committed ε", "ε spent after", "naive ε after", "level", "replay"].map((t) => h("th", { text: t })))),
      h("tbody", {}, batches.map((b) => h("tr", {},
        h("td", { class: "mono", text: b.batch_id || ("class " + b.class + " · " + b.batches + " batch" + (b.batches === 1 ? "" : "es")) }),
        h("td", { class: "num", text: st(b.state_at_reserve, "epsilon_spent") }),
        h("td", { class: "num", text: cost(b.reserved, "epsilon") }),
        h("td", { class: "num", text: cost(b.committed, "epsilon") }),
        h("td", { class: "num", text: st(b.state_after, "epsilon_spent") }),
        h("td", { class: "num", text: st(b.state_after, "naive_epsilon") }),
        h("td", { class: "num", text: cost(b.committed, "level") }),
        h("td", { text: cost(b.committed, "replay") }))))));
  }

  // ------------------------------------------------------------------------------------------
  // Jobs: live progress by polling

  function statusChip(status, id) {
    return h("span", { class: "chip status status-" + status, id: id || null, text: status });
  }

  function progressBar(job, id) {
    const step = job.progress ? job.progress.step : 0;
    const total = job.progress ? job.progress.total : null;
    const fraction = total ? Math.max(0, Math.min(1, step / total)) : 0;
    const W = 200;
    return s("svg", { class: "progress", id: id || null, width: W, height: 10, viewBox: "0 0 " + W + " 10", preserveAspectRatio: "none", role: "img", "aria-label": progressText(job) },
      s("rect", { class: "meter-free", x: 0, y: 0, width: W, height: 10, rx: 3 }),
      s("rect", { class: "progress-done", x: 0, y: 0, width: fraction * W, height: 10, rx: 3 }));
  }

  function progressText(job) {
    const step = job.progress ? job.progress.step : 0;
    const total = job.progress ? job.progress.total : null;
    if (!total) return step + " / ? steps";
    return step + " / " + total + " steps (" + Math.floor((step / total) * 100) + "%)";
  }

  /** Metric name and value pairs, each kept on one line (a name never breaks mid-word). */
  function metricItems(metrics) {
    if (!metrics || Object.keys(metrics).length === 0) return "—";
    // A snake_case name may break only after an underscore (a word boundary), never inside a word.
    const name = (k) => k.split("_").map((part, i, all) => [part + (i < all.length - 1 ? "_" : ""), i < all.length - 1 ? h("wbr", {}) : null]);
    return Object.entries(metrics).slice(0, 4).map(([k, v]) => h("span", { class: "metric", title: k + " " + String(v) }, h("span", { class: "metric-name", "data-name": k }, name(k)), " " + formatMetric(v)));
  }

  function metricsText(metrics) {
    if (!metrics) return "—";
    return Object.entries(metrics).slice(0, 4).map(([k, v]) => k + " " + formatMetric(v)).join(" · ");
  }

  function formatMetric(value) {
    if (typeof value === "number") return Number.isInteger(value) ? String(value) : String(Number.parseFloat(value.toPrecision(4)));
    if (value === null) return "—";
    if (typeof value === "object") return JSON.stringify(value);
    return String(value);
  }

  const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);

  async function jobsPage(gen) {
    fill(view, h("h1", { text: "Jobs" }), h("p", { class: "muted", text: "Training jobs of this tenant, newest first; refreshed every " + JOBS_POLL_MS / 1000 + " s." }));
    const holder = h("div", { id: "jobs-panel" });
    add(view, holder);
    live.hidden = false;
    const names = await datasetNames();
    await tick();

    async function tick() {
      try {
        const page = await api("/v1/jobs?limit=100");
        const held = await reservedOf(page.data);
        if (gen !== generation) return;
        fill(holder, jobsTable(page, names, held));
      } catch (error) {
        if (gen !== generation) return;
        showError(error);
        if (error instanceof ApiError && error.status === 401) return;
      }
      later(gen, JOBS_POLL_MS, tick);
    }
  }

  /** `{dataset id: name}` of the tenant's datasets (one call: GET /v1/spend). */
  async function datasetNames() {
    const names = {};
    try {
      const page = await api("/v1/spend?limit=1000");
      for (const d of page.data) names[d.id] = d.name;
    } catch (error) {
      if (error instanceof ApiError && error.status === 401) throw error;
    }
    return names;
  }

  /** The open reservation of each running job: what it holds (its reserved cost) until it commits. */
  async function reservedOf(jobs) {
    const held = {};
    await Promise.all(jobs.filter((j) => j.reservation_id && !TERMINAL.has(j.status)).map(async (j) => {
      try {
        const r = await api("/v1/reservations/" + encodeURIComponent(j.reservation_id));
        if (r.status === "reserved") held[j.id] = r;
      } catch (error) {
        if (error instanceof ApiError && error.status === 401) throw error;
      }
    }));
    return held;
  }

  /** A job's ε: while it runs, what its reservation holds (reserved, not yet spent); after, what it committed. */
  function jobEpsilon(job, reservation, attrs) {
    if (reservation && reservation.cost) {
      return h("td", Object.assign({ class: "num epsilon reserved", title: "reserved ε " + reservation.cost.epsilon + " (held while the job runs), committed " + job.epsilon_committed, "data-full": reservation.cost.epsilon }, attrs || {}),
        h("span", { class: "reserved-epsilon", text: sig(reservation.cost.epsilon, "up") }),
        h("span", { class: "muted small block", text: "reserved · committed " + sig(job.epsilon_committed, "up") }));
    }
    return exact("td", Object.assign({ class: "num epsilon" }, attrs || {}), job.epsilon_committed, "up");
  }

  function jobsTable(page, names, held) {
    names = names || {};
    held = held || {};
    if (page.count === 0) return h("p", { class: "empty", text: "No jobs yet. Queue one with POST /v1/jobs (a trainer key)." });
    return h("table", { id: "jobs-table", class: "table jobs" },
      h("thead", {}, h("tr", {}, ["Job", "Dataset · model", "Algorithm", "Status", "Progress", "ε reserved / committed", "Metrics", "Versions", "Updated"].map((t) => h("th", { text: t })))),
      h("tbody", {}, page.data.map((j) => h("tr", { "data-job-id": j.id },
        h("td", {}, h("a", { class: "mono id", href: "#/jobs/" + encodeURIComponent(j.id), text: j.id })),
        h("td", { class: "names" },
          h("a", { class: "dataset-name", href: "#/datasets/" + encodeURIComponent(j.dataset_id), title: j.dataset_id, text: names[j.dataset_id] || j.dataset_id }),
          h("a", { class: "small block model-name", href: "#/models/" + encodeURIComponent(j.model_name), text: j.model_name })),
        h("td", { text: j.algorithm }),
        h("td", { class: "status" }, statusChip(j.status), failureReason(j)),
        h("td", { class: "progress-cell" }, progressBar(j), h("span", { class: "small block progress-text", text: progressText(j) })),
        jobEpsilon(j, held[j.id]),
        h("td", { class: "small metrics" }, metricItems(j.metrics)),
        h("td", { class: "num", text: String((j.versions || []).length) }),
        h("td", { class: "small", text: when(j.updated_at) })))));
  }

  /** Why a job failed, in the list: the error code and the start of its message (all on hover). */
  function failureReason(job) {
    if (!job.error) return null;
    const code = job.error.error || "error";
    const full = code + ": " + (job.error.message || "");
    return h("span", { class: "small block failure-reason", title: full, text: clip(full, 90) });
  }

  async function jobPage(gen, id) {
    const panel = h("div", { id: "job-panel" });
    fill(view, 
      h("p", { class: "crumbs" }, h("a", { href: "#/jobs", text: "Jobs" }), " / ", id),
      h("h1", { text: "Job " + id }),
      panel);
    live.hidden = false;
    let polls = 0;
    let versionsKey = null;
    let versionsNode = h("div", { id: "job-versions" });
    await tick();

    async function tick() {
      let job = null;
      try {
        job = await api("/v1/jobs/" + encodeURIComponent(id));
        const reservation = (await reservedOf([job]))[job.id] || null;
        if (gen !== generation) return;
        polls += 1;
        job.reservation = reservation;
        const key = (job.versions || []).map((v) => v.name + "@" + v.version).join(",");
        if (key !== versionsKey) {
          versionsKey = key;
          versionsNode = await versionsList(job);
          if (gen !== generation) return;
        }
        fill(panel, jobDetail(job, polls), versionsNode);
      } catch (error) {
        if (gen !== generation) return;
        showError(error);
        if (error instanceof ApiError && (error.status === 401 || error.status === 404)) return;
      }
      if (job && TERMINAL.has(job.status)) {
        live.hidden = true;
        return;
      }
      later(gen, JOB_POLL_MS, tick);
    }
  }

  function jobDetail(job, polls) {
    const metrics = job.metrics || {};
    return h("div", {},
      h("section", { class: "card", id: "section-job" },
        h("div", { class: "job-head" }, statusChip(job.status, "job-status"),
          h("span", { class: "muted", text: " " + job.algorithm + " on " }),
          h("a", { class: "mono", href: "#/datasets/" + encodeURIComponent(job.dataset_id), text: job.dataset_id }),
          h("span", { class: "muted", text: " · model " + job.model_name + " · attempt " + job.attempts + " of " + job.max_attempts })),
        h("div", { class: "job-progress" }, progressBar(job, "job-progress"), h("span", { id: "job-progress-text", text: progressText(job) })),
        h("div", { class: "stats" },
          job.reservation ? h("div", { class: "stat" }, h("div", { class: "stat-label", text: "ε reserved (held while it runs)" }), exact("div", { class: "stat-value", id: "job-reserved" }, job.reservation.cost.epsilon, "up")) : null,
          h("div", { class: "stat" }, h("div", { class: "stat-label", text: "budget share ε committed (not a guarantee)" }), exact("div", { class: "stat-value", id: "job-epsilon" }, job.epsilon_committed, "up")),
          h("div", { class: "stat" }, h("div", { class: "stat-label", text: "δ committed" }), exact("div", { class: "stat-value" }, job.delta_committed || "0", "up")),
          h("div", { class: "stat" }, h("div", { class: "stat-label", text: "started" }), h("div", { class: "stat-value small", text: when(job.started_at) })),
          h("div", { class: "stat" }, h("div", { class: "stat-label", text: "updated" }), h("div", { class: "stat-value small", id: "job-updated", "data-polls": polls, text: when(job.updated_at) }))),
        job.error ? h("p", { class: "notice error", id: "job-error", text: "Error: " + (job.error.message || JSON.stringify(job.error)) }) : null,
        job.cancel_requested && !TERMINAL.has(job.status) ? h("p", { class: "notice", text: "Cancel requested; the worker stops at its next step." }) : null),
      h("section", { class: "card", id: "section-metrics" },
        h("h2", { text: "Metrics" }),
        Object.keys(metrics).length === 0 ? h("p", { class: "empty", text: "No metrics yet." }) :
          h("table", { class: "table compact", id: "job-metrics" }, h("tbody", {}, Object.entries(metrics).map(([k, v]) =>
            h("tr", { "data-metric": k }, h("th", { text: k }), h("td", { class: "num", title: String(v), "data-full": String(v), text: formatMetric(v) })))))),
      historySection(job.metric_history),
      planSection(job));
  }

  /**
   * The job's per-step curves (GET /v1/jobs/{id} `metric_history`): the iterate's held-out
   * metrics every `every` steps and at each checkpoint, stored by the worker only once a commit
   * covered those steps — so every point is of a released (charged) iterate, never of steps
   * whose cost could still be returned. Checkpoints (published versions) are the filled dots.
   */
  function historySection(history) {
    const points = history && Array.isArray(history.points) ? history.points : [];
    const card = h("section", { class: "card", id: "section-history" }, h("h2", { text: "Metrics per step" }));
    if (points.length === 0) {
      return add(card, h("p", { class: "empty", text: "No steps released yet: a point is stored only after the ledger commits the steps it describes." }));
    }
    const names = [];
    for (const p of points) for (const [k, v] of Object.entries(p)) if (typeof v === "number" && k !== "step" && names.indexOf(k) < 0) names.push(k);
    names.sort((a, b) => (b.indexOf("loss") >= 0) - (a.indexOf("loss") >= 0));
    const W = 440, H = 180, L = 50, R = 60, T = 12, B = 34;
    const xMax = Math.max(...points.map((p) => p.step)) || 1;
    const x = (v) => L + (v / xMax) * (W - L - R);
    add(card, h("p", { class: "muted", id: "history-note", text: points.length + " points, every " + history.every + " steps and at each checkpoint, up to step " + xMax +
      ": the iterate on the held-out test split, recorded only after the ledger committed those steps (the worker drops points of steps it did not release). Filled dots: published versions." }));
    return add(card, h("div", { id: "history-curves" }, names.slice(0, 4).map((metric) => {
      const shown = points.filter((p) => typeof p[metric] === "number");
      const ys = shown.map((p) => p[metric]);
      const lo = Math.min(...ys), hi = Math.max(...ys);
      const pad = (hi - lo) * 0.1 || Math.abs(hi) * 0.1 || 1;
      const y = (v) => T + (1 - (v - (lo - pad)) / (hi - lo + 2 * pad)) * (H - T - B);
      const d = shown.map((p, i) => (i ? "L" : "M") + x(p.step).toFixed(1) + " " + y(p[metric]).toFixed(1)).join(" ");
      const last = shown[shown.length - 1];
      return h("div", { class: "curve" }, h("div", { class: "small curve-name", title: metric, text: metric }),
        s("svg", { class: "chart history-curve", "data-metric": metric, "data-points": shown.length, viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": metric + " per step" },
          [lo, hi].map((t) => s("text", { class: "tick", x: L - 6, y: y(t) + 4, "text-anchor": "end", text: short(t) })),
          [0, xMax].map((t) => s("text", { class: "tick", x: x(t), y: H - B + 16, "text-anchor": "middle", text: String(t) })),
          s("text", { class: "axis-title", x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle", text: "step" }),
          s("path", { class: "series-metric", d }),
          shown.filter((p) => p.checkpoint).map((p) => s("circle", { class: "pt-metric pt-checkpoint", cx: x(p.step), cy: y(p[metric]), r: 3.5, "data-step": p.step },
            title("checkpoint at step " + p.step + " (a published version): " + metric + " " + p[metric]))),
          s("text", { class: "series-label", x: W - R + 8, y: y(last[metric]) + 4, text: formatMetric(last[metric]) })));
    })));
  }

  /** The plan the worker recorded before it reserved (what the charge is for) and the params. */
  function planSection(job) {
    const plan = job.plan || null;
    const rows = [];
    if (plan && plan.kind === "staged") {
      rows.push(["stages", String(plan.stages), "plan-stages"]);
    } else if (plan) {
      const q = plan.sampling_probability;
      rows.push(["noise multiplier σ", plan.noise_multiplier === undefined ? null : exact("span", {}, plan.noise_multiplier), "plan-sigma"]);
      rows.push(["sampling probability q (Poisson)", q === undefined ? null : exact("span", {}, q), "plan-q"]);
      rows.push(["steps", plan.steps === undefined ? null : String(plan.steps), "plan-steps"]);
      rows.push(["records", plan.n_records === undefined ? null : String(plan.n_records), "plan-records"]);
      if (q !== undefined && plan.n_records !== undefined) rows.push(["expected batch size q·N", sig(String(q * plan.n_records))]);
      const clipping = plan.params && plan.params.max_grad_norm;
      rows.push(["clipping norm C", clipping === undefined || clipping === null ? null : String(clipping), "plan-clipping"]);
    }
    return h("section", { class: "card", id: "section-plan" },
      h("h2", { text: "Plan and params" }),
      plan ? h("p", { class: "muted", text: "What the worker reserved before it read any data: the charge is for this event." }) :
        h("p", { class: "empty", text: "No plan yet: the worker records it when it claims the job, before it reserves." }),
      plan ? dl(rows) : null,
      plan && (plan.event || plan.events) ? [h("h3", { text: plan.event ? "Event (the charge)" : "Events of the stages" }), pre(plan.event || plan.events, "plan-event")] : null,
      h("h3", { text: "Params (as submitted, validated)" }), pre(job.params || {}, "job-params"));
  }

  async function versionsList(job) {
    const versions = job.versions || [];
    const wrapper = h("section", { class: "card", id: "job-versions" }, h("h2", { text: "Released versions" }));
    if (versions.length === 0) {
      add(wrapper, h("p", { class: "empty", text: "None yet: a version is published only after the ledger commits its release." }));
      return wrapper;
    }
    let certificates = {};
    try {
      const page = await api("/v1/models/" + encodeURIComponent(job.model_name) + "/versions?limit=1000");
      for (const v of page.data) certificates[v.version] = v;
    } catch (error) {
      if (error instanceof ApiError && error.status === 401) throw error;
      certificates = {};
    }
    const known = versions.map((v) => certificates[v.version]).filter(Boolean);
    add(wrapper, metricCurves(known));
    add(wrapper, h("table", { class: "table compact", id: "versions-table" },
      h("thead", {}, h("tr", {}, ["Version", "Step", "Metrics", "Certificate", "Weights"].map((t) => h("th", { text: t })))),
      h("tbody", {}, versions.map((v) => {
        const known = certificates[v.version];
        return h("tr", { "data-version": v.version },
          h("td", {}, h("a", { class: "version-link", href: modelHref(v.name, v.version), text: v.name + " v" + v.version })),
          h("td", { class: "num", text: String(v.step) }),
          h("td", { class: "small", text: known ? metricsText(known.metrics) : "—" }),
          h("td", {}, known ? h("a", { class: "mono small id", href: "#/certificates/" + encodeURIComponent(known.certificate_id), text: known.certificate_id }) : "—"),
          h("td", {}, known ? downloadButton(known) : "—"));
      }))));
    return wrapper;
  }

  function modelHref(name, version) {
    return "#/models/" + encodeURIComponent(name) + "/" + encodeURIComponent(version);
  }

  /**
   * The artifact needs the session's key (Authorization header), so a plain link cannot fetch
   * it: the button fetches it, checks its SHA-256 against the one recorded at publication, and
   * saves it under the server's file name.
   */
  function downloadButton(version) {
    const status = h("span", { class: "small muted download-status" });
    const button = h("button", { type: "button", class: "download", "data-sha256": version.artifact.sha256,
      text: "Download " + version.artifact.format + " (" + Math.max(1, Math.round(version.artifact.bytes / 1024)) + " KiB)" });
    button.addEventListener("click", async () => {
      button.disabled = true;
      status.textContent = " downloading…";
      try {
        const response = await fetch(version.artifact.url, { headers: { Authorization: "Bearer " + getKey() }, cache: "no-store", credentials: "omit" });
        if (!response.ok) throw new ApiError(response.status, await response.json().catch(() => null));
        const bytes = await response.arrayBuffer();
        const digest = Array.from(new Uint8Array(await crypto.subtle.digest("SHA-256", bytes))).map((b) => b.toString(16).padStart(2, "0")).join("");
        if (digest !== version.artifact.sha256) throw new Error("the artifact's SHA-256 " + digest + " is not the recorded " + version.artifact.sha256);
        const disposition = response.headers.get("content-disposition") || "";
        const match = /filename="?([^";]+)"?/.exec(disposition);
        const link = h("a", { href: URL.createObjectURL(new Blob([bytes], { type: "application/octet-stream" })), download: match ? match[1] : version.name + "-v" + version.version });
        document.body.appendChild(link);
        link.click();
        link.remove();
        status.textContent = " saved (SHA-256 checked)";
      } catch (error) {
        status.textContent = " failed: " + error.message;
        showError(error);
      } finally {
        button.disabled = false;
      }
    });
    return h("span", {}, button, status);
  }

  // ------------------------------------------------------------------------------------------
  // A model version: its DP statement (Ponomareva et al. 2023, §5.3), architecture, weights

  async function modelVersionPage(gen, name, version) {
    const v = await api("/v1/models/" + encodeURIComponent(name) + "/versions/" + encodeURIComponent(version));
    if (gen !== generation) return;
    const st = v.dp_statement || {};
    const mech = st.mechanism || {};
    const sampler = mech.sampler || null;
    const spec = v.model_spec || null;
    fill(view,
      h("p", { class: "crumbs" }, h("a", { href: "#/models", text: "Models" }), " / ",
        h("a", { href: "#/models/" + encodeURIComponent(v.name), text: v.name }),
        v.job_id ? [" · trained by ", h("a", { href: "#/jobs/" + encodeURIComponent(v.job_id), text: "job " + v.job_id })] : " · trained outside the service", " / v" + v.version),
      h("h1", { text: v.name + " v" + v.version }),
      h("section", { class: "card", id: "section-statement" },
        h("h2", { text: "DP statement" }),
        h("p", { class: "muted", text: "Derived by the ledger from the version's signed certificate" + (v.job_id ? " and its job's plan" : " alone (the model was trained outside the service: nothing its trainer states enters it)") + "; fields of " + (st.guidelines || "the reporting guidelines") + ". `ledger model-card " + v.name + " " + v.version + "` renders it as a model card." }),
        dl([
          ["guarantee of this model", st.guarantee ? h("span", {}, "(ε ≤ ", exact("span", { id: "statement-epsilon" }, st.guarantee.epsilon, "up"), ", δ ≤ ", exact("span", { id: "statement-delta" }, st.guarantee.delta, "up"), ")-DP — " + st.guarantee.scope + (st.guarantee.covers ? "; it covers " + st.guarantee.covers : "")) : null],
          ["this run alone", st.run_alone ? h("span", { id: "statement-run-alone" }, "(ε ≤ ", exact("span", {}, st.run_alone.epsilon, "up"), ", δ ≤ ", exact("span", {}, st.run_alone.delta, "up"), ")-DP by " + st.run_alone.accountant + " — " + st.run_alone.scope +
            (st.run_alone.certified === false ? "; derived from the certificate's charge and budget δ, not certified (ledger check recomputes it)" : "")) : null],
          ["budget share", st.budget_share ? h("span", { id: "statement-budget-share" }, "ε ", exact("span", {}, st.budget_share.epsilon, "up"), " — " + st.budget_share.scope) : null],
          ["privacy unit", st.privacy_unit ? st.privacy_unit.description : null, "statement-unit"],
          ["granularity", st.granularity],
          ["accountant", st.accounting ? st.accounting.accountant : null, "statement-accountant"],
          ["conversion", st.accounting ? st.accounting.conversion : null],
          ["rule and theorem", st.accounting ? st.accounting.rule + ": " + st.accounting.theorem : null],
          ["sampler", sampler ? sampler.description + (sampler.sampling_probability !== undefined ? " (q ≈ " + sig(sampler.sampling_probability) + ")" : "") : "not one DP-SGD run", "statement-sampler"],
          ["steps", mech.steps === null || mech.steps === undefined ? null : String(mech.steps), "statement-steps"],
          ["noise multiplier σ", mech.noise_multiplier === null || mech.noise_multiplier === undefined ? null : String(mech.noise_multiplier), "statement-sigma"],
          ["clipping norm C", mech.clipping_norm !== null && mech.clipping_norm !== undefined ? String(mech.clipping_norm) : mech.clipping_norm_source, "statement-clipping"],
          ["public / pre-trained data", st.public_data],
          ["budget remaining", st.budget ? h("span", {}, "ε ", remainingOf("span", { id: "statement-remaining" }, st.budget.epsilon_remaining, st.budget.epsilon), " of ", exact("span", {}, st.budget.epsilon),
            st.budget.delta_remaining === null ? "" : [", δ ", exact("span", {}, st.budget.delta_remaining, "down")], " — " + st.budget.scope + "; " + st.budget.delta_note) : null],
          ["certificate", st.certificate ? h("a", { href: "#/certificates/" + encodeURIComponent(st.certificate.id), text: st.certificate.id }) : null],
        ])),
      h("section", { class: "card", id: "section-model" },
        h("h2", { text: "Model" }),
        spec && spec.kind === "external" ? dl([
          ["origin", "trained outside the service, registered against the certificate of its release", "model-origin"],
          ["architecture (as registered)", spec.architecture, "model-architecture"],
          ["preprocessing (as registered)", spec.preprocessing, "model-preprocessing"],
          ["get it", "LedgerClient(url, key).download_artifact(" + JSON.stringify(v.name) + ", " + v.version + ")"],
        ]) : spec ? dl([
          ["architecture", spec.model + " " + JSON.stringify(spec.hidden) + ", " + spec.n_features + " inputs → " + spec.num_classes + " class logits", "model-architecture"],
          ["preprocessing", JSON.stringify(spec.preprocessing), "model-preprocessing"],
          ["data source", spec.data_source],
          ["load it", "service.training.nets.load_model(LedgerClient(url, key), " + JSON.stringify(v.name) + ", " + v.version + ")"],
        ]) : h("p", { class: "empty", text: "This version records no architecture (published before it was recorded, or a staged trainer's): download the weights." }),
        h("h3", { text: "Metrics" }), pre(v.metrics || {}, "model-metrics"),
        h("h3", { text: "Weights" }), downloadButton(v)));
  }


  // ------------------------------------------------------------------------------------------
  // ε over releases (every dataset): spent and the guarantee after each release, the budget line

  function epsilonOverReleases(answer, spend) {
    const releases = (answer.data || []).slice().reverse();  // oldest first
    if (releases.length === 0) return h("p", { class: "empty", text: "No releases yet." });
    const W = 760, H = 240, L = 56, R = 150, T = 14, B = 40;
    const budget = num(spend.epsilon_budget);
    const heldNow = num(spend.epsilon_held);
    const last = releases[releases.length - 1];
    const guaranteeOf = (r) => (r.guarantee ? r.guarantee.epsilon : r.epsilon);
    const share = isShare(spend.epsilon_spent_is);
    const heldAt = (r) => (r.held_at_release ? num(r.held_at_release.epsilon) : 0);
    const yTop = Math.max(budget, num(last.epsilon) + heldNow, ...releases.map((r) => Math.max(num(r.epsilon) + heldAt(r), num(guaranteeOf(r))))) * 1.08 || 1;
    const n = releases.length;
    // the last slot is "now" when something is held now: its bar stands right of the last release
    const slots = heldNow > 0 ? n + 1 : n;
    const x = (i) => L + (slots === 1 ? 0.5 : i / (slots - 1)) * (W - L - R);
    const y = (v) => T + (1 - v / yTop) * (H - T - B);
    const step = (value) => releases.map((r, i) => (i ? "H" + x(i).toFixed(1) + " V" : "M" + x(i).toFixed(1) + " ") + y(num(value(r))).toFixed(1)).join(" ");
    const yTicks = niceTicks(yTop, 5).filter((t) => t <= yTop);
    const every = Math.max(1, Math.ceil(n / 10));
    const labels = layoutLabels([
      { key: "budget", y: y(budget), text: "budget " + sig(spend.epsilon_budget), full: spend.epsilon_budget, cls: "budget-text" },
      { key: "spent", y: y(num(last.epsilon)), text: (share ? "used " : "spent ") + sig(last.epsilon, "up"), full: last.epsilon, cls: "spent-text" },
      last.guarantee && last.guarantee.epsilon !== last.epsilon ? { key: "guarantee", y: y(num(last.guarantee.epsilon)), text: "guarantee " + sig(last.guarantee.epsilon, "up"), full: last.guarantee.epsilon, cls: "guarantee-text" } : null,
      heldNow > 0 ? { key: "held", y: y(num(last.epsilon) + heldNow), text: "+ held now " + sig(spend.epsilon_held, "up"), full: spend.epsilon_held, cls: "held-text" } : null,
    ].filter(Boolean), T + 4, H - B - 2);
    const caption = n + " release" + (n === 1 ? "" : "s") + " · ε spent after the last " + sig(last.epsilon, "up") + " of the budget " + sig(spend.epsilon_budget) +
      (heldAt(last) > 0 ? " · held then " + sig(last.held_at_release.epsilon, "up") : "") +
      (heldNow > 0 ? " · held now " + sig(spend.epsilon_held, "up") : "");
    return h("div", {},
      s("svg", { id: "epsilon-over-time", class: "chart", viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": caption },
        yTicks.map((t) => [s("line", { class: "grid", x1: L, x2: W - R, y1: y(t), y2: y(t) }), s("text", { class: "tick", x: L - 6, y: y(t) + 4, "text-anchor": "end", text: short(t) })]),
        releases.map((r, i) => (i % every === 0 || i === n - 1) ? s("text", { class: "tick", x: x(i), y: H - B + 16, "text-anchor": "middle", text: "v" + r.version }, title(r.model + " v" + r.version + " · " + when(r.created_at))) : null),
        s("text", { class: "axis-title", x: (L + W - R) / 2, y: H - 6, "text-anchor": "middle", text: "releases, oldest first" }),
        s("line", { class: "budget-line", x1: L, x2: W - R, y1: y(budget), y2: y(budget) }, title("budget ε " + spend.epsilon_budget)),
        // held at each release: what open reservations held (reserved, not yet committed) then, above what was spent
        releases.map((r, i) => heldAt(r) > 0 ? s("rect", { class: "held-band held-at-release", x: x(i) - 5, y: y(num(r.epsilon) + heldAt(r)), width: 10, height: Math.max(1, y(num(r.epsilon)) - y(num(r.epsilon) + heldAt(r))), "data-version": r.version, "data-held": r.held_at_release.epsilon },
          title(r.model + " v" + r.version + ": held by open reservations when it was certified ε " + r.held_at_release.epsilon + " (reserved, not yet committed), above ε spent " + r.epsilon)) : null),
        heldNow > 0 ? [s("path", { class: "series-spent series-now", d: "M" + x(n - 1).toFixed(1) + " " + y(num(last.epsilon)).toFixed(1) + " H" + x(n).toFixed(1) }),
          s("rect", { class: "held-band held-now", x: x(n) - 6, y: y(num(last.epsilon) + heldNow), width: 12, height: Math.max(1, y(num(last.epsilon)) - y(num(last.epsilon) + heldNow)) }, title("held now by open reservations: ε " + spend.epsilon_held)),
          s("text", { class: "tick", x: x(n), y: H - B + 16, "text-anchor": "middle", text: "now" })] : null,
        s("path", { class: "series-spent", d: step((r) => r.epsilon) }),
        s("path", { class: "series-guarantee", d: step(guaranteeOf) }),
        releases.map((r, i) => s("circle", { class: "pt-release", cx: x(i), cy: y(num(r.epsilon)), r: 3.5, "data-epsilon": r.epsilon, "data-version": r.version },
          title(r.model + " v" + r.version + ": ε spent after " + r.epsilon + ", budget share " + r.charge.epsilon + (r.guarantee ? ", guarantee ε " + r.guarantee.epsilon : "")))),
        labels.map((l) => s("text", { class: "series-label " + l.cls, x: W - R + 6, y: l.at + 4, "data-full": l.full, text: l.text }))),
      h("p", { id: "epsilon-over-time-caption", class: "caption", text: caption }),
      h("p", { class: "legend" },
        h("span", { class: "swatch swatch-spent" }), share ? "budget used after each release (the Rényi filter's progress: a budget share, not a DP guarantee) " : "ε spent after each release (max over batches) ",
        h("span", { class: "swatch swatch-guarantee-line" }), "guarantee of the release (every release so far) ",
        h("span", { class: "swatch swatch-held" }), "held by open reservations (reserved, not yet committed) at each release, and now ",
        h("span", { class: "swatch swatch-budget" }), "budget"));
  }

  /** End labels of a chart, kept at least `gap` px apart (in y order), inside [top, bottom]. */
  function layoutLabels(labels, top, bottom, gap) {
    gap = gap || 14;
    const sorted = labels.slice().sort((a, b) => a.y - b.y);
    let previous = -Infinity;
    for (const l of sorted) {
      l.at = Math.max(l.y, previous + gap, top);
      previous = l.at;
    }
    const overflow = previous - bottom;
    if (overflow > 0) for (const l of sorted) l.at -= overflow;
    return sorted;
  }

  // ------------------------------------------------------------------------------------------
  // Models: the index, one model's versions with a privacy–utility view

  async function modelsPage(gen, offset) {
    const limit = 100;
    const [page, names] = await Promise.all([api("/v1/models?limit=" + limit + "&offset=" + offset), datasetNames()]);
    if (gen !== generation) return;
    fill(view, h("h1", { text: "Models" }),
      h("p", { class: "muted", text: "Every released model version of this tenant: trained by the service's worker, or outside it and registered against the certificate of its release (PUT /v1/models/{name}/versions/{v})." }));
    if (page.count === 0) {
      add(view, h("p", { class: "empty", text: "No models yet. A job publishes its versions; a model trained outside is registered with LedgerClient.register_model_version." }));
      return;
    }
    add(view, h("table", { id: "models-table", class: "table" },
      h("thead", {}, h("tr", {}, ["Model", "Versions", "Trained outside", "Latest", "Latest at", "Datasets"].map((t) => h("th", { text: t })))),
      h("tbody", {}, page.data.map((m) => h("tr", { "data-model": m.name },
        h("td", { class: "name" }, h("a", { href: "#/models/" + encodeURIComponent(m.name), text: m.name })),
        h("td", { class: "num versions", text: String(m.versions) }),
        h("td", { class: "num external", text: String(m.external_versions) }),
        h("td", {}, h("a", { href: modelHref(m.name, m.latest_version), text: "v" + m.latest_version })),
        h("td", { class: "small", text: when(m.latest_created_at) }),
        h("td", { class: "small" }, m.dataset_ids.map((id, i) => [i ? ", " : "", h("a", { href: "#/datasets/" + encodeURIComponent(id), title: id, text: names[id] || id })])))))));
    add(view, pager(offset, limit, page.count, "models", (next) => modelsPage(gen, next).catch(showError)));
  }

  async function modelPage(gen, name) {
    const page = await api("/v1/models/" + encodeURIComponent(name) + "/versions?limit=1000");
    if (gen !== generation) return;
    const versions = page.data;
    fill(view,
      h("p", { class: "crumbs" }, h("a", { href: "#/models", text: "Models" }), " / ", name),
      h("h1", { id: "model-name", text: name }),
      section("Privacy and utility", "privacy-utility", privacyUtility(versions)),
      section("Versions", "model-versions", h("table", { class: "table compact", id: "model-versions-table" },
        h("thead", {}, h("tr", {}, ["Version", "Origin", "Guarantee ε", "δ", "Metrics", "Certificate", "Created"].map((t) => h("th", { text: t })))),
        h("tbody", {}, versions.map((v) => h("tr", { "data-version": v.version },
          h("td", {}, h("a", { href: modelHref(v.name, v.version), text: "v" + v.version })),
          h("td", {}, v.job_id ? h("a", { class: "mono small id", href: "#/jobs/" + encodeURIComponent(v.job_id), text: "job " + v.job_id }) : h("span", { class: "chip", text: "external" })),
          exact("td", { class: "num guarantee-epsilon" }, v.guarantee ? v.guarantee.epsilon : null, "up"),
          exact("td", { class: "num" }, v.guarantee ? v.guarantee.delta : null, "up"),
          h("td", { class: "small metrics" }, metricItems(v.metrics)),
          h("td", {}, h("a", { class: "mono small id", href: "#/certificates/" + encodeURIComponent(v.certificate_id), text: v.certificate_id })),
          h("td", { class: "small", text: when(v.created_at) })))))));
  }

  /** The metric names of `versions` that are numbers in at least one (``step`` left out). */
  function numericMetrics(versions) {
    const names = [];
    for (const v of versions) for (const [k, value] of Object.entries(v.metrics || {})) {
      if (typeof value === "number" && k !== "step" && k !== "stage" && names.indexOf(k) < 0) names.push(k);
    }
    const preferred = ["accuracy", "test_accuracy", "val_accuracy"];
    names.sort((a, b) => (preferred.indexOf(b) >= 0) - (preferred.indexOf(a) >= 0));
    return names;
  }

  /** Each version's metric against its guarantee ε (a scatter; pick the metric). */
  function privacyUtility(versions) {
    const metrics = numericMetrics(versions);
    const holder = h("div", { id: "privacy-utility-panel" });
    if (metrics.length === 0) return add(holder, h("p", { class: "empty", text: "No version records a numeric metric." }));
    const select = h("select", { id: "utility-metric", "aria-label": "metric" }, metrics.map((m) => h("option", { value: m, text: m })));
    const chart = h("div", {});
    select.addEventListener("change", () => fill(chart, draw(select.value)));
    fill(chart, draw(metrics[0]));
    return add(holder, h("p", { class: "muted" }, "Metric ", select, " against each version's guarantee ε (its certificate's, valid for every release from the batches it read). Metrics are the trainer's own evaluation."), chart);

    function draw(metric) {
      const points = versions.filter((v) => v.guarantee && typeof (v.metrics || {})[metric] === "number");
      const W = 640, H = 260, L = 56, R = 24, T = 14, B = 40;
      const xs = points.map((v) => num(v.guarantee.epsilon));
      const ys = points.map((v) => v.metrics[metric]);
      const xTop = Math.max(...xs, 0) * 1.1 || 1;
      const yMin = Math.min(...ys, 0), yMax = Math.max(...ys, 0) * 1.1 || 1;
      const x = (v) => L + (v / xTop) * (W - L - R);
      const y = (v) => T + (1 - (v - yMin) / (yMax - yMin || 1)) * (H - T - B);
      return s("svg", { id: "privacy-utility", class: "chart chart-narrow", viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": metric + " against guarantee ε" },
        niceTicks(xTop, 5).filter((t) => t <= xTop).map((t) => [s("line", { class: "grid", x1: x(t), x2: x(t), y1: T, y2: H - B }), s("text", { class: "tick", x: x(t), y: H - B + 16, "text-anchor": "middle", text: short(t) })]),
        niceTicks(yMax - yMin, 4).map((t) => t + yMin).filter((t) => t <= yMax).map((t) => s("text", { class: "tick", x: L - 6, y: y(t) + 4, "text-anchor": "end", text: short(t) })),
        s("text", { class: "axis-title", x: (L + W - R) / 2, y: H - 6, "text-anchor": "middle", text: "guarantee ε" }),
        s("text", { class: "axis-title", x: 12, y: (T + H - B) / 2, "text-anchor": "middle", transform: "rotate(-90 12 " + (T + H - B) / 2 + ")", text: metric }),
        points.map((v) => s("g", { class: "pu-point", "data-version": v.version, "data-epsilon": v.guarantee.epsilon, "data-metric": String(v.metrics[metric]) },
          s("circle", { cx: x(num(v.guarantee.epsilon)), cy: y(v.metrics[metric]), r: 4.5, class: v.job_id ? "pt-job" : "pt-external" },
            title("v" + v.version + ": guarantee ε " + v.guarantee.epsilon + ", " + metric + " " + v.metrics[metric])),
          s("text", { class: "tick", x: x(num(v.guarantee.epsilon)) + 7, y: y(v.metrics[metric]) - 6, text: "v" + v.version }))));
    }
  }

  /** Each numeric metric of a job's released checkpoints against their step (the curves the
   * worker records: one point per published version). */
  function metricCurves(versions) {
    const withStep = versions.filter((v) => v.metrics && typeof v.metrics.step === "number");
    const metrics = numericMetrics(withStep);
    if (withStep.length < 2 || metrics.length === 0) return null;
    const W = 440, H = 170, L = 50, R = 56, T = 12, B = 34;
    const steps = withStep.map((v) => v.metrics.step);
    const xMax = Math.max(...steps) || 1;
    const x = (v) => L + (v / xMax) * (W - L - R);
    return h("div", { id: "metric-curves-panel" }, h("h3", { text: "Metrics per step (the released checkpoints)" }), h("div", { id: "metric-curves" }, metrics.slice(0, 4).map((metric) => {
      const points = withStep.filter((v) => typeof v.metrics[metric] === "number");
      const ys = points.map((v) => v.metrics[metric]);
      const lo = Math.min(...ys), hi = Math.max(...ys);
      const pad = (hi - lo) * 0.1 || Math.abs(hi) * 0.1 || 1;
      const y = (v) => T + (1 - (v - (lo - pad)) / (hi - lo + 2 * pad)) * (H - T - B);
      const d = points.map((v, i) => (i ? "L" : "M") + x(v.metrics.step).toFixed(1) + " " + y(v.metrics[metric]).toFixed(1)).join(" ");
      const lastPoint = points[points.length - 1];
      return h("div", { class: "curve" }, h("div", { class: "small curve-name", title: metric, text: metric }), s("svg", { class: "chart metric-curve", "data-metric": metric, viewBox: "0 0 " + W + " " + H, role: "img", "aria-label": metric + " per step" },
        [lo, hi].map((t) => s("text", { class: "tick", x: L - 6, y: y(t) + 4, "text-anchor": "end", text: short(t) })),
        [0, xMax].map((t) => s("text", { class: "tick", x: x(t), y: H - B + 16, "text-anchor": "middle", text: String(t) })),
        s("text", { class: "axis-title", x: (L + W - R) / 2, y: H - 4, "text-anchor": "middle", text: "step" }),
        s("path", { class: "series-metric", d }),
        points.map((v) => s("circle", { class: "pt-metric", cx: x(v.metrics.step), cy: y(v.metrics[metric]), r: 3 }, title("v" + v.version + " (step " + v.metrics.step + "): " + metric + " " + v.metrics[metric]))),
        s("text", { class: "series-label", x: W - R + 8, y: y(lastPoint.metrics[metric]) + 4, text: formatMetric(lastPoint.metrics[metric]) })));
    })));
  }

  // ------------------------------------------------------------------------------------------
  // The audit log: a dataset's hash chain, entry by entry, and its verification

  const AUDIT_PAGE = 200;

  async function auditPage(gen, datasetId) {
    const spend = await api("/v1/spend?limit=1000");
    if (gen !== generation) return;
    fill(view, h("h1", { text: "Audit log" }),
      h("p", { class: "muted", text: "Each dataset's append-only hash chain: every reservation, commit, abort, publication and administrative change, each entry hashing the one before it; the head is signed by the server (GET /v1/datasets/{id}/audit). Verification recomputes the whole chain on the server." }));
    if (spend.count === 0) {
      add(view, h("p", { class: "empty", text: "No datasets yet, so no chains." }));
      return;
    }
    const chosen = datasetId || spend.data[0].id;
    const select = h("select", { id: "audit-dataset", "aria-label": "dataset" },
      spend.data.map((d) => h("option", { value: d.id, selected: d.id === chosen, text: d.name + " (" + d.id + ")" })));
    select.addEventListener("change", () => { window.location.hash = "#/audit/" + encodeURIComponent(select.value); });
    const status = h("span", { id: "audit-verify", class: "verify-result pending", text: "verifying…" });
    const entries = h("div", { id: "audit-entries-panel" });
    add(view, h("div", { class: "verify-row" }, h("label", { for: "audit-dataset", text: "Dataset " }), select, status), entries);
    const path = "/v1/datasets/" + encodeURIComponent(chosen) + "/audit";
    const [page, verified] = await Promise.all([
      api(path + "?after=0&limit=" + AUDIT_PAGE),
      api("/v1/audit/verify?dataset_id=" + encodeURIComponent(chosen)).catch((error) => ({ ok: false, reason: error.message })),
    ]);
    if (gen !== generation) return;
    status.className = "verify-result " + (verified.ok ? "ok" : "bad");
    status.textContent = verified.ok ? "chain verified: " + verified.entries + " entries, hashes and links recomputed" : "NOT verified — " + (verified.reason || JSON.stringify(verified));
    draw(page, [0]);

    function draw(answer, starts) {
      fill(entries,
        answer.head ? h("p", { class: "small muted", id: "audit-head" }, "Head: entry " + answer.head.chain_seq + " · ", h("span", { class: "mono", text: answer.head.hash }), answer.head.signature ? " · signed by key " + answer.head.signature.key_id : "") : null,
        answer.data.length === 0 ? h("p", { class: "empty", text: "No entries." }) :
          h("table", { class: "table compact", id: "audit-table" },
            h("thead", {}, h("tr", {}, ["#", "Time", "Event", "What", "Hash"].map((t) => h("th", { text: t })))),
            h("tbody", {}, answer.data.map((e) => h("tr", { "data-seq": e.chain_seq, "data-event": e.event_type },
              h("td", { class: "num", text: String(e.chain_seq) }),
              h("td", { class: "small nowrap", text: when(e.created_at) }),
              h("td", {}, h("span", { class: "chip event", text: e.event_type })),
              h("td", { class: "small payload", title: JSON.stringify(e.payload) }, payloadText(e.payload)),
              h("td", { class: "mono small", title: e.hash + " (previous " + e.prev_hash + ")", text: e.hash.slice(0, 12) + "…" }))))),
        h("div", { class: "pager", id: "audit-pager" },
          h("button", { type: "button", id: "audit-prev", disabled: starts.length < 2, text: "‹ Previous", onclick: () => {
            const back = starts.slice(0, -1);
            load(back[back.length - 1], back);
          } }),
          h("button", { type: "button", id: "audit-next", disabled: answer.next_after === null || answer.next_after === undefined, text: "Next ›", onclick: () => load(answer.next_after, starts.concat([answer.next_after])) })));
    }

    function load(after, starts) {
      api(path + "?after=" + after + "&limit=" + AUDIT_PAGE)
        .then((answer) => { if (gen === generation) draw(answer, starts); })
        .catch(showError);
    }
  }

  /** An audit payload in a line: its fields, with links to what they name. */
  function payloadText(payload) {
    if (!payload || typeof payload !== "object") return String(payload);
    const parts = [];
    for (const [k, v] of Object.entries(payload)) {
      if (v === null || v === undefined) continue;
      let shown;
      if (k === "certificate_id") shown = h("a", { href: "#/certificates/" + encodeURIComponent(v), text: String(v) });
      else if (typeof v === "object") shown = clip(JSON.stringify(v), 60);
      else shown = clip(String(v), 60);
      parts.push(h("span", { class: "field" }, h("span", { class: "muted", text: k + " " }), shown));
    }
    return parts;
  }

  /** A budget in words: the rule and how it composes under its accountant, ε, δ (the theorem is
   * in "Rule and theorem"; the JSON internals are folded below). */
  function budgetInWords(budget, cert) {
    const rule = budget.rule || cert.rule;
    const accountant = budget.accountant || cert.accountant;
    const sequential = {
      basic: "sequential composition: every charge on a batch adds up (basic composition)",
      rdp: "sequential composition under a Rényi privacy filter per batch: charges compose as Rényi DP and the budget holds under adaptive choices",
      prv: "sequential composition of declared plan segments, each priced tightly (PRV) and summed",
    };
    const words = {
      sequential: sequential[accountant] || "sequential composition",
      parallel: "parallel composition: disjoint batches each charged once, the maximum counts",
      lifelong: "lifelong (L2DP-ML): a constant ε however many tasks; replays of committed noise are free",
      geometric: "geometric series: level k allows first·ratioᵏ, each level used once per block",
    };
    return h("p", { id: "cert-budget-words" },
      (words[rule] || rule) + ". Budget ε " + (budget.epsilon === undefined ? "—" : budget.epsilon) + ", δ " + (budget.delta === undefined ? "—" : budget.delta) +
      ", accountant " + accountant + ".",
      h("span", { class: "muted", text: " The theorem it rests on is under Rule and theorem." }));
  }

  // ------------------------------------------------------------------------------------------

  window.addEventListener("hashchange", render);
  window.addEventListener("unhandledrejection", (event) => {
    showError(event.reason);
  });
  render();
})();

/**
 * "All tasks" on the dashboard: the operators' list (`GET /v1/tasks?order=newest`), newest first, a page at a
 * time, live. Each task's title (its id where it has none; the id is the link's title), with its status line
 * (`metadata.message`) under it, its state, progress, attempts, worker, when it was created, how long it has
 * run (its last attempt: from its start to its end, or to now while it runs), a batch's counts of its
 * children, and its tags. Filters: state, title text, tag and batch (`?state=`, `?title=`, `?tag=`,
 * `?parent=`); a tag or a batch's counts in a row set its filter. A task's title links to the dashboard
 * watching it (`/?task=ID`): a batch opens there as its parent with its children.
 *
 * Live: each task shown that has not ended is followed on a client of the list's own (its state, progress,
 * status line and counts change in place), and the first page is read again every few seconds while the
 * list is open and the page visible, so that tasks created since come in at the top.
 *
 * On a phone each task is a block: its title (wrapped, never cut), then its state and each number under its
 * name, then its worker, batch and tags where it has them, so that nothing is cut or off screen.
 *
 * Shown only where this page may read the management API (open mode on loopback; with an API key the
 * browser holds none, so the section stays hidden, and so do the operators' links in the footer).
 *
 * A task's state reads as on its card (state-words.js): a task requeued after a failed attempt is "Retrying",
 * a cancelled one "Cancelled".
 *
 * State for tests: `#all-tasks[data-ready][data-count][data-more][data-query]` (`data-query`: the filters of
 * the rows shown, as a query string); each row is `tr[data-task-id][data-state][data-shown][data-retrying]
 * [data-cancelled][data-progress][data-message]` (`data-state` as the gateway says it, `data-shown` as the
 * badge does: "retrying", "cancelled" or the state).
 */

import { GatewayClient, watchBrowser } from "./gateway-client.js";
import { managementOpen } from "./management.js";
import {
  STATE_WORDS,
  childrenEnded,
  isCancelled,
  isRetrying,
  shownState,
  stateWord,
  statusLine,
  taskName,
} from "./state-words.js";

const PAGE_SIZE = 20;
const STATES = ["queued", "running", "succeeded", "failed", "expired"];
const TERMINAL = new Set(["succeeded", "failed", "expired"]);
// How often the first page is read again for tasks created since (while open and visible).
const HEAD_EVERY_MS = 3000;
// Typing in a text filter asks once the typing pauses.
const TYPING_MS = 300;
const DASH = "—";
const TIME = { hour: "numeric", minute: "2-digit" };
const COLUMNS = ["Task", "State", "Progress", "Attempts", "Worker", "Created", "Duration", "Batch", "Tags"];

const section = document.querySelector("#all-tasks");

function el(tag, props = {}, ...children) {
  const node = Object.assign(document.createElement(tag), props);
  node.append(...children);
  return node;
}

function labelled(words, field) {
  return el("label", { className: "filter" }, el("span", {}, words), field);
}

function build() {
  const state = el("select", { name: "state" }, el("option", { value: "" }, "every state"));
  for (const name of STATES) {
    // The gateway's "queued" holds the tasks waiting for a retry too, and its "failed" the cancelled ones.
    const words =
      name === "queued"
        ? `${STATE_WORDS.queued} or ${STATE_WORDS.retrying.toLowerCase()}`
        : name === "failed"
          ? `${STATE_WORDS.failed} or ${STATE_WORDS.cancelled.toLowerCase()}`
          : STATE_WORDS[name];
    state.append(el("option", { value: name }, words));
  }
  const search = { type: "search", autocomplete: "off", spellcheck: false };
  const title = el("input", { ...search, name: "title", placeholder: "monthly export" });
  const tag = el("input", { ...search, name: "tag", placeholder: "owner:u42" });
  const parent = el("input", { ...search, name: "parent", placeholder: "a batch's task id" });
  const clear = el("button", { type: "button", className: "clear", hidden: true }, "Clear filters");
  const refresh = el("button", { type: "button", className: "refresh" }, "Refresh");
  const more = el("button", { type: "button", className: "more", hidden: true }, "More");
  const rows = el("tbody");
  const empty = el("p", { className: "all-tasks-empty", hidden: true }, "No task in this state.");
  const status = el("p", { className: "all-tasks-status", role: "status" });
  const head = el("tr");
  for (const column of COLUMNS) head.append(el("th", { scope: "col" }, column));
  const filters = el(
    "form",
    { className: "all-tasks-bar", role: "search" },
    labelled("Show", state),
    labelled("Title", title),
    labelled("Tag", tag),
    labelled("Batch", parent),
    el("div", { className: "all-tasks-actions" }, clear, refresh),
  );
  filters.addEventListener("submit", (event) => event.preventDefault());
  const details = el(
    "details",
    {},
    el("summary", {}, "All tasks"),
    filters,
    el("div", { className: "all-tasks-scroll" }, el("table", {}, el("thead", {}, head), rows)),
    empty,
    status,
    more,
  );
  section.replaceChildren(details);
  return { details, filters, state, title, tag, parent, clear, refresh, more, rows, empty, status };
}

/** The filters as the list's query (empty ones left out). */
function filterQuery(ui) {
  const query = new URLSearchParams();
  for (const name of ["state", "title", "tag", "parent"]) {
    const value = ui[name].value.trim();
    if (value) query.set(name, value);
  }
  return query;
}

async function fetchPage(filters, cursor, limit = PAGE_SIZE) {
  const query = new URLSearchParams({ order: "newest", limit: String(limit) });
  for (const [name, value] of filters) query.set(name, value);
  if (cursor) query.set("cursor", cursor);
  const answer = await fetch(`/v1/tasks?${query}`, { headers: { Accept: "application/json" } });
  if (!answer.ok) {
    const body = await answer.json().catch(() => ({}));
    throw new Error(body.error ? body.error.message : `HTTP ${answer.status}`);
  }
  return answer.json();
}

/** A cell with its column's name, which a phone shows above its value (the table's head is not shown). */
function cell(label, className, ...content) {
  const td = el("td", { className }, ...content);
  td.dataset.label = label;
  return td;
}

function nowrap(text) {
  return text.replace(/\s/g, "\u00a0");
}

/** When, as a time of day (with the date when not today). */
function when(ms) {
  if (typeof ms !== "number") return DASH;
  const at = new Date(ms);
  const today = new Date().toDateString() === at.toDateString();
  return nowrap(at.toLocaleString([], today ? TIME : { month: "short", day: "numeric", ...TIME }));
}

/** A length of time in its two largest units ("42 s", "3 min 5 s", "2 h 10 min"). */
function duration(ms) {
  const s = Math.max(0, Math.round(ms / 1000));
  if (s < 60) return nowrap(`${s} s`);
  const m = Math.floor(s / 60);
  if (m < 60) return nowrap(`${m} min ${s % 60} s`);
  const h = Math.floor(m / 60);
  if (h < 24) return nowrap(`${h} h ${m % 60} min`);
  return nowrap(`${Math.floor(h / 24)} d ${h % 24} h`);
}

/** How long the task's last attempt has run: from its start to its end, or to now while it runs. */
function ran(task) {
  // Not started, or waiting for its next attempt (the last one's end is not kept): nothing to say.
  if (typeof task.startedAtMs !== "number" || task.state === "queued") return DASH;
  const end = typeof task.endedAtMs === "number" ? task.endedAtMs : TERMINAL.has(task.state) ? null : Date.now();
  return end === null ? DASH : duration(end - task.startedAtMs);
}

/** A batch's counts, short: "12/20 done · 1 failed". */
function countsWords(children) {
  const parts = [`${childrenEnded(children)}/${children.total}\u00a0done`];
  if (children.failed) parts.push(`${children.failed}\u00a0failed`);
  if (children.expired) parts.push(`${children.expired}\u00a0expired`);
  if (children.running) parts.push(`${children.running}\u00a0running`);
  return parts.join(" · ");
}

/** The list: its rows by task id, each followed live until its task ends. */
class TaskList {
  constructor(ui) {
    this.ui = ui;
    this.client = new GatewayClient(location.origin, { storage: null });
    watchBrowser(this.client);
    /** @type {Map<string, {task: object, tr: HTMLElement, stop: (() => void) | null}>} */
    this.rows = new Map();
    this.cursor = null;
    this.filters = new URLSearchParams();
    this.generation = 0;
  }

  /** A page of tasks: in place of every row (`replace`), or after them. */
  show(page, replace) {
    if (replace) this.clear();
    for (const task of page.tasks) {
      if (this.rows.has(task.id)) continue;
      this.ui.rows.append(this.add(task));
    }
    this.cursor = page.nextCursor;
    this.ui.more.hidden = this.cursor === null;
    this.counted();
  }

  /** The newest tasks again: those created since come in at the top, in order; the others are left. */
  showHead(page) {
    const fresh = page.tasks.filter((task) => !this.rows.has(task.id));
    if (fresh.length === 0) return;
    const first = this.ui.rows.firstElementChild;
    const top = first ? this.rows.get(first.dataset.taskId).task : null;
    for (const task of fresh) {
      // Only what is newer than the first row: an older one missing here is on a page not read yet.
      if (top && (task.createdAtMs < top.createdAtMs || (task.createdAtMs === top.createdAtMs && task.id < top.id))) {
        continue;
      }
      this.ui.rows.insertBefore(this.add(task), first);
    }
    this.counted();
  }

  counted() {
    const count = this.ui.rows.childElementCount;
    this.ui.empty.hidden = count > 0;
    this.ui.empty.textContent = this.filters.toString() ? "No task matches these filters." : "No task yet.";
    section.dataset.count = String(count);
    section.dataset.more = this.cursor === null ? "0" : "1";
    section.dataset.query = this.filters.toString();
  }

  clear() {
    for (const row of this.rows.values()) if (row.stop) row.stop();
    this.rows.clear();
    this.ui.rows.replaceChildren();
  }

  /** A row for `task`, followed live while the task has not ended. */
  add(task) {
    const tr = el("tr");
    const row = { task, tr, stop: null };
    this.rows.set(task.id, row);
    this.render(row);
    if (!TERMINAL.has(task.state)) {
      const cursor = task.epoch ? `${task.version}:${task.epoch}` : task.version;
      const update = (now) => {
        if (this.rows.get(task.id) !== row || !now) return;
        row.task = now;
        this.render(row);
      };
      row.stop = this.client.subscribe(task.id, null, (_frame, now) => update(now), {
        cursor,
        onMetadata: (u) => update(u.task),
        onChildren: (u) => update(u.task),
      });
    }
    return tr;
  }

  render({ task, tr }) {
    const name = taskName(task);
    const titled = name !== task.id;
    const link = el("a", { href: `/?task=${encodeURIComponent(task.id)}`, title: `Watch ${task.id}` }, name);
    link.className = titled ? "title" : "title untitled";
    const line = statusLine(task);
    const titleCell = el("td", { className: "all-task-title" }, link);
    if (line) titleCell.append(el("span", { className: "all-task-line" }, line));

    const batch = cell("Batch", "all-task-batch");
    if (task.children) {
      const words = countsWords(task.children);
      const open = el("button", { type: "button", className: "link", title: `List the tasks of ${name}` }, words);
      open.addEventListener("click", () => this.filterBy("parent", task.id));
      batch.append(open);
    } else if (task.parent) {
      const up = el("button", { type: "button", className: "link in-batch", title: `List the batch ${task.parent}` }, "in a batch");
      up.addEventListener("click", () => this.filterBy("parent", task.parent));
      batch.append(up);
    } else {
      batch.append(DASH);
      batch.classList.add("none");
    }

    const tags = cell("Tags", "all-task-tags");
    if (task.tags && task.tags.length) {
      for (const tag of task.tags) {
        const chip = el("button", { type: "button", className: "tag", title: `Only tasks tagged ${tag}` }, tag);
        chip.addEventListener("click", () => this.filterBy("tag", tag));
        tags.append(chip);
      }
    } else {
      tags.append(DASH);
      tags.classList.add("none");
    }

    tr.replaceChildren(
      titleCell,
      el("td", { className: "all-task-state" }, el("span", { className: "state-badge" }, stateWord(task))),
      cell("Progress", "num", `${task.progress}%`),
      cell("Attempts", "num", `${task.attempts} of ${task.maxAttempts}`),
      cell("Worker", task.worker ? "all-task-worker" : "all-task-worker none", task.worker ?? DASH),
      cell("Created", "num all-task-created", when(task.createdAtMs)),
      cell("Duration", "num all-task-duration", ran(task)),
      batch,
      tags,
    );
    tr.dataset.shown = shownState(task);
    tr.dataset.taskId = task.id;
    tr.dataset.state = task.state;
    tr.dataset.retrying = String(isRetrying(task));
    tr.dataset.cancelled = String(isCancelled(task));
    tr.dataset.progress = String(task.progress);
    tr.dataset.message = line;
    tr.dataset.batch = task.children ? `${childrenEnded(task.children)}/${task.children.total}` : "";
  }

  /** Running tasks' durations move on. */
  tick() {
    for (const row of this.rows.values()) {
      if (row.task.state !== "running") continue;
      const td = row.tr.querySelector(".all-task-duration");
      if (td) td.textContent = ran(row.task);
    }
  }

  filterBy(name, value) {
    this.ui[name].value = value;
    this.load(true);
  }

  async load(replace) {
    const ui = this.ui;
    const mine = ++this.generation; // a newer filter wins over an answer still on its way
    const filters = replace ? filterQuery(ui) : this.filters;
    ui.clear.hidden = filterQuery(ui).toString() === "";
    ui.status.textContent = "";
    ui.more.disabled = ui.refresh.disabled = true;
    try {
      const page = await fetchPage(filters, replace ? null : this.cursor);
      if (mine !== this.generation) return;
      this.filters = filters;
      this.show(page, replace);
    } catch (error) {
      if (mine === this.generation) ui.status.textContent = `The list could not be read: ${error.message}`;
    } finally {
      if (mine === this.generation) ui.more.disabled = ui.refresh.disabled = false;
    }
  }

  /** Read the first page again for tasks created since (not while a filter's answer is on its way). */
  async pollHead() {
    const mine = this.generation;
    try {
      const page = await fetchPage(this.filters, null);
      if (mine === this.generation) this.showHead(page);
    } catch {
      // the next read may do better; the rows shown stay live meanwhile
    }
  }
}

async function start() {
  if (!section) return;
  // The one check of whether this page may read the management API (shared with the cards' Cancel).
  if (!(await managementOpen())) return;
  let first;
  try {
    first = await fetchPage(new URLSearchParams(), null);
  } catch {
    return; // the management API is not ours to read here: no section
  }
  const ui = build();
  const list = new TaskList(ui);
  list.show(first, true);

  // The same check decides the operators' links in the footer (health, readiness, metrics, the client).
  const links = document.querySelector("#operator-links");
  if (links) links.hidden = false;
  ui.state.addEventListener("change", () => list.load(true));
  let typing = null;
  for (const field of [ui.title, ui.tag, ui.parent]) {
    field.addEventListener("input", () => {
      clearTimeout(typing);
      typing = setTimeout(() => list.load(true), TYPING_MS);
    });
    field.addEventListener("change", () => {
      clearTimeout(typing);
      if (filterQuery(ui).toString() !== list.filters.toString()) list.load(true);
    });
  }
  ui.clear.addEventListener("click", () => {
    ui.filters.reset();
    list.load(true);
  });
  ui.refresh.addEventListener("click", () => list.load(true));
  ui.more.addEventListener("click", () => list.load(false));
  setInterval(() => {
    if (ui.details.open && document.visibilityState === "visible") list.pollHead();
  }, HEAD_EVERY_MS);
  setInterval(() => list.tick(), 1000);
  section.hidden = false;
  section.dataset.ready = "true";
}

start();

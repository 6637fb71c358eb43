/**
 * "All tasks" on the dashboard: the operators' list (`GET /v1/tasks?order=newest`), newest first, a page at a
 * time, filtered by state. On a phone each task is two lines (its id; its state, progress, attempts and
 * version, each labelled), so that nothing is cut or off screen.
 *
 * Shown only where this page may read the management API (open mode on loopback; with an API key the
 * browser holds none, so the section stays hidden, and so do the operators' links in the footer). Read-only: a task's id links to the dashboard watching
 * it (`/?task=ID`).
 *
 * A task's state reads as on its card (state-words.js): a task requeued after a failed attempt is "Retrying",
 * a cancelled one "Cancelled".
 *
 * State for tests: `#all-tasks[data-ready][data-count][data-more]`; each row is
 * `tr[data-task-id][data-state][data-shown][data-retrying][data-cancelled]` (`data-state` as the gateway says it,
 * `data-shown` as the badge does: "retrying", "cancelled" or the state).
 */

import { managementOpen } from "./management.js";
import { STATE_WORDS, stateWord, isCancelled, isRetrying, shownState } from "./state-words.js";

const PAGE_SIZE = 20;
const STATES = ["queued", "running", "succeeded", "failed", "expired"];

const section = document.querySelector("#all-tasks");

function el(tag, props = {}, ...children) {
  const node = Object.assign(document.createElement(tag), props);
  node.append(...children);
  return node;
}

function build() {
  const filter = el("select", { name: "state" }, el("option", { value: "" }, "every state"));
  for (const state of STATES) {
    // The gateway's "queued" holds the tasks waiting for a retry too.
    // and its "failed" the cancelled ones.
    const words =
      state === "queued"
        ? `${STATE_WORDS.queued} or ${STATE_WORDS.retrying.toLowerCase()}`
        : state === "failed"
          ? `${STATE_WORDS.failed} or ${STATE_WORDS.cancelled.toLowerCase()}`
          : STATE_WORDS[state];
    filter.append(el("option", { value: state }, words));
  }
  const refresh = el("button", { type: "button", className: "refresh" }, "Refresh");
  const more = el("button", { type: "button", className: "more", hidden: true }, "More");
  const rows = el("tbody");
  const empty = el("p", { className: "all-tasks-empty", hidden: true }, "No task in this state.");
  const status = el("p", { className: "all-tasks-status", role: "status" });
  const head = el("tr");
  for (const title of ["Task", "State", "Progress", "Attempts", "Version"]) head.append(el("th", { scope: "col" }, title));
  const details = el(
    "details",
    {},
    el("summary", {}, "All tasks"),
    el("div", { className: "all-tasks-bar" }, el("label", {}, "Show ", filter), refresh),
    el("div", { className: "all-tasks-scroll" }, el("table", {}, el("thead", {}, head), rows)),
    empty,
    status,
    more,
  );
  section.replaceChildren(details);
  return { details, filter, refresh, more, rows, empty, status };
}

async function fetchPage(state, cursor) {
  const query = new URLSearchParams({ order: "newest", limit: String(PAGE_SIZE) });
  if (state) query.set("state", state);
  if (cursor) query.set("cursor", cursor);
  const answer = await fetch(`/v1/tasks?${query}`, { headers: { Accept: "application/json" } });
  if (!answer.ok) {
    const body = await answer.json().catch(() => ({}));
    throw new Error(body.error ? body.error.message : `HTTP ${answer.status}`);
  }
  return answer.json();
}

/** A number's cell, with its column's name for a phone, where the table's head is not shown. */
function cell(label, text) {
  const td = el("td", {}, text);
  td.dataset.label = label;
  return td;
}

function row(task) {
  const link = el("a", { href: `/?task=${encodeURIComponent(task.id)}`, title: "Watch this task" }, task.id);
  const tr = el(
    "tr",
    {},
    el("td", { className: "all-task-id" }, link),
    el("td", { className: "all-task-state" }, el("span", { className: "state-badge" }, stateWord(task))),
    cell("Progress", `${task.progress}%`),
    cell("Attempts", `${task.attempts} of ${task.maxAttempts}`),
    cell("Version", String(task.version)),
  );
  tr.dataset.shown = shownState(task);
  tr.dataset.taskId = task.id;
  tr.dataset.state = task.state;
  tr.dataset.retrying = String(isRetrying(task));
  tr.dataset.cancelled = String(isCancelled(task));
  return tr;
}

async function start() {
  if (!section) return;
  // The one check of whether this page may read the management API (shared with the cards' Cancel).
  if (!(await managementOpen())) return;
  let first;
  try {
    first = await fetchPage("", null);
  } catch {
    return; // the management API is not ours to read here: no section
  }
  const ui = build();
  let cursor = null;
  let generation = 0;

  const show = (page, replace) => {
    if (replace) ui.rows.replaceChildren();
    for (const task of page.tasks) ui.rows.append(row(task));
    cursor = page.nextCursor;
    ui.more.hidden = cursor === null;
    ui.empty.hidden = ui.rows.childElementCount > 0;
    section.dataset.count = String(ui.rows.childElementCount);
    section.dataset.more = cursor === null ? "0" : "1";
  };
  const load = async (replace) => {
    const mine = ++generation; // a newer filter wins over an answer still on its way
    ui.status.textContent = "";
    ui.more.disabled = ui.refresh.disabled = true;
    try {
      const page = await fetchPage(ui.filter.value, replace ? null : cursor);
      if (mine === generation) show(page, replace);
    } catch (error) {
      if (mine === generation) ui.status.textContent = `The list could not be read: ${error.message}`;
    } finally {
      if (mine === generation) ui.more.disabled = ui.refresh.disabled = false;
    }
  };

  show(first, true);
  // The same check decides the operators' links in the footer (health, readiness, metrics, the client).
  const links = document.querySelector("#operator-links");
  if (links) links.hidden = false;
  ui.filter.addEventListener("change", () => load(true));
  ui.refresh.addEventListener("click", () => load(true));
  ui.more.addEventListener("click", () => load(false));
  section.hidden = false;
  section.dataset.ready = "true";
}

start();

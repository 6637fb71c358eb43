/**
 * A batch on its card (a task with children: a Celery group, an import of 2,000 files): its counts in words
 * ("12 of 20 done · 1 failed") and as a bar of one segment per state, live, and its children, each with its
 * title, state and status line (`metadata.message`), live, under "Tasks in this batch".
 *
 * The counts are the parent's own (`task.children`, kept by the gateway with each child's change and pushed
 * in `children` frames: never counted here). The children's rows are fed by whoever follows them: the tag
 * page when the children carry the page's tag (tag-page.js), else `followChildren`: a batch subscription
 * with the card's credential (the parent's subscribe token, a tag token, or none in open mode), on a client
 * of its own; where the gateway has none and the management API is open to the page, it lists
 * `GET /v1/tasks?parent=ID` and follows each child. The card lists at most SHOWN children, in the order
 * they were created.
 *
 * State for tests: `.batch[data-total][data-ended][data-queued][data-running][data-succeeded][data-failed]
 * [data-expired]`, each child `li.child[data-task-id][data-state][data-progress]` with `.child-title`,
 * `.state-badge`, `.child-line` (its status line) and `.child-error` (why a failed one failed).
 */

import { GatewayClient, watchBrowser } from "./gateway-client.js";
import {
  childrenEnded,
  childrenWords,
  errorWords,
  sentence,
  shownState,
  statusLine,
  stateWord,
  taskName,
} from "./state-words.js";

// The most children a card lists (a bigger batch says how many are left out; All tasks lists them all).
export const SHOWN = 100;
const SEGMENTS = ["succeeded", "failed", "expired", "running", "queued"];
const SEGMENT_WORDS = { succeeded: "done", failed: "failed", expired: "expired", running: "running", queued: "waiting" };
const COUNTS = ["total", "queued", "running", "succeeded", "failed", "expired"];

function el(tag, props = {}, ...children) {
  const node = Object.assign(document.createElement(tag), props);
  node.append(...children);
  return node;
}

/** Children in the order they were created (then by title, numbers as numbers: "part 2" before "part 10"). */
function createdFirst(a, b) {
  if (a.createdAtMs !== b.createdAtMs) return (a.createdAtMs ?? 0) - (b.createdAtMs ?? 0);
  const byName = taskName(a).localeCompare(taskName(b), undefined, { numeric: true });
  return byName !== 0 ? byName : a.id < b.id ? -1 : a.id > b.id ? 1 : 0;
}

/** Why a child failed, in its worker's words ("" unless it failed; a cancelled one reads Cancelled). */
function childError(task) {
  return task.state === "failed" && task.error && task.error !== "cancelled" ? sentence(errorWords(task.error)) : "";
}

export class BatchView {
  /** @param {HTMLElement} card  the card's article: its `.batch` section is filled */
  constructor(card, { open = false } = {}) {
    this.box = card.querySelector(".batch");
    this.words = this.box.querySelector(".batch-counts");
    this.bar = this.box.querySelector(".batch-bar");
    this.details = this.box.querySelector(".batch-children");
    this.list = this.box.querySelector(".children-list");
    this.more = this.box.querySelector(".children-more");
    this.details.open = open;
    this.segments = new Map();
    for (const state of SEGMENTS) {
      const segment = el("span", { className: `segment segment-${state}` });
      this.segments.set(state, segment);
      this.bar.append(segment);
    }
    /** @type {Map<string, {task: object, row: HTMLElement}>} */
    this.rows = new Map();
    this.counts = null;
  }

  /** The parent's counts (null: not a batch, or not yet). */
  setCounts(children) {
    this.counts = children ?? null;
    this.box.hidden = this.counts === null;
    if (this.counts === null) return;
    const counts = this.counts;
    for (const name of COUNTS) this.box.dataset[name] = String(counts[name] ?? 0);
    this.box.dataset.ended = String(childrenEnded(counts));
    const words = childrenWords(counts);
    this.words.textContent = words;
    this.bar.setAttribute("aria-label", words);
    for (const [state, segment] of this.segments) {
      const share = counts.total > 0 ? (counts[state] / counts.total) * 100 : 0;
      segment.style.width = `${share}%`;
      segment.title = `${counts[state]} ${SEGMENT_WORDS[state]}`;
    }
    this.details.querySelector("summary").textContent =
      counts.total === 1 ? "The task in this batch" : `The ${counts.total} tasks in this batch`;
    this.renderMore();
  }

  /** A child as it is now: its row made or updated, and put in its place. */
  child(task) {
    let known = this.rows.get(task.id);
    if (!known) {
      const row = el(
        "li",
        { className: "child" },
        el(
          "div",
          { className: "child-head" },
          el("a", { className: "child-title" }),
          el("span", { className: "state-badge" }),
        ),
        el("p", { className: "child-line" }),
        el("p", { className: "child-error" }),
      );
      row.dataset.taskId = task.id;
      known = { task, row };
      this.rows.set(task.id, known);
    }
    const created = known.task.createdAtMs;
    known.task = task;
    const { row } = known;
    row.dataset.state = shownState(task);
    row.dataset.progress = String(task.progress);
    const title = row.querySelector(".child-title");
    title.textContent = taskName(task);
    title.title = task.id;
    title.href = `/?task=${encodeURIComponent(task.id)}`;
    row.querySelector(".state-badge").textContent =
      task.state === "running" && task.progress > 0 ? `${stateWord(task)} ${task.progress}%` : stateWord(task);
    const line = statusLine(task);
    row.querySelector(".child-line").textContent = line;
    row.querySelector(".child-line").hidden = !line;
    const error = childError(task);
    row.querySelector(".child-error").textContent = error;
    row.querySelector(".child-error").hidden = !error;
    if (row.parentNode !== this.list || created !== task.createdAtMs) this.place(known);
    this.renderMore();
  }

  /** Rows in creation order, at most SHOWN of them. */
  place(known) {
    const ordered = [...this.rows.values()].sort((a, b) => createdFirst(a.task, b.task));
    const index = ordered.indexOf(known);
    if (index >= SHOWN) {
      known.row.remove();
      return;
    }
    const next = ordered.slice(index + 1).find((other) => other.row.parentNode === this.list);
    this.list.insertBefore(known.row, next ? next.row : null);
    while (this.list.childElementCount > SHOWN) this.list.lastElementChild.remove();
  }

  renderMore() {
    const total = this.counts ? this.counts.total : this.rows.size;
    const shown = this.list.childElementCount;
    this.more.hidden = shown >= total;
    this.more.textContent =
      shown >= total ? "" : shown === 0 ? "Loading the tasks…" : `${total - shown} more not shown here.`;
  }

  /** How many children the view has (listed or followed). */
  get known() {
    return this.rows.size;
  }
}

let childClient = null;

/**
 * Follow the children of `parentId`, calling `onChild(task)` at each change of one: a batch subscription
 * with `token` on a client of its own (the page's client streams each task to one subscription, and the
 * card holds the parent's); where it is refused and `canList()` (the management API is open to the page),
 * list them instead (`GET /v1/tasks?parent=ID`, the newest SHOWN) and follow each. Returns `{relist, stop}`:
 * `relist()` lists again when listing (the parent's count of children grew: some were added).
 */
export function followChildren(parentId, token, onChild, { canList = () => false } = {}) {
  if (childClient === null) {
    childClient = new GatewayClient(location.origin, { storage: null });
    watchBrowser(childClient);
  }
  const client = childClient;
  const followed = new Map(); // child id -> stop, when listing
  let stopped = false;
  let listing = null; // a listing under way
  let listed = false; // following by listing (no batch subscription)

  async function list() {
    const query = new URLSearchParams({ parent: parentId, limit: String(SHOWN) });
    const answer = await fetch(`/v1/tasks?${query}`, { headers: { Accept: "application/json" } });
    if (!answer.ok) throw new Error(`HTTP ${answer.status}`);
    const page = await answer.json();
    if (stopped) return;
    for (const task of page.tasks) {
      if (followed.has(task.id)) continue;
      onChild(task);
      const cursor = task.epoch ? `${task.version}:${task.epoch}` : task.version;
      const options = { cursor, onMetadata: (update) => update.task && onChild(update.task) };
      followed.set(task.id, client.subscribe(task.id, null, (_frame, now) => onChild(now), options));
    }
  }

  function relist() {
    // One listing at a time; a change while one is under way lists once more after it.
    if (listing) {
      listing.again = true;
      return;
    }
    listing = { again: false };
    list()
      .catch(() => {}) // the next change of the counts lists again
      .finally(() => {
        const again = listing.again;
        listing = null;
        if (again && !stopped) relist();
      });
  }

  const child = (task) => task && task.id !== parentId && onChild(task);
  const stopBatch = client.subscribeBatch(parentId, token, (_frame, task) => child(task), {
    onMetadata: (update) => child(update.task),
    onError: () => {
      // A gateway with no batch subscriptions, or a credential it does not take for one.
      if (!canList() || stopped) return;
      listed = true;
      relist();
    },
  });
  return {
    relist: () => listed && relist(),
    stop() {
      stopped = true;
      stopBatch();
      for (const stop of followed.values()) stop();
      followed.clear();
    },
  };
}

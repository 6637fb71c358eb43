/**
 * The dashboard served at `/`: each watched task as a card, live over one GatewayClient.
 *
 * Tasks come from the link (`/?task=ID&token=T`, repeatable), the form (folded: it is for developers; a
 * person without their link is told to open it), or the demo button, and are kept in sessionStorage so
 * that a reloaded page watches them again (the client keeps their cursors there too, so it resumes with
 * `caught-up` or `delta`, not from 0). Opened on a tag (`/?tag=T&token=TAG_TOKEN`), the page shows that
 * tag's tasks instead, newest first, new ones coming in at the top (tag-page.js); no form, no demo.
 *
 * While the link is down (the client is reconnecting or offline), every card still in progress is marked
 * stale: its bar and numbers faded, a note saying when its data dates from, and a banner under the header
 * says so in words; nothing on the page ticks on while it is down.
 *
 * Order: tasks from the link first, in the link's order (the task a person came for is at the top), then
 * the others, newest first.
 *
 * A running or succeeded task that was retried says what came of its earlier attempts, from the task itself
 * ("Attempt 1 failed: timeout; retried."), so that a page that caught up with a snapshot after an outage
 * (the task, not the entries it missed) tells the same story as one that saw every entry; the error a
 * succeeded task keeps is that earlier attempt's, never shown as its outcome. A succeeded task keeps its
 * attempts and says how long it took (from its creation to its result).
 *
 * A task cancelled on request (failed, error "cancelled") reads "Cancelled", in grey: it was stopped, it did
 * not fail. Where the management API is open to this page (management.js), the card of a queued or running
 * task offers "Cancel task", asks once more (with an optional reason), and posts the cancel; the card then
 * changes by the live stream like any other change.
 *
 * A card names its task by its title (its id where it has none: the id is in the technical details and the
 * heading's tooltip), and so does the page's title when it shows one task; the task's status line
 * (`metadata.message`) is under its progress bar, live. A batch's card shows its children's counts and,
 * below, its children (batch-view.js): fed by the tag page, or listed and followed here where the
 * management API is open; unfolded when the link names that one task.
 *
 * State for tests and tools is in the DOM: `#connection[data-state][data-transport][data-live]`,
 * `body[data-stale][data-manage]` and `article.task-card[data-task-id][data-state][data-retrying]
 * [data-version][data-progress][data-resume][data-resumed-from][data-resumes][data-stale][data-message]
 * [data-revision][data-batch]` (`data-state` is "cancelled" for a cancelled task).
 */

import { BatchView, SHOWN, followChildren } from "./batch-view.js";
import { GatewayClient, watchBrowser } from "./gateway-client.js";
import { managementOpen } from "./management.js";
import {
  STATE_WORDS,
  earlierAttempts,
  errorWords,
  isCancelled,
  isRetrying,
  refusal,
  sentence,
  stateWord,
  statusLine,
  taskName,
} from "./state-words.js";
import { followTag } from "./tag-page.js";

const TERMINAL = new Set(["succeeded", "failed", "expired"]);
const RESUME = new Set(["caught-up", "delta", "snapshot"]);
const LIST_KEY = "task-gateway:dashboard:tasks";

const DASH = "—";
// The stream a card shows as the task's output (docs/protocol.md, "Streams"; docs/browser.md).
const OUTPUT_STREAM = "output";
// One time style on the page: the user's locale, hours and minutes, no leading zero ("9:05 AM", "09:05").
const TIME = { hour: "numeric", minute: "2-digit" };

const client = new GatewayClient(location.origin);
watchBrowser(client);

/** @type {Map<string, Card>} */
const cards = new Map();
const $ = (selector) => document.querySelector(selector);
const connection = $("#connection");
const tasksEl = $("#tasks");
const template = $("#task-card");
// Gateway clock minus ours, learnt from live events, so that "updated … ago" follows the gateway's clock.
let clockOffsetMs = 0;
// The tasks the link names, in its order: they come first on the page.
const linkedIds = [];
// When the link went down (ms since the epoch), while it is down and some card is still in progress.
let staleSince = null;
// Whether this page may use the management API (open mode): then a live task's card offers Cancel.
let canManage = false;
// Opened on a tag: whether the tag is followed (new tasks may come, even while none is live).
let followingTag = () => false;


// --- cards ----------------------------------------------------------------------------------------------

class Card {
  /** `follow: false`: the card is fed by a tag subscription (tag-page.js), not one of its own; `open`: a
   * batch's children are shown unfolded (the page follows this one task). */
  constructor(id, token, { follow = true, open = false } = {}) {
    this.id = id;
    this.token = token || null;
    this.task = null;
    this.lastEvent = null; // {version, event}
    this.resume = null;
    this.resumedFrom = null;
    this.resumes = 0;
    this.error = null;
    this.heardAt = null; // when a frame of this task last arrived (ms since the epoch, our clock)
    const el = template.content.firstElementChild.cloneNode(true);
    el.dataset.taskId = id;
    el.querySelector(".task-id").textContent = id;
    el.querySelector(".task-id").title = id;
    el.querySelector(".f-id").textContent = id;
    const remove = el.querySelector(".remove");
    remove.addEventListener("click", () => removeTask(id));
    remove.hidden = !follow; // a tag's page shows every task of the tag
    const copy = el.querySelector(".copy");
    copy.addEventListener("click", () => this.copyResult());
    this.cancelOpen = false; // the "Cancel this task?" question is shown
    this.cancelError = null;
    el.querySelector(".cancel-task").addEventListener("click", () => this.askCancel(true));
    el.querySelector(".cancel-keep").addEventListener("click", () => this.askCancel(false));
    el.querySelector(".cancel-confirm").addEventListener("submit", (event) => {
      event.preventDefault();
      this.sendCancel(event.currentTarget.elements.reason.value);
    });
    this.el = el;
    this.batch = new BatchView(el, { open });
    // The children's rows: fed by the tag page when they carry its tag, else followed here where the
    // management API is open (batch-view.js); null until the task is known to be a batch.
    this.childrenFed = false;
    this.children = null;
    this.listedTotal = null; // the count of children when they were last listed
    this.startCursor = client.cursor(id) ?? 0;
    this.output = { text: "", attempt: null, ended: false }; // the task's stream "output", as written
    this.stop = follow
      ? client.subscribe(id, this.token, (frame, task) => this.onFrame(frame, task), {
          onError: (error) => this.onError(error),
          streams: [OUTPUT_STREAM],
          onChunks: (update) => this.onChunks(update),
          onMetadata: (update) => this.onBeside(update),
          onChildren: (update) => this.onBeside(update),
        })
      : () => {};
    this.render();
  }

  get live() {
    return !this.error && !(this.task && TERMINAL.has(this.task.state));
  }

  onFrame(frame, task) {
    // The id was made again (its task deleted): nothing shown of the task it named before applies.
    if (this.task && (task.epoch ?? null) !== (this.task.epoch ?? null)) this.lastEvent = null;
    if (RESUME.has(frame.type) && frame.reason !== "conflated") {
      this.resume = frame.type;
      this.resumedFrom = this.task ? this.task.version : this.startCursor;
      this.resumes += 1;
    }
    if (frame.type === "event") {
      this.setLastEvent(frame.version, frame.event);
      if (typeof frame.event.atMs === "number") clockOffsetMs = frame.event.atMs - Date.now();
    } else if (frame.type === "delta" && frame.events.length > 0) {
      const last = frame.events[frame.events.length - 1];
      this.setLastEvent(last.version, last.event);
    }
    this.task = task;
    this.heardAt = Date.now();
    if (task.version > 0 && (!this.lastEvent || this.lastEvent.version < task.version)) {
      this.fetchLastEvent(task.version);
    }
    this.render();
    updateConnection();
  }

  /** The task's metadata or a batch's counts changed beside its history (no new version): the task the
   * client hands over carries them. */
  onBeside(update) {
    if (!update.task) return; // before the task's first frame, which will carry it
    this.task = update.task;
    this.heardAt = Date.now();
    this.render();
  }

  /** A child of this batch as it is now (from the tag page, or followed here). */
  onChild(task) {
    this.batch.child(task);
  }

  /** Follow the children where nobody feeds them (batch-view.js: a batch subscription with the card's
   * credential); when they are listed instead, list them again when the count of children grows. */
  followBatch() {
    const counts = this.task && this.task.children;
    if (!counts || this.childrenFed || this.error) return;
    const grew = counts.total !== this.listedTotal;
    this.listedTotal = counts.total;
    if (this.children === null) {
      const canList = () => canManage;
      this.children = followChildren(this.id, this.token, (task) => this.onChild(task), { canList });
    } else if (grew && this.batch.known < Math.min(counts.total, SHOWN)) {
      this.children.relist();
    }
  }

  /** Chunks of the task's output: appended, or the text started over (a retry's output replaces). */
  onChunks(update) {
    const output = this.output;
    const text = update.chunks.join("");
    output.text = update.replace ? text : output.text + text;
    if (update.attempt !== null) output.attempt = update.attempt;
    output.ended = update.ended;
    this.renderOutput(update.replace);
  }

  renderOutput(startedOver) {
    const box = this.el.querySelector(".task-output");
    const pre = box.querySelector(".output-text");
    const output = this.output;
    // Kept at the bottom while the reader is there (the last lines in view); left where a reader scrolled.
    const following = startedOver || pre.scrollHeight - pre.scrollTop - pre.clientHeight < 24;
    box.hidden = output.text === "" && output.attempt === null;
    box.dataset.attempt = output.attempt === null ? "" : String(output.attempt);
    box.dataset.ended = String(output.ended);
    pre.textContent = output.text;
    const retried = output.attempt !== null && output.attempt > 1;
    box.querySelector(".output-attempt").textContent = retried ? `(attempt ${output.attempt})` : "";
    if (following) pre.scrollTop = pre.scrollHeight;
  }

  onError(error) {
    this.error = error;
    this.render();
    updateConnection();
  }

  setLastEvent(version, event) {
    if (!this.lastEvent || this.lastEvent.version < version) this.lastEvent = { version, event };
  }

  /** A resume frame carries the state, not the entry that made it: read that entry once (again at the next
   * resume frame if the read failed, as it may just after an outage). */
  async fetchLastEvent(version) {
    if (this.fetching === version) return;
    this.fetching = version;
    try {
      const headers = this.token ? { Authorization: `Bearer ${this.token}` } : {};
      const url = `/v1/tasks/${encodeURIComponent(this.id)}/events?cursor=${version - 1}`;
      const answer = await fetch(url, { headers });
      if (!answer.ok) throw new Error(`HTTP ${answer.status}`);
      const body = await answer.json();
      for (const entry of body.events ?? []) if (entry.version === version) this.setLastEvent(version, entry.event);
      this.render();
    } catch {
      // Only a nicety (the card still shows the task's state): the next resume frame asks again.
      if (this.fetching === version) this.fetching = null;
    }
  }

  askCancel(open) {
    this.cancelOpen = open;
    this.cancelError = null;
    this.render();
    if (open) this.el.querySelector(".cancel-confirm input[name=reason]").focus();
    else this.el.querySelector(".cancel-task").focus();
  }

  /** Post the cancel; the card changes when the cancel entry comes down the live stream. */
  async sendCancel(reason) {
    const submit = this.el.querySelector(".cancel-confirm button[type=submit]");
    submit.disabled = true;
    this.cancelError = null;
    try {
      const why = reason.trim();
      const answer = await fetch(`/v1/tasks/${encodeURIComponent(this.id)}/cancel`, {
        method: "POST",
        headers: { "Content-Type": "application/json" },
        body: JSON.stringify(why ? { reason: why } : {}),
      });
      const body = await answer.json().catch(() => ({}));
      if (!answer.ok) {
        this.cancelError = body.error ? body.error.message : `The task could not be cancelled (HTTP ${answer.status}).`;
      } else {
        this.cancelOpen = false;
        this.el.querySelector(".cancel-confirm").reset();
      }
    } catch {
      this.cancelError = "The gateway could not be reached; try again in a moment.";
    } finally {
      submit.disabled = false;
      this.render();
    }
  }

  render() {
    const el = this.el;
    const task = this.task;
    const cancelled = Boolean(task) && isCancelled(task);
    this.renderName(task);
    const line = this.error ? "" : statusLine(task);
    el.querySelector(".status-line").textContent = line;
    el.querySelector(".status-line").hidden = !line;
    el.dataset.message = line;
    el.dataset.revision = task ? String(task.revision ?? 0) : "";
    this.batch.setCounts(task && !this.error ? task.children : null);
    el.dataset.batch = String(Boolean(task && task.children));
    this.followBatch();
    const state = this.error ? "error" : cancelled ? "cancelled" : task ? task.state : "waiting";
    el.dataset.state = state;
    const retrying = state === "queued" && isRetrying(task);
    el.dataset.retrying = String(retrying);
    el.dataset.version = task ? String(task.version) : "";
    el.dataset.progress = task ? String(task.progress) : "";
    el.dataset.resume = this.resume ?? "";
    el.dataset.resumedFrom = this.resumedFrom === null ? "" : String(this.resumedFrom);
    el.dataset.resumes = String(this.resumes);
    el.querySelector(".state-badge").textContent = STATE_WORDS[retrying ? "retrying" : state] ?? state;
    el.querySelector(".headline").textContent = headline(task, this.error);
    const history = earlierAttempts(task);
    el.querySelector(".history").textContent = this.error ? "" : history;
    el.querySelector(".history").hidden = this.error || !history;

    const progress = task ? task.progress : 0;
    const bar = el.querySelector(".bar");
    bar.setAttribute("aria-valuenow", String(progress));
    bar.setAttribute("aria-valuetext", `${progress}%${task ? `, ${stateWord(task)}` : ""}`);
    el.querySelector(".bar-fill").style.width = `${progress}%`;
    el.querySelector(".f-progress").textContent = task ? `${progress}%` : DASH;
    el.querySelector(".f-attempts").textContent = task ? `${task.attempts} of ${task.maxAttempts}` : DASH;
    el.querySelector(".f-deadline").textContent = givesUpAt(task);
    el.querySelector(".f-took").textContent = took(task, this.lastEvent);
    el.querySelector(".f-version").textContent = task ? String(task.version) : DASH;
    el.querySelector(".f-event").textContent = this.lastEvent ? describeEvent(this.lastEvent) : DASH;
    el.querySelector(".f-resume").textContent = this.resume
      ? `${this.resume} from v${this.resumedFrom}${this.resumes > 1 ? ` (${this.resumes} connects)` : ""}`
      : DASH;

    // A task that ended badly: the badge says so; the box says why, that it will not be tried again, and
    // what a person can do now.
    const failure = el.querySelector(".task-failure");
    const failed = state === "failed" || state === "expired"; // a cancelled task did not fail
    failure.hidden = !failed;
    el.querySelector(".failure-text").textContent = failed
      ? task.state === "expired"
        ? `It did not finish in time: it gave up at ${clockTime(task.expiresAtMs - clockOffsetMs)}.`
        : sentence(errorWords(task.error)) || "The worker reported a failure."
      : "";
    el.querySelector(".failure-retry").textContent = failed
      ? `Will not be retried${task.attempts >= task.maxAttempts ? ` (all ${task.maxAttempts} attempts used)` : ""}.`
      : "";

    // A cancelled task: why, in the words it was given (the cancel entry's reason), if the card has it.
    const note = el.querySelector(".task-cancelled");
    note.hidden = !cancelled;
    const entry = this.lastEvent && this.lastEvent.event;
    const why = entry && entry.type === "cancel" && entry.reason ? sentence(entry.reason).replace(/[.!]+$/, "") : "";
    note.textContent = cancelled ? `Cancelled on request${why ? `: ${why}` : ""}. It will not be run again.` : "";
    this.renderCancel(task);

    this.renderResult(task);

    const error = el.querySelector(".card-error");
    error.hidden = !this.error;
    error.textContent = this.error ? `Can't follow this task: ${refusal(this.error, this.token)}` : "";
    this.renderTimes();
  }

  /** The task's name where a person reads it (its title, else its id); the id in the technical details. */
  renderName(task) {
    const el = this.el;
    const name = taskName(task, this.id);
    const heading = el.querySelector(".task-id");
    heading.textContent = name;
    heading.title = name === this.id ? this.id : `${name} (${this.id})`;
    heading.dataset.titled = String(name !== this.id);
    el.querySelector(".bar").setAttribute("aria-label", `Progress of ${name}`);
    const remove = el.querySelector(".remove");
    remove.setAttribute("aria-label", `Stop watching ${name}`);
    remove.title = `Stop watching ${name}`;
    const parent = task && task.parent;
    el.querySelector(".f-parent-box").hidden = !parent;
    el.querySelector(".f-parent").textContent = parent || "";
    if (name !== this.name) {
      this.name = name;
      nameThePage();
    }
  }

  /** "Cancel task", where this page may cancel and the task is still queued or running. */
  renderCancel(task) {
    const offered = canManage && !this.error && Boolean(task) && !TERMINAL.has(task.state);
    if (!offered) this.cancelOpen = false;
    const box = this.el.querySelector(".cancel-box");
    box.hidden = !offered;
    this.el.querySelector(".cancel-task").hidden = this.cancelOpen;
    this.el.querySelector(".cancel-task").setAttribute("aria-label", `Cancel ${taskName(task, this.id)}`);
    this.el.querySelector(".cancel-confirm").hidden = !this.cancelOpen;
    const error = this.el.querySelector(".cancel-error");
    error.hidden = !this.cancelError;
    error.textContent = this.cancelError ?? "";
  }

  /** A succeeded task's result: a link when it is a web address, else the reference to copy. */
  renderResult(task) {
    const box = this.el.querySelector(".task-result");
    const ref = task && task.state === "succeeded" && task.resultRef ? task.resultRef : null;
    box.hidden = ref === null;
    const link = box.querySelector(".result-link");
    const chip = box.querySelector(".result-copy");
    const web = ref !== null && isWebAddress(ref);
    link.hidden = !web;
    chip.hidden = ref === null || web;
    if (web) {
      link.href = ref;
      link.title = ref;
    } else {
      link.removeAttribute("href");
    }
    box.querySelector(".result-ref").textContent = ref !== null && !web ? ref : "";
    box.querySelector(".copy").setAttribute("aria-label", `Copy the result of ${taskName(task, this.id)}`);
  }

  async copyResult() {
    const button = this.el.querySelector(".copy");
    const ref = this.task && this.task.resultRef;
    if (!ref) return;
    try {
      await navigator.clipboard.writeText(ref);
      button.textContent = "Copied";
    } catch {
      // No clipboard (an insecure origin, a denied permission): select the text for a manual copy.
      const range = document.createRange();
      range.selectNodeContents(this.el.querySelector(".result-ref"));
      getSelection().removeAllRanges();
      getSelection().addRange(range);
      button.textContent = "Selected";
    }
    clearTimeout(this.copiedTimer);
    this.copiedTimer = setTimeout(() => {
      button.textContent = "Copy";
    }, 2000);
  }

  /** What changes with the clock or the link alone: "updated … ago", staleness, the connection detail. */
  renderTimes() {
    const stale = staleSince !== null && this.live;
    // While stale the note says since when; an "Updated … ago" frozen above it would only contradict it.
    const updated = this.el.querySelector(".f-updated");
    const at = this.updatedAt();
    // A finished task says when it finished: a time that no outage can make stale.
    const finished = this.task !== null && this.task !== undefined && TERMINAL.has(this.task.state);
    if (at === null || stale) updated.textContent = "";
    else if (finished) updated.textContent = `Finished ${clockTime(at)}`;
    else updated.textContent = `Updated ${formatAgo(Date.now() - at)}`;
    this.el.dataset.stale = String(stale);
    const note = this.el.querySelector(".stale-note");
    note.hidden = !stale;
    note.textContent = stale
      ? `May be out of date: no news since ${clockTime(Math.min(staleSince, this.heardAt ?? staleSince))}.`
      : "";
    const state = connection.dataset.state;
    this.el.querySelector(".f-transport").textContent =
      state === "reconnecting" || state === "offline"
        ? state
        : client.transport === "sse"
          ? "Server-sent events"
          : "WebSocket";
  }

  /** When the task last changed: its latest entry's time on the gateway's clock, else when we heard of it. */
  updatedAt() {
    const atMs = this.lastEvent && this.lastEvent.event.atMs;
    if (typeof atMs === "number" && this.lastEvent.version === (this.task && this.task.version)) {
      return Math.min(Date.now(), atMs - clockOffsetMs);
    }
    return this.heardAt;
  }
}

/** When the task expires, as a time of day (a date too when not today); a dash once it has ended. */
function givesUpAt(task) {
  if (!task || TERMINAL.has(task.state)) return DASH;
  const at = new Date(task.expiresAtMs - clockOffsetMs);
  const today = new Date().toDateString() === at.toDateString();
  const options = today ? TIME : { month: "short", day: "numeric", ...TIME };
  return nowrap(at.toLocaleString([], options));
}

/** How long a succeeded task took, from its creation to its result (its last entry); a dash until known. */
function took(task, last) {
  if (!task || task.state !== "succeeded" || !last || last.version !== task.version) return DASH;
  if (typeof last.event.atMs !== "number") return DASH;
  return duration(last.event.atMs - task.createdAtMs);
}

/** A length of time in the two largest units that matter ("42 s", "3 min 5 s", "2 h 10 min", "3 d 4 h"). */
function duration(ms) {
  const s = Math.max(0, Math.round(ms / 1000));
  if (s < 1) return "under a second";
  if (s < 60) return `${s}\u00a0s`;
  const m = Math.floor(s / 60);
  if (m < 60) return nowrap(`${m} min ${s % 60} s`);
  const h = Math.floor(m / 60);
  if (h < 24) return nowrap(`${h} h ${m % 60} min`);
  return nowrap(`${Math.floor(h / 24)} d ${h % 24} h`);
}

function isWebAddress(ref) {
  try {
    const url = new URL(ref);
    return url.protocol === "https:" || url.protocol === "http:";
  } catch {
    return false;
  }
}

function describeEvent({ event }) {
  let text;
  switch (event.type) {
    case "start":
      text = `started by ${event.worker}`;
      break;
    case "progress": {
      // The percentage is on the card already: say only where the worker is, if it said; the gateway's own
      // entry for a batch's children (its cursor "children:ENDED/TOTAL", protocol.md's Batches) in words.
      const batch = /^children:(\d+)\/(\d+)$/.exec(event.cursor ?? "");
      text = batch ? `${batch[1]} of ${batch[2]} in the batch done` : event.cursor ? event.cursor : "progress reported";
      break;
    }
    case "succeed":
      text = "finished";
      break;
    case "fail":
      text = `attempt failed: ${event.error}`;
      break;
    case "expire":
      text = "expired at its deadline";
      break;
    case "cancel":
      text = event.reason ? `cancelled: ${event.reason}` : "cancelled";
      break;
    default:
      text = String(event.type);
  }
  return typeof event.atMs === "number" ? `${text}\u00a0·\u00a0${clockTime(event.atMs - clockOffsetMs)}` : text;
}

/** A line in words where the badge and the bar do not say enough; empty otherwise. */
function headline(task, error) {
  if (error) return "";
  if (!task) return "Connecting to the gateway…";
  if (task.state === "queued") {
    // Requeued after a failed attempt: `attempts` counts the attempts started, so the one that failed is
    // number `attempts` and the next to start is `attempts + 1` (gateway/machine.py).
    if (task.attempts > 0) {
      const why = sentence(errorWords(task.error));
      return `Attempt ${task.attempts} of ${task.maxAttempts} failed${why ? `: ${why.replace(/[.!]+$/, "")}` : ""}.`
        + ` Waiting for attempt ${task.attempts + 1}.`;
    }
    return "Waiting for a worker to start it";
  }
  return "";
}

/** How long ago, in steps that do not tick by the second. */
function formatAgo(ms) {
  const m = Math.floor(Math.max(0, ms) / 60_000);
  if (m < 1) return "just now";
  if (m < 60) return `${m} min ago`;
  return `at ${clockTime(Date.now() - ms)}`;
}

function clockTime(ms) {
  return nowrap(new Date(ms).toLocaleTimeString([], TIME));
}

/** "1:43 PM" never wraps before its "PM". */
function nowrap(text) {
  return text.replace(/\s/g, "\u00a0");
}

// --- the list of watched tasks --------------------------------------------------------------------------

function addTask(id, token, { save = true } = {}) {
  id = String(id).trim();
  token = token ? String(token).trim() : null;
  if (!id) return null;
  let card = cards.get(id);
  if (card && (!token || token === card.token)) {
    card.el.scrollIntoView({ block: "nearest" });
    return card;
  }
  if (card) {
    // The same task with another token (say, after a "forbidden"): watch it again with the new one.
    card.stop();
    if (card.children) card.children.stop();
    card.el.remove();
    cards.delete(id);
  }
  card = new Card(id, token, { open: linkedIds.length === 1 && linkedIds[0] === id });
  cards.set(id, card);
  arrange();
  if (save) saveList();
  updateEmpty();
  updateConnection();
  return card;
}

function removeTask(id) {
  const card = cards.get(id);
  if (!card) return;
  card.stop();
  if (card.children) card.children.stop();
  card.el.remove();
  cards.delete(id);
  if (linkedIds.includes(id)) linkedIds.splice(linkedIds.indexOf(id), 1);
  saveList();
  // A task from the link would come back on reload: take it out of the address too.
  const params = new URLSearchParams(location.search);
  const ids = params.getAll("task");
  const index = ids.indexOf(id);
  if (index >= 0) {
    const tokens = params.getAll("token");
    ids.splice(index, 1);
    if (index < tokens.length) tokens.splice(index, 1);
    params.delete("task");
    params.delete("token");
    ids.forEach((t, i) => {
      params.append("task", t);
      if (i < tokens.length && tokens[i]) params.append("token", tokens[i]);
    });
    const query = params.toString();
    history.replaceState(null, "", query ? `?${query}` : location.pathname);
  }
  updateEmpty();
  updateConnection();
}

/** The link's tasks first, in its order; then the others, newest first. */
function arrange() {
  const linked = linkedIds.filter((id) => cards.has(id)).map((id) => cards.get(id).el);
  const others = [...cards.values()].filter((c) => !linkedIds.includes(c.id)).reverse().map((c) => c.el);
  const order = [...linked, ...others];
  if (order.some((el, i) => tasksEl.children[i] !== el)) tasksEl.replaceChildren(...order);
}

function saveList() {
  // Oldest first, as they were added, so that a reload puts them back in the same order.
  const list = [...cards.values()].map((c) => ({ id: c.id, token: c.token }));
  try {
    sessionStorage.setItem(LIST_KEY, JSON.stringify(list));
  } catch {
    // storage denied: the page still works, a reload just forgets the list
  }
}

function loadList() {
  try {
    const list = JSON.parse(sessionStorage.getItem(LIST_KEY) ?? "[]");
    return Array.isArray(list) ? list.filter((t) => t && typeof t.id === "string") : [];
  } catch {
    return [];
  }
}

function updateEmpty() {
  $("#empty").hidden = cards.size > 0;
  nameThePage();
}

/** The page's title: the task's name when it shows one task, else how many (a tag's page names its tag). */
function nameThePage() {
  if (document.body.dataset.tag) return;
  const only = cards.size === 1 ? [...cards.values()][0] : null;
  document.title = only
    ? `${only.name ?? only.id} · task-gateway`
    : cards.size > 1
      ? `${cards.size} tasks · task-gateway`
      : "task-gateway dashboard";
}

// --- connection indicator -------------------------------------------------------------------------------

const LABELS = {
  idle: "Idle",
  connecting: "Connecting…",
  connected: "Connected",
  reconnecting: "Reconnecting…",
  offline: "Offline",
};

const banner = $("#link-banner");

function updateConnection() {
  const live = [...cards.values()].filter((c) => c.live).length;
  const watching = live > 0 || followingTag();
  // With nothing to watch (every card finished or refused, the tag refused) the connection means nothing to
  // the user: no "Connected" beside cards that cannot follow, no "Reconnecting" for what will not change.
  const state = watching ? client.state : "idle";
  connection.dataset.state = state;
  connection.dataset.transport = client.transport;
  connection.dataset.live = String(live);
  connection.hidden = state === "idle";
  connection.querySelector(".label").textContent = LABELS[state] ?? state;
  const transport = client.transport === "sse" ? "server-sent events" : "WebSocket";
  connection.title = `${live} live task${live === 1 ? "" : "s"}; transport: ${transport}`;

  // The link is down while there is something live to show: the cards' data may be stale.
  const down = watching && (state === "reconnecting" || state === "offline");
  if (down && staleSince === null) staleSince = client.lastHeardAt ?? Date.now();
  if (!down) staleSince = null;
  document.body.dataset.stale = String(down);
  banner.hidden = !down;
  banner.dataset.state = state;
  if (down) {
    banner.querySelector(".banner-title").textContent =
      state === "offline" ? "You are offline." : "Connection lost.";
    banner.querySelector(".banner-text").textContent =
      (state === "offline" ? "Progress will update when the network is back. " : "Reconnecting… ") +
      `What you see dates from ${clockTime(staleSince)}.`;
  }
  for (const card of cards.values()) card.renderTimes();
}

client.onState(updateConnection);

// --- controls -------------------------------------------------------------------------------------------

function notice(message) {
  const el = $("#notice");
  el.textContent = message ?? "";
  el.hidden = !message;
}

$("#add-task").addEventListener("submit", (event) => {
  event.preventDefault();
  const form = event.currentTarget;
  const id = form.elements.task.value.trim();
  if (!id) return;
  notice(null);
  addTask(id, form.elements.token.value);
  form.reset();
});

const demoButton = $("#start-demo");
demoButton.addEventListener("click", async () => {
  demoButton.disabled = true;
  notice(null);
  try {
    const answer = await fetch("/v1/demo/tasks", { method: "POST" });
    const body = await answer.json().catch(() => ({}));
    if (!answer.ok) {
      notice(body.error ? body.error.message : `The demo could not start (HTTP ${answer.status}).`);
      return;
    }
    addTask(body.task.id, body.subscribeToken);
  } catch {
    notice("The gateway could not be reached; try again in a moment.");
  } finally {
    demoButton.disabled = false;
  }
});

async function showDemo() {
  try {
    const answer = await fetch("/v1/demo");
    if (!answer.ok) return;
    const body = await answer.json();
    $("#demo").hidden = !body.enabled;
    document.body.dataset.demo = body.enabled ? "on" : "off";
  } catch {
    // no demo: the rest of the page works the same
  }
}

// "Updated … ago" moves on between frames, except while the link is down: then the note says since when.
setInterval(() => {
  if (staleSince !== null) return;
  for (const card of cards.values()) card.renderTimes();
}, 15_000);

// --- start ----------------------------------------------------------------------------------------------

/** `/?tag=T&token=TAG_TOKEN`: the tag's tasks, and nothing else to do on the page. */
function startTag(tag, token) {
  document.body.dataset.tag = tag;
  $("#controls").hidden = true;
  $("#demo").hidden = true;
  followingTag = followTag({
    client,
    tag,
    token,
    cards,
    newCard: (id) => new Card(id, token, { follow: false }),
    removeCard: (card) => {
      if (card.children) card.children.stop();
    },
    changed: () => {
      updateEmpty();
      updateConnection();
    },
  });
  updateEmpty();
  updateConnection();
  managementOpen().then((open) => {
    canManage = open;
    document.body.dataset.manage = open ? "open" : "closed";
    for (const card of cards.values()) card.render();
  });
  document.body.dataset.ready = "true";
}

function start() {
  const tag = new URLSearchParams(location.search).get("tag");
  if (tag && tag.trim()) {
    startTag(tag.trim(), new URLSearchParams(location.search).get("token") || null);
    return;
  }
  // The link's tasks (`?task=A&token=TA&task=B&token=TB`) and those this tab watched before a reload,
  // in the order they were added; a token from the link wins.
  const params = new URLSearchParams(location.search);
  const tokens = params.getAll("token");
  const linked = new Map();
  params.getAll("task").forEach((id, i) => {
    if (id.trim() && !linked.has(id.trim())) linked.set(id.trim(), tokens[i] || null);
  });
  linkedIds.push(...linked.keys());
  if (linked.size > 0) {
    // Someone came to see these tasks: they come first, the controls (the demo too) folded below them.
    const controls = $("#controls");
    controls.querySelector("summary").textContent = "Watch another task";
    controls.querySelector(".controls-body").prepend($("#demo"));
    $("#watched").after(controls);
    document.body.dataset.linked = "true";
  }
  for (const { id, token } of loadList()) addTask(id, linked.get(id) || token, { save: false });
  for (const [id, token] of linked) if (!cards.has(id)) addTask(id, token, { save: false });
  saveList();
  updateEmpty();
  updateConnection();
  showDemo();
  managementOpen().then((open) => {
    canManage = open;
    document.body.dataset.manage = open ? "open" : "closed";
    for (const card of cards.values()) card.render();
  });
  document.body.dataset.ready = "true";
}

start();

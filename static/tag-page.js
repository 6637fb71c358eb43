/**
 * The dashboard opened on a tag, `/?tag=owner:u42&token=T` (T a tag token: `POST /v1/tokens`, or
 * `gateway token subscribe --tag`): every task carrying the tag as a card, over one tag subscription of the
 * page's GatewayClient. The tasks still in progress (running, queued or retrying) come first, then the
 * finished ones; each group newest first (createdAtMs, then id, descending). A task created with the tag
 * appears at the top of the first group as soon as it exists; one that finishes moves to its place among
 * the finished ones and stays there, as it ended. After a drop the client resumes every task from its cursor,
 * and tasks created meanwhile come in at their place.
 *
 * The tag reads as words ("owner:u42" is "owner u42"); the tag itself is the heading's title. A refused link
 * says why and what to do (state-words.js).
 *
 * The cards are the dashboard's (dashboard.js makes them and keeps them in its map, so the connection
 * indicator, the stale marks and Cancel work as for any card), fed by the tag subscription instead of one
 * subscription each. A batch is one card: a task whose parent the tag lists too is shown in its parent's card
 * (batch-view.js: its title, state and status line, live), not as a card of its own; the parent's counts
 * are its own (`children`).
 *
 * State for tests: `#tag-head[data-tag][data-state][data-count]`, `data-state` being `loading` (no list
 * yet), `live` or `error`; the cards in `#tasks` in the order shown, a card that came after the first
 * list with `data-new="true"`.
 */

import { refusal } from "./state-words.js";

const FINISHED = new Set(["succeeded", "failed", "expired"]);

/** A tag as a person reads it: its parts (`owner:u42`, `team_data:eng`) as words ("owner u42"). */
export function tagWords(tag) {
  return tag.replace(/[:_]+/g, " ").trim() || tag;
}

/** Whether task `a` is shown before task `b`: in progress before finished, then newest first (createdAtMs
 * descending, then id descending). */
function precedes(a, b) {
  const done = FINISHED.has(a.state);
  if (done !== FINISHED.has(b.state)) return !done;
  return a.createdAtMs !== b.createdAtMs ? a.createdAtMs > b.createdAtMs : a.id > b.id;
}

/**
 * Follow `tag` with `token` on `client`, putting cards into `cards` (id -> card) made by `newCard(id)`;
 * `changed()` is called after every change (the dashboard updates its indicator and empty-page words).
 * Returns a function that tells whether the tag is still followed (false once it was refused).
 */
export function followTag({ client, tag, token, cards, newCard, removeCard, changed }) {
  const head = document.querySelector("#tag-head");
  const tasksEl = document.querySelector("#tasks");
  const summary = head.querySelector(".tag-summary");
  const problem = head.querySelector(".tag-error");
  const empty = document.querySelector("#empty");
  let listed = false;
  let refused = false;
  let first = null; // the ids of the first list: any other task came in while the page was open
  let listedIds = new Set(); // the tag's tasks as last listed, and those added since

  head.hidden = false;
  head.dataset.tag = tag;
  head.dataset.state = "loading";
  const words = tagWords(tag);
  head.querySelector(".tag-name").textContent = words;
  head.querySelector(".tag-title").title = `tag ${tag}`;
  document.title = `${words} · task-gateway`;
  empty.textContent = "Loading the tasks…";

  /** Put a card where it belongs: before the first other card whose task its own precedes; left where it
   * is when it is there already, so that nothing moves under the reader's eyes for nothing. */
  function place(card) {
    let before = null;
    for (let el = tasksEl.firstElementChild; el; el = el.nextElementSibling) {
      const other = el === card.el ? null : cards.get(el.dataset.taskId);
      if (other && other.task && precedes(card.task, other.task)) {
        before = el;
        break;
      }
    }
    if (card.el.parentNode !== tasksEl || card.el.nextElementSibling !== before) {
      tasksEl.insertBefore(card.el, before);
    }
  }

  function summarise() {
    const tasks = [...cards.values()].map((card) => card.task).filter(Boolean);
    const running = tasks.filter((task) => task.state === "running").length;
    const waiting = tasks.filter((task) => task.state === "queued").length;
    const parts = [`${tasks.length} task${tasks.length === 1 ? "" : "s"}`];
    if (running) parts.push(`${running} running`);
    if (waiting) parts.push(`${waiting} waiting`);
    summary.textContent = listed ? parts.join(" · ") : "";
    head.dataset.count = String(tasks.length);
    if (listed) empty.textContent = "No task carries this tag yet. New ones appear here as they start.";
    changed();
  }

  /** The card of `id`, made when it has none yet (unplaced until its task's first frame). */
  function cardOf(id) {
    let card = cards.get(id);
    if (card === undefined) {
      card = newCard(id);
      cards.set(id, card);
      card.el.dataset.new = String(first !== null && !first.has(id)); // highlighted a moment
    }
    return card;
  }

  /** The card of a child's batch, when its parent is among the tag's tasks: the child is shown there. */
  function batchOf(task) {
    if (!task.parent || !(cards.has(task.parent) || listedIds.has(task.parent))) return null;
    const parent = cardOf(task.parent);
    parent.childrenFed = true;
    const own = cards.get(task.id);
    if (own) {
      // Shown on its own before its parent was known: it moves into its batch.
      own.el.remove();
      cards.delete(task.id);
      removeCard(own);
    }
    return parent;
  }

  client.subscribeTag(
    tag,
    token,
    (frame, task) => {
      const batch = batchOf(task);
      if (batch) {
        batch.onChild(task);
        summarise();
        return;
      }
      const unplaced = !cards.has(task.id) || cards.get(task.id).task === null;
      const card = cardOf(task.id);
      const fresh = unplaced;
      const finished = !fresh && FINISHED.has(card.task?.state);
      card.onFrame(frame, task);
      // A task's creation time never changes: a card moves only when its task finishes (or, after a
      // snapshot of a task made anew under its id, no longer is).
      if (fresh || finished !== FINISHED.has(task.state)) place(card);
      summarise();
    },
    {
      onTag: (frame) => {
        // Tasks no longer listed were deleted (retention): their cards go too.
        const now = new Set(frame.taskIds);
        first ??= now;
        listedIds = new Set(now);
        for (const [id, card] of cards) {
          if (!now.has(id)) {
            card.el.remove();
            cards.delete(id);
            removeCard(card);
          }
        }
        listed = true;
        head.dataset.state = "live";
        head.dataset.more = String(frame.more);
        head.querySelector(".tag-more").hidden = !frame.more;
        summarise();
      },
      onAdded: (frame) => listedIds.add(frame.taskId),
      onMetadata: (update) => update.task && shown(update.task),
      onChildren: (update) => update.task && shown(update.task),
      onError: (error) => {
        refused = true;
        head.dataset.state = "error";
        problem.hidden = false;
        problem.textContent = `Can't follow these tasks: ${refusal(error, token)}`;
        empty.textContent = "";
        summarise();
      },
    },
  );
  /** A task whose metadata or counts changed beside its history: on its card, or in its batch's. */
  function shown(task) {
    const batch = batchOf(task);
    if (batch) batch.onChild(task);
    else if (cards.get(task.id)?.task) cards.get(task.id).onBeside({ task });
  }

  return () => !refused;
}

/**
 * The dashboard opened on a tag, `/?tag=owner:u42&token=T` (T a tag token: `POST /v1/tokens`, or
 * `gateway token subscribe --tag`): every task carrying the tag as a card, newest first (createdAtMs, then
 * id, descending), over one tag subscription of the page's GatewayClient. A task created with the tag
 * appears at the top as soon as it exists; a finished one stays, as it ended. After a drop the client
 * resumes every task from its cursor, and tasks created meanwhile come in at their place.
 *
 * The cards are the dashboard's (dashboard.js makes them and keeps them in its map, so the connection
 * indicator, the stale marks and Cancel work as for any card), fed by the tag subscription instead of one
 * subscription each.
 *
 * State for tests: `#tag-head[data-tag][data-state][data-count]`, `data-state` being `loading` (no list
 * yet), `live` or `error`; the cards in `#tasks` in the order shown, a card that came after the first
 * list with `data-new="true"`.
 */

function explain({ code, message }) {
  const words = {
    unauthorized: "the link's access code is missing, expired or invalid",
    forbidden: "the link's access code is for other tasks",
    "invalid-request": "the link is not right",
    "websocket-required": "this network lets no live connection through",
  };
  return `${words[code] ?? message} (${code})`;
}

/** Newest first: createdAtMs descending, then id descending. */
function newer(a, b) {
  return a.createdAtMs !== b.createdAtMs ? a.createdAtMs > b.createdAtMs : a.id > b.id;
}

/**
 * Follow `tag` with `token` on `client`, putting cards into `cards` (id -> card) made by `newCard(id)`;
 * `changed()` is called after every change (the dashboard updates its indicator and empty-page words).
 * Returns a function that tells whether the tag is still followed (false once it was refused).
 */
export function followTag({ client, tag, token, cards, newCard, changed }) {
  const head = document.querySelector("#tag-head");
  const tasksEl = document.querySelector("#tasks");
  const summary = head.querySelector(".tag-summary");
  const problem = head.querySelector(".tag-error");
  const empty = document.querySelector("#empty");
  let listed = false;
  let refused = false;
  let first = null; // the ids of the first list: any other task came in while the page was open

  head.hidden = false;
  head.dataset.tag = tag;
  head.dataset.state = "loading";
  head.querySelector(".tag-name").textContent = tag;
  document.title = `${tag} · task-gateway`;
  empty.textContent = "Loading the tasks…";

  /** Put a new card where it belongs: before the first card older than its task. */
  function place(card) {
    // Cards come newest first at the start (the list's order) and one at a time at the top later: look
    // from the end, so that either costs a step or two.
    let before = null;
    for (let el = tasksEl.lastElementChild; el; el = el.previousElementSibling) {
      const other = cards.get(el.dataset.taskId);
      if (other && other.task && !newer(other.task, card.task)) before = el;
      else break;
    }
    tasksEl.insertBefore(card.el, before);
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

  client.subscribeTag(
    tag,
    token,
    (frame, task) => {
      let card = cards.get(task.id);
      const fresh = card === undefined;
      if (fresh) {
        card = newCard(task.id);
        cards.set(task.id, card);
        card.el.dataset.new = String(first !== null && !first.has(task.id)); // highlighted a moment
      }
      card.onFrame(frame, task);
      if (fresh) place(card); // a task's creation time never changes: placed once
      summarise();
    },
    {
      onTag: (frame) => {
        // Tasks no longer listed were deleted (retention): their cards go too.
        const now = new Set(frame.taskIds);
        first ??= now;
        for (const [id, card] of cards) {
          if (!now.has(id)) {
            card.el.remove();
            cards.delete(id);
          }
        }
        listed = true;
        head.dataset.state = "live";
        head.dataset.more = String(frame.more);
        head.querySelector(".tag-more").hidden = !frame.more;
        summarise();
      },
      onError: (error) => {
        refused = true;
        head.dataset.state = "error";
        problem.hidden = false;
        problem.textContent = `Can't follow these tasks: ${explain(error)}`;
        empty.textContent = "";
        summarise();
      },
    },
  );
  return () => !refused;
}

/**
 * The words a person reads for a task's state, the same on a task's card (dashboard.js) and in "All tasks"
 * (task-list.js); what its earlier attempts came to; and why a link cannot be followed, with what to do.
 */

export const STATE_WORDS = {
  waiting: "Loading",
  queued: "Queued",
  retrying: "Retrying",
  running: "Running",
  succeeded: "Succeeded",
  failed: "Failed",
  cancelled: "Cancelled",
  expired: "Expired",
  error: "Can't follow",
};

/** A failed attempt with attempts left comes back queued: to a person, it is being retried. */
export function isRetrying(task) {
  return task.state === "queued" && task.attempts > 0;
}

/**
 * A task ended on request (`POST /v1/tasks/{id}/cancel`): the gateway leaves it failed with the error
 * "cancelled". To a person it was stopped, not a failure.
 */
export function isCancelled(task) {
  return task.state === "failed" && task.error === "cancelled";
}

/** The state as a person reads it: the gateway's, or "retrying" or "cancelled" (keys of STATE_WORDS). */
export function shownState(task) {
  return isRetrying(task) ? "retrying" : isCancelled(task) ? "cancelled" : task.state;
}

/** The word for `task`'s state ("Retrying" for a task requeued after a failed attempt, "Cancelled"). */
export function stateWord(task) {
  return STATE_WORDS[shownState(task)] ?? task.state;
}

/** Text as given, trimmed, with a capital first letter. */
export function sentence(text) {
  const trimmed = (text ?? "").trim();
  return trimmed && trimmed[0].toUpperCase() + trimmed.slice(1);
}

/** A worker's error as it gave it (trimmed); the gateway's own (a heartbeat lease that ran out) in words. */
export function errorWords(error) {
  const trimmed = (error ?? "").trim();
  return trimmed === "heartbeat-timeout" ? "its worker stopped reporting" : trimmed;
}

/**
 * What the attempts before the running or succeeded one came to, in words ("Attempt 1 failed: timeout;
 * retried."), or "" when there were none. Said from the task alone, so the same whether the page saw every
 * entry or caught up with a snapshot: a task is requeued only by a failed attempt with attempts left, so a
 * running or succeeded task at attempt n had n - 1 attempts fail before it; its `error` stays the last of
 * those failures' (the gateway keeps it: protocol.md, Shapes) and is not the outcome.
 */
export function earlierAttempts(task) {
  if (!task || (task.state !== "running" && task.state !== "succeeded")) return "";
  const failed = task.attempts - 1;
  if (failed < 1) return "";
  const why = errorWords(task.error).replace(/[.!]+$/, "");
  const which = failed === 1 ? "Attempt 1" : `Attempts 1 ${failed === 2 ? "and" : "to"} ${failed}`;
  const last = !why ? "" : failed === 1 ? `: ${why}` : ` (attempt ${failed}: ${why})`;
  return `${which} failed${last}; retried.`;
}

/**
 * Why a link's tasks cannot be followed, and what to do: a sentence for the refusal `{code, message}`,
 * `token` the link's access code (null: the link had none).
 */
export function refusal({ code, message }, token) {
  const ask = "ask whoever sent you the link for a new one.";
  const whole = `Open the whole link you were given, or ${ask}`;
  const words = {
    unauthorized: token
      ? `the link's access code has expired or is not valid (${code}). ${sentence(ask)}`
      : `the link has no access code (${code}). ${whole}`,
    forbidden: `the link's access code is for other tasks (${code}). ${whole}`,
    "unknown-task": `there is no such task (${code}); it may have been deleted since it finished. ${sentence(ask)}`,
    "invalid-request": `the link is not complete (${code}). ${whole}`,
    "websocket-required": `this network lets no live connection through (${code}). Try another network.`,
  };
  return words[code] ?? `${message} (${code}).`;
}

/** What a person calls a task: its title, else its id (the id stays in the technical details). */
export function taskName(task, id = task ? task.id : "") {
  const title = task && typeof task.title === "string" ? task.title.trim() : "";
  return title || id;
}

/** A task's status line, `metadata.message` (docs/protocol.md), trimmed; "" when it has none. */
export function statusLine(task) {
  const message = task && task.metadata ? task.metadata.message : undefined;
  return typeof message === "string" ? message.trim() : "";
}

/** How many of a batch's children have ended (succeeded, failed or expired). */
export function childrenEnded(children) {
  return children.succeeded + children.failed + children.expired;
}

/**
 * A batch's counts in words: "12 of 20 done · 1 failed · 3 running" (what did not happen is left out; a
 * cancelled child is among the failed, as the gateway counts it).
 */
export function childrenWords(children) {
  const parts = [`${childrenEnded(children)} of ${children.total} done`];
  if (children.failed) parts.push(`${children.failed} failed`);
  if (children.expired) parts.push(`${children.expired} expired`);
  if (children.running) parts.push(`${children.running} running`);
  return parts.join("\u00a0· ");
}

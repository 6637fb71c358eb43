/**
 * The words a person reads for a task's state, the same on a task's card (dashboard.js) and in "All tasks"
 * (task-list.js).
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

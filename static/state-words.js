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
  expired: "Expired",
  error: "Can't follow",
};

/** A failed attempt with attempts left comes back queued: to a person, it is being retried. */
export function isRetrying(task) {
  return task.state === "queued" && task.attempts > 0;
}

/** The word for `task`'s state ("Retrying" for a task requeued after a failed attempt). */
export function stateWord(task) {
  return STATE_WORDS[isRetrying(task) ? "retrying" : task.state] ?? task.state;
}

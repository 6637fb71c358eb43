/**
 * Whether this page may use the management API (create, list, cancel): true where it is open to the page,
 * that is on a gateway in open mode (loopback, no API key). With an API key the browser holds none, so the
 * answer is false and nothing that needs the key is offered. Asked once per page (`GET /v1/tasks?limit=1`).
 */

let asked = null;

/** @returns {Promise<boolean>} */
export function managementOpen() {
  asked ??= fetch("/v1/tasks?limit=1", { headers: { Accept: "application/json" } })
    .then((answer) => answer.ok)
    .catch(() => false);
  return asked;
}

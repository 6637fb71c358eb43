// The page: starts reports (POST /api/reports) and answers (POST /api/answers) and follows every task of its
// user live, with one tag subscription to the gateway (gateway-client.js's subscribeTag, imported from the
// gateway itself), and each task's output (its stream "output": an answer's words) with a subscription to
// the task on the same socket.

const user = new URLSearchParams(location.search).get("user") || "alice";
const list = document.getElementById("reports");
const button = document.getElementById("start");
const problem = document.getElementById("problem");
const connection = document.getElementById("connection");
document.getElementById("user").textContent = user;

const STATE_WORDS = { queued: "Queued", running: "Running", succeeded: "Done", failed: "Failed", expired: "Expired" };

async function session() {
  const answer = await fetch(`/api/session?user=${encodeURIComponent(user)}`);
  const body = await answer.json();
  if (!answer.ok) throw new Error(body.error);
  return body;
}

function cancelled(task) {
  return task.state === "failed" && task.error === "cancelled";
}

function words(task) {
  if (cancelled(task)) return "Cancelled";
  if (task.state === "queued" && task.attempts > 0) return "Retrying";
  return STATE_WORDS[task.state] ?? task.state;
}

function detail(task, cursor) {
  const parts = [`attempt ${task.attempts} of ${task.maxAttempts}`];
  if (cursor) parts.unshift(cursor);
  if (task.resultRef) parts.push(`result: ${task.resultRef}`);
  // A task keeps the error of an attempt that was retried: it is the task's own only once the task ended so.
  if (task.error && (task.state === "failed" || task.state === "expired")) parts.push(`error: ${task.error}`);
  return parts.join(" · ");
}

function card(taskId) {
  let el = list.querySelector(`li[data-task-id="${CSS.escape(taskId)}"]`);
  if (el) return el;
  el = document.createElement("li");
  el.className = "report";
  el.dataset.taskId = taskId;
  el.innerHTML = `<div class="head"><span class="id"></span><strong class="state"></strong></div>
    <div class="bar" role="progressbar" aria-label="progress" aria-valuemin="0" aria-valuemax="100" aria-valuenow="0"><span></span></div>
    <div class="detail"></div><pre class="output" hidden></pre>`;
  el.querySelector(".id").textContent = taskId;
  followOutput(taskId, el.querySelector(".output"));
  return el;
}

let followOutput = () => {}; // set once the client is there

/** The task's stream "output", live: the text so far, then each word; a retry's answer replaces it. */
function showOutput(pre, update) {
  const words = update.chunks.join("");
  pre.textContent = update.replace ? words : pre.textContent + words;
  pre.hidden = pre.textContent === "";
  pre.dataset.attempt = String(update.attempt ?? "");
  if (update.ended) pre.dataset.ended = "true";
  pre.scrollTop = pre.scrollHeight;
}

// Task id -> the cursor its last progress named ("row-12"), from the progress entries the page was handed: a
// task's state carries no cursor, so a card drawn from a frame without them (after a reload, a caught-up or
// snapshot frame) shows none until its next progress.
const cursors = new Map();

function render(frame, task) {
  // An event frame carries one event; a delta, the entries missed ({version, event}), in order.
  const events = frame.type === "delta" ? frame.events.map((entry) => entry.event) : [frame.event];
  for (const event of events) {
    if (event?.type === "progress") cursors.set(task.id, event.cursor);
  }
  if (task.state === "queued") cursors.delete(task.id); // retrying: the next attempt starts over
  const el = card(task.id);
  el.querySelector(".state").textContent = words(task);
  el.querySelector(".bar").setAttribute("aria-valuenow", String(task.progress));
  el.querySelector(".bar > span").style.width = `${task.progress}%`;
  el.querySelector(".detail").textContent = detail(task, cursors.get(task.id));
  el.dataset.progress = String(task.progress);
  el.dataset.state = task.state;
  el.classList.toggle("cancelled", cancelled(task));
  if (!el.isConnected) place(el, task);
}

function place(el, task) {
  // Newest first, as the tag lists them: before the first card created before this task.
  const later = [...list.children].find((other) => Number(other.dataset.createdAtMs) < task.createdAtMs);
  el.dataset.createdAtMs = String(task.createdAtMs);
  list.insertBefore(el, later ?? null);
}

async function follow() {
  let current = await session();
  const { GatewayClient, watchBrowser } = await import(`${current.gatewayUrl}/static/gateway-client.js`);
  const client = new GatewayClient(current.gatewayUrl);
  watchBrowser(client);
  client.onState((state) => {
    connection.dataset.state = state;
    connection.textContent = state;
  });
  const subscribe = (cursors) =>
    client.subscribeTag(current.tag, current.token, render, {
      cursors,
      onError: (error) => {
        problem.textContent = `${error.code}: ${error.message}`;
      },
    });
  followOutput = (taskId, pre) =>
    client.subscribe(taskId, current.token, () => {}, {
      streams: ["output"],
      onChunks: (update) => showOutput(pre, update),
    });
  subscribe(undefined);
  // A tag token is checked when the socket subscribes (again, after a drop): renew it before it expires.
  const renew = async () => {
    try {
      current = await session();
      subscribe(client.tagCursors(current.tag) ?? undefined);
    } catch (error) {
      problem.textContent = `could not renew the token: ${error.message}`;
    }
    setTimeout(renew, Math.max(10_000, current.expiresAtMs - Date.now() - 60_000));
  };
  setTimeout(renew, Math.max(10_000, current.expiresAtMs - Date.now() - 60_000));
}

button.addEventListener("click", async () => {
  button.disabled = true;
  try {
    const answer = await fetch("/api/reports", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ user }),
    });
    const body = await answer.json();
    if (!answer.ok) throw new Error(body.error);
    problem.textContent = "";
  } catch (error) {
    problem.textContent = `could not start a report: ${error.message}`;
  } finally {
    button.disabled = false;
  }
});

const form = document.getElementById("ask");
form.addEventListener("submit", async (event) => {
  event.preventDefault();
  const submit = form.querySelector("button");
  submit.disabled = true;
  try {
    const answer = await fetch("/api/answers", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ user, question: form.elements.question.value, flaky: form.elements.flaky.checked }),
    });
    const body = await answer.json();
    if (!answer.ok) throw new Error(body.error);
    problem.textContent = "";
  } catch (error) {
    problem.textContent = `could not ask: ${error.message}`;
  } finally {
    submit.disabled = false;
  }
});

follow().then(
  () => {
    button.disabled = false;
    form.querySelector("button").disabled = false;
    document.body.dataset.ready = "true";
  },
  (error) => {
    problem.textContent = `cannot follow the reports: ${error.message}`;
  },
);

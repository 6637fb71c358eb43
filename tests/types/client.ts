// gateway-client.js as an application uses it, checked by `tsc --strict` against gateway-client.d.ts
// (tests/types/check). The @ts-expect-error lines are mistakes the types must refuse: if a type were too
// loose (`any`), the mistake would pass and the unused @ts-expect-error would fail the check.

import {
  GatewayClient,
  watchBrowser,
  type Children,
  type BatchFrame,
  type ChildrenUpdate,
  type ConnectionState,
  type Cursor,
  type Frame,
  type JsonObject,
  type MetadataUpdate,
  type StreamUpdate,
  type SubscriptionError,
  type TagFrame,
  type TagSubscriptionError,
  type Task,
} from "../../static/gateway-client.js";

const client = new GatewayClient("https://gateway.example", { backoffCapMs: 5_000, storage: null });
const stopWatching: () => void = watchBrowser(client, window);
watchBrowser(client);

const states: ConnectionState[] = [];
const stopStates = client.onState((state) => states.push(state));

function render(task: Task): string {
  const left = task.expiresAtMs - Date.now();
  const done = task.state === "succeeded" ? `result ${task.resultRef ?? "?"}` : task.error ?? "";
  const tags = task.tags.length > 0 ? ` [${task.tags.join(", ")}] since ${new Date(task.createdAtMs).toISOString()}` : "";
  return `${task.id}: ${task.state} ${task.progress}% (attempt ${task.attempts} of ${task.maxAttempts}), ${left} ms ${done}${tags}`;
}

function labels(task: Task): string {
  const age = Date.now() - task.createdAtMs;
  return `${task.tags.join(", ") || "untagged"}, made ${age} ms ago`;
}

function describe(frame: Frame): string {
  switch (frame.type) {
    case "caught-up":
      return `nothing missed up to ${frame.version}`;
    case "delta":
      return frame.events.map((entry) => `${entry.version}: ${entry.event.type} at ${entry.event.atMs}`).join(", ");
    case "snapshot":
      return frame.reason === "recreated" ? `a new task under this id (${frame.task.epoch})` : `snapshot (${frame.reason})`;
    case "event": {
      const event = frame.event;
      if (event.type === "progress") return `${event.progress}% at ${event.cursor}`;
      if (event.type === "succeed") return `succeeded: ${event.resultRef} ${event.resultHash}`;
      if (event.type === "fail") return `failed (${event.retryable ? "retryable" : "final"}): ${event.error}`;
      if (event.type === "start") return `started by ${event.worker}`;
      if (event.type === "cancel") return `cancelled${event.reason === undefined ? "" : `: ${event.reason}`}`;
      return `expired at ${event.atMs}`;
    }
  }
}

const stop = client.subscribe(
  "report-42",
  "eyJ...",
  (frame, task) => {
    console.log(describe(frame), render(task), labels(task));
  },
  { cursor: 3, onError: (error: SubscriptionError) => console.error(error.code, error.message) },
);
client.subscribe("open-task", null, (frame) => console.log(frame.taskId, frame.version));
// A cursor saved with the epoch of its task: a task made again under the id comes as a snapshot.
function saved(task: Task): Cursor {
  return task.epoch === undefined ? task.version : (`${task.version}:${task.epoch}` as const);
}
client.subscribe("saved-task", null, (frame, task) => console.log(saved(task)), { cursor: "7:3f9a0c1b7d2e" });

// Every task of a tag: the list at each (re)subscription, the tasks added later, each task's frames.
const byId = new Map<string, Task>();
const stopTag = client.subscribeTag(
  "owner:u42",
  "eyJ...",
  (frame, task) => {
    byId.set(frame.taskId, task);
    if (frame.type === "snapshot" && frame.reason === "new") console.log(`new task ${task.id}`);
  },
  {
    cursors: { "report-42": 3, "report-43": "2:3f9a0c1b7d2e" },
    onTag: (frame: TagFrame) => {
      for (const id of byId.keys()) if (!frame.taskIds.includes(id)) byId.delete(id);
      console.log(frame.tag, frame.more ? "and more" : "all");
    },
    onAdded: (frame) => console.log(`${frame.taskId} added to ${frame.tag}`),
    onError: (error: TagSubscriptionError) => console.error(error.code, error.message),
  },
);
client.subscribeTag("project:7", null, (frame, task) => console.log(frame.type, task.state));
const cursors: Record<string, number> | null = client.tagCursors("owner:u42");
const newest: Task[] = client.tagTasks("owner:u42");
console.log(cursors, newest.map((task) => task.id));
stopTag();
client.unsubscribeTag("project:7");
const cursor: number | null = client.cursor("report-42");
console.log(cursor, client.state, client.transport);
client.reconnectNow();
client.setOnline(false);
stop();
client.unsubscribe("open-task");
stopStates();
stopWatching();
client.close();

// --- what the types refuse ---------------------------------------------------------------------------

// @ts-expect-error a token is a string or null
client.subscribe("t", 42, () => {});
// @ts-expect-error the listener gets a frame and a task, not a string
client.subscribe("t", null, (frame: string) => frame);
// @ts-expect-error a state that does not exist
const wrong: ConnectionState = "closed";
const idle: ConnectionState = "idle";
console.log(idle);
// @ts-expect-error options are checked
new GatewayClient("https://gateway.example", { backoffCapMs: "10s" });
client.subscribe("t", null, (frame) => {
  // @ts-expect-error only a delta carries events
  console.log(frame.events);
  if (frame.type === "snapshot") {
    // @ts-expect-error a snapshot's reason is one of five
    const reason: "other" = frame.reason;
    console.log(reason);
  }
});
client.subscribe("t", null, (frame) => {
  if (frame.type === "event" && frame.event.type === "cancel") {
    // @ts-expect-error a cancel's reason may be absent (no reason given)
    const why: string = frame.event.reason;
    // @ts-expect-error a cancel carries no error: the task's error says "cancelled"
    console.log(why, frame.event.error);
  }
});
// @ts-expect-error a tag subscription's token is a string or null
client.subscribeTag("owner:u42", 42, () => {});
client.subscribeTag("owner:u42", null, () => {}, {
  // @ts-expect-error a tag frame lists ids, not tasks
  onTag: (frame) => frame.taskIds.map((task: Task) => task.state),
  // @ts-expect-error an added frame names the task; its state comes in the frames that follow
  onAdded: (frame) => console.log(frame.task),
});
// @ts-expect-error a cursor is a number, or a version and an epoch as "version:epoch"
client.subscribeTag("owner:u42", null, () => {}, { cursors: { "report-42": "3" } });
// @ts-expect-error the epoch is a string
const epoch: number = ({} as Task).epoch;
// @ts-expect-error tags are strings
const tag: number = ({} as Task).tags[0];
console.log(tag);
// @ts-expect-error progress is a number
const progress: string = ({} as Task).progress;
console.log(wrong, progress);

// A task's streams: by name from their start, or from the offsets held; chunks in order, then the end.
let answer = "";
client.subscribe("llm-run", null, () => {}, {
  streams: ["output"],
  onChunks: (update: StreamUpdate) => {
    answer = (update.replace ? "" : answer) + update.chunks.join("");
    if (update.ended) console.log(`${update.stream} ended at ${update.offset}, attempt ${update.attempt ?? "none"}`);
  },
});
client.subscribe("build-7", null, () => {}, { streams: { log: 120, output: 0 } });
// @ts-expect-error an offset is a number
client.subscribe("build-7", null, () => {}, { streams: { log: "120" } });

// Titles, live metadata (its status line, `metadata.message`) and a batch's counts of its children.
function statusOf(task: Task): string {
  const message = task.metadata.message;
  const name = task.title ?? task.id;
  return typeof message === "string" ? `${name}: ${message}` : name;
}
function countsOf(children: Children): string {
  const ended = children.succeeded + children.failed + children.expired;
  return `${ended} of ${children.total} done, ${children.failed} failed, ${children.running} running`;
}
function ranFor(task: Task): number | null {
  if (task.startedAtMs === undefined) return null;
  return (task.endedAtMs ?? Date.now()) - task.startedAtMs;
}
client.subscribe("batch-1", null, (frame, task) => console.log(statusOf(task), task.revision, ranFor(task), task.worker), {
  onMetadata: (update: MetadataUpdate) => {
    const held: JsonObject = update.metadata;
    console.log(update.taskId, update.revision, held, update.task === null ? "before its first frame" : statusOf(update.task));
  },
  onChildren: (update: ChildrenUpdate) => console.log(countsOf(update.children), update.task?.parent),
});
client.subscribeTag("owner:u42", null, () => {}, {
  onMetadata: (update) => console.log(update.metadata.message),
  onChildren: (update) => console.log(update.children.total),
});
client.subscribe("t", null, (frame, task) => {
  // @ts-expect-error a task's children are counts, present only for a batch
  const total: number = task.children.total;
  // @ts-expect-error metadata is a JSON object: no functions in it
  task.metadata.run = () => 1;
  console.log(total, frame.type);
});
client.subscribe("t", null, () => {}, {
  // @ts-expect-error counts are numbers
  onChildren: (update) => update.children.total.toUpperCase(),
});

// A batch, its parent and every child, on one subscription with the parent's subscribe token.
const batchTitles = new Map<string, string>();
const stopBatch = client.subscribeBatch("import-7", "eyJ...", (frame, task) => batchTitles.set(task.id, task.title ?? task.id), {
  onBatch: (frame: BatchFrame) => console.log(`${frame.parent}: ${frame.taskIds.length - 1} children`, frame.more),
  onAdded: (frame) => console.log(`${frame.taskId} joined ${frame.parent}`),
  onChildren: ({ children }) => console.log(children.total),
  onError: (error) => console.error(error.code),
});
console.log(client.batchTasks("import-7").map((task) => task.parent ?? "the parent"));
stopBatch();
client.unsubscribeBatch("import-7");
client.subscribeBatch("import-7", null, () => {}, {
  // @ts-expect-error a batch's added frame names its parent, not a tag
  onAdded: (frame) => console.log(frame.tag),
});

// Types for gateway-client.js (served beside it at /static/gateway-client.d.ts). Checked in CI with
// `tsc --strict` against tests/types/, which uses the client as an application would.

/** A task's state; the last three are terminal. */
export type TaskState = "queued" | "running" | "succeeded" | "failed" | "expired";

/** A task as the gateway sends it (no history). */
export interface Task {
  id: string;
  state: TaskState;
  /** The deadline for a result, in epoch milliseconds. */
  expiresAtMs: number;
  attempts: number;
  maxAttempts: number;
  /** 0 to 100. */
  progress: number;
  /** How many entries the task's history holds: the cursor a client keeps. */
  version: number;
  /** The task's tags, fixed at creation, sorted (`[]` for none). */
  tags: string[];
  /** When the task was created, by the gateway's clock, in epoch milliseconds. */
  createdAtMs: number;
  /**
   * Which history of its id the task is, made at its creation: a task made again under the id of a
   * deleted one has another. A cursor goes with it (`Cursor`). Absent only from a gateway before epochs.
   */
  epoch?: string;
  resultRef?: string;
  resultHash?: string;
  /** Why a failed task failed (a worker's error), or `"cancelled"` for a task cancelled on request. */
  error?: string;
  /** What a person reads for the task ("Monthly sales export"), given at its creation; absent when none. */
  title?: string;
  /**
   * The task's live metadata (a JSON object, `{}` for none), changed beside its history by merge patches.
   * `message`, when a string, is the status line a person reads ("Rendering page 3 of 12"). The client
   * always sets it (the newest it holds, by `revision`).
   */
  metadata: JsonObject;
  /** The id of the batch (task) this one is a child of; absent when none. */
  parent?: string;
  /** The gateway moves the task's progress as its children end. */
  progressFromChildren?: true;
  /** A batch's counts of its children, present once it has had one (a cancelled child counts as failed). */
  children?: Children;
  /**
   * Counts the changes beside the history (metadata patches, changes of the children): the newest
   * `metadata` and `children` are those of the highest revision. The client always sets it.
   */
  revision: number;
  /** The worker of the last start, once started. */
  worker?: string;
  /** When the last attempt started, by the gateway's clock (epoch milliseconds). */
  startedAtMs?: number;
  /** When the task ended (succeeded, failed or expired), by the gateway's clock. */
  endedAtMs?: number;
}

/** A JSON value, as metadata holds. */
export type JsonValue = string | number | boolean | null | JsonValue[] | { [key: string]: JsonValue };
export type JsonObject = { [key: string]: JsonValue };

/** A batch's counts of its children, by state (`total` is their sum). */
export interface Children {
  total: number;
  queued: number;
  running: number;
  succeeded: number;
  failed: number;
  expired: number;
}

/**
 * A history event, stamped by the gateway's clock. `expire` and `cancel` are the gateway's own: `cancel` ends
 * a queued or running task on a backend's request (`POST /v1/tasks/{id}/cancel`), leaving it `failed` with
 * `error: "cancelled"`; `reason` is there only when one was given.
 */
export type TaskEvent =
  | { type: "start"; atMs: number; worker: string }
  | { type: "progress"; atMs: number; progress: number; cursor: string }
  | { type: "succeed"; atMs: number; resultRef: string; resultHash: string }
  | { type: "fail"; atMs: number; error: string; retryable: boolean }
  | { type: "expire"; atMs: number }
  | { type: "cancel"; atMs: number; reason?: string };

/** One history entry: the event that moved the task to `version`. */
export interface Entry {
  version: number;
  event: TaskEvent;
}

interface FrameBase {
  taskId: string;
  /** The cursor the client holds once it has applied this frame. */
  version: number;
  task: Task;
}

/** Nothing was missed since the cursor. */
export interface CaughtUpFrame extends FrameBase {
  type: "caught-up";
}

/** The entries missed since the cursor. */
export interface DeltaFrame extends FrameBase {
  type: "delta";
  events: Entry[];
}

/**
 * The whole state instead of entries: the cursor was too old, ahead of the task, or the client was slow;
 * `new`: a task of a tag subscription the client had no cursor for (one created while it was away, say);
 * `recreated`: the cursor was of another task under this id (deleted by retention, the id made again
 * since): this task replaces it, whatever the versions.
 */
export interface SnapshotFrame extends FrameBase {
  type: "snapshot";
  reason: "retention" | "cursor-ahead" | "conflated" | "new" | "recreated";
}

/** One new entry, at version last + 1, with the task after it. */
export interface EventFrame extends FrameBase {
  type: "event";
  event: TaskEvent;
}

/** A task's whole metadata after a change, with the task's revision (no version: beside the history). */
export interface MetadataFrame {
  type: "metadata";
  taskId: string;
  revision: number;
  metadata: JsonObject;
}

/** A batch's whole counts after a change of one of its children. */
export interface ChildrenFrame {
  type: "children";
  taskId: string;
  revision: number;
  children: Children;
}

/**
 * A task's metadata changed: from a `metadata` frame, or a newer one carried by a task's frame (after a
 * reconnect, say). Told at the first frame too, and never an older one after a newer.
 */
export interface MetadataUpdate {
  taskId: string;
  revision: number;
  metadata: JsonObject;
  /** The task with this metadata; null when it came before the task's first frame. */
  task: Task | null;
}

/** A batch's counts changed (as MetadataUpdate). */
export interface ChildrenUpdate {
  taskId: string;
  revision: number;
  children: Children;
  task: Task | null;
}

/** A frame handed to a listener: the resume frame of a subscription, then its events, in order. */
export type Frame = CaughtUpFrame | DeltaFrame | SnapshotFrame | EventFrame;

export type FrameListener = (frame: Frame, task: Task) => void;

/** `idle`: nothing to watch (every task finished, nothing subscribed), so no socket is open. */
export type ConnectionState = "idle" | "connecting" | "connected" | "reconnecting" | "offline";

/** Why a subscription ended without its task finishing (it is not retried). */
export interface SubscriptionError {
  code: "unauthorized" | "forbidden" | "unknown-task" | "invalid-request";
  message: string;
}

/**
 * The last version seen of a task: a number, or `"version:epoch"` with the `epoch` of the task it was seen
 * in, so that a task made again under its id is not taken for it. A bare number is taken as a version of
 * the task the id names now.
 */
export type Cursor = number | `${number}:${string}`;

export interface SubscribeOptions {
  /** Start from this cursor instead of the one kept in storage (default: kept, else 0). */
  cursor?: Cursor;
  onError?: (error: SubscriptionError) => void;
  /**
   * The task's streams to follow (its output: a model's tokens, a log), by name from their start, or with
   * the offset to start each from (the `nextOffset` held). The client keeps each stream's attempt and next
   * offset and resumes from them after a drop.
   */
  streams?: string[] | Record<string, number>;
  /** Each followed stream's chunks, in order, then its end once the task has ended. */
  onChunks?: (update: StreamUpdate) => void;
  /** The task's metadata at its first frame and at each change (by revision, across reconnects). */
  onMetadata?: (update: MetadataUpdate) => void;
  /** A batch's counts of its children at its first frame and at each change. */
  onChildren?: (update: ChildrenUpdate) => void;
}

/** Chunks of one of a task's streams (docs/protocol.md, "Streams"). */
export interface StreamUpdate {
  taskId: string;
  stream: string;
  /** The attempt that wrote the chunks (a greater one than before: a retry's output). */
  attempt: number | null;
  /** The offset of the first chunk (with `ended`: the stream's final next offset). */
  offset: number;
  chunks: string[];
  /** The text starts over with these chunks (a retry's output replaces the failed attempt's). */
  replace: boolean;
  /** The task has ended and the stream with it: no chunk follows (`chunks` is empty). */
  ended: boolean;
}

/** A stream's chunks as the gateway sends them. */
export interface ChunksFrame {
  type: "chunks";
  taskId: string;
  stream: string;
  attempt: number;
  offset: number;
  chunks: string[];
}

/** A stream's end, after the task's terminal frame. */
export interface EndFrame {
  type: "end";
  taskId: string;
  stream: string;
  offset: number;
}

/** A tag subscription's list of the tag's tasks, newest first, sent at each (re)subscription. */
export interface TagFrame {
  type: "tag";
  tag: string;
  taskIds: string[];
  /** Some tasks were left out (the gateway lists at most GATEWAY_TAG_SUBSCRIPTION_MAX, the newest). */
  more: boolean;
}

/** A task created with the tag while subscribed; its `snapshot` (`reason: "new"`) and events follow. */
export interface AddedFrame {
  type: "added";
  tag: string;
  taskId: string;
}

/** A batch subscription's list of its tasks, sent at each (re)subscription: the parent first, then its
 * children newest first. */
export interface BatchFrame {
  type: "batch";
  parent: string;
  taskIds: string[];
  /** Some children were left out (the gateway lists at most GATEWAY_TAG_SUBSCRIPTION_MAX). */
  more: boolean;
}

/** A child added to a batch while subscribed; its `snapshot` (`reason: "new"`) and events follow. */
export interface BatchAddedFrame {
  type: "added";
  parent: string;
  taskId: string;
}

/** Why a tag subscription ended (it is not retried). `websocket-required`: the client fell back to
 * server-sent events, which have no tag stream. */
export interface TagSubscriptionError {
  code: "unauthorized" | "forbidden" | "invalid-request" | "websocket-required";
  message: string;
}

export interface TagSubscribeOptions {
  /** The versions already seen, task id -> cursor (default: those kept in storage, else none). */
  cursors?: Record<string, Cursor>;
  /** The tag's tasks, newest first, at each (re)subscription; tasks no longer listed are forgotten. */
  onTag?: (frame: TagFrame) => void;
  /**
   * A task created with the tag while subscribed (announced once); its frames follow. Announced again (or
   * listed before): its id was made again, and its snapshot replaces the task it named.
   */
  onAdded?: (frame: AddedFrame) => void;
  onError?: (error: TagSubscriptionError) => void;
  /** Each task's metadata at its first frame and at each change, as `SubscribeOptions.onMetadata`. */
  onMetadata?: (update: MetadataUpdate) => void;
  /** Each batch's counts at its first frame and at each change. */
  onChildren?: (update: ChildrenUpdate) => void;
}

export interface BatchSubscribeOptions {
  /** The versions already seen, task id -> cursor (default: those kept in storage, else none). */
  cursors?: Record<string, Cursor>;
  /** The batch's tasks (the parent, then its children newest first) at each (re)subscription. */
  onBatch?: (frame: BatchFrame) => void;
  /** A child added while subscribed (announced once); its frames follow. */
  onAdded?: (frame: BatchAddedFrame) => void;
  onError?: (error: TagSubscriptionError) => void;
  /** Each task's metadata at its first frame and at each change. */
  onMetadata?: (update: MetadataUpdate) => void;
  /** The parent's counts of its children at its first frame and at each change. */
  onChildren?: (update: ChildrenUpdate) => void;
}

/** The part of `Storage` the client uses to keep cursors across reloads. */
export interface CursorStorage {
  getItem(key: string): string | null;
  setItem(key: string, value: string): void;
}

export interface ClientOptions {
  /** The WebSocket class (default: the global one). */
  WebSocket?: typeof WebSocket;
  /** For the SSE fallback (default: the global one); null turns the fallback off. */
  EventSource?: typeof EventSource | null;
  /** Where cursors survive a reload (default: sessionStorage); null keeps them in memory only. */
  storage?: CursorStorage | null;
  /** First reconnect wait in ms (full jitter), default 250. */
  backoffBaseMs?: number;
  /** Longest reconnect wait in ms, default 10000. */
  backoffCapMs?: number;
  /** WebSocket attempts that never opened before falling back to SSE, default 2. */
  sseAfterFailures?: number;
  /** A socket that has said nothing for this long (ms) is sent a `ping`, default 3000. */
  heartbeatMs?: number;
  /** A `ping` not answered within this (ms; a handshake gets twice this) is a dead link: the socket is
   * dropped and replaced, cursors kept. Default 3000. */
  deadlineMs?: number;
  /** The deadline (ms) of the ping `reconnectNow()` sends an open socket, default 1500. */
  probeMs?: number;
  /** A source of numbers in [0, 1), for tests. */
  random?: () => number;
}

export class GatewayClient {
  /** @param baseUrl the gateway, e.g. "https://gateway.example" (http(s) or ws(s)) */
  constructor(baseUrl: string, options?: ClientOptions);

  readonly baseUrl: string;
  readonly transport: "websocket" | "sse";
  readonly state: ConnectionState;
  readonly online: boolean;
  /** When the link was last known to work (ms since the epoch); null before the first frame. */
  readonly lastHeardAt: number | null;

  /**
   * Watch one task: `onFrame` gets every frame of it, in order, with the task after the frame.
   * @param token the task's subscribe token (null where the gateway runs open)
   * @returns a function that stops watching
   */
  subscribe(taskId: string, token: string | null, onFrame: FrameListener, options?: SubscribeOptions): () => void;
  unsubscribe(taskId: string): void;
  /** The last version applied for a task, or null. */
  cursor(taskId: string): number | null;
  /**
   * Watch every task carrying `tag`, those it has and those created later: `onFrame` gets every frame of
   * each, per task in order with no gap, with the task after the frame. Resumes every task from its cursor
   * after a drop. A second subscription to the same tag replaces the first.
   * @param token a tag token for `tag` (`POST /v1/tokens`; null where the gateway runs open)
   * @returns a function that stops watching
   */
  subscribeTag(tag: string, token: string | null, onFrame: FrameListener, options?: TagSubscribeOptions): () => void;
  unsubscribeTag(tag: string): void;
  /** A tag subscription's cursors map (task id -> last version applied, finished tasks too), or null. */
  tagCursors(tag: string): Record<string, number> | null;
  /** A tag subscription's tasks as they are now, newest first (createdAtMs, then id, descending). */
  tagTasks(tag: string): Task[];
  /**
   * Follow a batch, its parent and every child (those added later too), with one credential: a tag
   * subscription whose tasks are the parent and its children (docs/protocol.md, Batches).
   * @param token the parent's subscribe token, or a tag token for a tag the parent carries (null where the
   *   gateway runs open)
   * @returns a function that stops watching
   */
  subscribeBatch(parent: string, token: string | null, onFrame: FrameListener, options?: BatchSubscribeOptions): () => void;
  unsubscribeBatch(parent: string): void;
  /** A batch subscription's tasks as they are now (the parent among them), newest first. */
  batchTasks(parent: string): Task[];
  /** Be told of connection state changes; returns a function that stops telling. */
  onState(listener: (state: ConnectionState) => void): () => void;
  /** Whether the network is up (watchBrowser calls this from `online`/`offline`). */
  setOnline(online: boolean): void;
  /** Reconnect at once instead of waiting out the backoff. */
  reconnectNow(): void;
  /** Close everything; the client does not reconnect after this. */
  close(): void;
}

/** The window events watchBrowser listens to. */
export interface BrowserWindow {
  addEventListener(type: "online" | "offline", listener: () => void): void;
  removeEventListener(type: "online" | "offline", listener: () => void): void;
  document?: {
    visibilityState: string;
    addEventListener(type: "visibilitychange", listener: () => void): void;
    removeEventListener(type: "visibilitychange", listener: () => void): void;
  };
  navigator?: { onLine: boolean };
}

/**
 * Browser habits: reconnect at once when the network comes back or the page becomes visible, and show
 * `offline` while the browser says so. Returns a function that removes the listeners.
 */
export function watchBrowser(client: GatewayClient, win?: BrowserWindow): () => void;

/**
 * gateway-client.js: live task state from a task-gateway, for any web app (an ES module, no
 * dependencies, no build step).
 *
 * The core uses only `WebSocket` (and `EventSource` for the SSE fallback), so it runs in a page, a
 * worker or a React Native app. Browser habits (reconnect at once when the network comes back or the
 * page becomes visible) live in `watchBrowser`, apart from the core.
 *
 *     import { GatewayClient, watchBrowser } from "https://gateway.example/static/gateway-client.js";
 *     const client = new GatewayClient("https://gateway.example");
 *     watchBrowser(client);
 *     client.onState((state) => console.log(state));        // connecting, connected, reconnecting, offline, idle
 *     const stop = client.subscribe(taskId, subscribeToken, (frame, task) => render(task));
 *     // Every task carrying a tag (a tag token from POST /v1/tokens): those there are and those to come.
 *     client.subscribeTag("owner:u42", tagToken, (frame, task) => render(task), { onAdded, onTag });
 *     // A task's output as its worker writes it (its streams): the text so far, then each chunk.
 *     client.subscribe(taskId, subscribeToken, onFrame, {
 *       streams: ["output"],
 *       onChunks: (u) => (u.replace ? replaceText(u.chunks.join("")) : appendText(u.chunks.join(""))),
 *     });
 *     // A task's metadata (its status line: `metadata.message`) and a batch's counts of its children, live.
 *     client.subscribe(taskId, subscribeToken, onFrame, {
 *       onMetadata: (u) => showLine(u.metadata.message),
 *       onChildren: (u) => showCounts(u.children),         // {total, queued, running, succeeded, failed, expired}
 *     });
 *
 * Every frame handed to a listener is exactly what the gateway sent, in order: the resume frame
 * (`caught-up`, `delta` or `snapshot`) then `event` frames at version last + 1. The client checks that,
 * resubscribes from its cursor on a gap, and keeps each cursor in `sessionStorage` so a reloaded page
 * resumes where it was. A tag subscription does the same for each of the tag's tasks, with one cursor per
 * task (the cursors map it sends when it subscribes again after a drop). A cursor goes with the epoch of
 * its task's history (`version:epoch`): a task made again under the id of a deleted one comes as a
 * `snapshot` (`reason: "recreated"`), never as the old one's next versions, and replaces it.
 *
 * A task's `metadata` and `children` (a batch's counts) live beside its history: they change with no new
 * version, in `metadata` and `children` frames, each with the task's `revision`. The client keeps, per task,
 * the newest of each by revision, from those frames and from the task of every resume and `event` frame
 * (the frame that carries the higher revision wins, whatever the order they come in, across reconnects), and
 * the task it hands to a listener always carries them: `task.metadata`, `task.children`, `task.revision`.
 *
 * @module gateway-client
 */

const TERMINAL = new Set(["succeeded", "failed", "expired"]);
const RESUME = new Set(["caught-up", "delta", "snapshot"]);
// What changes beside a task's history, with its revision instead of a version (docs/protocol.md).
const BESIDE = new Set(["metadata", "children"]);
const FATAL = new Set(["unauthorized", "forbidden", "unknown-task", "invalid-request"]);
const STORAGE_PREFIX = "task-gateway:cursor:";
const TAG_STORAGE_PREFIX = "task-gateway:tag:"; // the ids of a tag's tasks (their cursors as above)
const BATCH_STORAGE_PREFIX = "task-gateway:batch:"; // the ids of a batch's tasks
// The frame that answers a tag's or a batch's subscribe, listing its tasks.
const GROUP = new Set(["tag", "batch"]);
const TAG_FATAL = new Set(["unauthorized", "forbidden", "invalid-request"]);
// The gateway's bounds on a message (its defaults): before the socket holds an authorized subscription
// (GATEWAY_WS_MAX_MESSAGE_BYTES_BEFORE_AUTH), and after (GATEWAY_WS_MAX_MESSAGE_BYTES). A tag's subscribe
// sends the cursors of its newest tasks that fit; one left out costs a snapshot, never a loss.
const MESSAGE_BYTES_BEFORE_AUTH = 4096;
const MESSAGE_BYTES = 65536;
const CLOSE_TOO_BIG = 1009;

/**
 * @typedef {object} Task  The gateway's task: id, state, expiresAtMs, attempts, maxAttempts, progress,
 *   version, tags, createdAtMs, epoch, resultRef?, resultHash?, error?, title?, metadata, parent?,
 *   progressFromChildren?, children?, revision, worker?, startedAtMs?, endedAtMs?
 * @typedef {number | string} Cursor  the last version seen: a number, or `"version:epoch"` with the epoch
 *   of the task it was seen in (`task.epoch`); a bare number is taken as a version of the task the id
 *   names now
 * @typedef {object} Frame  A server frame: {type, taskId, version, task, event?, events?, reason?}
 * @typedef {(frame: Frame, task: Task) => void} FrameListener
 * @typedef {object} TagFrame  {type: "tag", tag, taskIds (newest first), more}
 * @typedef {object} AddedFrame  {type: "added", tag or parent, taskId}
 * @typedef {object} BatchFrame  {type: "batch", parent, taskIds (the parent, then its children newest
 *   first), more}
 * @typedef {object} StreamUpdate  chunks of one of a task's streams, in order: {taskId, stream, attempt,
 *   offset (the first chunk's), chunks, replace (true: the text starts over with these chunks: a retry's
 *   output, or the stream sent again from its attempt's first chunk), ended (true: the task has ended and
 *   the stream with it; `chunks` is empty and `offset` the stream's final next offset)}
 * @typedef {object} Children  a batch's counts: {total, queued, running, succeeded, failed, expired}
 * @typedef {object} MetadataUpdate  {taskId, revision, metadata, task (the task with it; null before its
 *   first frame)}: a task's metadata changed (a `metadata` frame, or a newer one in a task's frame)
 * @typedef {object} ChildrenUpdate  {taskId, revision, children, task}: a batch's counts changed
 * @typedef {"idle"|"connecting"|"connected"|"reconnecting"|"offline"} ConnectionState  `idle`: nothing to
 *   watch, no socket (the gateway closes a socket that holds no subscription)
 */

/**
 * @typedef {object} ClientOptions
 * @property {typeof WebSocket} [WebSocket]  the WebSocket class (default: the global one)
 * @property {typeof EventSource | null} [EventSource]  for the SSE fallback (default: the global one)
 * @property {Storage | null} [storage]  where cursors survive a reload (default: sessionStorage)
 * @property {number} [backoffBaseMs=250]  first reconnect wait (full jitter: uniform in [0, wait])
 * @property {number} [backoffCapMs=10000]  longest reconnect wait
 * @property {number} [sseAfterFailures=2]  WebSocket attempts that never opened before falling back to SSE
 * @property {number} [heartbeatMs=3000]  a socket that has said nothing for this long is sent a `ping`
 * @property {number} [deadlineMs=3000]  a `ping` (or a new socket's handshake, given twice this) not
 *   answered within this is a dead link: the socket is dropped and replaced, cursors kept
 * @property {number} [probeMs=1500]  the deadline of the ping `reconnectNow()` sends an open socket
 * @property {() => number} [random]  for tests
 */

export class GatewayClient {
  /**
   * @param {string} baseUrl  the gateway, e.g. "https://gateway.example" (http(s) or ws(s))
   * @param {ClientOptions} [options]
   */
  constructor(baseUrl, options = {}) {
    this.baseUrl = String(baseUrl).replace(/\/+$/, "");
    this.WebSocket = options.WebSocket ?? globalThis.WebSocket;
    this.EventSource = options.EventSource === undefined ? globalThis.EventSource ?? null : options.EventSource;
    this.storage = options.storage === undefined ? safeSessionStorage() : options.storage;
    this.backoffBaseMs = options.backoffBaseMs ?? 250;
    this.backoffCapMs = options.backoffCapMs ?? 10000;
    this.sseAfterFailures = options.sseAfterFailures ?? 2;
    this.heartbeatMs = options.heartbeatMs ?? 3000;
    this.deadlineMs = options.deadlineMs ?? 3000;
    this.probeMs = options.probeMs ?? 1500;
    this.random = options.random ?? Math.random;
    /** @type {"websocket"|"sse"} */
    this.transport = "websocket";
    /** @type {ConnectionState} */
    this.state = "connecting";
    this.online = true;
    this._subs = new Map();
    this._tags = new Map();
    this._authorized = false; // the socket has answered a subscription (its limit on messages is higher)
    this._messageBytes = [MESSAGE_BYTES_BEFORE_AUTH, MESSAGE_BYTES]; // halved on a close 1009
    this._stateListeners = new Set();
    this._ws = null;
    this._failures = 0;
    this._everOpened = false;
    this._timer = null;
    this._heartbeat = null;
    this._lastHeard = 0;
    this._pingDeadline = 0; // when the ping in flight must have been answered (0: none in flight)
    /** When the link was last known to work (ms since the epoch); null before the first frame. */
    this.lastHeardAt = null;
    this._closed = false;
  }

  /**
   * Watch one task. `onFrame` gets every frame of it, in order, with the task state after the frame.
   * @param {string} taskId
   * @param {string | null} token  the task's subscribe token (null where the gateway runs open)
   * @param {FrameListener} onFrame
   * @param {{cursor?: Cursor, onError?: (error: {code: string, message: string}) => void,
   *   streams?: string[] | Record<string, number>, onChunks?: (update: StreamUpdate) => void,
   *   onMetadata?: (update: MetadataUpdate) => void, onChildren?: (update: ChildrenUpdate) => void}} [options]
   *   `streams`: the task's streams to follow, by name (from their start) or with the offset to start
   *   each from; `onChunks` gets each stream's chunks in order, across reconnects (the client keeps each
   *   stream's attempt and next offset, and resumes from them), then its end once the task has ended;
   *   `onMetadata` and `onChildren`: the task's metadata, a batch's counts, at the first frame and at each
   *   change (never an older one after a newer: by revision), after `onFrame` when a frame of it brought them
   * @returns {() => void}  stops watching
   */
  subscribe(taskId, token, onFrame, options = {}) {
    const from = parseCursor(options.cursor) ?? this._loadCursor(taskId) ?? { version: 0, epoch: null };
    const wanted = Array.isArray(options.streams)
      ? options.streams.map((name) => [name, 0])
      : Object.entries(options.streams ?? {});
    const sub = {
      taskId,
      token,
      onFrame,
      onError: options.onError ?? null,
      cursor: from.version,
      epoch: from.epoch, // the epoch of the task's history the cursor is of (null: not known)
      awaiting: true,
      done: false,
      task: null,
      source: null,
      resumeMode: null,
      ended: false, // the task has ended (its streams' end frames may still be to come)
      // stream name -> {attempt (null: none seen yet), next (the offset to resume from), ended}
      streams: new Map(wanted.map(([name, offset]) => [name, { attempt: null, next: offset, ended: false }])),
      onChunks: options.onChunks ?? null,
      held: heldBeside(), // the newest metadata and children counts, by revision
      onMetadata: options.onMetadata ?? null,
      onChildren: options.onChildren ?? null,
    };
    this._subs.set(taskId, sub);
    if (this.transport === "sse") {
      this._openSse(sub);
    } else if (this._ws && this._ws.readyState === 1) {
      this._sendSubscribe(sub);
    } else {
      this._connect();
    }
    return () => this.unsubscribe(taskId);
  }

  /** @param {string} taskId */
  unsubscribe(taskId) {
    const sub = this._subs.get(taskId);
    if (!sub) return;
    this._subs.delete(taskId);
    if (sub.source) sub.source.close();
    if (this._ws && this._ws.readyState === 1 && !sub.done) {
      this._ws.send(JSON.stringify({ type: "unsubscribe", taskId }));
    }
  }

  /** The cursor (last version applied) of a task, or null. @param {string} taskId */
  cursor(taskId) {
    const sub = this._subs.get(taskId);
    return sub ? sub.cursor : this._loadCursor(taskId)?.version ?? null;
  }

  /**
   * Watch every task carrying `tag`: those it has (newest first) and those created with it later, each
   * until it ends; finished ones stay known. `onFrame` gets every frame of every such task, per task in
   * order with no gap (a resume frame or an `event`; a `snapshot` replaces the task), with the task after
   * it. The client keeps a cursor per task (in `sessionStorage` too) and, after a drop, subscribes again
   * with them all, so each task resumes where it was and tasks created meanwhile come as `snapshot`s
   * (`reason: "new"`); when more are known than fit the gateway's limit on a message, those of the newest
   * tasks (one left out comes as a `snapshot`). A second subscription to the same tag replaces the first.
   * @param {string} tag
   * @param {string | null} token  a tag token for `tag` (`POST /v1/tokens`; null where the gateway runs open)
   * @param {FrameListener} onFrame
   * @param {{cursors?: Record<string, Cursor>, onTag?: (frame: TagFrame) => void,
   *   onAdded?: (frame: AddedFrame) => void,
   *   onError?: (error: {code: string, message: string}) => void,
   *   onMetadata?: (update: MetadataUpdate) => void, onChildren?: (update: ChildrenUpdate) => void}} [options]
   *   `cursors`: the versions already seen (default: those kept in storage); `onTag`: the tag's tasks at
   *   each (re)subscription; `onAdded`: a task created with the tag while subscribed (its frames follow; one
   *   it knew: the id was made again, and the new task's snapshot replaces it); `onMetadata`,
   *   `onChildren`: each task's metadata and a batch's counts, as for `subscribe`
   * @returns {() => void}  stops watching
   */
  subscribeTag(tag, token, onFrame, options = {}) {
    return this._subscribeGroup("tag", tag, token, onFrame, options);
  }

  /**
   * Follow a batch: its parent and every child, those added later too, on one subscription with one
   * credential (docs/protocol.md, Batches): a tag subscription whose tasks are the parent and its children,
   * with all that `subscribeTag` does (a cursor per task, resumed after a drop). `onBatch` gets the `batch`
   * frame at each (re)subscription (the parent first, then its children newest first), `onAdded` each child
   * added while subscribed. A second subscription to the same batch replaces the first.
   * @param {string} parent  the parent task's id
   * @param {string | null} token  the parent's subscribe token, or a tag token for a tag the parent carries
   *   (null where the gateway runs open)
   * @param {FrameListener} onFrame
   * @param {{cursors?: Record<string, Cursor>, onBatch?: (frame: BatchFrame) => void,
   *   onAdded?: (frame: AddedFrame) => void,
   *   onError?: (error: {code: string, message: string}) => void,
   *   onMetadata?: (update: MetadataUpdate) => void, onChildren?: (update: ChildrenUpdate) => void}} [options]
   * @returns {() => void}  stops watching
   */
  subscribeBatch(parent, token, onFrame, options = {}) {
    return this._subscribeGroup("parent", parent, token, onFrame, { ...options, onTag: options.onBatch });
  }

  /** @param {string} parent */
  unsubscribeBatch(parent) {
    this.unsubscribeTag(groupKey("parent", parent));
  }

  /**
   * A batch's tasks as they are now (the parent among them), newest first; those whose first frame has not
   * come yet are left out. @param {string} parent
   * @returns {Task[]}
   */
  batchTasks(parent) {
    return this.tagTasks(groupKey("parent", parent));
  }

  /** A tag's or a batch's subscription (`kind`: "tag" or "parent"), kept under groupKey(kind, name). */
  _subscribeGroup(kind, name, token, onFrame, options) {
    const key = groupKey(kind, name);
    const previous = this._tags.get(key);
    if (previous) this._endTag(previous);
    const sub = {
      kind,
      name,
      key,
      token,
      onFrame,
      onTag: options.onTag ?? null,
      onAdded: options.onAdded ?? null,
      onError: options.onError ?? null,
      onMetadata: options.onMetadata ?? null,
      onChildren: options.onChildren ?? null,
      // task id -> {cursor: number|null, epoch: string|null, task: Task|null, awaiting: boolean, held}
      tasks: new Map(),
      awaiting: false, // a subscribe sent, its `tag` frame not come yet
      done: false,
      listed: 0, // how many tasks the last `tag` frame listed
      cap: Infinity, // the most cursors to send (the server's limit, once learnt)
      sent: 0, // how many cursors the last subscribe sent
      retry: null,
    };
    const cursors = options.cursors ?? this._loadTagCursors(sub);
    for (const [taskId, cursor] of Object.entries(cursors)) {
      const from = parseCursor(cursor);
      if (from) sub.tasks.set(taskId, knownTask(from.version, from.epoch));
    }
    this._tags.set(key, sub);
    if (this.transport === "sse") {
      // Server-sent events have no tag stream: a tag needs the WebSocket this network did not let through.
      const what = kind === "tag" ? "a tag" : "a batch";
      this._tagError(sub, {
        code: "websocket-required",
        message: `following ${what} needs a WebSocket, and none could connect (server-sent events have no tag stream)`,
      });
    } else if (this._ws && this._ws.readyState === 1) {
      this._sendTagSubscribe(sub);
    } else {
      this._connect();
    }
    return () => this.unsubscribeTag(key);
  }

  /** @param {string} tag */
  unsubscribeTag(tag) {
    const sub = this._tags.get(tag);
    if (!sub) return;
    this._tags.delete(tag);
    this._endTag(sub);
  }

  /**
   * The cursors map of a tag subscription: task id -> last version applied, for every task of the tag
   * the client knows (finished ones too); null when the tag is not subscribed. @param {string} tag
   * @returns {Record<string, number> | null}
   */
  tagCursors(tag) {
    const sub = this._tags.get(tag);
    if (!sub) return null;
    const cursors = {};
    for (const [taskId, known] of sub.tasks) if (known.cursor !== null) cursors[taskId] = known.cursor;
    return cursors;
  }

  /**
   * The tasks of a tag subscription as they are now, newest first (createdAtMs descending, then id
   * descending); those whose first frame has not come yet are left out. @param {string} tag
   * @returns {Task[]}
   */
  tagTasks(tag) {
    const sub = this._tags.get(tag);
    if (!sub) return [];
    const tasks = [...sub.tasks.values()].map((known) => known.task).filter((task) => task !== null);
    return tasks.sort(newestFirst);
  }

  /**
   * Be told of connection state changes. @param {(state: ConnectionState) => void} listener
   * @returns {() => void}
   */
  onState(listener) {
    this._stateListeners.add(listener);
    return () => this._stateListeners.delete(listener);
  }

  /** Tell the client whether the network is up (watchBrowser does this from `online`/`offline`). */
  setOnline(online) {
    this.online = online;
    if (!online) {
      this._setState("offline");
    } else {
      this.reconnectNow();
    }
  }

  /** Reconnect at once instead of waiting out the backoff (the network came back, the page is visible). */
  reconnectNow() {
    if (this._closed) return;
    this._failures = 0;
    if (this.transport === "sse") {
      for (const sub of this._subs.values()) if (!sub.done && !sub.source) this._openSse(sub);
      return;
    }
    if (this._ws && this._ws.readyState === 1) {
      // It may have died while the network was away or the page slept: ask, and replace it unless it
      // answers quickly. Back from offline, the link is not known to work until it does.
      if (this.state === "offline") this._setState("reconnecting");
      this._ping(this.probeMs);
      return;
    }
    if (this._ws && this._ws.readyState === 0) {
      this._abandon(); // a handshake begun on the old network may never finish
    }
    this._connect();
  }

  /** Close everything; the client does not reconnect after this. */
  close() {
    this._closed = true;
    clearTimeout(this._timer);
    clearInterval(this._heartbeat);
    this._heartbeat = null;
    if (this._ws) this._ws.close(1000);
    for (const sub of this._subs.values()) if (sub.source) sub.source.close();
    for (const sub of this._tags.values()) clearTimeout(sub.retry);
  }

  // --- WebSocket ------------------------------------------------------------------------------------

  _wsUrl() {
    return this.baseUrl.replace(/^http/, "ws") + "/v1/ws";
  }

  /** Whether anything needs the socket: a task not finished, or a tag. */
  _wanted() {
    return [...this._subs.values()].some((s) => !s.done) || [...this._tags.values()].some((s) => !s.done);
  }

  _connect() {
    if (this._closed || !this.online) return;
    clearTimeout(this._timer);
    this._timer = null;
    if (this._ws && this._ws.readyState <= 1) return; // connecting or open
    if (!this._wanted()) {
      this._setState("idle"); // nothing to watch: no socket, nothing to reconnect
      return;
    }
    this._setState(this._everOpened && this.state !== "idle" ? "reconnecting" : "connecting");
    let ws;
    try {
      ws = new this.WebSocket(this._wsUrl());
    } catch (error) {
      this._dropped(null);
      return;
    }
    this._ws = ws;
    this._authorized = false;
    let opened = false;
    this._lastHeard = Date.now();
    this._pingDeadline = this._lastHeard + 2 * this.deadlineMs; // the handshake's deadline
    this._startHeartbeat();
    ws.onopen = () => {
      if (this._ws !== ws) return;
      opened = true;
      this._everOpened = true;
      this._heard();
      this._setState("connected");
      // Tags first: a task also watched on its own is then streamed to its own subscription (the last).
      for (const sub of this._tags.values()) if (!sub.done) this._sendTagSubscribe(sub);
      for (const sub of this._subs.values()) if (!sub.done) this._sendSubscribe(sub);
    };
    ws.onmessage = (message) => {
      if (this._ws !== ws) return;
      this._heard();
      // The socket outlived an offline spell (or a wake-up): the network is back and it still works.
      if (this.online && this.state !== "connected") this._setState("connected");
      let frame;
      try {
        frame = JSON.parse(message.data);
      } catch {
        return;
      }
      if (GROUP.has(frame.type) || RESUME.has(frame.type)) this._authorized = true;
      const group = frame.tag !== undefined || frame.parent !== undefined;
      if (GROUP.has(frame.type) || ((frame.type === "added" || frame.type === "error") && group)) {
        this._onTagFrame(frame);
        return;
      }
      this._onFrame(frame, (sub) => this._sendSubscribe(sub));
      if (frame.taskId !== undefined) for (const sub of this._tags.values()) this._onTagTaskFrame(sub, frame);
    };
    ws.onclose = (event) => {
      if (this._ws !== ws) return;
      if (event && event.code === CLOSE_TOO_BIG) {
        // A message over the gateway's limit (a lower one than its default): send smaller ones.
        this._messageBytes = this._messageBytes.map((bytes) => Math.max(512, Math.floor(bytes / 2)));
      }
      this._ws = null;
      this._stopHeartbeat();
      this._dropped(opened);
    };
    ws.onerror = () => {}; // onclose follows
  }

  _heard() {
    this._lastHeard = Date.now();
    this.lastHeardAt = this._lastHeard;
    this._pingDeadline = 0;
  }

  /** One timer per client: pings a silent socket and replaces one that misses its deadline. */
  _startHeartbeat() {
    if (this._heartbeat !== null) return;
    const tick = Math.max(100, Math.min(this.heartbeatMs, this.deadlineMs, this.probeMs) / 4);
    this._heartbeat = setInterval(() => this._checkLink(), tick);
  }

  _stopHeartbeat() {
    clearInterval(this._heartbeat);
    this._heartbeat = null;
    this._pingDeadline = 0;
  }

  _checkLink() {
    const ws = this._ws;
    if (!ws) return this._stopHeartbeat();
    const now = Date.now();
    if (this._pingDeadline && now >= this._pingDeadline) {
      const opened = ws.readyState === 1;
      this._abandon(); // no answer in time: a dead link (no FIN ever came), or a handshake that hangs
      this._dropped(opened);
      return;
    }
    if (ws.readyState === 1 && !this._pingDeadline && now - this._lastHeard >= this.heartbeatMs) {
      this._ping(this.deadlineMs);
    }
  }

  /** Send a ping that must be answered (by any frame) within `deadlineMs`. */
  _ping(deadlineMs) {
    const ws = this._ws;
    if (!ws || ws.readyState !== 1) return;
    const deadline = Date.now() + deadlineMs;
    if (!this._pingDeadline || deadline < this._pingDeadline) this._pingDeadline = deadline;
    try {
      ws.send('{"type":"ping"}');
    } catch {
      // closing: onclose follows
    }
  }

  /** Let go of the current socket without waiting for a closing handshake a dead link never completes. */
  _abandon() {
    const ws = this._ws;
    this._ws = null;
    this._stopHeartbeat();
    if (!ws) return;
    ws.onopen = ws.onmessage = ws.onclose = null;
    ws.onerror = null;
    try {
      ws.close(4000);
    } catch {
      // already closed
    }
  }

  _sendSubscribe(sub) {
    sub.awaiting = true;
    const message = { type: "subscribe", taskId: sub.taskId, cursor: cursorOf(sub.cursor, sub.epoch) };
    if (sub.token) message.token = sub.token;
    if (sub.streams.size) message.streams = Object.fromEntries([...sub.streams].map(([name, s]) => [name, s.next]));
    this._ws.send(JSON.stringify(message));
  }

  _dropped(opened) {
    if (this._closed) return;
    for (const sub of this._tags.values()) {
      clearTimeout(sub.retry);
      sub.retry = null;
    }
    if (!this._wanted()) {
      // Nothing to watch (every task finished, the gateway let the socket go): no socket until the next
      // subscription.
      this._setState("idle");
      return;
    }
    this._failures = opened ? 0 : this._failures + 1;
    const tags = [...this._tags.values()].some((s) => !s.done); // a tag needs the WebSocket: no fallback
    if (!this._everOpened && this._failures >= this.sseAfterFailures && this.EventSource && !tags) {
      this._fallBackToSse(); // the WebSocket never got through: a network that blocks it
      return;
    }
    if (!this.online) {
      this._setState("offline");
      return;
    }
    this._setState("reconnecting");
    const wait = Math.min(this.backoffCapMs, this.backoffBaseMs * 2 ** this._failures) * this.random();
    this._timer = setTimeout(() => this._connect(), wait);
  }

  // --- SSE fallback --------------------------------------------------------------------------------

  _fallBackToSse() {
    this.transport = "sse";
    for (const sub of this._subs.values()) if (!sub.done) this._openSse(sub);
  }

  _openSse(sub) {
    if (sub.source) sub.source.close();
    sub.source = null;
    if (this._closed || sub.done || this._subs.get(sub.taskId) !== sub) return; // closed or unsubscribed meanwhile
    const query = new URLSearchParams({ cursor: String(cursorOf(sub.cursor, sub.epoch)) });
    if (sub.token) query.set("token", sub.token);
    if (sub.streams.size) query.set("streams", [...sub.streams].map(([name, s]) => `${name}:${s.next}`).join(","));
    const url = `${this.baseUrl}/v1/tasks/${encodeURIComponent(sub.taskId)}/stream?${query}`;
    const source = new this.EventSource(url);
    sub.source = source;
    sub.awaiting = true;
    this._setState("connecting");
    const reopen = () => {
      // A gap: start a fresh stream from the cursor we hold.
      source.close();
      sub.source = null;
      this._openSse(sub);
    };
    const handle = (message) => {
      let frame;
      try {
        frame = JSON.parse(message.data);
      } catch {
        return;
      }
      this._setState("connected");
      this._onFrame(frame, reopen);
      if (sub.done) {
        source.close();
        sub.source = null;
      }
    };
    for (const type of ["caught-up", "delta", "snapshot", "event", "chunks", "end", "metadata", "children"]) {
      source.addEventListener(type, handle);
    }
    source.onerror = () => {
      // EventSource reconnects by itself with Last-Event-ID; a closed one (HTTP error) is reopened later.
      if (sub.done || this._closed) return;
      this._setState(this.online ? "reconnecting" : "offline");
      if (source.readyState === 2) {
        sub.source = null;
        const wait = Math.min(this.backoffCapMs, this.backoffBaseMs * 2 ** 3) * this.random();
        this._timer = setTimeout(() => sub.done || sub.source || this._openSse(sub), wait);
      } else {
        // Reconnecting by itself with Last-Event-ID (the last version we applied): the next frame is the
        // resume frame of the new stream, which must be applied, not dropped as a stray.
        sub.awaiting = true;
      }
    };
  }

  // --- frames --------------------------------------------------------------------------------------

  _onFrame(frame, resubscribe) {
    if (frame.type === "pong") return;
    const sub = this._subs.get(frame.taskId);
    if (frame.type === "error") {
      if (sub && FATAL.has(frame.code)) {
        sub.done = true;
        if (sub.onError) sub.onError({ code: frame.code, message: frame.message });
      }
      return;
    }
    if (!sub || sub.done) return;
    if (frame.type === "chunks" || frame.type === "end") {
      this._onStreamFrame(sub, frame);
      return;
    }
    if (BESIDE.has(frame.type)) {
      sub.task = besideFrame(sub.held, frame, sub.task, sub);
      return;
    }
    if (RESUME.has(frame.type)) {
      // A snapshot also comes unasked: the newest state past a backlog (conflated), or the task made again.
      if (!sub.awaiting && !(frame.type === "snapshot" && ["conflated", "recreated"].includes(frame.reason))) return;
      sub.awaiting = false;
      if (sub.ended) return; // resumed for its streams alone: the task's end was applied and told
      if (frame.reason !== "conflated") sub.resumeMode = frame.type;
      this._failures = 0;
    } else if (frame.type === "event") {
      if (sub.awaiting || sub.ended) return; // sent before our resubscribe (its resume frame covers it)
      if (frame.version !== sub.cursor + 1) {
        resubscribe(sub);
        return;
      }
    } else {
      return;
    }
    sub.cursor = frame.version;
    sub.epoch = frame.task.epoch ?? null; // a snapshot of a task made again under the id brings its own
    const { task, changed } = absorb(sub.held, frame.task);
    sub.task = task;
    this._saveCursor(sub.taskId, sub.cursor, sub.epoch);
    if (TERMINAL.has(frame.task.state)) {
      sub.ended = true;
      sub.done = [...sub.streams.values()].every((s) => s.ended);
    }
    sub.onFrame(frame, task);
    tellBeside(sub, sub.held, task, changed);
  }

  /** A `chunks` or `end` frame of a stream the subscription follows (docs/protocol.md, "Live"). */
  _onStreamFrame(sub, frame) {
    const stream = sub.streams.get(frame.stream);
    // Before the resume frame of a subscription sent again, a frame is the earlier subscription's: the new
    // one sends the stream again from the offset it was sent with.
    if (!stream || stream.ended || sub.awaiting) return;
    const update = { taskId: sub.taskId, stream: frame.stream, attempt: stream.attempt, offset: frame.offset };
    if (frame.type === "end") {
      stream.ended = true;
      stream.next = frame.offset;
      sub.done = sub.ended && [...sub.streams.values()].every((s) => s.ended);
      if (sub.onChunks) sub.onChunks({ ...update, chunks: [], replace: false, ended: true });
      return;
    }
    // The text goes on from the next offset of the attempt held; any other frame starts it over (a retry's
    // output, or the stream sent from its attempt's first chunk).
    const replace = frame.offset !== stream.next || (stream.attempt !== null && frame.attempt !== stream.attempt);
    stream.attempt = frame.attempt;
    stream.next = frame.offset + frame.chunks.length;
    if (sub.onChunks) sub.onChunks({ ...update, attempt: frame.attempt, chunks: frame.chunks, replace, ended: false });
  }

  // --- tag subscriptions ---------------------------------------------------------------------------

  _sendTagSubscribe(sub) {
    clearTimeout(sub.retry);
    sub.retry = null;
    sub.awaiting = true;
    for (const known of sub.tasks.values()) known.awaiting = true;
    const message = { type: "subscribe", [sub.kind]: sub.name, cursors: {} };
    if (sub.token) message.token = sub.token;
    const room = this._messageBytes[this._authorized ? 1 : 0] - utf8Length(JSON.stringify(message));
    message.cursors = this._cursorsToSend(sub, room);
    sub.sent = Object.keys(message.cursors).length;
    this._ws.send(JSON.stringify(message));
  }

  /**
   * The cursors of the newest tasks known, as many as fit in `room` bytes (and no more than `cap`, once the
   * gateway has said it lists no more): a task left out gets a snapshot, never a loss.
   */
  _cursorsToSend(sub, room) {
    const order = (a, b) => newestFirst(a[1].task ?? { id: a[0] }, b[1].task ?? { id: b[0] });
    const known = [...sub.tasks].filter(([, k]) => k.cursor !== null).sort(order);
    const cursors = {};
    let count = 0;
    for (const [taskId, k] of known) {
      const cursor = cursorOf(k.cursor, k.epoch);
      const bytes = utf8Length(JSON.stringify(taskId)) + utf8Length(JSON.stringify(cursor)) + 2; // "id":N,
      if (count >= sub.cap || bytes > room) break;
      cursors[taskId] = cursor;
      room -= bytes;
      count += 1;
    }
    return cursors;
  }

  _endTag(sub) {
    const live = !sub.done;
    sub.done = true;
    clearTimeout(sub.retry);
    if (live && this._ws && this._ws.readyState === 1) {
      this._ws.send(JSON.stringify({ type: "unsubscribe", [sub.kind]: sub.name }));
    }
  }

  _tagError(sub, error) {
    sub.done = true;
    if (sub.onError) sub.onError(error);
  }

  /** A frame about a tag subscription itself: `tag`, `added`, or an `error` with `tag`. */
  _onTagFrame(frame) {
    const sub = this._tags.get(frame.tag !== undefined ? frame.tag : groupKey("parent", frame.parent));
    if (!sub || sub.done) return;
    if (frame.type === "error") {
      if (frame.code === "invalid-request" && sub.sent > sub.listed && sub.cap > sub.listed) {
        // More cursors than the gateway takes (tasks were added since it listed them): send the newest.
        sub.cap = sub.listed;
        if (this._ws && this._ws.readyState === 1) this._sendTagSubscribe(sub);
      } else if (TAG_FATAL.has(frame.code)) {
        this._tagError(sub, { code: frame.code, message: frame.message });
      } else {
        // Not the subscription's fault (the database out of reach, say): ask again a little later.
        const wait = Math.min(this.backoffCapMs, this.backoffBaseMs * 2 ** 3) * this.random();
        clearTimeout(sub.retry);
        sub.retry = setTimeout(() => {
          sub.retry = null;
          if (!sub.done && this._tags.get(sub.key) === sub && this._ws && this._ws.readyState === 1) {
            this._sendTagSubscribe(sub);
          }
        }, wait);
      }
      return;
    }
    if (GROUP.has(frame.type)) {
      sub.awaiting = false;
      sub.listed = frame.taskIds.length;
      if (frame.more) sub.cap = Math.min(sub.cap, frame.taskIds.length);
      this._failures = 0;
      // The tag's tasks now: those no longer listed (deleted by retention, or past the gateway's limit) are
      // forgotten; new ones wait for their first frame.
      const listed = new Set(frame.taskIds);
      for (const taskId of sub.tasks.keys()) if (!listed.has(taskId)) sub.tasks.delete(taskId);
      for (const taskId of frame.taskIds) {
        if (!sub.tasks.has(taskId)) sub.tasks.set(taskId, knownTask(null, null));
      }
      this._saveTagIds(sub);
      if (sub.onTag) sub.onTag(frame);
    } else if (frame.type === "added") {
      // Announced once; again (or a listed task), the id was made again: what was known of it goes, and the
      // new task's snapshot follows.
      sub.tasks.set(frame.taskId, knownTask(null, null));
      this._saveTagIds(sub);
      if (sub.onAdded) sub.onAdded(frame);
    }
  }

  /** A task's frame, for a tag subscription that knows the task: applied in order, per task, no gap. */
  _onTagTaskFrame(sub, frame) {
    if (sub.done) return;
    const known = sub.tasks.get(frame.taskId);
    if (!known) return;
    if (BESIDE.has(frame.type)) {
      known.task = besideFrame(known.held, frame, known.task, sub);
      return;
    }
    if (!frame.task) return;
    let shown = frame;
    if (RESUME.has(frame.type)) {
      // A snapshot replaces whatever was known (even an older version: the task was made anew). A
      // caught-up or delta behind what was applied is stale; a delta's entries already applied are cut.
      if (frame.type !== "snapshot" && known.cursor !== null && frame.version < known.cursor) return;
      if (frame.type === "delta" && known.cursor !== null && frame.events.some((e) => e.version <= known.cursor)) {
        shown = { ...frame, events: frame.events.filter((e) => e.version > known.cursor) };
      }
      known.awaiting = false;
    } else if (frame.type === "event") {
      if (known.cursor === null || frame.version <= known.cursor) return; // before its first frame, or seen
      if (frame.version !== known.cursor + 1) {
        // A gap: subscribe again with every cursor (unless that is under way); the resume frames cover it.
        if (!known.awaiting && !sub.awaiting && this._ws && this._ws.readyState === 1) this._sendTagSubscribe(sub);
        return;
      }
    } else {
      return;
    }
    known.cursor = frame.version;
    known.epoch = frame.task.epoch ?? null;
    const { task, changed } = absorb(known.held, frame.task);
    known.task = task;
    this._saveCursor(frame.taskId, known.cursor, known.epoch);
    sub.onFrame(shown, task);
    tellBeside(sub, known.held, task, changed);
  }

  _loadTagCursors(sub) {
    if (!this.storage) return {};
    let ids;
    try {
      ids = JSON.parse(this.storage.getItem(storageKey(sub)) ?? "[]");
    } catch {
      return {};
    }
    const cursors = {};
    if (!Array.isArray(ids)) return cursors;
    for (const taskId of ids) {
      const cursor = typeof taskId === "string" ? this._loadCursor(taskId) : null;
      if (cursor !== null) cursors[taskId] = cursorOf(cursor.version, cursor.epoch);
    }
    return cursors;
  }

  _saveTagIds(sub) {
    if (!this.storage) return;
    try {
      this.storage.setItem(storageKey(sub), JSON.stringify([...sub.tasks.keys()]));
    } catch {
      // storage full or denied: the cursors still live in memory
    }
  }

  _setState(state) {
    if (this.state === state) return;
    this.state = state;
    for (const listener of this._stateListeners) listener(state);
  }

  /** The cursor kept for a task ({version, epoch}), or null. */
  _loadCursor(taskId) {
    if (!this.storage) return null;
    try {
      const raw = this.storage.getItem(STORAGE_PREFIX + taskId);
      return raw === null ? null : parseCursor(raw);
    } catch {
      return null;
    }
  }

  _saveCursor(taskId, cursor, epoch) {
    if (!this.storage) return;
    try {
      this.storage.setItem(STORAGE_PREFIX + taskId, String(cursorOf(cursor, epoch)));
    } catch {
      // storage full or denied: the cursor still lives in memory
    }
  }
}

/**
 * Browser habits for a client: reconnect at once when the network comes back (`online`) or the page
 * becomes visible again (`visibilitychange`), and show `offline` while the browser says so.
 * @param {GatewayClient} client
 * @param {Window} [win]
 * @returns {() => void}  removes the listeners
 */
export function watchBrowser(client, win = globalThis) {
  if (!win || typeof win.addEventListener !== "function") return () => {};
  const doc = win.document;
  const online = () => client.setOnline(true);
  const offline = () => client.setOnline(false);
  const visible = () => {
    if (!doc || doc.visibilityState === "visible") client.reconnectNow();
  };
  win.addEventListener("online", online);
  win.addEventListener("offline", offline);
  if (doc) doc.addEventListener("visibilitychange", visible);
  if (win.navigator && win.navigator.onLine === false) client.setOnline(false);
  return () => {
    win.removeEventListener("online", online);
    win.removeEventListener("offline", offline);
    if (doc) doc.removeEventListener("visibilitychange", visible);
  };
}

// --- metadata and children: beside the history, the newest by revision ----------------------------------

/** What a subscription holds of a task beside its history: the newest metadata and children counts seen,
 * each with the revision it came with (-1: none yet), and the epoch of the task they are of. */
function heldBeside() {
  return { epoch: null, metadataRevision: -1, metadata: {}, childrenRevision: -1, children: null };
}

/** A task a tag subscription knows, from its cursor (null: none yet). */
function knownTask(cursor, epoch) {
  return { cursor, epoch, task: null, awaiting: true, held: heldBeside() };
}

/**
 * Take what a task of a resume or `event` frame carries beside its history into `held` where its revision is
 * not older than what is held (`>=`), and return the task with the newest of each (the frame's task itself
 * when it has them), and which changed. A task made again under its id (another epoch) starts over: its
 * revisions are its own.
 */
function absorb(held, task) {
  const epoch = task.epoch ?? null;
  if (held.epoch !== epoch) Object.assign(held, heldBeside(), { epoch });
  const revision = typeof task.revision === "number" ? task.revision : 0;
  const changed = { metadata: false, children: false };
  if (revision >= held.metadataRevision) {
    const metadata = isObject(task.metadata) ? task.metadata : {};
    changed.metadata = held.metadataRevision < 0 || !sameJson(held.metadata, metadata);
    held.metadata = metadata;
    held.metadataRevision = revision;
  }
  if (revision >= held.childrenRevision) {
    const children = isObject(task.children) ? task.children : null;
    changed.children = !sameJson(held.children, children);
    held.children = children;
    held.childrenRevision = revision;
  }
  // The task itself, unless a frame brought newer metadata or counts than it carries.
  const newer = held.metadataRevision > revision || held.childrenRevision > revision;
  return { task: newer ? withBeside(task, held) : task, changed };
}

/** The task with the metadata and counts held (a frame may have brought newer ones than the task's). */
function withBeside(task, held) {
  const shown = { ...task, metadata: held.metadata, revision: Math.max(0, held.metadataRevision, held.childrenRevision) };
  if (held.children !== null) shown.children = held.children;
  else delete shown.children;
  return shown;
}

/**
 * A `metadata` or `children` frame: applied where its revision is not older than what is held, and told to
 * the subscription's `onMetadata` or `onChildren`; returns the task as it is now (null before its first
 * frame).
 */
function besideFrame(held, frame, task, sub) {
  const revision = typeof frame.revision === "number" ? frame.revision : 0;
  const metadata = frame.type === "metadata";
  if (metadata ? !isObject(frame.metadata) : !isObject(frame.children)) return task;
  if (revision < (metadata ? held.metadataRevision : held.childrenRevision)) return task; // older than held
  const same = metadata ? sameJson(held.metadata, frame.metadata) : sameJson(held.children, frame.children);
  if (metadata) {
    held.metadata = frame.metadata;
    held.metadataRevision = revision;
  } else {
    held.children = frame.children;
    held.childrenRevision = revision;
  }
  const now = task === null ? null : withBeside(task, held);
  if (!same) tellBeside(sub, held, now, { metadata, children: !metadata }, frame.taskId);
  return now;
}

/** Tell a subscription's `onMetadata` and `onChildren` what changed. */
function tellBeside(sub, held, task, changed, taskId = task.id) {
  const revision = Math.max(0, held.metadataRevision, held.childrenRevision);
  if (changed.metadata && sub.onMetadata) sub.onMetadata({ taskId, revision, metadata: held.metadata, task });
  if (changed.children && held.children !== null && sub.onChildren) {
    sub.onChildren({ taskId, revision, children: held.children, task });
  }
}

function isObject(value) {
  return typeof value === "object" && value !== null && !Array.isArray(value);
}

/** Whether two JSON values are the same (the gateway sends each the same way, so key order matches). */
function sameJson(a, b) {
  return a === b || JSON.stringify(a) === JSON.stringify(b);
}

/** Where a tag's or a batch's subscription is kept: a tag under its name (no tag holds a NUL), a batch apart. */
function groupKey(kind, name) {
  return kind === "tag" ? name : `\u0000parent:${name}`;
}

/** Where the ids of a tag's or a batch's tasks are kept in storage. */
function storageKey(sub) {
  return (sub.kind === "tag" ? TAG_STORAGE_PREFIX : BATCH_STORAGE_PREFIX) + sub.name;
}

/** The bytes `text` takes in UTF-8 (what the gateway counts), with no TextEncoder (React Native). */
function utf8Length(text) {
  let bytes = 0;
  for (const char of text) {
    const code = char.codePointAt(0);
    bytes += code < 0x80 ? 1 : code < 0x800 ? 2 : code < 0x10000 ? 3 : 4;
  }
  return bytes;
}

/**
 * A cursor as given or kept (a version, or `"version:epoch"`) as {version, epoch}; null for anything else.
 * @param {unknown} value
 */
function parseCursor(value) {
  if (Number.isSafeInteger(value) && value >= 0) return { version: value, epoch: null };
  const match = typeof value === "string" ? /^([0-9]{1,16})(?::([0-9A-Za-z]{1,32}))?$/.exec(value) : null;
  const version = match ? Number(match[1]) : NaN;
  return Number.isSafeInteger(version) ? { version, epoch: match[2] ?? null } : null;
}

/** A cursor as the gateway takes it: `"version:epoch"`, or the bare version where no epoch is known. */
function cursorOf(version, epoch) {
  return epoch ? `${version}:${epoch}` : version;
}

/** Newest first: createdAtMs descending, then id descending (the order of a tag's tasks). */
function newestFirst(a, b) {
  const at = (b.createdAtMs ?? 0) - (a.createdAtMs ?? 0);
  return at !== 0 ? at : a.id < b.id ? 1 : a.id > b.id ? -1 : 0;
}

function safeSessionStorage() {
  try {
    return globalThis.sessionStorage ?? null;
  } catch {
    return null; // denied (sandboxed frame, privacy mode)
  }
}

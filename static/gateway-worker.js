/**
 * gateway-worker.js: a task-gateway worker for Node 20 (and any runtime with `fetch`): an ES module with
 * no dependency, for a job run by BullMQ, a Node queue of your own or a script, to report its task and
 * stream its output (docs/node-worker.md).
 *
 *     import { GatewayWorker } from "./gateway-worker.js";   // a copy of /static/gateway-worker.js
 *     const worker = new GatewayWorker("https://gateway.example", taskId, callbackToken);
 *     await worker.start("bullmq-1");
 *     for await (const token of answer) await worker.write("output", token);   // buffered
 *     await worker.progress(50);
 *     await worker.succeed("s3://answers/42", "sha256:9f2c");                  // flushes first
 *
 * What it does for you, as the Python `Worker` does (protocol.md):
 * - every callback goes with a `callbackId` of its own, and is sent again with that id after a lost answer,
 *   a 5xx or a 429 (after its `Retry-After`), with exponential backoff and full jitter: applied once;
 * - `progress`, `succeed` and `fail` are fenced with the attempt `start` began; a callback that had no effect
 *   throws `CallbackIgnored` (`TaskCancelled` when the task was cancelled: stop working), a 4xx
 *   `CallbackError` (`AttemptOver` when the attempt is over);
 * - on a task with a heartbeat lease (`heartbeatMs`), it heartbeats a third of the lease after the last
 *   renewal until `succeed`, `fail` or `close`; told the attempt is over, it calls `onOver` and every call
 *   after throws that error;
 * - `write(name, text)` appends to the task's stream `name`, buffered: a stream's text goes 50 ms after its
 *   oldest write not sent, or at once at 64 KiB (that write then waits for the answer), cut into chunks of
 *   at most 64 KiB of UTF-8 between characters, at most 1,000 chunks and 1 MiB an append; a batch whose
 *   answer was lost goes again with the same `seq` (the gateway appends it once); `flush()` sends it all
 *   now, and `succeed`/`fail` flush first.
 *
 * @module gateway-worker
 */

const MAX_CHUNK_BYTES = 64 * 1024;
const MAX_CHUNKS = 1000;
const MAX_BODY_BYTES = 1024 * 1024;
const BODY_FRAME_BYTES = 80; // {"attempt":A,"seq":S,"chunks":[]} with 19-digit numbers
const NAME = /^[a-z0-9_-]{1,32}$/;
const APPLIED = new Set(["started", "progress", "succeeded", "failed", "requeued"]);
const HARMLESS = new Set(["duplicate-progress", "duplicate-result", "duplicate-callback"]);
const ATTEMPT_OVER = new Set(["stale-attempt", "not-running"]);
const encoder = new TextEncoder();
const decoder = new TextDecoder();

/** A callback, heartbeat or append that did not do what it asked. */
export class WorkerError extends Error {
  /**
   * @param {string} message
   * @param {string} reason  the gateway's reason or error code
   * @param {object | null} task  the task as the answer carries it
   */
  constructor(message, reason, task) {
    super(message);
    this.name = new.target.name;
    this.reason = reason;
    this.task = task;
  }
}

/** The gateway refused the request with a 4xx: sending it again would not help. */
export class CallbackError extends WorkerError {
  /**
   * @param {number} status
   * @param {string} code
   * @param {string} message
   * @param {object | null} task
   */
  constructor(status, code, message, task = null) {
    super(`${status} ${code}: ${message}`, code, task);
    this.status = status;
    this.code = code;
  }
}

/** The worker's attempt is over (`409 stale-attempt`, `409 not-running`): what it does no longer counts. */
export class AttemptOver extends CallbackError {}

/** Answered, but the callback changed nothing (`terminal-conflict`, `not-running`, ...). */
export class CallbackIgnored extends WorkerError {
  /**
   * @param {string} what  the callback's type, or "heartbeat", "write"
   * @param {string} reason
   * @param {object | null} task
   */
  constructor(what, reason, task) {
    const state = task ? ` (the task is ${task.state}, attempt ${task.attempts})` : "";
    super(`${what} had no effect: ${reason}${state}`, reason, task);
    this.what = what;
  }
}

/** The task was cancelled (`POST /v1/tasks/{id}/cancel`): stop working. */
export class TaskCancelled extends CallbackIgnored {}

/** The task already runs an attempt this worker did not begin (`start` without `takeOver`). */
export class TaskAlreadyRunning extends CallbackIgnored {}

/** @param {any} task */
function cancelled(task) {
  return !!task && task.state === "failed" && task.error === "cancelled";
}

/**
 * `text` cut into chunks of at most 64 KiB of UTF-8, between characters, each with its size in bytes.
 * @param {string} text
 * @returns {Array<[string, number]>}
 */
export function chunksOf(text) {
  const data = encoder.encode(text);
  if (data.length <= MAX_CHUNK_BYTES) return data.length ? [[text, data.length]] : [];
  const cut = [];
  for (let start = 0; start < data.length; ) {
    let end = Math.min(start + MAX_CHUNK_BYTES, data.length);
    while (end < data.length && (data[end] & 0xc0) === 0x80) end -= 1; // not inside a character
    cut.push(/** @type {[string, number]} */ ([decoder.decode(data.subarray(start, end)), end - start]));
    start = end;
  }
  return cut;
}

/** One stream's text written and not taken yet, and its batches' numbers. */
class StreamOut {
  /** @param {string} name */
  constructor(name) {
    this.name = name;
    /** @type {number | null} */
    this.attempt = null;
    this.seq = 0;
    /** @type {{attempt: number, seq: number, chunks: string[]} | null} */
    this.inflight = null;
    /** @type {Array<[string, number, number]>} chunk, UTF-8 bytes, bytes in a body */
    this.chunks = [];
    this.bytes = 0;
    /** @type {number | null} */
    this.since = null;
  }

  /** @param {number} attempt @param {number} now @param {boolean} flush @param {number} flushMs */
  take(attempt, now, flush, flushMs) {
    if (attempt !== this.attempt) {
      this.attempt = attempt;
      this.seq = 0;
      if (this.inflight) this.inflight = { ...this.inflight, attempt, seq: 0 };
    }
    if (this.inflight) return this.inflight;
    if (this.since === null) return null;
    if (!flush && this.bytes < MAX_CHUNK_BYTES && now < this.since + flushMs) return null;
    const taken = [];
    let room = MAX_BODY_BYTES - BODY_FRAME_BYTES;
    while (this.chunks.length && taken.length < MAX_CHUNKS && this.chunks[0][2] <= room) {
      const [chunk, size, encoded] = /** @type {[string, number, number]} */ (this.chunks.shift());
      taken.push(chunk);
      room -= encoded;
      this.bytes -= size;
    }
    if (!this.chunks.length) this.since = null;
    this.inflight = { attempt, seq: this.seq, chunks: taken };
    return this.inflight;
  }
}

/**
 * @typedef {object} WorkerOptions
 * @property {typeof fetch} [fetch]  the fetch function (default: the global one)
 * @property {number} [retries=8]  how many times a request is sent again before its error is thrown
 * @property {number} [timeoutMs=10000]  each try's bound
 * @property {number} [backoffBaseMs=50]  first wait before a try again (full jitter), doubling
 * @property {number} [backoffCapMs=2000]  the longest wait
 * @property {number} [flushMs=50]  a stream's text goes this long after its oldest write not sent
 * @property {(error: WorkerError) => void} [onOver]  the heartbeat (or a background append) learned the
 *   attempt is over or the task was cancelled: stop the job
 */

export class GatewayWorker {
  /**
   * @param {string} baseUrl  the gateway, e.g. "https://gateway.example"
   * @param {string} taskId
   * @param {string} callbackToken  the task's callback token (from the create's answer)
   * @param {WorkerOptions} [options]
   */
  constructor(baseUrl, taskId, callbackToken, options = {}) {
    this.taskId = taskId;
    this.base = `${baseUrl.replace(/\/+$/, "")}/v1/tasks/${encodeURIComponent(taskId)}`;
    this.token = callbackToken;
    this.fetch = options.fetch ?? globalThis.fetch.bind(globalThis);
    this.retries = options.retries ?? 8;
    this.timeoutMs = options.timeoutMs ?? 10_000;
    this.backoffBaseMs = options.backoffBaseMs ?? 50;
    this.backoffCapMs = options.backoffCapMs ?? 2_000;
    this.flushMs = options.flushMs ?? 50;
    this.onOver = options.onOver;
    /** @type {number | null} the attempt this worker's start began */
    this.attempt = null;
    /** @type {number | null} */
    this.heartbeatMs = null;
    /** @type {WorkerError | null} what the heartbeat or a background append learned */
    this.over = null;
    this._renewedAt = 0;
    /** @type {ReturnType<typeof setTimeout> | null} */
    this._beat = null;
    /** @type {ReturnType<typeof setTimeout> | null} */
    this._flushTimer = null;
    /** @type {Map<string, StreamOut>} */
    this._streams = new Map();
    /** @type {Promise<unknown>} one append on its way at a time */
    this._appending = Promise.resolve();
    /** @type {WorkerError | null} a refusal a background append learned, for the next call */
    this._refused = null;
    this._ending = false;
  }

  /**
   * Begin an attempt. A task another worker runs throws `TaskAlreadyRunning`, unless `takeOver`.
   * @param {string} worker  a name for whoever runs it
   * @param {{takeOver?: boolean}} [options]
   */
  async start(worker, { takeOver = false } = {}) {
    this._check();
    const answer = await this._callback({ type: "start", worker }, false);
    const { reason, task } = answer;
    if (reason === "already-running" && !takeOver) throw new TaskAlreadyRunning("start", reason, task);
    if (task.state === "running" && ["started", "already-running", "duplicate-callback"].includes(reason)) {
      this.attempt = task.attempts;
      this._ending = false;
      this._schedule();
      return answer;
    }
    throw ignored("start", reason, task);
  }

  /** @param {number} progress  0 to 100 @param {string} [cursor] */
  async progress(progress, cursor = "") {
    this._check();
    return checked("progress", await this._callback({ type: "progress", progress, cursor }, true));
  }

  /** Flush what was written, then report the result. @param {string} resultRef @param {string} resultHash */
  async succeed(resultRef, resultHash) {
    return this._last({ type: "succeed", resultRef, resultHash });
  }

  /** Flush what was written, then report the failure. @param {string} error @param {{retryable: boolean}} o */
  async fail(error, { retryable }) {
    return this._last({ type: "fail", error, retryable });
  }

  /** Renew the lease now (the worker does it by itself after `start`). */
  async heartbeat() {
    this._check();
    if (this.attempt === null) throw new Error("heartbeat() before start(): this worker holds no attempt");
    return this._post(`${this.base}/heartbeat`, { attempt: this.attempt }, "heartbeat");
  }

  /**
   * Append `text` to the task's stream `name`, buffered; resolves at once unless 64 KiB wait (then once
   * they are taken).
   * @param {string} name  1 to 32 characters of a-z 0-9 _ -
   * @param {string} text
   */
  async write(name, text) {
    this._check();
    if (this.attempt === null) throw new Error("write() before start(): this worker holds no attempt");
    if (!NAME.test(name)) throw new TypeError(`a stream's name is 1 to 32 characters of a-z 0-9 _ -: ${name}`);
    let out = this._streams.get(name);
    if (!out) this._streams.set(name, (out = new StreamOut(name)));
    for (const [chunk, size] of chunksOf(text)) {
      out.chunks.push([chunk, size, encoder.encode(JSON.stringify(chunk)).length + 1]);
      out.bytes += size;
      if (out.since === null) out.since = Date.now();
    }
    if (out.bytes >= MAX_CHUNK_BYTES) return this._send(out, true);
    if (this._flushTimer === null && out.since !== null) {
      this._flushTimer = setTimeout(() => this._flushInBackground(), this.flushMs);
    }
  }

  /** Send everything written, now. */
  async flush() {
    this._check();
    for (const out of this._streams.values()) await this._send(out, true);
  }

  /** Stop the heartbeat and the background flush (`succeed` and `fail` do it too). */
  close() {
    this._ending = true;
    if (this._beat !== null) clearTimeout(this._beat);
    if (this._flushTimer !== null) clearTimeout(this._flushTimer);
    this._beat = this._flushTimer = null;
  }

  // --- inside ----------------------------------------------------------------------------------------------

  _check() {
    if (this.over) throw this.over;
    if (this._refused) {
      const refused = this._refused;
      this._refused = null;
      throw refused;
    }
  }

  /** @param {Record<string, unknown>} event */
  async _last(event) {
    this._check();
    if (this.attempt !== null) await this.flush();
    this.close();
    return checked(String(event.type), await this._callback(event, true));
  }

  /** @param {Record<string, unknown>} event @param {boolean} fenced */
  async _callback(event, fenced) {
    /** @type {Record<string, unknown>} */
    const body = { callbackId: crypto.randomUUID(), event };
    if (fenced && this.attempt !== null) body.attempt = this.attempt;
    return this._post(`${this.base}/callbacks`, body, String(event.type));
  }

  /**
   * POST `body` until answered (no answer, a 5xx, a 429: sent again, the same body); a 4xx throws.
   * @param {string} url @param {object} body @param {string} what
   * @returns {Promise<any>}
   */
  async _post(url, body, what) {
    const { status, answer, sentAt } = await this._exchange(url, body);
    if (status >= 300) throw refusal(status, answer, what);
    this._renewed(answer, sentAt);
    return answer;
  }

  /** @param {string} url @param {object} body */
  async _exchange(url, body) {
    const payload = JSON.stringify(body);
    for (let failures = 0; ; failures += 1) {
      const sentAt = Date.now();
      /** @type {Response | null} */
      let response = null;
      let error = null;
      try {
        response = await this.fetch(url, {
          method: "POST",
          headers: { Authorization: `Bearer ${this.token}`, "Content-Type": "application/json" },
          body: payload,
          signal: AbortSignal.timeout(this.timeoutMs),
        });
        if (response.status < 500 && response.status !== 429) {
          const text = await response.text();
          let answer = {};
          try {
            answer = text ? JSON.parse(text) : {};
          } catch {
            answer = { error: { code: `http-${response.status}`, message: text.slice(0, 200) } };
          }
          return { status: response.status, answer, sentAt };
        }
        await response.body?.cancel();
      } catch (caught) {
        error = caught; // no answer: refused, reset, timed out
        response = null;
      }
      if (failures >= this.retries) {
        throw error ?? new Error(`HTTP ${response?.status} from ${url} after ${failures + 1} tries`);
      }
      const wait = Math.random() * Math.min(this.backoffCapMs, this.backoffBaseMs * 2 ** failures);
      const asked = Number(response?.headers.get("retry-after"));
      await sleep(Math.max(wait, Number.isFinite(asked) && asked > 0 ? asked * 1000 : 0));
    }
  }

  /** @param {any} answer @param {number} sentAt */
  _renewed(answer, sentAt) {
    if (answer && answer.heartbeatMs != null) {
      this.heartbeatMs = answer.heartbeatMs;
      this._renewedAt = Math.max(this._renewedAt, sentAt);
      this._schedule();
    }
  }

  /** The next heartbeat, a third of the lease after its last renewal. */
  _schedule() {
    if (this._beat !== null) clearTimeout(this._beat);
    this._beat = null;
    if (this.heartbeatMs === null || this.attempt === null || this._ending || this.over) return;
    const due = this._renewedAt + this.heartbeatMs / 3 - Date.now();
    this._beat = setTimeout(() => this._heartbeatNow(), Math.max(0, due));
  }

  async _heartbeatNow() {
    this._beat = null;
    try {
      await this._post(`${this.base}/heartbeat`, { attempt: this.attempt }, "heartbeat");
    } catch (error) {
      if (this._ending) return;
      if (error instanceof AttemptOver || error instanceof TaskCancelled) return this._overBy(error);
      this._renewedAt = Date.now(); // not reached: try again a beat later
    }
    this._schedule();
  }

  /** @param {WorkerError} error */
  _overBy(error) {
    if (this.over) return;
    this.over = error;
    this.close();
    this.onOver?.(error);
  }

  async _flushInBackground() {
    this._flushTimer = null;
    try {
      for (const out of this._streams.values()) await this._send(out, false);
    } catch (error) {
      if (error instanceof AttemptOver || error instanceof TaskCancelled) return this._overBy(error);
      if (error instanceof WorkerError) this._refused = error;
      // no answer after every retry: the same batch goes again with the next flush
    }
    const waiting = [...this._streams.values()].filter((out) => out.since !== null || out.inflight);
    if (waiting.length && this._flushTimer === null && !this.over && !this._ending) {
      this._flushTimer = setTimeout(() => this._flushInBackground(), this.flushMs);
    }
  }

  /**
   * Send `out`'s due batches (all, `flush`), one append on its way at a time.
   * @param {StreamOut} out @param {boolean} flush
   * @returns {Promise<void>}
   */
  _send(out, flush) {
    const run = async () => {
      for (;;) {
        const batch = out.take(/** @type {number} */ (this.attempt), Date.now(), flush, this.flushMs);
        if (!batch) return;
        const url = `${this.base}/streams/${out.name}`;
        const { status, answer, sentAt } = await this._exchange(url, batch);
        if (status < 300) {
          out.inflight = null;
          out.seq += 1;
          this._renewed(answer, sentAt);
          continue;
        }
        const code = answer?.error?.code ?? `http-${status}`;
        if (status === 409 && code === "seq-gap" && Number.isInteger(answer.expectedSeq) &&
            answer.expectedSeq < batch.seq) {
          out.seq = answer.expectedSeq;
          out.inflight = { ...batch, seq: answer.expectedSeq };
          continue;
        }
        if (!(status === 409 && ATTEMPT_OVER.has(code))) out.inflight = null; // refused for good: dropped
        throw refusal(status, answer, "write");
      }
    };
    const sending = this._appending.then(run, run);
    this._appending = sending.catch(() => undefined);
    return sending;
  }
}

/** @param {number} ms */
function sleep(ms) {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

/** @param {string} what @param {string} reason @param {any} task */
function ignored(what, reason, task) {
  if (reason === "terminal-conflict" && cancelled(task)) return new TaskCancelled(what, reason, task);
  return new CallbackIgnored(what, reason, task);
}

/** The answer, unless it says the callback had no effect. @param {string} what @param {any} answer */
function checked(what, answer) {
  if (APPLIED.has(answer.reason) || HARMLESS.has(answer.reason)) return answer;
  throw ignored(what, answer.reason, answer.task ?? null);
}

/** The error for a 4xx. @param {number} status @param {any} answer @param {string} what */
function refusal(status, answer, what) {
  const code = answer?.error?.code ?? `http-${status}`;
  const message = answer?.error?.message ?? "";
  const task = answer?.task ?? null;
  if (status === 409 && ATTEMPT_OVER.has(code)) {
    return cancelled(task) ? new TaskCancelled(what, code, task) : new AttemptOver(status, code, message, task);
  }
  return new CallbackError(status, code, message, task);
}

// Types for gateway-worker.js (served beside it at /static/gateway-worker.d.ts): a task-gateway worker for
// Node 20. Checked in CI with `tsc --strict` against tests/types/worker.ts.

import type { Task } from "./gateway-client.js";

/** A callback's answer (protocol.md, Callbacks). */
export interface CallbackAnswer {
  reason: string;
  task: Task;
  leaseUntilMs?: number;
  heartbeatMs?: number;
}

/** A heartbeat's answer. */
export interface HeartbeatAnswer {
  leaseUntilMs: number;
  heartbeatMs: number;
}

export interface WorkerOptions {
  /** The fetch function (default: the global one). */
  fetch?: typeof fetch;
  /** How many times a request is sent again (no answer, a 5xx, a 429) before its error is thrown (8). */
  retries?: number;
  /** Each try's bound, in milliseconds (10,000). */
  timeoutMs?: number;
  /** The first wait before a try again (50 ms, full jitter, doubling up to `backoffCapMs`: 2,000). */
  backoffBaseMs?: number;
  backoffCapMs?: number;
  /** A stream's text goes this long after its oldest write not sent (50 ms). */
  flushMs?: number;
  /** The heartbeat (or a background append) learned the attempt is over, or the task was cancelled. */
  onOver?: (error: WorkerError) => void;
}

/** A callback, heartbeat or append that did not do what it asked. */
export class WorkerError extends Error {
  /** The gateway's reason or error code. */
  readonly reason: string;
  /** The task as the answer carries it, if it does. */
  readonly task: Task | null;
}

/** The gateway refused the request with a 4xx. */
export class CallbackError extends WorkerError {
  readonly status: number;
  readonly code: string;
}

/** `409 stale-attempt` or `409 not-running`: the worker's attempt is over. */
export class AttemptOver extends CallbackError {}

/** Answered, but the callback changed nothing. */
export class CallbackIgnored extends WorkerError {
  readonly what: string;
}

/** The task was cancelled: stop working. */
export class TaskCancelled extends CallbackIgnored {}

/** `start` found the task running an attempt this worker did not begin. */
export class TaskAlreadyRunning extends CallbackIgnored {}

/** `text` cut into chunks of at most 64 KiB of UTF-8, between characters, with their sizes in bytes. */
export function chunksOf(text: string): Array<[string, number]>;

export class GatewayWorker {
  constructor(baseUrl: string, taskId: string, callbackToken: string, options?: WorkerOptions);
  readonly taskId: string;
  /** The attempt this worker's start began (`null` before). */
  readonly attempt: number | null;
  /** The task's lease, once an answer said it. */
  readonly heartbeatMs: number | null;
  /** What the heartbeat or a background append learned: every call throws it. */
  readonly over: WorkerError | null;
  start(worker: string, options?: { takeOver?: boolean }): Promise<CallbackAnswer>;
  progress(progress: number, cursor?: string): Promise<CallbackAnswer>;
  succeed(resultRef: string, resultHash: string): Promise<CallbackAnswer>;
  fail(error: string, options: { retryable: boolean }): Promise<CallbackAnswer>;
  heartbeat(): Promise<HeartbeatAnswer>;
  write(name: string, text: string): Promise<void>;
  flush(): Promise<void>;
  close(): void;
}

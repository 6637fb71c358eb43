// static/gateway-worker.js under `node --test` against a real gateway, which tests/integration/
// test_node_worker.py starts (in open mode) and names in GATEWAY_URL; GATEWAY_LOSSY_URL is the same gateway
// through a proxy that loses 30% of its answers after the gateway wrote them (that test checks, from the
// proxy's record, that answers were lost and each lost one was followed by a duplicate).

import assert from "node:assert/strict";
import { test } from "node:test";

import {
  AttemptOver,
  GatewayWorker,
  TaskAlreadyRunning,
  TaskCancelled,
} from "../../static/gateway-worker.js";

const URL = process.env.GATEWAY_URL;
const LOSSY = process.env.GATEWAY_LOSSY_URL;

async function create(id, more = {}) {
  const answer = await fetch(`${URL}/v1/tasks`, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ id, ttlMs: 120000, ...more }),
  });
  const body = await answer.text();
  assert.equal(answer.status, 201, body);
  return JSON.parse(body);
}

async function text(id, name = "output") {
  const answer = await fetch(`${URL}/v1/tasks/${id}/streams/${name}/text`);
  assert.equal(answer.status, 200);
  return answer.text();
}

async function chunks(id, name = "output") {
  const answer = await fetch(`${URL}/v1/tasks/${id}/streams/${name}?offset=0&limit=10000`);
  return (await answer.json()).chunks;
}

test("a worker starts, reports progress, streams tokens and succeeds", async () => {
  const made = await create("node-llm-1");
  const worker = new GatewayWorker(URL, "node-llm-1", made.callbackToken);
  const started = await worker.start("node-1");
  assert.equal(started.reason, "started");
  assert.equal(worker.attempt, 1);
  const tokens = Array.from({ length: 500 }, (_, n) => `token${n} `);
  for (const token of tokens) await worker.write("output", token);
  await worker.progress(50, "half");
  const big = "é€𝄞".repeat(30000); // 270,000 bytes of UTF-8: cut into chunks of at most 64 KiB
  await worker.write("log", big);
  await worker.succeed("s3://answers/1", "sha256:1"); // flushes first
  assert.equal(await text("node-llm-1"), tokens.join(""));
  const logChunks = await chunks("node-llm-1", "log");
  assert.equal(logChunks.join(""), big);
  assert.ok(logChunks.every((c) => new TextEncoder().encode(c).length <= 65536));
  const task = await (await fetch(`${URL}/v1/tasks/node-llm-1`)).json();
  assert.equal(task.state, "succeeded");
});

test("writes reach the gateway within the flush interval, with no other call", async () => {
  const made = await create("node-bg-1");
  const worker = new GatewayWorker(URL, "node-bg-1", made.callbackToken);
  await worker.start("node-1");
  await worker.write("output", "thinking...");
  const deadline = Date.now() + 5000;
  while ((await text("node-bg-1")) !== "thinking...") {
    assert.ok(Date.now() < deadline, "the write's text never arrived");
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
  await worker.succeed("s3://r/1", "sha256:1");
});

test("appends whose answers are lost are sent again with their seq and taken once", async () => {
  const made = await create("node-lossy-1");
  const worker = new GatewayWorker(LOSSY, "node-lossy-1", made.callbackToken);
  await worker.start("node-1");
  const lines = Array.from({ length: 300 }, (_, n) => `line ${n}\n`);
  for (const [n, line] of lines.entries()) {
    await worker.write("output", line);
    if (n % 10 === 9) await worker.flush();
  }
  await worker.succeed("s3://logs/1", "sha256:1");
  assert.deepEqual(await chunks("node-lossy-1"), lines); // none missing, none twice
});

test("the heartbeat holds the lease and a cancel stops the writes", async () => {
  const made = await create("node-cut-1", { heartbeatMs: 1000 });
  let told = null;
  const worker = new GatewayWorker(URL, "node-cut-1", made.callbackToken, { onOver: (e) => (told = e) });
  await worker.start("node-1");
  assert.equal(worker.heartbeatMs, 1000);
  const beat = await worker.heartbeat();
  assert.ok(beat.leaseUntilMs > Date.now() - 1000);
  await worker.write("output", "before ");
  await worker.flush();
  const cancel = await fetch(`${URL}/v1/tasks/node-cut-1/cancel`, {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: "{}",
  });
  assert.equal(cancel.status, 200);
  await worker.write("output", "after");
  await assert.rejects(worker.flush(), TaskCancelled);
  // The heartbeat learns it too (a beat a third of the lease on): every call throws it from then on.
  const deadline = Date.now() + 5000;
  while (told === null) {
    assert.ok(Date.now() < deadline, "the heartbeat never learned of the cancel");
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
  assert.ok(told instanceof TaskCancelled);
  await assert.rejects(worker.write("output", "more"), TaskCancelled);
  assert.equal(await text("node-cut-1"), "before ");
  worker.close();
});

test("a second worker is refused unless it takes over, and an old attempt's writes are refused", async () => {
  const made = await create("node-stale-1", { maxAttempts: 2 });
  const old = new GatewayWorker(URL, "node-stale-1", made.callbackToken);
  const other = new GatewayWorker(URL, "node-stale-1", made.callbackToken);
  await old.start("node-1");
  await assert.rejects(other.start("node-2"), TaskAlreadyRunning);
  await old.write("output", "first attempt");
  await old.fail("flaky", { retryable: true }); // requeued
  await other.start("node-2");
  assert.equal(other.attempt, 2);
  await other.write("output", "second attempt");
  await other.flush();
  await old.write("output", " goes on");
  await assert.rejects(old.flush(), (error) => error instanceof AttemptOver && error.code === "stale-attempt");
  await other.succeed("s3://r/2", "sha256:2");
  assert.equal(await text("node-stale-1"), "second attempt");
});

// gateway-worker.js as a Node worker uses it, checked by `tsc --strict` against gateway-worker.d.ts
// (tests/types/check). The @ts-expect-error lines are mistakes the types must refuse.

import {
  AttemptOver,
  GatewayWorker,
  TaskCancelled,
  type CallbackAnswer,
  type WorkerError,
} from "../../static/gateway-worker.js";

async function job(taskId: string, callbackToken: string, tokens: AsyncIterable<string>): Promise<void> {
  const worker = new GatewayWorker("https://gateway.example", taskId, callbackToken, {
    flushMs: 100,
    onOver: (error: WorkerError) => console.log(error.reason, error.task?.state),
  });
  const started: CallbackAnswer = await worker.start("bullmq-1", { takeOver: false });
  const attempt: number | null = worker.attempt;
  console.log(started.task.attempts, attempt);
  try {
    for await (const token of tokens) await worker.write("output", token);
    await worker.progress(50, "half");
    await worker.flush();
    const lease = await worker.heartbeat();
    console.log(lease.leaseUntilMs + lease.heartbeatMs);
    await worker.succeed("s3://answers/42", "sha256:9f2c");
  } catch (error) {
    if (error instanceof TaskCancelled) return;
    if (error instanceof AttemptOver) console.log(error.status, error.code);
    await worker.fail(String(error), { retryable: true });
  } finally {
    worker.close();
  }
  // @ts-expect-error: a stream's text is a string
  await worker.write("output", 42);
  // @ts-expect-error: fail says whether the failure is retryable
  await worker.fail("boom");
}

console.log(job);

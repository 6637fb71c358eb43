"""A task's streams through the HTTP API of a real server (SQLite and PostgreSQL): appends and their answers
in protocol.md's order (duplicates, seq-reused, seq-gap, stale attempts, a task not running, too many
streams, a full stream), a retry's output replacing the failed attempt's, the three reads, the credentials
each route takes, and streams deleted with their task by retention."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support import (
    FakeClock,
    Running,
    bearer,
    create_task,
    drain_all,
    error,
    eventually,
    mint_tag,
    post_callback,
    running_gateway,
)

pytestmark = pytest.mark.anyio

API_KEY = "streams-test-api-key"
START = {"type": "start", "worker": "w1"}
SUCCEED = {"type": "succeed", "resultRef": "s3://r", "resultHash": "sha256:1"}
RETRY = {"type": "fail", "error": "boom", "retryable": True}


async def append(
    gw: Running, task_id: str, token: str, attempt: Any, seq: Any, *chunks: Any, stream: str = "output"
) -> Any:
    body = {"attempt": attempt, "seq": seq, "chunks": list(chunks)}
    return await gw.client.post(f"/v1/tasks/{task_id}/streams/{stream}", json=body, headers=bearer(token))


def appended(answer: Any) -> tuple[int, int, bool]:
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert {"stream", "attempt", "offset", "nextOffset", "duplicate"} <= set(body), body
    return body["offset"], body["nextOffset"], body["duplicate"]


async def started(gw: Running, task_id: str, **kwargs: Any) -> tuple[str, str]:
    """A running task's callback and subscribe tokens."""
    made = await create_task(gw, task_id, **kwargs)
    await post_callback(gw, task_id, made.callback_token, START)
    return made.callback_token, made.subscribe_token


async def test_appends_are_taken_once_in_order_and_read_back_as_pages_text_and_a_list(
    database_url: str,
) -> None:
    async with running_gateway(database_url) as gw:
        cb, sub = await started(gw, "t")
        assert appended(await append(gw, "t", cb, 1, 0, "Hel", "lo")) == (0, 2, False)
        assert appended(await append(gw, "t", cb, 1, 1, ", wörld", "\n")) == (2, 4, False)
        # The answer to a batch was lost: the worker sends it again, and it is not appended twice.
        assert appended(await append(gw, "t", cb, 1, 0, "Hel", "lo")) == (0, 2, True)
        assert appended(await append(gw, "t", cb, 1.0, 1, ", wörld", "\n")) == (2, 4, True)
        assert appended(await append(gw, "t", cb, 1, 0, "x", stream="log")) == (0, 1, False)

        page = await gw.client.get("/v1/tasks/t/streams/output", headers=bearer(sub))
        assert page.status_code == 200, page.text
        epoch = (await gw.client.get("/v1/tasks/t")).json()["epoch"]
        assert page.json() == {
            "stream": "output",
            "epoch": epoch,
            "attempt": 1,
            "offset": 0,
            "chunks": ["Hel", "lo", ", wörld", "\n"],
            "nextOffset": 4,
            "more": False,
            "closed": False,
        }
        page = await gw.client.get("/v1/tasks/t/streams/output", params={"offset": 1, "limit": 2})
        assert (page.json()["chunks"], page.json()["nextOffset"], page.json()["more"]) == (
            ["lo", ", wörld"],
            3,
            True,
        )
        text = await gw.client.get("/v1/tasks/t/streams/output/text", params={"token": sub})
        assert text.status_code == 200 and text.text == "Hello, wörld\n"
        assert text.headers["content-type"] == "text/plain; charset=utf-8"
        assert (text.headers["Stream-Attempt"], text.headers["Stream-Next-Offset"]) == ("1", "4")
        assert text.headers["Stream-Closed"] == "false"
        listed = await gw.client.get("/v1/tasks/t/streams", headers=bearer(sub))
        assert listed.json() == {
            "epoch": epoch,
            "streams": [
                {"name": "log", "attempt": 1, "nextOffset": 1, "bytes": 1, "closed": False},
                {
                    "name": "output",
                    "attempt": 1,
                    "nextOffset": 4,
                    "bytes": len("Hello, wörld\n".encode()),
                    "closed": False,
                },
            ],
        }
        # The task's history has no entry of them.
        assert (await gw.client.get("/v1/tasks/t")).json()["version"] == 1

        # A stream no append made reads as an empty one; the task's end closes every stream.
        await post_callback(gw, "t", cb, SUCCEED, attempt=1)
        empty = (await gw.client.get("/v1/tasks/t/streams/steps")).json()
        assert (empty["attempt"], empty["chunks"], empty["nextOffset"], empty["closed"]) == (0, [], 0, True)
        empty_text = await gw.client.get("/v1/tasks/t/streams/steps/text")
        assert (empty_text.text, empty_text.headers["Stream-Next-Offset"]) == ("", "0")
        closed = await gw.client.get("/v1/tasks/t/streams")
        assert [s["closed"] for s in closed.json()["streams"]] == [True, True]
        late = await append(gw, "t", cb, 1, 2, "late")
        assert "succeeded" in error(late, 409, "not-running")
        assert late.json()["task"]["state"] == "succeeded"


async def test_a_seq_out_of_turn_a_reused_one_a_stale_attempt_and_a_task_not_running_are_refused(
    database_url: str,
) -> None:
    async with running_gateway(database_url, stream_max_bytes=10) as gw:
        made = await create_task(gw, "t", max_attempts=2)
        cb = made.callback_token
        assert "queued" in error(await append(gw, "t", cb, 0, 0, "a"), 409, "not-running")
        await post_callback(gw, "t", cb, START)
        appended(await append(gw, "t", cb, 1, 0, "a"))
        gap = await append(gw, "t", cb, 1, 2, "c")
        assert gap.status_code == 409, gap.text
        assert gap.json()["error"]["code"] == "seq-gap" and gap.json()["expectedSeq"] == 1
        error(await append(gw, "t", cb, 1, 0, "b"), 409, "seq-reused")
        error(await append(gw, "t", cb, 2, 1, "b"), 409, "stale-attempt")
        full = error(await append(gw, "t", cb, 1, 1, "0123456789"), 413, "stream-full")
        assert "GATEWAY_STREAM_MAX_BYTES" in full
        for name in ("s1", "s2", "s3", "s4", "s5", "s6", "s7"):
            appended(await append(gw, "t", cb, 1, 0, "x", stream=name))
        error(await append(gw, "t", cb, 1, 0, "x", stream="s8"), 409, "too-many-streams")
        # Nothing of the refused batches was appended.
        assert (await gw.client.get("/v1/tasks/t/streams/output/text")).text == "a"
        assert len((await gw.client.get("/v1/tasks/t/streams")).json()["streams"]) == 8


async def test_a_retry_is_told_by_its_chunks_whatever_their_escaping_the_last_batch_and_an_earlier(
    database_url: str,
) -> None:
    """The same chunks sent again, escaped otherwise in the body (\\u escapes for what was sent as UTF-8), are
    the same batch: a duplicate, for the stream's last batch and for an earlier one; another text is
    seq-reused."""
    async with running_gateway(database_url) as gw:
        cb, _ = await started(gw, "t")
        url, headers = "/v1/tasks/t/streams/output", {**bearer(cb), "Content-Type": "application/json"}
        for raw, answer in (
            ('{"attempt": 1, "seq": 0, "chunks": ["héllo", "\\"w\\"\\n"]}'.encode(), (0, 2, False)),
            ('{"attempt": 1, "seq": 1, "chunks": ["\U0001f642"]}'.encode(), (2, 3, False)),
            (rb'{"seq": 1, "attempt": 1, "chunks": ["\ud83d\ude42"]}', (2, 3, True)),
            (rb'{"attempt":1,"seq":0,"chunks":["h\u00e9llo","\"\u0077\"\u000a"]}', (0, 2, True)),
        ):
            assert appended(await gw.client.post(url, content=raw, headers=headers)) == answer, raw
        for seq, chunks in ((1, ["\U0001f643"]), (0, ["héllo", '"w"'])):
            error(await append(gw, "t", cb, 1, seq, *chunks), 409, "seq-reused")
        assert (await gw.client.get("/v1/tasks/t/streams/output/text")).text == 'héllo"w"\n\U0001f642'


async def test_a_retrys_output_replaces_the_failed_attempts_at_the_offsets_that_follow(
    database_url: str,
) -> None:
    async with running_gateway(database_url) as gw:
        cb, _ = await started(gw, "t", max_attempts=2)
        appended(await append(gw, "t", cb, 1, 0, "first ", "try"))
        appended(await append(gw, "t", cb, 1, 0, "log", stream="log"))
        await post_callback(gw, "t", cb, RETRY, attempt=1)
        assert "requeued" in error(await append(gw, "t", cb, 1, 1, "x"), 409, "not-running")
        await post_callback(gw, "t", cb, START)
        error(await append(gw, "t", cb, 1, 1, "x"), 409, "stale-attempt")
        # The attempt's seqs start again from 0; its chunks at the offsets after the first attempt's.
        assert appended(await append(gw, "t", cb, 2, 0, "second")) == (2, 3, False)
        text = await gw.client.get("/v1/tasks/t/streams/output/text")
        assert (text.text, text.headers["Stream-Attempt"], text.headers["Stream-Next-Offset"]) == (
            "second",
            "2",
            "3",
        )
        # An offset of the first attempt reads from the second's first chunk; so does one past the end.
        for offset in ("0", "1", "9"):
            page = (await gw.client.get("/v1/tasks/t/streams/output", params={"offset": offset})).json()
            assert (page["attempt"], page["offset"], page["chunks"]) == (2, 2, ["second"]), offset
        # A stream the new attempt has not written keeps the first attempt's text.
        assert (await gw.client.get("/v1/tasks/t/streams/log/text")).text == "log"
        listed = (await gw.client.get("/v1/tasks/t/streams")).json()["streams"]
        assert [(s["name"], s["attempt"], s["bytes"]) for s in listed] == [("log", 1, 3), ("output", 2, 6)]


async def test_an_offset_of_another_history_of_the_id_reads_from_the_first_chunk(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url) as gw:
        cb, _ = await started(gw, "t")
        appended(await append(gw, "t", cb, 1, 0, "a", "b", "c"))
        epoch = (await gw.client.get("/v1/tasks/t")).json()["epoch"]
        same = (await gw.client.get("/v1/tasks/t/streams/output", params={"offset": f"2:{epoch}"})).json()
        assert (same["offset"], same["chunks"]) == (2, ["c"])
        other = (await gw.client.get("/v1/tasks/t/streams/output", params={"offset": "2:0ther"})).json()
        assert (other["offset"], other["chunks"]) == (0, ["a", "b", "c"])


async def test_appends_renew_the_lease_and_count_against_the_callback_rate(sqlite_url: str) -> None:
    clock = FakeClock()
    async with running_gateway(sqlite_url, clock=clock, sweep_interval_ms=0, callback_rate_per_s=3) as gw:
        made = await gw.client.post("/v1/tasks", json={"id": "t", "ttlMs": 600_000, "heartbeatMs": 2_000})
        cb = made.json()["callbackToken"]
        await post_callback(gw, "t", cb, START)
        clock.advance(1_500)
        answer = await append(gw, "t", cb, 1, 0, "a")
        assert answer.json()["leaseUntilMs"] == clock.now + 2_000 and answer.json()["heartbeatMs"] == 2_000
        clock.advance(1_500)
        assert (await append(gw, "t", cb, 1, 0, "a")).json()[
            "leaseUntilMs"
        ] == clock.now + 2_000  # a retry too
        limited = await append(gw, "t", cb, 1, 1, "b")
        error(limited, 429, "rate-limited")
        assert int(limited.headers["Retry-After"]) >= 1


async def test_bad_input_is_refused_with_the_field_named(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url) as gw:
        cb, sub = await started(gw, "t")
        path = "/v1/tasks/t/streams/output"
        for body, field in [
            ({"attempt": 1, "seq": 0, "chunks": []}, "chunks"),
            ({"attempt": 1, "seq": 0, "chunks": [""]}, "chunks"),
            ({"attempt": 1, "seq": 0, "chunks": [1]}, "chunks"),
            ({"attempt": 1, "seq": 0, "chunks": ["x" * 65_537]}, "chunks[0]"),
            ({"attempt": 1, "seq": -1, "chunks": ["x"]}, "seq"),
            ({"attempt": 1, "seq": 2**53, "chunks": ["x"]}, "seq"),
            ({"attempt": "1", "seq": 0, "chunks": ["x"]}, "attempt"),
            ({"seq": 0, "chunks": ["x"]}, "attempt"),
            ({"attempt": 1, "seq": 0, "chunk": ["x"]}, "chunk: unknown field (did you mean chunks?)"),
        ]:
            message = error(await gw.client.post(path, json=body, headers=bearer(cb)), 400, "invalid-request")
            assert message.startswith(field), (body, message)
        too_big = {"attempt": 1, "seq": 0, "chunks": ["x" * 60_000] * 18}
        error(await gw.client.post(path, json=too_big, headers=bearer(cb)), 413, "payload-too-large")
        # An append's body may pass GATEWAY_MAX_BODY_BYTES (64 KiB): its own limit is 1 MiB.
        assert appended(await append(gw, "t", cb, 1, 0, *(["x" * 60_000] * 10))) == (0, 10, False)
        for name in ("Output", "a" * 33, "a.b"):
            error(await append(gw, "t", cb, 1, 0, "x", stream=name), 400, "invalid-request")
            error(
                await gw.client.get(f"/v1/tasks/t/streams/{name}", headers=bearer(sub)),
                400,
                "invalid-request",
            )
        for params in (
            {"offset": "-1"},
            {"offset": "x"},
            {"offset": str(2**53)},
            {"limit": "0"},
            {"limit": "10001"},
            {"other": "1"},
        ):
            error(await gw.client.get(path, params=params, headers=bearer(sub)), 400, "invalid-request")
        error(await gw.client.get(path + "?offset=1&offset=2", headers=bearer(sub)), 400, "invalid-request")


async def test_each_route_takes_the_credentials_the_protocol_says(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url, api_key=API_KEY) as gw:
        key = bearer(API_KEY)
        made = await create_task(gw, "t", tags=["owner:u1"], headers=key)
        await post_callback(gw, "t", made.callback_token, START)
        # Appends: the callback token, or the API key (from the header only).
        appended(await append(gw, "t", made.callback_token, 1, 0, "a"))
        appended(await append(gw, "t", API_KEY, 1, 1, "b"))
        error(await append(gw, "t", made.subscribe_token, 1, 2, "c"), 403, "forbidden")
        error(await append(gw, "t", mint_tag("owner:u1"), 1, 2, "c"), 403, "forbidden")
        other = await create_task(gw, "u", headers=key)
        error(await append(gw, "t", other.callback_token, 1, 2, "c"), 403, "forbidden")
        error(await append(gw, "nope", made.callback_token, 1, 0, "c"), 403, "forbidden")  # before the task
        error(await append(gw, "nope", API_KEY, 1, 0, "c"), 404, "unknown-task")
        body = {"attempt": 1, "seq": 2, "chunks": ["c"]}
        nothing = await gw.client.post("/v1/tasks/t/streams/output", json=body)
        error(nothing, 401, "unauthorized")
        in_url = await gw.client.post("/v1/tasks/t/streams/output", json=body, params={"token": API_KEY})
        error(in_url, 401, "unauthorized")
        # Reads: the subscribe token, a tag token of the task's tag, the API key; not the callback token.
        for route in ("/v1/tasks/t/streams", "/v1/tasks/t/streams/output", "/v1/tasks/t/streams/output/text"):
            for token in (made.subscribe_token, mint_tag("owner:u1"), API_KEY):
                assert (await gw.client.get(route, headers=bearer(token))).status_code == 200, (route, token)
            error(await gw.client.get(route, headers=bearer(made.callback_token)), 403, "forbidden")
            error(await gw.client.get(route, headers=bearer(mint_tag("owner:u2"))), 403, "forbidden")
            error(await gw.client.get(route), 401, "unauthorized")
        error(await gw.client.get("/v1/tasks/nope/streams", headers=key), 404, "unknown-task")
        error(
            await gw.client.get("/v1/tasks/nope/streams", headers=bearer(mint_tag("owner:u1"))),
            403,
            "forbidden",
        )


async def test_a_tasks_streams_are_deleted_with_it_by_retention(database_url: str) -> None:
    clock = FakeClock()
    async with running_gateway(database_url, clock=clock, retain_finished_s=60) as gw:
        cb, _ = await started(gw, "gone")
        appended(await append(gw, "gone", cb, 1, 0, "old output"))
        await post_callback(gw, "gone", cb, SUCCEED, attempt=1)
        await drain_all(gw, 1)
        clock.advance(61_000)
        await eventually(
            lambda: gw.client.get("/v1/tasks/gone/streams"), lambda a: a.status_code == 404, "gone"
        )
        error(await gw.client.get("/v1/tasks/gone/streams/output/text"), 404, "unknown-task")
        # The id made again is another task, whose streams are its own.
        cb, _ = await started(gw, "gone")
        assert (await gw.client.get("/v1/tasks/gone/streams")).json()["streams"] == []
        assert appended(await append(gw, "gone", cb, 1, 0, "new")) == (0, 1, False)
        assert (await gw.client.get("/v1/tasks/gone/streams/output/text")).text == "new"

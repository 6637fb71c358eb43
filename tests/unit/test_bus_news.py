"""A bus message heard by the hub: its task is made only where a subscriber needs it.

Every process of a deployment hears every message on a shared bus (PostgreSQL, Redis): its own commits
again, and the other processes' commits, most of them of tasks it has no subscriber of. ``News.decode``
leaves the task as the message's JSON and ``News.read`` makes it; the hub reads only the messages that
bring an entry to a subscription of its own. A message whose task cannot be read is a wake-up: the entry
is read from the store.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

import gateway.bus.base as bus_base
from gateway.bus.base import News
from gateway.live.feed import Feed
from gateway.live.hub import Hub
from gateway.machine import task_from_json
from tests.unit.fake_book import FakeBook
from tests.unit.fanout_play import check_stream, news
from tests.unit.test_hub import running, take

pytestmark = pytest.mark.anyio


def heard(committed: Any) -> News:
    """The message as a listener hears it: encoded by the committing process, decoded here."""
    return News.decode(news(committed).encode())


class Counting:
    """``task_from_json``, counted."""

    def __init__(self) -> None:
        self.calls = 0
        self.real = task_from_json

    def __call__(self, body: Any) -> Any:
        self.calls += 1
        return self.real(body)


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> Counting:
    counting = Counting()
    monkeypatch.setattr(bus_base, "task_from_json", counting)
    return counting


def test_a_decoded_message_makes_its_task_when_read() -> None:
    book = FakeBook()
    book.create("t")
    committed = book.commit("t")
    message = heard(committed)
    assert message.task is None and message.frame is not None
    assert message.frame.text == news(committed).frame.text  # type: ignore[union-attr]
    read = message.read()
    assert read.task == committed.task and read.frame == message.frame and read == news(committed)
    assert news(committed).read() == news(committed)  # published in process: nothing to make


async def test_the_hub_makes_the_task_only_of_news_a_subscriber_here_needs(made: Counting) -> None:
    book = FakeBook()
    for task_id in ("t", "u"):
        book.create(task_id)
    async with running(Hub(book)) as hub:
        feed = Feed(hub, book)
        await feed.subscribe("t", 0)
        stream = [frame for _, frame in await take(feed)]
        first = book.commit("t")
        hub.receive(news(first))  # this process's commit, published in process
        hub.receive(heard(first))  # ... and heard again on the bus
        hub.receive(heard(book.commit("u")))  # another task's, no subscriber here
        assert made.calls == 0
        second = book.commit("t")  # another process's commit: the subscriber needs it
        hub.receive(heard(second))
        stream += [frame for _, frame in await take(feed, 2)]
        assert made.calls == 1
    assert check_stream(book, "t", 0, stream) == 2
    assert [c for c in book.calls if c[0] == "entries"] == []  # all from the bus, none read


async def test_a_message_whose_task_cannot_be_read_wakes_the_store_read() -> None:
    book = FakeBook()
    book.create("t")
    async with running(Hub(book)) as hub:
        feed = Feed(hub, book)
        await feed.subscribe("t", 0)
        stream = [frame for _, frame in await take(feed)]
        committed = book.commit("t")
        message = heard(committed)
        broken = News(message.task_id, message.version, None, message.frame, False, {"id": "t"})
        assert broken.read() == News("t", committed.task.version)  # a bare wake-up
        hub.receive(broken)
        stream += [frame for _, frame in await take(feed)]
    assert check_stream(book, "t", 0, stream) == 1
    assert [c[:3] for c in book.calls if c[0] == "entries"] == [("entries", "t", 0)]


def test_news_of_an_append_carries_its_chunks_or_only_its_next_offset_where_they_do_not_fit() -> None:
    small = News.appended("t", "output", 2, 5, 2, b'["a","\\u00e9"]')
    heard = News.decode(small.encode())
    assert heard.run is not None and heard.version == -1 and heard.task_id == "t"
    assert (heard.run.stream, heard.run.attempt, heard.run.offset, heard.run.next_offset) == (
        "output",
        2,
        5,
        7,
    )
    assert small.run is not None and heard.run.items() == small.run.items() == ["a", "é"]
    chunks = ["x" * 1000] * 9  # past a NOTIFY's payload: the subscribers read them from the store
    large = News.decode(News.appended("t", "log", 1, 0, 9, orjson.dumps(chunks)).encode())
    assert large.run is not None and large.run.items() is None and large.run.next_offset == 9
    assert News.decode(heard.encode()) == heard  # decoded, encoded again (the twin's way)
    for bad in (
        '{"type":"chunks","taskId":"t","stream":"output","attempt":1,"offset":0,"nextOffset":2,"chunks":["a"]}',
        '{"type":"chunks","taskId":"t","stream":"output","attempt":1,"offset":0,"nextOffset":1,"chunks":[1]}',
        '{"type":"chunks","taskId":"t","stream":"output","attempt":true,"offset":0,"nextOffset":1}',
        '{"type":"chunks","taskId":1,"stream":"output","attempt":1,"offset":0,"nextOffset":1}',
        '{"type":"chunks","taskId":"t","stream":"output","offset":0,"nextOffset":1}',
    ):
        with pytest.raises(ValueError):
            News.decode(bad)

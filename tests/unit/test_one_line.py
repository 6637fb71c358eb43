"""What the gateway's warnings say of an exception (``gateway.errors.one_line``): one line, never empty."""

from __future__ import annotations

import sqlite3

from sqlalchemy.exc import OperationalError

from gateway.errors import one_line


def test_an_exception_that_says_nothing_is_named_by_its_type() -> None:
    # A deadline's TimeoutError: "database unavailable: " with nothing after it said nothing.
    assert one_line(TimeoutError()) == "TimeoutError"
    assert one_line(ConnectionError("  ")) == "ConnectionError"


def test_a_wrapped_driver_error_is_the_driver_s_words_without_the_sql() -> None:
    statement = "SELECT tasks.id,\n       tasks.version\nFROM tasks\nWHERE tasks.id = ?"
    wrapped = OperationalError(statement, ("t",), sqlite3.OperationalError("database or disk is full"))
    assert "\n" in str(wrapped) and "SELECT" in str(wrapped)
    assert one_line(wrapped) == "database or disk is full"


def test_a_message_over_several_lines_is_one() -> None:
    assert one_line(RuntimeError("could not\n   connect\tto server")) == "could not connect to server"
    assert one_line(OSError(111, "Connection refused")) == "[Errno 111] Connection refused"

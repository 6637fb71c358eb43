"""A database operation run to its end within a deadline, whatever cancels its caller: what the book's and
the tag reads' methods are wrapped in (:func:`shielded`)."""

from __future__ import annotations

import functools
import math
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import anyio

# The longest a database operation may take before it is abandoned (answered as 503 unavailable), by
# default (GATEWAY_DB_DEADLINE_MS: ``Book.deadline_s``).
DB_DEADLINE_S = 10.0


class Deadlined(Protocol):
    # The longest one database operation may take (GATEWAY_DB_DEADLINE_MS), then TimeoutError (a 503).
    deadline_s: float


D = TypeVar("D", bound=Deadlined)
P = ParamSpec("P")
R = TypeVar("R")


def shielded(
    method: Callable[Concatenate[D, P], Awaitable[R]],
) -> Callable[Concatenate[D, P], Coroutine[Any, Any, R]]:
    """Run a database operation to its end even when its caller is cancelled (a client gone, a shutdown):
    a transaction is not left half-done, and a connection is never torn down mid-query (which hangs
    aiosqlite's worker). Bounded by its owner's ``deadline_s``, or by the caller's own deadline where that
    is sooner (the committer's: a batch is answered by its earliest callback's): past it, ``TimeoutError``
    (a 503). The store ends its transaction by then, commit and rollback included (``pg_writer``)."""

    @functools.wraps(method)
    async def run(owner: D, /, *args: P.args, **kwargs: P.kwargs) -> R:
        caller = anyio.current_effective_deadline()  # -inf once the caller is cancelled: not a deadline
        within_s = (
            owner.deadline_s if caller == -math.inf else min(owner.deadline_s, caller - anyio.current_time())
        )
        with anyio.fail_after(within_s, shield=True):
            return await method(owner, *args, **kwargs)

    return run

"""The operators' task list, ``GET /v1/tasks`` (docs/protocol.md, List): its query, validated, its opaque
page cursor and its pages.

Without ``tag=`` the tasks come in id order, and a cursor is the id a page starts after. With ``tag=`` or
``order=newest`` they come newest first (``createdAtMs`` descending, then id descending), and a cursor is
the creation time and id a page starts after. Either way a cursor is one shape (the schema's pattern) and
every string of that shape is taken: it is a place in the list's order, wherever it came from (see
:meth:`TaskListQuery.before` for a place the newest-first order cannot read).
"""

from __future__ import annotations

import base64
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError
from starlette.datastructures import QueryParams

from gateway.errors import InvalidRequest
from gateway.machine import Task, task_to_json
from gateway.web.auth import LIST_CREDENTIAL
from gateway.web.tags import WantedTags
from gateway.web.wire import MAX_SAFE, State, _validate

MAX_PAGE = 500
_PAGE_CURSOR_PREFIX = "1:"
# The shape of every cursor page_cursor makes: base64url (unpadded) of "1:" and a place, whose first three
# characters are always "MT" and one of o-r. The schema states it, and every string of this shape is taken.
PAGE_CURSOR_PATTERN = "^MT[o-r][A-Za-z0-9_-]*$"
_PAGE_CURSOR = re.compile(PAGE_CURSOR_PATTERN)
# A place in the newest-first order: "<createdAtMs>:<id>".
_NEWEST_PLACE = re.compile("([0-9]{1,16}):(.*)", re.DOTALL)
# Where a cursor that names no place in the newest-first order starts: after every task (an empty page).
_PAST_EVERY_TASK = (-1, "")


def page_cursor(place: str) -> str:
    """An opaque cursor for the page after ``place`` (clients must not build or read it)."""
    return base64.urlsafe_b64encode((_PAGE_CURSOR_PREFIX + place).encode()).decode().rstrip("=")


def _place(cursor: str) -> str:
    """The place a page starts after. A cursor of the right shape that page_cursor did not make (forged or
    mangled) is still a place: its bytes are read as UTF-8 with U+FFFD for what is not, NUL included (which
    no database text holds), and a dangling last character (no whole byte) is dropped."""
    if not _PAGE_CURSOR.fullmatch(cursor):
        raise PydanticCustomError("page_cursor", "not a cursor from this list; pass nextCursor as it came")
    body = cursor[: len(cursor) - 1] if len(cursor) % 4 == 1 else cursor
    raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    return raw[len(_PAGE_CURSOR_PREFIX) :].decode(errors="replace").replace("\x00", "\ufffd")


class TaskListQuery(BaseModel):
    """The query of ``GET /v1/tasks``: query strings are text, so numbers are read from their digits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    state: State | None = Field(default=None, description="only tasks in this state")
    tag: WantedTags | None = Field(
        default=None,
        description="only tasks carrying this tag; repeated, only tasks carrying every one. With it the "
        "list is newest first (createdAtMs, then id, descending)",
    )
    order: Literal["newest"] | None = Field(
        default=None,
        description="newest: newest first (createdAtMs, then id, descending), as a list by tag always is; "
        "absent: id order (by tag: newest first)",
    )
    parent: Annotated[str, Field(max_length=128)] | None = Field(
        default=None,
        description="only the children of this task (protocol.md, Batches). With it the list is newest first",
    )
    title: Annotated[str, Field(max_length=200)] | None = Field(
        default=None,
        description="only tasks whose title contains this text, letters' case aside. With it the list is "
        "newest first",
    )
    cursor: (
        Annotated[str, Field(max_length=1024, json_schema_extra={"pattern": PAGE_CURSOR_PATTERN})] | None
    ) = Field(
        default=None, description="the nextCursor of the page before (opaque); absent for the first page"
    )
    limit: Annotated[int, Field(ge=1, le=MAX_PAGE)] = Field(default=50, description="tasks per page")

    @property
    def newest_first(self) -> bool:
        """Whether the list is newest first: by tag, parent or title, or asked for."""
        return self.tag is not None or self.order == "newest" or self.parent is not None or bool(self.title)

    def after(self) -> str | None:
        """Id order: the id the page starts after, from the cursor."""
        return None if self.cursor is None else _place(self.cursor)

    def before(self) -> tuple[int, str] | None:
        """Newest first: the (creation time, id) the page starts after, from the cursor. A cursor of the
        id order names no place here: the list ends (an empty page)."""
        if self.cursor is None:
            return None
        place = _NEWEST_PLACE.fullmatch(_place(self.cursor))
        if place is None:
            return _PAST_EVERY_TASK
        return min(int(place[1]), MAX_SAFE), place[2]


def parse_task_list_query(params: QueryParams) -> TaskListQuery:
    """The query; ``tag`` may be repeated (every one must match), any other parameter is read once."""
    if "token" in params:  # open mode (with an API key the guard has answered 401 already)
        raise InvalidRequest(f"token: not a query parameter of this route; {LIST_CREDENTIAL}")
    data: dict[str, Any] = dict(params)
    if "tag" in params:
        data["tag"] = params.getlist("tag")
    query = _validate(TaskListQuery, data)
    try:
        query.after()
    except PydanticCustomError as exc:
        raise InvalidRequest(f"cursor: {exc.message()}") from None
    return query


def task_page_json(tasks: list[Task], limit: int, *, newest_first: bool = False) -> dict[str, Any]:
    """A page of at most ``limit`` tasks from ``tasks`` (fetched with one more, to know if more follow)."""
    page = tasks[:limit]
    next_cursor = None
    if len(tasks) > limit and page:
        last = page[-1]
        next_cursor = page_cursor(f"{last.created_at_ms}:{last.id}" if newest_first else last.id)
    return {"tasks": [task_to_json(t) for t in page], "nextCursor": next_cursor}

"""The documentation a user gets with the repository: docs/protocol.md names every reason the code can
answer, every error code and close code, and every route; the README links the docs in the repository and
points to nothing outside it; the OpenAPI document's reasons and codes are the code's."""

from __future__ import annotations

import ast
import inspect
import re
import typing
from pathlib import Path

from starlette.routing import Mount, Route, WebSocketRoute

from gateway import errors
from gateway.settings import Settings
from gateway.web import answers
from gateway.web.app import create_app

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gateway"
PROTOCOL = (ROOT / "docs" / "protocol.md").read_text()
README = (ROOT / "README.md").read_text()


def _strings_in_calls(path: Path, functions: set[str], position: int | None = None) -> set[str]:
    """String constants passed to calls of ``functions`` (at argument ``position``, or anywhere in them)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
        if name not in functions:
            continue
        args = node.args if position is None else node.args[position : position + 1]
        for arg in args:
            for inner in ast.walk(arg):
                if isinstance(inner, ast.Constant) and isinstance(inner.value, str):
                    found.add(inner.value)
    return found


def machine_reasons() -> set[str]:
    """Every reason the state machine and the book can answer a callback with."""
    machine = ROOT / "gateway" / "machine.py"
    reasons = _strings_in_calls(machine, {"_unchanged"}) | _strings_in_calls(machine, {"_advance"}, 2)
    reasons |= _strings_in_calls(ROOT / "gateway" / "book" / "book.py", {"Transition"})
    return reasons


def error_codes() -> set[str]:
    codes = {
        cls.default_code
        for cls in vars(errors).values()
        if isinstance(cls, type) and issubclass(cls, errors.GatewayError) and cls is not errors.Conflict
    }
    web = sorted((ROOT / "gateway" / "web").glob("*.py"))
    streams = ROOT / "gateway" / "streams.py"
    book = sorted((ROOT / "gateway" / "book").glob("*.py"))
    for path in [*book, ROOT / "gateway" / "lease.py", streams, *web]:
        codes |= _strings_in_calls(path, {"Conflict"}, 0)
    # An error of another class under a code of its own (413 stream-full, 413 metadata-too-large).
    for path in (streams, ROOT / "gateway" / "metadata.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.keyword) and node.arg == "code" and isinstance(node.value, ast.Constant):
                codes.add(str(node.value.value))
    return codes


def documented(name: str) -> bool:
    return f"`{name}`" in PROTOCOL or f'"{name}"' in PROTOCOL


def test_every_reason_the_code_can_answer_is_documented_and_in_the_openapi_schema() -> None:
    reasons = machine_reasons()
    # The scan finds what it should (a broken scan would make the checks below vacuous).
    assert {"started", "terminal-conflict", "not-startable", "duplicate-callback"} <= reasons
    assert [r for r in sorted(reasons) if not documented(r)] == []
    # A callback answers every reason but the cancel's own; a cancel answers its own or a callback's.
    cancel_only = set(typing.get_args(answers.CancelReason)) - set(typing.get_args(answers.Reason))
    assert cancel_only == {"cancelled"}
    assert set(typing.get_args(answers.Reason)) | cancel_only == reasons
    for delivery in ("delivered", "duplicate-delivery"):
        assert documented(delivery)


def test_every_error_code_and_close_code_is_documented() -> None:
    codes = error_codes()
    assert {
        "task-exists",
        "stale-attempt",
        "callback-id-reused",
        "unavailable",
        "seq-gap",
        "stream-full",
        "parent-ended",
        "metadata-too-large",
    } <= codes
    assert [c for c in sorted(codes) if not documented(c)] == []
    assert set(typing.get_args(answers.ErrorCode)) == codes
    closes = {v for k, v in vars(errors).items() if k.startswith("CLOSE_")}
    closes |= {
        cls.close_code
        for cls in vars(errors).values()
        if isinstance(cls, type) and issubclass(cls, errors.GatewayError) and cls.status != 409
    }
    closes -= {1009}  # payload-too-large: a message over the server's limit, closed by the server itself
    assert [c for c in sorted(closes) if f"`{c}`" not in PROTOCOL] == []


def test_every_route_is_documented() -> None:
    app = create_app(Settings(database_url="sqlite:///unused.db", secret="x" * 32))
    for route in app.routes:
        if isinstance(route, Mount) or (isinstance(route, Route) and route.path == "/"):
            continue
        assert isinstance(route, Route | WebSocketRoute)
        assert f"{route.path}" in PROTOCOL, route.path


def test_the_readme_is_the_map_of_every_page_and_nothing_points_outside_the_repository() -> None:
    """The README links every page of docs/; no page names a path outside the checkout."""
    for doc in sorted((ROOT / "docs").glob("*.md")):
        assert f"](docs/{doc.name})" in README, doc.name
    for text_path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *_example_readmes()]:
        text = text_path.read_text()
        assert not re.search(r"shared/|/work/|reference design", text), text_path
    # gateway watch's environment is documented.
    walkthrough = (ROOT / "docs" / "walkthrough.md").read_text()
    assert "GATEWAY_URL" in walkthrough and "GATEWAY_TOKEN" in walkthrough


def test_the_code_and_the_pages_point_to_rules_a_reader_can_open() -> None:
    """The rules the task machine follows are protocol.md's (The task's life, Resuming, Notifications): no
    module of the gateway or of its tests, page of docs/ or README calls them "the reference", which is not
    in the repository."""
    texts = [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted(PACKAGE.rglob("*.py")),
        *sorted((ROOT / "tests").rglob("*.py")),
    ]
    texts.remove(Path(__file__).resolve())  # this test names the words it keeps out
    naming = [str(p.relative_to(ROOT)) for p in texts if re.search(r"\bthe reference\b", p.read_text(), re.I)]
    assert naming == []


def _example_readmes() -> list[Path]:
    return sorted((ROOT / "examples").glob("*/README.md"))


def test_the_relative_links_of_the_readme_docs_and_examples_lead_to_files_of_the_checkout() -> None:
    """A link such as ``[the example](../examples/celery/README.md)`` or ``(protocol.md#tag-subscriptions)``
    names a file that is there (its anchor aside), and never one outside the checkout."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *_example_readmes()]
    assert ROOT / "examples" / "celery" / "README.md" in pages
    checked = 0
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a web address, or an anchor of the page itself
            path = (page.parent / target.split("#", 1)[0]).resolve()
            assert path.is_relative_to(ROOT) and path.exists(), (page.name, target)
            checked += 1
    assert checked > 10


def test_every_setting_has_a_row_with_its_default() -> None:
    """Each limit (and every other setting) is "a setting with a safe default ... and a README line"
    (issue 9): a row of the settings table (docs/configuration.md, which the README links), whose default
    is the one the code uses."""
    from gateway.settings import _ENV

    table = (ROOT / "docs" / "configuration.md").read_text()
    rows = dict(re.findall(r"^\| `(GATEWAY_\w+)` \| (.+?) \|", table, re.MULTILINE))
    missing = [name for name in _ENV.values() if name not in rows]
    assert missing == [], f"no row in the settings table of docs/configuration.md: {missing}"
    for field, name in _ENV.items():
        default = Settings.model_fields[field].default
        if isinstance(default, bool) or default is None or default == ():
            continue  # said in words (none, open mode, kept in a file)
        shown = f"{default:g}" if isinstance(default, float) else str(default)
        assert rows[name] == f"`{shown}`", (name, rows[name], default)


def test_each_migrations_docstring_names_its_own_revision_and_the_one_it_revises() -> None:
    """Alembic reads ``revision`` and ``down_revision``; a reader reads the docstring. Revisions renumbered
    when parts merge must keep the two the same."""
    versions = sorted((ROOT / "gateway" / "store" / "migrations" / "versions").glob("[0-9]*.py"))
    assert versions
    for path in versions:
        module = ast.parse(path.read_text())
        said = ast.get_docstring(module) or ""
        values = {
            node.target.id: ast.literal_eval(node.value)
            for node in module.body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value
        }
        assert f"Revision ID: {values['revision']}\n" in said + "\n", path.name
        assert re.search(rf"^Revises: ?{values['down_revision'] or ''}$", said, re.MULTILINE), path.name
        assert path.name.startswith(f"{values['revision']}_"), path.name


def test_the_integrations_settings_table_is_every_queues_install_options_with_their_defaults() -> None:
    """docs/integrations.md promises one set of options for every queue: the table's rows are the keyword
    options of Celery's, RQ's and Dramatiq's ``install`` and arq's ``configure`` (its ``install`` passes them
    on), each with the default the code has."""
    from gateway.integrations import arq, celery, dramatiq, rq
    from gateway.integrations.ticket import DEFAULT_TTL_MS

    doc = (ROOT / "docs" / "integrations.md").read_text()
    section = doc.split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| `(\w+)` \| (.+?) \|", section, re.MULTILINE))
    assert {"url", "api_key", "timeout"} <= set(rows)
    for function in (celery.install, rq.install, arq.configure, dramatiq.install):
        options = {
            name: parameter.default
            for name, parameter in inspect.signature(function).parameters.items()
            if parameter.kind is inspect.Parameter.KEYWORD_ONLY
        }
        assert set(options) == set(rows), function.__module__
        for name, default in options.items():
            if default is inspect.Parameter.empty:
                assert rows[name] == "(required)", name
            elif name == "ttl":
                assert default is None and rows[name] == "a day" and DEFAULT_TTL_MS == 86_400_000
            else:
                assert rows[name] == f"`{default!r}`", (function.__module__, name, default)

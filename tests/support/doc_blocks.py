"""The code blocks of README.md and docs/*.md, as the tests that run them read them.

docs/development.md ("The code blocks of the documentation") states the convention for the docs' writers;
in short: ``sh``, ``python`` and ``sql`` blocks run (tests/integration/test_doc_blocks.py), page by page, in
the page's order; a ``python`` block whose first line is ``# NAME.py`` is that file; a block without a
language is text; any other block, and one that does not run as it stands, carries a mark in an HTML comment
on the line above its fence: ``not run: output``, ``not run: fragment``, ``run by PATH``, ``run in the
background`` (it must end by itself, with 0) or ``run in the background until stopped`` (a server or a
worker). Every address of a gateway in a block, ``localhost:8000`` or ``127.0.0.1:8000``, is the test's own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN_LANGUAGES = ("sh", "python", "sql")
OUTPUT, FRAGMENT, RUN_BY, BACKGROUND, UNTIL_STOPPED = (
    "output",
    "fragment",
    "run by",
    "background",
    "background until stopped",
)
_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<language>[^`\s]*)\s*$")
_CLOSE = re.compile(r"^\s*```\s*$")
_COMMENT = re.compile(r"^\s*<!--\s*(?P<words>(?:not run|run)\b.*?)\s*-->\s*$")
_MARKS = {
    "not run: output": OUTPUT,
    "not run: fragment": FRAGMENT,
    "run in the background": BACKGROUND,
    "run in the background until stopped": UNTIL_STOPPED,
}
_FILE = re.compile(r"^# (?P<name>[A-Za-z_][A-Za-z0-9_]*\.py)$")
_GATEWAY_ADDRESS = re.compile(r"\b(localhost|127\.0\.0\.1):8000\b")


def pages() -> list[str]:
    """README.md and every page of docs/, as paths from the checkout's root."""
    return ["README.md", *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").glob("*.md")))]


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # the opening fence's, from 1
    language: str
    text: str
    mark: str | None  # OUTPUT, FRAGMENT, RUN_BY, BACKGROUND, UNTIL_STOPPED or None
    runner: str | None = None  # the PATH of ``run by PATH``

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def file(self) -> str | None:
        """The file a ``python`` block is (``# jobs.py`` on its first line), else ``None``."""
        if self.language != "python":
            return None
        found = _FILE.match(self.text.split("\n", 1)[0])
        return found["name"] if found else None

    @property
    def runs_here(self) -> bool:
        """Run by tests/integration/test_doc_blocks.py (in the foreground, in the background, or written as
        the file it is)."""
        return self.language in RUN_LANGUAGES and self.mark in (None, BACKGROUND, UNTIL_STOPPED)


class BadMark(ValueError):
    """A comment above a fence that reads like a mark and is none of the marks."""


def blocks(page: str) -> list[Block]:
    """The fenced code blocks of ``page`` (a path from the checkout's root), indented ones (in a list)
    included, each with its indentation removed."""
    lines = (ROOT / page).read_text().split("\n")
    found: list[Block] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        end = i + 1
        while not _CLOSE.match(lines[end]):
            end += 1
        indent = len(fence["indent"])
        text = "\n".join(line[indent:] for line in lines[i + 1 : end])
        mark, runner = _mark(lines[i - 1] if i else "", f"{page}:{i + 1}")
        found.append(Block(page, i + 1, fence["language"], text, mark, runner))
        i = end + 1
    return found


def _mark(above: str, where: str) -> tuple[str | None, str | None]:
    comment = _COMMENT.match(above)
    if comment is None:
        return None, None
    words = " ".join(comment["words"].split())
    if words.startswith("run by "):
        return RUN_BY, words.removeprefix("run by ")
    if words in _MARKS:
        return _MARKS[words], None
    raise BadMark(f"{where}: {above.strip()!r} is not a mark (tests/support/doc_blocks.py lists them)")


def local(text: str, port: int) -> str:
    """``text`` with every address of a gateway on port 8000 turned to ``port``'s."""
    return _GATEWAY_ADDRESS.sub(lambda m: f"{m[1]}:{port}", text)

"""The queue extras install what the tests test (pyproject.toml): the ``test`` extra, which CI installs
afresh, installs the four queue extras themselves, so CI runs the newest each allows; each extra's range
holds what this environment runs, and is capped, so that a release CI has not run (rq 3.0 with redis-py
8.2, whose worker hangs on SIGTERM; Celery 5.7) is not what a user's ``pip install '.[rq]'`` takes."""

from __future__ import annotations

import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS: dict[str, list[Requirement]] = {
    extra: [Requirement(line) for line in lines] for extra, lines in PROJECT["optional-dependencies"].items()
}
QUEUES = ("celery", "rq", "arq", "dramatiq")
UPPER = ("<", "<=", "==", "~=")


def test_the_test_extra_installs_the_queue_extras_themselves() -> None:
    test = EXTRAS["test"]
    own = [req for req in test if canonicalize_name(req.name) == canonicalize_name(PROJECT["name"])]
    assert [sorted(req.extras) for req in own] == [sorted(QUEUES)]
    # No bound of its own on a queue's packages: the extras' are the ones CI installs.
    queued = {canonicalize_name(req.name) for queue in QUEUES for req in EXTRAS[queue]}
    assert [str(req) for req in test if canonicalize_name(req.name) in queued] == []


@pytest.mark.parametrize("queue", QUEUES)
def test_each_queue_extra_holds_what_the_tests_run_and_is_capped(queue: str) -> None:
    for req in EXTRAS[queue]:
        installed = version(req.name)
        held = req.specifier.contains(installed, prereleases=True)
        assert held, f"[{queue}] {req}: the tests run {installed}"
        assert any(spec.operator in UPPER for spec in req.specifier), f"[{queue}] {req}: no upper bound"


def test_a_package_two_extras_name_has_one_range() -> None:
    ranges: dict[str, set[str]] = {}
    for queue in QUEUES:
        for req in EXTRAS[queue]:
            ranges.setdefault(canonicalize_name(req.name), set()).add(str(req.specifier))
    assert {name: found for name, found in ranges.items() if len(found) > 1} == {}

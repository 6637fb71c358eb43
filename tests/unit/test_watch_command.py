"""``gateway watch`` takes a task id or ``--tag``, one of them, and says so before it connects anywhere."""

from __future__ import annotations

import pytest

from gateway.cli import main


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["watch"], "give a task id or --tag TAG (one of them)"),
        (["watch", "report-42", "--tag", "owner:u42"], "give a task id or --tag TAG (one of them)"),
        (["watch", "--tag", "owner:u42", "--cursor", "3"], "--cursor is for one task"),
    ],
)
def test_a_task_id_or_a_tag_one_of_them(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as ended:
        main(argv)
    assert ended.value.code == 2
    assert words in capsys.readouterr().err


def test_gateway_watch_says_a_title_a_status_line_and_a_batchs_counts_when_they_change() -> None:
    from gateway.client.terminal import _Line

    line = _Line()
    task = {"title": "Monthly export", "metadata": {"message": "Sheet 1"}, "revision": 1}
    assert line.task("t1", task) == ["Monthly export  (t1)", "  Sheet 1"]
    assert line.task("t1", task) == []  # nothing changed: nothing said
    assert line.live({"type": "metadata", "metadata": {"message": "Sheet 2", "rows": 3}}) == ["  Sheet 2"]
    assert line.live({"type": "metadata", "metadata": {"rows": 4}}) == []  # no status line: none said
    counts = {"total": 3, "queued": 1, "running": 1, "succeeded": 1, "failed": 0, "expired": 0}
    said = line.live({"type": "children", "children": counts})
    assert said == ["  children: 3 (1 queued, 1 running, 1 succeeded, 0 failed, 0 expired)"]
    assert line.task("t1", {"children": counts}) == [] and line.name == "Monthly export"
    # A task older than what was printed (an event frame behind a metadata frame) changes nothing.
    assert line.live({"type": "metadata", "revision": 5, "metadata": {"message": "Sheet 5"}}) == ["  Sheet 5"]
    assert line.task("t1", {"revision": 4, "metadata": {"message": "Sheet 4"}}) == []
    assert line.live({"type": "metadata", "revision": 3, "metadata": {"message": "Sheet 3"}}) == []

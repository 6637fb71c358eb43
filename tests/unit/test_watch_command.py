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

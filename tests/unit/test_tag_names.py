"""What a tag may be (``gateway.tag_names``): the check and the pattern the OpenAPI document states agree,
and a refusal says what is wrong in the protocol's words, naming the field."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from gateway.errors import InvalidRequest
from gateway.tag_names import MAX_TAG_LENGTH, MAX_TAGS, TAG_PATTERN, check_tag, tag_problem, tags_problem
from gateway.web.tags import TaskTags

TAG_CHARS = "ABCXYZabcxyz0189:._@-"


@given(st.text(alphabet=st.sampled_from(TAG_CHARS), min_size=1, max_size=MAX_TAG_LENGTH))
def test_every_string_of_the_alphabet_up_to_128_characters_is_a_tag(tag: str) -> None:
    assert check_tag(tag) == tag
    assert re.fullmatch(TAG_PATTERN, tag)


@given(st.text(max_size=MAX_TAG_LENGTH + 2) | st.text(alphabet=TAG_CHARS + " \n/é", max_size=140))
def test_the_check_and_the_documented_pattern_agree(value: str) -> None:
    assert (tag_problem(value) is None) == (re.fullmatch(TAG_PATTERN, value) is not None)


RULE = "a tag is 1 to 128 characters of A-Z, a-z, 0-9 and : . _ @ -"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", f"tag: '' is not a tag: {RULE}"),
        ("a" * 129, f"tag: '{'a' * 40}...' is not a tag: {RULE}"),
        ("owner u42", f"tag: 'owner u42' is not a tag: {RULE}"),
        ("owner:u42\n", f"tag: 'owner:u42\\n' is not a tag: {RULE}"),
        ("café", f"tag: 'café' is not a tag: {RULE}"),
        ("a/b", f"tag: 'a/b' is not a tag: {RULE}"),
        (42, "tag: a tag must be a string"),
        (None, "tag: a tag must be a string"),
    ],
)
def test_a_bad_tag_is_refused_naming_the_field(value: object, message: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        check_tag(value)
    assert refused.value.message == message
    assert refused.value.code == "invalid-request"
    assert check_tag("owner:u42", "tags[0]") == "owner:u42"
    with pytest.raises(InvalidRequest, match=r"^tags\[3\]: "):
        check_tag(value, "tags[3]")


def test_a_tasks_tags_are_sorted_at_most_16_none_twice() -> None:
    # The create's wire type (gateway.web.tags.TaskTags) takes the rule from tags_problem, and sorts.
    adapter: TypeAdapter[tuple[str, ...]] = TypeAdapter(TaskTags)
    assert adapter.validate_python(["project:7", "owner:u42"]) == ("owner:u42", "project:7")
    assert adapter.validate_python([]) == ()
    assert len(adapter.validate_python([f"t{i:02}" for i in range(MAX_TAGS)])) == MAX_TAGS
    assert tags_problem([f"t{i:02}" for i in range(MAX_TAGS + 1)]) == "at most 16 tags per task, got 17"
    assert tags_problem(["a", "b", "a"]) == "'a' is given more than once (each tag once)"
    assert (tags_problem(["a", ""]) or "").startswith("'' is not a tag")
    assert tags_problem(["a", 7]) == "a tag must be a string"
    with pytest.raises(ValidationError, match="at most 16 tags per task, got 17"):
        adapter.validate_python([f"t{i:02}" for i in range(MAX_TAGS + 1)])

"""What a tag may be (``gateway.tag_names``): the check and the pattern the OpenAPI document states agree,
and a refusal says what is wrong in the protocol's words, naming the field."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.errors import InvalidRequest
from gateway.tag_names import MAX_TAG_LENGTH, MAX_TAGS, TAG_PATTERN, check_tag, check_tags, tag_problem

TAG_CHARS = "ABCXYZabcxyz0189:._@-"


@given(st.text(alphabet=st.sampled_from(TAG_CHARS), min_size=1, max_size=MAX_TAG_LENGTH))
def test_every_string_of_the_alphabet_up_to_128_characters_is_a_tag(tag: str) -> None:
    assert check_tag(tag) == tag
    assert re.fullmatch(TAG_PATTERN, tag)


@given(st.text(max_size=MAX_TAG_LENGTH + 2) | st.text(alphabet=TAG_CHARS + " \n/é", max_size=140))
def test_the_check_and_the_documented_pattern_agree(value: str) -> None:
    assert (tag_problem(value) is None) == (re.fullmatch(TAG_PATTERN, value) is not None)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("", "tag: must not be empty"),
        ("a" * 129, "tag: at most 128 characters, got 129"),
        ("owner u42", "tag: only A-Z, a-z, 0-9 and : . _ @ - may be in a tag, not ' '"),
        ("owner:u42\n", "tag: only A-Z, a-z, 0-9 and : . _ @ - may be in a tag, not '\\n'"),
        ("café", "tag: only A-Z, a-z, 0-9 and : . _ @ - may be in a tag, not 'é'"),
        ("a/b", "tag: only A-Z, a-z, 0-9 and : . _ @ - may be in a tag, not '/'"),
        (42, "tag: must be a string"),
        (None, "tag: must be a string"),
    ],
)
def test_a_bad_tag_is_refused_naming_the_field(value: object, message: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        check_tag(value)
    assert refused.value.message == message
    assert refused.value.code == "invalid-request"


def test_a_tasks_tags_are_sorted_at_most_16_none_twice() -> None:
    assert check_tags(["project:7", "owner:u42"]) == ("owner:u42", "project:7")
    assert check_tags([]) == ()
    assert len(check_tags([f"t{i:02}" for i in range(MAX_TAGS)])) == MAX_TAGS
    with pytest.raises(InvalidRequest, match=r"^tags: at most 16 tags, got 17$"):
        check_tags([f"t{i:02}" for i in range(MAX_TAGS + 1)])
    with pytest.raises(InvalidRequest, match=r"^tags\[2\]: 'a' is given more than once$"):
        check_tags(["a", "b", "a"])
    with pytest.raises(InvalidRequest, match=r"^tags\[1\]: must not be empty$"):
        check_tags(["a", ""])

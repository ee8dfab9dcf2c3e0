"""The token file: one ``ROLE TOKEN`` a line, comments only where they cannot be a token's."""

import pytest

from millpond.errors import InvalidConfigError
from millpond.service.auth import load_tokens


def test_a_hash_inside_a_token_belongs_to_the_token(tmp_path) -> None:
    path = tmp_path / "tokens"
    path.write_text(
        "# roles and tokens\n"
        "admin s3cr3tpa#ssw0rd-long-secret\n"
        "writer writer-token-1   # the actors' token\n"
        "   # an indented comment\n"
        "learner learner#token#2\n"
    )
    assert load_tokens(path) == [
        ("admin", "s3cr3tpa#ssw0rd-long-secret"),
        ("writer", "writer-token-1"),
        ("learner", "learner#token#2"),
    ]


def test_a_token_that_would_start_a_comment_is_refused(tmp_path) -> None:
    path = tmp_path / "tokens"
    path.write_text("admin #not-a-token-but-a-comment\n")
    with pytest.raises(InvalidConfigError, match=r"tokens:1: expected 'ROLE TOKEN'"):
        load_tokens(path)

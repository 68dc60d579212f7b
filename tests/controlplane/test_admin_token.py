"""The admin token comes from the environment or a secret file, and weak ones are refused."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from controlplane.admin_token import AdminTokenSource, check_admin_token

GOOD = secrets.token_urlsafe(32)


@pytest.mark.parametrize(
    ("token", "problem"),
    [
        ("replace-with-a-secret", "placeholder"),
        ("change-me-local-admin", "placeholder"),
        ("CHANGEME" + GOOD, "placeholder"),
        ("admin-token-for-tests", "fewer than 32"),
        ("demo-admin-token", "fewer than 32"),
        ("a" * 64, "repeated pattern"),
        ("abcabcabcabcabcabcabcabcabcabcabcabc", "repeated pattern"),
    ],
)
def test_weak_tokens_are_refused_naming_the_problem_not_the_token(token, problem):
    with pytest.raises(ValueError, match=problem) as raised:
        check_admin_token(token, "$VTOKEN_ADMIN_TOKEN")
    assert token not in str(raised.value)
    assert "$VTOKEN_ADMIN_TOKEN" in str(raised.value)


def test_the_token_is_read_from_the_environment():
    source = AdminTokenSource()
    assert source.read({"VTOKEN_ADMIN_TOKEN": f" {GOOD}\n"}) == GOOD
    assert AdminTokenSource(admin_token_env="MY_TOKEN").read({"MY_TOKEN": GOOD}) == GOOD
    with pytest.raises(ValueError, match=r"no admin token: set \$VTOKEN_ADMIN_TOKEN"):
        source.read({})


def test_a_secret_file_wins_over_the_environment(tmp_path: Path):
    path = tmp_path / "admin-token"
    path.write_text(GOOD + "\n")
    source = AdminTokenSource(admin_token_file=path)
    assert source.read({"VTOKEN_ADMIN_TOKEN": secrets.token_urlsafe(32)}) == GOOD
    path.write_text("changeme")
    with pytest.raises(ValueError, match="admin_token_file .* placeholder"):
        source.read({})
    with pytest.raises(ValueError, match="cannot read admin_token_file"):
        AdminTokenSource(admin_token_file=tmp_path / "missing").read({})

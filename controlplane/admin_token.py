"""The admin token: read from an environment variable or a secret file, never from a config
literal, and refused when it is a placeholder or too short to resist guessing.

Contract: :meth:`AdminTokenSource.read` returns a token that passed :func:`check_admin_token`
or raises ``ValueError`` with a message naming where the token was looked for (never the
token itself).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

MIN_ADMIN_TOKEN_CHARS = 32
# A token of fewer distinct characters is a pattern ("aaaa...", "abcabc..."), not a secret;
# secrets.token_urlsafe(32) (43 characters) has ~30 distinct ones.
MIN_DISTINCT_CHARS = 10
DEFAULT_ENV = "VTOKEN_ADMIN_TOKEN"
# Words that mark a value copied from an example; compared with letters and digits only.
PLACEHOLDER_WORDS = (
    "replace",
    "changeme",
    "placeholder",
    "yoursecret",
    "yourtoken",
    "example",
    "insecure",
    "password",
    "todo",
    "xxxx",
)


def check_admin_token(token: str, origin: str) -> str:
    """``token`` stripped of surrounding whitespace, when it may guard the admin API;
    ``ValueError`` naming ``origin`` otherwise (placeholder, short, or a repeated pattern)."""
    token = token.strip()
    folded = re.sub(r"[^a-z0-9]", "", token.lower())
    if any(word in folded for word in PLACEHOLDER_WORDS):
        raise ValueError(f"the admin token from {origin} is a placeholder: set a random secret")
    if len(token) < MIN_ADMIN_TOKEN_CHARS:
        raise ValueError(
            f"the admin token from {origin} has {len(token)} characters, fewer than "
            f"{MIN_ADMIN_TOKEN_CHARS}: use e.g. `python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))'`"
        )
    if len(set(token)) < MIN_DISTINCT_CHARS:
        raise ValueError(f"the admin token from {origin} is a repeated pattern, not a secret")
    return token


class AdminTokenSource(BaseModel):
    """Where the admin token is read at start (fields of the Serve config's ``args``):
    ``admin_token_file`` when set (the whole file, surrounding whitespace stripped), else the
    environment variable ``admin_token_env``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    admin_token_env: str = Field(default=DEFAULT_ENV, min_length=1)
    admin_token_file: Path | None = None

    def read(self, environ: Mapping[str, str]) -> str:
        """The checked token; ``ValueError`` when it is missing, unreadable or weak."""
        if self.admin_token_file is not None:
            origin = f"admin_token_file {str(self.admin_token_file)!r}"
            try:
                raw = self.admin_token_file.read_text()
            except OSError as error:
                raise ValueError(f"cannot read {origin}: {error.strerror}") from None
            return check_admin_token(raw, origin)
        raw_env = environ.get(self.admin_token_env)
        if not raw_env:
            raise ValueError(
                f"no admin token: set ${self.admin_token_env} (or name a secret file in the "
                "Serve config's admin_token_file)"
            )
        return check_admin_token(raw_env, f"${self.admin_token_env}")

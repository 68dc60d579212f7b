"""Input limits checked before anything parses a body further, tokenizes or touches Redis.

:class:`InputLimitsMiddleware` (pure ASGI) reads a request's body once, up to
``max_body_bytes`` (413 beyond, from ``Content-Length`` alone when it says so), checks that
it is JSON no deeper than ``max_json_depth`` (deeper is a 400; Python's parser would raise
``RecursionError`` near depth 1000), and that an OpenAI body's prompt text has at most
``max_prompt_chars`` characters (400), then hands the same bytes to the app. Bodies that are
not JSON pass through: the route answers them with its own 400.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from controlplane.openai_models import prompt_chars

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPENAI_BODY_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class InputLimits(BaseModel):
    """The ingress's input limits (the Serve config's ``args.limits``).

    The prompt limit is in characters so it is checked before tokenizing: a 3 MB prompt
    cost 3.66 s of tokenizer CPU before its 400 (issue 15). 200,000 characters is about
    50,000 English tokens, beyond any context served here today."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_body_bytes: int = Field(default=2 * 1024 * 1024, gt=0)
    max_prompt_chars: int = Field(default=200_000, gt=0)
    max_json_depth: int = Field(default=32, gt=0)


class InputError(Exception):
    """A request refused by its shape; answered as an OpenAI error body."""

    def __init__(self, status: int, message: str, kind: str) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def json_depth_exceeds(value: Any, max_depth: int) -> bool:
    """Whether ``value`` nests arrays/objects more than ``max_depth`` deep (a scalar is
    depth 0, ``[]`` depth 1). Iterative, so any depth the parser accepted is safe here."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth + 1 > max_depth:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return False


def check_body(path: str, body: bytes, limits: InputLimits) -> None:
    """``InputError`` when the body breaks a limit or is not JSON Python can read (a
    400, before any route parses it: an integer of more than 4,300 digits is a
    ``ValueError`` that no route expects); ``None`` otherwise."""
    if len(body) > limits.max_body_bytes:
        raise InputError(413, _too_large(limits), "request_too_large")
    if not body:
        return
    try:
        parsed = json.loads(body)
    except RecursionError:
        parsed = None
        too_deep = True
    except ValueError as error:  # not JSON, not UTF-8, or an integer of 4,300+ digits
        message = f"request body is not valid JSON: {error}"
        raise InputError(400, message, "invalid_request") from None
    else:
        too_deep = json_depth_exceeds(parsed, limits.max_json_depth)
    if too_deep:
        raise InputError(
            400,
            f"request body nests deeper than {limits.max_json_depth} levels",
            "invalid_request",
        )
    if path in OPENAI_BODY_PATHS and isinstance(parsed, dict):
        chars = prompt_chars(parsed)
        if chars > limits.max_prompt_chars:
            field = "messages" if "messages" in parsed else "prompt"
            raise InputError(
                400,
                f"{field}: the prompt has {chars} characters, more than the limit of "
                f"{limits.max_prompt_chars}",
                "invalid_request",
            )


def _too_large(limits: InputLimits) -> str:
    return f"request body is larger than the limit of {limits.max_body_bytes} bytes"


class InputLimitsMiddleware:
    """Applies :func:`check_body` to every request with a body (POST, PUT, PATCH);
    ``on_error(scope, send, error)`` answers a refused one."""

    def __init__(
        self,
        app: ASGIApp,
        limits: InputLimits,
        on_error: Callable[[Scope, Send, InputError], Awaitable[None]],
    ) -> None:
        self.app, self.limits, self.on_error = app, limits, on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read(scope, receive)
            check_body(scope["path"], body, self.limits)
        except InputError as error:
            await self.on_error(scope, send, error)
            return
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _read(self, scope: Scope, receive: Receive) -> bytes:
        for name, value in scope.get("headers", []):
            too_large = value.isdigit() and int(value) > self.limits.max_body_bytes
            if name == b"content-length" and too_large:
                raise InputError(413, _too_large(self.limits), "request_too_large")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limits.max_body_bytes:
                raise InputError(413, _too_large(self.limits), "request_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)

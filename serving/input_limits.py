"""Reading a request's JSON body under the ingress's input limits: once, after authentication.

A route authenticates its caller first, then :func:`read_request` (or :func:`read_body` and
:func:`decode_body`) reads and decodes the body:

1. It reads at most ``max_body_bytes`` (413 beyond, from ``Content-Length`` alone when it
   says so, before reading anything).
2. A scan of the raw bytes (:func:`json_shape`) counts the body's JSON items and its
   nesting depth without building a Python object: 400 beyond ``max_json_items`` or
   ``max_json_depth``. It is a handful of C-speed passes (bytes ``replace``, ``count``,
   ``translate``, one regular expression): 15 ms for a 2 MiB body of 700,000 empty objects,
   which ``json.loads`` and a walk of its result took 1.46 s of event-loop time to refuse.
3. Only then is it parsed, once (``json.loads``: Python's parser would raise
   ``RecursionError`` near depth 1000, and an integer of more than 4,300 digits is a 400
   here), checked for lone UTF-16 surrogates (``"\\ud800"`` is valid JSON but not text:
   the tokenizer raises ``TypeError`` on it; 400 naming the field), for the prompt's
   characters (``max_prompt_chars``, OpenAI bodies only, before tokenizing; 400) and
   validated into the route's model (400 naming the field).

A body over :data:`INLINE_MAX_BYTES` is scanned and decoded on a worker thread, so the
event loop keeps serving other requests (``/health`` included) meanwhile.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect, Request

from controlplane.openai_models import prompt_chars
from serving.errors import HTTPError

M = TypeVar("M", bound=BaseModel)

INLINE_MAX_BYTES = 16 * 1024
"""Bodies up to this size are decoded on the event loop (at most ~8,000 items: well under
a millisecond); larger ones on a worker thread."""


class InputLimits(BaseModel):
    """The ingress's input limits (the Serve config's ``args.limits``).

    ``max_prompt_chars``: the prompt's characters, checked before tokenizing; by default
    ``prompt_chars_per_token`` times the model's context (``max_model_len``): 8 characters
    a token is about twice English text's average, so any prompt the context can hold
    passes and a 200,000-character prompt for a 2,048-token context (~98 characters a
    token) is refused before the tokenizer spends CPU on it. ``max_json_items``: values
    and object keys in a body (:func:`json_shape`). ``tokenizer_threads``,
    ``max_tokenizing_per_tenant`` and ``max_tokenizing``: the tokenizer pool
    (:class:`serving.tokenize_pool.TokenizerPool`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_body_bytes: int = Field(default=2 * 1024 * 1024, gt=0)
    max_prompt_chars: int | None = Field(default=None, gt=0)
    prompt_chars_per_token: float = Field(default=8.0, gt=0, allow_inf_nan=False)
    max_json_depth: int = Field(default=32, gt=0)
    max_json_items: int = Field(default=65_536, gt=0)
    tokenizer_threads: int = Field(default=2, gt=0)
    max_tokenizing_per_tenant: int = Field(default=4, gt=0)
    max_tokenizing: int = Field(default=256, gt=0)

    def prompt_chars_limit(self, max_model_len: int) -> int:
        """The most characters a prompt may have for a model of ``max_model_len`` tokens."""
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return math.ceil(self.prompt_chars_per_token * max_model_len)


@dataclass(frozen=True, slots=True)
class JsonShape:
    """A JSON text's ``items`` (an upper bound on its values and object keys: 1 + the
    commas, colons and opening brackets outside strings) and ``depth`` (arrays and objects
    nested: a scalar is 0, ``[]`` 1)."""

    items: int
    depth: int


_STRING = re.compile(rb'"[^"]*"')  # escapes are gone by the time it runs
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_DEPTH_STEP = np.zeros(256, dtype=np.int8)
_DEPTH_STEP[list(b"[{")] = 1
_DEPTH_STEP[list(b"]}")] = -1
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _outside_strings(body: bytes) -> bytes:
    """``body`` with each string reduced to one ``"``. Escaped backslashes go first, then
    escaped quotes (JSON allows neither outside a string), so each ``"`` left opens or
    closes a string."""
    plain = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    return _STRING.sub(b'"', plain)


def json_shape(body: bytes) -> JsonShape:
    """The :class:`JsonShape` of ``body``, from its bytes alone (for a body that is not
    JSON, some bounded count: the parser refuses the body afterwards). Linear in its size:
    37 ms for 2 MiB of empty objects, in C calls of at most 23 ms."""
    outside = _outside_strings(body)
    items = 1 + sum(outside.count(mark) for mark in (b",", b":", b"[", b"{"))
    brackets = np.frombuffer(outside.translate(None, delete=_NOT_BRACKETS), dtype=np.uint8)
    depth = int(np.cumsum(_DEPTH_STEP[brackets], dtype=np.int32).max()) if brackets.size else 0
    return JsonShape(items, max(depth, 0))


def _lone_surrogate_at(value: Any) -> str | None:
    """The path (``messages.0.content``) of the first string or key in ``value`` holding a
    lone UTF-16 surrogate, or ``None``. Iterative: any depth the parser accepted is safe."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str) and not item.isascii():
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return ".".join(str(part) for part in path) or "body"
        elif isinstance(item, dict):
            stack.extend((key, path) for key in item)  # a key: its object's path
            stack.extend((child, (*path, key)) for key, child in item.items())
        elif isinstance(item, list):
            stack.extend((child, (*path, index)) for index, child in enumerate(item))
    return None


def _parse(body: bytes, limits: InputLimits) -> Any:
    """The parsed body, once its shape is within ``limits``; 400 otherwise."""
    shape = json_shape(body)
    if shape.depth > limits.max_json_depth:
        message = f"request body nests deeper than {limits.max_json_depth} levels"
        raise HTTPError(400, message, "invalid_request")
    if shape.items > limits.max_json_items:
        message = f"request body has more than {limits.max_json_items} JSON items"
        raise HTTPError(400, message, "invalid_request")
    try:
        parsed = json.loads(body)
    except RecursionError:  # unreachable within max_json_depth; kept as a 400, not a 500
        message = f"request body nests deeper than {limits.max_json_depth} levels"
        raise HTTPError(400, message, "invalid_request") from None
    except ValueError as error:  # not JSON, not UTF-8, or an integer of 4,300+ digits
        message = f"request body is not valid JSON: {error}"
        raise HTTPError(400, message, "invalid_request") from None
    if _SURROGATE_ESCAPE.search(body) and (where := _lone_surrogate_at(parsed)):
        raise HTTPError(
            400,
            f"invalid request: {where}: holds a lone UTF-16 surrogate, which is not text",
            "invalid_request",
        )
    return parsed


def decode(body: bytes, model: type[M], limits: InputLimits, max_prompt_chars: int | None) -> M:
    """``body`` parsed (:func:`_parse`) and validated into ``model``; with
    ``max_prompt_chars``, a longer prompt is a 400 naming ``prompt`` or ``messages``."""
    raw = _parse(body, limits)
    if not isinstance(raw, dict):
        raise HTTPError(400, "request body must be a JSON object", "invalid_request")
    if max_prompt_chars is not None and (chars := prompt_chars(raw)) > max_prompt_chars:
        field = "messages" if "messages" in raw else "prompt"
        raise HTTPError(
            400,
            f"{field}: the prompt has {chars} characters, more than the limit of "
            f"{max_prompt_chars}",
            "invalid_request",
        )
    try:
        return model.model_validate(raw)
    except ValidationError as error:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in error.errors()
        )
        raise HTTPError(400, f"invalid request: {problems}", "invalid_request") from None


async def decode_body(
    body: bytes, model: type[M], limits: InputLimits, max_prompt_chars: int | None = None
) -> M:
    """:func:`decode` on the event loop for a small body, on a worker thread for a large one."""
    if len(body) <= INLINE_MAX_BYTES:
        return decode(body, model, limits, max_prompt_chars)
    return await asyncio.to_thread(decode, body, model, limits, max_prompt_chars)


async def read_body(request: Request, limits: InputLimits) -> bytes:
    """The request's body, at most ``limits.max_body_bytes`` of it (413 beyond)."""
    too_large = HTTPError(
        413,
        f"request body is larger than the limit of {limits.max_body_bytes} bytes",
        "request_too_large",
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and (len(declared) > 18 or int(declared) > limits.max_body_bytes):
        raise too_large
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_body_bytes:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:
        raise HTTPError(400, "the client left before sending its body", "invalid_request") from None
    return b"".join(chunks)


async def read_request(
    request: Request, model: type[M], limits: InputLimits, max_prompt_chars: int | None = None
) -> M:
    """The request's body read (:func:`read_body`) and decoded (:func:`decode_body`)."""
    return await decode_body(await read_body(request, limits), model, limits, max_prompt_chars)

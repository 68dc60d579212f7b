"""OpenAPI documentation of the JSON bodies the routes read themselves.

The routes parse their bodies inside the pipeline (after authentication), so FastAPI cannot
see them; :func:`body_of` documents one as a reference to a component schema and
:func:`openapi_with_bodies` adds those schemas, so clients and the fuzzer
(``tests/serving/test_fuzz_ingress.py``) know every field.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


def body_of(model: type[BaseModel], required: bool = True) -> dict[str, Any]:
    """A route's ``openapi_extra``: its JSON body is ``model``."""
    schema = {"$ref": _REF.format(model=model.__name__)}
    return {
        "requestBody": {"required": required, "content": {"application/json": {"schema": schema}}}
    }


def openapi_with_bodies(api: FastAPI, models: Iterable[type[BaseModel]]) -> dict[str, Any]:
    """``api``'s OpenAPI document with the schemas of ``models`` as components (built once)."""
    if api.openapi_schema is None:
        document = get_openapi(
            title=api.title,
            version=api.version,
            openapi_version=api.openapi_version,
            description=api.description,
            routes=api.routes,
        )
        schemas = document.setdefault("components", {}).setdefault("schemas", {})
        for model in models:
            schema = model.model_json_schema(ref_template=_REF)
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = schema
        api.openapi_schema = document
    return api.openapi_schema

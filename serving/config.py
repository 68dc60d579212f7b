"""``vtoken serve --config FILE``: run a Ray Serve config file's applications here."""

from __future__ import annotations

import importlib
import signal
import threading
from pathlib import Path

import yaml


def load_serve_config(path: Path):  # type: ignore[no-untyped-def]
    """Parse and validate a Serve config (Ray's ``ServeDeploySchema``); ``ValueError`` if bad."""
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    try:
        raw = yaml.safe_load(path.read_text())
        return ServeDeploySchema.model_validate(raw)
    except (yaml.YAMLError, ValidationError) as error:
        raise ValueError(f"{path}: not a valid Serve config: {error}") from None


def build_applications(path: Path) -> list[tuple[str, str, object]]:
    """``(name, route_prefix, Application)`` for each application of the file."""
    config = load_serve_config(path)
    built = []
    for application in config.applications:
        module_name, _, attribute = application.import_path.replace(":", ".").rpartition(".")
        builder = getattr(importlib.import_module(module_name), attribute)
        built.append((application.name, application.route_prefix or "/", builder(application.args)))
    return built


def run_serve_config(path: Path) -> None:
    import ray
    from ray import serve

    config = load_serve_config(path)
    applications = build_applications(path)
    ray.init(address="auto" if _cluster_running() else None, include_dashboard=False)
    http = config.http_options
    serve.start(http_options={"host": http.host, "port": http.port})
    for name, route_prefix, application in applications:
        serve.run(application, name=name, route_prefix=route_prefix)  # type: ignore[arg-type]
    print(f"serving on http://{http.host}:{http.port} (Ctrl-C to stop)")
    stopped = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stopped.set())
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    stopped.wait()
    serve.shutdown()
    ray.shutdown()


def _cluster_running() -> bool:
    import os

    return bool(os.environ.get("RAY_ADDRESS"))

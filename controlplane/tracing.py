"""OpenTelemetry setup at process start, from the standard ``OTEL_*`` variables.

Library code only uses ``opentelemetry-api``. A process that serves (ingress, controller,
replica) calls :func:`configure_tracing` once: when neither ``OTEL_EXPORTER_OTLP_ENDPOINT``
nor ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set and ``OTEL_TRACES_EXPORTER`` is not
``otlp``, nothing is installed and every span is a no-op (no exporter, no cost).
``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` are honoured by the SDK itself.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from opentelemetry import propagate, trace

OTLP_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def tracing_requested(environ: Mapping[str, str] = os.environ) -> bool:
    if environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    exporter = environ.get("OTEL_TRACES_EXPORTER", "")
    if exporter and exporter != "otlp":
        return False  # "none", or an exporter this process does not install
    return exporter == "otlp" or any(environ.get(name) for name in OTLP_ENDPOINT_VARIABLES)


def configure_tracing(service_name: str, environ: Mapping[str, str] = os.environ) -> bool:
    """Install the SDK with an OTLP/HTTP exporter when the environment asks for one.

    Returns whether a provider was installed. Safe to call more than once per process.
    """
    if not tracing_requested(environ):
        return False
    if type(trace.get_tracer_provider()).__name__ == "TracerProvider":
        return True  # an SDK provider is already installed in this process
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({"service.name": environ.get("OTEL_SERVICE_NAME", service_name)})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return True


def engine_traces_endpoint(environ: Mapping[str, str] = os.environ) -> str | None:
    """The OTLP/HTTP traces URL for vLLM's own spans (its ``otlp_traces_endpoint``), from
    the same variables as :func:`configure_tracing`; ``None`` when tracing is off.

    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is used as is; otherwise
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` + ``/v1/traces`` (the OTLP/HTTP path, as the SDK's
    exporter does). vLLM speaks gRPC unless ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` is
    ``http/protobuf``: the caller sets that (see :data:`ENGINE_TRACES_PROTOCOL`)."""
    if not tracing_requested(environ):
        return None
    traces = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if traces:
        return traces
    base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    return f"{base.rstrip('/')}/v1/traces" if base else None


ENGINE_TRACES_PROTOCOL = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
"""The variable and value that make vLLM's exporter speak OTLP/HTTP like ours."""


def inject_context() -> dict[str, str]:
    """The current trace context as W3C headers, to carry across a Serve call."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def extract_context(carrier: Mapping[str, str] | None):  # type: ignore[no-untyped-def]
    """The context a caller injected (an empty context when there is none)."""
    return propagate.extract(dict(carrier or {}))

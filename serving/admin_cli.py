"""Serving commands of the `vtoken` CLI: serve, tenant, status, demo.

``tenant`` and ``status`` talk to a running server's admin API (``--url``, default
``$VTOKEN_URL`` or http://127.0.0.1:8000; ``--admin-token`` or ``$VTOKEN_ADMIN_TOKEN``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from controlplane.models import TenantLimits

Url = Annotated[str, typer.Option(envvar="VTOKEN_URL", help="Server base URL.")]
Token = Annotated[str, typer.Option(envvar="VTOKEN_ADMIN_TOKEN", help="Admin token.")]
DEFAULT_URL = "http://127.0.0.1:8000"

tenant_app = typer.Typer(no_args_is_help=True, help="Manage tenants and their KV quotas.")


def _admin(
    method: str,
    url: str,
    token: str,
    path: str,
    body: dict | None = None,
    missing_ok: bool = False,
) -> Any:
    """One admin API call; exits with the server's message on an error (``None`` for a
    404 when ``missing_ok``)."""
    import httpx

    try:
        response = httpx.request(
            method,
            url.rstrip("/") + path,
            json=body,
            timeout=30,
            headers={"Authorization": f"Bearer {token}"},
        )
    except httpx.HTTPError as error:
        typer.echo(f"error: cannot reach {url}: {error}", err=True)
        raise typer.Exit(2) from error
    if missing_ok and response.status_code == 404:
        return None
    if response.status_code >= 400:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text
        typer.echo(f"error: {response.status_code}: {message}", err=True)
        raise typer.Exit(1)
    return response.json()


QUOTA_FIELDS = tuple(TenantLimits.model_fields)


@tenant_app.command("set")
def tenant_set(
    tenant_id: str,
    kv_budget_blocks: Annotated[
        int | None, typer.Option(help="Active-KV budget in blocks (new tenants: required).")
    ] = None,
    weight: float | None = None,
    max_concurrent_requests: int | None = None,
    prompt_tokens_per_s: float | None = None,
    eviction_budget_tokens: int | None = None,
    squeeze_to_floor: Annotated[
        bool | None,
        typer.Option(help="Count running requests at their floors (trades quality for load)."),
    ] = None,
    prefix_group: Annotated[
        str | None,
        typer.Option(help="Share prefix-cache blocks with the other tenants of this group."),
    ] = None,
    max_queue_depth: Annotated[
        int | None, typer.Option(help="Requests that may wait for admission (0: none).")
    ] = None,
    max_queue_wait_s: Annotated[
        float | None, typer.Option(help="Longest wait for admission, in seconds.")
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(help="Add this key, 32+ characters (a new tenant otherwise gets one)."),
    ] = None,
    url: Url = DEFAULT_URL,
    admin_token: Token = "",
) -> None:
    """Create a tenant, or change the given fields of an existing one (others are kept);
    prints the quota (and a new tenant's generated key, once; ``tenant key`` manages keys).
    Values are checked against the quota model (``TenantLimits``) before the quota is sent."""
    given = {
        "kv_budget_blocks": kv_budget_blocks,
        "weight": weight,
        "max_concurrent_requests": max_concurrent_requests,
        "prompt_tokens_per_s": prompt_tokens_per_s,
        "eviction_budget_tokens": eviction_budget_tokens,
        "squeeze_to_floor": squeeze_to_floor,
        "prefix_group": prefix_group,
        "max_queue_depth": max_queue_depth,
        "max_queue_wait_s": max_queue_wait_s,
    }
    current = _admin("GET", url, admin_token, f"/admin/tenants/{tenant_id}", missing_ok=True)
    body: dict[str, Any] = {k: current[k] for k in QUOTA_FIELDS if current and k in current}
    body.update({k: v for k, v in given.items() if v is not None})
    if "kv_budget_blocks" not in body:
        typer.echo(f"error: tenant {tenant_id!r} is new: --kv-budget-blocks is required", err=True)
        raise typer.Exit(2)
    try:
        TenantLimits.model_validate(body)
    except ValidationError as error:
        problem = error.errors()[0]
        field = "--" + str(problem["loc"][0]).replace("_", "-")
        typer.echo(f"error: {field}: {problem['msg']}", err=True)
        raise typer.Exit(2) from None
    if api_key is not None:
        body["api_key"] = api_key
    typer.echo(
        json.dumps(_admin("PUT", url, admin_token, f"/admin/tenants/{tenant_id}", body), indent=2)
    )


@tenant_app.command("get")
def tenant_get(tenant_id: str, url: Url = DEFAULT_URL, admin_token: Token = "") -> None:
    typer.echo(json.dumps(_admin("GET", url, admin_token, f"/admin/tenants/{tenant_id}"), indent=2))


@tenant_app.command("list")
def tenant_list(url: Url = DEFAULT_URL, admin_token: Token = "") -> None:
    typer.echo(json.dumps(_admin("GET", url, admin_token, "/admin/tenants"), indent=2))


@tenant_app.command("delete")
def tenant_delete(tenant_id: str, url: Url = DEFAULT_URL, admin_token: Token = "") -> None:
    """Revoke the tenant's keys, drop its reservations, then delete its quota."""
    typer.echo(json.dumps(_admin("DELETE", url, admin_token, f"/admin/tenants/{tenant_id}")))


key_app = typer.Typer(no_args_is_help=True, help="Add, list and revoke a tenant's API keys.")
tenant_app.add_typer(key_app, name="key")


@key_app.command("add")
def key_add(
    tenant_id: str,
    api_key: Annotated[
        str | None, typer.Option(help="Add this key (32+ characters) instead of a generated one.")
    ] = None,
    url: Url = DEFAULT_URL,
    admin_token: Token = "",
) -> None:
    """Give the tenant another key; prints its id (and a generated key, once)."""
    body = {"api_key": api_key} if api_key is not None else {}
    added = _admin("POST", url, admin_token, f"/admin/tenants/{tenant_id}/keys", body)
    typer.echo(json.dumps(added, indent=2))


@key_app.command("list")
def key_list(tenant_id: str, url: Url = DEFAULT_URL, admin_token: Token = "") -> None:
    """The tenant's key ids (never the keys)."""
    listed = _admin("GET", url, admin_token, f"/admin/tenants/{tenant_id}/keys")
    typer.echo(json.dumps(listed, indent=2))


@key_app.command("revoke")
def key_revoke(
    tenant_id: str, key_id: str, url: Url = DEFAULT_URL, admin_token: Token = ""
) -> None:
    """Revoke one key by its id; the tenant's other keys stay valid."""
    path = f"/admin/tenants/{tenant_id}/keys/{key_id}"
    typer.echo(json.dumps(_admin("DELETE", url, admin_token, path)))


def status(url: Url = DEFAULT_URL, admin_token: Token = "") -> None:
    """Replicas and tenants: KV held vs quota, blocks reclaimed."""
    from rich.console import Console
    from rich.table import Table

    snapshot = _admin("GET", url, admin_token, "/admin/status")
    console = Console()
    replicas = Table(title=f"replicas (plan version {snapshot['plan_version']})")
    columns = ("replica", "fresh", "used/total", "reclaimable", "reclaimed", "running", "preempted")
    # Ids are never elided, however narrow the terminal: the other columns fold instead.
    ids = [r["id"] for r in snapshot["replicas"]]
    replicas.add_column(columns[0], no_wrap=True, min_width=max(map(len, ids), default=7))
    for column in columns[1:]:
        replicas.add_column(column)
    for r in snapshot["replicas"]:
        fresh = r.get("fresh", False)
        replicas.add_row(
            r["id"],
            str(fresh),
            f"{r['blocks_used']}/{r['blocks_total']}" if fresh else "-",
            str(r.get("reclaimable_blocks", "-")),
            str(r.get("blocks_reclaimed", "-")),
            str(r.get("running_requests", "-")),
            str(r.get("preemptions", "-")),
        )
    tenants = Table(title="tenants")
    tenant_columns = (
        "tenant", "budget", "active KV", "floor", "reclaimable", "shared", "running", "queued",
        "oldest wait", "VTC lead", "pressure",
    )  # fmt: skip
    ids = [t["id"] for t in snapshot["tenants"]]
    tenants.add_column(tenant_columns[0], no_wrap=True, min_width=max(map(len, ids), default=6))
    for column in tenant_columns[1:]:
        tenants.add_column(column)
    for t in snapshot["tenants"]:
        pressure = t.get("pressure") or {}
        tenants.add_row(
            t["id"],
            str(t["quota_blocks"]),
            str(t["kv_blocks"]) + (" (over)" if t["over_budget"] else ""),
            str(t.get("floor_blocks", "-")),
            str(t.get("reclaimable_blocks", "-")),
            str(t.get("shared_blocks", "-")),
            str(t["running_requests"]),
            str(t.get("queue_depth", "-")),
            f"{t['queue_oldest_wait_s']:.1f} s" if t.get("queue_depth") else "-",
            "-" if t.get("virtual_lead") is None else f"{t['virtual_lead']:.0f}",
            ", ".join(f"{r[:8]} keep {f:.2f}" for r, f in sorted(pressure.items())) or "-",
        )
    console.print(replicas, tenants)


def serve_command(
    config: Annotated[
        Path, typer.Option(exists=True, dir_okay=False, help="Serve config YAML.")
    ] = Path("deploy/serve-local.yaml"),
) -> None:
    """Run the applications of a Ray Serve config file until interrupted."""
    from serving.config import run_serve_config

    try:
        run_serve_config(config)
    except ValueError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(2) from error


def demo(
    report: Annotated[Path | None, typer.Option(help="Write the report as JSON here.")] = None,
    replicas: Annotated[int, typer.Option(min=1, max=4)] = 2,
) -> None:
    """Redis + Ray + vLLM replicas on this machine, three tenants, a final report."""
    from serving.demo import run_demo

    run_demo(report, replicas)


def register(app: typer.Typer) -> None:
    app.add_typer(tenant_app, name="tenant")
    app.command("status")(status)
    app.command("serve")(serve_command)
    app.command("demo")(demo)

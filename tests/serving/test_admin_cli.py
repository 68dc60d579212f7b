"""`vtoken tenant set`: its options are the quota model's fields, checked by that model."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from typer.testing import CliRunner

from controlplane.models import TenantLimits, TenantQuota
from serving import admin_cli


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, Any]]:
    """The admin API calls the CLI makes; tenant "acme" exists with a budget of 8."""
    made: list[tuple[str, str, Any]] = []
    stored = TenantQuota(tenant_id="acme", kv_budget_blocks=8, weight=2.0).model_dump()

    def fake_admin(method: str, url: str, token: str, path: str, body: Any = None, **_: Any):
        made.append((method, path, body))
        if method == "GET":
            return stored if path == "/admin/tenants/acme" else None
        return body

    monkeypatch.setattr(admin_cli, "_admin", fake_admin)
    return made


def test_the_options_are_the_quota_fields() -> None:
    options = inspect.signature(admin_cli.tenant_set).parameters
    assert set(admin_cli.QUOTA_FIELDS) <= set(options)


def test_set_keeps_the_fields_not_given(calls: list[tuple[str, str, Any]]) -> None:
    result = CliRunner().invoke(admin_cli.tenant_app, ["set", "acme", "--prompt-tokens-per-s", "5"])
    assert result.exit_code == 0, result.output
    (_, path, body) = calls[-1]
    assert path == "/admin/tenants/acme"
    assert body == {
        **TenantLimits(kv_budget_blocks=8, weight=2.0).model_dump(),
        "prompt_tokens_per_s": 5.0,
    }


def test_a_value_the_model_refuses_is_never_sent(calls: list[tuple[str, str, Any]]) -> None:
    result = CliRunner().invoke(admin_cli.tenant_app, ["set", "acme", "--weight", "0"])
    assert result.exit_code == 2
    assert "--weight" in result.output and "greater than or equal to 0.001" in result.output
    assert [method for method, _, _ in calls] == ["GET"]
    new = CliRunner().invoke(admin_cli.tenant_app, ["set", "newcomer", "--weight", "3"])
    assert new.exit_code == 2 and "--kv-budget-blocks is required" in new.output


def test_key_commands_add_list_and_revoke_by_id(calls: list[tuple[str, str, Any]]) -> None:
    runner = CliRunner()
    added = runner.invoke(admin_cli.tenant_app, ["key", "add", "acme"])
    chosen = runner.invoke(admin_cli.tenant_app, ["key", "add", "acme", "--api-key", "k" * 40])
    listed = runner.invoke(admin_cli.tenant_app, ["key", "list", "acme"])
    revoked = runner.invoke(admin_cli.tenant_app, ["key", "revoke", "acme", "key-0123"])
    for result in (added, chosen, listed, revoked):
        assert result.exit_code == 0, result.output
    assert calls == [
        ("POST", "/admin/tenants/acme/keys", {}),
        ("POST", "/admin/tenants/acme/keys", {"api_key": "k" * 40}),
        ("GET", "/admin/tenants/acme/keys", None),
        ("DELETE", "/admin/tenants/acme/keys/key-0123", None),
    ]


def test_status_shows_each_tenants_budget_active_kv_reclaimable_and_pressure(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    snapshot = {
        "plan_version": 7,
        "replicas": [],
        "tenants": [
            {"id": "acme", "quota_blocks": 40, "kv_blocks": 50, "floor_blocks": 21,
             "reclaimable_blocks": 29, "shared_blocks": 12, "running_requests": 3,
             "over_budget": True, "queue_depth": 4, "queue_oldest_wait_s": 2.25,
             "virtual_counters": {"replica-one": 980.0}, "virtual_lead": 412.4,
             "pressure": {"replica-one": 0.72}},
            {"id": "beta", "quota_blocks": 10, "kv_blocks": 4, "floor_blocks": 4,
             "reclaimable_blocks": 0, "running_requests": 1, "over_budget": False,
             "pressure": {}},
        ],
    }  # fmt: skip
    monkeypatch.setattr(admin_cli, "_admin", lambda *args, **kwargs: snapshot)
    monkeypatch.setenv("COLUMNS", "200")
    admin_cli.status(url="http://127.0.0.1:1", admin_token="t" * 40)
    lines = {line.split("│")[1].strip(): line for line in capsys.readouterr().out.splitlines()
             if line.count("│") > 2 and line.split("│")[1].strip() in ("acme", "beta")}  # fmt: skip
    cells = [cell.strip() for cell in lines["acme"].split("│")[1:-1]]
    assert cells == [
        "acme", "40", "50 (over)", "21", "29", "12", "3", "4", "2.2 s", "412", "replica- keep 0.72"
    ]  # fmt: skip
    assert [c.strip() for c in lines["beta"].split("│")[1:-1]][-2:] == ["-", "-"]


def test_set_turns_squeezing_to_floors_on(calls: list[tuple[str, str, Any]]) -> None:
    result = CliRunner().invoke(admin_cli.tenant_app, ["set", "acme", "--squeeze-to-floor"])
    assert result.exit_code == 0, result.output
    (_, _, body) = calls[-1]
    assert body["squeeze_to_floor"] is True and body["kv_budget_blocks"] == 8


def test_set_puts_the_tenant_in_a_prefix_group(calls: list[tuple[str, str, Any]]) -> None:
    result = CliRunner().invoke(admin_cli.tenant_app, ["set", "acme", "--prefix-group", "bots"])
    assert result.exit_code == 0, result.output
    (_, _, body) = calls[-1]
    assert body["prefix_group"] == "bots" and body["weight"] == 2.0  # the rest is kept


def test_a_bad_prefix_group_is_refused_before_anything_is_sent(
    calls: list[tuple[str, str, Any]],
) -> None:
    result = CliRunner().invoke(admin_cli.tenant_app, ["set", "acme", "--prefix-group", "a b"])
    assert result.exit_code == 2
    assert "--prefix-group" in result.output and "1-64 characters" in result.output
    assert [method for method, _, _ in calls] == ["GET"]

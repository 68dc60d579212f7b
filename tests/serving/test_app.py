"""Serve application wiring that needs no Ray: the Serve config's arguments and where the
admin token comes from (what admission learns of the engines: tests/workers/test_config.py)."""

from __future__ import annotations

import re
import secrets
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from serving.app import AppArgs, admission_config, build_app

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SECRET_KEYS = re.compile(r"^\s*(admin_token|api_key|password|secret|token)\s*:", re.MULTILINE)


def _serve_configs() -> list[Path]:
    return [p for p in sorted(DEPLOY.glob("*.yaml")) if "applications" in p.read_text()]


def test_deploy_holds_no_secret_literal():
    assert _serve_configs(), "no Serve config found in deploy/"
    for path in sorted(DEPLOY.glob("*.yaml")):
        assert not SECRET_KEYS.search(path.read_text()), path.name


@pytest.mark.parametrize("path", _serve_configs(), ids=lambda p: p.name)
def test_deploy_serve_configs_validate_and_name_where_the_token_is_read(path: Path):
    for application in yaml.safe_load(path.read_text())["applications"]:
        args = AppArgs.model_validate(application["args"])
        assert args.admin_token_file is not None or args.admin_token_env


def test_an_admin_token_literal_in_the_serve_config_is_refused():
    with pytest.raises(ValueError, match="admin_token must not be written in the Serve config"):
        AppArgs.model_validate({"redis_url": "redis://x", "admin_token": "x" * 40})


def test_build_app_refuses_a_missing_or_weak_token_at_start(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("VTOKEN_ADMIN_TOKEN", raising=False)
    with pytest.raises(ValueError, match="no admin token"):
        build_app({"redis_url": "redis://127.0.0.1:1/0"})
    monkeypatch.setenv("VTOKEN_ADMIN_TOKEN", "replace-with-a-secret")
    with pytest.raises(ValueError, match="placeholder"):
        build_app({"redis_url": "redis://127.0.0.1:1/0"})
    with pytest.raises(ValueError, match="fewer than 32"):
        build_app({"redis_url": "redis://127.0.0.1:1/0"}, admin_token="demo-admin-token")


def test_input_limits_are_serve_config_args():
    args = AppArgs.model_validate({"redis_url": "redis://x", "limits": {"max_prompt_chars": 10}})
    assert args.limits.max_prompt_chars == 10
    with pytest.raises(ValueError, match="max_body_bytes"):
        AppArgs.model_validate({"redis_url": "redis://x", "limits": {"max_body_bytes": 0}})


def test_the_redis_url_comes_from_the_environment_never_with_a_password_in_the_config():
    with pytest.raises(ValueError, match="must not carry a password"):
        AppArgs.model_validate({"redis_url": "redis://:hunter2hunter2@10.0.0.1:6379/0"})
    args = AppArgs.model_validate({})
    with pytest.raises(ValueError, match=r"no Redis URL: set \$VTOKEN_REDIS_URL"):
        args.read_redis_url({})
    url = "redis://:s3cret-from-the-env@10.0.0.1:6379/0"
    assert args.read_redis_url({"VTOKEN_REDIS_URL": url}) == url
    with pytest.raises(ValueError, match="unsupported scheme 'http'") as refused:
        args.read_redis_url({"VTOKEN_REDIS_URL": "http://:s3cret@10.0.0.1/"})
    assert "s3cret" not in str(refused.value)
    named = AppArgs.model_validate({"redis_url_env": "MY_REDIS"})
    assert named.read_redis_url({"MY_REDIS": "redis://127.0.0.1:1/0"}) == "redis://127.0.0.1:1/0"


def test_the_ingress_holds_many_streams_at_once(monkeypatch: pytest.MonkeyPatch):
    """Serve's default max_ongoing_requests (5) would queue the sixth request (and admin
    status) behind five long streams at the ingress."""
    token = secrets.token_urlsafe(32)
    app = build_app({"redis_url": "redis://127.0.0.1:1/0"}, admin_token=token)
    config = app._bound_deployment._deployment_config  # what serve.run deploys
    assert config.max_ongoing_requests == 1024
    small = build_app(
        {"redis_url": "redis://127.0.0.1:1/0", "ingress_max_ongoing_requests": 64},
        admin_token=token,
    )
    assert small._bound_deployment._deployment_config.max_ongoing_requests == 64


def test_engine_replicas_ask_for_the_custom_resources_configured():
    args = {"redis_url": "redis://127.0.0.1:1/0", "replica_resources": {"engine_node": 1}}
    assert AppArgs.model_validate(args).replica_resources == {"engine_node": 1.0}
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        AppArgs.model_validate({**args, "replica_resources": {"engine_node": -1}})
    with pytest.raises(ValueError, match="valid number"):
        AppArgs.model_validate({**args, "replica_resources": {"engine_node": "lots"}})


def test_engine_replicas_use_the_project_router_unless_serve_default_is_asked():
    from serving.router import VTokenRequestRouter

    token = secrets.token_urlsafe(32)

    def engine_router(router: str | None) -> object:
        args = {"redis_url": "redis://127.0.0.1:1/0", **({"router": router} if router else {})}
        app = build_app(args, admin_token=token)
        engine = app._bound_deployment.init_args[0]
        assert engine._bound_deployment.name == "engine"
        config = engine._bound_deployment._deployment_config.request_router_config
        return config.get_request_router_class()

    assert engine_router(None) is VTokenRequestRouter
    assert engine_router("serve_default") is not VTokenRequestRouter
    prefix = engine_router("serve_prefix_cache_affinity")
    assert prefix.__name__ == "ServePrefixCacheAffinityRouter"
    # Serve's router reads the prompt's text: here, the token ids the replicas take.
    pending = SimpleNamespace(args=[{"prompt_token_ids": [12, 345, 6]}])
    assert prefix._extract_text_from_request(None, pending) == "12 345 6 "
    with pytest.raises(ValueError, match="router"):
        AppArgs.model_validate({"redis_url": "redis://127.0.0.1:1/0", "router": "random"})


def test_admission_learns_the_engines_prefill_chunk_when_their_policy_evicts_during_prefill():
    """``max_num_batched_tokens`` in the engine settings reaches admission as its prefill
    chunk (active-KV admission only; unset, a prompt counts whole)."""
    from serving.settings import ReplicaSettings

    h2o = {"policy": "h2o", "keep_ratio": 0.2}
    chunked = ReplicaSettings(vtoken=h2o, max_num_batched_tokens=256)
    assert admission_config(chunked, "active_kv").prefill_chunk_tokens == 256
    assert admission_config(chunked, "worst_case").prefill_chunk_tokens is None
    assert admission_config(ReplicaSettings(vtoken=h2o), "active_kv").prefill_chunk_tokens is None
    bounds = admission_config(chunked, "active_kv")
    assert bounds.keep_ratio == 0.2 and bounds.block_size == chunked.block_size


def test_the_clusters_capacity_reaches_admission_and_is_checked():
    """``cluster_kv_blocks`` bounds every tenant's reservations together (off by default)."""
    from serving.settings import ReplicaSettings

    assert AppArgs().cluster_kv_blocks is None
    engine = ReplicaSettings()
    settings = AppArgs(cluster_kv_blocks=512).ingress_settings(engine, "t" * 40, "redis://x")
    assert settings.admission.cluster_kv_blocks == 512
    assert settings.admission.block_size == engine.block_size
    with pytest.raises(ValueError, match="cluster_kv_blocks"):
        AppArgs(cluster_kv_blocks=0)


def test_the_engines_scheduling_policy_reaches_the_ingress():
    """The ingress refuses a priority the engines would not honour: it knows their policy."""
    from serving.settings import ReplicaSettings

    for policy in ("fcfs", "priority"):
        engine = ReplicaSettings(scheduling_policy=policy)
        settings = AppArgs().ingress_settings(engine, "t" * 40, "redis://x")
        assert settings.scheduling_policy == policy


def test_admission_learns_a_hybrid_models_sliding_windows_from_its_config(tmp_path):
    """The ingress counts each sliding-window group of the engines' model (read from its
    config.json, no engine started) with the engines' step size and context; a model
    without sliding layers adds nothing."""
    import json

    from serving.settings import ReplicaSettings

    layer_types = ["sliding_attention"] * 5 + ["full_attention"]
    config = {"num_hidden_layers": 18, "sliding_window": 512, "layer_types": layer_types * 3}
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine = ReplicaSettings(model=str(tmp_path), max_num_batched_tokens=256, max_model_len=4096)
    sliding = admission_config(engine, "active_kv").sliding
    assert (sliding.windows, sliding.in_flight_tokens, sliding.max_model_len) == (
        (512,) * 5,
        256,
        4096,
    )
    assert admission_config(engine, "worst_case").sliding == sliding  # never evicted from
    assert admission_config(ReplicaSettings(), "active_kv", tmp_path).sliding.windows
    assert admission_config(ReplicaSettings(), "active_kv").sliding.windows == ()  # SmolLM2

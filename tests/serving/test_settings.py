"""The typed settings the Serve args parse into: an engine replica's vToken section is a
``VTokenConfig`` (served engines evict on demand unless told), and an ingress's admission
config travels whole."""

from __future__ import annotations

import pickle

import pytest
from pydantic import ValidationError

from controlplane.admission import AdmissionConfig
from serving.input_limits import InputLimits
from serving.settings import IngressSettings, ReplicaSettings
from workers.config import VTokenConfig


def test_served_engines_evict_on_demand_unless_told():
    assert ReplicaSettings(model="m").vtoken == VTokenConfig(policy="none", eviction="on_demand")
    settings = ReplicaSettings(vtoken={"policy": "h2o", "keep_ratio": 0.2})
    assert settings.vtoken.eviction == "on_demand"
    told = ReplicaSettings(model="m", vtoken={"policy": "none", "eviction": "eager"})
    assert told.vtoken.eviction == "eager"
    # A config object counts what its maker set, as if written in YAML.
    built = ReplicaSettings(vtoken=VTokenConfig(policy="h2o", keep_ratio=0.2))
    assert built.vtoken.eviction == "on_demand"
    eager = VTokenConfig(policy="h2o", keep_ratio=0.2, eviction="eager")
    assert ReplicaSettings(vtoken=eager).vtoken.eviction == "eager"


def test_a_bad_vtoken_section_fails_with_its_field():
    with pytest.raises(ValidationError, match=r"vtoken\n.*unknown policy 'nope'"):
        ReplicaSettings(vtoken={"policy": "nope"})
    with pytest.raises(ValidationError, match="vtoken"):
        ReplicaSettings(vtoken={"policy": "h2o"})  # H2O needs a budget


def test_vllm_gets_the_vtoken_fields_the_config_set():
    """``additional_config["vtoken"]``: what the Serve config wrote, plus the serving
    default of ``eviction``, as JSON values."""
    assert ReplicaSettings().additional_vtoken() == {"policy": "none", "eviction": "on_demand"}
    naive = ReplicaSettings(vtoken={"policy": "h2o", "keep_ratio": 0.2, "mode": "naive"})
    assert naive.additional_vtoken() == {
        "policy": "h2o",
        "keep_ratio": 0.2,
        "mode": "naive",
        "eviction": "on_demand",
    }


def test_settings_survive_the_trip_to_a_replica():
    """Serve pickles a deployment's arguments: both settings arrive equal."""
    engine = ReplicaSettings(vtoken={"policy": "h2o", "keep_ratio": 0.5, "prefix_pin_tokens": 8})
    assert pickle.loads(pickle.dumps(engine)) == engine
    ingress = IngressSettings(
        model_name="m",
        tokenizer_path="t",
        max_model_len=128,
        admin_token="a",
        redis_url="redis://127.0.0.1:1/0",
        admission=AdmissionConfig(block_size=16, keep_ratio=0.5),
        limits=InputLimits(max_prompt_chars=10),
    )
    assert pickle.loads(pickle.dumps(ingress)) == ingress
    assert ingress.block_size == 16

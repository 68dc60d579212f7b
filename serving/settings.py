"""What the Serve config's arguments parse into, once (:func:`serving.app.build_app`): an
engine replica's :class:`ReplicaSettings` and an ingress replica's :class:`IngressSettings`.
Each deployment receives its settings whole; nothing re-validates them downstream.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from controlplane.admission import AdmissionConfig
from controlplane.openai_models import DEFAULT_MAX_N
from serving.input_limits import InputLimits
from workers.config import VTokenConfig


class ReplicaSettings(BaseModel):
    """One replica's engine and reporting settings (from the Serve config)."""

    model_config = ConfigDict(extra="forbid")

    model: str = "smollm2"
    served_name: str | None = None  # the model id clients send (default: ``model``)
    block_size: int = Field(default=32, gt=0)
    max_model_len: int = Field(default=2048, gt=0)
    max_num_seqs: int = Field(default=16, gt=0)
    num_blocks: int | None = Field(default=None, gt=0)
    max_num_batched_tokens: int | None = Field(default=None, gt=0)
    """vLLM's token budget of one step, so its prefill chunk (``None``: vLLM's default).
    Set, it also reaches admission: a request whose policy evicts during prefill counts
    one chunk plus its budget until its prefill ends, when that is below its prompt
    (``VTokenConfig.admission_prefill_chunk_tokens``); unset, a prompt counts whole."""
    dtype: str = "auto"
    kv_cache_space_gib: int = Field(default=1, gt=0)
    gpu_memory_utilization: float = Field(default=0.3, gt=0, le=1)
    """Share of each GPU vLLM may use (weights, activations, then the KV pool); CPU: unused."""
    enforce_eager: bool | None = None
    """``None``: eager on CPU (vLLM's CPU build has no graphs to replay), CUDA graphs on
    GPUs (a vToken engine's are piecewise: ``workers.vllm_patches.fall_back_to_piecewise``)."""
    kv_cache_dtype: str = "auto"  # vLLM's names: auto (the model's dtype), fp8, fp8_e5m2, ...
    tensor_parallel_size: int = Field(default=1, gt=0)
    """GPUs per replica: the deployment's ``replica_num_gpus`` must be at least this."""
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """vLLM's scheduling policy: ``fcfs`` (first come, first served) or ``priority``
    (requests with a lower ``priority`` in their body are scheduled first and preempted
    last; ties first come, first served). With vToken's ``fair_share`` on, tenants' weights
    order requests of the same priority."""
    enable_prefix_caching: bool = True
    """vLLM's automatic prefix caching: a prompt prefix already computed on this replica
    under the same salt (the tenant's, or its prefix group's: ``cache_salt``) is reused
    instead of recomputed. With vToken a request publishes every full block until it
    first evicts, then keeps those below its first eviction and its pinned prefix
    (``prefix_pin_tokens`` in ``vtoken``; ``pin_cache_hits`` keeps hits too);
    ``False`` turns it off."""
    vtoken: VTokenConfig = Field(
        default_factory=lambda: VTokenConfig(policy="none"), validate_default=True
    )
    """The engines' vToken config; served engines evict ``on_demand`` unless it says
    otherwise (tokens stay until memory or the tenant's budget needs them)."""
    redis_url: str | None = None
    key_prefix: str = "vtoken"
    report_period_s: float = Field(default=0.1, gt=0)
    metrics_port: int | None = Field(default=0, ge=0, le=65535)
    """The replica's Prometheus endpoint (``GET /metrics``) on its node's address: 0 takes
    a free port (every replica of a node needs its own), ``None`` serves none. Each
    replica's address is in its reports, ``/admin/status`` and ``/admin/metrics/targets``
    (Prometheus HTTP service discovery)."""

    @field_validator("vtoken", mode="before")
    @classmethod
    def _serving_defaults(cls, vtoken: Any) -> Any:
        if isinstance(vtoken, VTokenConfig):  # what its maker set, as if written in YAML
            vtoken = vtoken.model_dump(exclude_unset=True)
        if isinstance(vtoken, dict):
            return {"eviction": "on_demand", **vtoken}
        return vtoken  # not a mapping: pydantic names the field and what it expected

    @property
    def name(self) -> str:
        return self.served_name or self.model

    def eager(self, device_type: str) -> bool:
        """Whether the engine on ``device_type`` ("cuda", "cpu", ...) runs without graphs."""
        return self.enforce_eager if self.enforce_eager is not None else device_type != "cuda"

    def additional_vtoken(self) -> dict[str, Any]:
        """The vToken section of vLLM's ``additional_config``: the fields the Serve config set
        (and the serving default of ``eviction``), as JSON values."""
        return self.vtoken.model_dump(mode="json", exclude_unset=True)


ApiDocs = Literal["off", "admin", "public"]
"""Who may read the ingress's OpenAPI document (every route and body, the admin API's
included): ``off`` (the default) serves none, ``admin`` serves ``GET /openapi.json`` to the
admin token only, ``public`` serves it and the ``/docs`` and ``/redoc`` pages to anyone."""


@dataclass(frozen=True, slots=True)
class IngressSettings:
    """What one ingress replica serves. ``tokenizer_path`` and ``redis_url`` are read only
    where the real dependencies are built (:class:`serving.ingress.Ingress`); ``admission``
    goes whole to :class:`controlplane.admission.Admission` (its ``block_size`` is the
    engines'; its ``reservation_ttl_s`` paces renewals); ``limits`` guards every body;
    ``api_docs`` says who may read the API's OpenAPI document (:data:`ApiDocs`)."""

    model_name: str
    tokenizer_path: str
    max_model_len: int
    admin_token: str
    redis_url: str
    admission: AdmissionConfig
    key_prefix: str = "vtoken"
    max_n: int = DEFAULT_MAX_N  # choices one request may ask for (each is a sequence's KV)
    limits: InputLimits = field(default_factory=InputLimits)
    api_docs: ApiDocs = "off"
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"  # the engines' (ReplicaSettings)

    @property
    def max_prompt_chars(self) -> int:
        """The most characters a prompt may have (``limits``, derived from the context)."""
        return self.limits.prompt_chars_limit(self.max_model_len)

    @property
    def block_size(self) -> int:
        """The engines' KV block size (admission converts tokens to blocks with it)."""
        return self.admission.block_size

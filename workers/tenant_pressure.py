"""The controller's tenant limits on one engine: eviction pressure and allowances.

``pressure``: tenant -> keep fraction in (0, 1) of what the tenant holds
(``controlplane/pressure.py``: budget / measured active KV). Each running request of such a
tenant may keep that fraction of its *anchor*: its live tokens when this fraction reached it
(a request still in prefill, or added later, is anchored at its first decoding step). The
same fraction again changes nothing; a new fraction (a new plan measured the tenant still
over) applies to what each request holds then, so a tenant that stays over is squeezed
further, toward what its policy protects (sinks, recent window), which eviction never takes.
A fraction of 1, or a tenant left out, is no pressure.

``allowance``: tenant -> the most blocks the tenant may hold here (the plan's ``allowance``
for this replica); a tenant left out has no limit here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(slots=True)
class TenantPressure:
    """The latest pressure and allowances (replaced whole by :meth:`update`)."""

    pressure: dict[str, float] = field(default_factory=dict)
    allowance: dict[str, int] = field(default_factory=dict)

    def update(
        self, pressure: Mapping[str, float], allowance: Mapping[str, int] | None = None
    ) -> set[str]:
        """Take a new plan's pressure and allowances; returns the tenants whose fraction
        changed (their requests take a new anchor). A fraction outside (0, 1] or an
        allowance that is not a whole number of blocks >= 0 raises ``ValueError`` and
        changes nothing."""
        bad = {tenant: f for tenant, f in pressure.items() if not 0.0 < f <= 1.0}
        if bad:
            raise ValueError(f"keep fractions must be in (0, 1]: {bad}")
        allowance = dict(allowance or {})
        negative = {tenant: b for tenant, b in allowance.items() if int(b) != b or b < 0}
        if negative:
            raise ValueError(f"allowances must be whole blocks >= 0: {negative}")
        self.allowance = {tenant: int(b) for tenant, b in allowance.items()}
        changed = {t for t, f in pressure.items() if f < 1.0 and f != self.pressure.get(t)}
        self.pressure = {t: float(f) for t, f in pressure.items() if f < 1.0}
        return changed

    def applies_to(self, tenant: str) -> bool:
        return tenant in self.pressure

    def anchor(
        self, tenant: str, anchor: int | None, num_live: int, decoding: bool, changed: set[str]
    ) -> int | None:
        """A request's anchor after :meth:`update` (``changed``: what it returned): none
        when released or in prefill (set once it decodes), its live tokens when new or its
        tenant's fraction changed, else the one it had."""
        if tenant not in self.pressure or not decoding:
            return None
        if tenant in changed or anchor is None:
            return num_live
        return anchor

    def bound(self, tenant: str, anchor: int | None) -> int | None:
        """Live tokens a request anchored at ``anchor`` may keep of what it pays for
        (``None``: no pressure on it)."""
        fraction = self.pressure.get(tenant)
        if fraction is None or anchor is None:
            return None
        return max(1, int(anchor * fraction))

"""Tenant pressure and allowances on one engine (plain values)."""

from __future__ import annotations

import pytest

from workers.tenant_pressure import TenantPressure


def test_a_fraction_of_one_is_no_pressure_and_changes_are_reported():
    tenants = TenantPressure()
    assert tenants.update({"x": 0.5, "y": 1.0}, {"x": 7}) == {"x"}
    assert tenants.pressure == {"x": 0.5} and tenants.allowance == {"x": 7}
    assert tenants.applies_to("x") and not tenants.applies_to("y")
    assert tenants.update({"x": 0.5}) == set()  # the same fraction again
    assert tenants.allowance == {}  # replaced whole
    assert tenants.update({"x": 0.25}) == {"x"}


@pytest.mark.parametrize(
    ("pressure", "allowance"),
    [({"x": 0.0}, None), ({"x": 1.5}, None), ({}, {"x": -1}), ({}, {"x": 2.5})],
)
def test_bad_values_raise_and_change_nothing(pressure, allowance):
    tenants = TenantPressure()
    tenants.update({"y": 0.5}, {"y": 3})
    with pytest.raises(ValueError):
        tenants.update(pressure, allowance)
    assert tenants.pressure == {"y": 0.5} and tenants.allowance == {"y": 3}


def test_anchors_and_bounds():
    tenants = TenantPressure()
    changed = tenants.update({"x": 0.5})
    assert tenants.anchor("x", None, 40, decoding=True, changed=changed) == 40
    assert tenants.anchor("x", None, 40, decoding=False, changed=changed) is None  # prefill
    assert tenants.anchor("y", 30, 40, decoding=True, changed=changed) is None  # released
    assert tenants.anchor("x", 30, 40, decoding=True, changed=set()) == 30  # kept
    assert tenants.bound("x", 30) == 15 and tenants.bound("x", 1) == 1
    assert tenants.bound("x", None) is None and tenants.bound("y", 30) is None

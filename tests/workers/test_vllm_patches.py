"""``TOUCH_POINTS`` is the whole list of what ``install()`` changes in vLLM, and every
entry names something the pinned vLLM has."""

from __future__ import annotations

import importlib

from workers.vllm_patches import TOUCH_POINTS, TouchPoint, cuda_attention_impls, install
from workers.vllm_patches.support import qualname


def _class(point: TouchPoint) -> type:
    module_name, _, class_name = point.class_path.rpartition(".")
    return getattr(importlib.import_module(module_name), class_name)


def test_each_target_is_listed_once_with_a_reason():
    targets = [point.target for point in TOUCH_POINTS]
    assert len(targets) == len(set(targets))
    assert all(point.why for point in TOUCH_POINTS)


def test_every_target_is_a_vllm_class_attribute():
    """A CUDA-only target is checked where its module imports (FlashInfer's needs its
    package, absent from vLLM's CPU build)."""
    importable = {qualname(cls) for cls in cuda_attention_impls()}
    for point in TOUCH_POINTS:
        assert point.target.startswith("vllm.")
        if point.cuda_only and point.class_path not in importable:
            continue
        if point.how != "add":
            assert hasattr(_class(point), point.attribute), point.target


def test_install_applies_every_entry_off_cuda_but_the_cuda_only_ones():
    install()
    install()  # idempotent: nothing wrapped twice
    for point in TOUCH_POINTS:
        if point.cuda_only:
            continue  # the CPU build's platform is not CUDA
        attribute = getattr(_class(point), point.attribute)
        if point.how == "add":
            assert attribute is point.hook, point.target
            continue
        function = attribute.fget if point.how == "property" else attribute
        assert hasattr(function, "__vtoken_original__"), point.target
        assert not hasattr(function.__vtoken_original__, "__vtoken_original__"), point.target

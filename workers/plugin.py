"""vLLM general-plugin entry point (``vllm.general_plugins``: ``vtoken = workers.plugin:register``).

vLLM calls ``register()`` in the front end, the engine core and every worker. It installs
the wrappers listed in ``workers/vllm_patches/`` (``TOUCH_POINTS``), which stay inert for
every engine whose ``additional_config`` has no ``"vtoken"`` section.
"""

from __future__ import annotations


def register() -> None:
    from workers.vllm_patches import install

    install()

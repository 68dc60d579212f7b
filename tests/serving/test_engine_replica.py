"""The engine replica's Serve deployment, without Ray or an engine."""

from __future__ import annotations

import asyncio

import pytest

from serving.engine_replica import EngineReplica


@pytest.mark.filterwarnings("ignore:coroutine .EngineReplica.__del__. was never awaited")
def test_health_never_depends_on_the_report_loop():
    """A report loop that stopped (here: it raised) is restarted by the health check, which
    passes: Serve must not restart an engine (model reload, streams cut) for its reporter."""

    class Engine:
        async def check_health(self) -> None:
            return None

    class Reporter:
        runs = 0

        async def run(self) -> None:
            Reporter.runs += 1
            if Reporter.runs == 1:
                raise RuntimeError("OOM command not allowed when used memory > 'maxmemory'")
            await asyncio.sleep(3600)

        def status(self) -> dict[str, object]:
            return {"report_age_s": 12.5}

    async def scenario() -> None:
        replica = EngineReplica.func_or_class.__new__(EngineReplica.func_or_class)
        replica.host, replica.reporter = Engine(), Reporter()
        replica._task = asyncio.get_running_loop().create_task(replica.reporter.run())
        await asyncio.sleep(0)
        assert replica._task.done()
        await replica.check_health()  # does not raise
        await asyncio.sleep(0)
        assert Reporter.runs == 2 and not replica._task.done()
        assert await replica.report_status() == {"report_age_s": 12.5}
        replica._task.cancel()

    asyncio.run(scenario())

"""Block reports: what a request or tenant holds, and what a repack could give back."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from vtoken.token_table import TokenTable


@dataclass(frozen=True, slots=True)
class BlockReport:
    """Blocks held vs needed; ``reclaimable = allocated - ideal``, ideal = ceil(live / block)."""

    num_requests: int
    allocated_blocks: int
    live_tokens: int
    ideal_blocks: int

    @property
    def reclaimable_blocks(self) -> int:
        return self.allocated_blocks - self.ideal_blocks

    def __add__(self, other: BlockReport) -> BlockReport:
        return BlockReport(
            num_requests=self.num_requests + other.num_requests,
            allocated_blocks=self.allocated_blocks + other.allocated_blocks,
            live_tokens=self.live_tokens + other.live_tokens,
            ideal_blocks=self.ideal_blocks + other.ideal_blocks,
        )


EMPTY_REPORT = BlockReport(num_requests=0, allocated_blocks=0, live_tokens=0, ideal_blocks=0)


def request_report(table: TokenTable) -> BlockReport:
    return BlockReport(
        num_requests=1,
        allocated_blocks=table.num_held_blocks,
        live_tokens=table.num_live,
        ideal_blocks=table.num_ideal_blocks,
    )


def tenant_reports(tables: Iterable[tuple[str, TokenTable]]) -> dict[str, BlockReport]:
    """Sum of request reports per tenant, from ``(tenant, table)`` pairs."""
    reports: dict[str, BlockReport] = {}
    for tenant, table in tables:
        reports[tenant] = reports.get(tenant, EMPTY_REPORT) + request_report(table)
    return reports

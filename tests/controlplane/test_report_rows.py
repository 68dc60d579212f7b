"""Parsing reports and prefix keys as read from Redis (pure)."""

from __future__ import annotations

from controlplane.prefix import MAX_REPORTED_KEYS
from controlplane.report_rows import ReportRows, parse_prefix_keys, parse_reports
from controlplane.store_scripts import WRONG_TYPE
from tests.controlplane.builders import report


def test_reports_are_fresh_stale_or_invalid_never_an_error() -> None:
    rows = ReportRows(
        now_s=10.0,
        replica_ids=["fresh", "old", "gone", "junk", "foreign"],
        last_heartbeat_s={"fresh": 10.0},
        raw_reports=[
            report("fresh", 9.5).model_dump_json(),
            report("old", 1.0).model_dump_json(),
            None,
            "{not json",
            WRONG_TYPE,
        ],
    )
    snapshot = parse_reports(rows, max_age_s=1.0)
    assert list(snapshot.fresh) == ["fresh"]
    assert snapshot.stale_ids == {"old", "gone", "junk", "foreign"}
    assert snapshot.invalid_ids == {"junk", "foreign"}


def test_prefix_keys_parse_or_are_refused_whole() -> None:
    assert parse_prefix_keys("r1", "t1 aa bb").keys == ("aa", "bb")
    assert parse_prefix_keys("r1", "t1").keys == ()
    too_many = "t2 " + " ".join(["k"] * (MAX_REPORTED_KEYS + 1))
    refused = parse_prefix_keys("r1", too_many)
    assert refused.tag == "t2" and refused.keys == ()
    assert parse_prefix_keys("r1", "t3 " + "k" * 65).keys == ()

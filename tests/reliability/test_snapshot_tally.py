"""The corpus verdict: runs after the ``test_snapshot_*`` corpus modules (file order) and
judges their tally as a whole. Run alone it fails: no corpus ran.

The figures go to ``snapshot-reliability.json`` in pytest's base temporary directory and
are printed (``-s`` shows them).
"""

from __future__ import annotations

import json

import pytest

from .snapshot_reference import TALLY

pytestmark = pytest.mark.integration

MIN_CASES = 300


def test_the_corpus_found_no_crash_and_no_silent_accept(tmp_path_factory):
    report = TALLY.report()
    path = tmp_path_factory.getbasetemp() / "snapshot-reliability.json"
    path.write_text(json.dumps(report, indent=2, sort_keys=True))
    print(f"\nsnapshot reliability corpus ({path}):\n{json.dumps(report, indent=2)}")
    assert report["cases"] >= MIN_CASES, "the corpus did not run (run the whole package)"
    assert report["crashes"] == 0, report["first_failures"]
    assert report["silently_accepted"] == 0, report["first_failures"]
    assert report["wrongly_quarantined"] == 0, report["first_failures"]
    assert report["quarantined"] > 0 and report["accepted"] > 0
    assert report["named_file_errors"] > 0 and report["step_errors"] > 0

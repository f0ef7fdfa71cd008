"""The ``details`` table of asset metadata: one row per entry, values a reader can copy."""

from assets.details import details_table


def test_details_rows_render_values_as_written():
    table = details_table({"fingerprint": "ab" * 32, "settings": {"num_steps": 3},
                           "layers": [1, 2], "run id": None, "reason": "a | b"})
    rows = table.splitlines()
    assert rows[:2] == ["| | |", "|---|---|"] and len(rows) == 7
    assert rows[2] == f"| fingerprint | {'ab' * 32} |"  # in full: the headline shows 12
    assert rows[3] == '| settings | `{"num_steps": 3}` |' and rows[4] == "| layers | `[1, 2]` |"
    assert rows[5] == "| run id | – |" and rows[6] == "| reason | a \\| b |"  # one cell

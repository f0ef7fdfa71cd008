"""The ``details`` entry of an asset's metadata: what a reader rarely needs, in one table.

Each asset leads its metadata with the few numbers that matter, rounded; fingerprints,
keys, settings and plumbing go into one two-column Markdown table after them.
"""

import json


def details_table(rows: dict) -> str:
    """What a reader rarely needs, folded into one two-column table."""
    return "\n".join(["| | |", "|---|---|",
                      *(f"| {k} | {_cell(v)} |" for k, v in rows.items())])


def _cell(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, dict | list | tuple):
        return f"`{json.dumps(value, separators=(', ', ': '))}`"
    return str(value).replace("|", "\\|")

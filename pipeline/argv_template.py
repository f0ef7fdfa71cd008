"""Command templates an operator writes in configuration: an argv list (never a shell line)
whose items may hold ``{name}`` placeholders, filled item by item when the command runs.

``{{`` and ``}}`` are literal braces. A placeholder is a plain name (no format spec or
conversion). A *list* placeholder stands alone as a whole item and expands into zero or more
items (e.g. ``{speculative_args}``: the engine's speculative flags, none for no drafter).
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence


def placeholders(argv: Sequence[str]) -> set[str]:
    """The placeholder names used in ``argv``; a malformed one is a ``ValueError``."""
    names = set()
    for arg in argv:
        for _, name, spec, conv in string.Formatter().parse(arg):
            if name is not None:
                if spec or conv or not name.isidentifier():
                    raise ValueError(f"placeholder {{{name}}} in {arg!r} must be a plain name")
                names.add(name)
    return names


def check_template(argv: Sequence[str], known: set[str] | frozenset[str], *,
                   required: Sequence[str] = (), lists: Sequence[str] = (),
                   what: str = "command") -> None:
    """Refuse, naming ``what``, an empty template, an unknown or missing placeholder, or a
    list placeholder that is not a whole item."""
    if not argv or not argv[0]:
        raise ValueError(f"{what} is empty: give an argv list, e.g. [\"python\", \"-m\", ...]")
    used = placeholders(argv)
    unknown = used - set(known)
    if unknown:
        raise ValueError(f"{what} uses unknown placeholders {sorted(unknown)}; known: "
                         f"{sorted(known)}")
    missing = [name for name in required if name not in used]
    if missing:
        raise ValueError(f"{what} must use {', '.join('{' + n + '}' for n in missing)}")
    for name in lists:
        embedded = [a for a in argv if f"{{{name}}}" in a and a != f"{{{name}}}"]
        if embedded:
            raise ValueError(f"{what}: {{{name}}} expands into several items and must stand "
                             f"alone as one, not inside {embedded[0]!r}")


def expand(argv: Sequence[str], values: Mapping[str, object],
           lists: Mapping[str, Sequence[str]] = {}) -> list[str]:  # noqa: B006 (read only)
    """``argv`` with every placeholder filled: a whole-item list placeholder becomes its
    items, every other item is formatted with ``values``."""
    out: list[str] = []
    for arg in argv:
        whole = arg[1:-1] if arg.startswith("{") and arg.endswith("}") else None
        if whole in lists:
            out.extend(lists[whole])
        else:
            out.append(arg.format_map(values))
    return out

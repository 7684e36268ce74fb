"""The host time of ``BannedRow.check`` per round: a real tokenizer, a long word list, blocks of a few tokens.

``BannedRow.check`` matches each round's new tokens against the banned words (``engine.banned_rows``). Since
2026-11-29 it judges them one at a time, as the rounds of a target-only decoder would (one ``violation`` and one
``num_safe`` per token), where it judged the block at once before. This script times it at two revisions on the
same text: the README's first ``--tokens`` tokens, fed ``--block`` at a time, with the 1,000 case-insensitive words
of ``2026-11-23-banned-words-1000.txt``; the best of ``--repeats`` passes, in µs a check. It loads each revision's
``engine/banned_rows.py`` with ``git show`` (the rest of the package is the working tree's).

Usage (from the project root; the tokenizer folder of any first load of the packaged models)::

    python docs/benchmarks/banned_check_cost.py \\
        --tokenizer ~/.cache/specdecode/dense/qwen2.5-coder-1.5b-instruct-bfloat16 --revisions 8a05b59,HEAD
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))


def load(revision: str, folder: Path):
    """``engine/banned_rows.py`` at ``revision``, as a module of its own."""
    source = subprocess.run(["git", "show", f"{revision}:src/specdecode/engine/banned_rows.py"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout
    path = folder / f"banned_rows_{revision.replace('/', '_')}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True, help="a folder with tokenizer files")
    parser.add_argument("--revisions", default="8a05b59,HEAD")
    parser.add_argument("--tokens", type=int, default=3000)
    parser.add_argument("--block", type=int, default=5, help="new tokens a round (γ + 1 when all are accepted)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from specdecode.engine.banned_words import BannedWords, read_banned_words

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    words = read_banned_words(ROOT / "docs/benchmarks/2026-11-23-banned-words-1000.txt")
    ids = tok((ROOT / "README.md").read_text())["input_ids"][: args.tokens]
    print(f"{len(words)} words (case-insensitive), {len(ids)} tokens of README.md, {args.block} a check")
    with tempfile.TemporaryDirectory() as folder:
        for revision in args.revisions.split(","):
            module, best = load(revision, Path(folder)), None
            for _ in range(args.repeats):
                row = module.BannedRow(BannedWords(words, ignore_case=True).matcher(tok), len(tok), 10)
                output, checks, rollbacks = [], 0, 0
                t0 = time.perf_counter()
                for at in range(0, len(ids), args.block):
                    output.extend(ids[at : at + args.block])
                    rollbacks += row.check(output, None)[1] is not None
                    checks += 1
                elapsed = time.perf_counter() - t0
                best = elapsed if best is None else min(best, elapsed)
            print(f"{revision}: {best / checks * 1e6:.1f} µs a check ({checks} checks, {rollbacks} rollbacks)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Issue 28's size bar, counted: the lines of ``engine/`` and ``drafters/`` at two revisions, split into code,
docstrings and comments, and by the issue that added each module.

Issue 28 asks for ``engine/`` plus ``drafters/`` "smaller than today's 5.0k lines, with every feature kept"; its
"today" is 25df2e7. Since then the tree-verification issue (29), the llama.cpp target issue (30) and the sampling
controls issue (31) added modules of their own to the same folders. This script counts, per module, with
``tokenize`` and ``ast`` (no import of the code):

- lines: every line of the file;
- code: lines holding a token that is not a comment and not part of a docstring (module, class or function);
- docs: lines of docstrings; comments: lines holding only a comment; blank lines are the rest.

and marks the modules that later issues added (``LATER``, written by hand from ``git log --diff-filter=A`` and
what each module is for: not every adding commit names its issue); every other module new since ``--before`` is
shown as issue 28's or a split of an older module. It reads files with ``git show``, so it needs this repository's
history.

Usage (from the project root)::

    python docs/benchmarks/engine_size.py --before 25df2e7 --after HEAD
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import subprocess
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("src/specdecode/engine", "src/specdecode/drafters")
#: Modules added by later issues than 28, by the issue that added them (their commit messages name it).
LATER = {
    "engine/tree.py": 29, "engine/tree_sampling.py": 29, "engine/cost_model.py": 29, "engine/speculation_cost.py": 29,
    "drafters/draft_tree.py": 29, "drafters/token_recycling.py": 29, "drafters/datastore.py": 29,
    "engine/runner_target.py": 30, "engine/processors.py": 31,
}


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout


def count(source: str) -> dict[str, int]:
    """{"lines", "code", "docs", "comments"} of one module's source."""
    lines = source.splitlines()
    docs: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            value = first.value if isinstance(first, ast.Expr) else None
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docs.update(range(first.lineno, first.end_lineno + 1))
    code: set[int] = set()
    comments: set[int] = set()
    skip = (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER, tokenize.COMMENT)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments.add(token.start[0])
        elif token.type not in skip:
            code.update(n for n in range(token.start[0], token.end[0] + 1) if n not in docs)
    return {"lines": len(lines), "code": len(code), "docs": len(docs),
            "comments": len(comments - code - docs)}


def modules(rev: str) -> dict[str, dict[str, int]]:
    out = {}
    for path in git("ls-tree", "-r", "--name-only", rev, *FOLDERS).split():
        if path.endswith(".py"):
            out[re.sub(r"^src/specdecode/", "", path)] = count(git("show", f"{rev}:{path}"))
    return out


def total(rows: dict[str, dict[str, int]], keep=lambda name: True) -> dict[str, int]:
    keys = ("lines", "code", "docs", "comments")
    return {k: sum(v[k] for name, v in rows.items() if keep(name)) for k in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default="25df2e7", help="issue 28's 'today'")
    parser.add_argument("--after", default="HEAD")
    args = parser.parse_args()
    before, after = modules(args.before), modules(args.after)
    after_rev = git("rev-parse", "--short", args.after).strip()
    print(f"engine/ + drafters/: {args.before} against {args.after} ({after_rev})")
    print("\n| module | lines before | lines after | code after | docstrings after | comments after | added by |\n"
          "|---|---:|---:|---:|---:|---:|---|")
    for name in sorted(set(before) | set(after)):
        b, a = before.get(name), after.get(name)
        who = f"issue {LATER[name]}" if name in LATER else ("" if b else "issue 28 (or a split)")
        cells = [str(b["lines"]) if b else "–", *(str(a[k]) if a else "–" for k in ("lines", "code", "docs",
                                                                                     "comments"))]
        print(f"| {name} | {' | '.join(cells)} | {who} |")
    print("\n| part | lines | code | docstrings | comments |\n|---|---:|---:|---:|---:|")
    parts = ((f"all, {args.before}", before, lambda n: True), (f"all, {args.after}", after, lambda n: True),
             (f"modules of issues 29-31, {args.after}", after, lambda n: n in LATER),
             (f"the rest, {args.after}", after, lambda n: n not in LATER))
    for label, rows, keep in parts:
        t = total(rows, keep)
        print(f"| {label} | {t['lines']:,} | {t['code']:,} | {t['docs']:,} | {t['comments']:,} |")


if __name__ == "__main__":
    main()

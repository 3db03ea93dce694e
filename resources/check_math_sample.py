"""Check ``resources/samples/math_word_problems.jsonl``: every record well formed, every calculation right.

Dev script, not part of the workflow. Usage (from the repository root)::

    python resources/check_math_sample.py [resources/samples/math_word_problems.jsonl]

The file is in the GSM8K record format, one JSON object per line: ``{"id": "math-NNN", "question": str,
"answer": str}``. The answer is step-by-step reasoning with each calculation written inline as
``<<expression=result>>`` followed by the result again in the text (``48 / 2 = <<48/2=24>>24``), and a last line
``#### <number>``, as GSM8K writes them. The problems and answers are original, not taken from GSM8K.

Checked, for every record: the id is ``math-NNN`` and unique; the question is non-empty and has no ``<<``;
there are 2 to 6 reasoning lines before the ``####`` line; every ``<<expression=result>>`` evaluates (only
numbers, ``+ - * /`` and parentheses) to its result, and the number written right after it equals that result;
the final number equals one of the calculated results or appears in the last reasoning line (``... so they
need 4 buses``). Prints one line per problem found and exits 1 if there is any, else prints a summary.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import re
import sys
from pathlib import Path

CALC = re.compile(r"<<([^<>=]+)=([^<>=]+)>>\$?(-?[\d,]*\.?\d+)?")
FINAL = re.compile(r"#### (-?\d+(?:\.\d+)?)")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
ID = re.compile(r"math-\d{3}")
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate(expr: str) -> float:
    """The value of an arithmetic expression of numbers, ``+ - * /``, unary minus and parentheses."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"not plain arithmetic: {expr!r}")

    return ev(ast.parse(expr.strip(), mode="eval"))


def close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(1.0, abs(a), abs(b))


def check_record(rec: dict) -> list[str]:
    """The problems of one record (empty when it is fine)."""
    problems = []
    if not isinstance(rec.get("question"), str) or not rec["question"].strip() or "<<" in rec["question"]:
        problems.append("question missing, empty or containing <<")
    answer = rec.get("answer")
    if not isinstance(answer, str):
        return problems + ["answer missing"]
    lines = answer.strip().split("\n")
    final = FINAL.fullmatch(lines[-1])
    if not final:
        return problems + [f"last line {lines[-1]!r} is not '#### <number>'"]
    steps = lines[:-1]
    if not 2 <= len(steps) <= 6:
        problems.append(f"{len(steps)} reasoning lines, not 2-6")
    results = []
    for expr, result, written in CALC.findall(answer):
        try:
            value = evaluate(expr)
        except (ValueError, SyntaxError, ZeroDivisionError) as err:
            problems.append(f"<<{expr}={result}>>: {err}")
            continue
        if not close(value, float(result)):
            problems.append(f"<<{expr}={result}>>: the expression is {value:g}")
        if not written or not close(float(written.replace(",", "")), float(result)):
            problems.append(f"<<{expr}={result}>> is followed by {written or 'no number'!r}, not its result")
        results.append(float(result))
    if not results:
        problems.append("no <<expression=result>> calculation")
    target = float(final.group(1))
    last_line_numbers = [float(n) for n in NUMBER.findall(CALC.sub("", steps[-1]))] if steps else []
    if not any(close(target, r) for r in results + last_line_numbers):
        problems.append(f"final answer {final.group(1)} is neither a calculated result nor in the last step")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path", nargs="?", default=str(Path(__file__).parent / "samples" / "math_word_problems.jsonl"))
    args = ap.parse_args(argv)
    seen: set[str] = set()
    bad = records = calcs = 0
    for lineno, line in enumerate(Path(args.path).read_text(encoding="utf-8").splitlines(), 1):
        rec = json.loads(line)
        records += 1
        sid = rec.get("id")
        problems = check_record(rec)
        if not isinstance(sid, str) or not ID.fullmatch(sid) or sid in seen:
            problems.append(f"id {sid!r} is not a new math-NNN")
        seen.add(sid)
        calcs += len(CALC.findall(rec.get("answer") or ""))
        for p in problems:
            print(f"{args.path}:{lineno} ({sid}): {p}")
        bad += bool(problems)
    if bad:
        print(f"{bad} of {records} records have problems")
        return 1
    print(f"{records} records, {calcs} calculations: all correct")
    return 0


if __name__ == "__main__":
    sys.exit(main())

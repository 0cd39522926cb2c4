"""Issue 27's size limits for the benchmark and command-line modules (``specdial/bench/``,
``specdial/cli*.py`` and the commands' own modules): no file over 500 lines, no function over 80 (docstring included), so that
they stay split along responsibilities."""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "python" / "specdial"
FILES = sorted([*(PKG / "bench").glob("*.py"), *PKG.glob("cli*.py"),
                *(PKG / name for name in ("generate_cmd.py", "replay.py", "policy_sim.py"))])


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PKG)))
def test_file_and_function_sizes(path):
    text = path.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 500, f"{path.name}: {len(text.splitlines())} lines > 500"
    long = [(n.name, n.lineno, n.end_lineno - n.lineno + 1)
            for n in ast.walk(ast.parse(text))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > 80]
    assert not long, f"{path.name}: functions over 80 lines (name, line, length): {long}"


def test_the_limits_see_the_modules():
    names = {p.name for p in FILES}
    assert {"driver.py", "compare.py", "cli.py", "http_driver.py", "configurations.py"} <= names

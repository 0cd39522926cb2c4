"""Issue 27's size limits for the whole package (``python/specdial``): no file over 500 lines,
no function over 80 (docstring included), so that modules stay split along responsibilities
(docs/ARCHITECTURE.md names the seams)."""

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "python" / "specdial"
FILES = sorted(PKG.rglob("*.py"))
MAX_FILE_LINES, MAX_FUNCTION_LINES = 500, 80


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(PKG)))
def test_file_and_function_sizes(path):
    text = path.read_text(encoding="utf-8")
    lines = len(text.splitlines())
    assert lines <= MAX_FILE_LINES, f"{path.name}: {lines} lines > {MAX_FILE_LINES}"
    long = [(n.name, n.lineno, n.end_lineno - n.lineno + 1)
            for n in ast.walk(ast.parse(text))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{path.name}: functions over {MAX_FUNCTION_LINES} lines (name, line, " \
                     f"length): {long}"


def test_the_limits_see_every_layer():
    folders = {p.parent.name for p in FILES}
    assert {"bench", "config", "distributed", "engine", "launch", "models", "server",
            "worker", "attention"} <= folders
    assert len(FILES) > 100

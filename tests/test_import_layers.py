"""The import contracts (docs/ARCHITECTURE.md, "Layers"; ``[tool.importlinter]`` and
``[tool.ruff]`` in pyproject.toml) hold for the package, and each one fails when code breaks it:
an import added to a copy of the package (upward, function-local, TYPE_CHECKING-only, between
independent siblings, closing a cycle, reaching a private name, or a module given no layer) makes
``lint-imports`` name it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _tool(name: str) -> Path:
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{name} is not installed beside {sys.executable}: install the test extra "
                    "(pip install -e '.[test]')")
    return path


def _run(tool: str, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(cwd / "python") + os.pathsep + str(cwd)}
    return subprocess.run([str(_tool(tool)), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def _copy(dst: Path) -> Path:
    """The package's sources, pyproject.toml and the custom contract, copied under ``dst``."""
    def sources_only(folder: str, names: list[str]) -> set[str]:
        return {n for n in names if n == "__pycache__" or (
            Path(folder, n).is_file() and not n.endswith((".py", ".pyi")))}

    shutil.copytree(ROOT / "python" / "specdial", dst / "python" / "specdial",
                    ignore=sources_only)
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")
    (dst / "tools").mkdir()
    shutil.copy(ROOT / "tools" / "import_contracts.py", dst / "tools" / "import_contracts.py")
    return dst


def test_the_package_keeps_every_import_contract():
    out = _run("lint-imports", ROOT, "--no-cache")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 kept, 0 broken" in out.stdout, out.stdout


def test_ruff_private_name_rule_passes_on_the_package():
    out = _run("ruff", ROOT, "check")
    assert out.returncode == 0, out.stdout + out.stderr


# (file under specdial/, text appended, contract id, what the report must name)
BACK_IMPORTS = {
    "config imports the engine": (
        "config/engine.py", "from specdial.engine import loop\n", "layers",
        "specdial.config.engine -> specdial.engine.loop"),
    "models import the worker, for type checking only": (
        "models/batch.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from specdial.worker.inputs import DecodeInput\n", "layers",
        "specdial.models.batch -> specdial.worker.inputs"),
    "the collectives import launch code, inside a function": (
        "distributed/channel.py", "\ndef _late():\n    from specdial.launch import node\n",
        "layers", "specdial.distributed.channel -> specdial.launch.node"),
    "the server imports launch code (independent siblings)": (
        "server/chat.py", "from specdial.launch import launcher\n", "layers",
        "specdial.server.chat -> specdial.launch.launcher"),
    "a new top-level module has no layer": (
        "stray.py", "X = 1\n", "layers", "specdial.stray"),
    "the group and its channel import each other": (
        "distributed/group.py", "from specdial.distributed import channel\n", "acyclic",
        "specdial.distributed"),
    "a private name of another module": (
        "models/llama.py", "from specdial.attention.base import _hidden\n", "private-names",
        "specdial.models.llama -> specdial.attention.base._hidden"),
}


@pytest.mark.parametrize("case", list(BACK_IMPORTS))
def test_a_broken_rule_fails_the_contracts(tmp_path, case):
    rel, text, contract, named = BACK_IMPORTS[case]
    copy = _copy(tmp_path)
    target = copy / "python" / "specdial" / rel
    with open(target, "a", encoding="utf-8") as f:
        f.write(text)
    out = _run("lint-imports", copy, "--no-cache", "--contract", contract)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "BROKEN" in out.stdout and named in out.stdout, out.stdout


def test_ruff_flags_a_private_name_of_a_dependency(tmp_path):
    copy = _copy(tmp_path)
    with open(copy / "python" / "specdial" / "models" / "llama.py", "a") as f:
        f.write("from torch.nn.modules.module import _addindent\n")
    out = _run("ruff", copy, "check")
    assert out.returncode == 1 and "`_addindent`" in out.stdout, out.stdout + out.stderr


def test_the_old_config_path_is_the_same_config():
    """``specdial.engine.config`` only re-exports the bottom layer's objects (for code written
    before the move): the same class and functions, not copies."""
    import specdial.config as config
    import specdial.engine.config as old

    for name in old.__all__:
        assert getattr(old, name) is getattr(config, name), name
    from specdial.worker import graph_tables

    assert graph_tables.normalize_graph_bs is config.normalize_graph_bs
    assert graph_tables.default_cuda_graph_bs is config.default_cuda_graph_bs


def test_private_name_imports_reads_every_kind_of_import_from(tmp_path):
    """The private-names contract's reader: absolute, relative and function-local imports of a
    private name count; dunders, private modules (``from pkg import _ext``) and a module's own
    names do not."""
    from tools.import_contracts import private_name_imports

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    files = {"__init__.py": "from pkg import _ext\n", "_ext.py": "", "a.py": "_x = 1\n",
             "b.py": "from pkg.a import _x, __doc__\nfrom .a import _x as y\n"
                     "def f():\n    from pkg.a import _x\n",
             "c.py": "from pkg.c import _self\nfrom os import _exit\n"}
    for name, text in files.items():
        (pkg / name).write_text(text)
    modules = {"pkg", "pkg._ext", "pkg.a", "pkg.b", "pkg.c"}
    assert private_name_imports("pkg", pkg, modules) == [
        ("pkg.b", "pkg.a", "_x", 1), ("pkg.b", "pkg.a", "_x", 2), ("pkg.b", "pkg.a", "_x", 4)]


def test_a_stale_ignored_import_warns_without_failing(tmp_path):
    """Ignored imports that no longer exist (an owner removed them) are reported, not fatal."""
    copy = _copy(tmp_path)
    conf = copy / "pyproject.toml"
    stale = '"specdial.config.engine -> specdial.models.llama",'
    text = conf.read_text()
    start = text.index('type = "private_names"\n') + len('type = "private_names"\n')
    end = text.find("\n[", start)
    ignores = text.find("ignore_imports = [\n", start, end)
    if ignores < 0:  # every temporary entry is gone: give the contract one
        text = text[:start] + f"ignore_imports = [\n    {stale}\n]\n" + text[start:]
    else:
        at = ignores + len("ignore_imports = [\n")
        text = text[:at] + f"    {stale}\n" + text[at:]
    conf.write_text(text)
    out = _run("lint-imports", copy, "--no-cache", "--contract", "private-names")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "specdial.config.engine -> specdial.models.llama" in out.stdout + out.stderr

"""The .pyi stubs agree with the compiled module (mypy's stubtest), and py.typed ships."""

import os
import subprocess
import sys
from pathlib import Path

import specdial
from timeouts import scaled


def test_stubtest_passes():
    proc = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "specdial._core", "--ignore-missing-stub"],
        capture_output=True,
        text=True,
        timeout=scaled(300),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_stubtest_notices_a_missing_name(tmp_path):
    """The check can fail: a stub that lacks a runtime class is reported."""
    pkg = Path(specdial.__file__).parent
    stub = (pkg / "_core.pyi").read_text()
    line = "    def slot_states(self) -> list[tuple[int, int, float, int]]: ...\n"
    assert line in stub
    broken = tmp_path / "specdial"
    broken.mkdir()
    (broken / "__init__.pyi").write_text("")
    (broken / "_core.pyi").write_text(stub.replace(line, ""))
    proc = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "specdial._core"],
        capture_output=True,
        text=True,
        timeout=scaled(300),
        env={**os.environ, "MYPYPATH": str(tmp_path)},
    )
    assert proc.returncode != 0
    assert "specdial._core.AdaptiveSpeculativeParams.slot_states is not present in stub" in proc.stdout, proc.stdout


def test_py_typed_ships():
    assert (Path(specdial.__file__).parent / "py.typed").exists()


def test_type_checkers_see_the_engine_class(tmp_path):
    """``specdial.Engine`` is imported lazily at run time; mypy must still see the class
    (issue 13: it saw ``object``) and its offline API."""
    src = tmp_path / "use_engine.py"
    src.write_text("import specdial\n"
                   "reveal_type(specdial.Engine)\n"
                   "engine = specdial.Engine(model_path=None)\n"
                   "reveal_type(engine.async_generate)\n")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", str(src), "--follow-imports=silent",
         "--ignore-missing-imports", "--cache-dir", str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=scaled(600))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "-> specdial.engine.core.Engine" in proc.stdout, proc.stdout
    assert "return_logprob: bool" in proc.stdout, proc.stdout

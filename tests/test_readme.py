"""Every command and code block of the README runs (issue 26), at small sizes, so the README
cannot go stale.

How a block is run (generic, so new blocks are covered without touching this file):

- ```bash blocks: lines joined at a trailing backslash, ``#`` comments dropped, ``&&`` chains
  split; each command runs with ``bash`` in a scratch directory that links the repository's
  top-level entries (outputs such as ``cost_table.json`` land there, not in the checkout).
  ``.venv/bin/`` and a leading ``python``/``python3`` become this interpreter's; ``[...]``
  (optional arguments in usage lines) is dropped; ``curl`` fails on an HTTP error.
  Environment setup and the Rust builds (creating the venv, ``pip install``, ``cargo test``,
  ``cargo bench``, ``pytest``: the suite this test belongs to; CI runs the first ones,
  ``.ci/run``) is not run here, and is listed.
- Sizes: :data:`SMALL` sets options per subcommand (``generate --max-new-tokens 8``, ...),
  replacing the README's value or adding the option.
- ``specdial serve`` starts in the background with ``--port 0`` and reports the free port it
  bound (:mod:`serve_process`; the README's port is replaced by it everywhere in the block); the block's next commands (``curl``) run against it once
  ``/health`` answers; it is stopped with SIGTERM at the end of the block and must exit 0.
- Placeholder files the README names (``trace.jsonl``) are copied from ``examples/``.
- ```python blocks run as a script with this interpreter, ``"max_new_tokens": N`` set to 8.
- A block preceded by ``<!-- readme-test: skip: REASON -->`` is not run; the reason must be one
  of :data:`SKIP_REASONS` (a GPU, several nodes, placeholder model paths), never its duration;
  the skipped blocks are listed by :func:`test_skipped_blocks_have_an_allowed_reason`.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from serve_process import start_server
from timeouts import scaled

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BIN = Path(sys.executable).parent
SKIP_MARK = re.compile(r"<!--\s*readme-test:\s*skip:\s*(.+?)\s*-->")
#: What may keep a block from running here: needs a GPU, several machines, or model paths that
#: are placeholders for the user's own.
SKIP_REASONS = ("gpu", "multi-node", "placeholder model paths")
#: Setup commands: not run here (they install the package or run this suite; CI runs them).
SETUP = re.compile(r"^(python3? -m venv|\S*pip install|cargo test|cargo bench|"
                   r"\S*python -m pytest|\S*pytest\b)")
#: Small sizes per subcommand: option -> value (replaced, or added when absent).
SMALL: dict[tuple[str, ...], dict[str, str]] = {
    ("generate",): {"--max-new-tokens": "8"},
    ("policy", "simulate"): {"--segments": "400"},
    ("bench", "cost-table"): {"--batch-sizes": "1,2", "--contexts": "16", "--steps": "0,1",
                              "--n-warmup": "0", "--n-measure": "1"},
}
#: Bench scripts' small sizes (script name -> options).
SMALL_SCRIPTS: dict[str, dict[str, str]] = {
    "policy_py.py": {"--iterations": "200", "--rounds": "1"},
    "iteration_profile.py": {"--concurrency": "1", "--configs": "no-spec,adaptive",
                             "--max-new-tokens": "8", "--threads": "1"},
    "prefix_cache_ab.py": {"--repetitions": "1", "--conversations": "1",
                           "--max-new-tokens": "4", "--groups": "1", "--per-group": "2",
                           "--system-prompt-len": "32", "--question-len": "4"},
}
FIXTURES = {"trace.jsonl": ROOT / "examples" / "sample_trace.jsonl"}
TIMEOUT_S = scaled(300)  # idle-machine seconds x the suite's scale (tests/timeouts.py)


@dataclass
class Block:
    lang: str
    text: str
    line: int
    skip: str | None

    @property
    def id(self) -> str:
        return f"{self.lang}@L{self.line}"


def readme_blocks() -> list[Block]:
    """The README's ```bash and ```python blocks, each with the skip reason of the comment
    right before it (None if none)."""
    lines = README.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\w+)\s*$", lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while not lines[j].startswith("```"):
            j += 1
        prev = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        mark = SKIP_MARK.search(prev)
        if m.group(1) in ("bash", "python"):
            blocks.append(Block(m.group(1), "\n".join(lines[i + 1:j]), i + 1,
                                mark.group(1) if mark else None))
        i = j + 1
    return blocks


def commands(text: str) -> list[str]:
    """Shell commands of a bash block: continuations joined, comments dropped, ``&&`` split."""
    joined = re.sub(r"\\\n\s*", " ", text)
    joined = re.sub(r"\s*\[--[^\]]*\]", "", joined)  # optional arguments of a usage line
    out = []
    for line in joined.splitlines():
        part: list[str] = []
        for word in shlex.split(line, comments=True) + ["&&"]:
            if word == "&&":
                if part:
                    out.append(shlex.join(part))
                part = []
            else:
                part.append(word)
    return out


def _set_options(words: list[str], options: dict[str, str]) -> list[str]:
    words = list(words)
    for opt, value in options.items():
        if opt in words:
            words[words.index(opt) + 1] = value
        else:
            words += [opt, value]
    return words


def small(cmd: str, port: int) -> str:
    """``cmd`` at small sizes, with this interpreter and the free ``port`` (module docstring)."""
    cmd = cmd.replace(".venv/bin/", f"{BIN}/")
    words = shlex.split(cmd)
    if words[0] in ("python", "python3"):
        words[0] = sys.executable
    if Path(words[0]).name == "specdial":
        sub = tuple(w for w in words[1:3] if not w.startswith("-"))
        for key, options in SMALL.items():
            if sub[:len(key)] == key and "--help" not in words:
                words = _set_options(words, options)
        if sub[:1] == ("serve",):
            # info: uvicorn's start-up line names the port a --port 0 server got
            words = _set_options(words, {"--port": str(port), "--log-level": "info"})
    for name, options in SMALL_SCRIPTS.items():
        if len(words) > 1 and Path(words[1]).name == name:
            words = _set_options(words, options)
    if words[0] == "curl":
        words[1:1] = ["--fail", "--max-time", f"{scaled(120):g}"]
    return re.sub(r"(localhost|127\.0\.0\.1):\d+", f"127.0.0.1:{port}", shlex.join(words))


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    for entry in ROOT.iterdir():
        if entry.name not in (".git",):
            (tmp_path / entry.name).symlink_to(entry)
    for name, src in FIXTURES.items():
        if not (tmp_path / name).exists():
            (tmp_path / name).write_bytes(src.read_bytes())
    return tmp_path


def _env(scratch: Path) -> dict[str, str]:
    return {**os.environ, "XDG_CACHE_HOME": str(scratch / ".cache"), "PYTHONUNBUFFERED": "1"}


BLOCKS = readme_blocks()


def test_the_readme_has_blocks_and_they_parse():
    assert len(BLOCKS) >= 5
    assert commands("a \\\n  b && c # note\n# only a comment\n") == ["a b", "c"]
    assert commands("x sim [--regime R] [--curve A|b.json] --y 1") == ["x sim --y 1"]
    assert small(".venv/bin/specdial generate 'x' --max-new-tokens 64", 1).endswith(
        "--max-new-tokens 8")
    assert small("curl -s localhost:30000/health", 5).startswith("curl --fail")
    assert "127.0.0.1:5/" in small("curl -s localhost:30000/health", 5)


def test_skipped_blocks_have_an_allowed_reason():
    skipped = [(b.id, b.skip) for b in BLOCKS if b.skip]
    print("README blocks not run here:", skipped)
    for block_id, reason in skipped:
        assert any(reason.lower().startswith(r) for r in SKIP_REASONS), (block_id, reason)


@pytest.mark.parametrize("block", [b for b in BLOCKS if not b.skip], ids=lambda b: b.id)
def test_readme_block_runs(block: Block, scratch: Path):
    env = _env(scratch)
    if block.lang == "python":
        code = re.sub(r'"max_new_tokens":\s*\d+', '"max_new_tokens": 8', block.text)
        proc = subprocess.run([sys.executable, "-c", code], cwd=scratch, env=env,
                              capture_output=True, text=True, timeout=TIMEOUT_S)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return
    port = 0  # the running server's, once one started
    server: subprocess.Popen | None = None
    log = scratch / "serve.log"
    not_run = []
    try:
        for raw in commands(block.text):
            if SETUP.match(raw):
                not_run.append(raw)
                continue
            cmd = small(raw, port)
            if re.search(r"specdial serve\b", cmd) and "--help" not in cmd:
                _stop(server, log)  # a block may start several servers, one after the other
                log = scratch / f"serve-{time.monotonic_ns()}.log"  # one per server
                # port 0: the server binds a free port itself and logs it (serve_process)
                server, port = start_server(["bash", "-c", f"exec {small(raw, 0)}"], log,
                                            timeout=300, cwd=scratch, env=env)
                continue
            proc = subprocess.run(["bash", "-c", cmd], cwd=scratch, env=env,
                                  capture_output=True, text=True, timeout=TIMEOUT_S)
            assert proc.returncode == 0, f"{raw}\n-> {cmd}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    finally:
        _stop(server, log)
    print("setup commands not run here (CI runs them):", not_run)


def _stop(server: subprocess.Popen | None, log: Path) -> None:
    """SIGTERM, then the server must drain and exit 0 within a minute (``log``: its output)."""
    if server is None or server.returncode is not None:
        return
    server.send_signal(signal.SIGTERM)
    try:
        rc = server.wait(timeout=scaled(60))
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
        raise
    assert rc == 0, log.read_text()[-3000:]

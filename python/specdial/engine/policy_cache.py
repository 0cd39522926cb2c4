"""The policy cache: what the ``goodput`` strategy learned on this machine, kept between runs.

Every engine used to start its cost model from nothing, so a short run (a CLI ``generate`` of
128 tokens is some 35 decode iterations) was mostly learning (issue 26). An adaptive engine with
the ``goodput`` strategy now saves what it learned at :meth:`specdial.Engine.shutdown` (the cost
model and the long-run acceptance counts, :meth:`specdial._core.Scheduler.export_policy_state`)
and the next engine with the same key starts from it.

- **Key**: the machine (host name, architecture, CPU model; the GPU's name on CUDA), the device
  type, the target and drafter (resolved directory plus the name, size and modification time of
  their weight and config files), the algorithm, the dtype, the torch thread count of the engine
  loop, the tensor-parallel size, the CUDA-graph sizes, whether steps 0 skips the draft extend,
  and specdial's version. The file is ``<dir>/<sha256 of the key, 24 hex>.json``.
- **Directory**: ``EngineConfig.policy_cache_dir``, else the user cache directory's
  ``specdial/policy`` (platformdirs' rule: ``$XDG_CACHE_HOME`` or ``~/.cache`` on Linux,
  ``~/Library/Caches`` on macOS, ``%LOCALAPPDATA%`` on Windows), read when the engine starts.
- **File**: ``{"format": 1, "key": {...}, "saved_at": ISO time, "state": {...}}``, written to a
  temporary file in the same directory and moved into place with ``os.replace`` (atomic: a
  reader never sees half a file). The state carries the Rust side's own ``version``.
- **Ignored with a warning** (logged on ``specdial.engine``; the engine then starts fresh): a
  file that does not parse, another ``format``, a key that differs from this engine's (a stale
  or copied file), a state the Rust side refuses (another version, values out of range). A
  cache that cannot be written is a warning too, never an error.

``EngineConfig.policy_cache=False`` (``--no-policy-cache``) neither reads nor writes.
:attr:`specdial.EngineStats.policy_cache` says what happened: ``"loaded"``, ``"none"`` (no
file yet), ``"ignored: <why>"``, ``"off"`` or ``"n/a: <why>"`` (no goodput policy, or an engine
built from modules, which has no files to key on).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("specdial.engine")

__all__ = ["FORMAT", "PolicyCache", "default_cache_dir", "model_fingerprint"]

#: Version of the cache file's layout (the Rust state carries its own version inside).
FORMAT = 1

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".json")


def default_cache_dir(environ: Any = None) -> Path:
    """``specdial/policy`` under the user's cache directory (platformdirs' ``user_cache_dir``
    rule, without the dependency): ``$XDG_CACHE_HOME`` (when absolute) or ``~/.cache`` on Linux
    and other Unix, ``~/Library/Caches`` on macOS, ``%LOCALAPPDATA%`` on Windows."""
    env = os.environ if environ is None else environ
    if sys.platform == "win32":
        base = Path(env.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
        return base / "specdial" / "Cache" / "policy"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "specdial" / "policy"
    xdg = env.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "specdial" / "policy"


def model_fingerprint(directory: Path | None) -> str | None:
    """A short hash of a model directory: its resolved path and the name, size and mtime of
    its weight and config files (so replaced weights make a new key). None for None."""
    if directory is None:
        return None
    d = Path(directory).resolve()
    items: list[Any] = [str(d)]
    try:
        for p in sorted(d.iterdir()):
            if p.is_file() and p.suffix in _WEIGHT_SUFFIXES:
                st = p.stat()
                items.append([p.name, st.st_size, st.st_mtime_ns])
    except OSError:
        pass
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def machine_key(device: Any) -> dict[str, Any]:
    """The machine part of the key: host, architecture, CPU model, and the GPU's name on CUDA."""
    key: dict[str, Any] = {"host": platform.node(), "arch": platform.machine(),
                           "cpu": _cpu_name(), "device": device.type}
    if device.type == "cuda":
        import torch

        key["gpu"] = torch.cuda.get_device_name(device)
    return key


@dataclass
class PolicyCache:
    """One engine's cache entry: where it lives, its key, and what loading it did."""

    path: Path | None
    key: dict[str, Any]
    status: str
    loaded_text: str | None = None

    @classmethod
    def disabled(cls, why: str) -> "PolicyCache":
        """An entry that neither reads nor writes; ``status`` is ``why``."""
        return cls(path=None, key={}, status=why)

    @classmethod
    def open(cls, scheduler: Any, *, enabled: bool, directory: str | None,
             key: dict[str, Any]) -> "PolicyCache":
        """Reads the entry for ``key`` and seeds ``scheduler``'s goodput policy from it (before
        the engine loop starts). Never raises for a bad or missing file: it logs a warning and
        the engine starts fresh."""
        if not enabled:
            return cls.disabled("off")
        if scheduler.export_policy_state() is None:
            return cls.disabled("n/a: the policy is not the adaptive goodput strategy")
        full_key = {"format": FORMAT, **key}
        digest = hashlib.sha256(json.dumps(full_key, sort_keys=True).encode()).hexdigest()[:24]
        root = Path(directory) if directory is not None else default_cache_dir()
        entry = cls(path=root / f"{digest}.json", key=full_key, status="none")
        entry._load(scheduler)
        return entry

    def _ignore(self, why: str) -> None:
        logger.warning("policy cache %s ignored (%s); the policy starts fresh", self.path, why)
        self.status = f"ignored: {why}"

    def _load(self, scheduler: Any) -> None:
        assert self.path is not None
        try:
            raw = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return
        except OSError as e:
            return self._ignore(f"unreadable: {e.strerror}")
        try:
            doc = json.loads(raw)
        except ValueError:
            return self._ignore("corrupt: not JSON")
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            got = doc.get("format") if isinstance(doc, dict) else None
            return self._ignore(f"format {got!r}, expected {FORMAT}")
        if doc.get("key") != self.key:
            return self._ignore("stale: saved for another machine, model or setting")
        text = json.dumps(doc.get("state"))
        try:
            scheduler.import_policy_state(text)
        except ValueError as e:
            return self._ignore(str(e))
        self.loaded_text = scheduler.export_policy_state()
        self.status = "loaded"
        logger.info("policy cache %s loaded (saved %s)", self.path, doc.get("saved_at"))

    def save(self, scheduler: Any) -> bool:
        """Writes what ``scheduler``'s policy learned, atomically (a temporary file in the same
        directory, then ``os.replace``). Skipped when nothing was measured or nothing changed
        since loading. Returns whether it wrote; a write error is a warning."""
        if self.path is None:
            return False
        text = scheduler.export_policy_state()
        if text is None or text == self.loaded_text:
            return False
        state = json.loads(text)
        if not state.get("cost", {}).get("observations"):
            return False
        doc = {"format": FORMAT, "key": self.key,
               "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "state": state}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(doc, f)
                os.replace(tmp, self.path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:
            logger.warning("policy cache %s not written: %s", self.path, e)
            return False
        self.loaded_text = text
        return True


def engine_key(engine: Any, cfg: Any, model_dir: Path, draft_dir: Path | None,
               algorithm: str | None, dtype: Any) -> dict[str, Any]:
    """The key of ``engine``'s cache entry (module docstring): what makes its costs differ."""
    import specdial

    return {"machine": machine_key(engine.device), "model": model_fingerprint(model_dir),
            "drafter": model_fingerprint(draft_dir), "algorithm": algorithm,
            "dtype": str(dtype).removeprefix("torch."),
            "threads": int(getattr(engine._loop, "_num_threads", 0)), "tp_size": cfg.tp_size,
            "cuda_graph_bs": engine.cuda_graph_bs,
            "skip_zero_step_draft_extend": cfg.skip_zero_step_draft_extend,
            "specdial": getattr(specdial, "__version__", None)}

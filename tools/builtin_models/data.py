"""Corpus, module split and tokenizer of the built-in models.

Corpus: every ``.py`` file under the running interpreter's standard library directory
(``sysconfig.get_paths()["stdlib"]``), except files inside a directory named
``site-packages``, ``dist-packages``, ``test``, ``tests`` or ``idle_test`` (so ``Lib/test``,
``unittest/test``, ``ctypes/test``, ``lib2to3/tests``, ``idlelib/idle_test``, ...) and files
that are not valid UTF-8.

Split rule (stable across machines and runs): a module, identified by its path relative to the
stdlib directory with ``/`` separators (``json/decoder.py``), is held out when
``int(sha1(path).hexdigest(), 16) % 20 == 0`` -- about 5% of the modules. Held-out modules are
never trained on (not even by the tokenizer); the benchmark prompts come from them.

Tokenizer: byte-level BPE (``tokenizers``), :data:`VOCAB_SIZE` entries including the
end-of-text token :data:`EOT` that separates files in the training stream.
"""

from __future__ import annotations

import hashlib
import json
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

EOT = "<|endoftext|>"
VOCAB_SIZE = 4096
HELD_OUT_MODULUS = 20  # 1 module in 20 (~5%) is held out
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})


@dataclass(frozen=True)
class Module:
    """One source file: ``path`` relative to the stdlib directory (``/`` separators)."""

    path: str
    text: str


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(path: str) -> bool:
    """The split rule: ``sha1(path) % 20 == 0`` (``path`` relative, ``/`` separators)."""
    return int(hashlib.sha1(path.encode()).hexdigest(), 16) % HELD_OUT_MODULUS == 0


def is_excluded(path: str) -> bool:
    """True for files inside an excluded directory (test packages, site-packages, ...)."""
    return any(part in EXCLUDED_DIRS for part in path.split("/")[:-1])


def load_modules(root: Path | None = None) -> list[Module]:
    """All corpus modules sorted by path (see the module docstring for the rule)."""
    root = root or stdlib_dir()
    out = []
    for file in sorted(root.rglob("*.py")):
        rel = file.relative_to(root).as_posix()
        if is_excluded(rel) or not file.is_file():
            continue
        try:
            text = file.read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.append(Module(rel, text))
    return out


@dataclass(frozen=True)
class Split:
    train: list[Module]
    held_out: list[Module]

    def summary(self) -> dict:
        return {
            "python_version": sys.version.split()[0],
            "stdlib_dir": str(stdlib_dir()),
            "modules": len(self.train) + len(self.held_out),
            "train_modules": len(self.train),
            "held_out_modules": len(self.held_out),
            "train_bytes": sum(len(m.text.encode()) for m in self.train),
            "held_out_bytes": sum(len(m.text.encode()) for m in self.held_out),
        }


def split_modules(modules: list[Module] | None = None) -> Split:
    modules = load_modules() if modules is None else modules
    return Split([m for m in modules if not is_held_out(m.path)],
                 [m for m in modules if is_held_out(m.path)])


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """Byte-level BPE trained on ``texts``; returns a ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok, out_dir: Path, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json to ``out_dir``."""
    from transformers import PreTrainedTokenizerFast

    out_dir.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, pad_token=EOT,
                                   unk_token=None, bos_token=None,
                                   model_max_length=model_max_length, clean_up_tokenization_spaces=False)
    fast.save_pretrained(str(out_dir))
    # a class name every transformers version (4.x and 5.x) maps to its fast tokenizer
    cfg_file = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_file.write_text(json.dumps(cfg, indent=2) + "\n")
    if not (out_dir / "special_tokens_map.json").exists():
        with open(out_dir / "special_tokens_map.json", "w") as f:
            json.dump({"eos_token": EOT, "pad_token": EOT}, f, indent=2)


def encode_stream(tok, modules: list[Module]) -> list[int]:
    """Token ids of ``modules`` concatenated, each file followed by the EOT token."""
    eot = tok.token_to_id(EOT)
    ids: list[int] = []
    for enc in tok.encode_batch([m.text for m in modules]):
        ids.extend(enc.ids)
        ids.append(eot)
    return ids

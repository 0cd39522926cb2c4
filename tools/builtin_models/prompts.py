"""Benchmark prompts from the held-out standard-library modules.

``python -m tools.builtin_models.prompts [--out python/specdial/bench/prompts] [--tokenizer DIR]`` regenerates
(deterministically, from the running interpreter's standard library and the split of
:mod:`tools.builtin_models.data`):

- ``code.jsonl``: one prompt per eligible function or method of the held-out modules. The
  prompt is the function (dedented) up to the end of its docstring, or, without a docstring,
  its signature and first two body lines (``kind`` ``"docstring"`` / ``"first_lines"``),
  without the final newline (BPE merges a newline with the next line's indentation, so a
  prompt ending in a bare newline token is out of distribution); ``reference`` holds the true
  continuation (that newline and the next lines, at most 12).
- ``prose.jsonl``: held-out docstrings of at least 80 characters that read as English prose.
  The prompt is ``'\"\"\"'`` plus the docstring's first words (about 40%, at least 8), so the
  model knows it is inside a docstring; ``reference`` holds the rest, ``text`` the whole.
- ``hard.jsonl``: prompts where drafting should fail often (``kind``): ``shuffled_lines``
  (a held-out function with its lines in random order), ``identifier_soup`` (random held-out
  identifiers and string literals in a list) and ``random_literals`` (a dict of random
  alphanumeric strings).

Every line has ``id``, ``prompt``, ``kind`` and ``module`` (and ``prompt_tokens`` when a
tokenizer is available). Prompts are capped at :data:`MAX_PROMPT_TOKENS` tokens so that a
prompt plus 128 generated tokens stays within the models' training length (384).
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import keyword
import random
import re
import string
import textwrap
import tokenize
from pathlib import Path
from typing import Any, Callable

import specdial
from tools.builtin_models import data

MAX_PROMPT_TOKENS = 224
MAX_PROMPT_CHARS = 1200  # used when no tokenizer is available
SEED = 2024
REPO_PROMPTS = Path(specdial.__file__).resolve().parent / "bench" / "prompts"  # package data


def _counter(tokenizer_dir: Path | None) -> Callable[[str], int] | None:
    if tokenizer_dir is None or not (tokenizer_dir / "tokenizer.json").is_file():
        return None
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    return lambda text: len(tok.encode(text).ids)


def _fits(prompt: str, count: Callable[[str], int] | None) -> int | None:
    """Token count if the prompt fits (char count without a tokenizer), else None."""
    if count is None:
        return len(prompt) if len(prompt) <= MAX_PROMPT_CHARS else None
    n = count(prompt)
    return n if n <= MAX_PROMPT_TOKENS else None


def _functions(module: data.Module):
    tree = ast.parse(module.text)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def code_prompts(modules: list[data.Module], count) -> list[dict[str, Any]]:
    out = []
    for m in modules:
        lines = m.text.splitlines(keepends=True)
        for fn in sorted(_functions(m), key=lambda n: n.lineno):
            start, end = fn.lineno - 1, fn.end_lineno or fn.lineno
            body = fn.body
            doc = ast.get_docstring(fn, clean=False)
            if doc is not None and isinstance(body[0], ast.Expr):
                cut = body[0].end_lineno or start + 1  # prompt ends after the docstring
                kind = "docstring"
            else:
                cut = (body[0].lineno - 1) + 2  # signature + first two body lines
                kind = "first_lines"
            if cut >= end:  # nothing left to continue
                continue
            snippet = textwrap.dedent("".join(lines[start:end]))
            split_at = sum(len(x) for x in textwrap.dedent("".join(lines[start:end])).splitlines(
                keepends=True)[:cut - start])
            # end the prompt at the end of a line, without its newline: BPE merges "\n" with
            # the next line's indentation, so a prompt ending in a bare "\n" token is
            # out of distribution (the model then starts a new top-level statement)
            split_at -= 1
            prompt, rest = snippet[:split_at], snippet[split_at:]
            ref_lines = rest.splitlines(keepends=True)[:13]  # "\n" + 12 lines
            if len([x for x in ref_lines if x.strip()]) < 2:
                continue
            n = _fits(prompt, count)
            if n is None:
                continue
            out.append({"prompt": prompt, "reference": "".join(ref_lines), "kind": kind,
                        "module": m.path, "name": fn.name, "lineno": fn.lineno,
                        "prompt_tokens": n})
    return out


_PROSE_OK = re.compile(r"[A-Za-z]")


def _is_prose(doc: str) -> bool:
    words = doc.split()
    if len(doc) < 80 or len(words) < 12:
        return False
    alpha_words = sum(1 for w in words if re.fullmatch(r"[A-Za-z][a-z]*[.,;:)]?", w))
    code_chars = sum(doc.count(c) for c in "{}[]=<>_*#\\|")
    return alpha_words / len(words) >= 0.6 and code_chars / len(doc) < 0.03


def prose_prompts(modules: list[data.Module], count) -> list[dict[str, Any]]:
    out = []
    for m in modules:
        tree = ast.parse(m.text)
        nodes = [tree] + sorted((n for n in ast.walk(tree)
                                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                   ast.ClassDef))), key=lambda n: n.lineno)
        for node in nodes:
            doc = ast.get_docstring(node, clean=True)
            if not doc or not _is_prose(doc):
                continue
            words = doc.split(" ")
            k = max(8, int(len(words) * 0.4))
            head, tail = " ".join(words[:k]), " ".join(words[k:])
            prompt = '"""' + head
            n = _fits(prompt, count)
            if n is None or not tail.strip():
                continue
            out.append({"prompt": prompt, "reference": " " + tail, "text": doc, "kind": "docstring",
                        "module": m.path, "name": getattr(node, "name", "<module>"),
                        "lineno": getattr(node, "lineno", 1), "prompt_tokens": n})
    return out


def _names_and_strings(modules: list[data.Module]) -> tuple[list[str], list[str]]:
    names, strings = set(), set()
    for m in modules:
        try:
            toks = list(tokenize.generate_tokens(io.StringIO(m.text).readline))
        except (tokenize.TokenError, SyntaxError):
            continue
        for t in toks:
            if t.type == tokenize.NAME and len(t.string) >= 4 and not keyword.iskeyword(t.string):
                names.add(t.string)
            elif (t.type == tokenize.STRING and 4 <= len(t.string) <= 24 and "\n" not in t.string
                  and t.string[0] in "'\""):
                strings.add(t.string)
    return sorted(names), sorted(strings)


def hard_prompts(modules: list[data.Module], code: list[dict[str, Any]], count,
                 per_kind: int = 40) -> list[dict[str, Any]]:
    rng = random.Random(SEED)
    out: list[dict[str, Any]] = []
    # shuffled lines of held-out functions (prompt + reference, 8..20 non-empty lines)
    pool = [c for c in code if 8 <= len([x for x in (c["prompt"] + c["reference"]).splitlines()
                                         if x.strip()]) <= 20]
    for c in rng.sample(pool, min(per_kind, len(pool))):
        body = [x for x in (c["prompt"] + c["reference"]).splitlines() if x.strip()]
        rng.shuffle(body)
        prompt = "\n".join(body)
        n = _fits(prompt, count)
        if n is not None:
            out.append({"prompt": prompt, "kind": "shuffled_lines", "module": c["module"],
                        "name": c["name"], "prompt_tokens": n})
    names, strings = _names_and_strings(modules)
    for i in range(per_kind):
        items = [rng.choice(names) if rng.random() < 0.5 else rng.choice(strings)
                 for _ in range(rng.randint(16, 28))]
        prompt = f"{rng.choice(names)} = [" + ", ".join(items) + ","
        n = _fits(prompt, count)
        if n is not None:
            out.append({"prompt": prompt, "kind": "identifier_soup", "module": "*",
                        "prompt_tokens": n})
    alphabet = string.ascii_letters + string.digits
    for i in range(per_kind):
        def word() -> str:
            return "".join(rng.choice(alphabet) for _ in range(rng.randint(3, 9)))
        pairs = [f"'{word()}': '{word()}'" for _ in range(rng.randint(6, 12))]
        prompt = f"{rng.choice(names)} = {{\n    " + ",\n    ".join(pairs) + ",\n    '"
        n = _fits(prompt, count)
        if n is not None:
            out.append({"prompt": prompt, "kind": "random_literals", "module": "*",
                        "prompt_tokens": n})
    return out


def write_jsonl(path: Path, rows: list[dict[str, Any]], prefix: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i, row in enumerate(rows):
            f.write(json.dumps({"id": f"{prefix}-{i:04d}", **row}, ensure_ascii=False) + "\n")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def generate(out: Path, tokenizer_dir: Path | None) -> dict[str, int]:
    count = _counter(tokenizer_dir)
    held = data.split_modules().held_out
    code = code_prompts(held, count)
    prose = prose_prompts(held, count)
    hard = hard_prompts(held, code, count)
    write_jsonl(out / "code.jsonl", code, "code")
    write_jsonl(out / "prose.jsonl", prose, "prose")
    write_jsonl(out / "hard.jsonl", hard, "hard")
    return {"code": len(code), "prose": len(prose), "hard": len(hard)}


def main(argv: list[str] | None = None) -> None:
    from tools.builtin_models.train import PACKAGE_BUILTIN

    ap = argparse.ArgumentParser(prog="python -m tools.builtin_models.prompts", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO_PROMPTS)
    ap.add_argument("--tokenizer", type=Path, default=PACKAGE_BUILTIN / "target",
                    help="tokenizer directory used to cap prompt lengths")
    args = ap.parse_args(argv)
    counts = generate(args.out, args.tokenizer)
    print(f"wrote {counts} to {args.out}")


if __name__ == "__main__":
    main()

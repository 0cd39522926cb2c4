"""Built-in models shipped with the package (see ``MODEL_CARD.md`` beside this file).

- ``target``: a Llama-architecture model trained on the CPython standard library source;
- ``draft``: a 1-layer draft model of the same family and tokenizer;
- ``eagle``: an EAGLE-1 head over the target's hidden states
  (:func:`specdial.models.load_eagle_head` layout);
- ``eagle-weak``: that head with seeded noise added to its weights, labelled for benchmarking a
  low-acceptance drafter (``python -m tools.builtin_models.weak_drafter``; never a default).

Regenerate them with ``python -m tools.builtin_models.train``.
"""

from __future__ import annotations

from pathlib import Path

BUILTIN_DIR = Path(__file__).resolve().parent
BUILTIN_MODELS = ("target", "draft", "eagle", "eagle-weak")


def builtin_model_path(name: str) -> Path:
    """Directory of the built-in model ``name`` (``"target"``, ``"draft"``, ``"eagle"`` or
    ``"eagle-weak"``).

    Raises ``ValueError`` for another name and ``FileNotFoundError`` when the directory or
    its ``config.json`` / ``model.safetensors`` is missing (e.g. a source checkout where the
    models were not trained yet).
    """
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {name!r}; choose one of {BUILTIN_MODELS}")
    path = BUILTIN_DIR / name
    missing = [f for f in ("config.json", "model.safetensors") if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"built-in model {name!r} is missing {', '.join(missing)} in {path}; "
            "train the built-in models with `python -m tools.builtin_models.train`")
    return path


__all__ = ["BUILTIN_DIR", "BUILTIN_MODELS", "builtin_model_path"]

"""Training and checking the built-in models (``python/specdial/builtin/``); not shipped.

Run from the repository root: ``python -m tools.builtin_models.train`` (all stages),
``python -m tools.builtin_models.gates`` (acceptance gates), ``python -m
tools.builtin_models.prompts`` (the bench prompt files), ``python -m
tools.builtin_models.weak_drafter`` (the weak EAGLE head ``builtin/eagle-weak``). The serving
package never imports this folder.
"""

"""``greedy(n)``: the sampling params of a greedy request of ``n`` new tokens.

Offline requests that name no ``temperature`` are sampled at 1.0 (SGLang's ``sgl.Engine``;
:mod:`specdial.engine.sampling_defaults`), so a test comparing against target-only greedy
decoding says ``temperature`` 0 through this."""
from __future__ import annotations

from typing import Any


def greedy(max_new_tokens: int, **sampling: Any) -> dict[str, Any]:
    """``{"temperature": 0.0, "max_new_tokens": max_new_tokens, **sampling}``."""
    return {"temperature": 0.0, "max_new_tokens": max_new_tokens, **sampling}

"""Large JSON bodies (logprobs of n choices) are encoded in parts in a thread
(:mod:`specdial.server.big_json`): the bytes are exactly ``JSONResponse``'s, bad floats raise
as there, and the routes that can make such bodies answer through it."""

from __future__ import annotations

import asyncio
import math

import pytest
from fastapi.responses import JSONResponse

from specdial.server.big_json import dumps_in_parts, json_response

BODIES = [
    {"id": "x", "choices": [{"index": 0, "text": "café 日本語 \"q\" \\ \n", "logprobs": {
        "tokens": ["a", "é"], "token_logprobs": [None, -0.5],
        "top_logprobs": [None, {"é": -0.5, "e": -1.25e-30, "\u2028": -3.0}],
        "text_offset": [0, 1]}, "finish_reason": "stop"}], "usage": {"prompt_tokens": 2}},
    [{"text": "", "meta_info": {"output_top_logprobs": [[[-0.1, 5, "x"]], [], None],
                                "finish_reason": {"type": "length", "length": 3}}}],
    {"nested": [[[[[[[{"deep": [1, 2.5, True, False, None]}]]]]]]], "empty": {}, "e": []},
    {1: "int keys are JSON strings", "a": {2: [3]}},
    [], {}, "plain", 7, None,
]


@pytest.mark.parametrize("body", BODIES)
def test_bytes_equal_json_response(body):
    assert dumps_in_parts(body) == JSONResponse(body).body


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_raise_as_json_response_does(bad):
    body = {"choices": [{"logprobs": {"top_logprobs": [{"a": bad}]}}]}
    with pytest.raises(ValueError):
        JSONResponse(body)
    with pytest.raises(ValueError):
        dumps_in_parts(body)


def test_json_response_builds_in_a_thread():
    import threading

    seen = []

    def build():
        seen.append(threading.current_thread() is threading.main_thread())
        return BODIES[0]

    r = asyncio.run(json_response(build, 201))
    assert seen == [False] and r.status_code == 201
    assert r.body == JSONResponse(BODIES[0]).body
    assert r.headers["content-type"] == "application/json"

"""Log-probabilities (issue 13): the worker's batched logprobs of emitted tokens and prompt tokens
equal transformers' ``log_softmax`` of the same checkpoint's raw logits, for every steps
schedule, drafter, sampling option, chunked prefill, and a batch where only some requests ask."""

from __future__ import annotations

import asyncio

import pytest
import torch

from conftest import PROMPTS
from greedy import greedy
from specdial.engine import Engine
from specdial.engine.api import LogprobOptions, RequestError

KW = dict(max_running_requests=4, kv_cache_tokens=1024, page_size=8, log_interval_s=None)
N = 12


def reference_logprobs(hf, prompt, output):
    """transformers' log_softmax at every position of prompt + output: ``[L - 1, V]`` where
    row ``i`` predicts token ``i + 1``."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1]


def check(hf, prompt, out, top_n, start):
    m = out["meta_info"]
    ref = reference_logprobs(hf, prompt, out["output_ids"])
    seq = prompt + out["output_ids"]
    got = torch.tensor([lp for lp, _, _ in m["output_token_logprobs"]])
    want = ref[len(prompt) - 1:].gather(1, torch.tensor(seq[len(prompt):])[:, None])[:, 0]
    assert [t for _, t, _ in m["output_token_logprobs"]] == out["output_ids"]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for pos, top in enumerate(m["output_top_logprobs"]):
        assert len(top) == top_n
        values, ids = ref[len(prompt) - 1 + pos].topk(top_n)
        torch.testing.assert_close(torch.tensor([lp for lp, _, _ in top]), values,
                                   atol=1e-4, rtol=1e-4)
        assert [lp for lp, _, _ in top] == sorted((lp for lp, _, _ in top), reverse=True)
    if start is None:
        assert m["input_token_logprobs"] is None
        return
    inp = m["input_token_logprobs"]
    assert [t for _, t, _ in inp] == prompt[start:]
    for q, (lp, _, _) in zip(range(start, len(prompt)), inp):
        if q == 0:
            assert lp is None and m["input_top_logprobs"][0] is None
        else:
            assert lp == pytest.approx(ref[q - 1, prompt[q]].item(), abs=1e-4)
            top = m["input_top_logprobs"][q - start]
            assert [t for _, t, _ in top] == ref[q - 1].topk(top_n).indices.tolist()


@pytest.mark.parametrize("schedule", [[0], [3], [7], [1, 5, 0, 2]])
@pytest.mark.parametrize("drafter", ["draft_noisy", "eagle_random"])
def test_logprobs_match_transformers(tiny, schedule, drafter):
    engine = Engine.from_modules(tiny.target, getattr(tiny, drafter), steps_schedule=schedule,
                                 **KW)
    try:
        outs = engine.generate(input_ids=PROMPTS, sampling_params=greedy(N),
                               return_logprob=True, top_logprobs_num=3, logprob_start_len=0)
        for prompt, out in zip(PROMPTS, outs):
            check(tiny.hf, prompt, out, 3, 0)
    finally:
        engine.shutdown()


def test_logprobs_are_raw_under_sampling_and_chunked_prefill(tiny):
    """Temperature / top-k change what is sampled, not the reported (raw) logprobs; prompts
    longer than max_prefill_tokens are prefilled in chunks and keep every prompt logprob; only
    the requests that ask get logprobs."""
    engine = Engine.from_modules(tiny.target, tiny.draft_noisy, steps_schedule=[3],
                                 max_prefill_tokens=4, **KW)
    try:
        sp = {"max_new_tokens": N, "temperature": 0.8, "top_k": 5, "seed": 7}
        outs = engine.generate(input_ids=PROMPTS, sampling_params=sp, return_logprob=True,
                               top_logprobs_num=2, logprob_start_len=2)
        for prompt, out in zip(PROMPTS, outs):
            check(tiny.hf, prompt, out, 2, 2)
        plain = engine.generate(input_ids=PROMPTS[1], sampling_params=sp)
        assert "output_token_logprobs" not in plain["meta_info"]
        assert plain["output_ids"] == outs[1]["output_ids"]  # seeded: logprobs change nothing
    finally:
        engine.shutdown()


def test_mixed_batch_and_stream_chunks(tiny):
    engine = Engine.from_modules(tiny.target, tiny.draft_noisy, steps_schedule=[2], **KW)
    try:
        async def run():
            async def one(prompt, lp):
                chunks = [c async for c in engine.async_stream(
                    input_ids=prompt, sampling_params=greedy(N), logprobs=lp)]
                return chunks
            return await asyncio.gather(one(PROMPTS[0], None),
                                        one(PROMPTS[1], LogprobOptions(top_n=1)),
                                        one(PROMPTS[2], LogprobOptions(prompt_start=16)))

        plain, with_lp, with_prompt = asyncio.run(run())
        assert all(c.logprobs is None and c.prompt_logprobs is None for c in plain)
        for chunks in (with_lp, with_prompt):
            for c in chunks:
                assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        first = next(c for c in with_prompt if c.token_ids)
        assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == 1
        assert sum(c.prompt_logprobs is not None for c in with_prompt) == 1
        ids = [t for c in with_lp for t in c.token_ids]
        ref = reference_logprobs(tiny.hf, PROMPTS[1], ids)[len(PROMPTS[1]) - 1:]
        got = torch.tensor([lp for c in with_lp for lp in c.logprobs])
        torch.testing.assert_close(got, ref.gather(1, torch.tensor(ids)[:, None])[:, 0],
                                   atol=1e-4, rtol=1e-4)
        assert [c.top_logprobs[0][0][0] for c in with_lp if c.token_ids][:1] == [
            ref[0].argmax().item()]
    finally:
        engine.shutdown()


def test_logprob_option_errors(tiny):
    engine = Engine.from_modules(tiny.target, None, **KW)
    try:
        with pytest.raises(RequestError, match="top_logprobs_num"):
            engine.generate(input_ids=[1, 2], return_logprob=True, top_logprobs_num=21)
        with pytest.raises(RequestError, match="logprob_start_len"):
            engine.generate(input_ids=[1, 2], return_logprob=True, logprob_start_len=2)
        with pytest.raises(RequestError, match="need return_logprob"):
            engine.generate(input_ids=[1, 2], top_logprobs_num=2)
        with pytest.raises(RequestError, match="streams one prompt"):
            engine.generate(input_ids=[[1, 2], [3]], stream=True)
    finally:
        engine.shutdown()

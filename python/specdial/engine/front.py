"""The serving calls of one replica (:class:`LocalFront`): ``generate``, ``async_generate``,
``stream`` and ``async_stream`` over its loop, with the signatures of
:class:`~specdial.launch.data_parallel.DataParallelEngine`, so that
:class:`specdial.Engine` hands each call to one front (this one, or the data-parallel one over
its replicas) without branching in every method. The contract is :mod:`specdial.engine.api`;
:class:`specdial.Engine`'s methods carry the user-facing docs.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable, Iterator

from specdial.engine.api import LogprobOptions, RequestError, StreamChunk
from specdial.engine.messages import Message, RequestSpec
from specdial.engine.output import OutputAccumulator
from specdial.engine.requests import (async_collect, async_stream, batch_specs, collect,
                                      sync_stream)
from specdial.engine.token_align import TokenBytes

__all__ = ["LocalFront"]


class LocalFront:
    """One replica's serving calls. ``post``: hands a message to its loop (starting it; raises
    ``RuntimeError`` once shut down or failed); ``cancel``: aborts a spec's request when its
    consumer goes away; ``spec(prompt, input_ids, sampling_params, stop, label, logprobs)``:
    validates one request into a :class:`RequestSpec` (:func:`~specdial.engine.requests.
    make_spec`); ``tokenizer``: for ``return_text_in_logprobs`` and the logprob entries'
    alignment to the text (:mod:`specdial.engine.token_align`); ``closed()``: whether the
    engine is shut down."""

    def __init__(self, post: Callable[[Message], None], cancel: Callable[[RequestSpec], None],
                 spec: Callable[..., RequestSpec], tokenizer: Any,
                 closed: Callable[[], bool]) -> None:
        self._post, self._cancel, self._spec = post, cancel, spec
        self._tokenizer, self._closed = tokenizer, closed
        self._token_bytes = None if tokenizer is None else TokenBytes(tokenizer)

    def _batch(self, prompt: Any, sampling_params: Any, input_ids: Any,
               return_logprob: Any, logprob_start_len: Any, top_logprobs_num: Any,
               return_text_in_logprobs: Any
               ) -> tuple[bool, list[RequestSpec], list[OutputAccumulator]]:
        if self._closed():
            raise RuntimeError("Engine is shut down")
        return batch_specs(prompt, sampling_params, input_ids, return_logprob,
                           logprob_start_len, top_logprobs_num, return_text_in_logprobs,
                           spec=self._spec, tokenizer=self._tokenizer,
                           token_bytes=self._token_bytes)

    def generate(self, prompt: Any = None, sampling_params: Any = None, input_ids: Any = None,
                 *, return_logprob: bool = False, logprob_start_len: int = -1,
                 top_logprobs_num: int = 0, return_text_in_logprobs: bool = False,
                 stream: bool = False) -> Any:
        """:meth:`specdial.Engine.generate` on this replica."""
        single, specs, outs = self._batch(prompt, sampling_params, input_ids, return_logprob,
                                          logprob_start_len, top_logprobs_num,
                                          return_text_in_logprobs)
        if stream:
            if not single:
                raise RequestError("generate(stream=True) streams one prompt; call it once per "
                                   "prompt, or use async_stream", "prompt")
            return self._stream_dicts(specs[0], outs[0])
        out = collect(self._post, self._cancel, specs, outs)
        return out[0] if single else out

    async def async_generate(self, prompt: Any = None, sampling_params: Any = None,
                             input_ids: Any = None, *, return_logprob: bool = False,
                             logprob_start_len: int = -1, top_logprobs_num: int = 0,
                             return_text_in_logprobs: bool = False, stream: bool = False) -> Any:
        """:meth:`specdial.Engine.async_generate` on this replica."""
        single, specs, outs = self._batch(prompt, sampling_params, input_ids, return_logprob,
                                          logprob_start_len, top_logprobs_num,
                                          return_text_in_logprobs)
        if stream:
            if not single:
                raise RequestError("async_generate(stream=True) streams one prompt; call it "
                                   "once per prompt", "prompt")
            return self._astream_dicts(specs[0], outs[0])
        out = await async_collect(self._post, self._cancel, specs, outs)
        return out[0] if single else out

    def stream(self, prompt: str | None = None, *, input_ids: list[int] | None = None,
               sampling_params: dict[str, Any] | None = None, stop: list[str] | None = None,
               logprobs: LogprobOptions | None = None) -> Iterator[StreamChunk]:
        """:meth:`specdial.Engine.stream` on this replica (validated on the first ``next()``)."""
        yield from sync_stream(self._post, self._cancel,
                               self._spec(prompt, input_ids, sampling_params, stop,
                                          logprobs=logprobs))

    def async_stream(self, prompt: str | None = None, *, input_ids: list[int] | None = None,
                     sampling_params: dict[str, Any] | None = None,
                     stop: list[str] | None = None,
                     logprobs: LogprobOptions | None = None,
                     whole: bool = False,
                     on_submitted: Callable[[int], None] | None = None
                     ) -> AsyncIterator[StreamChunk]:
        """:meth:`specdial.Engine.async_stream` on this replica (``whole``: the chunks held
        until the request ends, :func:`~specdial.engine.requests.held_until_end`;
        ``on_submitted``: :func:`~specdial.engine.requests.async_stream`'s)."""
        return async_stream(self._post, self._cancel,
                            self._spec(prompt, input_ids, sampling_params, stop,
                                       logprobs=logprobs), whole=whole,
                            on_submitted=on_submitted)

    def _stream_dicts(self, spec: RequestSpec, out: OutputAccumulator
                      ) -> Iterator[dict[str, Any]]:
        for chunk in sync_stream(self._post, self._cancel, spec):
            out.add(chunk)
            yield out.result()

    async def _astream_dicts(self, spec: RequestSpec,
                             out: OutputAccumulator) -> AsyncIterator[dict[str, Any]]:
        chunks = async_stream(self._post, self._cancel, spec)
        try:
            async for chunk in chunks:
                out.add(chunk)
                yield out.result()
        finally:
            await chunks.aclose()

"""The HTTP driver: a running OpenAI-compatible server (``specdial serve``, vLLM or SGLang).

:class:`HttpDriver` sends ``POST /v1/completions`` with ``stream: true`` and
``stream_options.include_usage`` (the completion token count comes from ``usage``) and reads the
engine's counters from ``GET /metrics`` (:func:`prometheus_snapshot`, Prometheus text format).
Split out of :mod:`specdial.bench.driver` (which re-exports these names) so that the run loop and
the in-process driver stay apart from the HTTP and Prometheus details.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Callable, Mapping, Sequence

from specdial.bench.datasets import BenchRequest
from specdial.bench.metrics import RequestRecord

__all__ = ["HttpDriver", "parse_prometheus", "prometheus_snapshot"]

logger = logging.getLogger("specdial.bench")

Clock = Callable[[], float]

_METRIC = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
_PREFIXES = ("specdial:", "vllm:", "sglang:")
#: snapshot key -> metric name without the prefix (counters summed over label sets).
_PROM_NAMES = {
    "running": "num_requests_running", "queued": "num_requests_waiting",
    "num_drafts": "spec_decode_num_drafts_total",
    "draft_tokens_proposed": "spec_decode_num_draft_tokens_total",
    "num_accepted_tokens": "spec_decode_num_accepted_tokens_total",
    "step_switches": "spec_decode_step_switches_total",
    "preemptions": "num_preemptions_total",
    "requests_finished": "num_requests_finished_total",
    "prompt_tokens": "prompt_tokens_total", "generation_tokens": "generation_tokens_total",
    "cached_tokens": "prefix_cache_hits_total",  # vLLM's name too
}


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The samples of a Prometheus text exposition: ``{name: [(labels, value), ...]}``
    (comments and malformed lines skipped)."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _METRIC.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group(2) or ""))
        out.setdefault(m.group(1), []).append((labels, value))
    return out


def prometheus_snapshot(text: str) -> dict[str, Any]:
    """A stats mapping (the :class:`~specdial.engine.api.EngineStats` field names) from a
    ``/metrics`` body: specdial's names (``specdial:spec_decode_num_drafts_total``, ...), or
    vLLM's/SGLang's where they match; ``steps_per_slot`` from
    ``specdial:spec_decode_num_steps{slot=...}``; ``verify_length_histogram`` from
    ``specdial:spec_decode_verify_length_total{verify_length=...}``; ``tree_node_histogram``
    from ``specdial:spec_decode_tree_nodes_total{tree_nodes=...}``."""
    samples = parse_prometheus(text)

    def lookup(base: str) -> list[tuple[dict[str, str], float]] | None:
        for prefix in _PREFIXES:
            if prefix + base in samples:
                return samples[prefix + base]
        return None

    snap: dict[str, Any] = {}
    for key, base in _PROM_NAMES.items():
        found = lookup(base)
        if found is not None:
            snap[key] = int(sum(v for _, v in found))
    steps = lookup("spec_decode_num_steps") or []
    snap["steps_per_slot"] = {int(lab["slot"]): int(v) for lab, v in steps if "slot" in lab}
    lengths = lookup("spec_decode_verify_length_total")
    if lengths is not None:
        snap["verify_length_histogram"] = {int(lab["verify_length"]): int(v)
                                           for lab, v in lengths if "verify_length" in lab}
    nodes = lookup("spec_decode_tree_nodes_total")
    if nodes is not None:
        snap["tree_node_histogram"] = {int(lab["tree_nodes"]): int(v)
                                       for lab, v in nodes if "tree_nodes" in lab}
    return snap


class HttpDriver:
    """A running OpenAI-compatible server at ``base_url`` (see the module docstring).

    ``model``: the ``model`` field; None = the first id of ``GET /v1/models`` (omitted if that
    fails). ``ignore_eos`` is sent as the vLLM/SGLang extension field (``specdial serve``
    accepts it); a server that answers 400 naming it gets requests without it from then on, and the output lengths are then those the model chooses up to
    ``max_tokens``. Prompts are text, else token ids (``input_ids``; the server must take
    token-id prompts, as specdial's and vLLM's do).
    """

    streaming = True

    def __init__(self, base_url: str, *, model: str | None = None, api_key: str | None = None,
                 ignore_eos: bool = True, timeout_s: float = 600.0) -> None:
        self.base_url, self.model, self.api_key = base_url.rstrip("/"), model, api_key
        self.name = "http"
        self.ignore_eos = ignore_eos
        self.timeout_s = timeout_s
        self.client: Any = None
        self.warnings: list[str] = []
        self._has_metrics = True

    def prepare(self, req: BenchRequest, max_new_tokens: int) -> BenchRequest | None:
        return req if req.prompt or req.input_ids else None

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` from the server's ``POST /tokenize`` (specdial's, vLLM's and
        SGLang's)."""
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        r = httpx.post(self.base_url + "/tokenize", json={"prompt": text}, headers=headers,
                       timeout=self.timeout_s)
        r.raise_for_status()
        return list(r.json()["tokens"])

    def fits(self, prompt_tokens: int, output_tokens: int) -> bool:
        """Always True: the server answers what does not fit with an error, counted as a
        failed request."""
        return True

    async def start(self) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        self.client = httpx.AsyncClient(
            base_url=self.base_url, headers=headers, timeout=httpx.Timeout(self.timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
        if self.model is None:
            try:
                r = await self.client.get("/v1/models")
                data = r.json().get("data") or []
                self.model = data[0]["id"] if data else None
            except Exception as e:  # noqa: BLE001 - the field is optional for specdial serve
                logger.warning("GET /v1/models failed (%s); sending requests without 'model'", e)

    async def flush_cache(self) -> bool:
        """SGLang's ``POST /flush_cache?timeout=60`` (specdial's and SGLang's servers); False,
        with a warning, when the server answers otherwise."""
        r = await self.client.post("/flush_cache", params={"timeout": 60})
        if r.status_code != 200:
            msg = f"POST /flush_cache answered {r.status_code}; the prefix cache was not flushed"
            logger.warning(msg)
            self.warnings.append(msg)
            return False
        return True

    async def stats(self) -> dict[str, Any] | None:
        if not self._has_metrics:
            return None
        try:
            r = await self.client.get("/metrics")
        except Exception as e:  # noqa: BLE001 - a benchmark without server stats still runs
            logger.warning("GET /metrics failed (%s); no engine statistics", e)
            self._has_metrics = False
            return None
        if r.status_code != 200:
            self._has_metrics = False
            return None
        return prometheus_snapshot(r.text)

    def _body(self, req: BenchRequest, params: Mapping[str, Any]) -> dict[str, Any]:
        prompt: Any = req.prompt if req.prompt else list(req.input_ids or ())
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": params["max_new_tokens"],
                                "temperature": params.get("temperature", 0.0), "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.model is not None:
            body["model"] = self.model
        if self.ignore_eos and params.get("ignore_eos"):
            body["ignore_eos"] = True
        return body

    async def send(self, req: BenchRequest, params: dict[str, Any], rec: RequestRecord,
                   clock: Clock) -> None:
        for _ in range(2):
            body = self._body(req, params)
            async with self.client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode("utf-8", "replace")
                    if resp.status_code == 400 and "ignore_eos" in body and "ignore_eos" in text:
                        if self.ignore_eos:
                            self.ignore_eos = False
                            msg = ("the server does not accept 'ignore_eos'; requests are sent "
                                   "without it (output lengths may be shorter than max_tokens)")
                            logger.warning(msg)
                            self.warnings.append(msg)
                        continue
                    rec.error = f"HTTP {resp.status_code}: {text[:300]}"
                    return
                await self._read_sse(resp, rec, clock)
                return

    @staticmethod
    async def _read_sse(resp: Any, rec: RequestRecord, clock: Clock) -> None:
        usage: dict[str, Any] | None = None
        chunks = 0
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            now = clock()
            obj = json.loads(data)
            if "error" in obj:
                rec.error = str(obj["error"].get("message", obj["error"]))
                return
            for choice in obj.get("choices") or []:
                if choice.get("text"):
                    rec.add_chunk(now, None)
                    rec.output_text += choice["text"]
                    chunks += 1
                if choice.get("finish_reason"):
                    rec.finish_reason = choice["finish_reason"]
                    rec.end_time = now
            if obj.get("usage"):
                usage = obj["usage"]
        if usage is not None:
            rec.completion_tokens = int(usage.get("completion_tokens", chunks))
            rec.prompt_tokens = int(usage.get("prompt_tokens", 0)) or None
            details = usage.get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                rec.cached_tokens = int(details["cached_tokens"])
        else:  # no usage: one token per chunk (a lower bound with speculation)
            rec.completion_tokens = chunks
        if rec.end_time is None:
            rec.end_time = clock()
        rec.success = rec.finish_reason is not None and rec.finish_reason != "abort"
        if not rec.success and rec.error is None:
            rec.error = f"finish_reason {rec.finish_reason!r}"

    def generate_batch(self, reqs: Sequence[BenchRequest],
                       params: list[dict[str, Any]]) -> list[dict[str, Any]]:
        raise NotImplementedError("the HTTP driver always streams")

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()

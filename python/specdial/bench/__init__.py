"""``specdial bench``: serving benchmarks of the engine or a server, and the comparison mode.

- :mod:`specdial.bench.datasets`: prompt sets (package data ``specdial/bench/prompts``, a user's JSONL, the
  mixed code/hard workload);
- :mod:`specdial.bench.driver`: the in-process engine driver, Poisson arrivals and the run loop;
  :mod:`specdial.bench.http_driver`: the HTTP driver and the Prometheus ``/metrics`` parsing
  (re-exported by ``driver``);
- :mod:`specdial.bench.metrics`: TTFT / TPOT / ITL percentiles, throughput, acceptance and steps
  statistics (seconds and tokens/s);
- :mod:`specdial.bench.compare` and :mod:`specdial.bench.plots`: ``specdial bench compare``
  (JSON, markdown with ratios, PNG plots); :mod:`specdial.bench.configurations`: what it
  compares (``--configs``) and the engine of each (re-exported by ``compare``);
- :mod:`specdial.bench.cli`: the command-line registration.

Nothing here imports torch or matplotlib at import time.
"""

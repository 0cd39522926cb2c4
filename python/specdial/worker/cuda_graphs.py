"""Former home of the CUDA-graph machinery, now split by what each piece is (issue 16).

- :mod:`specdial.worker.graph_tables`: capture sizes and the :class:`CapturePlan`;
- :mod:`specdial.worker.step_buffers`: the one buffer set, :class:`KVLayout`, pass outputs;
- :mod:`specdial.worker.step_runner` / :mod:`specdial.worker.graph_passes`: one
  :class:`StepRunner` per steps value (eager and captured passes share one body);
- :mod:`specdial.worker.graph_pool`: :class:`GraphPool`, :func:`capture_all`;
- :mod:`specdial.attention.torch_backend`: :class:`TorchStaticAttention` (beside flashinfer's
  twin), :func:`specdial.attention.select.make_static_attention`.

Only the two names ``engine.py`` and the CLI flags import stay here; new code imports from the
modules above.
"""

from specdial.worker.graph_tables import default_cuda_graph_bs, normalize_graph_bs

__all__ = ["default_cuda_graph_bs", "normalize_graph_bs"]

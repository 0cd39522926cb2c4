"""What each data-parallel replica process gets: its options, its devices, its seed.

Replica ``i`` of ``dp_size`` (its ``dp_rank``) runs one :class:`specdial.Engine` with
``dp_size=1`` and the router's ``tp_size``; it differs from the others only in:

- **devices** (:func:`replica_devices`): on a GPU host replica ``i`` sees devices
  ``i*tp .. i*tp+tp-1`` of the ones this process sees, through ``CUDA_VISIBLE_DEVICES`` (so
  inside it they are ``cuda:0..tp-1``), as SGLang's ``base_gpu_id + dp_rank * tp_size``;
- **seed** (:func:`replica_seed`): the sampling generator of requests without a seed of their
  own. Replica 0 keeps ``seed`` (so dp 1 is replica 0 of dp N); the others get independent
  streams from :class:`numpy.random.SeedSequence` (``seed``, spawn key ``i``);
- **rendezvous** (:func:`replica_options`): with ``tp_size > 1`` each replica's
  tensor-parallel group has its own port: a free one, or ``dist_init_addr``'s port ``+ i``
  (an IPv6 host stays bracketed, ``[::1]:5000`` -> ``[::1]:5001``, as SGLang writes it);
- **threads**: on the CPU, unless ``cpu_threads`` is given, one torch thread per replica
  (N replicas each using every core would oversubscribe the machine; BENCHMARKS.md shows one
  thread fastest for small models at small batches).

A callable ``steps_schedule`` (the test hook) reaches the replicas **by reference**: pickle
writes its module and qualified name, and the replica imports it (with the router's
``sys.path``, :mod:`specdial.launch.replica_wire`). So a module-level function works; a lambda,
a closure, a bound method of a local object or a function of the ``__main__`` script (the
replica's ``__main__`` is another module) cannot be sent, and :func:`replica_options` refuses
them with a ``ValueError`` naming ``steps_schedule`` (``data_parallel_backend='inprocess'``
takes any callable).
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np

from specdial.config import EngineConfig, parse_addr

__all__ = ["check_sendable", "format_addr", "replica_devices", "replica_options", "replica_seed",
           "visible_devices"]


def visible_devices(env_value: str | None, device_count: int) -> list[str]:
    """The devices this process sees, as ``CUDA_VISIBLE_DEVICES`` entries: the variable's
    entries when it is set (ids or UUIDs), else ``"0".."device_count-1"``."""
    if env_value is not None:
        return [d.strip() for d in env_value.split(",") if d.strip()]
    return [str(k) for k in range(device_count)]


def replica_devices(dp_rank: int, tp_size: int, visible: list[str]) -> str:
    """``CUDA_VISIBLE_DEVICES`` of replica ``dp_rank``: entries ``dp_rank*tp_size ..
    dp_rank*tp_size+tp_size-1`` of ``visible`` (from :func:`visible_devices`). Raises
    ``ValueError`` when there are too few devices for ``dp_size * tp_size``."""
    first = dp_rank * tp_size
    if first + tp_size > len(visible):
        raise ValueError(f"data-parallel replica {dp_rank} needs devices {first}.."
                         f"{first + tp_size - 1} (dp_size x tp_size devices in all) but this "
                         f"process sees {len(visible)} ({','.join(visible) or 'none'}); lower "
                         "--dp-size or --tp-size, or use --device cpu")
    return ",".join(visible[first:first + tp_size])


def replica_seed(seed: int, dp_rank: int) -> int:
    """The sampling seed of replica ``dp_rank`` (module docstring): ``seed`` for replica 0,
    else a 63-bit value derived from ``(seed, dp_rank)``."""
    if dp_rank == 0:
        return int(seed)
    state = np.random.SeedSequence(int(seed), spawn_key=(int(dp_rank),)).generate_state(
        1, np.uint64)
    return int(state[0] % (2 ** 63))


def format_addr(host: str, port: int) -> str:
    """``host:port``, the host bracketed when it is an IPv6 address (``[::1]:5000``); the
    inverse of :func:`~specdial.config.parse_addr`."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_sendable(steps_schedule: Any) -> None:
    """Raise ``ValueError`` naming ``steps_schedule`` when it is a callable a replica process
    cannot import by reference (module docstring); sequences and None pass."""
    if not callable(steps_schedule):
        return
    why = None
    if getattr(steps_schedule, "__module__", None) == "__main__":
        why = ("it is defined in the __main__ script, which a replica process does not run; "
               "move it into an importable module")
    else:
        try:
            pickle.dumps(steps_schedule, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # noqa: BLE001 - pickle raises several types for this
            why = (f"it cannot be pickled by reference ({type(e).__name__}: {e}); use a "
                   "module-level function, not a lambda, closure or local object")
    if why:
        raise ValueError(f"steps_schedule: a callable is sent to data-parallel replica "
                         f"processes by its module and name, but {why} (or pass a sequence, "
                         "or use data_parallel_backend='inprocess')")


def replica_options(cfg: EngineConfig, dp_rank: int, on_cpu: bool) -> dict[str, Any]:
    """The ``Engine`` keyword arguments of replica ``dp_rank`` of ``cfg`` (module docstring).
    Raises ``ValueError`` naming ``steps_schedule`` for a callable that cannot be sent by
    reference (:func:`check_sendable`)."""
    check_sendable(cfg.steps_schedule)
    options = cfg.to_dict()
    options.update(dp_size=1, seed=replica_seed(cfg.seed, dp_rank))
    if on_cpu and cfg.cpu_threads is None:
        options["cpu_threads"] = 1
    if cfg.tp_size > 1 and cfg.dist_init_addr is not None:
        host, port = parse_addr(cfg.dist_init_addr)
        options["dist_init_addr"] = format_addr(host, port + dp_rank)
    if cfg.record_trace is not None and dp_rank > 0:
        options["record_trace"] = f"{cfg.record_trace}.dp{dp_rank}"
    return options

"""hbmalloc: a caching GPU-memory allocator.

Functions here read and steer the allocators of this process (one per CUDA
device, created at first use) and replay recorded traces offline::

    import hbmalloc
    hbmalloc.memory_stats(0)          # dict with torch.cuda.memory_stats() keys
    print(hbmalloc.memory_summary(0)) # torch.cuda.memory_summary() text
    hbmalloc.snapshot("snap.pickle")  # opens in pytorch.org/memory_viz
    hbmalloc.reset_peak_memory_stats(0)
    hbmalloc.replay("trace.json.gz", policy="pytorch", config="expandable_segments:True")

To make hbmalloc PyTorch's CUDA allocator, call ``hbmalloc.torch.install()``
before the first CUDA allocation (PyTorch itself is optional: ``import
hbmalloc`` never imports it).

Configuration comes from the environment, read once at first use:
``HBMALLOC_CONF`` (``policy:NAME,key:value,...``), else
``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` (policy ``pytorch``);
``HBMALLOC_HISTORY_ENTRIES`` (history kept for snapshots, default 0; later
``set_history_entries()``); ``log:PATH`` (and ``log_entries:N``) in
``HBMALLOC_CONF`` keeps a replayable log that ``write_log()`` writes;
``HBMALLOC_CUDA_DRIVER`` (the CUDA driver library to load).

Errors: ``ValueError`` for bad arguments, devices and configuration,
``MemoryError`` for out of memory, ``RuntimeError`` for driver problems
(including "no CUDA driver"), ``OSError`` for unreadable trace files.
"""

import json
import os

from . import _native

__all__ = [
    "memory_stats",
    "memory_summary",
    "snapshot",
    "empty_cache",
    "reset_peak_memory_stats",
    "reset_accumulated_memory_stats",
    "set_memory_fraction",
    "memory_fraction",
    "set_history_entries",
    "record_stream",
    "replay",
    "library_path",
    "settings",
    "driver_calls",
    "write_log",
]


def memory_stats(device=0):
    """``torch.cuda.memory_stats(device)`` for hbmalloc's allocator: a dict
    keyed exactly as PyTorch keys it (``allocation.all.current``, ...)."""
    return dict(_native.memory_stats(device))


def memory_summary(device=0, abbreviated=False):
    """``torch.cuda.memory_summary(device, abbreviated)`` text for hbmalloc's allocator."""
    return _native.memory_summary(device, abbreviated)


def snapshot(path, device=0):
    """Writes the allocator's memory snapshot of ``device`` to ``path`` in the
    format of ``torch.cuda.memory._dump_snapshot`` (pytorch.org/memory_viz
    and ``python -m torch.cuda._memory_viz`` read it). Set
    ``HBMALLOC_HISTORY_ENTRIES`` before first use to include a trace."""
    _native.snapshot(os.fsdecode(path), device)


def write_log():
    """Writes the production log that ``log:PATH`` in ``HBMALLOC_CONF`` asks
    for: each device's snapshot with the allocations and frees it kept,
    which ``hbmalloc replay`` reads, to ``PATH`` (device 0) or
    ``PATH.dev<N>``. Returns the paths written; ``RuntimeError`` when no log
    is configured. ``hbmalloc.torch.install()`` calls it at exit."""
    return [str(p) for p in _native.write_log()]


def empty_cache(device=0):
    """Returns the cached free memory of ``device`` to the driver."""
    _native.empty_cache(device)


def reset_peak_memory_stats(device=0):
    """``torch.cuda.reset_peak_memory_stats(device)``: every ``peak`` statistic
    of ``device`` becomes its current value."""
    _native.reset_peak_memory_stats(device)


def reset_accumulated_memory_stats(device=0):
    """``torch.cuda.reset_accumulated_memory_stats(device)``: the ``allocated``
    and ``freed`` totals, ``num_alloc_retries`` and ``num_ooms`` of ``device``
    start again from zero."""
    _native.reset_accumulated_memory_stats(device)


def set_memory_fraction(fraction, device=0):
    """``torch.cuda.set_per_process_memory_fraction(fraction, device)``: the
    allocator of ``device`` holds at most ``fraction`` (0 to 1) of its memory,
    and raises ``MemoryError`` past it."""
    _native.set_memory_fraction(float(fraction), device)


def memory_fraction(device=0):
    """``torch.cuda.get_per_process_memory_fraction(device)``: the share of
    ``device``'s memory its allocator may hold (1.0 unless set)."""
    return _native.memory_fraction(device)


def set_history_entries(entries, clear=False):
    """Every device's allocator (and those created later) keeps its last
    ``entries`` trace entries from now on, for ``snapshot()`` (0 stops
    recording; ``HBMALLOC_HISTORY_ENTRIES`` sets the first value). ``clear``
    drops the entries kept so far."""
    entries = int(entries)
    if entries < 0:
        raise ValueError(f"entries must be 0 or more, got {entries}")
    _native.set_history_entries(entries, bool(clear))


def record_stream(ptr, stream, device=0):
    """Declares that the allocation at ``ptr`` on ``device`` is also used on
    ``stream``, a ``cudaStream_t`` as an integer (``torch.cuda.Stream.cuda_stream``):
    once freed, its memory is not reused before the work queued on ``stream``
    by then has completed (PyTorch's ``Tensor.record_stream``). Returns
    ``False`` when ``ptr`` is not a live allocation of hbmalloc's on
    ``device`` (memory from another allocator: there is nothing to do)."""
    return _native.record_stream(int(ptr), int(stream), device)


def settings(device=0):
    """The policy and configuration of ``device``'s allocator, as a settings
    string (``policy:pytorch,expandable_segments:True``)."""
    return _native.settings(device)


def driver_calls(device=0):
    """The driver calls ``device``'s allocator has made, by kind:
    ``{"map": {"calls": N, "seconds": S}, ...}`` for every kind
    (``segment_alloc`` is ``cudaMalloc``, ``physical_create``
    ``cuMemCreate``, ...), ``seconds`` being the wall-clock time spent in
    them (the driver call and the context switch around it). All zero before
    the device's first allocation."""
    calls = _native.driver_calls(device)
    return {kind: {"calls": count, "seconds": seconds} for kind, count, seconds in calls}


# The largest device capacity a replay takes (1 PiB), as in ``hbmalloc replay``.
_MAX_CAPACITY_BYTES = _native.MAX_CAPACITY_BYTES


def _capacity_bytes(capacity):
    """``capacity`` as a whole number of bytes within 1 byte and 1 PiB, else ``ValueError``."""
    try:
        value = int(capacity)
    except (TypeError, ValueError, OverflowError):
        value = None
    if value is None or isinstance(capacity, (bool, str, bytes)) or value != capacity:
        raise ValueError(f"capacity must be a whole number of bytes, got {capacity!r}")
    if not 1 <= value <= _MAX_CAPACITY_BYTES:
        raise ValueError(
            f"capacity must be between 1 byte and 1 PiB ({_MAX_CAPACITY_BYTES}), got {value}"
        )
    return value


def replay(
    trace_path,
    policy="hbm",
    config="",
    capacity=None,
    find_min_capacity=True,
    part_handle_maps=False,
    ignore_recorded_ooms=False,
):
    """Replays a recorded trace (PyTorch snapshot ``.pickle``, torch.profiler
    ``.json``/``.json.gz``, RMM ``.csv``) on a simulated GPU under ``policy``
    (``hbm``, hbmalloc's own, or ``pytorch``) with ``config`` (``key:value,...``;
    ``PYTORCH_CUDA_ALLOC_CONF`` syntax for ``pytorch``), on a device of
    ``capacity`` bytes (a whole number up to 1 PiB; ``None``: unbounded).

    Returns one dict per device of the trace, with the metrics of
    ``hbmalloc replay --json`` (``peak_live_bytes``, ``peak_reserved_bytes``,
    ``efficiency``, ``min_capacity_bytes``, ``device_calls``, ...).
    ``find_min_capacity=False`` skips the bisection for ``min_capacity_bytes``.
    The simulated GPU behaves like a real one (whole-handle maps, driver
    latencies measured on an H100); ``part_handle_maps=True`` is a what-if: a
    driver that also maps part of a physical handle
    (``hbmalloc replay --part-handle-maps``). An out-of-memory error the
    trace recorded is reproduced, as ``hbmalloc replay`` does, by making the
    simulated device report the free memory the real one reported then;
    ``ignore_recorded_ooms=True`` skips those requests instead
    (``--ignore-recorded-ooms``).
    """
    if capacity is not None:
        capacity = _capacity_bytes(capacity)
    return json.loads(
        _native.replay_json(
            os.fsdecode(trace_path),
            policy,
            config,
            capacity,
            bool(find_min_capacity),
            bool(part_handle_maps),
            not ignore_recorded_ooms,
        )
    )


def library_path():
    """Path of the shared library that exports hbmalloc's C ABI
    (``hbmalloc_alloc``, ``hbmalloc_free``, ...; see ``hbmalloc.h``).

    It is this package's native module itself: one library serves Python and
    ``torch.cuda.memory.CUDAPluggableAllocator``, so the stats read from
    Python are those of the allocator PyTorch uses."""
    return os.path.abspath(_native.__file__)


def __getattr__(name):
    # `hbmalloc.torch` without an explicit import; importing it never imports torch.
    if name == "torch":
        import importlib

        return importlib.import_module(".torch", __name__)
    raise AttributeError(f"module 'hbmalloc' has no attribute '{name}'")

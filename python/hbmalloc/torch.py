"""hbmalloc as PyTorch's CUDA allocator.

``install()`` makes hbmalloc serve every CUDA allocation of this process
through ``torch.cuda.memory.CUDAPluggableAllocator``; call it before the
first CUDA allocation. ``mem_pool()`` gives a ``torch.cuda.MemPool`` backed
by hbmalloc, for routing only some allocations (``torch.cuda.use_mem_pool``).

With a pluggable allocator installed, ``torch.cuda.memory_stats()``,
``memory_summary()`` and snapshots raise in PyTorch: use
``hbmalloc.memory_stats()``, ``hbmalloc.memory_summary()`` and
``hbmalloc.snapshot()`` instead.

Streams: PyTorch does not pass ``Tensor.record_stream`` on to a pluggable
allocator (``CUDAPluggableAllocator`` forwards ``recordStream`` only to a
hook that Python cannot set), so a tensor used on a second stream could be
reused while that stream still works on it. ``install()`` therefore wraps
``torch.Tensor.record_stream`` to tell hbmalloc as well
(``forward_record_stream``), and sets ``TORCH_NCCL_AVOID_RECORD_STREAMS=1``
unless it is set: ``ProcessGroupNCCL`` calls ``recordStream`` from C++,
which no Python wrapper sees, and with that setting it keeps the tensors of
a collective alive until the collective is waited on instead. Call
``install()`` before ``torch.distributed.init_process_group``. Other C++
callers of ``recordStream`` are not covered.

Importing this module does not import torch; its functions raise
``ImportError`` when torch is missing.
"""

import os
import warnings

import hbmalloc

_TOO_LATE = (
    "hbmalloc.torch.install() came too late: PyTorch's CUDA allocator is already "
    "initialised (CUDA memory was allocated, CUDA was initialised, or another "
    "allocator was installed). Call hbmalloc.torch.install() before the first CUDA "
    "allocation, e.g. right after `import torch`."
)

_allocator = None
_installed = False
_NCCL_AVOID_RECORD_STREAMS = "TORCH_NCCL_AVOID_RECORD_STREAMS"


def _torch():
    try:
        import torch
        import torch.cuda.memory
    except ImportError as e:
        raise ImportError(
            "hbmalloc.torch needs PyTorch, which is not installed (pip install torch); "
            "the rest of hbmalloc works without it"
        ) from e
    return torch


def allocator():
    """The ``torch.cuda.memory.CUDAPluggableAllocator`` over hbmalloc's
    library (``hbmalloc_alloc`` / ``hbmalloc_free``), created once."""
    global _allocator
    torch = _torch()
    if _allocator is None:
        _allocator = torch.cuda.memory.CUDAPluggableAllocator(
            hbmalloc.library_path(), "hbmalloc_alloc", "hbmalloc_free"
        )
    return _allocator


def forward_record_stream(tensor, stream):
    """Tells hbmalloc that ``tensor``'s memory is also used on ``stream`` (a
    ``torch.cuda.Stream``), as ``tensor.record_stream(stream)`` tells
    PyTorch's own allocator. ``install()`` makes ``Tensor.record_stream`` call
    this; call it yourself where a ``record_stream`` does not pass through
    Python. Returns ``False`` for memory that is not hbmalloc's (a CPU
    tensor, another allocator's memory)."""
    if tensor.device.type != "cuda":
        return False
    return hbmalloc.record_stream(
        tensor.untyped_storage().data_ptr(), stream.cuda_stream, tensor.device.index
    )


def _forward_record_streams(torch):
    """Wraps ``torch.Tensor.record_stream`` so that hbmalloc hears of it too
    (see the module documentation), and keeps ProcessGroupNCCL from relying
    on ``recordStream``."""
    torch_record_stream = torch.Tensor.record_stream

    def record_stream(self, stream):
        # PyTorch's own checks (a CUDA tensor, a stream); its recordStream
        # stops at the pluggable allocator.
        torch_record_stream(self, stream)
        forward_record_stream(self, stream)

    record_stream.__doc__ = torch_record_stream.__doc__
    torch.Tensor.record_stream = record_stream
    if os.environ.setdefault(_NCCL_AVOID_RECORD_STREAMS, "1") != "1":
        warnings.warn(
            f"{_NCCL_AVOID_RECORD_STREAMS}={os.environ[_NCCL_AVOID_RECORD_STREAMS]}: "
            "ProcessGroupNCCL will call recordStream, which PyTorch does not pass on to "
            "hbmalloc; a tensor of an asynchronous collective could then be reused while "
            f"NCCL still uses it. Set {_NCCL_AVOID_RECORD_STREAMS}=1 (hbmalloc's default).",
            RuntimeWarning,
            stacklevel=3,
        )


def is_installed():
    """True once ``install()`` succeeded in this process."""
    return _installed


def install():
    """Makes hbmalloc PyTorch's CUDA allocator for this process and returns
    the ``CUDAPluggableAllocator``.

    Also wraps ``torch.Tensor.record_stream`` and sets
    ``TORCH_NCCL_AVOID_RECORD_STREAMS=1`` unless it is set (see the module
    documentation: PyTorch does not pass ``record_stream`` on to a pluggable
    allocator).

    Raises ``RuntimeError`` when called twice, or when PyTorch's CUDA
    allocator is already initialised (too late), and ``ImportError``
    without torch."""
    global _installed
    torch = _torch()
    if _installed:
        raise RuntimeError(
            "hbmalloc.torch.install() was already called: hbmalloc is already "
            "PyTorch's CUDA allocator in this process"
        )
    if torch.cuda.is_initialized():
        raise RuntimeError(_TOO_LATE)
    plugged = allocator()
    try:
        torch.cuda.memory.change_current_allocator(plugged)
    except RuntimeError as e:
        # torch: "Can't swap an already initialized allocator".
        raise RuntimeError(f"{_TOO_LATE} (PyTorch said: {e})") from e
    _forward_record_streams(torch)
    _installed = True
    return plugged


def mem_pool(**kwargs):
    """A ``torch.cuda.MemPool`` whose memory comes from hbmalloc; use it with
    ``torch.cuda.use_mem_pool(pool)``. Keyword arguments go to ``MemPool``."""
    torch = _torch()
    return torch.cuda.MemPool(allocator=allocator().allocator(), **kwargs)

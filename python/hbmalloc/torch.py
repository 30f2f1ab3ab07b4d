"""hbmalloc as PyTorch's CUDA allocator.

``install()`` makes hbmalloc serve every CUDA allocation of this process
through ``torch.cuda.memory.CUDAPluggableAllocator``; call it before the
first CUDA allocation. ``mem_pool()`` gives a ``torch.cuda.MemPool`` backed
by hbmalloc, for routing only some allocations (``torch.cuda.use_mem_pool``).

With a pluggable allocator installed, ``torch.cuda.memory_stats()``,
``memory_summary()`` and snapshots raise in PyTorch: use
``hbmalloc.memory_stats()``, ``hbmalloc.memory_summary()`` and
``hbmalloc.snapshot()`` instead.

Importing this module does not import torch; its functions raise
``ImportError`` when torch is missing.
"""

import hbmalloc

_TOO_LATE = (
    "hbmalloc.torch.install() came too late: PyTorch's CUDA allocator is already "
    "initialised (CUDA memory was allocated, CUDA was initialised, or another "
    "allocator was installed). Call hbmalloc.torch.install() before the first CUDA "
    "allocation, e.g. right after `import torch`."
)

_allocator = None
_installed = False


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


def is_installed():
    """True once ``install()`` succeeded in this process."""
    return _installed


def install():
    """Makes hbmalloc PyTorch's CUDA allocator for this process and returns
    the ``CUDAPluggableAllocator``.

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
    _installed = True
    return plugged


def mem_pool(**kwargs):
    """A ``torch.cuda.MemPool`` whose memory comes from hbmalloc; use it with
    ``torch.cuda.use_mem_pool(pool)``. Keyword arguments go to ``MemPool``."""
    torch = _torch()
    return torch.cuda.MemPool(allocator=allocator().allocator(), **kwargs)

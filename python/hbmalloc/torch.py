"""hbmalloc as PyTorch's CUDA allocator.

``install()`` makes hbmalloc serve every CUDA allocation of this process
through ``torch.cuda.memory.CUDAPluggableAllocator``; call it before the
first CUDA allocation. ``mem_pool()`` gives a ``torch.cuda.MemPool`` backed
by hbmalloc, for routing only some allocations (``torch.cuda.use_mem_pool``).

PyTorch's memory functions: with a pluggable allocator, ``torch.cuda``'s
statistics (``memory_stats()``, ``memory_allocated()``,
``max_memory_allocated()``, ``memory_summary()``, ...) and snapshots raise,
and ``empty_cache()`` and ``set_per_process_memory_fraction()`` do nothing
(PyTorch forwards them to hooks Python cannot set). ``install()`` routes
them to hbmalloc instead, at the ``torch._C`` functions ``torch.cuda`` calls:
statistics and snapshots are hbmalloc's, ``empty_cache()`` empties
hbmalloc's caches, a memory fraction limits hbmalloc (and reads back), and
``reset_peak_memory_stats()`` / ``reset_accumulated_memory_stats()`` reset
hbmalloc's, and ``torch.cuda.memory._record_memory_history()`` sets how
many trace entries hbmalloc keeps (``max_entries``; its stack and context
options are not recorded: hbmalloc's entries have no frames).

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

CUDA graphs: PyTorch does not tell a pluggable allocator about graph
capture either (its private-pool hooks cannot be set from Python), so memory
a captured graph uses could be handed to other tensors once they are freed,
and the graph would overwrite them when it replays. After ``install()``,
``torch.cuda.CUDAGraph.capture_begin`` (``torch.cuda.graph``,
``make_graphed_callables``, ``torch.compile(mode="reduce-overhead")``) raises
``RuntimeError`` saying so. To capture graphs, use ``install(compiled=True)``
(below), or route only part of a program to hbmalloc with ``mem_pool()``:
PyTorch's own allocator then keeps a graph's memory private.

cuDNN's benchmark mode: with ``torch.backends.cudnn.benchmark = True``,
PyTorch asks the allocator for its largest free block (``cacheInfo``) before
it times convolution algorithms, and a pluggable allocator raises there
("does not yet support cacheInfo"; it has no hook for it), so every new
convolution shape would fail. After ``install()``, benchmark mode stays off:
setting it warns (``RuntimeWarning``) and leaves it off, and ``install()``
turns it off (and warns) if it was on. cuDNN's heuristics then choose the
algorithms, as they do by default. ``mem_pool()`` keeps benchmark mode: there
PyTorch's own allocator answers.

Sharing CUDA tensors between processes (``torch.multiprocessing``, CUDA IPC)
raises in PyTorch with a pluggable allocator ("does not yet support
shareIPcHandle" / "getIpcDevPtr"), and with the compiled one (below) hbmalloc's
own error says so; policy ``hbm``'s memory is virtual-memory (``cuMemMap``)
memory, which CUDA's legacy IPC calls do not support either.

Configuration: with ``HBMALLOC_CONF`` unset, hbmalloc reads
``PYTORCH_CUDA_ALLOC_CONF`` (else ``PYTORCH_ALLOC_CONF``) and runs PyTorch's
policy with it, so that a job keeps its tuned settings; ``install()`` warns
when that happens (a cluster-wide ``expandable_segments:True`` would
otherwise replace policy ``hbm`` unnoticed). ``HBMALLOC_CONF`` comes first.

Compiled: ``install(compiled=True)`` closes the gaps above from C++. It
compiles ``torch_allocator.cc`` (shipped in this package) against the
installed torch, once per torch version and compiler (kept in
``HBMALLOC_CACHE_DIR``, else ``~/.cache/hbmalloc``; it needs a C++ compiler,
``CXX`` or ``c++``, and CUDA's runtime headers, from ``CUDA_HOME`` or the
pip packages a CUDA build of torch brings), and installs that subclass of
PyTorch's ``CUDAPluggableAllocator``, which answers ``recordStream``,
``cacheInfo``, the statistics and their resets, ``empty_cache`` and memory
fractions itself, and raises ``torch.OutOfMemoryError`` (after telling the
observers ``torch._C._cuda_attach_out_of_memory_observer`` attached). So
``Tensor.record_stream`` is not wrapped (PyTorch's C++ callers, NCCL's
included, reach hbmalloc), ``TORCH_NCCL_AVOID_RECORD_STREAMS`` is left
alone, ``torch.cuda``'s statistics are PyTorch's own calls, cuDNN's benchmark
mode works, and PyTorch's fallbacks that catch its out-of-memory error
catch hbmalloc's. Every allocator call PyTorch may make answers or raises
hbmalloc's own error; none that PyTorch makes from a destructor (``~MemPool``'s
``setUseOnOOM``, ``releasePool``, a tensor's free) raises. It also keeps
private memory pools as PyTorch's
allocator does, so CUDA graph capture, ``torch.cuda.MemPool`` and
``torch.cuda.use_mem_pool`` work: a graph's memory is reused only by
allocations into its pool, and while a capture is underway hbmalloc waits
for no event and gives no memory back (``hbmalloc.h``). Snapshots and history
are still routed (PyTorch builds its snapshot from its own allocator's
internals). It is opt-in until it has run on a GPU (``scripts/gpu-check``
runs it).

Importing this module does not import torch; its functions raise
``ImportError`` when torch is missing.
"""

import atexit
import ctypes
import hashlib
import importlib.util
import os
import pathlib
import pickle
import subprocess
import warnings

import hbmalloc
from hbmalloc import _native

_TOO_LATE = (
    "hbmalloc.torch.install() came too late: PyTorch's CUDA allocator is already "
    "initialised (CUDA memory was allocated, CUDA was initialised, or another "
    "allocator was installed). Call hbmalloc.torch.install() before the first CUDA "
    "allocation, e.g. right after `import torch`."
)

_NO_GRAPHS = (
    "hbmalloc.torch.install() made hbmalloc PyTorch's CUDA allocator, and PyTorch does not "
    "tell such an allocator about CUDA graph capture: memory the graph uses could be given "
    "to other tensors and overwritten when the graph replays. CUDA graphs (torch.cuda.graph, "
    "make_graphed_callables, torch.compile(mode='reduce-overhead')) are refused in this "
    "process; to use them with hbmalloc, do not call install() and route allocations with "
    "hbmalloc.torch.mem_pool() instead."
)

_NO_CUDNN_BENCHMARK = (
    "torch.backends.cudnn.benchmark stays off after hbmalloc.torch.install(): cuDNN's "
    "benchmark mode asks the allocator for its largest free block (cacheInfo), which "
    "PyTorch's pluggable allocator does not support, so convolutions would raise "
    "'CUDAPluggableAllocator does not yet support cacheInfo'. cuDNN's heuristics choose "
    "the convolution algorithms instead. To keep benchmark mode, route allocations with "
    "hbmalloc.torch.mem_pool() instead of install()."
)

_pluggables = {}  # alloc function name -> CUDAPluggableAllocator
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


def _pluggable(alloc_fn_name):
    """The ``CUDAPluggableAllocator`` over hbmalloc's library with
    ``alloc_fn_name`` and ``hbmalloc_free``, created once per name."""
    torch = _torch()
    if alloc_fn_name not in _pluggables:
        _pluggables[alloc_fn_name] = torch.cuda.memory.CUDAPluggableAllocator(
            hbmalloc.library_path(), alloc_fn_name, "hbmalloc_free"
        )
    return _pluggables[alloc_fn_name]


def allocator():
    """The ``torch.cuda.memory.CUDAPluggableAllocator`` that ``install()``
    makes PyTorch's, created once: ``hbmalloc_torch_alloc`` and
    ``hbmalloc_free`` from hbmalloc's library.

    ``CUDAPluggableAllocator`` hands what its alloc function returns to a
    tensor without checking it, so a NULL for "out of memory" would become a
    tensor at address 0, and the first kernel to touch it would fault.
    ``hbmalloc_torch_alloc`` throws a C++ exception instead, which PyTorch
    raises as ``RuntimeError`` where the allocation was made: "CUDA out of
    memory. hbmalloc: tried to allocate ..." and hbmalloc's report (not
    ``torch.OutOfMemoryError``, which only PyTorch's own C++ can throw; code
    that catches ``RuntimeError`` or matches "CUDA out of memory." sees it,
    but PyTorch's internal fallbacks that catch its own error, such as cuDNN
    retrying with a smaller workspace, do not)."""
    return _pluggable("hbmalloc_torch_alloc")


def _mem_pool_allocator():
    """The ``CUDAPluggableAllocator`` behind ``mem_pool()``: ``hbmalloc_alloc``,
    which returns NULL when it fails. PyTorch's own allocator calls it for a
    pool and turns NULL into its own out-of-memory handling (free its cache,
    retry, raise ``torch.OutOfMemoryError``), which an exception would skip."""
    return _pluggable("hbmalloc_alloc")


def _cache_dir():
    """Where compiled allocators are kept: ``HBMALLOC_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/hbmalloc``, else ``~/.cache/hbmalloc``."""
    configured = os.environ.get("HBMALLOC_CACHE_DIR")
    if configured:
        return pathlib.Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "hbmalloc"


def _cuda_include_dirs():
    """Directories with CUDA's runtime headers, which PyTorch's CUDA headers
    include: ``cuda_runtime_api.h`` and the ``crt/`` headers it includes.
    The CUDA toolkit's (``CUDA_HOME``, as ``torch.utils.cpp_extension``
    finds it) come first, then those pip installs with a CUDA build of torch
    (the ``nvidia`` packages have the runtime's, ``triton`` the ``crt/``
    ones)."""
    from torch.utils import cpp_extension

    candidates = []
    if cpp_extension.CUDA_HOME:
        candidates.append(pathlib.Path(cpp_extension.CUDA_HOME) / "include")
    for package in ("nvidia", "triton"):
        spec = importlib.util.find_spec(package)
        for root in (spec.submodule_search_locations or []) if spec else []:
            root = pathlib.Path(root)
            candidates += sorted(root.glob("*/include")) + sorted(root.glob("backends/nvidia/include"))
    runtime = next((d for d in candidates if (d / "cuda_runtime_api.h").is_file()), None)
    crt = next((d for d in candidates if (d / "crt" / "host_defines.h").is_file()), None)
    if runtime is None or crt is None:
        raise RuntimeError(
            "hbmalloc.torch: the compiled allocator needs CUDA's runtime headers "
            "(cuda_runtime_api.h and crt/host_defines.h), and found "
            f"{'none' if runtime is None else 'no crt/'} in CUDA_HOME "
            f"({cpp_extension.CUDA_HOME}) or the nvidia and triton packages. Install "
            "the CUDA toolkit (and set CUDA_HOME), or use install() without compiled=True."
        )
    return [runtime] if runtime == crt else [runtime, crt]


def _compile(source):
    """Compiles ``source`` (a C++ file that may include this package's
    ``torch_allocator.cc`` and ``hbmalloc.h``) into a shared library against
    the installed torch, once per source, torch and compiler: returns its
    path in the cache (``_cache_dir()``). ``CXX`` names the compiler (default
    ``c++``). Raises ``RuntimeError`` with the compiler's output on failure."""
    torch = _torch()
    from torch.utils import cpp_extension

    here = pathlib.Path(__file__).resolve().parent
    torch_lib = pathlib.Path(torch.__file__).resolve().parent / "lib"
    compiler = os.environ.get("CXX", "c++")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = ["-std=c++20", "-O2", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    includes = [f"-I{here}"]
    for directory in [*cpp_extension.include_paths(), *_cuda_include_dirs()]:
        includes += ["-isystem", str(directory)]
    libraries = [f"-L{torch_lib}", "-ltorch_cuda", "-lc10_cuda", "-lc10", f"-Wl,-rpath,{torch_lib}"]
    key = hashlib.sha256()
    for part in (source, here / "torch_allocator.cc", here / "hbmalloc.h"):
        key.update(pathlib.Path(part).read_bytes())
    key.update(repr((torch.__version__, compiler, flags, includes, libraries)).encode())
    output = _cache_dir() / f"{pathlib.Path(source).stem}-{key.hexdigest()[:16]}.so"
    if output.exists():
        return output
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f"{output.name}.{os.getpid()}.tmp")
    command = [compiler, *flags, *includes, str(source), *libraries, "-o", str(partial)]
    try:
        result = subprocess.run(command, capture_output=True, text=True)
    except OSError as e:
        raise RuntimeError(f"hbmalloc.torch: cannot run the C++ compiler {compiler!r}: {e}") from e
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(
            f"hbmalloc.torch: compiling {source} against torch {torch.__version__} failed "
            f"(exit {result.returncode}):\n{_first_lines(result.stderr)}\ncommand: {' '.join(command)}"
        )
    os.replace(partial, output)  # Atomic: a concurrent build writes the same file.
    return output


def _first_lines(text, limit=4000):
    """The start of a compiler's output (its first error says the most),
    cut at a line within `limit` characters."""
    if len(text) <= limit:
        return text
    return text[: text.rfind("\n", 0, limit) + 1] + "[...]"


def _compiled_install(torch):
    """Builds the compiled allocator and makes it PyTorch's; returns torch's
    handle to it."""
    library = ctypes.CDLL(str(_compile(pathlib.Path(__file__).with_name("torch_allocator.cc"))))
    entry = library.hbmalloc_torch_compiled_install
    entry.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    entry.restype = ctypes.c_int
    error = ctypes.create_string_buffer(4096)
    status = entry(os.fsencode(hbmalloc.library_path()), error, len(error))
    message = error.value.decode(errors="replace")
    if status == 2:
        raise RuntimeError(f"{_TOO_LATE} (PyTorch said: {message})")
    if status != 0:
        raise RuntimeError(f"hbmalloc.torch.install(compiled=True): {message}")
    return torch.cuda.memory._get_current_allocator()


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


def _nested(flat):
    """hbmalloc's ``memory_stats()`` (``{"allocation.all.current": n, ...}``)
    as the nested dict ``torch._C._cuda_memoryStats`` returns, which
    ``torch.cuda.memory_stats()`` flattens again with dots."""
    nested = {}
    for key, value in flat.items():
        *path, last = key.split(".")
        node = nested
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return nested


def memory_snapshot(pool_and_traces=None):
    """What ``torch._C._cuda_memorySnapshot`` returns, from hbmalloc's
    allocators: the segments of every device that has allocated, and each
    one's trace (``HBMALLOC_HISTORY_ENTRIES``, ``set_history_entries()``). ``pool_and_traces`` is
    ``None`` or torch's ``(pool, pool, include_traces)``; hbmalloc has no
    pools, so the pool is not used."""
    include_traces = pool_and_traces is None or bool(pool_and_traces[2])
    merged = {"segments": [], "device_traces": [], "allocator_settings": {},
              "external_annotations": []}
    for device in range(_native.device_count()):
        data = _native.existing_snapshot_bytes(device)
        snapshot = pickle.loads(data) if data is not None else None
        merged["device_traces"].append(
            snapshot["device_traces"][device] if snapshot and include_traces else []
        )
        if snapshot:
            merged["segments"].extend(snapshot["segments"])
            merged["allocator_settings"] = snapshot["allocator_settings"]
            merged["external_annotations"].extend(snapshot.get("external_annotations", []))
    return merged


def _route_memory_functions(torch, compiled):
    """Points the ``torch._C`` functions behind ``torch.cuda``'s memory
    functions at hbmalloc (see the module documentation); with the
    ``compiled`` allocator, only snapshots and history."""
    c = torch._C
    routes = {
        "_cuda_memorySnapshot": memory_snapshot,
        "_cuda_record_memory_history": _record_memory_history,
        "_cuda_record_memory_history_legacy": _record_memory_history_legacy,
    }
    if not compiled:
        # The compiled allocator answers these itself, from C++.
        routes.update(_statistics_routes(c))
    # Only what this torch has: install() has swapped the allocator already,
    # and a name another torch version lacks must not undo that.
    for name, function in routes.items():
        if hasattr(c, name):
            setattr(c, name, function)


def _statistics_routes(c):
    """The ``torch._C`` functions a pluggable allocator leaves raising or
    doing nothing, as hbmalloc's (``c`` is ``torch._C``, read before any is
    replaced)."""
    torch_empty_cache = getattr(c, "_cuda_emptyCache", lambda: None)
    torch_set_memory_fraction = getattr(c, "_cuda_setMemoryFraction", lambda f, d: None)

    def empty_cache():
        torch_empty_cache()
        _native.empty_cache_all()

    def set_memory_fraction(fraction, device):
        torch_set_memory_fraction(fraction, device)
        hbmalloc.set_memory_fraction(fraction, device)

    return {
        "_cuda_memoryStats": lambda device: _nested(hbmalloc.memory_stats(device)),
        "_cuda_resetPeakMemoryStats": hbmalloc.reset_peak_memory_stats,
        "_cuda_resetAccumulatedMemoryStats": hbmalloc.reset_accumulated_memory_stats,
        "_cuda_emptyCache": empty_cache,
        "_cuda_setMemoryFraction": set_memory_fraction,
        "_cuda_getMemoryFraction": hbmalloc.memory_fraction,
    }


def _record_memory_history(enabled, context=None, stacks=None, max_entries=2**63 - 1,
                           clear_history=False, *_rest):
    """``torch._C._cuda_record_memory_history`` (behind
    ``torch.cuda.memory._record_memory_history``): ``enabled`` None stops
    recording, anything else keeps the last ``max_entries`` entries."""
    hbmalloc.set_history_entries(0 if enabled is None else max_entries, clear_history)


def _record_memory_history_legacy(enabled, record_context=True, trace_alloc_max_entries=1,
                                  trace_alloc_record_context=False, record_context_cpp=False,
                                  clear_history=False, *_rest):
    """The boolean form of ``torch.cuda.memory._record_memory_history``."""
    hbmalloc.set_history_entries(trace_alloc_max_entries if enabled else 0, clear_history)


def _keep_cudnn_benchmark_off(torch):
    """Keeps ``torch.backends.cudnn.benchmark`` off (see the module
    documentation): through the property and through ``flags()`` /
    ``set_flags()``, which call ``torch._C._set_cudnn_benchmark``."""
    c = torch._C
    torch_set = getattr(c, "_set_cudnn_benchmark", None)
    if torch_set is None:
        return

    def set_cudnn_benchmark(enabled):
        if enabled:
            warnings.warn(_NO_CUDNN_BENCHMARK, RuntimeWarning, stacklevel=3)
            enabled = False
        torch_set(enabled)

    c._set_cudnn_benchmark = set_cudnn_benchmark
    # The property keeps the setter it was made with.
    prop = vars(type(torch.backends.cudnn)).get("benchmark")
    if prop is not None and hasattr(prop, "setter"):
        prop.setter = set_cudnn_benchmark
    if c._get_cudnn_benchmark():
        set_cudnn_benchmark(True)  # warns, and turns it off


def _warn_of_pytorch_policy():
    """Warns when PyTorch's configuration variable picks hbmalloc's policy:
    with ``HBMALLOC_CONF`` unset, hbmalloc reads ``PYTORCH_CUDA_ALLOC_CONF``
    (else ``PYTORCH_ALLOC_CONF``) and runs PyTorch's own policy with it, which a
    cluster-wide ``expandable_segments:True`` would do without anyone asking
    for it. The C ABI's own choice (``configuration_source``), read before
    any allocator exists."""
    source = _native.configuration_source()
    if source is None or source[0] == "HBMALLOC_CONF":
        return
    var, value = source
    warnings.warn(
        f"{var}={value} is set and HBMALLOC_CONF is not: hbmalloc runs PyTorch's "
        f"policy (policy:pytorch) with {var}'s settings, not its own policy hbm. "
        "Set HBMALLOC_CONF=policy:hbm to use hbm (HBMALLOC_CONF comes first), or "
        f"HBMALLOC_CONF=policy:pytorch,{value} to keep PyTorch's policy without "
        "this warning.",
        RuntimeWarning,
        stacklevel=3,
    )


def _write_log_at_exit():
    """Writes the production log (``log:PATH`` in ``HBMALLOC_CONF``) as the
    process ends; a failure warns, as nothing can be raised then."""
    try:
        hbmalloc.write_log()
    except Exception as e:  # noqa: BLE001 - at exit, every failure is reported the same way
        warnings.warn(f"hbmalloc: the log was not written: {e}", RuntimeWarning)


def _refuse_graph_capture(torch):
    """Makes CUDA graph capture raise (see the module documentation)."""

    def capture_begin(self, *args, **kwargs):
        raise RuntimeError(_NO_GRAPHS)

    graph = getattr(torch.cuda, "CUDAGraph", None)
    if graph is not None:
        capture_begin.__doc__ = graph.capture_begin.__doc__
        graph.capture_begin = capture_begin


def is_installed():
    """True once ``install()`` succeeded in this process."""
    return _installed


def install(compiled=False):
    """Makes hbmalloc PyTorch's CUDA allocator for this process and returns
    PyTorch's handle to it (the ``CUDAPluggableAllocator``).

    Also wraps ``torch.Tensor.record_stream`` and sets
    ``TORCH_NCCL_AVOID_RECORD_STREAMS=1`` unless it is set, and routes
    ``torch.cuda``'s statistics, snapshots, history, ``empty_cache()`` and
    memory fraction to hbmalloc (see the module documentation: PyTorch passes
    none of them on to a pluggable allocator); CUDA graph capture raises from
    then on, as PyTorch cannot keep a graph's memory private from hbmalloc
    through the pluggable allocator alone (``compiled=True`` can),
    and ``torch.backends.cudnn.benchmark`` stays off (with a warning when
    set), as its algorithm search asks the allocator what a pluggable one
    cannot answer.

    ``compiled=True`` builds the allocator in C++ against the installed
    torch instead (once; cached, see the module documentation), which
    answers PyTorch itself: streams (NCCL's too), statistics, cuDNN's
    benchmark mode and ``torch.OutOfMemoryError`` work as with PyTorch's
    own allocator, and it keeps CUDA graphs' private memory pools, so none
    of the wrapping above is done but the routing of snapshots and history.
    It needs a C++ compiler and CUDA's runtime headers.

    Raises ``RuntimeError`` when called twice, or when PyTorch's CUDA
    allocator is already initialised (too late), or when the compiled
    allocator cannot be built, and ``ImportError`` without torch."""
    global _installed
    torch = _torch()
    if _installed:
        raise RuntimeError(
            "hbmalloc.torch.install() was already called: hbmalloc is already "
            "PyTorch's CUDA allocator in this process"
        )
    if torch.cuda.is_initialized():
        raise RuntimeError(_TOO_LATE)
    _warn_of_pytorch_policy()
    if compiled:
        plugged = _compiled_install(torch)
    else:
        plugged = allocator()
        try:
            torch.cuda.memory.change_current_allocator(plugged)
        except RuntimeError as e:
            # torch: "Can't swap an already initialized allocator".
            raise RuntimeError(f"{_TOO_LATE} (PyTorch said: {e})") from e
    # Swapped: installed, whatever follows.
    _installed = True
    if _native.log_path() is not None:
        atexit.register(_write_log_at_exit)
    if not compiled:
        _forward_record_streams(torch)
        _keep_cudnn_benchmark_off(torch)
    _route_memory_functions(torch, compiled)
    if not compiled:
        _refuse_graph_capture(torch)
    return plugged


def mem_pool(**kwargs):
    """A ``torch.cuda.MemPool`` whose memory comes from hbmalloc; use it with
    ``torch.cuda.use_mem_pool(pool)``. Keyword arguments go to ``MemPool``."""
    torch = _torch()
    return torch.cuda.MemPool(allocator=_mem_pool_allocator().allocator(), **kwargs)

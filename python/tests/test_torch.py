"""hbmalloc with PyTorch, on a machine without a GPU: install() builds and
installs a CUDAPluggableAllocator from library_path(), refuses to run twice
or too late, install(compiled=True) builds the C++ allocator against this
torch and PyTorch's own C++ calls reach hbmalloc through it, and torch's
own memory_viz reads hbmalloc's snapshots (the C ABI's, and those `hbmalloc
replay --snapshot-at-peak` writes).

Skipped when torch is not importable (scripts/test-python installs it with
HBMALLOC_TEST_TORCH=1). Each install() case runs in a fresh interpreter:
PyTorch's current allocator is process-wide state.
"""

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import needs_driver, run_python

torch = pytest.importorskip("torch", reason="PyTorch is not installed (HBMALLOC_TEST_TORCH=1 scripts/test-python)")

MIB = 1 << 20


def run_ok(code, env=None):
    result = run_python(textwrap.dedent(code), env=env)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout


def test_install_plugs_hbmalloc_in_and_refuses_a_second_time():
    out = run_ok(
        """
        import torch, hbmalloc, hbmalloc.torch
        plugged = hbmalloc.torch.install()
        assert isinstance(plugged, torch.cuda.memory.CUDAPluggableAllocator)
        assert hbmalloc.torch.is_installed()
        try:
            hbmalloc.torch.install()
        except RuntimeError as e:
            print("second:", e)
        else:
            raise SystemExit("a second install() did not raise")
        """
    )
    assert "second: hbmalloc.torch.install() was already called" in out


def test_install_gives_torch_the_alloc_that_raises_and_mem_pool_the_one_that_returns_null():
    """PyTorch's CUDAPluggableAllocator hands a NULL from its alloc function
    to a tensor unchecked: install() loads hbmalloc_torch_alloc, which throws
    instead (tests/cxx/throw_test.cc checks the throw); a MemPool's allocator
    turns NULL into PyTorch's own out-of-memory handling, so mem_pool() loads
    hbmalloc_alloc."""
    out = run_ok(
        """
        import torch, hbmalloc.torch
        loaded = []
        real = torch.cuda.memory.CUDAPluggableAllocator

        class Recording(real):
            def __init__(self, path, alloc_fn_name, free_fn_name):
                loaded.append((alloc_fn_name, free_fn_name))
                super().__init__(path, alloc_fn_name, free_fn_name)

        torch.cuda.memory.CUDAPluggableAllocator = Recording
        hbmalloc.torch.install()
        hbmalloc.torch._mem_pool_allocator()
        print("loaded:", loaded)
        """
    )
    assert (
        "loaded: [('hbmalloc_torch_alloc', 'hbmalloc_free'), ('hbmalloc_alloc', 'hbmalloc_free')]"
        in out
    )


def test_install_passes_record_stream_on_to_hbmalloc():
    """PyTorch drops Tensor.record_stream at a pluggable allocator; install()
    wraps it so that hbmalloc hears of it, and keeps ProcessGroupNCCL off
    recordStream. Tensors here are stand-ins: CUDA tensors need a GPU."""
    out = run_ok(
        """
        import os, types
        import torch, hbmalloc, hbmalloc.torch
        os.environ.pop("TORCH_NCCL_AVOID_RECORD_STREAMS", None)
        torch_record_stream = torch.Tensor.record_stream
        heard = []
        hbmalloc.record_stream = lambda ptr, stream, device=0: heard.append((ptr, stream, device)) or True
        hbmalloc.torch.install()
        assert torch.Tensor.record_stream is not torch_record_stream
        print("nccl:", os.environ["TORCH_NCCL_AVOID_RECORD_STREAMS"])

        # torch's own checks still apply: a CPU tensor is refused as before.
        try:
            torch.zeros(1).record_stream(None)
        except (TypeError, RuntimeError) as e:
            print("cpu refused:", type(e).__name__)
        assert heard == []

        def tensor(kind, index, ptr):
            storage = types.SimpleNamespace(data_ptr=lambda: ptr)
            return types.SimpleNamespace(
                device=types.SimpleNamespace(type=kind, index=index),
                untyped_storage=lambda: storage,
            )

        stream = types.SimpleNamespace(cuda_stream=0x7700)
        assert hbmalloc.torch.forward_record_stream(tensor("cuda", 1, 0xABC000), stream)
        assert not hbmalloc.torch.forward_record_stream(tensor("cpu", None, 0x1000), stream)
        print("heard:", heard)
        """
    )
    assert "nccl: 1" in out
    assert "cpu refused:" in out
    assert f"heard: [({0xABC000}, {0x7700}, 1)]" in out


@needs_driver
def test_install_routes_torch_memory_functions_to_hbmalloc(tmp_path):
    """torch.cuda's statistics, resets, empty_cache, memory fraction and
    snapshots raise or do nothing through a pluggable allocator; after
    install() they read and steer hbmalloc. Memory is allocated through the
    C ABI on the driver double (no GPU here)."""
    dump = tmp_path / "dump.pickle"
    out = run_ok(
        f"""
        import ctypes, pickle
        import torch, hbmalloc, hbmalloc.torch
        MIB = 1 << 20
        hbmalloc.torch.install()
        # torch.cuda's memory functions answer nothing before CUDA is up; a
        # GPU process has it up once it allocated.
        torch.cuda.memory.is_initialized = lambda: True
        lib = ctypes.CDLL(hbmalloc.library_path())
        lib.hbmalloc_alloc.restype = ctypes.c_void_p
        lib.hbmalloc_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.hbmalloc_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.hbmalloc_last_error_code.restype = ctypes.c_int

        p = lib.hbmalloc_alloc(3 * MIB, 0, None)
        assert p
        stats = torch.cuda.memory_stats(0)
        assert dict(stats) == hbmalloc.memory_stats(0), "the same statistics"
        assert torch.cuda.memory_allocated(0) == stats["allocated_bytes.all.current"] >= 3 * MIB
        assert torch.cuda.memory_reserved(0) >= 3 * MIB
        peak = torch.cuda.max_memory_allocated(0)
        lib.hbmalloc_free(p, 3 * MIB, 0, None)
        assert torch.cuda.max_memory_allocated(0) == peak > torch.cuda.memory_allocated(0)
        torch.cuda.reset_peak_memory_stats(0)
        assert torch.cuda.max_memory_allocated(0) == torch.cuda.memory_allocated(0)
        assert torch.cuda.memory_stats(0)["allocation.all.allocated"] > 0
        torch.cuda.reset_accumulated_memory_stats(0)
        assert torch.cuda.memory_stats(0)["allocation.all.allocated"] == 0
        print(torch.cuda.memory_summary(0).splitlines()[1])

        torch.cuda.empty_cache()
        print("reserved after empty_cache:", torch.cuda.memory_reserved(0))

        # torch.cuda.set_per_process_memory_fraction initialises CUDA first:
        # call what it calls.
        torch._C._cuda_setMemoryFraction(0.001, 0)
        assert not lib.hbmalloc_alloc(64 * MIB, 0, None)
        print("over the fraction:", lib.hbmalloc_last_error_code())
        print("fraction:", torch._C._cuda_getMemoryFraction(0))
        torch._C._cuda_setMemoryFraction(1.0, 0)

        torch.cuda.memory._record_memory_history(max_entries=1000)
        q = lib.hbmalloc_alloc(5 * MIB, 0, None)
        assert q
        torch.cuda.memory._dump_snapshot({str(dump)!r})
        with open({str(dump)!r}, "rb") as f:
            snap = pickle.load(f)
        sizes = [b["size"] for seg in snap["segments"] for b in seg["blocks"]
                 if b["state"] == "active_allocated"]
        print("snapshot:", len(snap["device_traces"]), 5 * MIB in sizes)
        traced = [e["size"] for e in snap["device_traces"][0] if e["action"] == "alloc"]
        print("traced:", traced[-1] == 5 * MIB)
        torch.cuda.memory._record_memory_history(enabled=None, clear_history=True)
        print("stopped:", torch.cuda.memory._snapshot()["device_traces"][0])
        print("segments:", len(torch.cuda.memory.memory_snapshot()) > 0)
        """
    )
    assert "PyTorch CUDA memory summary, device ID 0" in out
    assert "reserved after empty_cache: 0" in out
    assert "over the fraction: 1" in out  # HBMALLOC_OUT_OF_MEMORY
    assert "fraction: 0.001" in out
    assert "snapshot: 2 True" in out  # the driver double has two devices
    assert "segments: True" in out
    assert "traced: True" in out
    assert "stopped: []" in out


def test_install_refuses_cuda_graph_capture():
    out = run_ok(
        """
        import torch, hbmalloc.torch
        torch_capture_begin = torch.cuda.CUDAGraph.capture_begin
        hbmalloc.torch.install()
        assert torch.cuda.CUDAGraph.capture_begin is not torch_capture_begin
        # A CUDAGraph needs a GPU to exist: the check runs before self is used.
        try:
            torch.cuda.CUDAGraph.capture_begin(object(), capture_error_mode="global")
        except RuntimeError as e:
            print("refused:", e)
        else:
            raise SystemExit("capture_begin did not raise")
        """
    )
    assert "refused: hbmalloc.torch.install() made hbmalloc PyTorch's CUDA allocator" in out
    assert "hbmalloc.torch.mem_pool()" in out


def test_install_keeps_cudnn_benchmark_off():
    """cuDNN's benchmark mode asks the allocator for cacheInfo, which a
    pluggable allocator raises on: install() keeps it off, through the
    property, flags() and a setting made before install()."""
    out = run_ok(
        """
        import warnings, torch, hbmalloc.torch
        torch.backends.cudnn.benchmark = True
        print("before:", torch.backends.cudnn.benchmark)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hbmalloc.torch.install()
            print("at install:", torch.backends.cudnn.benchmark, len(caught))
            torch.backends.cudnn.benchmark = True
            print("set:", torch.backends.cudnn.benchmark, len(caught))
            with torch.backends.cudnn.flags(benchmark=True):
                print("flags:", torch.backends.cudnn.benchmark, len(caught))
            torch.backends.cudnn.benchmark = False
            print("off:", torch.backends.cudnn.benchmark, len(caught))
        print("message:", caught[0].message)
        print("where:", caught[1].filename)
        """
    )
    assert "before: True" in out
    assert "at install: False 1" in out
    assert "set: False 2" in out
    assert "flags: False 3" in out
    assert "off: False 3" in out
    assert "does not yet support cacheInfo" in out
    assert "hbmalloc.torch.mem_pool()" in out
    # The warning points at the line that set the flag (python -c's code).
    assert "where: <string>" in out


def test_install_warns_when_nccl_is_told_to_record_streams():
    result = run_python(
        textwrap.dedent(
            """
            import warnings, torch, hbmalloc.torch
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                hbmalloc.torch.install()
            print([str(w.message) for w in caught])
            """
        ),
        env={"TORCH_NCCL_AVOID_RECORD_STREAMS": "0"},
    )
    assert result.returncode == 0, result.stderr
    assert "TORCH_NCCL_AVOID_RECORD_STREAMS=0" in result.stdout
    assert "ProcessGroupNCCL will call recordStream" in result.stdout


@pytest.mark.parametrize(
    "env, warned",
    [
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
        ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}, True),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "HBMALLOC_CONF": "policy:hbm"}, False),
        ({"PYTORCH_CUDA_ALLOC_CONF": " "}, False),
    ],
)
def test_install_warns_when_pytorchs_variable_picks_the_policy(env, warned):
    """With HBMALLOC_CONF unset, PyTorch's variable selects policy pytorch:
    install() says so, and says how to get hbm."""
    base = {"HBMALLOC_CONF": "", "PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": ""}
    result = run_python(
        textwrap.dedent(
            """
            import warnings, torch, hbmalloc, hbmalloc.torch
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                hbmalloc.torch.install()
            print("warnings:", [str(w.message) for w in caught if "HBMALLOC_CONF" in str(w.message)])
            print("settings:", hbmalloc.settings())
            """
        ),
        env={**base, **env},
    )
    assert result.returncode == 0, result.stderr
    if warned:
        assert "is set and HBMALLOC_CONF is not" in result.stdout
        assert "HBMALLOC_CONF=policy:hbm" in result.stdout
        assert "settings: policy:pytorch" in result.stdout
    else:
        assert "warnings: []" in result.stdout
        assert "settings: policy:hbm" in result.stdout


def test_install_too_late_after_cuda_was_initialised():
    out = run_ok(
        """
        import torch, hbmalloc.torch
        # What a process that already allocated CUDA memory looks like.
        torch.cuda.is_initialized = lambda: True
        try:
            hbmalloc.torch.install()
        except RuntimeError as e:
            print("late:", e)
        else:
            raise SystemExit("install() after CUDA initialisation did not raise")
        assert not hbmalloc.torch.is_installed()
        """
    )
    assert "came too late" in out
    assert "before the first CUDA allocation" in out


def test_install_too_late_when_torch_refuses_the_swap():
    out = run_ok(
        """
        import torch, hbmalloc.torch
        # torch's own check (an allocator already initialised), as it raises it.
        def refuse(allocator):
            raise RuntimeError("Can't swap an already initialized allocator")
        torch._C._cuda_changeCurrentAllocator = refuse
        try:
            hbmalloc.torch.install()
        except RuntimeError as e:
            print("late:", e)
            assert isinstance(e.__cause__, RuntimeError)
        else:
            raise SystemExit("install() did not pass on torch's refusal")
        assert not hbmalloc.torch.is_installed()
        """
    )
    assert "came too late" in out
    assert "Can't swap an already initialized allocator" in out


def test_mem_pool_is_backed_by_hbmalloc():
    out = run_ok(
        """
        import torch, hbmalloc.torch
        try:
            pool = hbmalloc.torch.mem_pool()
        except (RuntimeError, AssertionError) as e:
            # Some torch builds need an initialised CUDA context for a pool.
            print("no-gpu:", type(e).__name__, e)
        else:
            assert isinstance(pool, torch.cuda.MemPool)
            print("pool:", pool.allocator is not None)
        """
    )
    if out.startswith("no-gpu:"):
        pytest.skip(f"MemPool needs a GPU with this torch: {out.strip()}")
    assert "pool: True" in out


needs_cuda_torch = pytest.mark.skipif(
    torch.version.cuda is None,
    reason="the compiled allocator builds against a CUDA build of torch (its CUDA headers)",
)


@pytest.fixture(scope="session")
def compiled_cache(tmp_path_factory):
    """The environment of a process that builds the compiled allocator: one
    cache for the session, so each C++ file is compiled once."""
    return {"HBMALLOC_CACHE_DIR": str(tmp_path_factory.mktemp("compiled"))}


@needs_cuda_torch
@needs_driver
def test_compiled_allocator_answers_pytorchs_calls_from_cpp(compiled_cache):
    """tests/torch_allocator_check.cc calls the compiled allocator through
    PyTorch's allocator interface, on the driver double: statistics,
    cacheInfo, a recorded stream holding memory after its free, errors of
    PyTorch's own types (out-of-memory observers told first), a graph
    capture's private pool and a MemPool's (use_on_oom, no_split, live
    allocations), history, IPC in PyTorch's format (and refused for what is
    not hbmalloc's), checkpointing refused with hbmalloc's reason, torch.profiler's memory events, fraction and resets."""
    check = pathlib.Path(__file__).with_name("torch_allocator_check.cc")
    out = run_ok(
        f"""
        import ctypes, hbmalloc, hbmalloc.torch
        library = ctypes.CDLL(str(hbmalloc.torch._compile({str(check)!r})))
        check = library.hbmalloc_torch_compiled_check
        check.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
        report = ctypes.create_string_buffer(1 << 16)
        check(hbmalloc.library_path().encode(), report, len(report))
        print(report.value.decode())
        """,
        compiled_cache,
    )
    assert "exception" not in out, out
    for line in [
        "name: hbmalloc",
        "malloc: 1",
        f"allocated: {3 * MIB}",
        f"requested large pool: {3 * MIB}",
        "cacheInfo: 1",
        "cacheInfo keeps a larger guess: 1",
        "recordStream: ok",
        # Freed, but still active: the recorded stream's work is not done.
        "after free: allocated 0, active 1",
        "too large: OutOfMemoryError: CUDA out of memory. hbmalloc: tried to allocate 1.00 PiB",
        "bad device: Error: hbmalloc: device 7 is out of range",
        f"observed: device 0, {1 << 50} bytes, total 1, free 1; \n",
        # A graph capture's private pool (hbmalloc.h: nothing given back
        # meanwhile), then a MemPool's.
        "pool holders: 1",
        "empty_cache during capture: empty_cache is not allowed while a CUDA graph capture",
        "the pool reuses its memory: 1",
        "others never get it: 1",
        "second end: hbmalloc: endAllocateToPool for pool (9, 0) on device 0, which is not",
        "not routed after the end: 1",
        f"released: holders 0, memory given back {2 * MIB}",
        "MemPool holders: 1 then 0",
        "release again: hbmalloc: releasePool: no private memory pool (0, 5) on this device",
        "begin twice: hbmalloc: beginAllocateToPool: already allocating to pool (9, 0) on device 0",
        # torch.profiler's memory events: the request's size, then the
        # device's allocated bytes after the call (the 3 MiB block above is
        # freed but still active, so not allocated).
        # A tensor's memory goes back through its DataPtr's deleter.
        f"tensor: deleter is raw_deleter 1, simple 1, allocated {MIB}, after its delete 0, zero-size null 1",
        # MemPool(use_on_oom=True, no_split=True): recorded; out of memory,
        # a request is served from such a pool's cache; ~MemPool's
        # setUseOnOOM(false) after the pool is gone does not throw.
        "pool options: use_on_oom 1, no_split 1",
        "live: exact 1, one missing 0, one foreign 0, after a free 1",
        "out of memory, use_on_oom: served 1; without: OutOfMemoryError",
        "after release: options 00, pools with options 0",
        "unknown pool: no private memory pool (0, 6) on this device",
        "history: 1 off 0 on 1",
        "shareIpcHandle: hbmalloc: cannot share 0x0 with another process: it is not a live allocation",
        "getIpcDevPtr: hbmalloc: not a CUDA IPC handle PyTorch or hbmalloc wrote: 1 bytes",
        "shareIpcHandle: 66 bytes, version 2, type c, offset within its 2 MiB segment 1",
        "snapshot: hbmalloc: a memory snapshot from C++ is not available; take it from Python",
        "getCheckpointState: hbmalloc: CUDA graph tree checkpointing",
        "allocateWithAddress: hbmalloc: CUDA graph tree checkpointing",
        "raw_delete of a foreign pointer: hbmalloc: raw_delete of a pointer raw_alloc did not hand out",
        f"profiler: usage 1 {MIB} allocated {MIB} reserved 1 cuda:0; "
        f"usage 1 {-MIB} allocated 0 reserved 1 cuda:0; "
        f"out of memory {1 << 50} cuda:0; \n",
        "fraction: 0.5",
        "allocations counted after reset: 0",
        "peak is current after reset: 1",
    ]:
        assert line in out, f"{line!r} not in:\n{out}"


def throwing_defaults(torch_include, torch_lib):
    """The CUDAAllocator virtuals whose default throws in this torch: from
    the header (a body with TORCH_CHECK(false / TORCH_CHECK_NOT_IMPLEMENTED(false
    / throw, in CUDAAllocator or in DeviceAllocator unless CUDAAllocator
    defines it), and CUDAPluggableAllocator's, whose implementations are not
    installed: named by their messages in libtorch_cuda.so ("... does not yet
    support NAME")."""
    throws = re.compile(r"TORCH_CHECK(?:_NOT_IMPLEMENTED)?\(\s*false|\bthrow\b")

    def virtuals(header, cls):
        """{name: (virtual?, body)} of the methods `cls` declares in its body
        (the body "" where it has none there)."""
        text = (torch_include / header).read_text()
        text = re.sub(r"//[^\n]*", "", text)
        start = re.search(rf"(?:class|struct)\s+(?:\w+\s+)?{cls}\s*:[^{{;]*{{", text)
        assert start, f"no {cls} in {header}"

        def matching(k):  # index after the brace that closes the one before k
            depth = 1
            while depth:
                depth += {"{": 1, "}": -1}.get(text[k], 0)
                k += 1
            return k

        end = matching(start.end())
        found = {}
        declaration = re.compile(r"^[ \t]*(virtual\s+)?[\w:<>,*& \t]*?\b(\w+)\s*\(", re.M)
        for decl in declaration.finditer(text[start.end() : end]):
            k = start.end() + decl.end()
            depth = 1
            while depth:  # past the parameter list
                depth += {"(": 1, ")": -1}.get(text[k], 0)
                k += 1
            tail = re.match(r"[^;{}()]*[;{]", text[k:end])
            body = ""  # a declaration without a body (pure, or defined elsewhere)
            if tail and tail.group(0).endswith("{") and "=" not in tail.group(0):
                body = text[k + tail.end() : matching(k + tail.end())]
            if body or decl.group(2) not in found:
                found[decl.group(2)] = (bool(decl.group(1)), body)
        return found

    cuda = virtuals("c10/cuda/CUDACachingAllocator.h", "CUDAAllocator")
    names = {name for name, (virtual, body) in cuda.items() if virtual and throws.search(body)}
    base_header = torch_include / "c10/core/CachingDeviceAllocator.h"
    if base_header.exists() and "struct C10_API DeviceAllocator" in base_header.read_text():
        base = virtuals("c10/core/CachingDeviceAllocator.h", "DeviceAllocator")
        names |= {
            n for n, (v, body) in base.items() if v and throws.search(body) and not cuda.get(n, (0, ""))[1]
        }
    binary = (torch_lib / "libtorch_cuda.so").read_bytes()
    lower = {name.lower(): name for name in cuda}
    for match in re.finditer(rb"CUDAPluggableAllocator does not (?:yet )?support (\w+)", binary):
        word = match.group(1).decode()
        names.add(lower.get(word.lower(), word))
    return names


@needs_cuda_torch
def test_compiled_allocator_overrides_every_throwing_default():
    """Every CUDAAllocator virtual whose default throws in the installed
    torch (its header, and CUDAPluggableAllocator's library) is overridden
    by the compiled allocator, with this torch's signature: a throw from a
    virtual PyTorch calls in a destructor (~MemPool's setUseOnOOM) ends the
    process. A method binds when it is marked override, or when the
    compiler's -Wsuggest-override says it could be."""
    import hbmalloc.torch

    root = pathlib.Path(torch.__file__).resolve().parent
    names = throwing_defaults(root / "include", root / "lib")
    assert "setUseOnOOM" in names and "cacheInfo" in names, names  # the extraction works
    source = pathlib.Path(hbmalloc.torch.__file__).with_name("torch_allocator.cc")
    from torch.utils import cpp_extension

    includes = [f"-I{source.parent}"]
    for directory in [*cpp_extension.include_paths(), *hbmalloc.torch._cuda_include_dirs()]:
        includes += ["-isystem", str(directory)]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    compiler = os.environ.get("CXX", "c++")
    command = [compiler, "-std=c++20", "-fsyntax-only", "-Wsuggest-override",
               f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, str(source)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[:4000]
    bound = set(re.findall(r"HbmallocAllocator::(\w+)\([^\n]*can be marked override", result.stderr))
    body = re.sub(r"//[^\n]*", "", source.read_text())
    body = body[body.index("class HbmallocAllocator") :]
    bound |= set(re.findall(r"\b(\w+)\s*\([^;{}]*\)\s*(?:const\s*)?override\s*{", body))
    missing = sorted(names - bound)
    assert not missing, f"torch {torch.__version__}: not overridden with this torch's signature: {missing}"


@needs_cuda_torch
@needs_driver
def test_install_compiled_lets_torch_ask_hbmalloc_itself(compiled_cache):
    """install(compiled=True): torch.cuda's statistics, resets, empty_cache
    and memory fraction reach hbmalloc through PyTorch's own C++ (nothing
    routed), cuDNN's benchmark mode and Tensor.record_stream are left as
    they are, snapshots are routed, and graph capture is left to PyTorch
    (which calls the compiled allocator's private-pool hooks)."""
    out = run_ok(
        """
        import ctypes, os
        import torch, hbmalloc, hbmalloc.torch
        MIB = 1 << 20
        os.environ.pop("TORCH_NCCL_AVOID_RECORD_STREAMS", None)
        native_stats = torch._C._cuda_memoryStats
        record_stream = torch.Tensor.record_stream
        installed = hbmalloc.torch.install(compiled=True)
        print("handle:", type(installed).__name__, torch._C._cuda_getAllocatorBackend())
        assert torch._C._cuda_memoryStats is native_stats, "statistics are not routed"
        assert torch.Tensor.record_stream is record_stream, "record_stream is not wrapped"
        print("nccl:", os.environ.get("TORCH_NCCL_AVOID_RECORD_STREAMS"))

        torch.cuda.memory.is_initialized = lambda: True  # as once a GPU allocated
        lib = ctypes.CDLL(hbmalloc.library_path())
        lib.hbmalloc_alloc.restype = ctypes.c_void_p
        lib.hbmalloc_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.hbmalloc_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        p = lib.hbmalloc_alloc(3 * MIB, 0, None)
        assert p
        stats = torch.cuda.memory_stats(0)
        ours = hbmalloc.memory_stats(0)
        # Every statistic this torch reports, as hbmalloc has it (hbmalloc's
        # keys follow the newest torch: an older one lacks num_oom_rejections).
        print("same statistics:", bool(stats) and all(ours[k] == v for k, v in stats.items()), len(stats))
        print("allocated:", torch.cuda.memory_allocated(0))
        lib.hbmalloc_free(p, 3 * MIB, 0, None)
        torch.cuda.reset_peak_memory_stats(0)
        assert torch.cuda.max_memory_allocated(0) == torch.cuda.memory_allocated(0) == 0
        torch.cuda.reset_accumulated_memory_stats(0)
        assert torch.cuda.memory_stats(0)["allocation.all.allocated"] == 0
        torch.cuda.empty_cache()
        print("reserved after empty_cache:", torch.cuda.memory_reserved(0))
        torch._C._cuda_setMemoryFraction(0.001, 0)
        print("fraction:", torch._C._cuda_getMemoryFraction(0), hbmalloc.memory_fraction(0))
        torch._C._cuda_setMemoryFraction(1.0, 0)

        torch.backends.cudnn.benchmark = True
        print("benchmark:", torch.backends.cudnn.benchmark)
        torch.cuda.memory._record_memory_history(max_entries=1000)
        q = lib.hbmalloc_alloc(5 * MIB, 0, None)
        traced = [e["size"] for e in torch.cuda.memory._snapshot()["device_traces"][0]
                  if e["action"] == "alloc"]
        print("traced:", traced[-1] == 5 * MIB)
        print("graphs left to PyTorch:", "hbmalloc" not in torch.cuda.CUDAGraph.capture_begin.__module__)
        """,
        compiled_cache,
    )
    assert "handle: _CUDAAllocator hbmalloc" in out
    assert "nccl: None" in out
    assert "same statistics: True" in out
    assert f"allocated: {3 * MIB}" in out
    assert "reserved after empty_cache: 0" in out
    assert "fraction: 0.001 0.001" in out
    assert "benchmark: True" in out
    assert "traced: True" in out
    assert "graphs left to PyTorch: True" in out


@needs_cuda_torch
def test_install_compiled_too_late_and_build_errors(compiled_cache, tmp_path):
    """PyTorch's own refusal reaches the caller as "too late" (its allocator
    initialised: here, the pluggable one install() made); a compiler that
    fails is named with its output, and a torch older than the allocator
    needs gets one error that says so."""
    out = run_ok(
        """
        import torch, hbmalloc.torch
        hbmalloc.torch.install()
        try:
            hbmalloc.torch._compiled_install(torch)
        except RuntimeError as e:
            print("late:", e)
        """,
        compiled_cache,
    )
    assert "came too late" in out
    assert "Can't swap an already initialized allocator" in out

    def failed_build(compiler, cache_dir):
        """install(compiled=True) in a fresh interpreter with CXX=`compiler`,
        which must fail the build: its RuntimeError, printed."""
        result = run_python(
            textwrap.dedent(
                """
                import hbmalloc.torch
                try:
                    hbmalloc.torch.install(compiled=True)
                except RuntimeError as e:
                    print("build:", e)
                assert not hbmalloc.torch.is_installed()
                """
            ),
            env={"HBMALLOC_CACHE_DIR": str(cache_dir), "CXX": str(compiler)},
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    broken = failed_build("false", compiled_cache["HBMALLOC_CACHE_DIR"] + "/none")
    assert "build: hbmalloc.torch: compiling" in broken
    assert "failed (exit 1)" in broken

    # torch 2.5, as far as the preprocessor can tell: a compiler that finds
    # this torch/version.h before the installed torch's.
    old_torch = tmp_path / "torch-2.5"
    (old_torch / "torch").mkdir(parents=True)
    (old_torch / "torch" / "version.h").write_text(
        "#define TORCH_VERSION_MAJOR 2\n#define TORCH_VERSION_MINOR 5\n"
    )
    compiler = tmp_path / "c++-with-torch-2.5"
    compiler.write_text(f'#!/bin/sh\nexec c++ -I{old_torch} "$@"\n')
    compiler.chmod(0o755)
    too_old = failed_build(compiler, tmp_path / "cache")
    assert "needs torch 2.6 or newer" in too_old, too_old


def memory_viz(tmp_path):
    """Runs `python -m torch.cuda._memory_viz ARGS...`, asserting success;
    returns its output.

    `segments` and `memory` render flame graphs with flamegraph.pl, which
    _memory_viz downloads to ~/.cache; this machine is offline, so a stub in
    a private HOME stands in for the renderer: it keeps the lines _memory_viz
    computed from the snapshot (frames and sizes)."""
    home = tmp_path / "home"
    (home / ".cache").mkdir(parents=True, exist_ok=True)
    stub = home / ".cache" / "flamegraph.pl"
    stub.write_text(
        f"#!{sys.executable}\n"
        "import sys\n"
        "sys.stdout.write('<svg>' + sys.stdin.read() + '</svg>')\n"
    )
    stub.chmod(0o755)
    env = dict(os.environ, HOME=str(home))

    def viz(*args):
        result = subprocess.run(
            [sys.executable, "-m", "torch.cuda._memory_viz", *args],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert result.returncode == 0, f"_memory_viz {args}:\n{result.stdout}\n{result.stderr}"
        return result.stdout

    return viz


def check_every_view(viz, snapshot, tmp_path, size):
    """Every view of memory_viz opens `snapshot`; the flame graphs show a block of `size` bytes."""
    for command in ("segments", "memory"):
        svg = tmp_path / f"{command}.svg"
        viz(command, str(snapshot), "-o", str(svg))
        lines = svg.read_text()
        assert lines.startswith("<svg>") and str(size) in lines, lines
    # Summary statistics and the trace, printed.
    stats = viz("stats", str(snapshot))
    assert "Total" in stats or "segment" in stats.lower(), stats
    # The trace, one line per history entry: `name = segment[offset:size]`
    # for an allocation (the segment a variable of its own, or `seg_N` for
    # one that existed before the history began), `del name` for a free.
    trace = viz("trace", str(snapshot))
    assert "entries" in trace and re.search(r"^\w+ = \w+\[\d+:", trace, re.M), trace
    # The interactive pages that pytorch.org/memory_viz shows.
    for command in ("trace_plot", "segment_plot"):
        html = tmp_path / f"{command}.html"
        viz(command, str(snapshot), "-o", str(html))
        assert html.stat().st_size > 1000, f"{command} wrote almost nothing"


@needs_driver
def test_memory_viz_reads_hbmalloc_snapshots(c_abi, tmp_path):
    import hbmalloc

    kept = [c_abi.hbmalloc_alloc(size, 0, None) for size in (1000, 3 * MIB, 25 * MIB)]
    freed = c_abi.hbmalloc_alloc(2 * MIB, 0, None)
    c_abi.hbmalloc_free(freed, 0, 0, None)
    snapshot = tmp_path / "hbmalloc.pickle"
    hbmalloc.snapshot(snapshot)
    for ptr in kept:
        c_abi.hbmalloc_free(ptr, 0, 0, None)
    check_every_view(memory_viz(tmp_path), snapshot, tmp_path, 25 * MIB)


@pytest.mark.skipif(
    not os.environ.get("HBMALLOC_CLI"),
    reason="HBMALLOC_CLI does not name the hbmalloc binary (run scripts/test-python)",
)
@pytest.mark.parametrize("policy", ["hbm", "pytorch"])
def test_memory_viz_reads_replay_snapshots_at_peak(tmp_path, policy):
    # The bundled GPT-2 trace: 147.24 MiB (154,389,504 bytes) live from its first op.
    trace = pathlib.Path(__file__).resolve().parents[2] / "traces" / "gpt2_train.json.gz"
    snapshot = tmp_path / "peak.pickle"
    result = subprocess.run(
        [os.environ["HBMALLOC_CLI"], "replay", str(trace), "--policy", policy, "--snapshot-at-peak", str(snapshot)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "at peak, after op" in result.stdout, result.stdout
    check_every_view(memory_viz(tmp_path), snapshot, tmp_path, 154389504)


@needs_cuda_torch
def test_gpu_check_dry_run_plans_every_check(compiled_cache, tmp_path):
    """scripts/gpu-check --dry-run on a machine without a GPU: the
    environment and the compiled allocator's build pass, every GPU check is
    planned, and the JSON summary says so."""
    script = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "gpu-check"
    summary = tmp_path / "summary.json"
    result = subprocess.run(
        [sys.executable, str(script), "--dry-run", "--json", str(summary)],
        capture_output=True, text=True, env=dict(os.environ, **compiled_cache), timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    import json

    checks = {c["name"]: c["status"] for c in json.loads(summary.read_text())["checks"]}
    assert checks["environment"] == checks["build compiled allocator"] == "passed", checks
    for name in ["train/hbm-compiled/0", "mempool/hbm-compiled", "ipc/hbm-compiled", "gaps/hbm-compiled",
                 "bert/hbm-pluggable"]:
        assert checks[name] == "planned", checks

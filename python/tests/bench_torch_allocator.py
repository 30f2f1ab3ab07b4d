"""Benchmark (not a test): the compiled allocator's per-call cost next to
the C ABI call it wraps, on the CUDA driver double.

    HBMALLOC_CUDA_DRIVER=target/debug/libcuda_driver_double.so \\
        target/pyenv/bin/python python/tests/bench_torch_allocator.py [ITERATIONS]

Prints ns per allocate/free pair for each path (torch_allocator_bench.cc): ``c_abi`` (hbmalloc_torch_alloc and
hbmalloc_free), ``tensor`` (allocate less its device and stream queries,
then the DataPtr's deleter), ``raw`` (raw_alloc's malloc and raw_delete)
and ``pluggable`` (PyTorch's stock CUDAPluggableAllocator over the same C
ABI, as install() without compiled=True), for a zero-size request and a
cached 1 MiB block. ``HBMALLOC_BENCH_SOURCE`` names a copy of torch_allocator_bench.cc
beside an older torch_allocator.cc (a before/after run).
"""

import ctypes
import os
import pathlib
import sys

os.environ.setdefault("HBMALLOC_CONF", "policy:pytorch")

import hbmalloc  # noqa: E402
import hbmalloc.torch  # noqa: E402


def main():
    iterations = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
    source = os.environ.get("HBMALLOC_BENCH_SOURCE") or pathlib.Path(__file__).with_name(
        "torch_allocator_bench.cc"
    )
    library = ctypes.CDLL(str(hbmalloc.torch._compile(source)))
    bench = library.hbmalloc_torch_compiled_bench
    bench.argtypes = [ctypes.c_char_p, ctypes.c_long, ctypes.c_char_p, ctypes.c_size_t]
    report = ctypes.create_string_buffer(1 << 16)
    bench(hbmalloc.library_path().encode(), iterations, report, len(report))
    print(report.value.decode(), end="")


if __name__ == "__main__":
    main()

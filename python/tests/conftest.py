"""Shared set-up: the configuration hbmalloc reads at first use, and helpers.

hbmalloc's allocators are created once per process and read the
environment then, so it is fixed here, before any test touches them:
policy pytorch (the driver double backs its segments with host memory),
history on (snapshots carry a trace). The CUDA driver is the test double
named by HBMALLOC_CUDA_DRIVER (scripts/test-python builds it and sets it).
"""

import ctypes
import os
import pathlib
import subprocess
import sys

import pytest

os.environ.setdefault("HBMALLOC_CONF", "policy:pytorch")
os.environ.setdefault("HBMALLOC_HISTORY_ENTRIES", "100000")


def find_shared_traces():
    """`shared/traces` in this checkout's parents (CI puts shared/ beside the clone)."""
    for parent in pathlib.Path(__file__).resolve().parents:
        candidate = parent / "shared" / "traces"
        if candidate.is_dir():
            return candidate
    return None


def has_driver():
    path = os.environ.get("HBMALLOC_CUDA_DRIVER")
    return bool(path) and os.path.exists(path)


needs_driver = pytest.mark.skipif(
    not has_driver(),
    reason="HBMALLOC_CUDA_DRIVER does not name the driver test double (run scripts/test-python)",
)


@pytest.fixture(scope="session")
def c_abi():
    """hbmalloc's C ABI through ctypes, from the package's own library."""
    import hbmalloc

    lib = ctypes.CDLL(hbmalloc.library_path())
    lib.hbmalloc_alloc.restype = ctypes.c_void_p
    lib.hbmalloc_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.hbmalloc_free.restype = None
    lib.hbmalloc_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.hbmalloc_last_error_code.restype = ctypes.c_int
    lib.hbmalloc_last_error.restype = ctypes.c_ssize_t
    lib.hbmalloc_last_error.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    return lib


def run_python(code, env=None, timeout=300):
    """Runs `code` in a fresh interpreter (process-wide state: allocators,
    torch's current allocator); returns the completed process."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", code],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )

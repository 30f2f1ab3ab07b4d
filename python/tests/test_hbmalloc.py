"""The hbmalloc package without PyTorch: import, stats, summary, snapshot,
replay, the C ABI in library_path()."""

import ctypes
import json
import os
import pickle
import subprocess
import textwrap

import pytest

import hbmalloc
from conftest import find_shared_traces, needs_driver, run_python

MIB = 1 << 20


def test_import_needs_no_torch():
    # torch made unimportable: hbmalloc and hbmalloc.torch still import, and
    # install() says what is missing.
    result = run_python(
        textwrap.dedent(
            """
            import sys
            sys.modules["torch"] = None
            import hbmalloc, hbmalloc.torch
            assert hbmalloc.library_path().endswith((".so", ".pyd", ".dylib"))
            try:
                hbmalloc.torch.install()
            except ImportError as e:
                print("ImportError:", e)
            else:
                raise SystemExit("install() without torch did not raise")
            """
        )
    )
    assert result.returncode == 0, result.stderr
    assert "ImportError: hbmalloc.torch needs PyTorch" in result.stdout


def test_import_does_not_import_torch():
    result = run_python("import sys, hbmalloc; print('torch' in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_library_path_exports_the_c_abi():
    lib = ctypes.CDLL(hbmalloc.library_path())
    for name in [
        "hbmalloc_alloc",
        "hbmalloc_torch_alloc",
        "hbmalloc_free",
        "hbmalloc_record_stream",
        "hbmalloc_empty_cache",
        "hbmalloc_reset_peak_stats",
        "hbmalloc_reset_accumulated_stats",
        "hbmalloc_set_history_entries",
        "hbmalloc_set_memory_fraction",
        "hbmalloc_stats_json",
        "hbmalloc_summary",
        "hbmalloc_snapshot",
        "hbmalloc_last_error",
        "hbmalloc_last_error_code",
        "hbmalloc_init",
        "hbmalloc_reset",
    ]:
        assert getattr(lib, name) is not None


@needs_driver
def test_memory_stats_has_pytorchs_keys(c_abi):
    stats = hbmalloc.memory_stats(0)
    for kind in [
        "allocation",
        "segment",
        "active",
        "inactive_split",
        "allocated_bytes",
        "reserved_bytes",
        "active_bytes",
        "inactive_split_bytes",
        "requested_bytes",
    ]:
        for pool in ["all", "small_pool", "large_pool"]:
            for field in ["current", "peak", "allocated", "freed"]:
                assert f"{kind}.{pool}.{field}" in stats
    for key in ["num_alloc_retries", "num_ooms", "max_split_size", "oversize_allocations.current"]:
        assert key in stats
    assert all(isinstance(v, int) for v in stats.values())

    before = stats["allocation.all.current"]
    ptr = c_abi.hbmalloc_alloc(3 * MIB, 0, None)
    assert ptr
    stats = hbmalloc.memory_stats(0)
    assert stats["allocation.all.current"] == before + 1
    assert stats["requested_bytes.large_pool.current"] >= 3 * MIB
    c_abi.hbmalloc_free(ptr, 3 * MIB, 0, None)
    assert hbmalloc.memory_stats(0)["allocation.all.current"] == before


@needs_driver
def test_driver_calls_count_and_time_what_the_allocator_asked_of_the_driver(c_abi):
    before = hbmalloc.driver_calls(0)
    ptr = c_abi.hbmalloc_alloc(64 * MIB, 0, None)  # policy pytorch: a cudaMalloc of its own
    assert ptr
    after = hbmalloc.driver_calls(0)
    c_abi.hbmalloc_free(ptr, 64 * MIB, 0, None)
    assert set(after) == set(before) and "segment_alloc" in after
    made = {k: after[k]["calls"] - before[k]["calls"] for k in after}
    assert made["segment_alloc"] == 1
    assert after["segment_alloc"]["seconds"] > before["segment_alloc"]["seconds"]
    for kind, calls in made.items():
        if calls == 0:
            assert after[kind]["seconds"] == before[kind]["seconds"], kind


@needs_driver
def test_memory_summary_and_empty_cache(c_abi):
    ptr = c_abi.hbmalloc_alloc(MIB // 2, 0, None)
    text = hbmalloc.memory_summary(0)
    assert "PyTorch CUDA memory summary, device ID 0" in text
    assert "from small pool" in text
    assert "from small pool" not in hbmalloc.memory_summary(0, abbreviated=True)
    c_abi.hbmalloc_free(ptr, 0, 0, None)
    hbmalloc.empty_cache(0)
    assert hbmalloc.memory_stats(0)["reserved_bytes.all.current"] == 0


@needs_driver
def test_errors_become_python_exceptions(c_abi):
    with pytest.raises(ValueError, match="device 9 is out of range"):
        hbmalloc.memory_stats(9)
    assert hbmalloc.settings(0) == "policy:pytorch"
    # The C ABI reports through its last error instead.
    c_abi.hbmalloc_free(0x1000, 0, 0, None)
    assert c_abi.hbmalloc_last_error_code() == 3  # HBMALLOC_UNKNOWN_POINTER
    buf = ctypes.create_string_buffer(256)
    c_abi.hbmalloc_last_error(buf, 256)
    assert b"0x1000" in buf.value


@needs_driver
def test_record_stream_keeps_a_block_from_reuse_until_the_other_stream_is_done(c_abi):
    double = ctypes.CDLL(os.environ["HBMALLOC_CUDA_DRIVER"])
    double.hbm_double_set_events_complete.argtypes = [ctypes.c_bool]
    alloc_stream, other_stream = 0x5100, 0x5200
    size = 6 * MIB

    def alloc():
        ptr = c_abi.hbmalloc_alloc(size, 0, alloc_stream)
        assert ptr, "allocation failed"
        return ptr

    def free(ptr):
        c_abi.hbmalloc_free(ptr, size, 0, alloc_stream)

    double.hbm_double_set_events_complete(False)
    try:
        # Without record_stream, a freed block is reused on its stream at once
        # (what makes the check below able to fail).
        plain = alloc()
        free(plain)
        assert alloc() == plain
        free(plain)

        used = alloc()
        assert hbmalloc.record_stream(used, other_stream, device=0) is True
        free(used)
        # The other stream's work is pending: the block stays out of reach.
        other = alloc()
        assert other != used
        free(other)
    finally:
        double.hbm_double_set_events_complete(True)
        double.hbm_double_complete_all_events()
    # Memory hbmalloc did not allocate: nothing to do, as in PyTorch.
    assert hbmalloc.record_stream(0x1000, other_stream, device=0) is False
    with pytest.raises(ValueError, match="device 9 is out of range"):
        hbmalloc.record_stream(0x1000, other_stream, device=9)


def test_no_driver_is_a_clear_error():
    result = run_python(
        textwrap.dedent(
            """
            import hbmalloc
            try:
                hbmalloc.memory_stats(0)
            except RuntimeError as e:
                print("RuntimeError:", e)
            """
        ),
        env={"HBMALLOC_CUDA_DRIVER": "/nonexistent/libcuda.so.1"},
    )
    assert result.returncode == 0, result.stderr
    assert "RuntimeError: " in result.stdout
    assert "/nonexistent/libcuda.so.1" in result.stdout


def test_bad_configuration_names_the_key():
    result = run_python(
        "import hbmalloc\ntry:\n    hbmalloc.memory_stats(0)\nexcept ValueError as e:\n    print(e)",
        env={"HBMALLOC_CONF": "policy:pytorch,max_split_size_mb:abc"},
    )
    assert result.returncode == 0, result.stderr
    assert "HBMALLOC_CONF" in result.stdout and "max_split_size_mb" in result.stdout


@needs_driver
def test_snapshot_is_written_and_loadable(c_abi, tmp_path):
    keep = c_abi.hbmalloc_alloc(5 * MIB, 0, None)
    gone = c_abi.hbmalloc_alloc(1000, 0, None)
    c_abi.hbmalloc_free(gone, 1000, 0, None)
    path = tmp_path / "snapshot.pickle"
    hbmalloc.snapshot(path, device=0)
    with open(path, "rb") as f:
        data = pickle.load(f)
    assert set(data) >= {"segments", "device_traces", "allocator_settings", "external_annotations"}
    assert data["segments"], "the live block's segment is there"
    segment = data["segments"][0]
    for key in [
        "device",
        "address",
        "total_size",
        "allocated_size",
        "active_size",
        "requested_size",
        "stream",
        "segment_type",
        "segment_pool_id",
        "is_expandable",
        "frames",
        "blocks",
    ]:
        assert key in segment
    states = {b["state"] for s in data["segments"] for b in s["blocks"]}
    assert "active_allocated" in states
    actions = [e["action"] for e in data["device_traces"][0]]
    assert "alloc" in actions and "free_completed" in actions and "segment_alloc" in actions
    assert data["allocator_settings"]["hbmalloc_settings"] == "policy:pytorch"
    c_abi.hbmalloc_free(keep, 0, 0, None)


def test_replay_a_real_trace():
    traces = find_shared_traces()
    if traces is None:
        pytest.skip("shared/traces not found above this checkout")
    trace = traces / "profiler-cpu" / "resnet50_train.json.gz"
    if not trace.exists():
        pytest.skip(f"{trace} is absent")
    rows = hbmalloc.replay(trace, policy="pytorch")
    assert len(rows) >= 1
    for row in rows:
        assert row["settings"] == "policy:pytorch"
        assert 0 < row["peak_live_bytes"] <= row["peak_reserved_bytes"]
        assert 0 < row["efficiency"] <= 1
        assert row["min_capacity_bytes"] >= row["peak_live_bytes"]
        assert row["out_of_memory"] is None
        assert row["device_calls"]["segment_alloc"] > 0
    expandable = hbmalloc.replay(
        trace, policy="pytorch", config="expandable_segments:True", find_min_capacity=False
    )
    assert expandable[0]["settings"] == "policy:pytorch,expandable_segments:True"
    assert expandable[0]["min_capacity_bytes"] is None
    tight = hbmalloc.replay(trace, capacity=rows[0]["peak_live_bytes"] // 2, find_min_capacity=False)
    assert tight[0]["out_of_memory"] is not None
    # The default policy is hbm, hbmalloc's own.
    default = hbmalloc.replay(trace, find_min_capacity=False)
    assert default[0]["settings"] == "policy:hbm"
    assert default[0]["peak_reserved_bytes"] < rows[0]["peak_reserved_bytes"]
    # The default driver maps whole handles only, as real ones do, so hbm creates
    # handles of at most 16 granules (on heaps under 64 GiB, such as this one),
    # each mapped whole; a driver that also maps parts of a handle (a what-if)
    # lets it map one handle per run, in as many maps as creates or more.
    granule = 2 << 20
    assert default[0]["device_calls"]["physical_create"] * 16 * granule >= default[0]["peak_reserved_bytes"]
    assert default[0]["device_calls"]["map"] >= default[0]["device_calls"]["physical_create"]
    parts = hbmalloc.replay(trace, find_min_capacity=False, part_handle_maps=True)
    assert parts[0]["out_of_memory"] is None


def test_replay_bad_input():
    with pytest.raises(ValueError, match="no_such_key"):
        hbmalloc.replay(__file__, config="no_such_key:1")
    with pytest.raises(ValueError, match="policy"):
        hbmalloc.replay(__file__, policy="nonsense")
    with pytest.raises(OSError):
        hbmalloc.replay(os.path.join(os.path.dirname(__file__), "missing.pickle"))
    with pytest.raises(ValueError, match="capacity"):
        hbmalloc.replay(__file__, capacity=0)
    # Past 1 PiB, as the CLI refuses it, not a driver error from the simulated
    # device; a size the CLI writes with a unit is not a number of bytes here.
    for capacity in [2**63, 2**64, "80GiB", 0.5, float("nan"), True]:
        with pytest.raises(ValueError, match="capacity must be"):
            hbmalloc.replay(__file__, capacity=capacity)



RMM_LOG_WITH_A_RECORDED_OOM = """Thread,Time,Action,Pointer,Size,Stream
1,00:00:00.000001,allocate,0x1000000,67108864,0x0
1,00:00:00.000002,allocate failure,0x0,1073741824,0x0
1,00:00:00.000003,free,0x1000000,67108864,0x0
1,00:00:00.000004,allocate,0x2000000,33554432,0x0
"""


def test_replay_reproduces_recorded_out_of_memory_errors_as_the_cli_does(tmp_path):
    trace = tmp_path / "oom.csv"
    trace.write_text(RMM_LOG_WITH_A_RECORDED_OOM)
    reproduced = hbmalloc.replay(trace, find_min_capacity=False)[0]
    ignored = hbmalloc.replay(trace, find_min_capacity=False, ignore_recorded_ooms=True)[0]
    # A path as bytes, as os.fspath() accepts it.
    assert hbmalloc.replay(os.fsencode(trace), find_min_capacity=False)[0]["ops"] == reproduced["ops"]
    # Reproducing the failure asks the driver for the gigabyte it refused.
    assert reproduced["device_calls"] != ignored["device_calls"]
    cli = os.environ.get("HBMALLOC_CLI")
    if not cli:
        return
    for flags, row in [([], reproduced), (["--ignore-recorded-ooms"], ignored)]:
        out = subprocess.run(
            [cli, "replay", "--json", *flags, str(trace)], capture_output=True, text=True, check=True
        )
        expected = json.loads(out.stdout)
        for metrics in (expected, row):
            metrics.pop("ns_per_op")
        assert row == expected, flags


@needs_driver
def test_log_is_written_and_replays_to_the_peak_the_run_saw(tmp_path):
    log = tmp_path / "run.pickle"
    code = textwrap.dedent(
        """
        import ctypes, hbmalloc
        lib = ctypes.CDLL(hbmalloc.library_path())
        lib.hbmalloc_alloc.restype = ctypes.c_void_p
        lib.hbmalloc_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.hbmalloc_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        live = [lib.hbmalloc_alloc(size << 20, 0, None) for size in (3, 1, 4, 1, 5)]
        lib.hbmalloc_free(live[1], 1 << 20, 0, None)
        lib.hbmalloc_free(live[2], 4 << 20, 0, None)
        print(hbmalloc.memory_stats(0)["requested_bytes.all.peak"])
        print(hbmalloc.write_log())
        """
    )
    result = run_python(code, env={"HBMALLOC_CONF": f"policy:pytorch,log:{log}"})
    assert result.returncode == 0, result.stderr
    peak, written = result.stdout.split("\n")[:2]
    assert int(peak) == 14 * MIB
    assert written == str([str(log)])
    replayed = hbmalloc.replay(str(log), policy="pytorch")
    assert replayed[0]["peak_live_bytes"] == int(peak)

    no_log = run_python("import hbmalloc\ntry:\n    hbmalloc.write_log()\nexcept RuntimeError as e:\n    print(e)")
    assert "log:PATH" in no_log.stdout

//! The `hbmalloc` binary end to end: the README's main command, and bad
//! input of every kind giving one clear line and a non-zero exit.

use std::process::{Command, Stdio};

mod common;
use common::{assert_clear_error, hbmalloc, smallest_devices, stdout_of_success, succeed};

fn temp_file(bytes: &[u8]) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    std::io::Write::write_all(&mut f, bytes).unwrap();
    f
}

#[test]
fn compare_with_no_argument_runs_the_bundled_trace() {
    let stdout = succeed(&["compare", "--no-min-capacity"]);
    assert!(stdout.contains("gpt2_train"), "{stdout}");
    assert!(stdout.contains("pytorch+expandable"), "{stdout}");
}

#[test]
fn bench_hits_reports_the_cache_hits_apart() {
    // The second repeat times only the hits the first found.
    let stdout = succeed(&["bench", "--hits", "--json", "--repeat", "2"]);
    let rows: Vec<serde_json::Value> = stdout
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert!(!rows.is_empty(), "{stdout}");
    for row in rows {
        let (hit_ns, share) = (row["hit_ns_per_op"].as_f64(), row["hit_share"].as_f64());
        // Two clock reads and an op: more than a few nanoseconds.
        assert!(hit_ns.is_some_and(|ns| ns > 10.0), "{row}");
        // Some ops of the bundled trace call the driver, most do not.
        assert!(share.is_some_and(|s| s > 0.5 && s < 1.0), "{row}");
        assert!(row["hit_ops"].as_u64().is_some_and(|n| n > 1000), "{row}");
    }
    // Two configurations: a figure each and their ratio; one: no ratio.
    let figures = |table: &str| -> Vec<f64> {
        let row = table.lines().nth(1).unwrap();
        row.split_whitespace()
            .skip_while(|&field| field != "cpu")
            .skip(1)
            .map(|field| field.parse().unwrap())
            .collect()
    };
    let table = succeed(&[
        "bench",
        "--hits",
        "--repeat",
        "1",
        "--run",
        "policy:pytorch",
        "--run",
        "policy:hbm",
    ]);
    assert!(table.contains("hbm hit ns/op"), "{table}");
    let [pytorch, hbm, ratio] = figures(&table)[..] else {
        panic!("{table}")
    };
    assert!((ratio - hbm / pytorch).abs() < 0.01, "{table}");
    assert!(table.lines().next().unwrap().ends_with("ratio"), "{table}");
    // The notes say what the ratio, a hit and `cpu` (the bundled trace's
    // device) are, wrapped to the width.
    let words = table.split_whitespace().collect::<Vec<_>>().join(" ");
    for note in [
        "ratio: last configuration's figure divided by the first's",
        "hit ns/op: the mallocs and frees",
        "cpu: a torch.profiler trace's CPU memory",
    ] {
        assert!(words.contains(note), "{note}:\n{table}");
    }
    let table = succeed(&["bench", "--hits", "--repeat", "1", "--run", "policy:hbm"]);
    assert_eq!(figures(&table).len(), 1, "{table}");
    assert!(!table.contains("ratio"), "{table}");
}

/// The first line of a successful run's output, a JSON object.
fn first_json(args: &[&str]) -> serde_json::Value {
    let stdout = succeed(args);
    serde_json::from_str(stdout.lines().next().unwrap()).unwrap()
}

#[test]
fn replay_json_has_the_design_metric_names() {
    let first = first_json(&["compare", "--json", "--no-min-capacity"]);
    // Not asked for: no bisection for the smallest device; by default, one.
    assert!(first["min_capacity_bytes"].is_null(), "{first}");
    let row = first_json(&["compare", "--json", "--run", "policy:pytorch"]);
    assert!(row["min_capacity_bytes"].as_u64().is_some(), "{row}");
    for key in [
        "peak_live_bytes",
        "peak_reserved_bytes",
        "efficiency",
        "min_capacity_bytes",
        "device_calls",
        "cache_hit_rate",
        "steady_state_device_calls",
        "steady_state_calls_by_kind",
        "steady_state_driver_seconds",
        "simulated_driver_seconds",
        "ns_per_op",
        "recorded",
    ] {
        assert!(first.get(key).is_some(), "missing {key} in {first}");
    }
}

/// Several trace devices get a total row per configuration, summing theirs;
/// one gets none.
#[test]
fn compare_totals_the_rows_of_several_traces() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../../traces/");
    let traces = [
        format!("{root}gpt2_train_start.csv"),
        format!("{root}gpt2_train_op3000.pickle.gz"),
    ];
    let args = ["compare", &traces[0], &traces[1], "--no-min-capacity"];
    let table = succeed(&args);
    let json = succeed(&[&args[..], &["--json"]].concat());
    let rows: Vec<serde_json::Value> = json
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let totals: Vec<&str> = table
        .lines()
        .skip_while(|l| !l.starts_with("total of the 2 rows above"))
        .skip(1)
        .take(3)
        .collect();
    // One total per configuration, in the order the rows give them.
    let mut settings: Vec<&str> = Vec::new();
    for r in &rows {
        let s = r["settings"].as_str().unwrap();
        if !settings.contains(&s) {
            settings.push(s);
        }
    }
    assert_eq!((totals.len(), settings.len()), (3, 3), "{table}");
    for (total, settings) in totals.iter().zip(settings) {
        let of: Vec<&serde_json::Value> =
            rows.iter().filter(|r| r["settings"] == settings).collect();
        assert_eq!(of.len(), 2, "{settings}: {json}");
        let calls: u64 = of
            .iter()
            .map(|r| r["memory_device_calls"].as_u64().unwrap())
            .sum();
        let ms: f64 = of
            .iter()
            .map(|r| r["simulated_driver_seconds"].as_f64().unwrap() * 1e3)
            .sum();
        let cells: Vec<&str> = total.split_whitespace().collect();
        for (cell, key) in [(4, "peak_reserved_bytes"), (3, "waste_bytes")] {
            let sum: u64 = of.iter().map(|r| r[key].as_u64().unwrap()).sum();
            let cell = cells[cells.len() - cell];
            let (figure, unit) = cell.split_at(cell.len() - 1);
            let unit = match unit {
                "G" => 1u64 << 30,
                "M" => 1 << 20,
                _ => 1 << 10,
            };
            // Within the cell's rounding: a hundredth of a GiB, or a unit.
            let step = if unit == 1 << 30 { 0.005 } else { 0.5 };
            let error = (sum as f64 / unit as f64 - figure.parse::<f64>().unwrap()).abs();
            assert!(error <= step, "{key}: {sum} as {cell} in {total}");
        }
        assert_eq!(cells[cells.len() - 2], calls.to_string(), "{total}");
        assert_eq!(cells[cells.len() - 1], format!("{ms:.1}ms"), "{total}");
    }
    let one = succeed(&["compare", &traces[0], "--no-min-capacity"]);
    assert!(!one.contains("total of the"), "{one}");
    // Side by side, the offline plan's column is totalled too.
    let wide = succeed(&[&args[..], &["--wide", "--planned", "--run", "policy:hbm"]].concat());
    let planned = |line: &str| -> f64 {
        let column = line.split('|').nth(1).unwrap();
        let cell = column.split_whitespace().next().unwrap();
        cell.trim_end_matches('G').parse().unwrap()
    };
    let lines: Vec<&str> = wide.lines().filter(|l| l.contains('|')).collect();
    let rows: f64 = lines[2..4].iter().map(|l| planned(l)).sum();
    let total = lines.iter().find(|l| l.starts_with("total")).unwrap();
    assert!((planned(total) - rows).abs() <= 0.011, "{wide}");
    // The plan's waste in MiB, each row's rounded to one.
    let waste = |line: &str| -> f64 {
        let column = line.split('|').nth(1).unwrap();
        let cell = column.split_whitespace().nth(1).unwrap();
        cell.trim_end_matches('M').parse().unwrap()
    };
    let rows: f64 = lines[2..4].iter().map(|l| waste(l)).sum();
    assert!((waste(total) - rows).abs() <= 1.5, "{wide}");
    // Every replay completed: each configuration's total has its figures.
    let hbm = total.split('|').nth(2).unwrap();
    assert!(
        hbm.split_whitespace().next().unwrap().ends_with('G'),
        "{wide}"
    );
}

/// `compare`'s table fills `COLUMNS` where standard output is no terminal
/// (0, or none: the default, 100), and no less than its figures need.
#[test]
fn compare_fits_the_columns_it_is_given() {
    let with_columns = |args: &[&str], columns: &str| {
        stdout_of_success(
            Command::new(env!("CARGO_BIN_EXE_hbmalloc"))
                .args(args)
                .env("COLUMNS", columns)
                .output()
                .unwrap(),
        )
    };
    let table = |columns| with_columns(&["compare", "--no-min-capacity"], columns);
    let narrow = table("60");
    assert!(narrow.lines().all(|l| l.chars().count() <= 60), "{narrow}");
    assert_ne!(narrow, table("100"));
    assert_eq!(table("0"), table("100"));
    // Narrower than the figures: a replay that ran out says so in a line
    // cut to the rows' width, not to the terminal's.
    let trace = temp_file(PEAK_IN_THE_MIDDLE);
    let path = trace.path().to_str().unwrap();
    let text = with_columns(&["compare", path, "--capacity", "80MiB"], "40");
    let header = text.lines().next().unwrap().chars().count();
    assert!(header > 40, "{text}");
    let stopped: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("out of memory at op"))
        .collect();
    assert_eq!(stopped.len(), 3, "{text}");
    assert!(
        stopped.iter().all(|l| l.chars().count() == header),
        "{text}"
    );
}

#[test]
fn a_reader_that_goes_away_ends_the_program_quietly() {
    // `hbmalloc compare --json | head -1`: the pipe closes while rows are
    // still to come. Here it is closed before the first row is written.
    let mut child = Command::new(env!("CARGO_BIN_EXE_hbmalloc"))
        .args(["compare", "--json", "--no-min-capacity"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run hbmalloc");
    drop(child.stdout.take());
    let output = child.wait_with_output().expect("wait for hbmalloc");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{:?}: {stderr}", output.status);
    assert!(stderr.is_empty(), "{stderr}");
}

#[test]
fn missing_file() {
    let out = hbmalloc(&["replay", "/nonexistent/trace.pickle"]);
    assert_clear_error(&out, "/nonexistent/trace.pickle: cannot read: No such file");
}

/// A pattern the shell left unexpanded is named whole, directory and all,
/// and the message says no file matched it.
#[test]
fn a_pattern_that_matched_nothing_is_named_with_its_directory() {
    let out = hbmalloc(&["compare", "no/such/dir/*"]);
    assert_clear_error(&out, "no/such/dir/*: cannot read");
    assert_clear_error(&out, "no file matches this pattern");
}

#[test]
fn empty_and_unknown_files() {
    let f = temp_file(b"");
    assert_clear_error(&hbmalloc(&["replay", f.path().to_str().unwrap()]), "format");
    let f = temp_file(b"hello, I am not a trace\n");
    assert_clear_error(&hbmalloc(&["replay", f.path().to_str().unwrap()]), "format");
}

/// A snapshot with no segment and no event, and an RMM log of its header
/// alone (or of frees of addresses it never saw), hold no device's
/// activity: every command says so and fails, rather than print a table of
/// nothing.
#[test]
fn traces_with_no_device_activity() {
    // {'segments': [], 'device_traces': [[]]}
    let snapshot =
        temp_file(b"\x80\x04}\x94(\x8c\x08segments\x94]\x94\x8c\x0ddevice_traces\x94]\x94]\x94au.");
    let header = temp_file(b"Thread,Time,Action,Pointer,Size,Stream\n");
    let frees = temp_file(b"Thread,Time,Action,Pointer,Size,Stream\n1,0.1,free,0x1000,512,0x0\n");
    let html = tempfile::NamedTempFile::new().unwrap();
    let html = html.path().to_str().unwrap();
    for f in [&snapshot, &header, &frees] {
        let path = f.path().to_str().unwrap();
        for command in [
            &["compare", path][..],
            &["replay", path],
            &["advise", path],
            &["summary", path],
            &["fidelity", path],
            &["bench", path, "--repeat", "1"],
            &["report", path, "-o", html],
        ] {
            assert_clear_error(&hbmalloc(command), "no device allocated anything");
        }
    }
}

#[test]
fn truncated_pickle() {
    // A protocol-4 pickle that opens a dict and a string, then stops.
    let f = temp_file(b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x08segm");
    assert_clear_error(&hbmalloc(&["replay", f.path().to_str().unwrap()]), "pickle");
}

#[test]
fn pickle_with_a_global_is_refused() {
    let f = temp_file(b"\x80\x02cos\nsystem\nq\x00.");
    assert_clear_error(
        &hbmalloc(&["replay", f.path().to_str().unwrap()]),
        "os.system",
    );
}

#[test]
fn snapshot_with_wrong_types() {
    // {'segments': 5, 'device_traces': []}
    let f = temp_file(b"\x80\x04}\x94(\x8c\x08segments\x94K\x05\x8c\x0ddevice_traces\x94]\x94u.");
    assert_clear_error(
        &hbmalloc(&["replay", f.path().to_str().unwrap()]),
        "segments",
    );
}

#[test]
fn corrupt_json_and_gzip() {
    let f = temp_file(b"{\"traceEvents\": [ {\"name\": \"[memory]\", ");
    assert_clear_error(
        &hbmalloc(&["replay", f.path().to_str().unwrap()]),
        "invalid JSON",
    );
    let f = temp_file(b"\x1f\x8b\x08\x00garbage");
    assert_clear_error(&hbmalloc(&["replay", f.path().to_str().unwrap()]), "gzip");
}

#[test]
fn rmm_csv_with_a_bad_line() {
    let f = temp_file(
        b"Thread,Time,Action,Pointer,Size,Stream\n1,0.1,allocate,0x1000,notanumber,0x0\n",
    );
    assert_clear_error(&hbmalloc(&["replay", f.path().to_str().unwrap()]), "line 2");
}

#[test]
fn bad_configuration() {
    let trace =
        temp_file(b"Thread,Time,Action,Pointer,Size,Stream\n1,0.1,allocate,0x1000,4096,0x0\n");
    let path = trace.path().to_str().unwrap();
    let pytorch =
        |conf: &'static str| hbmalloc(&["replay", path, "--policy", "pytorch", "--config", conf]);
    assert_clear_error(&pytorch("no_such_key:1"), "no_such_key");
    assert_clear_error(&pytorch("expandable_segments:true"), "True");
    assert_clear_error(&pytorch("max_split_size_mb:-5"), "max_split_size_mb");
    // The default policy, hbm, validates its own keys the same way.
    let hbm = |conf: &'static str| hbmalloc(&["replay", path, "--config", conf]);
    assert_clear_error(&hbm("no_such_key:1"), "no_such_key");
    assert_clear_error(&hbm("max_waste_percent:lots"), "max_waste_percent");
    assert_clear_error(&hbm("max_waste_percent:lots"), "hbm configuration");
    assert_clear_error(
        &hbmalloc(&["replay", path, "--policy", "nonsense"]),
        "nonsense",
    );
    assert_clear_error(
        &hbmalloc(&["compare", path, "--run", "policy:pytorch,garbage"]),
        "garbage",
    );
}

/// The last `count` figures of each row of a benchmark table (after its
/// header, up to its first blank line; a row's name comes before them).
fn table_figures(table: &str, count: usize) -> Vec<Vec<f64>> {
    table
        .lines()
        .skip(1)
        .take_while(|l| !l.is_empty())
        .map(|l| {
            let cells: Vec<&str> = l.split_whitespace().collect();
            cells[cells.len().saturating_sub(count)..]
                .iter()
                .map(|c| c.parse().unwrap_or_else(|_| panic!("{c} in {table}")))
                .collect()
        })
        .collect()
}

#[test]
fn bench_threads_reports_operations_per_second_for_each_count() {
    let table = succeed(&["bench-threads", "--threads", "1,2", "--repeat", "1"]);
    // The workload's name has one or two words; the figures end the row.
    let rows = table_figures(&table, 4);
    assert_eq!(
        rows.len(),
        4,
        "two workloads at two thread counts:\n{table}"
    );
    for row in &rows {
        let [threads, mutex, sharded, ratio] = row[..] else {
            panic!("{table}")
        };
        assert!(threads == 1.0 || threads == 2.0, "{table}");
        // Under a billion operations a second: no allocator is that fast.
        assert!(
            [mutex, sharded].iter().all(|&m| m > 0.0 && m < 1000.0),
            "{table}"
        );
        assert!((ratio - sharded / mutex).abs() < 0.01, "{table}");
    }
}

#[test]
fn bench_scaling_reports_time_and_calls_for_each_live_count() {
    let args = ["bench-scaling", "--live", "100,1000", "--churn", "2000"];
    let table = succeed(&args);
    let rows = table_figures(&table, 7);
    assert_eq!(rows.len(), 2, "{table}");
    for (row, live) in rows.iter().zip([100.0, 1000.0]) {
        // live, then ns/op (over a nanosecond, under a millisecond) and
        // calls for each of the three configurations.
        assert_eq!(row.len(), 7, "{table}");
        assert_eq!(row[0], live, "{table}");
        assert!(
            row[1..].chunks(2).all(|c| c[0] > 1.0 && c[0] < 1e6),
            "{table}"
        );
    }
    // The calls are the engine's, the same in every run.
    let calls =
        |rows: &[Vec<f64>]| -> Vec<f64> { rows.iter().flat_map(|r| [r[2], r[4], r[6]]).collect() };
    assert_eq!(
        calls(&rows),
        calls(&table_figures(&succeed(&args), 7)),
        "{table}"
    );
}

#[test]
fn bench_log_reports_the_log_s_cost_beside_none() {
    let table = succeed(&["bench-log", "--repeat", "1", "--entries", "1000"]);
    let rows = table_figures(&table, 3);
    assert_eq!(rows.len(), 2, "traces and small-block churn:\n{table}");
    for row in &rows {
        let [off, log, ratio] = row[..] else {
            panic!("{table}")
        };
        // More than a nanosecond an operation, less than a millisecond.
        assert!([off, log].iter().all(|&ns| ns > 1.0 && ns < 1e6), "{table}");
        assert!((ratio - log / off).abs() < 0.01, "{table}");
    }
}

/// Counts of zero (or absurd ones) are refused with the range allowed,
/// never clamped to something that was not asked for.
#[test]
fn bench_counts_out_of_range() {
    assert_clear_error(&hbmalloc(&["bench", "--repeat", "0"]), "1..=1000");
    assert_clear_error(&hbmalloc(&["bench-threads", "--shards", "0"]), "1..=4096");
    assert_clear_error(
        &hbmalloc(&["bench-threads", "--repeat", "1001"]),
        "1..=1000",
    );
    assert_clear_error(&hbmalloc(&["bench-log", "--entries", "0"]), "1..=");
    assert_clear_error(&hbmalloc(&["bench-scaling", "--live", "0"]), "1..=10000000");
    assert_clear_error(
        &hbmalloc(&["bench-scaling", "--live", "100,10000001"]),
        "1..=10000000",
    );
    assert_clear_error(
        &hbmalloc(&["bench-scaling", "--churn", "0"]),
        "1..=1000000000",
    );
    assert_clear_error(&hbmalloc(&["bench-threads", "--threads", "0"]), "1..=256");
    assert_clear_error(
        &hbmalloc(&["bench-threads", "--threads", "2,257"]),
        "1..=256",
    );
}

#[test]
fn bad_capacities() {
    let trace =
        temp_file(b"Thread,Time,Action,Pointer,Size,Stream\n1,0.1,allocate,0x1000,4096,0x0\n");
    let path = trace.path().to_str().unwrap();
    assert_clear_error(&hbmalloc(&["replay", path, "--capacity=-1"]), "capacity");
    assert_clear_error(
        &hbmalloc(&["replay", path, "--capacity", "99999999TiB"]),
        "capacity",
    );
    assert_clear_error(
        &hbmalloc(&["replay", path, "--capacity", "12 parsecs"]),
        "capacity",
    );
}

#[test]
fn absurd_sizes_in_a_trace_run_out_of_memory_cleanly() {
    // 2^62 bytes: beyond any device; the replay reports it instead of crashing.
    let trace = temp_file(
        b"Thread,Time,Action,Pointer,Size,Stream\n1,0.1,allocate,0x1000,4611686018427387904,0x0\n",
    );
    let out = hbmalloc(&["replay", trace.path().to_str().unwrap()]);
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!all.contains("panicked"), "{all}");
    assert!(!out.status.success(), "{all}");
    assert!(all.contains("invalid allocation size"), "{all}");
}

/// 64 MiB and 32 MiB allocated, both freed, 16 MiB served from the cache.
const PEAK_IN_THE_MIDDLE: &[u8] = b"Thread,Time,Action,Pointer,Size,Stream\n\
1,0.1,allocate,0x1000,67108864,0x0\n\
1,0.2,allocate,0x2000,33554432,0x0\n\
1,0.3,free,0x1000,67108864,0x0\n\
1,0.4,free,0x2000,33554432,0x0\n\
1,0.5,allocate,0x3000,16777216,0x0\n";

/// A replay that runs out of memory at the capacity asked for prints the
/// allocator's whole report (the numbers, the verdict, what would help), as
/// it does for a recorded out-of-memory error, then the smallest device on
/// which each policy completes the trace (in JSON, the object alone).
#[test]
fn a_replay_that_runs_out_of_memory_prints_the_whole_report() {
    let trace = temp_file(PEAK_IN_THE_MIDDLE);
    let args = [
        "replay",
        trace.path().to_str().unwrap(),
        "--capacity",
        "80MiB",
    ];
    let stdout = succeed(&args);
    assert!(stdout.contains("out of memory at op 1:"), "{stdout}");
    assert!(
        stdout.contains("tried to allocate 32.00 MiB")
            && stdout.contains("allocator: 64.00 MiB live")
            && stdout.contains("verdict: real demand")
            && stdout.contains("what would help: "),
        "{stdout}"
    );
    // Each policy once, on an unbounded device (the 80 MiB asked for is
    // what ran out): the trace's 96 MiB peak.
    let helps = smallest_devices(&stdout);
    let policies: Vec<&str> = helps.iter().map(|h| h.0).collect();
    assert_eq!(
        policies,
        [
            "policy:hbm",
            "policy:pytorch",
            "policy:pytorch,expandable_segments:True"
        ],
        "{stdout}"
    );
    for (policy, needed) in &helps[..2] {
        assert_eq!(*needed, "96.00 MiB (peak live 96.00 MiB)", "{policy}");
    }
    // In JSON the report is the object's: nothing else is printed.
    let stdout = succeed(&[&args[..], &["--json"]].concat());
    for line in stdout.lines() {
        let row: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert_eq!(row["out_of_memory_at_op"], 1, "{line}");
    }
}

/// One replay's JSON object (the first line of `replay ARGS --json`).
fn replay_json(args: &[&str]) -> serde_json::Value {
    first_json(&[&["replay"], args, &["--json"]].concat())
}

#[test]
fn a_capacity_as_a_multiple_is_of_the_trace_s_peak_live_memory() {
    let trace = temp_file(PEAK_IN_THE_MIDDLE);
    let path = trace.path().to_str().unwrap();
    // 96 MiB live at the peak, in two segments PyTorch's policy fits exactly.
    let at = |capacity| replay_json(&[path, "--policy", "pytorch", "--capacity", capacity]);
    assert_eq!(at("0.99x")["out_of_memory_at_op"], 1);
    assert!(at("1x")["out_of_memory_at_op"].is_null());
}

#[test]
fn replay_finds_the_smallest_device_only_when_asked() {
    let trace = temp_file(PEAK_IN_THE_MIDDLE);
    let path = trace.path().to_str().unwrap();
    assert!(replay_json(&[path])["min_capacity_bytes"].is_null());
    assert_eq!(
        replay_json(&[path, "--min-capacity"])["min_capacity_bytes"],
        100_663_296
    );
}

#[test]
fn replay_writes_the_snapshot_at_peak_for_memory_viz() {
    let trace = temp_file(PEAK_IN_THE_MIDDLE);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("peak.pickle");
    for policy in ["pytorch", "hbm"] {
        let stdout = succeed(&[
            "replay",
            trace.path().to_str().unwrap(),
            "--policy",
            policy,
            "--snapshot-at-peak",
            path.to_str().unwrap(),
        ]);
        assert!(
            stdout.contains("at peak, after op 2 of 5") && stdout.contains("96.00 MiB in use"),
            "{stdout}"
        );
        // Where the free memory lies: none is free at this peak.
        assert!(
            stdout.contains("free there                 0 B idle")
                && stdout.contains("0 B between live blocks"),
            "{stdout}"
        );
        // Our own snapshot reader takes it back: the two live blocks, and
        // the history that led there.
        let written = hbmalloc_trace::load(&path).unwrap();
        let device = &written.devices[0];
        let allocs = device
            .ops
            .iter()
            .filter(|op| matches!(op, hbmalloc_trace::Op::Alloc { .. }))
            .count();
        assert_eq!(allocs, 2, "{policy}: {:?}", device.ops);
        assert_eq!(
            hbmalloc_replay::peak_live_bytes(device),
            96 << 20,
            "{policy}"
        );
    }
}

#[test]
fn snapshot_at_peak_refuses_several_traces_and_unwritable_paths() {
    let trace = temp_file(PEAK_IN_THE_MIDDLE);
    let path = trace.path().to_str().unwrap();
    assert_clear_error(
        &hbmalloc(&["replay", path, path, "--snapshot-at-peak", "x.pickle"]),
        "one trace",
    );
    assert_clear_error(
        &hbmalloc(&[
            "replay",
            path,
            "--snapshot-at-peak",
            "/nonexistent-dir/peak.pickle",
        ]),
        "/nonexistent-dir/peak.pickle",
    );
}

/// A trace's device past what PyTorch numbers (a chrome trace's `Device
/// Id` of 2^31) gets no snapshot, with a clear error: its `device_traces`
/// would list 2^31 devices.
#[test]
fn snapshot_at_peak_refuses_a_device_past_what_pytorch_numbers() {
    let event = |id: i64| {
        format!(
            r#"{{"name": "[memory]", "ts": 1, "args": {{"Addr": 16, "Bytes": 4096, "Device Type": 1, "Device Id": {id}}}}}"#
        )
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("peak.pickle");
    let args = |trace: &tempfile::NamedTempFile| {
        [
            "replay".to_string(),
            trace.path().to_str().unwrap().to_string(),
            "--snapshot-at-peak".to_string(),
            path.to_str().unwrap().to_string(),
        ]
    };
    let far = temp_file(format!("[{}]", event(1 << 31)).as_bytes());
    let far_args = args(&far);
    let far_args: Vec<&str> = far_args.iter().map(String::as_str).collect();
    assert_clear_error(
        &hbmalloc(&far_args),
        "device 2147483648: no PyTorch snapshot of this device",
    );
    assert!(!path.exists());
    let last = temp_file(format!("[{}]", event(127)).as_bytes());
    let last_args = args(&last);
    let last_args: Vec<&str> = last_args.iter().map(String::as_str).collect();
    succeed(&last_args);
    let written = hbmalloc_trace::load(&path).unwrap();
    assert_eq!(written.devices[0].device, 127);
}

#[test]
fn replay_logs_the_driver_calls_of_every_op_that_made_any() {
    let trace = temp_file(PEAK_IN_THE_MIDDLE);
    let trace = trace.path().to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("calls.csv");
    let file = path.to_str().unwrap();
    let log = |args: &[&str]| {
        let stdout = succeed(&[&["replay", trace, "--calls-log", file], args].concat());
        assert!(stdout.contains("2 of 5 ops called the driver"), "{stdout}");
        (stdout, std::fs::read_to_string(&path).unwrap())
    };
    // PyTorch's allocator: a `cudaMalloc` for each of the first two
    // requests, timed as measured on the H100; the frees and the third
    // request are served from its cache.
    let h100 = hbmalloc::LatencyModel::h100();
    let malloc_ns = |bytes: u64| h100.of(hbmalloc::CallKind::SegmentAlloc, bytes);
    let (first, second) = (malloc_ns(64 << 20), malloc_ns(32 << 20));
    let (stdout, csv) = log(&["--policy", "pytorch"]);
    // The second half (ops 2 to 4) calls nothing.
    assert!(
        stdout.contains("steady_state_device_calls  0 (0.000000 s of simulated driver time)"),
        "{stdout}"
    );
    assert_eq!(
        csv,
        format!(
            "op,action,size_bytes,live_bytes,reserved_bytes,driver_ns,segment_alloc\n\
             0,alloc,67108864,67108864,67108864,{first},1\n\
             1,alloc,33554432,100663296,100663296,{second},1\n"
        )
    );
    // On 80 MiB the second request fails after two tries (and a look at
    // the device's free memory): nothing after it is held, so its memory
    // columns are blank.
    let (_, failed) = log(&["--policy", "pytorch", "--capacity", "80MiB"]);
    let tries = 2 * second + h100.of(hbmalloc::CallKind::MemoryInfo, 0);
    assert!(
        failed.ends_with(&format!("\n1,alloc,33554432,,,{tries},2,1\n")),
        "{failed}"
    );
    // Policy hbm: a reservation, then creates, maps and an access grant.
    let (_, hbm) = log(&["--policy", "hbm"]);
    assert!(
        hbm.starts_with("op,action,size_bytes,live_bytes,reserved_bytes,driver_ns,address_reserve,physical_create,map,set_access\n0,alloc,"),
        "{hbm}"
    );
    assert_clear_error(
        &hbmalloc(&["replay", trace, trace, "--calls-log", file]),
        "one trace",
    );
    assert_clear_error(
        &hbmalloc(&["replay", trace, "--calls-log", "/nonexistent-dir/calls.csv"]),
        "/nonexistent-dir/calls.csv",
    );
}

#[test]
fn replay_writes_a_snapshot_after_any_op() {
    let trace = temp_file(PEAK_IN_THE_MIDDLE);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("op3.pickle");
    let stdout = succeed(&[
        "replay",
        trace.path().to_str().unwrap(),
        "--snapshot-at-op",
        "3",
        path.to_str().unwrap(),
    ]);
    assert!(
        stdout.contains("after op 3 of 5") && stdout.contains("32.00 MiB in use"),
        "{stdout}"
    );
    let written = hbmalloc_trace::load(&path).unwrap();
    assert_eq!(
        hbmalloc_replay::peak_live_bytes(&written.devices[0]),
        96 << 20
    );
    // Past the end, not a number, or beside --snapshot-at-peak: one clear line.
    let trace = trace.path().to_str().unwrap();
    let file = path.to_str().unwrap();
    assert_clear_error(
        &hbmalloc(&["replay", trace, "--snapshot-at-op", "6", file]),
        "it has 5 ops",
    );
    assert_clear_error(
        &hbmalloc(&["replay", trace, "--snapshot-at-op", "three", file]),
        "not 'three'",
    );
    assert_clear_error(
        &hbmalloc(&[
            "replay",
            trace,
            "--snapshot-at-op",
            "3",
            file,
            "--snapshot-at-peak",
            file,
        ]),
        "cannot be used with",
    );
}

/// The table's last row sums each column over the rows: live, and each
/// configuration's reserved memory, waste and calls.
#[test]
fn compare_sums_every_column_in_its_total_row() {
    let a = temp_file(PEAK_IN_THE_MIDDLE);
    let b =
        temp_file(b"Thread,Time,Action,Pointer,Size,Stream\n1,0.1,allocate,0x1000,3145728,0x0\n");
    let stdout = succeed(&[
        "compare",
        a.path().to_str().unwrap(),
        b.path().to_str().unwrap(),
        "--run",
        "policy:hbm",
        "--no-min-capacity",
        "--wide",
    ]);
    // The last fields of a row are hbm's calls and driver time.
    let calls = |line: &str| -> u64 {
        let fields: Vec<&str> = line.split_whitespace().collect();
        fields[fields.len() - 2].parse().unwrap()
    };
    // The rows lie between the two rules, the total after the second.
    let rows: Vec<&str> = stdout
        .lines()
        .skip_while(|l| !l.starts_with("---"))
        .filter(|l| !l.starts_with("---"))
        .take(3)
        .collect();
    assert_eq!(rows.len(), 3, "{stdout}");
    assert!(
        rows[2].starts_with("total (sums over the rows)"),
        "{stdout}"
    );
    assert_eq!(calls(rows[2]), calls(rows[0]) + calls(rows[1]), "{stdout}");
    assert!(calls(rows[1]) > 0, "{stdout}");
    // Live: 96 MiB and 3 MiB.
    assert!(rows[2].contains("99M"), "{stdout}");
}

#[test]
fn compare_writes_the_timeline_of_every_configuration_as_csv() {
    let trace = temp_file(PEAK_IN_THE_MIDDLE);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("timeline.csv");
    succeed(&[
        "compare",
        trace.path().to_str().unwrap(),
        "--no-min-capacity",
        "--timeline",
        path.to_str().unwrap(),
    ]);
    let csv = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(
        lines[0],
        "op,live_bytes,\"reserved_bytes policy:pytorch\",\
         \"reserved_bytes policy:pytorch,expandable_segments:True\",\
         \"reserved_bytes policy:hbm\""
    );
    // The initial state and five ops; live memory from the trace.
    assert_eq!(lines.len(), 7, "{csv}");
    let live: Vec<u64> = lines[1..]
        .iter()
        .map(|l| l.split(',').nth(1).unwrap().parse().unwrap())
        .collect();
    assert_eq!(live, [0, 64 << 20, 96 << 20, 32 << 20, 0, 16 << 20]);
    // Every configuration holds at least the live memory after each op.
    for line in &lines[1..] {
        let fields: Vec<u64> = line.split(',').map(|f| f.parse().unwrap()).collect();
        assert!(fields[2..].iter().all(|&r| r >= fields[1]), "{line}");
    }
    assert_clear_error(
        &hbmalloc(&[
            "compare",
            trace.path().to_str().unwrap(),
            trace.path().to_str().unwrap(),
            "--timeline",
            path.to_str().unwrap(),
        ]),
        "one trace",
    );
}

/// `--repeat-step`: the bundled GPT-2 trace's step (6,332 operations) runs
/// twice more and says so; a trace with no repeating step is refused in one
/// line that says why.
#[test]
fn repeat_step_runs_the_last_training_step_again() {
    let out = hbmalloc(&[
        "compare",
        "--run",
        "policy:hbm",
        "--no-min-capacity",
        "--json",
        "--repeat-step",
        "2",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("the step of 6332 operations from operation 13257 runs 2 more times"),
        "{stderr}"
    );
    let row: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(row["trace"], "gpt2_train.json.gz (bundled) +2 steps");
    assert_eq!(row["ops"], 20_182 + 2 * 6_332);

    // Every allocation a different size: nothing repeats.
    let mut csv = String::from("Thread,Time,Action,Pointer,Size,Stream\n");
    for i in 0..100 {
        csv.push_str(&format!(
            "1,0,allocate,{:#x},{},0\n",
            0x1000 * (i + 1),
            512 * (i + 1)
        ));
    }
    let file = temp_file(csv.as_bytes());
    let path = file.path().with_extension("csv");
    std::fs::copy(file.path(), &path).unwrap();
    let out = hbmalloc(&["replay", path.to_str().unwrap(), "--repeat-step", "3"]);
    std::fs::remove_file(&path).unwrap();
    assert_clear_error(&out, "no repeating step found in 100 operations");
}

/// The bundled trace's row under policy hbm, with `extra` arguments to
/// `compare`.
fn bundled_hbm_row(extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "compare",
        "--run",
        "policy:hbm",
        "--no-min-capacity",
        "--json",
    ];
    args.extend_from_slice(extra);
    serde_json::from_str(&succeed(&args)).unwrap()
}

/// `--jitter-sizes`: the bundled trace with every request size scaled by
/// its own factor within 5%: the same operations, a different peak, the same
/// figures for the same seed, and other figures for another seed.
#[test]
fn jitter_sizes_replays_the_trace_with_other_sizes() {
    let recorded = bundled_hbm_row(&[]);
    let jittered = bundled_hbm_row(&["--jitter-sizes", "7"]);
    assert_eq!(jittered["trace"], "gpt2_train.json.gz (bundled) ~sizes7");
    assert_eq!(jittered["ops"], recorded["ops"]);
    let live = |r: &serde_json::Value| r["peak_live_bytes"].as_f64().unwrap();
    assert_ne!(live(&jittered), live(&recorded));
    assert!((live(&jittered) / live(&recorded) - 1.0).abs() < 0.05);
    let again = bundled_hbm_row(&["--jitter-sizes", "7"]);
    assert_eq!(
        again["peak_reserved_bytes"],
        jittered["peak_reserved_bytes"]
    );
    assert_eq!(again["device_calls"], jittered["device_calls"]);
    let other = bundled_hbm_row(&["--jitter-sizes", "8"]);
    assert_ne!(live(&other), live(&jittered));
}

/// The simulated driver behaves like a real one unless a what-if is asked
/// for: it maps whole handles only, so policy hbm creates handles of at most
/// 16 granules (its heap stays under 64 GiB, where that is the most), and
/// calls cost what they cost on an H100. `--part-handle-maps` lets hbm map
/// parts of larger handles (fewer creates); `--zero-latency` makes driver
/// time 0 and changes no decision. The table says which driver it ran on.
#[test]
fn the_simulated_driver_is_the_real_one_unless_a_what_if_is_asked() {
    let real = bundled_hbm_row(&[]);
    let parts = bundled_hbm_row(&["--part-handle-maps"]);
    let free = bundled_hbm_row(&["--zero-latency"]);
    assert!(parts["trace"]
        .as_str()
        .unwrap()
        .ends_with("~part-handle-maps"));
    assert!(real["out_of_memory"].is_null(), "{real}");
    let creates = |r: &serde_json::Value| r["device_calls"]["physical_create"].as_u64().unwrap();
    assert!(creates(&real) > creates(&parts), "{real} {parts}");
    // Every create is at most 16 granules: the peak held is at most that much.
    let peak = real["peak_reserved_bytes"].as_u64().unwrap();
    assert!(creates(&real) * (32 << 20) >= peak);
    assert!(real["simulated_driver_seconds"].as_f64().unwrap() > 0.0);
    assert_eq!(free["simulated_driver_seconds"].as_f64().unwrap(), 0.0);
    assert_eq!(free["device_calls"], real["device_calls"]);
    assert_eq!(free["peak_reserved_bytes"], real["peak_reserved_bytes"]);
    // The table says which driver it simulated (in a legend wrapped to the
    // width, so compared word by word).
    let table = |extra: &[&str]| {
        let mut args = vec!["compare", "--run", "policy:hbm", "--no-min-capacity"];
        args.extend_from_slice(extra);
        let stdout = String::from_utf8(hbmalloc(&args).stdout).unwrap();
        stdout.split_whitespace().collect::<Vec<_>>().join(" ")
    };
    assert!(table(&[]).contains("maps whole physical handles only"));
    assert!(table(&["--part-handle-maps"]).contains("also maps part of a physical handle"));
    assert!(table(&["--zero-latency"]).contains("every call free"));
}

/// X (2 MiB), then Y (4 MiB), X freed, then Z (4 MiB): Y and Z are the peak
/// (8 MiB). Laid out knowing Z is coming, Y and Z lie side by side and X
/// above Y, so the plan maps 8 MiB at most.
const HOLE_THE_FUTURE_FILLS: &[u8] = b"Thread,Time,Action,Pointer,Size,Stream\n\
1,0.1,allocate,0x1000,2097152,0x0\n\
1,0.2,allocate,0x2000,4194304,0x0\n\
1,0.3,free,0x1000,2097152,0x0\n\
1,0.4,allocate,0x3000,4194304,0x0\n";

#[test]
fn compare_shows_what_an_offline_plan_of_the_trace_holds() {
    let trace = temp_file(HOLE_THE_FUTURE_FILLS);
    let path = trace.path().to_str().unwrap();
    let args = [
        "compare",
        path,
        "--planned",
        "--run",
        "policy:hbm",
        "--no-min-capacity",
        "--wide",
    ];
    let stdout = succeed(&args);
    assert!(stdout.contains("planned (offline)"), "{stdout}");
    let row = stdout
        .lines()
        .skip_while(|l| !l.starts_with("---"))
        .nth(1)
        .unwrap();
    let planned: Vec<&str> = row.split('|').nth(1).unwrap().split_whitespace().collect();
    assert_eq!(planned, ["8M", "0K", "1.000"], "{stdout}");

    let stdout = succeed(&[&args[..], &["--json"]].concat());
    let plan: serde_json::Value = stdout
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|v| v.get("planned").is_some())
        .unwrap_or_else(|| panic!("no plan in {stdout}"));
    let mib = |key: &str| plan["planned"][key].as_u64().unwrap() >> 20;
    assert_eq!(mib("arena_bytes"), 8, "{stdout}");
    assert_eq!(mib("peak_mapped_bytes"), 8, "{stdout}");
    assert_eq!(mib("peak_live_rounded_bytes"), 8, "{stdout}");
    assert_eq!(plan["planned"]["blocks"], 3, "{stdout}");
    // Four ops repeat nothing: no step to plan.
    assert!(plan["planned_last_step"].is_null(), "{stdout}");
    assert_eq!(plan["device"], 0, "{stdout}");
}

/// [`hbmalloc`] with `COLUMNS` set, as a shell that exports it would.
fn succeed_in_columns(columns: usize, args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_hbmalloc"))
        .args(args)
        .env("COLUMNS", columns.to_string())
        .output()
        .expect("run hbmalloc");
    stdout_of_success(out)
}

/// `compare`'s table fits 100 columns when no width is known, and the
/// width `COLUMNS` gives where it is narrower; `--wide` keeps the
/// configurations side by side. The bundled profiler trace's CPU memory is
/// called that, not device -1.
#[test]
fn compare_fits_the_width_it_is_given() {
    let args = [
        "compare",
        "--no-min-capacity",
        "--run",
        "policy:pytorch",
        "--run",
        "policy:pytorch,expandable_segments:True,max_split_size_mb:128,garbage_collection_threshold:0.6",
        "--run",
        "policy:hbm",
    ];
    for columns in [100, 80, 60] {
        let stdout = succeed_in_columns(columns, &args);
        for line in stdout.lines() {
            assert!(
                line.chars().count() <= columns,
                "{} columns > {columns}: {line}\n{stdout}",
                line.chars().count()
            );
        }
        assert!(stdout.contains("CPU memory"), "{stdout}");
        assert!(!stdout.contains(" -1 "), "{stdout}");
    }
    // Narrower than the rows' figures: the trace's line still keeps to the
    // narrowest label and 20 columns, its name cut short.
    let narrow = succeed_in_columns(20, &["compare", "--no-min-capacity", "--run", "policy:hbm"]);
    let name = narrow.lines().find(|l| l.contains("CPU memory")).unwrap();
    assert_eq!(name.chars().count(), 32, "{narrow}");
    let wide = succeed_in_columns(100, &[&args[..], &["--wide"]].concat());
    let row = wide.lines().find(|l| l.contains("gpt2_train")).unwrap();
    assert!(row.chars().count() > 100, "{wide}");
    assert!(row.contains(" cpu "), "{wide}");
}

/// The text names `drift_within_reach` only where drift is out of reach.
#[test]
fn a_replay_says_drift_is_out_of_reach_only_where_it_is() {
    let trace = temp_file(PEAK_IN_THE_MIDDLE);
    let path = trace.path().to_str().unwrap();
    let json = succeed(&["replay", path, "--json"]);
    let row: serde_json::Value = serde_json::from_str(json.trim()).unwrap();
    let within = row["drift_within_reach"].as_bool().unwrap();
    let text = succeed(&["replay", path]);
    assert_eq!(
        text.contains("drift_within_reach         no"),
        !within,
        "{text}"
    );
}

/// A replay that runs out of memory says at which op of how many, and shows
/// no efficiency or waste: the whole trace's peak live memory over the
/// reserved memory of the part that ran is no figure of the allocator.
#[test]
fn an_out_of_memory_replay_says_where_it_stopped_and_no_efficiency() {
    let trace = temp_file(PEAK_IN_THE_MIDDLE);
    let path = trace.path().to_str().unwrap();
    let stdout = succeed(&["replay", path, "--capacity", "80MiB"]);
    assert!(
        stdout.contains("stopped                    out of memory at op 1 of 5"),
        "{stdout}"
    );
    assert!(
        stdout.contains("efficiency                 none: the trace did not run to its end"),
        "{stdout}"
    );

    let stdout = succeed(&["replay", path, "--capacity", "80MiB", "--json"]);
    let row: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert!(row["efficiency"].is_null(), "{row}");
    assert!(row["waste_bytes"].is_null(), "{row}");
    assert_eq!(row["out_of_memory_at_op"], 1, "{row}");
    assert_eq!(row["trace_ops"], 5, "{row}");

    // Twice, for a total row; then in the wide layout.
    let compare = |extra: &[&str]| {
        let args = [
            "compare",
            path,
            "--capacity",
            "80MiB",
            "--run",
            "policy:hbm",
        ];
        succeed(&[&args[..], &["--no-min-capacity"], extra].concat())
    };
    let stdout = compare(&[path]);
    let row = stdout.lines().find(|l| l.starts_with("  hbm")).unwrap();
    assert!(row.contains("out of memory at op 1 of 5"), "{stdout}");
    let total = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with("  hbm"))
        .unwrap();
    assert!(
        total.contains("(2 OOM)") && !total.contains("0K"),
        "{stdout}"
    );
    let wide = compare(&["--wide"]);
    let row = wide
        .lines()
        .skip_while(|l| !l.starts_with("---"))
        .nth(1)
        .unwrap();
    let cells: Vec<&str> = row.split('|').nth(1).unwrap().split_whitespace().collect();
    assert_eq!(cells[1..4], ["-", "-", "OOM"], "{wide}");
}

/// `fidelity` needs a snapshot: a trace that records requests only (an RMM
/// log here, a profiler trace alike) is refused, not reported as diverging.
#[test]
fn fidelity_refuses_a_trace_that_is_not_a_snapshot() {
    let trace = temp_file(PEAK_IN_THE_MIDDLE);
    let out = hbmalloc(&["fidelity", trace.path().to_str().unwrap()]);
    assert_clear_error(&out, "not a PyTorch memory snapshot");
    assert!(
        out.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// A snapshot whose decisions policy `pytorch` reproduces passes with a
/// summary line; one it does not (here, a snapshot of policy `hbm`, which
/// maps where PyTorch allocates segments) fails, after the same summary.
#[test]
fn fidelity_sums_up_and_fails_when_a_snapshot_diverges() {
    let trace = temp_file(PEAK_IN_THE_MIDDLE);
    let dir = tempfile::tempdir().unwrap();
    let snapshot = |policy: &str| {
        let path = dir.path().join(format!("{policy}.pickle"));
        let path = path.to_str().unwrap().to_string();
        succeed(&[
            "replay",
            trace.path().to_str().unwrap(),
            "--policy",
            policy,
            "--snapshot-at-peak",
            &path,
        ]);
        path
    };
    let (pytorch, hbm) = (snapshot("pytorch"), snapshot("hbm"));

    let stdout = succeed(&["fidelity", &pytorch]);
    assert!(stdout.contains("— EXACT"), "{stdout}");
    assert!(
        stdout.ends_with(
            "fidelity: 1 device(s) of 1 snapshot(s): 1 exact, 0 diverge, 0 with no segment events\n"
        ),
        "{stdout}"
    );

    let out = hbmalloc(&["fidelity", &pytorch, &hbm]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("diverges at event 0"), "{stdout}");
    assert!(stdout.contains("1 exact, 1 diverge"), "{stdout}");
    assert_clear_error(&out, "diverges from the recorded allocator on 1 device(s)");

    let out = hbmalloc(&["fidelity", &hbm, "--json"]);
    assert!(!out.status.success());
    let row: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&out.stdout).trim()).unwrap();
    assert_eq!(row["verdict"], "diverges", "{row}");
}

/// The simulator is the GPU: `compare` on a run recorded on an H200
/// (`traces/gpt2_h200_native_200steps.pickle.gz`) gives, for PyTorch's
/// allocator with and without expandable segments, the peak reserved memory
/// that the same program measured under each on that GPU (the `.gpu.json`
/// beside it), and as many `cudaMalloc`s as native PyTorch made.
#[test]
fn compare_reproduces_what_the_gpu_measured() {
    let traces = concat!(env!("CARGO_MANIFEST_DIR"), "/../../traces/");
    let trace = format!("{traces}gpt2_h200_native_200steps.pickle.gz");
    let measured: serde_json::Value = serde_json::from_slice(
        &std::fs::read(format!("{traces}gpt2_h200_native_200steps.gpu.json")).unwrap(),
    )
    .unwrap();
    let stdout = succeed(&["compare", &trace, "--no-min-capacity", "--json"]);
    let rows: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for name in ["native", "expandable_segments"] {
        let gpu = &measured["runs"][name];
        let row = rows
            .iter()
            .find(|r| r["settings"] == gpu["settings"])
            .unwrap_or_else(|| panic!("no row for {}: {stdout}", gpu["settings"]));
        assert_eq!(
            row["peak_reserved_bytes"], gpu["peak_reserved_bytes"],
            "{name}"
        );
        if name == "native" {
            assert_eq!(
                row["device_calls"]["segment_alloc"],
                gpu["num_device_alloc"]
            );
        }
    }
}

/// `hbm`'s row of `compare --json` on the H200 run (shipped in `traces/`)
/// with `what_if` options, its efficiency at half and at the end, and what
/// `compare` said on stderr.
fn hbm_on_the_h200_run(what_if: &[&str]) -> (serde_json::Value, f64, f64, String) {
    let trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../traces/gpt2_h200_native_200steps.pickle.gz"
    );
    let mut args = vec!["compare", trace, "--no-min-capacity", "--json"];
    args.extend(["--run", "policy:hbm"]);
    args.extend(what_if);
    let out = hbmalloc(&args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let row: serde_json::Value = serde_json::from_str(stdout_of_success(out).trim()).unwrap();
    let at_half = row["efficiency_at_half"].as_f64().unwrap();
    let whole = row["efficiency"].as_f64().unwrap();
    (row, at_half, whole, stderr)
}

/// The H200 run's snapshot marks its steps (the optimizer's, from its
/// annotations), so a longer run can be drawn from them: `hbm` holds its
/// efficiency over 300 drawn steps, where it drifted on the GPU before the
/// rewrite for the real driver.
#[test]
fn a_gpu_snapshot_draws_a_longer_run_from_its_optimizer_steps() {
    let (row, at_half, whole, stderr) = hbm_on_the_h200_run(&["--draw-steps", "300"]);
    assert!(
        stderr.contains("300 steps drawn from 198 of its 200 recorded steps"),
        "{stderr}"
    );
    assert_eq!(row["steps"], 301, "the prefix's step, then the drawn ones");
    assert!(whole >= 0.98 && at_half - whole <= 0.005, "{row}");
}

/// On the H200 run `hbm` ends within about its allowance over live memory
/// (`max_waste_percent`, 1% of peak demand), as it was at half the run: at a
/// new live peak, idle handles that blocks cut into alias groups are mapped
/// whole before memory past the allowance is made (without that, 0.986,
/// down from 0.989 at half).
#[test]
fn hbm_ends_the_gpu_run_within_its_allowance() {
    let (row, at_half, whole, _) = hbm_on_the_h200_run(&[]);
    assert!(whole >= 0.99 && at_half - whole <= 0.001, "{row}");
}

/// A torch.profiler trace's host memory is `device cpu` in every message,
/// as the tables name it, never the index it is filed under.
#[test]
fn host_memory_is_device_cpu_in_every_message() {
    let bundled = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../traces/gpt2_train.json.gz"
    );
    let summary = succeed(&["summary", bundled]);
    assert!(
        summary.starts_with("gpt2_train.json.gz device cpu:\n"),
        "{summary}"
    );
    let out = hbmalloc(&["compare", "--repeat-step", "1", "--no-min-capacity"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("gpt2_train.json.gz (bundled) device cpu: the step of"),
        "{stderr}"
    );
    let out = hbmalloc(&["compare", "--draw-steps", "5"]);
    assert_clear_error(
        &out,
        "gpt2_train.json.gz (bundled) device cpu: --draw-steps",
    );
    for output in [
        summary.as_str(),
        &stderr,
        &String::from_utf8_lossy(&out.stderr),
    ] {
        assert!(!output.contains("device -1"), "{output}");
    }
}

/// `--draw-steps` draws at least one step, and a trace without step marks
/// is told both kinds of mark it could have.
#[test]
fn drawing_no_steps_is_refused() {
    let llama = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../traces/llama_varlen_300.json.gz"
    );
    let out = hbmalloc(&["compare", llama, "--draw-steps", "0", "--no-min-capacity"]);
    assert_clear_error(&out, "--draw-steps");
    let out = hbmalloc(&["compare", "--draw-steps", "5", "--no-min-capacity"]);
    assert_clear_error(&out, "a memory snapshot's optimizer steps");
}

//! `torch.cuda.memory_summary()`: the human-readable table of the allocator statistics.
//!
//! This reproduces `memory_summary` in `torch/cuda/memory.py` byte for byte: the same
//! 75-column rules, row order, sub-rows and number formatting. It reads the statistics
//! through [`DeviceStats::to_pytorch_map`], the same flat keys the Python code looks up, so
//! a key PyTorch renames would have to be renamed in one place only.

use std::collections::BTreeMap;

use crate::stats::DeviceStats;

/// Width of the table, in characters between the outer `|` borders.
const TABLE_WIDTH: usize = 75;

/// Unit suffixes of `_format_size`, each padded to three characters as PyTorch pads them.
const SIZE_PREFIXES: [&str; 6] = ["B  ", "KiB", "MiB", "GiB", "TiB", "PiB"];

/// Unit suffixes of `_format_count`.
const COUNT_PREFIXES: [&str; 3] = [" ", "K", "M"];

/// PyTorch's `_format_size(sz, pref_sz)`: `sz` in the largest binary unit that keeps
/// `pref_sz` (the row's aggregate value) at or above 768 of it, as a 6-wide integer.
///
/// `sz` is floor-divided (Python `//`) while `pref_sz` is divided exactly (Python `/`), so
/// the unit is chosen from the reference value and the digits are truncated, never rounded:
/// 1,048,575 B is "1023 KiB", and 786,432 B is "768 KiB" while 786,431 B stays in bytes.
pub fn format_size(size: i64, preferred_size: i64) -> String {
    format_scaled(
        size,
        preferred_size,
        &SIZE_PREFIXES,
        1024,
        768.0 * 1024.0,
        6,
    )
}

/// PyTorch's `_format_count(cnt, pref_cnt)`: like [`format_size`] with decimal units
/// (thresholds at 750,000), a 7-wide integer and a trailing space.
pub fn format_count(count: i64, preferred_count: i64) -> String {
    format!(
        "{} ",
        format_scaled(
            count,
            preferred_count,
            &COUNT_PREFIXES,
            1000,
            750.0 * 1000.0,
            7
        )
    )
}

/// The loop shared by `_format_size` and `_format_count`.
fn format_scaled(
    value: i64,
    preferred: i64,
    prefixes: &[&str],
    step: i64,
    threshold: f64,
    width: usize,
) -> String {
    let mut value = value;
    // Python keeps the reference as an int first and a float after the first `/`; converting
    // to f64 up front compares the same way (the conversion is monotonic and the threshold is
    // exact) and each later division by a power of two or by 1000 matches Python's true
    // division of the float.
    let mut preferred = preferred as f64;
    let mut prefix = prefixes[0];
    for &next_prefix in &prefixes[1..] {
        if preferred < threshold {
            break;
        }
        prefix = next_prefix;
        // Python's `//` floors; for a positive divisor that is Euclidean division.
        value = value.div_euclid(step);
        preferred /= step as f64;
    }
    format!("{value:>width$} {prefix}")
}

/// How a metric's cells are formatted.
#[derive(Copy, Clone)]
enum Formatter {
    Size,
    Count,
}

impl Formatter {
    fn format(self, value: i64, preferred: i64) -> String {
        match self {
            Formatter::Size => format_size(value, preferred),
            Formatter::Count => format_count(value, preferred),
        }
    }
}

/// The per-pool metrics in the order `memory_summary` prints them: (key, row title, format).
const POOLED_METRICS: [(&str, &str, Formatter); 9] = [
    ("allocated_bytes", "Allocated memory", Formatter::Size),
    ("active_bytes", "Active memory", Formatter::Size),
    ("requested_bytes", "Requested memory", Formatter::Size),
    ("reserved_bytes", "GPU reserved memory", Formatter::Size),
    (
        "inactive_split_bytes",
        "Non-releasable memory",
        Formatter::Size,
    ),
    ("allocation", "Allocations", Formatter::Count),
    ("active", "Active allocs", Formatter::Count),
    ("segment", "GPU reserved segments", Formatter::Count),
    ("inactive_split", "Non-releasable allocs", Formatter::Count),
];

/// The metrics without pools, printed after the pooled ones.
const OVERSIZE_METRICS: [(&str, &str); 2] = [
    ("oversize_allocations", "Oversize allocations"),
    ("oversize_segments", "Oversize GPU segments"),
];

/// One table row: a left-aligned title and four formatted cells.
fn table_row(title: &str, cells: [String; 4]) -> String {
    let [current, peak, allocated, freed] = cells;
    format!(" {title:<21} | {current} | {peak} | {allocated} | {freed} ")
}

/// The four fields of the statistic `prefix` (`"<metric>.<pool>."` or `"<metric>."`).
fn stat_fields(stats: &BTreeMap<String, i64>, prefix: &str) -> [i64; 4] {
    ["current", "peak", "allocated", "freed"].map(|field| {
        stats
            .get(&format!("{prefix}{field}"))
            .copied()
            .unwrap_or_default()
    })
}

/// `torch.cuda.memory_summary(device, abbreviated)` for `stats`, byte-identical to PyTorch's
/// output: each line framed by `|`, lines joined by newlines, and a final newline.
///
/// With `abbreviated` the "from large pool"/"from small pool" sub-rows are left out. In the
/// sub-rows each cell picks its unit from the aggregate ("all") row's value in the same
/// column, as PyTorch does, so a pool's numbers line up with the total above them.
pub fn memory_summary(stats: &DeviceStats, device: i64, abbreviated: bool) -> String {
    let stats = stats.to_pytorch_map();
    let rule_double = "=".repeat(TABLE_WIDTH);
    let rule_single = "-".repeat(TABLE_WIDTH);
    let num_ooms = stats["num_ooms"];
    let num_alloc_retries = stats["num_alloc_retries"];

    let mut lines = vec![
        rule_double.clone(),
        format!(
            " {:16} PyTorch CUDA memory summary, device ID {device:<17} ",
            ""
        ),
        rule_single.clone(),
        format!(
            "  {:9} CUDA OOMs: {num_ooms:<12} | {:6} cudaMalloc retries: {num_alloc_retries:<8}  ",
            "", ""
        ),
        rule_double.clone(),
        "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ".to_owned(),
    ];

    for (metric, title, formatter) in POOLED_METRICS {
        lines.push(rule_single.clone());
        let mut pools = vec![("all", title)];
        if !abbreviated {
            pools.push(("large_pool", "      from large pool"));
            pools.push(("small_pool", "      from small pool"));
        }
        let aggregate = stat_fields(&stats, &format!("{metric}.all."));
        for (pool, row_title) in pools {
            let values = stat_fields(&stats, &format!("{metric}.{pool}."));
            let cells = [0, 1, 2, 3].map(|i| formatter.format(values[i], aggregate[i]));
            lines.push(table_row(row_title, cells));
        }
    }

    for (metric, title) in OVERSIZE_METRICS {
        lines.push(rule_single.clone());
        let values = stat_fields(&stats, &format!("{metric}."));
        let cells = values.map(|value| format_count(value, value));
        lines.push(table_row(title, cells));
    }

    lines.push(rule_double);
    format!("|{}|\n", lines.join("|\n|"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::Stat;

    #[test]
    fn format_size_edges() {
        assert_eq!(format_size(0, 0), "     0 B  ");
        assert_eq!(format_size(1023, 1023), "  1023 B  ");
        assert_eq!(format_size(1024, 1024), "  1024 B  ");
        // The unit changes at 768 KiB of the reference value, not at 1024.
        assert_eq!(format_size(786_431, 786_431), "786431 B  ");
        assert_eq!(format_size(786_432, 786_432), "   768 KiB");
        assert_eq!(format_size(1_048_575, 1_048_575), "  1023 KiB");
        assert_eq!(format_size(1 << 20, 1 << 20), "  1024 KiB");
        assert_eq!(format_size(805_306_368, 805_306_368), "   768 MiB");
        // Truncation, not rounding: 1.99 GiB shows as 2047 MiB.
        assert_eq!(format_size((2 << 30) - 1, (2 << 30) - 1), "  2047 MiB");
        // One PiB and beyond: PiB is the last unit, so the digits keep growing.
        assert_eq!(format_size(1 << 50, 1 << 50), "  1024 TiB");
        assert_eq!(format_size(1 << 60, 1 << 60), "  1024 PiB");
        assert_eq!(format_size(i64::MAX, i64::MAX), "  8191 PiB");
        // The unit follows the reference value, not the value itself.
        assert_eq!(format_size(5, 1 << 30), "     0 MiB");
        assert_eq!(format_size(3 << 30, 1000), "3221225472 B  ");
        // Negative values are not expected; if one appears, Python's floor division applies.
        assert_eq!(format_size(-1, 1 << 20), "    -1 KiB");
    }

    #[test]
    fn format_count_edges() {
        assert_eq!(format_count(0, 0), "      0   ");
        assert_eq!(format_count(749_999, 749_999), " 749999   ");
        assert_eq!(format_count(750_000, 750_000), "    750 K ");
        assert_eq!(format_count(999_999, 999_999), "    999 K ");
        assert_eq!(format_count(750_000_000, 750_000_000), "    750 M ");
        // M is the last unit.
        assert_eq!(
            format_count(1_000_000_000_000, 1_000_000_000_000),
            "1000000 M "
        );
        assert_eq!(format_count(12, 900_000), "      0 K ");
    }

    /// Stats with values that exercise every unit change, built by hand.
    fn handcrafted_stats() -> DeviceStats {
        let stat = |current, peak, allocated, freed| Stat {
            current,
            peak,
            allocated,
            freed,
        };
        let mut stats = DeviceStats::default();
        // [all, small, large]
        stats.allocated_bytes = [
            stat(1_572_864_000, 2_147_483_648, 53_687_091_200, 52_114_227_200),
            stat(524_288, 1_048_576, 10_485_760, 9_961_472),
            stat(1_572_339_712, 2_146_435_072, 53_676_605_440, 52_104_265_728),
        ];
        stats.active_bytes = stats.allocated_bytes;
        stats.requested_bytes = [
            stat(1_572_000_000, 2_147_000_000, 53_680_000_000, 52_108_000_000),
            stat(500_000, 1_000_000, 10_000_000, 9_500_000),
            stat(1_571_500_000, 2_146_000_000, 53_670_000_000, 52_098_500_000),
        ];
        stats.reserved_bytes = [
            stat(2_151_677_952, 2_151_677_952, 2_151_677_952, 0),
            stat(2_097_152, 2_097_152, 2_097_152, 0),
            stat(2_149_580_800, 2_149_580_800, 2_149_580_800, 0),
        ];
        stats.inactive_split_bytes = [
            stat(787_456, 20_971_520, 1_234_567_890, 1_233_780_434),
            stat(512, 1023, 700_000, 699_488),
            stat(786_944, 20_970_497, 1_233_867_890, 1_233_080_946),
        ];
        stats.allocation = [
            stat(1_000, 2_000, 1_500_000, 1_499_000),
            stat(400, 800, 749_999, 749_599),
            stat(600, 1_200, 750_001, 749_401),
        ];
        stats.active = stats.allocation;
        stats.segment = [stat(3, 3, 3, 0), stat(1, 1, 1, 0), stat(2, 2, 2, 0)];
        stats.inactive_split = [
            stat(2, 5, 800_000_000, 799_999_998),
            stat(1, 2, 400_000_000, 399_999_999),
            stat(1, 3, 400_000_000, 399_999_999),
        ];
        stats.oversize_allocations = stat(1, 4, 760_000, 759_999);
        stats.oversize_segments = stat(0, 1, 1, 1);
        stats.num_ooms = 2;
        stats.num_alloc_retries = 13;
        stats.max_split_size = 200 << 20;
        stats
    }

    /// Produced by the `memory_summary` of torch/cuda/memory.py run on the same statistics
    /// (its formatting code, fed `handcrafted_stats()` as the `memory_stats()` dictionary).
    const GOLDEN_FULL: &str = "\
|===========================================================================|
|                  PyTorch CUDA memory summary, device ID 3                 |
|---------------------------------------------------------------------------|
|            CUDA OOMs: 2            |        cudaMalloc retries: 13        |
|===========================================================================|
|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |
|---------------------------------------------------------------------------|
| Allocated memory      |   1500 MiB |   2048 MiB |  51200 MiB |  49700 MiB |
|       from large pool |   1499 MiB |   2047 MiB |  51190 MiB |  49690 MiB |
|       from small pool |      0 MiB |      1 MiB |     10 MiB |      9 MiB |
|---------------------------------------------------------------------------|
| Active memory         |   1500 MiB |   2048 MiB |  51200 MiB |  49700 MiB |
|       from large pool |   1499 MiB |   2047 MiB |  51190 MiB |  49690 MiB |
|       from small pool |      0 MiB |      1 MiB |     10 MiB |      9 MiB |
|---------------------------------------------------------------------------|
| Requested memory      |   1499 MiB |   2047 MiB |  51193 MiB |  49694 MiB |
|       from large pool |   1498 MiB |   2046 MiB |  51183 MiB |  49685 MiB |
|       from small pool |      0 MiB |      0 MiB |      9 MiB |      9 MiB |
|---------------------------------------------------------------------------|
| GPU reserved memory   |   2052 MiB |   2052 MiB |   2052 MiB |      0 B   |
|       from large pool |   2050 MiB |   2050 MiB |   2050 MiB |      0 B   |
|       from small pool |      2 MiB |      2 MiB |      2 MiB |      0 B   |
|---------------------------------------------------------------------------|
| Non-releasable memory |    769 KiB |  20480 KiB |   1177 MiB |   1176 MiB |
|       from large pool |    768 KiB |  20479 KiB |   1176 MiB |   1175 MiB |
|       from small pool |      0 KiB |      0 KiB |      0 MiB |      0 MiB |
|---------------------------------------------------------------------------|
| Allocations           |    1000    |    2000    |    1500 K  |    1499 K  |
|       from large pool |     600    |    1200    |     750 K  |     749 K  |
|       from small pool |     400    |     800    |     749 K  |     749 K  |
|---------------------------------------------------------------------------|
| Active allocs         |    1000    |    2000    |    1500 K  |    1499 K  |
|       from large pool |     600    |    1200    |     750 K  |     749 K  |
|       from small pool |     400    |     800    |     749 K  |     749 K  |
|---------------------------------------------------------------------------|
| GPU reserved segments |       3    |       3    |       3    |       0    |
|       from large pool |       2    |       2    |       2    |       0    |
|       from small pool |       1    |       1    |       1    |       0    |
|---------------------------------------------------------------------------|
| Non-releasable allocs |       2    |       5    |     800 M  |     799 M  |
|       from large pool |       1    |       3    |     400 M  |     399 M  |
|       from small pool |       1    |       2    |     400 M  |     399 M  |
|---------------------------------------------------------------------------|
| Oversize allocations  |       1    |       4    |     760 K  |     759 K  |
|---------------------------------------------------------------------------|
| Oversize GPU segments |       0    |       1    |       1    |       1    |
|===========================================================================|
";

    /// As [`GOLDEN_FULL`], with `abbreviated=True`.
    const GOLDEN_ABBREVIATED: &str = "\
|===========================================================================|
|                  PyTorch CUDA memory summary, device ID 3                 |
|---------------------------------------------------------------------------|
|            CUDA OOMs: 2            |        cudaMalloc retries: 13        |
|===========================================================================|
|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |
|---------------------------------------------------------------------------|
| Allocated memory      |   1500 MiB |   2048 MiB |  51200 MiB |  49700 MiB |
|---------------------------------------------------------------------------|
| Active memory         |   1500 MiB |   2048 MiB |  51200 MiB |  49700 MiB |
|---------------------------------------------------------------------------|
| Requested memory      |   1499 MiB |   2047 MiB |  51193 MiB |  49694 MiB |
|---------------------------------------------------------------------------|
| GPU reserved memory   |   2052 MiB |   2052 MiB |   2052 MiB |      0 B   |
|---------------------------------------------------------------------------|
| Non-releasable memory |    769 KiB |  20480 KiB |   1177 MiB |   1176 MiB |
|---------------------------------------------------------------------------|
| Allocations           |    1000    |    2000    |    1500 K  |    1499 K  |
|---------------------------------------------------------------------------|
| Active allocs         |    1000    |    2000    |    1500 K  |    1499 K  |
|---------------------------------------------------------------------------|
| GPU reserved segments |       3    |       3    |       3    |       0    |
|---------------------------------------------------------------------------|
| Non-releasable allocs |       2    |       5    |     800 M  |     799 M  |
|---------------------------------------------------------------------------|
| Oversize allocations  |       1    |       4    |     760 K  |     759 K  |
|---------------------------------------------------------------------------|
| Oversize GPU segments |       0    |       1    |       1    |       1    |
|===========================================================================|
";

    #[test]
    fn full_summary_matches_pytorch() {
        let summary = memory_summary(&handcrafted_stats(), 3, false);
        assert_eq!(summary, GOLDEN_FULL);
    }

    #[test]
    fn abbreviated_summary_matches_pytorch() {
        let summary = memory_summary(&handcrafted_stats(), 3, true);
        assert_eq!(summary, GOLDEN_ABBREVIATED);
    }

    #[test]
    fn every_line_is_77_columns_for_ordinary_values() {
        for abbreviated in [false, true] {
            let summary = memory_summary(&handcrafted_stats(), 3, abbreviated);
            for line in summary.lines() {
                assert_eq!(line.chars().count(), TABLE_WIDTH + 2, "{line:?}");
            }
        }
        let empty = memory_summary(&DeviceStats::default(), 0, false);
        assert_eq!(empty.lines().count(), 47);
        assert!(empty.ends_with("|\n"));
    }
}

//! Policy `hbm`: hbmalloc's own policy. Reserved memory tracks live memory,
//! and a repeating workload makes no driver calls once warm.
//!
//! # Design
//!
//! * **Address space is cheap, physical memory is not.** Each stream gets a
//!   large virtual reservation (a *region*, twice the device's capacity; more
//!   are reserved if one fills up). Inside its regions, a stream's requests are
//!   placed by address-ordered best fit over byte ranges rounded to 512 bytes,
//!   with free ranges coalesced (blocks and free ranges are linked to their
//!   neighbours, as PyTorch's blocks are). Small requests are therefore
//!   packed densely next to large ones: there is no segment rounding and no
//!   small/large pool split to waste memory on.
//! * **Physical memory comes in granules** (`Device::granularity()`, 2 MiB).
//!   A miss creates one `physical_create` handle for each unmapped run under
//!   the block and maps it whole (a *chunk*: create, map, set access). When
//!   the heap grows at the top, the run is extended ahead (at most 1% of
//!   peak demand, within the allowance below) so that small requests do not
//!   map granule by granule; a request that takes demand to a new peak maps
//!   at least 12 MiB ahead (4% of demand while demand is small) even past
//!   the allowance, since a growing heap is where the driver calls are. Free
//!   ranges keep their mappings: that is the cache.
//! * **Stitching by aliasing** (GMLake's idea, kept online). When the memory
//!   held would exceed `max_waste_percent` over the peak demand seen so far,
//!   a run is backed instead by granules lying idle under free ranges
//!   elsewhere, *mapped a second time* at the new address ([`AliasGroup`]).
//!   The old mapping stays. Each group of aliased granules may be in use at
//!   one view at a time: a block is placed only where no group under it is
//!   in use elsewhere (and no group is under it twice), so no two live
//!   blocks ever share memory. A training step that needs memory at one
//!   place early and at another later finds both still mapped the next time
//!   round and makes no driver call, where moving the memory (unmap, map)
//!   paid calls every step. Measured on `gpt2_train` with `hbmalloc compare
//!   --json` (`steady_state_device_calls`, `efficiency`): 115 driver calls in
//!   the second half of the trace and 0.980 with moving (commit 62ca423), 0
//!   and 0.990 with aliasing.
//! * **On a miss** a run gets physical memory from, in order: spare pieces
//!   (held, unmapped; the smallest that covers the run, else the largest,
//!   split as needed); one new handle within the allowance; idle memory,
//!   aliased; wholly free chunks *stolen* (unmapped, highest address first,
//!   their unaliased granules stitched in here); and only then one new
//!   handle beyond the allowance. Granules mapped ahead take spares or a
//!   new handle only, never idle or stolen memory. A stream taking over
//!   memory another stream used last first waits for that stream through an
//!   event. A chunk partly under a live block is never unmapped. (We
//!   measured *unpinning* such chunks — unmap, map the live part back —
//!   under memory pressure: it unmaps live memory for a moment, which on a
//!   real GPU faults any kernel another host thread launches meanwhile, and
//!   a failed re-map loses the tensor. A production allocator must not take
//!   either risk.)
//! * **Streams.** A stream only ever reuses free ranges of its own regions.
//!   Blocks used on other streams (`record_stream`) stay out of the free set
//!   until events recorded on those streams complete, as in PyTorch.
//! * **Out of memory:** synchronize pending events (their blocks become
//!   free), unmap every wholly free chunk (its memory becomes spare unless
//!   it is still mapped at another view), search again with no allowance,
//!   and only then raise
//!   `AllocError::OutOfMemory` with a judged `OomReport`.
//! * **No virtual-memory API** (`granularity() == None`): regions become plain
//!   segments (`segment_alloc`, 2 MiB for requests up to 1 MiB, otherwise the
//!   request rounded up to 2 MiB), always fully backed; best fit and
//!   coalescing still apply inside them, and wholly free segments are freed by
//!   `empty_cache` or an out-of-memory retry.
//!
//! Measured figures: `hbmalloc compare ../shared/traces/pytorch-snapshots/*
//! ../shared/traces/profiler-cpu/* --json` (release build).
//!
//! Hot path (a cache hit): one lookup for best fit in the stream's size
//! index (size bins, each a small ordered map keyed by size, then address;
//! see `hbm/size_index.rs`; the first fit is one descent of one bin's
//! map), a remove and an insert there to split, one hash insert, and a
//! bitmap test that the granules are mapped and one that none is aliased
//! (granules found by shifting: the granularity is a power of two; if some
//! are aliased, one ordered search for the alias groups under the block,
//! and a counter per group). Blocks and free ranges are [`Span`]s linked to
//! their neighbours, so a free finds what to merge with through the links
//! (no search) and makes the size-index updates; a block placed on plain
//! memory skips the alias groups. No device call, `O(log n)`. Measured with
//! `scripts/bench-instructions` (callgrind, replayed operations only): on
//! `gpt2_train` 1,187 instructions per malloc or free against 1,014 for
//! policy `pytorch`, misses included (1,396 with one ordered map of every
//! range, 1,262 with an iterator over the bins for the first fit); most of
//! the rest is the alias checks and misses that stitch memory.
//!
//! Statistics keep PyTorch's meanings where they carry over: `reserved_bytes`
//! is physical memory held (every handle, mapped once or more, or spare; or
//! segments). A snapshot shows each mapped address range as a segment,
//! with each aliased granule only where it is in use (or was last used), so
//! segments add up to the memory mapped, never more than `reserved_bytes`;
//! `segment` counts regions (virtual reservations or fallback segments),
//! `num_device_alloc`/`num_device_free` count creates and maps / releases and
//! unmaps. Everything is reported in the large pool except allocations of at
//! most 1 MiB, which count as small as in PyTorch. `inactive_split*` stays 0:
//! `hbm` has no segments to split.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::config::ConfigError;
use crate::device::{Device, DevicePtr, EventId, PhysicalHandle, StreamId};
use crate::error::{AllocError, OomReport, OomVerdict};
use crate::history::{Action, History};
use crate::snapshot::{BlockSnapshot, BlockState, SegmentSnapshot};
use crate::stats::{decrease_pool, increase_pool, DeviceStats, StatArray};
use crate::{FastMap, SegmentImage};

mod size_index;
use size_index::SizeIndex;

/// Deliberately broken behaviour, for proving that the simulation harness
/// catches it (test builds only).
#[cfg(test)]
pub(crate) mod testing {
    use std::cell::Cell;

    thread_local! {
        /// When set, a block placed on aliased memory that another stream
        /// used last does not wait for that stream.
        pub(crate) static SKIP_ALIAS_WAIT: Cell<bool> = const { Cell::new(false) };
    }
}

const MIB: u64 = 1 << 20;
/// Every request rounds up to a multiple of this (as PyTorch's `kMinBlockSize`).
const MIN_BLOCK_SIZE: u64 = 512;
/// Requests up to this size count as "small pool" in the statistics.
const SMALL_SIZE: u64 = MIB;
/// Without a virtual-memory API, segments are multiples of this.
const SEGMENT_ROUND: u64 = 2 * MIB;
/// Virtual address space reserved per region, as a multiple of device memory:
/// room to place a full device's worth of blocks with fragmentation to spare.
const REGION_CAPACITY_FACTOR: u64 = 2;

const DEFAULT_MAX_WASTE_PERCENT: f64 = 1.0;
/// Mapping ahead is bounded by this share of peak demand whatever the
/// allowance: memory mapped ahead is pinned by the first small block placed
/// in it, so larger chunks trade efficiency for fewer calls.
const MAX_MAP_AHEAD_PERCENT: f64 = 2.0;
/// A request that takes demand to a new peak maps at least this much ahead,
/// even past the allowance. Measured with `hbmalloc compare` over the shared
/// traces (21 rows), against not mapping past the allowance: 15,885 ->
/// 13,728 driver calls, 174 -> 144 ms of simulated driver time, 1.20 -> 1.24
/// GiB of waste. 8 MiB: 14,582 calls; 16 MiB: 1.30 GiB of waste; 20 MiB:
/// vit_train's efficiency under 0.98.
const GROWTH_CHUNK_BYTES: u64 = 12 * MIB;
/// ... but no more than this many times `max_waste_percent` of peak demand,
/// so that a small heap's overshoot stays small (and `max_waste_percent:0`
/// maps nothing ahead).
const GROWTH_CHUNK_WASTE_FACTOR: f64 = 4.0;
/// Most addresses one physical granule is mapped at: each alias costs a map
/// call once and a page-table entry for good, so a granule that has moved
/// this often is moved (unmapped) rather than mapped once more.
const MAX_VIEWS: usize = 4;
/// Free ranges a request looks at, in best-fit order, for one whose aliased
/// granules are not in use elsewhere; if all are blocked, the block slides
/// past the memory in use within them, then tries the stream's largest free
/// range, and only then opens a new region.
const MAX_CANDIDATES: usize = 32;

/// Configuration of policy `hbm`, in the `key:value,key:value` syntax.
///
/// | key | default | meaning |
/// |---|---|---|
/// | `max_waste_percent` | 1 | physical memory held may exceed the peak demand (live plus pending-free bytes) by this percentage before idle memory is stitched (mapped a second time) instead of new memory created; a heap growing to a new peak may map up to 4 times this (at most 12 MiB) ahead. Lower: tighter memory, more map calls when the workload shifts or grows (0: nothing mapped ahead); higher: fewer driver calls. |
/// | `per_process_memory_fraction` | 1 | hard limit on memory held, as a fraction of device memory (as in PyTorch). |
#[derive(Clone, Debug, PartialEq)]
pub struct HbmConfig {
    /// Allowance of held memory over peak demand, in percent, before granules are stolen.
    pub max_waste_percent: f64,
    /// Hard limit on memory held, as a fraction of device memory.
    pub per_process_memory_fraction: f64,
}

impl Default for HbmConfig {
    fn default() -> Self {
        HbmConfig {
            max_waste_percent: DEFAULT_MAX_WASTE_PERCENT,
            per_process_memory_fraction: 1.0,
        }
    }
}

impl HbmConfig {
    /// Every key this policy accepts.
    pub const KEYS: [&'static str; 2] = ["max_waste_percent", "per_process_memory_fraction"];

    /// Parses `key:value,key:value`; an empty string gives the defaults.
    pub fn parse(conf: &str) -> Result<Self, ConfigError> {
        let mut config = HbmConfig::default();
        for entry in conf.split(',') {
            let entry = entry.trim();
            if entry.is_empty() {
                continue;
            }
            let Some((key, value)) = entry.split_once(':') else {
                return Err(ConfigError::new(entry, "", "key:value"));
            };
            let (key, value) = (key.trim(), value.trim());
            let number = |low: f64, high: f64, expected: &str| {
                value
                    .parse::<f64>()
                    .ok()
                    .filter(|v| (low..=high).contains(v))
                    .ok_or_else(|| ConfigError::new(key, value, expected))
            };
            match key {
                "max_waste_percent" => {
                    config.max_waste_percent = number(0.0, 1000.0, "a number between 0 and 1000")?
                }
                "per_process_memory_fraction" => {
                    let fraction = number(0.0, 1.0, "a number above 0 and at most 1")?;
                    if fraction == 0.0 {
                        return Err(ConfigError::new(
                            key,
                            value,
                            "a number above 0 and at most 1",
                        ));
                    }
                    config.per_process_memory_fraction = fraction;
                }
                _ => {
                    return Err(ConfigError::new(
                        key,
                        value,
                        format!("one of the keys {}", Self::KEYS.join(", ")),
                    ))
                }
            }
        }
        Ok(config)
    }

    /// The settings that differ from the defaults, in the syntax [`HbmConfig::parse`] reads.
    pub fn to_conf_string(&self) -> String {
        let defaults = HbmConfig::default();
        let mut parts = Vec::new();
        if self.max_waste_percent != defaults.max_waste_percent {
            parts.push(format!("max_waste_percent:{}", self.max_waste_percent));
        }
        if self.per_process_memory_fraction != defaults.per_process_memory_fraction {
            parts.push(format!(
                "per_process_memory_fraction:{}",
                self.per_process_memory_fraction
            ));
        }
        parts.join(",")
    }
}

/// An allocated block, or one freed by the program whose stream uses are pending.
#[derive(Clone, Debug)]
struct LiveBlock {
    requested: u64,
    stream: StreamId,
    /// False once the program freed it (then it waits for `pending_events`).
    allocated: bool,
    pending_events: u32,
    /// Other streams that use it (`record_stream`), not yet covered by events.
    stream_uses: Vec<StreamId>,
    /// Its span, which says where it lies (address, size, region).
    span: u32,
    /// It was placed on aliased memory. Memory under a live block never
    /// becomes aliased (aliases are made of whole free granules, mapped at
    /// unmapped ones), so a block placed on plain memory frees without
    /// looking at the alias groups.
    on_aliased: bool,
}

/// No span: the end of a region's list.
const NO_SPAN: u32 = u32::MAX;

/// A stretch of a region, a live block or a free range, linked to its
/// neighbours in address order (PyTorch's `Block` links, for the same
/// reason): freeing finds the ranges to merge with in O(1), with no search.
/// Free ranges are maximal: a free span's neighbours are live.
#[derive(Copy, Clone, Debug)]
struct Span {
    start: DevicePtr,
    size: u64,
    region: u32,
    prev: u32,
    next: u32,
    free: bool,
}

impl Span {
    fn end(&self) -> DevicePtr {
        self.start + self.size
    }
}

/// The views in `views` (a region's view index) overlapping granules
/// `[first, end)`, as (first granule, group). Borrows only the index, so the
/// caller may change `groups` while it walks.
fn views_overlapping<'a>(
    views: &'a BTreeMap<u64, u32>,
    groups: &[Option<AliasGroup>],
    first: u64,
    end: u64,
) -> impl Iterator<Item = (u64, u32)> + 'a {
    let straddling = views
        .range(..first)
        .next_back()
        .filter(|&(&start, &id)| {
            groups[id as usize]
                .as_ref()
                .is_some_and(|group| start + group.count > first)
        })
        .map(|(&start, &id)| (start, id));
    straddling
        .into_iter()
        .chain(views.range(first..end).map(|(&start, &id)| (start, id)))
}

/// A virtual reservation owned by one stream, or (without a virtual-memory
/// API) a plain segment.
#[derive(Debug)]
struct Region {
    base: DevicePtr,
    size: u64,
    stream: StreamId,
    /// The stream's entry in `HbmPolicy::free_by_size`.
    size_index: usize,
    /// A plain segment: always fully backed, no granules.
    segment: bool,
    /// Granules in the region.
    granules: u64,
    /// Mapped chunks by first granule. Each chunk is one mapping (one
    /// `map` call) of a sub-range of one physical handle; a run of granules
    /// may be stitched together from several chunks.
    chunks: BTreeMap<u64, Chunk>,
    /// Mapped granules. Lets the hot path test a whole block's granules 64
    /// at a time.
    mapped: Bitmap,
    /// Granules whose physical memory is mapped at another address too (a
    /// stitched alias, see [`AliasGroup`]): a block placed over them must
    /// first check that no live block uses that memory elsewhere.
    aliased: Bitmap,
    /// The alias-group views in this region, by first granule.
    group_views: BTreeMap<u64, u32>,
    /// Aliased granules whose group is in use at another view: no block may
    /// be placed on them (one bitmap test instead of a walk of the groups).
    lent: Bitmap,
}

/// A request's size as blocks hold it: a multiple of `MIN_BLOCK_SIZE`.
#[inline]
fn rounded(requested: u64) -> u64 {
    requested.div_ceil(MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE
}

/// The granules `[first, end)` of a region at `base` that the bytes
/// `[ptr, ptr + size)` lie on. `granule` is a power of two: two shifts, where
/// two divisions cost tens of cycles each on the hot path.
#[inline]
fn granules_under(granule: u64, base: DevicePtr, ptr: DevicePtr, size: u64) -> (u64, u64) {
    let shift = granule.trailing_zeros();
    let offset = ptr - base;
    (offset >> shift, (offset + size + granule - 1) >> shift)
}

/// Bits `lo..hi` of a word (`lo < hi <= 64`).
#[inline]
fn bit_mask(lo: u64, hi: u64) -> u64 {
    if hi - lo == 64 {
        u64::MAX
    } else {
        ((1u64 << (hi - lo)) - 1) << lo
    }
}

/// One bit per granule. It grows with the highest bit ever set (words past
/// its end read as zero): a region spans twice the device, and zeroing a
/// bitmap for all of it on every new region cost more than the rest of the
/// replay on traces with many streams.
#[derive(Debug, Default)]
struct Bitmap(Vec<u64>);

impl Bitmap {
    #[inline]
    fn word(&self, word: u64) -> u64 {
        self.0.get(word as usize).copied().unwrap_or(0)
    }

    #[inline]
    fn get(&self, index: u64) -> bool {
        self.word(index / 64) & (1 << (index % 64)) != 0
    }

    /// Sets or clears bits `[first, first + count)`, a word at a time.
    fn set(&mut self, first: u64, count: u64, value: bool) {
        let end = first + count;
        if value && self.0.len() < end.div_ceil(64) as usize {
            self.0.resize(end.div_ceil(64) as usize, 0);
        }
        let mut i = first;
        while i < end {
            let lo = i % 64;
            let hi = (end - (i - lo)).min(64);
            let mask = bit_mask(lo, hi);
            let Some(word) = self.0.get_mut((i / 64) as usize) else {
                break; // clearing past the end: already zero
            };
            if value {
                *word |= mask;
            } else {
                *word &= !mask;
            }
            i = i - lo + 64;
        }
    }

    /// The first index in `[from, limit)` whose bit is `value`, or `limit`
    /// (`from` when `from >= limit`).
    fn next_with(&self, from: u64, limit: u64, value: bool) -> u64 {
        if from >= limit {
            return from;
        }
        // Past the last word every bit is clear: no set bit to find there.
        let limit_set = if value {
            limit.min(self.0.len() as u64 * 64)
        } else {
            limit
        };
        let mut i = from;
        while i < limit_set {
            let lo = i % 64;
            let mut word = self.word(i / 64);
            if !value {
                word = !word;
            }
            word &= u64::MAX << lo;
            if word != 0 {
                return (i - lo + u64::from(word.trailing_zeros())).min(limit);
            }
            i = i - lo + 64;
        }
        limit
    }

    /// True when every bit in `[first, end)` is set.
    fn all(&self, first: u64, end: u64) -> bool {
        let mut i = first;
        while i < end {
            let word = self.word(i / 64);
            let lo = i % 64;
            let hi = (end - (i - lo)).min(64);
            let mask = bit_mask(lo, hi);
            if word & mask != mask {
                return false;
            }
            i = i - lo + 64;
        }
        true
    }

    /// The last set bit in `[first, end)`, if any.
    fn last_set(&self, first: u64, end: u64) -> Option<u64> {
        let end = end.min(self.0.len() as u64 * 64);
        let mut i = end;
        while i > first {
            let word_start = (i - 1) / 64 * 64;
            let lo = first.max(word_start) - word_start;
            let word = self.word(word_start / 64) & bit_mask(lo, i - word_start);
            if word != 0 {
                return Some(word_start + 63 - u64::from(word.leading_zeros()));
            }
            i = word_start;
        }
        None
    }

    /// True when some bit in `[first, end)` is set.
    #[inline]
    fn any(&self, first: u64, end: u64) -> bool {
        self.next_with(first, end, true) < end
    }

    fn count_ones(&self) -> u64 {
        self.0.iter().map(|w| u64::from(w.count_ones())).sum()
    }
}

impl Region {
    /// A region of `granules` granules, nothing mapped; `granules == 0`
    /// makes it a plain segment.
    fn new(base: DevicePtr, size: u64, stream: StreamId, size_index: usize, granules: u64) -> Self {
        Region {
            base,
            size,
            stream,
            size_index,
            segment: granules == 0,
            granules,
            chunks: BTreeMap::new(),
            mapped: Bitmap::default(),
            aliased: Bitmap::default(),
            group_views: BTreeMap::new(),
            lent: Bitmap::default(),
        }
    }

    #[inline]
    fn is_mapped(&self, index: u64) -> bool {
        self.segment || self.mapped.get(index)
    }

    /// The first granule in `[from, limit)` whose mapped bit is `mapped`, or
    /// `limit` (`from` when `from >= limit`). A segment is all mapped.
    fn next_with(&self, from: u64, limit: u64, mapped: bool) -> u64 {
        if self.segment && from < limit {
            return if mapped { from } else { limit };
        }
        self.mapped.next_with(from, limit, mapped)
    }

    /// The first granule in `[from, limit)` that is mapped here and not in
    /// use at another view (not lent), or `limit`: where idle memory may lie.
    fn next_unlent(&self, from: u64, limit: u64) -> u64 {
        let mut i = self.next_with(from, limit, true);
        while i < limit && self.lent.get(i) {
            i = self.lent.next_with(i, limit, false);
            i = self.next_with(i, limit, true);
        }
        i
    }

    /// True when every granule in `[first, end)` is mapped.
    fn all_mapped(&self, first: u64, end: u64) -> bool {
        self.segment || self.mapped.all(first, end)
    }
}

/// One mapping: `count` granules of `handle`, from byte `offset` of it.
#[derive(Copy, Clone, Debug)]
struct Chunk {
    count: u64,
    handle: PhysicalHandle,
    offset: u64,
}

/// A granule of physical memory: its handle and byte offset in it.
type PhysicalGranule = (PhysicalHandle, u64);

/// A place a granule is mapped: region index and granule in it.
type View = (u32, u64);

/// Granules `[.1, .2)` of region `.0`.
type GranuleSpan = (u32, u64, u64);

/// Physical memory mapped at several addresses (*stitched*, as in GMLake).
///
/// When a request needs memory and the allowance is spent, granules lying
/// idle under free ranges elsewhere are mapped under it a second time rather
/// than moved: the old mapping stays, so when the program later wants memory
/// at either address again it is still mapped there, and a repeating step
/// makes no driver call. A group is `count` granules of one handle and every
/// place (*view*) they are mapped whole; each view lies inside one chunk.
/// Only one view may be in use at a time, and the group says which. Groups
/// never overlap. An idle group is cut where a block or a donation needs
/// only part of it, and idle neighbours that continue each other at every
/// view are merged back. Bookkeeping is per group, not per granule, so a
/// block costs the same however large it is.
#[derive(Clone, Debug)]
struct AliasGroup {
    handle: PhysicalHandle,
    offset: u64,
    count: u64,
    /// Where it is mapped (region, first granule): two to [`MAX_VIEWS`].
    views: Vec<View>,
    /// The view that uses it now (when `blocks > 0`) or used it last. A
    /// different stream taking it over first waits for this view's stream.
    user: View,
    /// Live or pending-free blocks lying on it through `user`.
    blocks: u32,
}

/// Memory that may be mapped under a range as well (see [`AliasGroup`]).
enum Donor {
    /// Granules mapped only at `view`, idle there: `count` granules of
    /// `handle` from `offset`.
    Granules {
        view: View,
        count: u64,
        handle: PhysicalHandle,
        offset: u64,
    },
    /// A whole alias group, idle at every view.
    Group(u32),
}

/// Physical memory held but not mapped: `bytes` of `handle` from `offset`.
#[derive(Copy, Clone, Debug)]
struct Piece {
    handle: PhysicalHandle,
    offset: u64,
    bytes: u64,
}

/// A physical handle: its size and how much of it is mapped now.
#[derive(Copy, Clone, Debug)]
struct HandleInfo {
    bytes: u64,
    mapped: u64,
}

/// Why a range could not be backed.
enum Backing {
    /// Backed: every granule under it is mapped.
    Done,
    /// The device (or the memory limit) has no memory for it.
    OutOfMemory,
}

/// The `hbm` policy's state for one device.
#[derive(Debug)]
pub(crate) struct HbmPolicy {
    config: HbmConfig,
    /// `None`: no virtual-memory API, regions are segments.
    granule: Option<u64>,
    regions: Vec<Option<Region>>,
    /// Allocated and pending-free blocks by address.
    live: FastMap<DevicePtr, LiveBlock>,
    /// Every region's live blocks and free ranges (`NO_SPAN`-terminated
    /// lists), by id; see [`Span`].
    spans: Vec<Span>,
    /// Retired span ids, reused first.
    free_span_ids: Vec<u32>,
    /// Free spans of at least a granule (the only ones that can hold a whole
    /// one) by end address, for the walks that look for idle memory and
    /// stealable chunks. A carve from the front or a merge with the next
    /// range keeps a range's end, so the hot path rarely touches it.
    large_free: BTreeMap<DevicePtr, u32>,
    /// Free ranges per stream by (size, address), one entry per stream that
    /// ever had a region (few: a linear search finds a stream's entry).
    free_by_size: Vec<SizeIndex>,
    /// Physical memory held but not mapped: pieces of handles, taken from
    /// unmapped chunks (stolen, unpinned, or left over from failed maps).
    /// Any piece can be split at granule boundaries and mapped elsewhere.
    spare: Vec<Piece>,
    /// Every physical handle held, with how much of it is mapped (counting
    /// each view of an aliased granule).
    handles: FastMap<PhysicalHandle, HandleInfo>,
    /// Memory mapped at more than one address, by group id (`None`: a
    /// retired id, reused from `free_group_ids`).
    groups: Vec<Option<AliasGroup>>,
    free_group_ids: Vec<u32>,
    /// Reused by `claim` so that the hot path does not allocate.
    scratch_views: Vec<(u64, u32)>,
    /// Reused by `unclaim`, for the same reason.
    scratch_idle: Vec<u32>,
    /// Pending end-of-use events, per stream, in record order.
    pending_events: BTreeMap<StreamId, VecDeque<(EventId, DevicePtr)>>,
    /// Events whose synchronization failed: retired at the next full
    /// synchronization, so none is leaked.
    stray_events: Vec<EventId>,
    /// Physical memory held: mapped granules, spare handles and segments.
    held_bytes: u64,
    /// Highest live-plus-pending bytes seen, including requests being served.
    peak_demand_bytes: u64,
    /// The request being served takes demand to a new peak.
    growing: bool,
    /// Hard limit on `held_bytes` (memory fraction).
    limit_bytes: Option<u64>,
    device_total: u64,
    stats: DeviceStats,
    history: History,
}

/// Statistics count blocks of at most 1 MiB in the small pool, as PyTorch does.
fn increase(array: &mut StatArray, size: u64, amount: u64) {
    increase_pool(array, size <= SMALL_SIZE, amount);
}

fn decrease(array: &mut StatArray, size: u64, amount: u64) {
    decrease_pool(array, size <= SMALL_SIZE, amount);
}

impl HbmPolicy {
    pub(crate) fn new(
        config: HbmConfig,
        device_total: u64,
        granule: Option<u64>,
        history: History,
    ) -> Self {
        // CUDA's granularity is a power of two (2 MiB): the hot path finds a
        // block's granules by shifting, not dividing.
        let granule = granule.filter(|&g| g.is_power_of_two() && g >= MIN_BLOCK_SIZE);
        let mut policy = HbmPolicy {
            granule,
            regions: Vec::new(),
            live: FastMap::default(),
            spans: Vec::new(),
            free_span_ids: Vec::new(),
            large_free: BTreeMap::new(),
            free_by_size: Vec::new(),
            spare: Vec::new(),
            handles: FastMap::default(),
            groups: Vec::new(),
            free_group_ids: Vec::new(),
            scratch_views: Vec::new(),
            scratch_idle: Vec::new(),
            pending_events: BTreeMap::new(),
            stray_events: Vec::new(),
            held_bytes: 0,
            peak_demand_bytes: 0,
            growing: false,
            limit_bytes: None,
            device_total,
            stats: DeviceStats::default(),
            history,
            config,
        };
        policy.stats.max_split_size = -1;
        if policy.config.per_process_memory_fraction < 1.0 {
            policy.set_memory_fraction(policy.config.per_process_memory_fraction);
        }
        policy
    }

    pub(crate) fn stats(&self) -> &DeviceStats {
        &self.stats
    }

    pub(crate) fn stats_mut(&mut self) -> &mut DeviceStats {
        &mut self.stats
    }

    pub(crate) fn history(&self) -> &History {
        &self.history
    }

    pub(crate) fn set_memory_fraction(&mut self, fraction: f64) {
        self.limit_bytes = Some((fraction * self.device_total as f64) as u64);
    }

    fn region(&self, index: u32) -> &Region {
        self.regions[index as usize]
            .as_ref()
            .expect("a live region")
    }

    fn region_mut(&mut self, index: u32) -> &mut Region {
        self.regions[index as usize]
            .as_mut()
            .expect("a live region")
    }

    fn add_held(&mut self, bytes: u64) {
        self.held_bytes += bytes;
        increase(&mut self.stats.reserved_bytes, u64::MAX, bytes);
    }

    fn sub_held(&mut self, bytes: u64) {
        self.held_bytes -= bytes;
        decrease(&mut self.stats.reserved_bytes, u64::MAX, bytes);
    }

    // ----- free ranges -----

    /// Free ranges at least this large are in `large_free`: a granule
    /// (none, without one).
    fn large_range_bytes(&self) -> u64 {
        self.granule.unwrap_or(u64::MAX)
    }

    fn span(&self, id: u32) -> &Span {
        &self.spans[id as usize]
    }

    fn span_mut(&mut self, id: u32) -> &mut Span {
        &mut self.spans[id as usize]
    }

    fn new_span(&mut self, span: Span) -> u32 {
        match self.free_span_ids.pop() {
            Some(id) => {
                self.spans[id as usize] = span;
                id
            }
            None => {
                self.spans.push(span);
                (self.spans.len() - 1) as u32
            }
        }
    }

    /// Makes `before` and `after` neighbours (either may be `NO_SPAN`).
    fn link(&mut self, before: u32, after: u32) {
        if before != NO_SPAN {
            self.span_mut(before).next = after;
        }
        if after != NO_SPAN {
            self.span_mut(after).prev = before;
        }
    }

    /// Unlinks span `id` (merged into a neighbour) and retires its id.
    fn drop_span(&mut self, id: u32) {
        let Span { prev, next, .. } = *self.span(id);
        self.link(prev, next);
        self.free_span_ids.push(id);
    }

    /// Files free span `id` in the size index (and the large-range index).
    fn index_free(&mut self, id: u32) {
        let span = *self.span(id);
        let slot = self.region(span.region).size_index;
        self.free_by_size[slot].insert(span.size, span.start, id);
        if span.size >= self.large_range_bytes() {
            self.large_free.insert(span.end(), id);
        }
    }

    /// Takes free span `id` out of the indexes.
    fn unindex_free(&mut self, id: u32) {
        let span = *self.span(id);
        let slot = self.region(span.region).size_index;
        self.free_by_size[slot].remove(span.size, span.start);
        if span.size >= self.large_range_bytes() {
            self.large_free.remove(&span.end());
        }
    }

    /// Span `id` (a block just given back) becomes free, merged with free
    /// neighbours: found through its links, no search. Merged into a free
    /// next span, it takes that span's id and end, so the large-range entry
    /// stays as it is.
    fn release_span(&mut self, id: u32) {
        let Span {
            start,
            size,
            prev,
            next,
            region,
            ..
        } = *self.span(id);
        let slot = self.region(region).size_index;
        let large = self.large_range_bytes();
        let mut keep = id;
        let mut indexed_large = false;
        if next != NO_SPAN && self.span(next).free {
            let old = *self.span(next);
            self.free_by_size[slot].remove(old.size, old.start);
            indexed_large = old.size >= large;
            let span = self.span_mut(next);
            span.start = start;
            span.size += size;
            self.drop_span(id);
            keep = next;
        }
        if prev != NO_SPAN && self.span(prev).free {
            self.unindex_free(prev);
            let Span { start, size, .. } = *self.span(prev);
            let span = self.span_mut(keep);
            span.start = start;
            span.size += size;
            self.drop_span(prev);
        }
        let span = self.span_mut(keep);
        span.free = true;
        let (start, size, end) = (span.start, span.size, span.end());
        self.free_by_size[slot].insert(size, start, keep);
        if size >= large && !indexed_large {
            self.large_free.insert(end, keep);
        }
    }

    /// Cuts a live span of `size` bytes at `ptr` out of free span `id`; the
    /// parts before and after it stay free. Returns the new span.
    fn take_span(&mut self, id: u32, ptr: DevicePtr, size: u64) -> u32 {
        let range = *self.span(id);
        let slot = self.region(range.region).size_index;
        let large = self.large_range_bytes();
        let sizes = &mut self.free_by_size[slot];
        sizes.remove(range.size, range.start);
        let rest = range.end() - (ptr + size);
        if rest > 0 {
            // The range keeps what follows the block, hence its end (and its
            // large-range entry while it stays large).
            sizes.insert(rest, ptr + size, id);
            if range.size >= large && rest < large {
                self.large_free.remove(&range.end());
            }
        } else if range.size >= large {
            self.large_free.remove(&range.end());
        }
        let block = self.new_span(Span {
            start: ptr,
            size,
            region: range.region,
            prev: NO_SPAN,
            next: NO_SPAN,
            free: false,
        });
        // Slid past memory in use elsewhere: the front stays free.
        let before = if ptr > range.start {
            let front = self.new_span(Span {
                start: range.start,
                size: ptr - range.start,
                ..range
            });
            self.link(range.prev, front);
            self.index_free(front);
            front
        } else {
            range.prev
        };
        self.link(before, block);
        if rest > 0 {
            let span = self.span_mut(id);
            span.start = ptr + size;
            span.size = rest;
            self.link(block, id);
        } else {
            self.link(block, range.next);
            self.free_span_ids.push(id);
        }
        block
    }

    // ----- malloc -----

    pub(crate) fn malloc(
        &mut self,
        dev: &dyn Device,
        requested: u64,
        stream: StreamId,
    ) -> Result<DevicePtr, AllocError> {
        self.allocate(dev, rounded(requested), requested, stream)
    }

    fn allocate(
        &mut self,
        dev: &dyn Device,
        size: u64,
        requested: u64,
        stream: StreamId,
    ) -> Result<DevicePtr, AllocError> {
        self.process_events(dev)?;
        let demand = self.stats.active_bytes[0].current as u64 + size;
        self.growing = demand > self.peak_demand_bytes;
        self.peak_demand_bytes = self.peak_demand_bytes.max(demand);
        let mut retried = false;
        let (ptr, span, on_aliased) = loop {
            let found = match self.find_free(stream, size) {
                Some(found) => Some(found),
                None => self
                    .new_region(dev, stream, size)?
                    .map(|range| (range, self.span(range).start)),
            };
            if let Some((range, ptr)) = found {
                let region = self.span(range).region;
                let block = self.take_span(range, ptr, size);
                match self.back_range(dev, ptr, size, region, retried) {
                    Ok(Backing::Done) => match self.claim(dev, region, ptr, size) {
                        Ok(on_aliased) => break (ptr, block, on_aliased),
                        Err(e) => {
                            self.release_span(block);
                            return Err(e);
                        }
                    },
                    Ok(Backing::OutOfMemory) => self.release_span(block),
                    Err(e) => {
                        self.release_span(block);
                        return Err(e);
                    }
                }
            }
            if retried {
                return Err(self.out_of_memory(dev, requested, size, stream));
            }
            // Out of memory: let pending frees complete, give back wholly free
            // segments, and try once more, stealing without any allowance.
            retried = true;
            self.stats.num_alloc_retries += 1;
            self.synchronize_and_free_events(dev)?;
            // Every wholly free chunk becomes a spare piece, so memory held
            // in a chunk that straddled the failed block's edge (neither
            // under the block nor wholly in the free range beyond it) can be
            // stitched in too.
            if let Some(granule) = self.granule {
                let victims = self.free_spans(granule, u64::MAX, false);
                self.unmap_spans(dev, granule, &victims)?;
            }
            self.release_free_segments(dev)?;
        };
        self.live.insert(
            ptr,
            LiveBlock {
                requested,
                stream,
                allocated: true,
                pending_events: 0,
                stream_uses: Vec::new(),
                span,
                on_aliased,
            },
        );
        self.history.record(Action::Alloc, ptr, requested, stream);
        increase(&mut self.stats.allocation, size, 1);
        increase(&mut self.stats.allocated_bytes, size, size);
        increase(&mut self.stats.active, size, 1);
        increase(&mut self.stats.active_bytes, size, size);
        increase(&mut self.stats.requested_bytes, size, requested);
        Ok(ptr)
    }

    /// Where a block of `size` bytes goes: the best-fit free range of
    /// `stream` (smallest, then lowest address) whose aliased granules no
    /// live block uses elsewhere; failing that, the first of those ranges
    /// with room past such granules, then the stream's largest free range.
    /// As (free span, block address).
    #[inline]
    fn find_free(&self, stream: StreamId, size: u64) -> Option<(u32, DevicePtr)> {
        let index = self
            .free_by_size
            .iter()
            .find(|index| index.stream == stream)?;
        // The best fit is usually free to use: one lookup, no iterator.
        let (_, ptr, id) = index.first_fit(size)?;
        if !self.blocked(self.span(id).region, ptr, size) {
            return Some((id, ptr));
        }
        // On the stack: the hot path does not allocate.
        let mut blocked = [NO_SPAN; MAX_CANDIDATES];
        blocked[0] = id;
        let mut count = 1;
        for (_, ptr, id) in index.best_fit(size).skip(1).take(MAX_CANDIDATES - 1) {
            if !self.blocked(self.span(id).region, ptr, size) {
                return Some((id, ptr));
            }
            blocked[count] = id;
            count += 1;
        }
        // Every candidate is blocked at its start: slide past the memory in
        // use elsewhere, within the range.
        if let Some(found) = blocked[..count]
            .iter()
            .find_map(|&id| self.slide(id, size).map(|at| (id, at)))
        {
            return Some(found);
        }
        // More ranges fit than were tried: the largest (a region's tail,
        // above everything mapped, as a rule) before a new region, whose
        // first block would pin a granule of its own.
        if count < MAX_CANDIDATES {
            return None;
        }
        let (_, ptr, id) = index.largest()?;
        if !self.blocked(self.span(id).region, ptr, size) {
            return Some((id, ptr));
        }
        self.slide(id, size).map(|at| (id, at))
    }

    /// Slides a block of `size` bytes through free span `id` to the first
    /// place [`HbmPolicy::busy_end`] allows: past lent memory with the bitmap
    /// alone, walking the alias groups only where nothing is lent.
    fn slide(&self, id: u32, size: u64) -> Option<DevicePtr> {
        let granule = self.granule?;
        let range = self.span(id);
        let region_index = range.region;
        let region = self.region(region_index);
        let mut at = range.start;
        while at + size <= range.end() {
            let (first, end) = granules_under(granule, region.base, at, size);
            if let Some(last) = region.lent.last_set(first, end) {
                at = region.base + (last + 1) * granule;
                continue;
            }
            match self.busy_end(region_index, at, size) {
                None => return Some(at),
                Some(busy_end) => at = busy_end,
            }
        }
        None
    }

    /// Reserves a new region for `stream` big enough for `size`; returns it as
    /// one free span, or `None` when the device has no memory for a segment.
    fn new_region(
        &mut self,
        dev: &dyn Device,
        stream: StreamId,
        size: u64,
    ) -> Result<Option<u32>, AllocError> {
        let index = self.regions.len() as u32;
        let size_index = match self.free_by_size.iter().position(|s| s.stream == stream) {
            Some(slot) => slot,
            None => {
                self.free_by_size.push(SizeIndex::new(stream));
                self.free_by_size.len() - 1
            }
        };
        let region = match self.granule {
            Some(granule) => {
                let wanted = (self.device_total.saturating_mul(REGION_CAPACITY_FACTOR)).max(size);
                let region_size = wanted.div_ceil(granule) * granule;
                let base = dev.address_reserve(region_size)?;
                Region::new(base, region_size, stream, size_index, region_size / granule)
            }
            None => {
                let segment_size = size.div_ceil(SEGMENT_ROUND) * SEGMENT_ROUND;
                if self
                    .limit_bytes
                    .is_some_and(|limit| self.held_bytes + segment_size > limit)
                {
                    return Ok(None);
                }
                let base = match dev.segment_alloc(segment_size) {
                    Ok(base) => base,
                    Err(e) if e.is_out_of_memory() => return Ok(None),
                    Err(e) => return Err(e.into()),
                };
                self.add_held(segment_size);
                self.stats.num_device_alloc += 1;
                self.history
                    .record(Action::SegmentAlloc, base, segment_size, stream);
                // No granules: a plain segment, always fully backed.
                Region::new(base, segment_size, stream, size_index, 0)
            }
        };
        let (base, region_size) = (region.base, region.size);
        self.regions.push(Some(region));
        increase(&mut self.stats.segment, u64::MAX, 1);
        let span = self.new_span(Span {
            start: base,
            size: region_size,
            region: index,
            prev: NO_SPAN,
            next: NO_SPAN,
            free: true,
        });
        self.index_free(span);
        Ok(Some(span))
    }

    /// The memory this policy lets itself hold before it steals chunks
    /// rather than creating new ones.
    fn allowance_bytes(&self, granule: u64) -> u64 {
        let allowed = self.peak_demand_bytes as f64 * (1.0 + self.config.max_waste_percent / 100.0);
        (allowed as u64).div_ceil(granule) * granule
    }

    /// Creates a handle of `bytes` unless that would hold more than `limit`
    /// or the device is out of memory.
    fn create(
        &mut self,
        dev: &dyn Device,
        bytes: u64,
        limit: u64,
    ) -> Result<Option<PhysicalHandle>, AllocError> {
        if self.held_bytes + bytes > limit {
            return Ok(None);
        }
        match dev.physical_create(bytes) {
            Ok(handle) => {
                self.add_held(bytes);
                self.handles.insert(handle, HandleInfo { bytes, mapped: 0 });
                self.stats.num_device_alloc += 1;
                Ok(Some(handle))
            }
            Err(e) if e.is_out_of_memory() => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Maps `count` granules of `handle`, from byte `offset` of it, at granule
    /// `first` of the region. Access is granted afterwards, once for a whole
    /// run ([`HbmPolicy::grant_access`]). On failure the piece is kept as a
    /// spare (an alias's memory stays mapped elsewhere), so nothing is ever
    /// lost track of.
    #[allow(clippy::too_many_arguments)]
    fn map_chunk(
        &mut self,
        dev: &dyn Device,
        granule: u64,
        region_index: u32,
        first: u64,
        count: u64,
        handle: PhysicalHandle,
        offset: u64,
        alias: bool,
    ) -> Result<(), AllocError> {
        let (va, stream) = {
            let r = self.region(region_index);
            (r.base + first * granule, r.stream)
        };
        let bytes = count * granule;
        let piece = Piece {
            handle,
            offset,
            bytes,
        };
        // A failed alias loses nothing: the memory is still mapped elsewhere.
        if let Err(e) = dev.map(va, bytes, handle, offset) {
            if !alias {
                self.spare.push(piece);
            }
            return Err(e.into());
        }
        self.stats.num_device_alloc += 1;
        if let Some(info) = self.handles.get_mut(&handle) {
            info.mapped += bytes;
        }
        let region = self.region_mut(region_index);
        region.chunks.insert(
            first,
            Chunk {
                count,
                handle,
                offset,
            },
        );
        region.mapped.set(first, count, true);
        self.history.record(Action::SegmentMap, va, bytes, stream);
        Ok(())
    }

    /// Maps every unmapped granule under `[ptr, ptr + size)` of `region`.
    /// `pressed`: an out-of-memory retry, where stealing ignores the allowance.
    fn back_range(
        &mut self,
        dev: &dyn Device,
        ptr: DevicePtr,
        size: u64,
        region_index: u32,
        pressed: bool,
    ) -> Result<Backing, AllocError> {
        let Some(granule) = self.granule else {
            return Ok(Backing::Done);
        };
        let region = self.region(region_index);
        let (first, end) = granules_under(granule, region.base, ptr, size);
        if region.all_mapped(first, end) {
            return Ok(Backing::Done);
        }
        // Maximal unmapped runs under the block, found a word at a time.
        let mut runs: Vec<(u64, u64)> = Vec::new();
        let mut i = first;
        while i < end {
            let start = region.next_with(i, end, false);
            if start == end {
                break;
            }
            let stop = region.next_with(start, end, true);
            runs.push((start, stop - start));
            i = stop;
        }
        let hard_limit = self.limit_bytes.unwrap_or(u64::MAX);
        let soft_limit = if pressed {
            0
        } else {
            self.allowance_bytes(granule).min(hard_limit)
        };
        // Growth at the top of the heap: map ahead (half the allowance, at
        // most 1% of peak demand), so a growing heap maps in few large chunks
        // (each costs a create, a map and an access call). A request that
        // takes demand to a new peak maps at least `GROWTH_CHUNK_BYTES` ahead,
        // even past the allowance: growth (a first step, a longer sequence)
        // is where the calls are, and what the heap does not grow into is
        // one chunk at most.
        let needed: u64 = runs.iter().map(|r| r.1).sum::<u64>() * granule;
        let peak = self.peak_demand_bytes as f64;
        let ahead_percent = self.config.max_waste_percent.min(MAX_MAP_AHEAD_PERCENT) / 2.0;
        let growth_floor = GROWTH_CHUNK_BYTES
            .min((peak * self.config.max_waste_percent * GROWTH_CHUNK_WASTE_FACTOR / 100.0) as u64);
        let chunk_granules = ((peak * ahead_percent / 100.0) as u64).max(growth_floor) / granule;
        let ahead_limit = if self.growing && !pressed {
            (soft_limit + chunk_granules * granule).min(hard_limit)
        } else {
            soft_limit
        };
        let budget = ahead_limit.saturating_sub(self.held_bytes + needed) / granule;
        // Only the last run is extended, and only it may use the ahead limit.
        let mut last_extended = false;
        if let Some(last) = runs.last_mut() {
            let target = chunk_granules.min(last.1 + budget);
            if last.1 < target {
                // Extend up to the next mapped granule, within the target.
                let limit = (last.0 + target).min(region.granules);
                last.1 = region.next_with(last.0 + last.1, limit, true) - last.0;
                last_extended = true;
            }
        }
        let run_count = runs.len();
        // Memory already stitched under this range is not taken again.
        let span = (
            region_index,
            first,
            runs.last().map_or(end, |r| (r.0 + r.1).max(end)),
        );
        for (i, (start, count)) in runs.into_iter().enumerate() {
            let limit = if last_extended && i + 1 == run_count {
                ahead_limit
            } else {
                soft_limit
            };
            let backed = self.back_run(dev, granule, span, (start, count, end), limit, hard_limit);
            // Whatever got mapped, even on failure, gets access now.
            self.grant_access(dev, granule, region_index, start, start + count)?;
            if !backed? {
                return Ok(Backing::OutOfMemory);
            }
        }
        Ok(Backing::Done)
    }

    /// Grants access to the granules mapped in `[start, end)` of a run that
    /// was wholly unmapped before: one `set_access` per contiguous mapped
    /// stretch, however many chunks were stitched into it (as PyTorch's
    /// expandable segments do). If access fails the stretch's chunks are
    /// unmapped again: memory is never left mapped without access.
    fn grant_access(
        &mut self,
        dev: &dyn Device,
        granule: u64,
        region_index: u32,
        start: u64,
        end: u64,
    ) -> Result<(), AllocError> {
        let mut from = self.region(region_index).next_with(start, end, true);
        while from < end {
            let region = self.region(region_index);
            let to = region.next_with(from, end, false);
            if let Err(e) = dev.set_access(region.base + from * granule, (to - from) * granule) {
                let victims: Vec<(u32, u64, u64, u64)> = region
                    .chunks
                    .range(from..to)
                    .map(|(&s, c)| (region_index, s, s, c.count))
                    .collect();
                self.unmap_spans(dev, granule, &victims)?;
                return Err(e.into());
            }
            from = self.region(region_index).next_with(to, end, true);
        }
        Ok(())
    }

    /// Backs the unmapped granules `[start, start + count)`, where `run` is
    /// `(start, count, needed_end)`: spare pieces; one new handle within
    /// `soft_limit`; idle memory under free ranges, mapped here too
    /// ([`AliasGroup`]); wholly free chunks stolen (unmapped, stitched in
    /// here), then aliasing again; one new handle within the hard limit.
    /// Granules from `needed_end` on are mapped ahead: worth spares or a new
    /// handle, never aliasing or stealing. False: out of memory.
    fn back_run(
        &mut self,
        dev: &dyn Device,
        granule: u64,
        span: GranuleSpan,
        run: (u64, u64, u64),
        soft_limit: u64,
        hard_limit: u64,
    ) -> Result<bool, AllocError> {
        let (start, count, needed_end) = run;
        let region_index = span.0;
        let end = start + count;
        let mut cursor = self.stitch_spares(dev, granule, region_index, start, end)?;
        if cursor == end {
            return Ok(true);
        }
        if self.map_new_handle(dev, granule, region_index, cursor, end, soft_limit)? {
            return Ok(true);
        }
        let end = end.min(needed_end);
        if cursor >= end {
            return Ok(true);
        }
        cursor = self.alias_idle(dev, granule, span, cursor, end)?;
        if cursor == end {
            return Ok(true);
        }
        let victims = self.free_spans(granule, (end - cursor) * granule, true);
        // With nothing stolen, the spares and idle memory are as the calls
        // above left them: used up.
        if !victims.is_empty() {
            self.unmap_spans(dev, granule, &victims)?;
            cursor = self.stitch_spares(dev, granule, region_index, cursor, end)?;
            // Unmapping a view of a group frees a place for another view.
            cursor = self.alias_idle(dev, granule, span, cursor, end)?;
            if cursor == end {
                return Ok(true);
            }
        }
        self.map_new_handle(dev, granule, region_index, cursor, end, hard_limit)
    }

    /// Creates one handle for granules `[cursor, end)` (unless that would
    /// hold more than `limit`) and maps it there. False: no memory.
    fn map_new_handle(
        &mut self,
        dev: &dyn Device,
        granule: u64,
        region_index: u32,
        cursor: u64,
        end: u64,
        limit: u64,
    ) -> Result<bool, AllocError> {
        let count = end - cursor;
        let Some(handle) = self.create(dev, count * granule, limit)? else {
            return Ok(false);
        };
        self.map_chunk(dev, granule, region_index, cursor, count, handle, 0, false)?;
        Ok(true)
    }

    /// Maps spare pieces into `[cursor, end)`: the smallest piece that covers
    /// what is left (split, the rest staying spare), else the largest piece;
    /// returns the first granule still unmapped.
    fn stitch_spares(
        &mut self,
        dev: &dyn Device,
        granule: u64,
        region_index: u32,
        mut cursor: u64,
        end: u64,
    ) -> Result<u64, AllocError> {
        while cursor < end && !self.spare.is_empty() {
            let room = (end - cursor) * granule;
            let mut best = 0;
            for (i, p) in self.spare.iter().enumerate().skip(1) {
                let b = &self.spare[best];
                let better = match (p.bytes >= room, b.bytes >= room) {
                    (true, true) => p.bytes < b.bytes,
                    (true, false) => true,
                    (false, true) => false,
                    (false, false) => p.bytes > b.bytes,
                };
                if better {
                    best = i;
                }
            }
            let piece = self.spare.swap_remove(best);
            let take = piece.bytes.min(room);
            if piece.bytes > take {
                self.spare.push(Piece {
                    handle: piece.handle,
                    offset: piece.offset + take,
                    bytes: piece.bytes - take,
                });
            }
            self.map_chunk(
                dev,
                granule,
                region_index,
                cursor,
                take / granule,
                piece.handle,
                piece.offset,
                false,
            )?;
            cursor += take / granule;
        }
        Ok(cursor)
    }

    /// The granules `[first, end)` lying wholly inside each free range, as
    /// (region, first, end), highest address first; ranges smaller than a
    /// granule (not in `large_free`) hold none.
    fn free_granules(&self, granule: u64) -> impl Iterator<Item = (u32, u64, u64)> + '_ {
        self.large_free.values().rev().filter_map(move |&id| {
            let range = self.span(id);
            let base = self.region(range.region).base;
            let first = (range.start - base).div_ceil(granule);
            let end = (range.end() - base) / granule;
            (first < end).then_some((range.region, first, end))
        })
    }

    /// Granules lying wholly inside free ranges, highest address first
    /// (placement favours low addresses, so the top is the least likely to be
    /// wanted again soon), until they add up to `bytes`: as (region, chunk
    /// start, first granule, granules). `giving_only`: only chunks whose
    /// unmapping gives something — unaliased granules (spare once unmapped)
    /// or an idle group's view (a place for another view); unmapping a view
    /// of memory in use elsewhere gives nothing.
    fn free_spans(&self, granule: u64, bytes: u64, giving_only: bool) -> Vec<(u32, u64, u64, u64)> {
        let mut victims = Vec::new();
        let mut found = 0u64;
        for (region_index, first, end) in self.free_granules(granule) {
            if found >= bytes {
                break;
            }
            let region = self.region(region_index);
            for (&start, chunk) in region.chunks.range(..end).rev() {
                let chunk_end = start + chunk.count;
                if chunk_end <= first || found >= bytes {
                    break;
                }
                // Only chunks wholly inside the free range move: a chunk
                // partly under a live block stays mapped (see the header).
                if start < first || chunk_end > end {
                    continue;
                }
                // Wholly free here, so a group in use is in use elsewhere:
                // lent.
                if giving_only && region.lent.all(start, chunk_end) {
                    continue;
                }
                victims.push((region_index, start, start, chunk.count));
                found += chunk.count * granule;
            }
        }
        victims
    }

    /// Takes the given chunks (each wholly free) out of their regions: each
    /// is unmapped (one call) and its memory becomes a spare piece.
    fn unmap_spans(
        &mut self,
        dev: &dyn Device,
        granule: u64,
        victims: &[(u32, u64, u64, u64)],
    ) -> Result<(), AllocError> {
        if victims.is_empty() {
            return Ok(());
        }
        // A page may still be touched by kernels queued on its stream before
        // the free: wait for each owning stream once.
        let streams: BTreeSet<StreamId> = victims
            .iter()
            .map(|&(r, ..)| self.region(r).stream)
            .collect();
        for stream in streams {
            let event = dev.record_event(stream)?;
            if let Err(e) = dev.synchronize_event(event) {
                self.stray_events.push(event);
                return Err(e.into());
            }
        }
        for &(region_index, start, _, _) in victims {
            // Taken out first (one search); put back if the unmap fails.
            let region = self.region_mut(region_index);
            let chunk = region.chunks.remove(&start).expect("a mapped chunk");
            let va = region.base + start * granule;
            let stream = region.stream;
            let bytes = chunk.count * granule;
            if let Err(e) = dev.unmap(va, bytes) {
                self.region_mut(region_index).chunks.insert(start, chunk);
                return Err(e.into());
            }
            self.stats.num_device_free += 1;
            self.history.record(Action::SegmentUnmap, va, bytes, stream);
            if let Some(info) = self.handles.get_mut(&chunk.handle) {
                info.mapped -= bytes;
            }
            let region = self.region_mut(region_index);
            region.mapped.set(start, chunk.count, false);
            if !region.aliased.any(start, start + chunk.count) {
                self.spare.push(Piece {
                    handle: chunk.handle,
                    offset: chunk.offset,
                    bytes,
                });
                continue;
            }
            // Views of alias groups stay held at their other views; the rest
            // of the chunk becomes spare pieces.
            let end = start + chunk.count;
            let views: Vec<(u64, u32)> = region
                .group_views
                .range(start..end)
                .map(|(&s, &id)| (s, id))
                .collect();
            let mut cursor = start;
            for (view_start, id) in views {
                if view_start > cursor {
                    self.spare.push(Piece {
                        handle: chunk.handle,
                        offset: chunk.offset + (cursor - start) * granule,
                        bytes: (view_start - cursor) * granule,
                    });
                }
                cursor = view_start + self.group(id).count;
                self.drop_view(id, (region_index, view_start));
            }
            if cursor < end {
                self.spare.push(Piece {
                    handle: chunk.handle,
                    offset: chunk.offset + (cursor - start) * granule,
                    bytes: (end - cursor) * granule,
                });
            }
        }
        Ok(())
    }

    // ----- aliases -----

    fn group(&self, id: u32) -> &AliasGroup {
        self.groups[id as usize]
            .as_ref()
            .expect("a live alias group")
    }

    fn group_mut(&mut self, id: u32) -> &mut AliasGroup {
        self.groups[id as usize]
            .as_mut()
            .expect("a live alias group")
    }

    /// The granules `[first, end)` a block `[ptr, ptr + size)` of a region
    /// lies on, or `None` in a plain segment (no granules).
    #[inline]
    fn granule_span(&self, region_index: u32, ptr: DevicePtr, size: u64) -> Option<(u64, u64)> {
        let granule = self.granule?;
        let region = self.region(region_index);
        if region.segment {
            return None;
        }
        Some(granules_under(granule, region.base, ptr, size))
    }

    /// [`HbmPolicy::granule_span`], or `None` when none of those granules is
    /// aliased (the hot path: one bitmap test).
    #[inline]
    fn aliased_span(&self, region_index: u32, ptr: DevicePtr, size: u64) -> Option<(u64, u64)> {
        let (first, end) = self.granule_span(region_index, ptr, size)?;
        let aliased = &self.region(region_index).aliased;
        aliased.any(first, end).then_some((first, end))
    }

    /// The alias-group views of region `region_index` overlapping granules
    /// `[first, end)`, as (first granule of the view, group).
    fn views_in(
        &self,
        region_index: u32,
        first: u64,
        end: u64,
    ) -> impl Iterator<Item = (u64, u32)> + '_ {
        views_overlapping(
            &self.region(region_index).group_views,
            &self.groups,
            first,
            end,
        )
    }

    /// Whether a block may not lie at `[ptr, ptr + size)` of region
    /// `region_index` (see [`HbmPolicy::busy_end`]); the lent bitmap answers
    /// most cases without a walk of the groups.
    #[inline]
    fn blocked(&self, region_index: u32, ptr: DevicePtr, size: u64) -> bool {
        let Some((first, end)) = self.granule_span(region_index, ptr, size) else {
            return false;
        };
        let region = self.region(region_index);
        // Lent granules are aliased: the lent test comes first, as it
        // settles most blocked candidates alone.
        region.lent.any(first, end)
            || (region.aliased.any(first, end) && self.busy_end(region_index, ptr, size).is_some())
    }

    /// `None` when a block at `[ptr, ptr + size)` of region `region_index`
    /// may lie there: no group under it is in use at another view, and no
    /// group is under it twice (an alias beside its donor). Otherwise the
    /// end of the last view in the way.
    #[inline]
    fn busy_end(&self, region_index: u32, ptr: DevicePtr, size: u64) -> Option<DevicePtr> {
        let (first, end) = self.aliased_span(region_index, ptr, size)?;
        let granule = self.granule.unwrap_or(1);
        let region = self.region(region_index);
        let lent_end = region.lent.last_set(first, end).map(|index| index + 1);
        let twice_end = self
            .views_in(region_index, first, end)
            .filter(|&(start, id)| {
                let group = self.group(id);
                group.views.iter().any(|&(r, s)| {
                    r == region_index && s != start && s < end && s + group.count > first
                })
            })
            .map(|(start, id)| start + self.group(id).count)
            .max();
        lent_end
            .max(twice_end)
            .map(|index| region.base + index * granule)
    }

    /// A block now lies on `[ptr, ptr + size)`: it takes over the groups
    /// under it, after waiting for the stream that used them last when that
    /// is another stream (as a steal does). True: it lies on aliased memory.
    fn claim(
        &mut self,
        dev: &dyn Device,
        region_index: u32,
        ptr: DevicePtr,
        size: u64,
    ) -> Result<bool, AllocError> {
        let Some((first, end)) = self.aliased_span(region_index, ptr, size) else {
            return Ok(false);
        };
        let stream = self.region(region_index).stream;
        let mut views = std::mem::take(&mut self.scratch_views);
        views.clear();
        views.extend(self.views_in(region_index, first, end));
        let other_stream = |this: &Self, id: u32| {
            let user_stream = this.region(this.group(id).user.0).stream;
            (user_stream != stream).then_some(user_stream)
        };
        // Usually the memory was last used on this stream: nothing to wait for.
        if views
            .iter()
            .any(|&(_, id)| other_stream(self, id).is_some())
        {
            let waits: BTreeSet<StreamId> = views
                .iter()
                .filter_map(|&(_, id)| other_stream(self, id))
                .collect();
            #[cfg(test)]
            let waits = if testing::SKIP_ALIAS_WAIT.with(|skip| skip.get()) {
                BTreeSet::new()
            } else {
                waits
            };
            for other in waits {
                let event = dev.record_event(other)?;
                if let Err(e) = dev.synchronize_event(event) {
                    self.stray_events.push(event);
                    return Err(e.into());
                }
            }
        }
        for &(mut start, mut id) in &views {
            // An idle group is cut to the granules the block covers, so the
            // rest stays free to use at the other views.
            if self.group(id).blocks == 0 {
                if start < first {
                    id = self.split_group(id, first - start);
                    start = first;
                }
                if start + self.group(id).count > end {
                    self.split_group(id, end - start);
                }
            }
            let group = self.group_mut(id);
            debug_assert!(group.blocks == 0 || group.user == (region_index, start));
            group.user = (region_index, start);
            group.blocks += 1;
            if group.blocks == 1 {
                self.set_lent(id, true);
            }
        }
        self.scratch_views = views;
        Ok(true)
    }

    /// Marks (or clears) group `id` as lent at every view but its user's.
    fn set_lent(&mut self, id: u32, lent: bool) {
        let group = self.group(id);
        let (count, user) = (group.count, group.user);
        for index in 0..group.views.len() {
            let view = self.group(id).views[index];
            if view != user {
                self.region_mut(view.0).lent.set(view.1, count, lent);
            }
        }
    }

    /// Cuts idle group `id` after its first `at` granules; returns the
    /// group of the rest.
    fn split_group(&mut self, id: u32, at: u64) -> u32 {
        let granule = self.granule.unwrap_or(0);
        let group = self.group_mut(id);
        debug_assert!(group.blocks == 0 && at > 0 && at < group.count);
        let rest = AliasGroup {
            handle: group.handle,
            offset: group.offset + at * granule,
            count: group.count - at,
            views: group.views.iter().map(|&(r, s)| (r, s + at)).collect(),
            user: (group.user.0, group.user.1 + at),
            blocks: 0,
        };
        group.count = at;
        let views = rest.views.clone();
        let rest_id = self.new_group(rest);
        for (r, s) in views {
            self.region_mut(r).group_views.insert(s, rest_id);
        }
        rest_id
    }

    /// Merges idle group `id` with the idle groups just before and after it
    /// that continue it at every view (what [`HbmPolicy::split_group`] cut),
    /// so that groups do not stay small.
    fn merge_idle(&mut self, id: u32) {
        if self.groups[id as usize].is_none() {
            return; // merged into its neighbour already
        }
        let (region, start, count) = {
            let group = self.group(id);
            (group.user.0, group.user.1, group.count)
        };
        let views = &self.region(region).group_views;
        let next = views.get(&(start + count)).copied();
        let previous = views.range(..start).next_back().map(|(_, &before)| before);
        let mut id = id;
        if let Some(before) = previous.filter(|&before| self.continues(before, id)) {
            self.absorb(before, id);
            id = before;
        }
        if let Some(after) = next.filter(|&after| self.continues(id, after)) {
            self.absorb(id, after);
        }
    }

    /// Whether idle group `after` continues idle group `first` at every view.
    fn continues(&self, first: u32, after: u32) -> bool {
        let granule = self.granule.unwrap_or(0);
        let (a, b) = (self.group(first), self.group(after));
        first != after
            && a.blocks == 0
            && b.blocks == 0
            && a.handle == b.handle
            && b.offset == a.offset + a.count * granule
            && a.views.len() == b.views.len()
            && b.user == (a.user.0, a.user.1 + a.count)
            && a.views.iter().all(|&(r, s)| {
                // A view lies inside one chunk: one unmap removes it whole.
                let end = s + a.count + b.count;
                b.views.contains(&(r, s + a.count))
                    && self
                        .region(r)
                        .chunks
                        .range(..=s)
                        .next_back()
                        .is_some_and(|(&start, chunk)| start + chunk.count >= end)
            })
    }

    /// Appends group `after` to group `first` (see [`HbmPolicy::continues`]).
    fn absorb(&mut self, first: u32, after: u32) {
        let gone = self.groups[after as usize]
            .take()
            .expect("a live alias group");
        self.free_group_ids.push(after);
        for (r, s) in gone.views {
            self.region_mut(r).group_views.remove(&s);
        }
        self.group_mut(first).count += gone.count;
    }

    fn new_group(&mut self, group: AliasGroup) -> u32 {
        match self.free_group_ids.pop() {
            Some(id) => {
                self.groups[id as usize] = Some(group);
                id
            }
            None => {
                self.groups.push(Some(group));
                (self.groups.len() - 1) as u32
            }
        }
    }

    /// A block on `[ptr, ptr + size)` is gone: the groups under it are idle
    /// unless other blocks lie on them.
    fn unclaim(&mut self, region_index: u32, ptr: DevicePtr, size: u64) {
        let Some((first, end)) = self.aliased_span(region_index, ptr, size) else {
            return;
        };
        // Fields borrowed apart: the view index is read while the groups change.
        let views = &self
            .regions
            .get(region_index as usize)
            .and_then(|r| r.as_ref())
            .expect("a live region")
            .group_views;
        let mut idle = std::mem::take(&mut self.scratch_idle);
        idle.clear();
        for (start, id) in views_overlapping(views, &self.groups, first, end) {
            let group = self.groups[id as usize]
                .as_mut()
                .expect("a live alias group");
            debug_assert!(group.user == (region_index, start) && group.blocks > 0);
            group.blocks -= 1;
            if group.blocks == 0 {
                idle.push(id);
            }
        }
        // Groups cut apart when blocks claimed them grow back together.
        for &id in &idle {
            self.set_lent(id, false);
        }
        for &id in &idle {
            self.merge_idle(id);
        }
        self.scratch_idle = idle;
    }

    /// Whether `group` is idle at every view and may be mapped into `span`
    /// as well (a range being backed: memory already stitched into it must
    /// not be mapped there twice).
    fn group_idle(group: &AliasGroup, span: GranuleSpan) -> bool {
        group.blocks == 0
            && group.views.len() < MAX_VIEWS
            && !group
                .views
                .iter()
                .any(|&(r, s)| r == span.0 && s < span.2 && s + group.count > span.1)
    }

    /// Memory lying idle under free ranges, highest address first, until it
    /// adds up to `bytes`: runs of unaliased granules (each inside one
    /// chunk, so physically contiguous) and whole idle groups.
    fn idle_donors(&self, granule: u64, bytes: u64, span: GranuleSpan) -> Vec<Donor> {
        let mut donors = Vec::new();
        let mut found = 0u64;
        for (region_index, first, end) in self.free_granules(granule) {
            if found >= bytes {
                break;
            }
            let region = self.region(region_index);
            // Lent memory is in use elsewhere: skipped a word at a time.
            let mut i = region.next_unlent(first, end);
            while i < end && found < bytes {
                if region.aliased.get(i) {
                    let (&start, &id) = region
                        .group_views
                        .range(..=i)
                        .next_back()
                        .expect("an aliased granule lies in a group view");
                    let group = self.group(id);
                    if start >= first && start + group.count <= end && Self::group_idle(group, span)
                    {
                        donors.push(Donor::Group(id));
                        found += group.count * granule;
                    }
                    i = region.next_unlent(start + group.count, end);
                    continue;
                }
                let (&start, chunk) = region
                    .chunks
                    .range(..=i)
                    .next_back()
                    .expect("a mapped granule lies in a chunk");
                let stop = region
                    .aliased
                    .next_with(i, end.min(start + chunk.count), true);
                let count = (stop - i).min((bytes - found).div_ceil(granule));
                donors.push(Donor::Granules {
                    view: (region_index, i),
                    count,
                    handle: chunk.handle,
                    offset: chunk.offset + (i - start) * granule,
                });
                found += count * granule;
                i = region.next_unlent(stop, end);
            }
        }
        donors
    }

    /// Maps memory lying idle under free ranges elsewhere into
    /// `[cursor, end)` of the span's region as well (see [`AliasGroup`]);
    /// returns the first granule still unmapped.
    fn alias_idle(
        &mut self,
        dev: &dyn Device,
        granule: u64,
        span: GranuleSpan,
        mut cursor: u64,
        end: u64,
    ) -> Result<u64, AllocError> {
        let region_index = span.0;
        for donor in self.idle_donors(granule, (end - cursor) * granule, span) {
            if cursor == end {
                break;
            }
            let target = (region_index, cursor);
            match donor {
                Donor::Granules {
                    view,
                    count,
                    handle,
                    offset,
                } => {
                    let take = count.min(end - cursor);
                    self.map_chunk(
                        dev,
                        granule,
                        region_index,
                        cursor,
                        take,
                        handle,
                        offset,
                        true,
                    )?;
                    let group = AliasGroup {
                        handle,
                        offset,
                        count: take,
                        views: vec![view, target],
                        user: view,
                        blocks: 0,
                    };
                    let id = self.new_group(group);
                    self.add_view(id, view);
                    self.add_view(id, target);
                    cursor += take;
                }
                Donor::Group(id) => {
                    // A group is listed once per free view; the first use
                    // puts a view in the span and makes it ineligible.
                    let group = self.group(id);
                    if !Self::group_idle(group, span) {
                        continue;
                    }
                    if group.count > end - cursor {
                        self.split_group(id, end - cursor);
                    }
                    let group = self.group(id);
                    let (handle, offset, count) = (group.handle, group.offset, group.count);
                    self.map_chunk(
                        dev,
                        granule,
                        region_index,
                        cursor,
                        count,
                        handle,
                        offset,
                        true,
                    )?;
                    self.group_mut(id).views.push(target);
                    self.add_view(id, target);
                    cursor += count;
                }
            }
        }
        Ok(cursor)
    }

    /// Records `view` of group `id` in its region.
    fn add_view(&mut self, id: u32, view: View) {
        let count = self.group(id).count;
        let region = self.region_mut(view.0);
        region.group_views.insert(view.1, id);
        region.aliased.set(view.1, count, true);
    }

    /// Forgets `view` of group `id` (just unmapped there). A group left with
    /// one view is dissolved: that memory is plainly mapped again.
    fn drop_view(&mut self, id: u32, view: View) {
        let count = self.group(id).count;
        let region = self.region_mut(view.0);
        region.group_views.remove(&view.1);
        region.aliased.set(view.1, count, false);
        region.lent.set(view.1, count, false);
        let group = self.group_mut(id);
        group.views.retain(|&v| v != view);
        if group.user == view {
            debug_assert_eq!(group.blocks, 0, "an unmapped view was in use");
            group.user = group.views[0];
        }
        if group.views.len() == 1 {
            let last = group.views[0];
            let region = self.region_mut(last.0);
            region.group_views.remove(&last.1);
            region.aliased.set(last.1, count, false);
            self.groups[id as usize] = None;
            self.free_group_ids.push(id);
        }
    }

    /// Releases every handle of which nothing is mapped.
    fn release_spares(&mut self, dev: &dyn Device) -> Result<(), AllocError> {
        let mut idle: Vec<PhysicalHandle> = self
            .handles
            .iter()
            .filter(|(_, info)| info.mapped == 0)
            .map(|(&h, _)| h)
            .collect();
        // In handle order, as the calls are recorded.
        idle.sort_unstable();
        for handle in idle {
            dev.physical_release(handle)?;
            let info = self.handles.remove(&handle).expect("a held handle");
            self.spare.retain(|p| p.handle != handle);
            self.sub_held(info.bytes);
            self.stats.num_device_free += 1;
        }
        Ok(())
    }

    // ----- free -----

    pub(crate) fn free(&mut self, dev: &dyn Device, ptr: DevicePtr) -> Result<(), AllocError> {
        let Some(block) = self.live.get_mut(&ptr).filter(|b| b.allocated) else {
            return Err(AllocError::UnknownPointer { ptr });
        };
        block.allocated = false;
        let (requested, stream, span) = (block.requested, block.stream, block.span);
        let uses_pending = !block.stream_uses.is_empty();
        let size = self.span(span).size;
        decrease(&mut self.stats.allocation, size, 1);
        decrease(&mut self.stats.allocated_bytes, size, size);
        self.history
            .record(Action::FreeRequested, ptr, requested, stream);
        if uses_pending {
            self.insert_events(dev, ptr)
        } else {
            self.free_completed(ptr);
            Ok(())
        }
    }

    /// The block's last use is over: its range joins the free set.
    fn free_completed(&mut self, ptr: DevicePtr) {
        let block = self.live.remove(&ptr).expect("a live block");
        let Span { size, region, .. } = *self.span(block.span);
        decrease(&mut self.stats.active, size, 1);
        decrease(&mut self.stats.active_bytes, size, size);
        decrease(&mut self.stats.requested_bytes, size, block.requested);
        self.history
            .record(Action::FreeCompleted, ptr, block.requested, block.stream);
        if block.on_aliased {
            self.unclaim(region, ptr, size);
        } else {
            debug_assert!(self.aliased_span(region, ptr, size).is_none());
        }
        self.release_span(block.span);
    }

    pub(crate) fn record_stream(
        &mut self,
        ptr: DevicePtr,
        stream: StreamId,
    ) -> Result<(), AllocError> {
        let Some(block) = self.live.get_mut(&ptr).filter(|b| b.allocated) else {
            return Err(AllocError::UnknownPointer { ptr });
        };
        // Uses on the allocation stream are ordered already.
        if stream != block.stream && !block.stream_uses.contains(&stream) {
            block.stream_uses.push(stream);
        }
        Ok(())
    }

    fn insert_events(&mut self, dev: &dyn Device, ptr: DevicePtr) -> Result<(), AllocError> {
        let block = self.live.get_mut(&ptr).expect("a live block");
        let mut streams = std::mem::take(&mut block.stream_uses);
        streams.sort();
        for (i, &stream) in streams.iter().enumerate() {
            match dev.record_event(stream) {
                Ok(event) => {
                    if let Some(block) = self.live.get_mut(&ptr) {
                        block.pending_events += 1;
                    }
                    self.pending_events
                        .entry(stream)
                        .or_default()
                        .push_back((event, ptr));
                }
                Err(e) => {
                    // Keep the uses no event covers: the block is not reused
                    // until a device synchronization (OOM retry, empty_cache).
                    if let Some(block) = self.live.get_mut(&ptr) {
                        block.stream_uses = streams[i..].to_vec();
                    }
                    return Err(e.into());
                }
            }
        }
        Ok(())
    }

    fn event_completed(&mut self, ptr: DevicePtr) {
        let block = self.live.get_mut(&ptr).expect("a pending block");
        block.pending_events -= 1;
        if block.pending_events == 0 && block.stream_uses.is_empty() {
            self.free_completed(ptr);
        }
    }

    fn process_events(&mut self, dev: &dyn Device) -> Result<(), AllocError> {
        if self.pending_events.is_empty() {
            return Ok(());
        }
        let streams: Vec<StreamId> = self.pending_events.keys().copied().collect();
        for stream in streams {
            while let Some(&(event, ptr)) = self.pending_events.get(&stream).and_then(|q| q.front())
            {
                if !dev.query_event(event)? {
                    break;
                }
                if let Some(queue) = self.pending_events.get_mut(&stream) {
                    queue.pop_front();
                }
                self.event_completed(ptr);
            }
            if self
                .pending_events
                .get(&stream)
                .is_some_and(|q| q.is_empty())
            {
                self.pending_events.remove(&stream);
            }
        }
        Ok(())
    }

    fn synchronize_and_free_events(&mut self, dev: &dyn Device) -> Result<(), AllocError> {
        self.stats.num_sync_all_streams += 1;
        while let Some(&event) = self.stray_events.last() {
            dev.synchronize_event(event)?;
            self.stray_events.pop();
        }
        let mut stranded: Vec<DevicePtr> = self
            .live
            .iter()
            .filter(|(_, b)| !b.allocated && !b.stream_uses.is_empty())
            .map(|(&p, _)| p)
            .collect();
        stranded.sort_unstable();
        if !stranded.is_empty() {
            dev.synchronize_device()?;
        }
        for ptr in stranded {
            let block = self.live.get_mut(&ptr).expect("a pending block");
            block.stream_uses.clear();
            if block.pending_events == 0 {
                self.free_completed(ptr);
            }
        }
        while let Some((&stream, _)) = self.pending_events.iter().next() {
            while let Some(&(event, ptr)) = self.pending_events.get(&stream).and_then(|q| q.front())
            {
                dev.synchronize_event(event)?;
                if let Some(queue) = self.pending_events.get_mut(&stream) {
                    queue.pop_front();
                }
                self.event_completed(ptr);
            }
            self.pending_events.remove(&stream);
        }
        Ok(())
    }

    // ----- giving memory back -----

    /// Gives back every wholly free region: fallback segments to the driver
    /// (`segment_free`), and virtual reservations with nothing mapped in them
    /// (`address_free`), so that after `empty_cache` an idle allocator holds
    /// nothing at all.
    fn release_free_segments(&mut self, dev: &dyn Device) -> Result<(), AllocError> {
        let free_regions: Vec<u32> = self
            .regions
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.as_ref().map(|r| (i as u32, r)))
            .filter(|(i, r)| {
                (r.segment || r.chunks.is_empty())
                    && self.free_by_size[r.size_index]
                        .get(r.size, r.base)
                        .is_some_and(|id| self.span(id).region == *i)
            })
            .map(|(i, _)| i)
            .collect();
        for index in free_regions {
            let (base, size, stream, segment) = {
                let r = self.region(index);
                (r.base, r.size, r.stream, r.segment)
            };
            if segment {
                dev.segment_free(base, size)?;
                self.sub_held(size);
                self.stats.num_device_free += 1;
                self.history.record(Action::SegmentFree, base, size, stream);
            } else {
                dev.address_free(base, size)?;
            }
            let slot = self.region(index).size_index;
            let span = self.free_by_size[slot]
                .get(size, base)
                .expect("a wholly free region is one indexed range");
            self.unindex_free(span);
            self.free_span_ids.push(span);
            self.regions[index as usize] = None;
            decrease(&mut self.stats.segment, u64::MAX, 1);
        }
        Ok(())
    }

    pub(crate) fn empty_cache(&mut self, dev: &dyn Device) -> Result<(), AllocError> {
        self.synchronize_and_free_events(dev)?;
        if let Some(granule) = self.granule {
            let victims = self.free_spans(granule, u64::MAX, false);
            self.unmap_spans(dev, granule, &victims)?;
            self.release_spares(dev)?;
        }
        self.release_free_segments(dev)
    }

    // ----- out of memory -----

    fn out_of_memory(
        &mut self,
        dev: &dyn Device,
        requested: u64,
        rounded: u64,
        stream: StreamId,
    ) -> AllocError {
        let device_free = dev.memory_info().map(|i| i.free_bytes).unwrap_or(0);
        self.history
            .record(Action::Oom, device_free, rounded, stream);
        self.stats.num_ooms += 1;
        let allocated = self.stats.allocated_bytes[0].current as u64;
        // With remapping, every wholly free mapped granule is usable by any
        // request: that is the largest piece the allocator could offer.
        let largest_free = match self.granule {
            Some(g) => self
                .free_spans(g, u64::MAX, false)
                .iter()
                .map(|v| v.3 * g)
                .sum(),
            None => self
                .free_by_size
                .iter()
                .filter_map(|index| index.largest())
                .map(|(size, _, _)| size)
                .max()
                .unwrap_or(0),
        };
        let pending: u64 = self
            .live
            .values()
            .filter(|b| !b.allocated)
            .map(|b| self.span(b.span).size)
            .sum();
        let granule = self.granule.unwrap_or(SEGMENT_ROUND);
        let mut report = OomReport {
            requested_bytes: requested,
            rounded_bytes: rounded,
            device_request_bytes: rounded.div_ceil(granule) * granule,
            stream,
            device_total_bytes: self.device_total,
            device_free_bytes: device_free,
            allocated_bytes: allocated,
            reserved_bytes: self.held_bytes,
            cached_free_bytes: self.held_bytes.saturating_sub(allocated),
            largest_free_block_bytes: largest_free,
            pending_free_bytes: pending,
            limit_bytes: self.limit_bytes,
            policy: "hbm",
            verdict: OomVerdict::RealDemand,
        };
        report.judge();
        AllocError::OutOfMemory(Box::new(report))
    }

    // ----- restoring a recorded state -----

    /// Recreates a recorded segment's blocks: `hbm` places memory its own way,
    /// so it simply allocates each block and frees the ones that were free.
    pub(crate) fn restore_segment(
        &mut self,
        dev: &dyn Device,
        image: &SegmentImage,
    ) -> Result<Vec<DevicePtr>, AllocError> {
        if let Some(bad) = image
            .blocks
            .iter()
            .find(|b| b.size == 0 || b.size % MIN_BLOCK_SIZE != 0)
        {
            return Err(AllocError::InvalidSize { size: bad.size });
        }
        let mut ptrs = Vec::with_capacity(image.blocks.len());
        for block in &image.blocks {
            let requested = block.requested_size.clamp(1, block.size);
            // A block the program holds gets what the program asked for, as
            // every allocation replayed after it does (trace entries carry
            // requested sizes). Its recorded size is PyTorch's: rounded, and
            // with the remainder PyTorch did not split off (up to 1 MiB),
            // which is PyTorch's waste, not the program's. The rest of the
            // image (cached free blocks) keeps the recorded layout and sizes:
            // hbm starts from the recorded allocator's fragmentation.
            let size = if block.allocated && block.requested_size > 0 {
                rounded(requested)
            } else {
                block.size
            };
            ptrs.push(self.allocate(dev, size, requested, image.stream)?);
        }
        for (block, &ptr) in image.blocks.iter().zip(&ptrs) {
            if !block.allocated {
                self.free(dev, ptr)?;
            }
        }
        Ok(ptrs)
    }

    // ----- inspection -----

    /// Each contiguous mapped range (or fallback segment) as a segment.
    pub(crate) fn snapshot(&self) -> Vec<SegmentSnapshot> {
        let mut live: Vec<(DevicePtr, &LiveBlock)> =
            self.live.iter().map(|(&p, b)| (p, b)).collect();
        live.sort_unstable_by_key(|&(p, _)| p);
        let mut free: Vec<(DevicePtr, u64)> = self
            .free_by_size
            .iter()
            .flat_map(|index| index.iter())
            .map(|(size, p, _)| (p, size))
            .collect();
        free.sort_unstable();
        let mut segments = Vec::new();
        for (region_index, region) in self.regions.iter().enumerate() {
            let Some(region) = region else { continue };
            let runs: Vec<(DevicePtr, u64)> = match self.granule {
                Some(g) if !region.segment => {
                    let mut runs: Vec<(DevicePtr, u64)> = Vec::new();
                    // Mapped granules, each physical granule once: of an
                    // alias group, only the view in use (or used last), so
                    // that segments add up to memory held, as tools expect.
                    let shown = |index: u64| {
                        region.is_mapped(index)
                            && (!region.aliased.get(index)
                                || region.group_views.range(..=index).next_back().is_some_and(
                                    |(&start, &id)| {
                                        self.group(id).user == (region_index as u32, start)
                                    },
                                ))
                    };
                    let mut index = region.next_with(0, region.granules, true);
                    while index < region.granules {
                        if !shown(index) {
                            index = region.next_with(index + 1, region.granules, true);
                            continue;
                        }
                        let va = region.base + index * g;
                        match runs.last_mut() {
                            Some((start, len)) if *start + *len == va => *len += g,
                            _ => runs.push((va, g)),
                        }
                        index += 1;
                    }
                    runs
                }
                _ => vec![(region.base, region.size)],
            };
            for (start, len) in runs {
                let end = start + len;
                let mut blocks = Vec::new();
                let first_live = live.partition_point(|&(p, _)| p < start);
                for &(p, b) in live[first_live..].iter().take_while(|&&(p, _)| p < end) {
                    let state = if b.allocated {
                        BlockState::ActiveAllocated
                    } else {
                        BlockState::ActivePendingFree
                    };
                    blocks.push(BlockSnapshot {
                        address: p,
                        size: self.span(b.span).size,
                        requested_size: b.requested,
                        state,
                    });
                }
                // Free ranges overlapping the run, clipped to it.
                let first_free = free.partition_point(|&(p, size)| p + size <= start);
                for &(p, free_size) in free[first_free..].iter().take_while(|&&(p, _)| p < end) {
                    let lo = p.max(start);
                    let hi = (p + free_size).min(end);
                    if lo < hi {
                        blocks.push(BlockSnapshot {
                            address: lo,
                            size: hi - lo,
                            requested_size: 0,
                            state: BlockState::Inactive,
                        });
                    }
                }
                blocks.sort_by_key(|b| b.address);
                segments.push(SegmentSnapshot {
                    address: start,
                    total_size: len,
                    stream: region.stream,
                    small_pool: false,
                    expandable: !region.segment,
                    blocks,
                });
            }
        }
        segments.sort_by_key(|s| s.address);
        segments
    }

    /// Checks every invariant of DESIGN.md that this policy can see.
    pub(crate) fn check_invariants(&self) -> Result<(), String> {
        // Per region: live and free blocks tile it exactly (so nothing
        // overlaps), free ranges are coalesced, live blocks are mapped.
        let mut by_region: BTreeMap<u32, Vec<(DevicePtr, u64, bool)>> = BTreeMap::new();
        // Spans: each live block's span is a block at its address; each free
        // range in the size index is a free span of its stream, in the
        // large-range index exactly when it is large; links are mutual and
        // contiguous, and every span in use is a block or a free range.
        let mut in_use = 0usize;
        for (&p, b) in &self.live {
            let span = self
                .spans
                .get(b.span as usize)
                .ok_or_else(|| format!("live block {p:#x}: no span {}", b.span))?;
            if span.free || span.start != p {
                return Err(format!("live block {p:#x}: its span disagrees: {span:?}"));
            }
            by_region
                .entry(span.region)
                .or_default()
                .push((p, span.size, true));
            in_use += 1;
        }
        let mut large = 0usize;
        for (slot, index) in self.free_by_size.iter().enumerate() {
            for (size, p, id) in index.iter() {
                let span = self
                    .spans
                    .get(id as usize)
                    .ok_or_else(|| format!("free range {p:#x}: no span {id}"))?;
                if !span.free || span.start != p || span.size != size {
                    return Err(format!(
                        "free range {p:#x}+{size}: its span disagrees: {span:?}"
                    ));
                }
                let region = self
                    .regions
                    .get(span.region as usize)
                    .and_then(|r| r.as_ref())
                    .ok_or_else(|| format!("free range {p:#x} in a dead region"))?;
                if region.size_index != slot {
                    return Err(format!("free range {p:#x} in another stream's index"));
                }
                let is_large = size >= self.large_range_bytes();
                if is_large != (self.large_free.get(&(p + size)) == Some(&id)) {
                    return Err(format!("free range {p:#x}+{size} misfiled as large or not"));
                }
                large += usize::from(is_large);
                by_region
                    .entry(span.region)
                    .or_default()
                    .push((p, size, false));
                in_use += 1;
            }
        }
        if large != self.large_free.len() {
            return Err("the large-range index holds ranges that are not free".into());
        }
        if in_use + self.free_span_ids.len() != self.spans.len() {
            return Err(format!(
                "{} spans, {in_use} in use and {} retired",
                self.spans.len(),
                self.free_span_ids.len()
            ));
        }
        let retired: BTreeSet<u32> = self.free_span_ids.iter().copied().collect();
        for (id, span) in self.spans.iter().enumerate() {
            if retired.contains(&(id as u32)) {
                continue;
            }
            let region = self
                .regions
                .get(span.region as usize)
                .and_then(|r| r.as_ref())
                .ok_or_else(|| format!("span {id} in a dead region"))?;
            let linked = |other: u32, at: DevicePtr, back: bool| {
                let o = &self.spans[other as usize];
                let ok = !retired.contains(&other)
                    && o.region == span.region
                    && if back {
                        o.end() == at && o.next == id as u32
                    } else {
                        o.start == at && o.prev == id as u32
                    };
                ok && !(o.free && span.free)
            };
            let prev_ok = if span.prev == NO_SPAN {
                span.start == region.base
            } else {
                linked(span.prev, span.start, true)
            };
            let next_ok = if span.next == NO_SPAN {
                span.end() == region.base + region.size
            } else {
                linked(span.next, span.end(), false)
            };
            if !prev_ok || !next_ok {
                return Err(format!("span {id} is badly linked: {span:?}"));
            }
        }
        let mut segment_bytes = 0u64;
        let granule_bytes = self.granule.unwrap_or(0);
        // Per handle: its mapped and spare pieces, which must tile it.
        // Every view of every physical granule, from the chunks.
        let mut views: BTreeMap<PhysicalGranule, Vec<View>> = BTreeMap::new();
        for (i, region) in self.regions.iter().enumerate() {
            let Some(region) = region else { continue };
            let mut blocks = by_region.remove(&(i as u32)).unwrap_or_default();
            blocks.sort_unstable();
            let mut cursor = region.base;
            let mut previous_free = false;
            for &(p, size, is_live) in &blocks {
                if p != cursor {
                    return Err(format!(
                        "region {:#x}: block at {p:#x}, expected {cursor:#x} (overlap or hole)",
                        region.base
                    ));
                }
                if !is_live && previous_free {
                    return Err(format!("free ranges at {p:#x} not coalesced"));
                }
                if is_live {
                    if let Some(g) = self.granule.filter(|_| !region.segment) {
                        let (first, end) = granules_under(g, region.base, p, size);
                        if !region.all_mapped(first, end) {
                            return Err(format!("live block {p:#x} lies over unmapped memory"));
                        }
                    }
                }
                previous_free = !is_live;
                cursor = p + size;
            }
            if cursor != region.base + region.size {
                return Err(format!("region {:#x} is not fully tiled", region.base));
            }
            if region.segment {
                segment_bytes += region.size;
            } else {
                let mut next_free_granule = 0;
                let mut counted = 0;
                for (&start, chunk) in &region.chunks {
                    let count = chunk.count;
                    for k in 0..count {
                        views
                            .entry((chunk.handle, chunk.offset + k * granule_bytes))
                            .or_default()
                            .push((i as u32, start + k));
                    }
                    if start < next_free_granule || start + count > region.granules {
                        return Err(format!("region {:#x}: chunks overlap", region.base));
                    }
                    if !region.all_mapped(start, start + count) {
                        return Err(format!(
                            "region {:#x}: chunk not in the bitmap",
                            region.base
                        ));
                    }
                    next_free_granule = start + count;
                    counted += count;
                }
                let bits = region.mapped.count_ones();
                if counted != bits {
                    return Err(format!(
                        "region {:#x}: mapped bitmap disagrees",
                        region.base
                    ));
                }
            }
        }
        if !by_region.is_empty() {
            return Err("blocks in regions that do not exist".into());
        }
        let granule = self.granule.unwrap_or(0);
        // Each granule of each handle is mapped (at one or more views) or
        // spare, never both; granules with several views are exactly the
        // aliases.
        let mut spare_granules: BTreeSet<PhysicalGranule> = BTreeSet::new();
        for p in &self.spare {
            if p.bytes == 0 || p.bytes % granule.max(1) != 0 {
                return Err(format!(
                    "spare piece of handle {} is not whole granules",
                    p.handle.0
                ));
            }
            for k in 0..p.bytes / granule {
                if !spare_granules.insert((p.handle, p.offset + k * granule)) {
                    return Err(format!("spare pieces of handle {} overlap", p.handle.0));
                }
            }
        }
        let mut handle_bytes = 0u64;
        for (handle, info) in &self.handles {
            let mut mapped = 0;
            let mut offset = 0;
            while offset < info.bytes {
                let key = (*handle, offset);
                let seen = views.get(&key).map_or(0, |v| v.len() as u64);
                if (seen > 0) == spare_granules.contains(&key) {
                    return Err(format!(
                        "handle {}: granule at {offset} is {}",
                        handle.0,
                        if seen > 0 {
                            "both mapped and spare"
                        } else {
                            "neither mapped nor spare"
                        }
                    ));
                }
                mapped += seen * granule;
                offset += granule.max(1);
            }
            if mapped != info.mapped {
                return Err(format!("handle {}: mapped bytes disagree", handle.0));
            }
            handle_bytes += info.bytes;
        }
        if views
            .keys()
            .chain(&spare_granules)
            .any(|(h, _)| !self.handles.contains_key(h))
        {
            return Err("a mapping or spare piece of an unknown handle".into());
        }
        // Groups: each physical granule mapped more than once lies in exactly
        // one group, mapped at exactly its views.
        let mut grouped: BTreeSet<PhysicalGranule> = BTreeSet::new();
        let mut aliased_bits = 0u64;
        for (id, group) in self.groups.iter().enumerate() {
            let Some(group) = group else { continue };
            if group.views.len() < 2 || group.views.len() > MAX_VIEWS {
                return Err(format!("alias group {id} has {} views", group.views.len()));
            }
            if !group.views.contains(&group.user) {
                return Err(format!(
                    "alias group {id}: its user is not one of its views"
                ));
            }
            for k in 0..group.count {
                let key = (group.handle, group.offset + k * granule);
                if !grouped.insert(key) {
                    return Err(format!("granule {key:?} lies in two alias groups"));
                }
                let mut expected: Vec<View> =
                    group.views.iter().map(|&(r, s)| (r, s + k)).collect();
                expected.sort_unstable();
                if views.get(&key) != Some(&expected) {
                    return Err(format!(
                        "alias group {id}: granule {key:?} is mapped at {:?}, not {expected:?}",
                        views.get(&key)
                    ));
                }
            }
            for &(r, s) in &group.views {
                let region = self.region(r);
                if region.group_views.get(&s) != Some(&(id as u32))
                    || !region.aliased.all(s, s + group.count)
                {
                    return Err(format!(
                        "alias group {id}: view {s} of region {r} not indexed"
                    ));
                }
                aliased_bits += group.count;
            }
        }
        if let Some((key, at)) = views
            .iter()
            .find(|(k, at)| at.len() > 1 && !grouped.contains(k))
        {
            return Err(format!(
                "granule {key:?} is mapped at {at:?} outside any alias group"
            ));
        }
        let mut lent_bits = 0u64;
        for group in self.groups.iter().flatten() {
            for &(r, s) in &group.views {
                let lent = group.blocks > 0 && (r, s) != group.user;
                let bits = &self.region(r).lent;
                if (lent && !bits.all(s, s + group.count))
                    || (!lent && bits.any(s, s + group.count))
                {
                    return Err(format!("region {r}: lent bits of view {s} are wrong"));
                }
                if lent {
                    lent_bits += group.count;
                }
            }
        }
        let per_region =
            |count: fn(&Region) -> u64| -> u64 { self.regions.iter().flatten().map(count).sum() };
        if per_region(|r| r.lent.count_ones()) != lent_bits {
            return Err("lent bits outside busy alias groups".into());
        }
        let indexed_views = per_region(|r| r.group_views.len() as u64);
        let group_views: u64 = self
            .groups
            .iter()
            .flatten()
            .map(|g| g.views.len() as u64)
            .sum();
        if per_region(|r| r.aliased.count_ones()) != aliased_bits || indexed_views != group_views {
            return Err("aliased bits or view index disagree with the alias groups".into());
        }
        // Each group counts the live blocks on its user view, and no group is
        // used through two views. Blocks are matched to views granule by
        // granule here, apart from the hot path's view index.
        let mut users: BTreeMap<u32, (View, u32)> = BTreeMap::new();
        for (&ptr, block) in &self.live {
            let Span {
                size,
                region: region_index,
                ..
            } = *self.span(block.span);
            let region = self.region(region_index);
            if region.segment {
                continue;
            }
            let (first, end) = granules_under(granule, region.base, ptr, size);
            let mut seen: BTreeSet<u32> = BTreeSet::new();
            for (&s, &id) in &region.group_views {
                let count = self.group(id).count;
                if s < end && s + count > first && seen.insert(id) {
                    let entry = users.entry(id).or_insert(((region_index, s), 0));
                    if entry.0 != (region_index, s) {
                        return Err(format!("alias group {id} is used through two views"));
                    }
                    entry.1 += 1;
                } else if s < end && s + count > first {
                    return Err(format!("block {ptr:#x} lies on two views of group {id}"));
                }
            }
        }
        for (id, group) in self.groups.iter().enumerate() {
            let Some(group) = group else { continue };
            let used = users.get(&(id as u32));
            let count = used.map_or(0, |u| u.1);
            if count != group.blocks || used.is_some_and(|u| u.0 != group.user) {
                return Err(format!(
                    "alias group {id}: counts {} blocks on its user, found {count}",
                    group.blocks
                ));
            }
        }
        let spare = spare_granules.len() as u64 * granule;
        if handle_bytes != (views.len() as u64) * granule + spare {
            return Err("handles held disagree with mapped and spare memory".into());
        }
        let held = handle_bytes + segment_bytes;
        if held != self.held_bytes {
            return Err(format!(
                "reserved {} != mapped granules + spare handles + segments {held}",
                self.held_bytes
            ));
        }
        if self.stats.reserved_bytes[0].current as u64 != held {
            return Err("reserved_bytes stat disagrees with the mapped memory".into());
        }
        let allocated: u64 = self
            .live
            .values()
            .filter(|b| b.allocated)
            .map(|b| self.span(b.span).size)
            .sum();
        if self.stats.allocated_bytes[0].current as u64 != allocated {
            return Err(format!(
                "allocated_bytes stat {} != sum of live blocks {allocated}",
                self.stats.allocated_bytes[0].current
            ));
        }
        let active: u64 = self.live.values().map(|b| self.span(b.span).size).sum();
        if self.stats.active_bytes[0].current as u64 != active {
            return Err("active_bytes stat disagrees with the live blocks".into());
        }
        // No check of `held` against the memory fraction: a fraction lowered
        // below what is held frees nothing by itself (as in PyTorch), it only
        // refuses new memory.
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_parses_and_round_trips() {
        let c = HbmConfig::parse("max_waste_percent:5, per_process_memory_fraction:0.5").unwrap();
        assert_eq!(c.max_waste_percent, 5.0);
        assert_eq!(c.per_process_memory_fraction, 0.5);
        assert_eq!(HbmConfig::parse(&c.to_conf_string()).unwrap(), c);
        assert_eq!(HbmConfig::parse("").unwrap(), HbmConfig::default());
        assert_eq!(HbmConfig::default().to_conf_string(), "");
    }

    #[test]
    fn config_rejects_bad_input() {
        for bad in [
            "max_waste_percent:-1",
            "max_waste_percent:NaN",
            "max_waste_percent:x",
            "per_process_memory_fraction:0",
            "per_process_memory_fraction:1.5",
            "expandable_segments:True",
            "max_waste_percent",
        ] {
            let e = HbmConfig::parse(bad).unwrap_err();
            assert!(!e.expected.is_empty(), "{bad}");
        }
        let e = HbmConfig::parse("bogus:1").unwrap_err();
        assert_eq!(e.key, "bogus");
        assert!(e.expected.contains("max_waste_percent"));
    }

    #[test]
    fn granules_under_matches_division() {
        let granule = 2 * MIB;
        for (offset, size) in [
            (0, 1),
            (0, granule),
            (1, granule),
            (granule - 1, 2),
            (5 * granule, 3 * granule + 7),
        ] {
            let (first, end) = granules_under(granule, 1 << 40, (1 << 40) + offset, size);
            assert_eq!(first, offset / granule, "first granule of {offset}+{size}");
            assert_eq!(
                end,
                (offset + size).div_ceil(granule),
                "end granule of {offset}+{size}"
            );
        }
        // Granules are found by shifting: a device whose granularity is not a
        // power of two gets plain segments.
        let policy = |granule| {
            HbmPolicy::new(
                HbmConfig::default(),
                1 << 30,
                Some(granule),
                History::with_capacity(0),
            )
        };
        assert_eq!(policy(3 * MIB).granule, None);
        assert_eq!(policy(2 * MIB).granule, Some(2 * MIB));
    }

    #[test]
    fn next_unlent_skips_unmapped_and_lent_granules() {
        let mut region = Region::new(0, 200 * 2 * MIB, StreamId(0), 0, 200);
        region.mapped.set(10, 150, true);
        region.lent.set(10, 70, true);
        region.lent.set(100, 1, true);
        assert_eq!(region.next_unlent(0, 200), 80);
        assert_eq!(region.next_unlent(99, 200), 99);
        assert_eq!(region.next_unlent(100, 200), 101);
        assert_eq!(region.next_unlent(0, 50), 50);
        assert_eq!(region.next_unlent(160, 200), 200);
    }

    #[test]
    fn bitmap_queries() {
        let mut r = Bitmap(vec![0; 4]);
        r.set(60, 80, true);
        assert!(r.all(60, 140));
        assert!(r.all(64, 128));
        assert!(!r.all(59, 140));
        assert!(!r.all(60, 141));
        assert!(r.all(70, 70));
        r.set(100, 1, false);
        assert!(!r.all(64, 128));
        assert!(r.get(99) && !r.get(100));
        assert!(r.any(100, 102) && !r.any(100, 101) && !r.any(0, 60));
        // The bitmap grows on demand; bits past its end are clear.
        r.0.clear();
        assert!(!r.get(150) && !r.all(150, 151) && r.all(150, 150));
        r.set(300, 5, false);
        assert!(r.0.is_empty());
        r.set(130, 5, true);
        assert_eq!(r.0.len(), 3);
        assert_eq!(r.count_ones(), 5);
        assert!(r.all(130, 135) && !r.all(129, 135) && !r.get(199));
        r.set(131, 3, false);
        assert!(r.get(130) && !r.get(131) && !r.get(133) && r.get(134));
        assert_eq!(r.next_with(0, 200, true), 130);
        assert_eq!(r.next_with(130, 200, false), 131);
        assert_eq!(r.next_with(131, 200, true), 134);
        assert_eq!(r.next_with(135, 200, true), 200);
        assert_eq!(r.next_with(0, 100, true), 100);
        assert_eq!(r.next_with(150, 140, false), 150);
        assert_eq!(r.next_with(0, 200, false), 0);
        assert_eq!(r.last_set(0, 200), Some(134));
        assert_eq!(r.last_set(0, 134), Some(130));
        assert_eq!(r.last_set(131, 134), None);
        assert_eq!(r.last_set(0, 130), None);
        assert_eq!(r.last_set(130, 131), Some(130));
        r.set(63, 2, true);
        assert_eq!(r.last_set(0, 64), Some(63));
        assert_eq!(r.last_set(64, 65), Some(64));
        assert_eq!(r.last_set(0, 1 << 20), Some(134));
    }
}

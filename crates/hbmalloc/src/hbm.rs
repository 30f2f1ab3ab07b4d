//! Policy `hbm`: hbmalloc's own policy. Reserved memory tracks live memory,
//! and a repeating workload makes no driver calls once warm.
//!
//! Each stream places blocks by address-ordered best fit in a large virtual
//! reservation of its own; physical memory is created in granules, mapped
//! under the blocks that need it, and kept mapped under free ranges as the
//! cache. Past `max_waste_percent` over peak demand, idle granules are
//! mapped a second time where they are needed (stitched, [`AliasGroup`](groups::AliasGroup))
//! instead of new memory created, so a step that needs memory in one place
//! early and another later finds both mapped next time round. A miss takes
//! a wholly mapped free place before it maps memory at best fit
//! ([`DEFAULT_MAPPED_FIT`]): stitched views stay mapped after their blocks
//! are freed and serve later requests that fit, as GMLake's stitched blocks
//! do, so a step shorter than one seen before maps nothing. The design,
//! the order a miss gets memory in, and the measurements behind each rule
//! are in `docs/hbm-design.md`.
//!
//! [`HbmPolicy`] composes its state by concern, each part a struct with
//! private fields in its own file: [`Spans`](spans::Spans) (blocks and free
//! ranges, and their best-fit indexes, `size_index.rs`),
//! [`Physical`](physical::Physical) (handles, spare pieces, memory held),
//! [`AliasGroups`](groups::AliasGroups) (memory mapped twice, and its marks
//! in the regions' bitmaps, `bitmap.rs`) and
//! [`PlacementMemory`](placement::PlacementMemory) (the allocation clock,
//! lifetimes, recent frees, peak demand). The policy keeps the regions, the
//! live blocks and what several parts share, and coordinates: this file
//! holds the entry points (malloc and placement, free and stream events,
//! giving memory back, out of memory, restoring a recorded state),
//! `backing.rs` maps physical memory under a placed block, `alias.rs`
//! places blocks on alias groups and makes groups of idle memory, and
//! `inspect.rs` takes the snapshot and checks the invariants.

use std::collections::hash_map::Entry;
use std::collections::BTreeMap;
use std::ops::ControlFlow;

use crate::config::{conf_number, parse_real, ConfigError, MIN_BLOCK_SIZE};
use crate::device::{Device, DevicePtr, PhysicalHandle, StreamId};
use crate::error::{AllocError, OomReport, OomVerdict};
use crate::events::{PendingEvents, Poll};
use crate::fastmap::FastMap;
use crate::history::{Action, History};
use crate::policy::PolicyState;
use crate::snapshot::{largest_free_block, SegmentImage};
use crate::stats::{decrease_pool, increase_pool, DeviceStats, StatArray};

mod alias;
mod backing;
mod bitmap;
mod groups;
mod inspect;
mod physical;
mod pinned;
mod placement;
mod size_index;
mod spans;

use bitmap::{Bitmap, GranuleMap};
use groups::AliasGroups;
use physical::Physical;
use placement::PlacementMemory;
use spans::{Span, Spans, NO_SPAN};

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
/// even past the allowance: a growing heap is where the driver calls are.
const GROWTH_CHUNK_BYTES: u64 = 12 * MIB;
/// ... but no more than this many times `max_waste_percent` of peak demand,
/// so that a small heap's overshoot stays small (and `max_waste_percent:0`
/// maps nothing ahead).
const GROWTH_CHUNK_WASTE_FACTOR: f64 = 4.0;
/// Near the peak, a likely temporary at the top of a heap that maps whole
/// growth chunks ahead goes at the end of the memory mapped ahead when that
/// holds at least this many blocks of its size: the front stays whole for
/// the longer-lived block that follows. In a smaller room, or in the few
/// granules a small heap maps ahead, it would split the place the next
/// block needs.
const TOP_TEMPORARY_ROOM_FACTOR: u64 = 4;
/// Below the peak of demand, a run is backed by idle memory before a new
/// handle that would take the memory held past its peak, when at least this
/// many times the run's granules lie idle: stitching then leaves at least as
/// much idle as it takes, for the program's next requests.
const STITCH_BEFORE_PEAK_FACTOR: u64 = 2;
/// Most addresses one physical granule is mapped at: each alias costs a map
/// call once and a page-table entry for good, so a granule that has moved
/// this often is moved (unmapped) rather than mapped once more.
/// Configurable (`max_views`), so that tests can reach the cap. The most
/// allowed by default: on a driver that maps whole handles only, a lower cap
/// moves idle memory instead of aliasing it, and a long run drifts.
const DEFAULT_MAX_VIEWS: usize = 64;
/// The `max_views` a configuration may set: a group is two views at least.
const MAX_VIEWS_RANGE: std::ops::RangeInclusive<u64> = 2..=64;
/// On a device that maps whole handles only, and unless
/// `whole_handle_granules` fixes it, a new handle holds the most memory held
/// so far divided by this, in whole granules (at least
/// [`WHOLE_HANDLE_MIN_GRANULES`], at most 512): there only whole handles
/// move, and a heap's targets are relative to its size, so a large heap can
/// take larger handles for the same share of waste.
const WHOLE_HANDLE_HEAP_DIVISOR: u64 = 2048;
/// ... and at least this many: each handle costs a create and a map, and
/// with kept mappings reused first ([`DEFAULT_MAPPED_FIT`]) memory seldom
/// moves, so handles about the size of expandable segments' (20 MiB) cost
/// little memory. A run shorter than this gets a handle of its own length.
const WHOLE_HANDLE_MIN_GRANULES: u64 = 16;
/// ... and unless `whole_handle_granules` fixes the size, a run shorter
/// than this many handles of that size takes one handle of its own length:
/// cut into a full handle and a shorter one it would cost a create and a
/// map more for the same memory, and it is one block's memory, freed and
/// moved whole as that block is.
const WHOLE_HANDLE_SPLIT_FACTOR: u64 = 2;
/// ... and a run longer than this many handles of that size is cut into
/// this many equal ones instead: the size bounds the waste of small blocks,
/// and a run this long is one huge block's memory, freed and moved whole as
/// that block is, so smaller handles would only multiply the calls (and
/// the bookkeeping, without bound for an absurd request).
const MAX_HANDLES_PER_RUN: u64 = 256;
/// The `whole_handle_granules` a configuration may set.
const WHOLE_HANDLE_GRANULES_RANGE: std::ops::RangeInclusive<u64> = 1..=512;
/// On a miss, free ranges a request looks at in best-fit order for a place
/// whose granules are all mapped (and not in use at another view), before
/// best fit maps memory: a kept mapping (a stitched view, a chunk) serves a
/// request that fits, as GMLake hands out its stitched blocks, so a step
/// like an earlier one maps nothing. Configurable (`mapped_fit`, 0: off).
const DEFAULT_MAPPED_FIT: usize = 64;
/// The `mapped_fit` a configuration may set.
const MAPPED_FIT_RANGE: std::ops::RangeInclusive<u64> = 0..=4096;
/// Free ranges a request looks at, in best-fit order, for one whose aliased
/// granules are not in use elsewhere; if all are blocked, the block slides
/// past the memory in use within them, then tries the stream's largest free
/// range, and only then opens a new region.
const MAX_CANDIDATES: usize = 32;

/// Configuration of policy `hbm`, in the `key:value,key:value` syntax.
///
/// | key | default | meaning |
/// |---|---|---|
/// | `max_waste_percent` | 1 | physical memory held may exceed the peak demand (live plus pending-free bytes) by this percentage before idle memory is stitched (mapped a second time) instead of new memory created; a heap growing to a new peak may map up to 4 times this (at most 12 MiB) ahead, holding at most 5 times this over peak demand in all. Lower: tighter memory, more map calls when the workload shifts or grows (0: nothing mapped ahead); higher: fewer driver calls. |
/// | `per_process_memory_fraction` | 1 | hard limit on memory held, as a fraction of device memory (as in PyTorch). |
/// | `max_views` | 64 | most addresses one physical granule is mapped at (2 to 64): past it, idle memory is moved (unmapped, mapped elsewhere) instead of mapped once more. Each view is a page-table entry; lower: more map and unmap calls where memory moves around. |
/// | `whole_handle_granules` | auto | on a driver that maps whole handles only ([`Device::maps_handle_parts`] false), the most granules one physical handle holds (1 to 512), or `auto`: 1/2048 of the most memory held so far, rounded down to whole granules, at least 16 (32 MiB; up to 64 GiB held). A run shorter than the size (under `auto`, than twice the size) gets one handle of its own length. A run longer than 256 handles gets 256 equal ones. Only whole handles move there; higher: fewer create and map calls, more memory held (the one setting that trades memory for driver calls, `docs/real-driver.md`). Ignored where the driver maps parts of handles. |
/// | `mapped_fit` | 64 | on a miss (best fit lands on unmapped memory), how many free ranges, in best-fit order, are searched for a place whose granules are all mapped and not in use at another view, taken before best fit maps memory (0: best fit alone). |
#[derive(Clone, Debug, PartialEq)]
pub struct HbmConfig {
    /// Allowance of held memory over peak demand, in percent, before granules are stolen.
    pub max_waste_percent: f64,
    /// Hard limit on memory held, as a fraction of device memory.
    pub per_process_memory_fraction: f64,
    /// Most addresses one physical granule is mapped at.
    pub max_views: usize,
    /// Most granules in one handle on a driver that maps whole handles
    /// only; `None` (`auto`): a share of the most memory held so far.
    pub whole_handle_granules: Option<u64>,
    /// Free ranges a miss looks at for a wholly mapped place before best
    /// fit maps memory (0: none).
    pub mapped_fit: usize,
}

impl Default for HbmConfig {
    fn default() -> Self {
        HbmConfig {
            max_waste_percent: DEFAULT_MAX_WASTE_PERCENT,
            per_process_memory_fraction: 1.0,
            max_views: DEFAULT_MAX_VIEWS,
            whole_handle_granules: None,
            mapped_fit: DEFAULT_MAPPED_FIT,
        }
    }
}

impl HbmConfig {
    /// The statistics of an allocator that has not allocated: zeros (no
    /// `max_split_size`: -1).
    pub fn initial_stats(&self) -> DeviceStats {
        DeviceStats {
            max_split_size: -1,
            ..Default::default()
        }
    }

    /// Every key this policy accepts.
    pub const KEYS: [&'static str; 5] = [
        "max_waste_percent",
        "per_process_memory_fraction",
        "max_views",
        "whole_handle_granules",
        "mapped_fit",
    ];

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
                parse_real(key, value, expected)
                    .ok()
                    .filter(|v| (low..=high).contains(v))
                    .ok_or_else(|| ConfigError::new(key, value, expected))
            };
            let whole = |range: std::ops::RangeInclusive<u64>| {
                value
                    .parse::<u64>()
                    .ok()
                    .filter(|v| range.contains(v))
                    .ok_or_else(|| {
                        let (low, high) = range.into_inner();
                        ConfigError::new(key, value, format!("a whole number from {low} to {high}"))
                    })
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
                "max_views" => config.max_views = whole(MAX_VIEWS_RANGE)? as usize,
                "mapped_fit" => config.mapped_fit = whole(MAPPED_FIT_RANGE)? as usize,
                "whole_handle_granules" => {
                    config.whole_handle_granules = if value == "auto" {
                        None
                    } else {
                        Some(whole(WHOLE_HANDLE_GRANULES_RANGE).map_err(|e| ConfigError {
                            expected: format!("auto or {}", e.expected),
                            ..e
                        })?)
                    }
                }
                _ => return Err(unknown_key(key)),
            }
        }
        Ok(config)
    }

    /// The settings that differ from the defaults, in the syntax [`HbmConfig::parse`] reads.
    pub fn to_conf_string(&self) -> String {
        let defaults = HbmConfig::default();
        let mut parts = Vec::new();
        if self.max_waste_percent != defaults.max_waste_percent {
            parts.push(format!(
                "max_waste_percent:{}",
                conf_number(self.max_waste_percent)
            ));
        }
        if self.per_process_memory_fraction != defaults.per_process_memory_fraction {
            parts.push(format!(
                "per_process_memory_fraction:{}",
                conf_number(self.per_process_memory_fraction)
            ));
        }
        if self.max_views != defaults.max_views {
            parts.push(format!("max_views:{}", self.max_views));
        }
        if let Some(granules) = self.whole_handle_granules {
            parts.push(format!("whole_handle_granules:{granules}"));
        }
        if self.mapped_fit != defaults.mapped_fit {
            parts.push(format!("mapped_fit:{}", self.mapped_fit));
        }
        parts.join(",")
    }
}

/// The error for a key policy hbm does not take: the key is the culprit, and
/// a key of policy pytorch says so.
fn unknown_key(key: &str) -> ConfigError {
    let error = ConfigError::new(
        key,
        key,
        format!("a policy hbm key ({})", HbmConfig::KEYS.join(", ")),
    );
    if crate::config::KNOWN_KEYS.contains(&key) {
        error.with_hint("a policy pytorch key, which policy hbm does not take")
    } else {
        error
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
    /// It lies on aliased memory: placed there, or its handle was mapped
    /// again since (`pinned_place`, which claims its groups for it). Other
    /// aliases are made of whole free granules, mapped at unmapped ones,
    /// so a block on plain memory frees without looking at the groups.
    on_aliased: bool,
    /// The number of allocations made before this one (its birth, for
    /// the lifetimes placement keeps).
    born: u64,
}

/// A virtual reservation owned by one stream, or (without a virtual-memory
/// API) a plain segment.
#[derive(Debug)]
struct Region {
    base: DevicePtr,
    size: u64,
    stream: StreamId,
    /// The stream's size-index slot in [`Spans`].
    size_index: usize,
    /// A plain segment: always fully backed, no granules.
    segment: bool,
    /// Granules in the region.
    granules: u64,
    /// Mapped chunks by first granule. Each chunk is one mapping (one
    /// `map` call) of a sub-range of one physical handle; a run of granules
    /// may be stitched together from several chunks.
    chunks: BTreeMap<u64, Chunk>,
    /// The first granule of each chunk, kept with `chunks`: a run of mapped
    /// granules lies in one chunk when no chunk starts inside it: one bitmap
    /// test where idle alias groups may merge, instead of a search of
    /// `chunks` on a path hot enough to show in instruction counts.
    chunk_starts: Bitmap,
    /// Mapped granules. Lets the hot path test a whole block's granules 64
    /// at a time.
    mapped: Bitmap,
    /// Granules whose physical memory is mapped at another address too (a
    /// stitched alias, see [`AliasGroup`](groups::AliasGroup)): a block
    /// placed over them must first check that no live block uses that
    /// memory elsewhere.
    aliased: Bitmap,
    /// The alias group whose view covers each aliased granule.
    group_at: GranuleMap,
    /// Aliased granules whose group is in use at another view: no block may
    /// be placed on them (one bitmap test instead of a walk of the groups).
    lent: Bitmap,
}

/// Live region `index` of `regions`.
#[inline]
fn region_at(regions: &[Option<Region>], index: u32) -> &Region {
    regions[index as usize].as_ref().expect("a live region")
}

#[inline]
fn region_at_mut(regions: &mut [Option<Region>], index: u32) -> &mut Region {
    regions[index as usize].as_mut().expect("a live region")
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
            chunk_starts: Bitmap::default(),
            mapped: Bitmap::default(),
            aliased: Bitmap::default(),
            group_at: GranuleMap::default(),
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

    /// True when every granule in `[first, end)` is mapped and none is
    /// aliased: a block there needs no backing and may lie there whatever
    /// other views do.
    fn plain(&self, first: u64, end: u64) -> bool {
        self.segment || self.mapped.all_and_none_in(&self.aliased, first, end)
    }

    /// The chunks overlapping granules `[first, end)`, highest first, as
    /// (first granule, chunk).
    fn chunks_in(&self, first: u64, end: u64) -> impl Iterator<Item = (u64, Chunk)> + '_ {
        self.chunks
            .range(..end)
            .rev()
            .take_while(move |(&start, chunk)| start + chunk.count > first)
            .map(|(&start, &chunk)| (start, chunk))
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

/// What lies under the place chosen for a block.
#[derive(Copy, Clone, Debug)]
enum Place {
    /// Mapped memory, at best fit: nothing to back.
    Mapped,
    /// Mapped memory where a block of the same size was just freed: the
    /// block goes exactly there (see [`placement::RECENT_FREE_ALLOCATIONS`]).
    RecentlyFreed,
    /// A wholly mapped place in a free range best fit passed over (see
    /// [`DEFAULT_MAPPED_FIT`]): the block goes exactly there.
    MappedFit,
    /// Idle memory of handles live blocks pin, just mapped there again
    /// (`pinned_place`): the block goes exactly there.
    Pinned,
    /// Best fit, with granules to back (`back_range`).
    Unmapped,
}

/// Why a range could not be backed.
enum Backing {
    /// Backed: every granule under it is mapped.
    Done,
    /// The device (or the memory limit) has no memory for it.
    OutOfMemory,
}

/// The `hbm` policy's state for one device: the parts it composes, and
/// what they share (regions, live blocks, events, statistics).
#[derive(Debug)]
pub(crate) struct HbmPolicy {
    config: HbmConfig,
    /// `None`: no virtual-memory API, regions are segments.
    granule: Option<u64>,
    /// Regions by index (`None`: given back). Their bitmaps are read by
    /// placement and written by backing and the alias groups.
    regions: Vec<Option<Region>>,
    /// Allocated and pending-free blocks by address.
    live: FastMap<DevicePtr, LiveBlock>,
    /// Blocks and free ranges, and the free-range indexes.
    spans: Spans,
    /// Physical memory held.
    physical: Physical,
    /// Memory mapped at more than one address.
    groups: AliasGroups,
    /// What placement remembers of the program.
    placement: PlacementMemory,
    /// End-of-use events of freed blocks other streams used.
    events: PendingEvents<DevicePtr>,
    /// Statistics, history, device size, memory fraction (a hard limit on
    /// memory held), capture flag.
    state: PolicyState,
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
        maps_handle_parts: bool,
        history: History,
    ) -> Self {
        // CUDA's granularity is a power of two (2 MiB): the hot path finds a
        // block's granules by shifting, not dividing.
        let granule = granule.filter(|&g| g.is_power_of_two() && g >= MIN_BLOCK_SIZE);
        HbmPolicy {
            granule,
            regions: Vec::new(),
            live: FastMap::default(),
            spans: Spans::new(granule.unwrap_or(u64::MAX)),
            physical: Physical::new(maps_handle_parts),
            groups: AliasGroups::default(),
            placement: PlacementMemory::new(granule.unwrap_or(SEGMENT_ROUND)),
            events: PendingEvents::default(),
            state: PolicyState::new(
                config.initial_stats(),
                history,
                device_total,
                config.per_process_memory_fraction,
            ),
            config,
        }
    }

    #[inline]
    fn region(&self, index: u32) -> &Region {
        region_at(&self.regions, index)
    }

    #[inline]
    fn region_mut(&mut self, index: u32) -> &mut Region {
        region_at_mut(&mut self.regions, index)
    }

    /// `bytes` more are held (a plain segment).
    fn add_held(&mut self, bytes: u64) {
        self.physical.add_held(bytes);
        self.count_reserved(bytes);
    }

    /// `bytes` fewer are held (a plain segment).
    fn sub_held(&mut self, bytes: u64) {
        self.physical.sub_held(bytes);
        self.count_unreserved(bytes);
    }

    fn count_reserved(&mut self, bytes: u64) {
        increase(&mut self.state.stats.reserved_bytes, u64::MAX, bytes);
    }

    fn count_unreserved(&mut self, bytes: u64) {
        decrease(&mut self.state.stats.reserved_bytes, u64::MAX, bytes);
    }

    /// The size-index slot of span `id`'s stream.
    #[inline]
    fn slot_of(&self, id: u32) -> usize {
        self.region(self.spans.get(id).region).size_index
    }

    /// Block span `id` becomes free, merged with its free neighbours;
    /// returns the free span it is now part of.
    #[inline]
    fn release_span(&mut self, id: u32) -> u32 {
        let slot = self.slot_of(id);
        self.spans.release(id, slot)
    }

    /// Cuts a block of `size` bytes at `ptr` out of free span `id`; returns
    /// the block's span.
    #[inline]
    fn take_span(&mut self, id: u32, ptr: DevicePtr, size: u64) -> u32 {
        let slot = self.slot_of(id);
        self.spans.take(id, slot, ptr, size)
    }

    /// The granules `[first, end)` of its region lying wholly inside span
    /// `id` (none, `first >= end`, for a span smaller than a granule).
    fn whole_granules(&self, granule: u64, id: u32) -> (u64, u64) {
        let span = self.spans.get(id);
        let base = self.region(span.region).base;
        (
            (span.start - base).div_ceil(granule),
            (span.end() - base) / granule,
        )
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

    /// Counts a request of `size` bytes as demand (live and pending-free
    /// bytes with it); returns whether demand is near its peak.
    #[inline]
    fn count_demand(&mut self, size: u64) -> bool {
        let demand = self.state.stats.active_bytes[0].current as u64 + size;
        self.placement.demand(demand)
    }

    fn allocate(
        &mut self,
        dev: &dyn Device,
        size: u64,
        requested: u64,
        stream: StreamId,
    ) -> Result<DevicePtr, AllocError> {
        if self.physical.missing_access() {
            self.grant_missing_access(dev)?;
        }
        self.process_events(dev)?;
        // No device holds it: fail before mapping the whole device, twice,
        // to find out, and before it counts as demand.
        if self.state.device_total > 0 && size > self.state.device_total {
            return Err(self.out_of_memory(dev, requested, size, stream));
        }
        let near_peak = self.count_demand(size);
        let mut retried = false;
        let (ptr, span, on_aliased) = loop {
            if let Some((range, ptr, place)) = self.choose_place(dev, stream, size, retried)? {
                let region = self.spans.get(range).region;
                let ptr = match place {
                    Place::RecentlyFreed | Place::MappedFit | Place::Pinned => ptr,
                    Place::Mapped | Place::Unmapped => {
                        self.place_short_lived(range, ptr, size, near_peak)
                    }
                };
                let block = self.take_span(range, ptr, size);
                let backing = match place {
                    Place::Mapped | Place::RecentlyFreed | Place::MappedFit | Place::Pinned => {
                        Ok(Backing::Done)
                    }
                    Place::Unmapped => self.back_range(dev, ptr, size, region, retried),
                };
                match backing {
                    Ok(Backing::Done) => match self.claim(dev, region, ptr, size) {
                        Ok(on_aliased) => break (ptr, block, on_aliased),
                        Err(e) => {
                            self.release_span(block);
                            return Err(e);
                        }
                    },
                    Ok(Backing::OutOfMemory) => {
                        self.release_span(block);
                    }
                    Err(e) => {
                        self.release_span(block);
                        return Err(e);
                    }
                }
            }
            if retried {
                // What the two attempts mapped goes back, as PyTorch frees its
                // cache on an out-of-memory: the program's own `cudaMalloc`s
                // (cuDNN's, NCCL's) must find the device as it was.
                if !self.state.capture_underway {
                    self.empty_cache(dev)?;
                }
                return Err(self.out_of_memory(dev, requested, size, stream));
            }
            // Out of memory: let pending frees complete, give back wholly free
            // segments, and try once more, stealing without any allowance.
            retried = true;
            self.state.stats.num_alloc_retries += 1;
            if self.state.capture_underway {
                // Nothing may be waited for or given back: only the retry's
                // larger allowance for new memory.
                continue;
            }
            self.synchronize_and_free_events(dev)?;
            // Every wholly free chunk becomes a spare piece, so memory held
            // in a chunk that straddled the failed block's edge (neither
            // under the block nor wholly in the free range beyond it) can be
            // stitched in too.
            if let Some(granule) = self.granule {
                let victims = self.free_spans(granule, u64::MAX, false);
                self.unmap_spans(dev, granule, &victims)?;
                // Where handles map whole only, a spare of several granules
                // larger than what is missing cannot be cut to fit: give
                // spares back, so that a handle of the right size fits
                // under the limit.
                if !self.physical.maps_handle_parts() && self.whole_handle_granules(granule) > 1 {
                    self.release_spares(dev)?;
                }
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
                born: self.placement.allocated(),
            },
        );
        self.state
            .history
            .record(Action::Alloc, ptr, requested, stream);
        increase(&mut self.state.stats.allocation, size, 1);
        increase(&mut self.state.stats.allocated_bytes, size, size);
        increase(&mut self.state.stats.active, size, 1);
        increase(&mut self.state.stats.active_bytes, size, size);
        increase(&mut self.state.stats.requested_bytes, size, requested);
        Ok(ptr)
    }

    /// The free range and address a block of `size` bytes of `stream` goes
    /// at, and what lies under it; `None` when no range fits and no region
    /// can be made. A hit is mapped already. A miss goes where a block of
    /// this size was just freed, if it can, or at a wholly mapped place best
    /// fit passed over, before best fit maps memory; and before new memory
    /// (not on the out-of-memory retry), at idle memory pinned in handles,
    /// mapped again.
    #[inline]
    fn choose_place(
        &mut self,
        dev: &dyn Device,
        stream: StreamId,
        size: u64,
        retried: bool,
    ) -> Result<Option<(u32, DevicePtr, Place)>, AllocError> {
        // The usual cache hit, settled by one test: best fit lies on mapped
        // granules none of which is aliased.
        if let Some(found) = self.plain_fit(stream, size) {
            debug_assert_eq!(self.find_free(stream, size), Some(found));
            return Ok(Some((found.0, found.1, Place::Mapped)));
        }
        // Best fit is looked up again here: handing the first lookup on cost
        // the plain hit more than the second costs the rest (as measured).
        let chosen = match self.find_free(stream, size) {
            Some((range, ptr)) if self.is_mapped(self.spans.get(range).region, ptr, size) => {
                return Ok(Some((range, ptr, Place::Mapped)));
            }
            best => match (self.recently_freed_place(stream, size), best) {
                (Some((range, ptr)), _) => return Ok(Some((range, ptr, Place::RecentlyFreed))),
                (None, Some((range, ptr))) => match self.mapped_fit(stream, size) {
                    Some((range, ptr)) => return Ok(Some((range, ptr, Place::MappedFit))),
                    None => Some((range, ptr, Place::Unmapped)),
                },
                (None, None) => self
                    .new_region(dev, stream, size)?
                    .map(|(range, ptr)| (range, ptr, Place::Unmapped)),
            },
        };
        if retried {
            return Ok(chosen);
        }
        Ok(match self.pinned_place(dev, stream, size)? {
            Some((range, ptr)) => Some((range, ptr, Place::Pinned)),
            None => chosen,
        })
    }

    /// The best-fit free range of `stream` for `size` bytes, as (free span,
    /// address), when the block would lie on mapped granules none of which
    /// is aliased: what [`HbmPolicy::find_free`] then gives, mapped.
    #[inline]
    fn plain_fit(&self, stream: StreamId, size: u64) -> Option<(u32, DevicePtr)> {
        let (_, ptr, id) = self.spans.index_of(stream)?.first_fit(size)?;
        self.granules_in(self.spans.get(id).region, ptr, size)
            .is_none_or(|(region, first, end)| region.plain(first, end))
            .then_some((id, ptr))
    }

    /// Where a block of `size` bytes goes: the best-fit free range of
    /// `stream` (smallest, then lowest address) whose aliased granules no
    /// live block uses elsewhere; failing that, the first of those ranges
    /// with room past such granules, then the stream's largest free range.
    /// As (free span, block address).
    #[inline]
    fn find_free(&self, stream: StreamId, size: u64) -> Option<(u32, DevicePtr)> {
        let index = self.spans.index_of(stream)?;
        // The best fit is usually free to use: one lookup, no iterator.
        let (_, ptr, id) = index.first_fit(size)?;
        if !self.blocked(self.spans.get(id).region, ptr, size) {
            return Some((id, ptr));
        }
        // On the stack: the hot path does not allocate.
        let mut blocked = [NO_SPAN; MAX_CANDIDATES];
        blocked[0] = id;
        let mut count = 1;
        let mut first = true;
        let unblocked = index.walk_best_fit(size, |_, ptr, id| {
            if std::mem::take(&mut first) {
                return ControlFlow::Continue(()); // tried above
            }
            if !self.blocked(self.spans.get(id).region, ptr, size) {
                return ControlFlow::Break(Some((id, ptr)));
            }
            blocked[count] = id;
            count += 1;
            if count == MAX_CANDIDATES {
                ControlFlow::Break(None)
            } else {
                ControlFlow::Continue(())
            }
        });
        if let Some(Some(found)) = unblocked {
            return Some(found);
        }
        // Every candidate is blocked at its start: slide past the memory in
        // use elsewhere, within the range.
        if let Some(found) = blocked[..count]
            .iter()
            .find_map(|&id| self.slide(id, size, false).map(|at| (id, at)))
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
        if !self.blocked(self.spans.get(id).region, ptr, size) {
            return Some((id, ptr));
        }
        self.slide(id, size, false).map(|at| (id, at))
    }

    /// Where in free span `id` a block of `size` bytes goes, `ptr` being the
    /// front (or past memory in use elsewhere): its end instead when the
    /// block is likely a temporary and demand is `near_peak` (see
    /// [`placement::SHORT_LIVED_NEAR_PEAK_PERCENT`]); at the top of a heap
    /// that maps whole growth chunks ahead, the end of what is mapped
    /// ([`TOP_TEMPORARY_ROOM_FACTOR`]).
    #[inline]
    fn place_short_lived(&self, id: u32, ptr: DevicePtr, size: u64, near_peak: bool) -> DevicePtr {
        if !near_peak || !self.placement.mostly_short(size) {
            return ptr;
        }
        let range = *self.spans.get(id);
        let end = if self.is_mapped(range.region, range.end() - size, size) {
            range.end() - size
        } else if self.maps_whole_chunks_ahead() {
            // The heap's top: everything from `ptr` to `mapped_end` is mapped.
            let mapped_end = self.mapped_end(range.region, ptr, range.end());
            if mapped_end < ptr + TOP_TEMPORARY_ROOM_FACTOR * size {
                return ptr;
            }
            mapped_end - size
        } else {
            return ptr;
        };
        if end > ptr && !self.blocked(range.region, end, size) {
            end
        } else {
            ptr
        }
    }

    /// Where the memory mapped from `ptr` on ends (at most `limit`): the
    /// start of the first unmapped granule (`ptr` or below when its own is
    /// unmapped).
    fn mapped_end(&self, region_index: u32, ptr: DevicePtr, limit: DevicePtr) -> DevicePtr {
        let (Some(granule), Some((region, first, end))) = (
            self.granule,
            self.granules_in(region_index, ptr, limit - ptr),
        ) else {
            return limit;
        };
        (region.base + region.next_with(first, end, false) * granule).min(limit)
    }

    /// Every granule under `[ptr, ptr + size)` of region `region` is mapped
    /// (a segment, with no granules, is mapped whole).
    fn is_mapped(&self, region: u32, ptr: DevicePtr, size: u64) -> bool {
        self.granules_in(region, ptr, size)
            .is_none_or(|(region, first, end)| region.all_mapped(first, end))
    }

    /// The place a block of `size` bytes of `stream` was freed at within
    /// [`placement::RECENT_FREE_ALLOCATIONS`] allocations, as (free span,
    /// address), when it is still free, mapped, and not in use at another
    /// view.
    fn recently_freed_place(&self, stream: StreamId, size: u64) -> Option<(u32, DevicePtr)> {
        let (id, ptr) = self.placement.recent_free(stream, size)?;
        // Retired spans are never free, so a free span is a live one, and
        // free spans do not overlap: one that covers the place holds it.
        let span = self.spans.get(id);
        if !span.free || ptr < span.start || ptr + size > span.end() {
            return None;
        }
        let region = span.region;
        if self.region(region).stream != stream
            || !self.is_mapped(region, ptr, size)
            || self.blocked(region, ptr, size)
        {
            return None;
        }
        Some((id, ptr))
    }

    /// On a miss, the first wholly mapped place for a block of `size` bytes
    /// in the first `mapped_fit` free ranges of `stream` in best-fit order
    /// (see [`DEFAULT_MAPPED_FIT`]), as (free span, address).
    fn mapped_fit(&self, stream: StreamId, size: u64) -> Option<(u32, DevicePtr)> {
        let limit = self.config.mapped_fit;
        if limit == 0 || self.granule.is_none() {
            return None;
        }
        let index = self.spans.index_of(stream)?;
        let mut seen = 0;
        index
            .walk_best_fit(size, |_, _, id| {
                if let Some(at) = self.mapped_place(id, size) {
                    return ControlFlow::Break(Some((id, at)));
                }
                seen += 1;
                if seen == limit {
                    ControlFlow::Break(None)
                } else {
                    ControlFlow::Continue(())
                }
            })
            .flatten()
    }

    /// The lowest place in free span `id` where a block of `size` bytes lies
    /// on mapped granules only and may lie ([`HbmPolicy::busy_end`]).
    fn mapped_place(&self, id: u32, size: u64) -> Option<DevicePtr> {
        let range = self.spans.get(id);
        if self.region(range.region).segment {
            return Some(range.start);
        }
        self.slide(id, size, true)
    }

    /// Slides a block of `size` bytes through free span `id` to the first
    /// place [`HbmPolicy::busy_end`] allows (and, with `mapped_only`, where
    /// every granule under it is mapped): past lent memory with the bitmap
    /// alone, walking the alias groups only where nothing is lent.
    fn slide(&self, id: u32, size: u64, mapped_only: bool) -> Option<DevicePtr> {
        let granule = self.granule?;
        let range = self.spans.get(id);
        let region_index = range.region;
        let region = self.region(region_index);
        let mut at = range.start;
        while at + size <= range.end() {
            let (first, end) = granules_under(granule, region.base, at, size);
            if mapped_only {
                let unmapped = region.next_with(first, end, false);
                if unmapped < end {
                    // Past the unmapped granule, to the next mapped one.
                    let next = region.next_with(unmapped, region.granules, true);
                    at = region.base + next * granule;
                    continue;
                }
            }
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
    /// one free span and its start (where a block goes), or `None` when the
    /// device has no memory for a segment.
    fn new_region(
        &mut self,
        dev: &dyn Device,
        stream: StreamId,
        size: u64,
    ) -> Result<Option<(u32, DevicePtr)>, AllocError> {
        let index = self.regions.len() as u32;
        let size_index = self.spans.slot_for(stream);
        let region = match self.granule {
            Some(granule) => {
                let wanted = (self
                    .state
                    .device_total
                    .saturating_mul(REGION_CAPACITY_FACTOR))
                .max(size);
                // Saturates on an absurd device, whose driver then refuses it.
                let region_size = wanted.div_ceil(granule).saturating_mul(granule);
                let base = dev.address_reserve(region_size)?;
                Region::new(base, region_size, stream, size_index, region_size / granule)
            }
            None => {
                let segment_size = size.div_ceil(SEGMENT_ROUND) * SEGMENT_ROUND;
                if self
                    .state
                    .limit_bytes
                    .is_some_and(|limit| self.physical.held_bytes() + segment_size > limit)
                {
                    return Ok(None);
                }
                let base = match dev.segment_alloc(segment_size) {
                    Ok(base) => base,
                    Err(e) if e.is_out_of_memory() => return Ok(None),
                    Err(e) => return Err(e.into()),
                };
                self.add_held(segment_size);
                self.state.stats.num_device_alloc += 1;
                self.state
                    .history
                    .record(Action::SegmentAlloc, base, segment_size, stream);
                // No granules: a plain segment, always fully backed.
                Region::new(base, segment_size, stream, size_index, 0)
            }
        };
        let (base, region_size) = (region.base, region.size);
        self.regions.push(Some(region));
        increase(&mut self.state.stats.segment, u64::MAX, 1);
        let span = self.spans.add_free(
            Span {
                start: base,
                size: region_size,
                region: index,
                prev: NO_SPAN,
                next: NO_SPAN,
                free: true,
            },
            size_index,
        );
        Ok(Some((span, base)))
    }

    // ----- free -----

    pub(crate) fn live_size(&self, ptr: DevicePtr) -> Option<u64> {
        let block = self.live.get(&ptr).filter(|b| b.allocated)?;
        Some(self.spans.get(block.span).size)
    }

    pub(crate) fn free(&mut self, dev: &dyn Device, ptr: DevicePtr) -> Result<(), AllocError> {
        // One lookup: a block no other stream used leaves the map at once.
        let Entry::Occupied(mut entry) = self.live.entry(ptr) else {
            return Err(AllocError::UnknownPointer { ptr });
        };
        let block = entry.get_mut();
        if !block.allocated {
            return Err(AllocError::UnknownPointer { ptr });
        }
        block.allocated = false;
        let (requested, stream, span) = (block.requested, block.stream, block.span);
        let uses_pending = !block.stream_uses.is_empty();
        let done = (!uses_pending).then(|| entry.remove());
        let size = self.spans.get(span).size;
        decrease(&mut self.state.stats.allocation, size, 1);
        decrease(&mut self.state.stats.allocated_bytes, size, size);
        self.state
            .history
            .record(Action::FreeRequested, ptr, requested, stream);
        if let Some(block) = done {
            self.release_block(ptr, block);
            Ok(())
        } else if self.state.capture_underway {
            self.events.defer(ptr);
            Ok(())
        } else {
            self.insert_events(dev, ptr)
        }
    }

    /// The block's last use is over: its range joins the free set.
    fn free_completed(&mut self, ptr: DevicePtr) {
        let block = self.live.remove(&ptr).expect("a live block");
        self.release_block(ptr, block);
    }

    /// Block `block` at `ptr`, out of the live map, joins the free set.
    fn release_block(&mut self, ptr: DevicePtr, block: LiveBlock) {
        let Span { size, region, .. } = *self.spans.get(block.span);
        decrease(&mut self.state.stats.active, size, 1);
        decrease(&mut self.state.stats.active_bytes, size, size);
        decrease(&mut self.state.stats.requested_bytes, size, block.requested);
        self.state
            .history
            .record(Action::FreeCompleted, ptr, block.requested, block.stream);
        let free = self.release_span(block.span);
        if block.on_aliased {
            self.unclaim(region, ptr, size, free);
        } else {
            debug_assert!(self.aliased_span(region, ptr, size).is_none());
        }
        self.placement
            .freed(block.stream, size, ptr, free, block.born);
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
        let (recorded, result) = self.events.record(dev, ptr, &streams);
        let block = self.live.get_mut(&ptr).expect("a live block");
        block.pending_events += recorded;
        // Uses no event covers stay: the block is not reused until a device
        // synchronization (OOM retry, empty_cache).
        result.map_err(|(uncovered, e)| {
            block.stream_uses = uncovered;
            e.into()
        })
    }

    fn event_completed(&mut self, ptr: DevicePtr) {
        let block = self.live.get_mut(&ptr).expect("a pending block");
        block.pending_events -= 1;
        if block.pending_events == 0 && block.stream_uses.is_empty() {
            self.free_completed(ptr);
        }
    }

    /// A capture began (`true`) or the last one ended: see [`crate::capture`].
    /// At the end, the events of the blocks freed during it are recorded.
    pub(crate) fn set_capture_underway(
        &mut self,
        dev: &dyn Device,
        underway: bool,
    ) -> Result<(), AllocError> {
        self.state.capture_underway = underway;
        if underway {
            return Ok(());
        }
        let deferred = self.events.take_deferred();
        crate::capture::record_deferred(deferred, |ptr| self.insert_events(dev, ptr))
    }

    fn process_events(&mut self, dev: &dyn Device) -> Result<(), AllocError> {
        if self.events.is_empty() || self.state.capture_underway {
            return Ok(());
        }
        let mut poll = Poll::new();
        while let Some(ptr) = self.events.next_completed(dev, &mut poll)? {
            self.event_completed(ptr);
        }
        Ok(())
    }

    fn synchronize_and_free_events(&mut self, dev: &dyn Device) -> Result<(), AllocError> {
        self.state.stats.num_sync_all_streams += 1;
        self.events.retire_strays(dev)?;
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
        while let Some(ptr) = self.events.wait_next(dev)? {
            self.event_completed(ptr);
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
                    && self
                        .spans
                        .free_at(r.size_index, r.size, r.base)
                        .is_some_and(|id| self.spans.get(id).region == *i)
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
                self.state.stats.num_device_free += 1;
                self.state
                    .history
                    .record(Action::SegmentFree, base, size, stream);
            } else {
                dev.address_free(base, size)?;
            }
            let slot = self.region(index).size_index;
            let span = self
                .spans
                .free_at(slot, size, base)
                .expect("a wholly free region is one indexed range");
            self.spans.remove_free(span, slot);
            self.regions[index as usize] = None;
            decrease(&mut self.state.stats.segment, u64::MAX, 1);
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
        self.state
            .history
            .record(Action::Oom, device_free, rounded, stream);
        self.state.stats.num_ooms += 1;
        let allocated = self.state.stats.allocated_bytes[0].current as u64;
        // With remapping, every wholly free granule that may move is usable
        // by any request, and a free range of mapped memory by one that fits
        // it in place: the larger is the largest piece the allocator could
        // offer.
        let free_granules = self.granule.map(|g| self.free_granules_by_mobility(g));
        let largest_free = match free_granules {
            Some(free) => free.movable_bytes.max(largest_free_block(&self.snapshot())),
            None => self
                .spans
                .indexes()
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
            .map(|b| self.spans.get(b.span).size)
            .sum();
        let granule = self.granule.unwrap_or(SEGMENT_ROUND);
        let mut report = OomReport {
            requested_bytes: requested,
            rounded_bytes: rounded,
            device_request_bytes: rounded.div_ceil(granule) * granule,
            stream,
            device_total_bytes: self.state.device_total,
            device_free_bytes: device_free,
            allocated_bytes: allocated,
            reserved_bytes: self.physical.held_bytes(),
            cached_free_bytes: self.physical.held_bytes().saturating_sub(allocated),
            largest_free_block_bytes: largest_free,
            pending_free_bytes: pending,
            limit_bytes: self.state.limit_bytes,
            policy: "hbm",
            free_granules,
            segment_reserve_bytes: None,
            verdict: OomVerdict::RealDemand,
        };
        report.judge();
        AllocError::OutOfMemory(Box::new(report))
    }

    // ----- restoring a recorded state -----

    /// Maps memory under `size` bytes of `stream`'s address space where
    /// best fit would place a block of that size, and leaves them free (as
    /// a block allocated and freed there would, without the block): the
    /// blocks placed next find them mapped. Counts as demand, as that block
    /// would: the allowance and the growth rules see the extent as held for
    /// the program. Out of memory leaves the blocks to back themselves.
    fn back_free_extent(
        &mut self,
        dev: &dyn Device,
        stream: StreamId,
        size: u64,
    ) -> Result<(), AllocError> {
        self.count_demand(size);
        let found = match self.find_free(stream, size) {
            Some(found) => Some(found),
            None => self.new_region(dev, stream, size)?,
        };
        let Some((range, ptr)) = found else {
            return Ok(());
        };
        let region = self.spans.get(range).region;
        let span = self.take_span(range, ptr, size);
        let backing = self.back_range(dev, ptr, size, region, false);
        self.release_span(span);
        backing.map(|_| ())
    }

    /// Recreates a recorded segment's blocks: `hbm` places memory its own way,
    /// so it backs the segment's extent, then allocates each block and
    /// frees the ones that were free.
    pub(crate) fn restore_segment(
        &mut self,
        dev: &dyn Device,
        image: &SegmentImage,
    ) -> Result<Vec<DevicePtr>, AllocError> {
        // The segment is memory the program held before the recording
        // began: backed as one run (cut into handles as any run is; one
        // segment without a virtual-memory API), as PyTorch's policies
        // restore it with one call, not grown a block at a time as a heap
        // starting from nothing would be.
        let total: u64 = image.blocks.iter().map(|b| b.size).sum();
        if total > 0 {
            self.back_free_extent(dev, image.stream, total)?;
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
}

// The contract, served by the inherent methods of the same names.
crate::policy::policy_by_inherent_methods!(HbmPolicy);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_parses_and_round_trips() {
        let c = HbmConfig::parse(
            "max_waste_percent:5, per_process_memory_fraction:0.5, max_views:2, whole_handle_granules:4, mapped_fit:0",
        )
        .unwrap();
        assert_eq!(c.mapped_fit, 0);
        assert_eq!(c.max_waste_percent, 5.0);
        assert_eq!(c.per_process_memory_fraction, 0.5);
        assert_eq!(c.max_views, 2);
        assert_eq!(c.whole_handle_granules, Some(4));
        assert_eq!(HbmConfig::parse(&c.to_conf_string()).unwrap(), c);
        assert_eq!(HbmConfig::parse("").unwrap(), HbmConfig::default());
        assert_eq!(HbmConfig::default().to_conf_string(), "");
        // Written as short as it reads back; -0 is 0.
        let tiny = HbmConfig::parse("max_waste_percent:1e-320").unwrap();
        assert_eq!(tiny.to_conf_string(), "max_waste_percent:1e-320");
        let zero = HbmConfig::parse("max_waste_percent:-0").unwrap();
        assert_eq!(zero.to_conf_string(), "max_waste_percent:0");
        let auto = HbmConfig::parse("whole_handle_granules:auto").unwrap();
        assert_eq!(auto, HbmConfig::default());
        assert_eq!(auto.whole_handle_granules, None);
    }

    #[test]
    fn config_rejects_bad_input() {
        for bad in [
            "max_waste_percent:-1",
            "max_waste_percent:NaN",
            "max_waste_percent:x",
            "per_process_memory_fraction:0",
            "per_process_memory_fraction:1.5",
            "max_views:1",
            "max_views:65",
            "max_views:4.5",
            "whole_handle_granules:0",
            "whole_handle_granules:513",
            "whole_handle_granules:-1",
            "mapped_fit:-1",
            "mapped_fit:4097",
            "expandable_segments:True",
            "max_waste_percent",
        ] {
            let e = HbmConfig::parse(bad).unwrap_err();
            assert!(!e.expected.is_empty(), "{bad}");
        }
        let e = HbmConfig::parse("whole_handle_granules:0").unwrap_err();
        assert_eq!(e.expected, "auto or a whole number from 1 to 512");
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
                true,
                History::with_capacity(0),
            )
        };
        assert_eq!(policy(3 * MIB).granule, None);
        assert_eq!(policy(2 * MIB).granule, Some(2 * MIB));
    }

    /// A policy over a simulated device of `capacity` bytes whose handles
    /// are one granule each, so that memory is mapped where blocks are.
    fn one_granule_handles(capacity: u64) -> (crate::sim::SimDevice, HbmPolicy) {
        let dev = crate::sim::SimDevice::with_capacity(capacity);
        let config = HbmConfig::parse("whole_handle_granules:1").unwrap();
        let policy = HbmPolicy::new(
            config,
            capacity,
            dev.granularity(),
            dev.maps_handle_parts(),
            History::with_capacity(0),
        );
        (dev, policy)
    }

    /// A place remembered as freed is offered only while its span, which a
    /// retired id may now name elsewhere, still covers all of it: here the
    /// span is a 2 MiB free range at the place, and the 4 MiB remembered
    /// would run over a live block.
    #[test]
    fn a_recent_place_its_span_no_longer_covers_is_not_offered() {
        let (dev, mut policy) = one_granule_handles(1 << 30);
        let s = StreamId(0);
        let a = policy.malloc(&dev, 4 * MIB, s).unwrap();
        let b = policy.malloc(&dev, 6 * MIB, s).unwrap();
        policy.malloc(&dev, 2 * MIB, s).unwrap();
        assert_eq!(b, a + 4 * MIB);
        policy.free(&dev, a).unwrap(); // remembered: 4 MiB at `a`
        policy.free(&dev, b).unwrap(); // merges: `a`'s span id retired
        let front = policy.malloc(&dev, 2 * MIB, s).unwrap(); // reuses the id
        let rest = policy.malloc(&dev, 8 * MIB, s).unwrap();
        assert_eq!((front, rest), (a, a + 2 * MIB));
        policy.free(&dev, front).unwrap(); // the id is a free span again
        let (id, ptr) = policy.placement.recent_free(s, 4 * MIB).unwrap();
        let span = *policy.spans.get(id);
        assert_eq!(
            (ptr, span.free, span.start, span.end()),
            (a, true, a, a + 2 * MIB)
        );
        assert!(policy.is_mapped(span.region, a, 4 * MIB));
        assert_eq!(policy.recently_freed_place(s, 4 * MIB), None);
        let c = policy.malloc(&dev, 4 * MIB, s).unwrap();
        assert!(
            c + 4 * MIB <= rest || c >= rest + 8 * MIB,
            "over a live block"
        );
    }

    /// When every best-fit candidate is in use elsewhere at its start and
    /// cannot slide, the largest free range is the fallback, slid past its
    /// own granule in use elsewhere.
    #[test]
    fn the_largest_range_fallback_slides_past_memory_in_use_elsewhere() {
        let (dev, mut policy) = one_granule_handles(1 << 30);
        let s = StreamId(0);
        let holes: Vec<DevicePtr> = (0..=MAX_CANDIDATES)
            .map(|_| {
                let hole = policy.malloc(&dev, 4 * MIB, s).unwrap();
                policy.malloc(&dev, 2 * MIB, s).unwrap();
                hole
            })
            .collect();
        for &hole in &holes {
            policy.free(&dev, hole).unwrap();
        }
        let (_, tail, tail_id) = policy.spans.index_of(s).unwrap().largest().unwrap();
        let region = policy.spans.get(tail_id).region;
        let base = policy.region(region).base;
        // Each range's first granule is lent to a view in use (so aliased):
        // blocked.
        for start in holes.iter().copied().chain([tail]) {
            let granule = (start - base) / (2 * MIB);
            policy.region_mut(region).aliased.set(granule, 1, true);
            policy.region_mut(region).lent.set(granule, 1, true);
        }
        assert!(holes.iter().all(|&h| policy.blocked(region, h, 4 * MIB)));
        assert_eq!(
            policy.find_free(s, 4 * MIB),
            Some((tail_id, tail + 2 * MIB))
        );
    }

    /// Where handles map whole only, an idle handle whose groups blocks cut
    /// apart is mapped whole (each group gaining a view) before memory past
    /// the allowance is made: here a 4-granule handle mapped at three
    /// streams' regions, idle, cut in two groups, serves a fourth stream.
    #[test]
    fn an_idle_handle_cut_into_groups_is_mapped_whole_before_new_memory() {
        use crate::device::CallKind;
        let dev = crate::sim::SimDevice::with_capacity(1 << 30);
        let config = HbmConfig::parse("whole_handle_granules:4,max_waste_percent:0").unwrap();
        let granule = dev.granularity().unwrap();
        let mut policy = HbmPolicy::new(
            config,
            1 << 30,
            Some(granule),
            dev.maps_handle_parts(),
            History::with_capacity(0),
        );
        let size = 4 * granule;
        // Made on stream 0, idle there, then mapped under blocks of streams
        // 1 and 2 in turn: one group, three views.
        for stream in 0..3 {
            let block = policy.malloc(&dev, size, StreamId(stream)).unwrap();
            policy.free(&dev, block).unwrap();
        }
        assert_eq!(dev.call_counts().get(CallKind::PhysicalCreate), 1);
        let id = policy.region(0).group_at.get(0).expect("stitched");
        assert_eq!(policy.groups.get(id).views.len(), 3);
        // Cut apart, as a block on part of it leaves it: neither half may be
        // mapped alone.
        policy.groups.split(id, 1, granule, &mut policy.regions);
        let block = policy.malloc(&dev, size, StreamId(3)).unwrap();
        policy.check_invariants().unwrap();
        assert_eq!(
            dev.call_counts().get(CallKind::PhysicalCreate),
            1,
            "no new memory"
        );
        let region = policy.region(policy.spans.get(policy.live[&block].span).region);
        let under = (block - region.base) / granule;
        assert_eq!(
            region.group_at.get(under),
            Some(policy.region(0).group_at.get(0).unwrap())
        );
    }

    /// A request far longer than a handle gets at most
    /// [`MAX_HANDLES_PER_RUN`] handles, whatever its size: an absurd one
    /// costs a few hundred calls, not millions, and freed it is reused
    /// whole with no call at all.
    #[test]
    fn a_huge_request_takes_a_bounded_number_of_handles() {
        use crate::device::CallKind;
        let capacity = 1 << 41;
        let dev = crate::sim::SimDevice::with_capacity(capacity);
        let policy = |config: &str| {
            HbmPolicy::new(
                HbmConfig::parse(config).unwrap(),
                capacity,
                dev.granularity(),
                dev.maps_handle_parts(),
                History::with_capacity(0),
            )
        };
        let size = 1 << 40;
        for config in ["", "whole_handle_granules:1"] {
            let mut policy = policy(config);
            let before = dev.call_counts().get(CallKind::PhysicalCreate);
            let block = policy.malloc(&dev, size, StreamId(0)).unwrap();
            let created = dev.call_counts().get(CallKind::PhysicalCreate) - before;
            assert_eq!(created, MAX_HANDLES_PER_RUN, "{config:?}");
            policy.free(&dev, block).unwrap();
            let calls = dev.call_counts();
            assert_eq!(policy.malloc(&dev, size, StreamId(0)).unwrap(), block);
            assert_eq!(dev.call_counts(), calls, "reused whole");
            policy.check_invariants().unwrap();
            policy.empty_cache(&dev).unwrap();
        }
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
}

//! Deterministic simulation testing of the engine (FoundationDB / TigerBeetle
//! style): a seeded program drives an [`Allocator`] on a [`SimDevice`] the
//! way a real GPU program would — allocations of every size class on up to
//! eight streams, kernels queued on the allocation stream and, after
//! `record_stream`, on others, frees while those kernels are still queued,
//! events completing in random order, `empty_cache`, memory fractions,
//! CUDA graph captures (see [`crate::capture`]), capacity pressure and
//! injected driver faults at every kind of call — and
//! checks after every step that the allocator's books agree with the
//! device's and with the program's own view.
//!
//! Policy-generic: a run takes a settings string (`policy:pytorch,...`), so
//! every policy [`PolicyConfig::from_settings`] knows is tested the same way.
//! The same seed always runs the same program and makes the same checks.
//!
//! What is checked after every step (see [`run_seed`]):
//! - [`Allocator::check_invariants`] and [`SimDevice::check_invariants`];
//! - memory handed out is mapped with access (`set_access`);
//! - no two live allocations overlap, and the snapshot's allocated blocks are
//!   exactly the program's live allocations (address and requested size);
//! - `reserved_bytes` equals [`SimDevice::used_bytes`]; `allocated_bytes`
//!   equals the sum of the live allocations' block sizes (each measured when
//!   it was handed out, at least the requested size, a multiple of 512);
//!   the `allocation` count equals the number of live allocations;
//! - no use-after-free: no memory handed out overlaps a kernel still queued
//!   on a *different* stream than the new allocation's, and the device saw
//!   no unmap (or non-synchronizing segment free) of memory a queued kernel
//!   touches ([`SimDevice::take_violations`]);
//! - while a capture is underway, no call that waits or gives memory back
//!   reaches the device (event record, query or synchronization, device
//!   synchronization, segment free, unmap, release, address free), and
//!   `empty_cache` is refused;
//! - every error is accounted for: a driver error must come from an injected
//!   fault; an out-of-memory error carries the requested size and numbers
//!   that agree with the statistics; an allocator with nothing live and no
//!   faults armed must not run out of memory for a request that fits;
//! - at the end: everything freed, all streams complete, `empty_cache` →
//!   the device holds nothing, no event is pending, every `current`
//!   statistic is zero.

use std::collections::BTreeMap;
use std::fmt;

use crate::allocator::{Allocator, AllocatorConfig, PolicyConfig};
use crate::device::{CallKind, Device, DeviceErrorKind, DevicePtr, StreamId};
use crate::error::AllocError;
use crate::sim::{Fault, SimConfig, SimDevice};
use crate::snapshot::BlockState;

const MIB: u64 = 1 << 20;

/// SplitMix64: a small, fast, deterministic PRNG (no dependency needed).
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// A source of random choices: [`SplitMix64`] for seeded runs, or a byte
/// string (a fuzzer's input) for [`run_bytes`]. The choices are derived from
/// [`RandomSource::next_u64`]'s high bits, so a byte string steers them directly.
pub trait RandomSource {
    /// The next 64 random bits.
    fn next_u64(&mut self) -> u64;

    /// Uniform in `0..n` (`n > 0`).
    fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// One of `items` (not empty), uniformly.
    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }

    /// True with probability `percent` / 100.
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    /// Log-uniform in `lo..=hi` (`lo >= 1`): as many small sizes as large ones.
    fn log_range(&mut self, lo: u64, hi: u64) -> u64 {
        let lo_bits = 64 - lo.leading_zeros() as u64;
        let hi_bits = 64 - hi.leading_zeros() as u64;
        let bits = self.range(lo_bits, hi_bits);
        let top = if bits >= 64 {
            u64::MAX
        } else {
            (1u64 << bits) - 1
        };
        let bottom = 1u64 << (bits - 1);
        self.range(bottom.max(lo), top.min(hi))
    }
}

impl RandomSource for SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        SplitMix64::next_u64(self)
    }
}

/// Choices read from a byte string, two bytes per choice; zeros once it is
/// exhausted.
#[derive(Clone, Debug)]
struct ByteSource {
    data: Vec<u8>,
    pos: usize,
}

impl ByteSource {
    fn exhausted(&self) -> bool {
        self.pos >= self.data.len()
    }
}

impl RandomSource for ByteSource {
    fn next_u64(&mut self) -> u64 {
        let hi = self.data.get(self.pos).copied().unwrap_or(0);
        let lo = self.data.get(self.pos + 1).copied().unwrap_or(0);
        self.pos += 2;
        (u64::from(hi) << 56) | (u64::from(lo) << 48)
    }
}

enum Source {
    Seeded(SplitMix64),
    Bytes(ByteSource),
}

impl RandomSource for Source {
    fn next_u64(&mut self) -> u64 {
        match self {
            Source::Seeded(r) => r.next_u64(),
            Source::Bytes(b) => b.next_u64(),
        }
    }
}

/// A device the harness can drive: any [`Device`] built over a [`SimDevice`]
/// (the simulated GPU itself, or a test wrapper that changes its behaviour).
pub trait SimBacked: Device {
    /// The simulated GPU underneath.
    fn sim(&self) -> &SimDevice;
}

impl SimBacked for SimDevice {
    fn sim(&self) -> &SimDevice {
        self
    }
}

/// What a simulated program does, beyond what its seed decides.
#[derive(Clone, Debug)]
pub struct SimOptions {
    /// Operations per seed.
    pub steps: usize,
    /// Inject driver faults.
    pub faults: bool,
    /// Broken-program / broken-allocator variant: launch kernels on other
    /// streams without telling the allocator (`record_stream` is never
    /// called), as an allocator that ignored it would behave. The harness must
    /// report a use-after-free.
    pub skip_record_stream: bool,
    /// Device capacity; `None` lets the seed choose (96 MiB – 512 MiB).
    pub capacity_bytes: Option<u64>,
    /// Print every operation to stderr as it runs (for replaying a failure).
    pub trace: bool,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            steps: 300,
            faults: true,
            skip_record_stream: false,
            capacity_bytes: None,
            trace: false,
        }
    }
}

/// What one seed did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SeedReport {
    /// Operations run (each followed by every check).
    pub ops: u64,
    /// Allocations served.
    pub mallocs: u64,
    /// Out-of-memory errors returned (and checked).
    pub ooms: u64,
    /// Faults armed.
    pub faults_armed: u64,
    /// Calls that returned an injected driver error.
    pub device_errors: u64,
    /// Kernels queued.
    pub uses: u64,
    /// CUDA graph captures begun.
    pub captures: u64,
}

impl SeedReport {
    /// Adds `other` to `self`.
    pub fn add(&mut self, other: &SeedReport) {
        self.ops += other.ops;
        self.mallocs += other.mallocs;
        self.ooms += other.ooms;
        self.faults_armed += other.faults_armed;
        self.device_errors += other.device_errors;
        self.uses += other.uses;
        self.captures += other.captures;
    }
}

/// A failed check: which seed, which step, what.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimFailure {
    /// The settings string the allocator ran with.
    pub settings: String,
    /// The seed.
    pub seed: u64,
    /// The step (0-based) after which the check failed; `steps` is the final
    /// drain-and-empty phase.
    pub step: usize,
    /// What broke.
    pub message: String,
    /// The last operations before the failure, oldest first.
    pub recent: Vec<String>,
}

impl fmt::Display for SimFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "simulation failed: settings {:?}, seed {}, step {}: {}",
            self.settings, self.seed, self.step, self.message
        )?;
        writeln!(f, "  last operations:")?;
        for op in &self.recent {
            writeln!(f, "    {op}")?;
        }
        write!(
            f,
            "  replay: HBMALLOC_SIM_SEED={} cargo test -p hbmalloc --test simulation",
            self.seed
        )
    }
}

impl std::error::Error for SimFailure {}

#[derive(Clone, Debug)]
struct Live {
    requested: u64,
    block: u64,
    stream: StreamId,
    /// Streams the program used it on besides its own.
    others: Vec<StreamId>,
}

struct Run<D: SimBacked> {
    alloc: Allocator<D>,
    rng: Source,
    opts: SimOptions,
    streams: Vec<StreamId>,
    capacity: u64,
    live: BTreeMap<DevicePtr, Live>,
    live_target: u64,
    faults_armed: bool,
    fault_clear_at: usize,
    report: SeedReport,
    recent: Vec<String>,
    /// A CUDA graph capture is underway.
    capturing: bool,
}

/// Runs one seed on a fresh [`SimDevice`] under `settings`.
pub fn run_seed(settings: &str, seed: u64, opts: &SimOptions) -> Result<SeedReport, SimFailure> {
    run_seed_with(settings, seed, opts, SimDevice::with_capacity)
}

/// Runs one seed on the device `make_device(capacity)` builds (a wrapper
/// over a [`SimDevice`] of that capacity, for testing the harness itself).
pub fn run_seed_with<D: SimBacked>(
    settings: &str,
    seed: u64,
    opts: &SimOptions,
    make_device: impl FnOnce(u64) -> D,
) -> Result<SeedReport, SimFailure> {
    let rng = Source::Seeded(SplitMix64::new(seed ^ 0x5DEE_CE66_D1CE_5EED));
    run_with(settings, seed, opts, rng, make_device)
}

/// Runs the program a byte string spells (a fuzzer's input) on a fresh
/// [`SimDevice`], with every check of a seeded run: the first byte picks one
/// of `settings` and whether the device maps part of a handle
/// ([`SimConfig::maps_handle_parts`]), the rest are the program's choices,
/// two bytes each, until they run out; then everything is freed and the
/// cache emptied.
pub fn run_bytes(settings: &[&str], data: &[u8]) -> Result<SeedReport, SimFailure> {
    let Some((&first, rest)) = data.split_first() else {
        return Ok(SeedReport::default());
    };
    let count = settings.len().max(1);
    let Some(&chosen) = settings.get(usize::from(first) % count) else {
        return Ok(SeedReport::default());
    };
    let maps_handle_parts = (usize::from(first) / count) % 2 == 0;
    let opts = SimOptions {
        steps: rest.len(),
        ..SimOptions::default()
    };
    let rng = Source::Bytes(ByteSource {
        data: rest.to_vec(),
        pos: 0,
    });
    run_with(chosen, 0, &opts, rng, |capacity_bytes| {
        SimDevice::with_config(SimConfig {
            capacity_bytes,
            maps_handle_parts,
            ..SimConfig::default()
        })
    })
}

fn run_with<D: SimBacked>(
    settings: &str,
    seed: u64,
    opts: &SimOptions,
    mut rng: Source,
    make_device: impl FnOnce(u64) -> D,
) -> Result<SeedReport, SimFailure> {
    let fail = |step: usize, message: String, recent: Vec<String>| SimFailure {
        settings: settings.to_string(),
        seed,
        step,
        message,
        recent,
    };
    let policy = PolicyConfig::from_settings(settings)
        .map_err(|e| fail(0, format!("bad settings: {e}"), Vec::new()))?;
    let capacity = opts
        .capacity_bytes
        .unwrap_or_else(|| rng.range(48, 256) * 2 * MIB);
    let stream_count = rng.range(1, 8);
    let streams = (0..stream_count).map(StreamId).collect();
    let live_target = capacity / 100 * rng.range(50, 95);
    let device = make_device(capacity);
    let alloc = Allocator::new(
        device,
        AllocatorConfig {
            policy,
            history_entries: 0,
        },
    )
    .map_err(|e| fail(0, format!("Allocator::new: {e}"), Vec::new()))?;
    let mut run = Run {
        alloc,
        rng,
        opts: opts.clone(),
        streams,
        capacity,
        live: BTreeMap::new(),
        live_target,
        faults_armed: false,
        fault_clear_at: 0,
        report: SeedReport::default(),
        recent: Vec::new(),
        capturing: false,
    };
    let mut steps = opts.steps;
    for step in 0..opts.steps {
        if let Source::Bytes(b) = &run.rng {
            if b.exhausted() {
                steps = step;
                break;
            }
        }
        let capturing_before = run.capturing;
        let forbidden_before = forbidden_during_capture(run.sim());
        let result = run.step(step).and_then(|()| run.check());
        let result = result.and_then(|()| {
            let forbidden = forbidden_during_capture(run.sim()) - forbidden_before;
            if capturing_before && run.capturing && forbidden > 0 {
                return Err(format!(
                    "{forbidden} calls that wait or give memory back reached the device during a capture"
                ));
            }
            Ok(())
        });
        run.report.ops += 1;
        if let Err(message) = result {
            return Err(fail(step, message, run.recent));
        }
    }
    match run.finish() {
        Ok(()) => Ok(run.report),
        Err(message) => Err(fail(steps, message, run.recent)),
    }
}

impl<D: SimBacked> Run<D> {
    fn sim(&self) -> &SimDevice {
        self.alloc.device().sim()
    }

    fn log(&mut self, op: String) {
        if self.opts.trace {
            eprintln!("{op}");
        }
        if self.recent.len() == 12 {
            self.recent.remove(0);
        }
        self.recent.push(op);
    }

    fn pick_stream(&mut self) -> StreamId {
        *self.rng.pick(&self.streams)
    }

    fn pick_live(&mut self) -> Option<DevicePtr> {
        if self.live.is_empty() {
            return None;
        }
        let n = self.rng.below(self.live.len() as u64) as usize;
        self.live.keys().nth(n).copied()
    }

    fn live_requested(&self) -> u64 {
        self.live.values().map(|l| l.requested).sum()
    }

    fn pick_size(&mut self) -> u64 {
        let huge_max = (self.capacity / 3).max(65 * MIB);
        match self.rng.below(100) {
            0..=54 => self.rng.log_range(1, MIB),
            55..=79 => self.rng.range(MIB + 1, 10 * MIB),
            80..=94 => self.rng.range(10 * MIB, 64 * MIB),
            _ => self.rng.range(64 * MIB, huge_max),
        }
    }

    /// A driver error is fine only when it is an injected one. (A call
    /// refused during a capture, [`DeviceErrorKind::CaptureUnderway`], is a
    /// path that would have waited or given memory back: a failure.)
    fn device_error_ok(&mut self, e: &AllocError, what: &str) -> Result<(), String> {
        match e {
            AllocError::Device(d) if d.detail.starts_with("injected fault") => {
                self.report.device_errors += 1;
                self.log(format!("  -> error: {d}"));
                Ok(())
            }
            other => Err(format!("{what} failed: {other}")),
        }
    }

    fn step(&mut self, step: usize) -> Result<(), String> {
        if self.faults_armed && step >= self.fault_clear_at {
            self.sim().clear_faults();
            self.faults_armed = false;
        }
        let roll = self.rng.below(1000);
        match roll {
            0..=289 => self.op_malloc(),
            290..=299 => self.op_capture(),
            300..=449 => self.op_launch(),
            450..=549 => self.op_record_stream(),
            550..=769 => self.op_free(),
            770..=909 => self.op_complete(),
            910..=934 => {
                self.log("empty_cache".into());
                match self.alloc.empty_cache() {
                    Err(AllocError::CaptureUnderway { .. }) if self.capturing => Ok(()),
                    Ok(()) if self.capturing => Err("empty_cache ran during a capture".into()),
                    Ok(()) => Ok(()),
                    Err(e) => self.device_error_ok(&e, "empty_cache"),
                }
            }
            935..=944 => {
                let fraction = self.rng.range(50, 100) as f64 / 100.0;
                self.log(format!("set_memory_fraction({fraction})"));
                self.alloc
                    .set_memory_fraction(fraction)
                    .map_err(|e| format!("set_memory_fraction({fraction}): {e}"))
            }
            _ => {
                if self.opts.faults {
                    self.op_fault(step);
                }
                Ok(())
            }
        }
    }

    /// Begins a CUDA graph capture, or ends the one underway.
    fn op_capture(&mut self) -> Result<(), String> {
        self.capturing = !self.capturing;
        if self.capturing {
            self.log("begin capture".into());
            self.report.captures += 1;
            return self
                .alloc
                .set_capture_underway(true)
                .map_err(|e| format!("begin capture: {e}"));
        }
        self.log("end capture".into());
        match self.alloc.set_capture_underway(false) {
            Ok(()) => Ok(()),
            Err(e) => self.device_error_ok(&e, "end capture"),
        }
    }

    fn op_fault(&mut self, step: usize) {
        let kind = *self.rng.pick(&CallKind::ALL);
        let nth = if kind == CallKind::Map {
            // The Nth map of a multi-page growth: fail part-way.
            self.rng.range(1, 6)
        } else {
            self.rng.range(1, 3)
        };
        let error = if self.rng.chance(20) {
            DeviceErrorKind::OutOfMemory
        } else {
            DeviceErrorKind::Driver("CUDA_ERROR_UNKNOWN".into())
        };
        let sticky = self.rng.chance(15);
        self.log(format!("inject {kind} nth {nth} {error:?} sticky {sticky}"));
        self.sim().inject(Fault {
            call: kind,
            nth,
            error,
            sticky,
        });
        self.faults_armed = true;
        self.fault_clear_at = step + self.rng.range(1, 12) as usize;
        self.report.faults_armed += 1;
    }

    fn op_malloc(&mut self) -> Result<(), String> {
        let size = self.pick_size();
        let stream = self.pick_stream();
        // Mostly stay under the program's live budget, sometimes push past it.
        if self.live_requested() + size > self.live_target && !self.rng.chance(10) {
            return self.op_free();
        }
        self.log(format!("malloc({size}, stream {})", stream.0));
        let before = self.alloc.stats().allocated_bytes[0].current;
        match self.alloc.malloc(size, stream) {
            Ok(ptr) => {
                self.report.mallocs += 1;
                let block = (self.alloc.stats().allocated_bytes[0].current - before) as u64;
                if block < size || block % 512 != 0 {
                    return Err(format!(
                        "malloc({size}) at {ptr:#x} moved allocated_bytes by {block}"
                    ));
                }
                if let Some((&p, l)) = self.live.range(..ptr.saturating_add(size)).next_back() {
                    if p + l.requested > ptr {
                        return Err(format!(
                            "malloc({size}) returned {ptr:#x}, overlapping live [{p:#x}, +{})",
                            l.requested
                        ));
                    }
                }
                // Memory may be mapped at several addresses: no byte of it
                // may be under two live allocations.
                let physical = self.sim().physical_ranges(ptr, size);
                if !physical.is_empty() {
                    for (&p, l) in &self.live {
                        let theirs = self.sim().physical_ranges(p, l.requested);
                        let shared = physical.iter().any(|&(h, lo, hi)| {
                            theirs
                                .iter()
                                .any(|&(h2, lo2, hi2)| h == h2 && lo < hi2 && lo2 < hi)
                        });
                        if shared {
                            return Err(format!(
                                "malloc({size}) returned {ptr:#x}, whose physical memory is also under live [{p:#x}, +{})",
                                l.requested
                            ));
                        }
                    }
                }
                if !self.sim().accessible(ptr, size) {
                    return Err(format!(
                        "malloc({size}) returned {ptr:#x}, mapped without access (set_access)"
                    ));
                }
                let foreign: Vec<_> = self
                    .sim()
                    .pending_uses_overlapping(ptr, size)
                    .into_iter()
                    .filter(|u| u.stream != stream)
                    .collect();
                if let Some(u) = foreign.first() {
                    return Err(format!(
                        "use-after-free: malloc({size}) on stream {} returned [{ptr:#x}, +{size}) while a kernel queued on stream {} still touches [{:#x}, +{})",
                        stream.0, u.stream.0, u.ptr, u.len
                    ));
                }
                self.live.insert(
                    ptr,
                    Live {
                        requested: size,
                        block,
                        stream,
                        others: Vec::new(),
                    },
                );
                self.log(format!("  -> {ptr:#x} (block {block})"));
                if self.rng.chance(70) {
                    self.sim().enqueue_use(stream, ptr, size);
                    self.report.uses += 1;
                }
                Ok(())
            }
            Err(AllocError::OutOfMemory(report)) => {
                self.report.ooms += 1;
                self.log(format!("  -> OOM ({:?})", report.verdict));
                let stats = self.alloc.stats();
                let allocated = stats.allocated_bytes[0].current as u64;
                let reserved = stats.reserved_bytes[0].current as u64;
                if report.requested_bytes != size {
                    return Err(format!(
                        "OOM report says {} requested, not {size}",
                        report.requested_bytes
                    ));
                }
                if report.allocated_bytes != allocated || report.reserved_bytes != reserved {
                    return Err(format!(
                        "OOM report live {} reserved {} != stats {allocated} {reserved}",
                        report.allocated_bytes, report.reserved_bytes
                    ));
                }
                if report.device_total_bytes != self.capacity
                    || report.cached_free_bytes != reserved - allocated
                    || report.largest_free_block_bytes > report.cached_free_bytes
                    || report.largest_free_block_bytes < self.alloc.largest_free_block_bytes()
                    || report.free_granules.is_some_and(|free| {
                        // Each physical granule counted once, and only free ones.
                        free.movable_bytes + free.pinned_bytes > report.cached_free_bytes
                    })
                    || report.rounded_bytes < size
                {
                    return Err(format!("OOM report inconsistent: {report:?}"));
                }
                let limit = report.limit_bytes.unwrap_or(u64::MAX).min(self.capacity);
                // During a capture no cached memory is given back.
                if self.live.is_empty()
                    && !self.faults_armed
                    && !self.capturing
                    && size + 22 * MIB <= limit
                {
                    return Err(format!(
                        "spurious OOM: nothing live, {size} bytes asked of {limit}: {}",
                        report.render()
                    ));
                }
                Ok(())
            }
            Err(e) => self.device_error_ok(&e, &format!("malloc({size})")),
        }
    }

    fn op_launch(&mut self) -> Result<(), String> {
        let Some(ptr) = self.pick_live() else {
            return Ok(());
        };
        let l = &self.live[&ptr];
        let mut candidates = vec![l.stream];
        candidates.extend(l.others.iter().copied());
        let stream = *self.rng.pick(&candidates);
        let len = l.requested;
        self.log(format!("launch on stream {} over {ptr:#x}", stream.0));
        self.sim().enqueue_use(stream, ptr, len);
        self.report.uses += 1;
        Ok(())
    }

    fn op_record_stream(&mut self) -> Result<(), String> {
        let Some(ptr) = self.pick_live() else {
            return Ok(());
        };
        let stream = self.pick_stream();
        let own = self.live[&ptr].stream;
        if stream == own {
            return Ok(());
        }
        self.log(format!("record_stream({ptr:#x}, stream {})", stream.0));
        if !self.opts.skip_record_stream {
            self.alloc
                .record_stream(ptr, stream)
                .map_err(|e| format!("record_stream({ptr:#x}): {e}"))?;
        }
        let len = {
            let l = self.live.get_mut(&ptr).expect("live");
            if !l.others.contains(&stream) {
                l.others.push(stream);
            }
            l.requested
        };
        // The program records the stream because it launches work there.
        self.sim().enqueue_use(stream, ptr, len);
        self.report.uses += 1;
        Ok(())
    }

    fn op_free(&mut self) -> Result<(), String> {
        let Some(ptr) = self.pick_live() else {
            return Ok(());
        };
        self.log(format!("free({ptr:#x})"));
        let result = self.alloc.free(ptr);
        if let Err(e) = &result {
            self.device_error_ok(e, &format!("free({ptr:#x})"))?;
            // A failed free may or may not have released the allocation:
            // the snapshot says which.
            let still_live = self.alloc.snapshot().segments.iter().any(|s| {
                s.blocks
                    .iter()
                    .any(|b| b.address == ptr && b.state == BlockState::ActiveAllocated)
            });
            if still_live {
                return Ok(());
            }
        }
        self.live.remove(&ptr);
        Ok(())
    }

    fn op_complete(&mut self) -> Result<(), String> {
        match self.rng.below(10) {
            0..=3 => {
                let s = self.pick_stream();
                self.log(format!("complete_stream({})", s.0));
                self.sim().complete_stream(s);
            }
            4..=6 => {
                let events = self.sim().pending_event_ids();
                if !events.is_empty() {
                    let e = *self.rng.pick(&events);
                    self.log(format!("complete_event({})", e.0));
                    self.sim().complete_event(e);
                }
            }
            7..=8 => {
                let uses = self.sim().pending_uses();
                if !uses.is_empty() {
                    let u = self.rng.pick(&uses).id;
                    self.log(format!("complete_use({})", u.0));
                    self.sim().complete_use(u);
                }
            }
            _ => {
                self.log("complete_all".into());
                self.sim().complete_all();
            }
        }
        Ok(())
    }

    /// The checks made after every step.
    fn check(&mut self) -> Result<(), String> {
        self.alloc
            .check_invariants()
            .map_err(|e| format!("allocator invariant: {e}"))?;
        let sim = self.sim();
        sim.check_invariants()
            .map_err(|e| format!("device invariant: {e}"))?;
        let violations = sim.take_violations();
        if let Some(v) = violations.first() {
            return Err(format!("use-after-free: {v}"));
        }
        let stats = self.alloc.stats();
        let reserved = stats.reserved_bytes[0].current;
        let used = self.sim().used_bytes();
        if reserved != used as i64 {
            return Err(format!(
                "reserved_bytes {reserved} != device used_bytes {used}"
            ));
        }
        let allocated: u64 = self.live.values().map(|l| l.block).sum();
        if stats.allocated_bytes[0].current != allocated as i64 {
            return Err(format!(
                "allocated_bytes {} != sum of live blocks {allocated}",
                stats.allocated_bytes[0].current
            ));
        }
        if stats.allocation[0].current != self.live.len() as i64 {
            return Err(format!(
                "allocation count {} != {} live",
                stats.allocation[0].current,
                self.live.len()
            ));
        }
        let snapshot = self.alloc.snapshot();
        let shown: u64 = snapshot.segments.iter().map(|s| s.total_size).sum();
        if shown as i64 > stats.reserved_bytes[0].current {
            return Err(format!(
                "snapshot segments add up to {shown}, more than reserved_bytes {}",
                stats.reserved_bytes[0].current
            ));
        }
        let mut in_snapshot: Vec<(DevicePtr, u64)> = snapshot
            .segments
            .iter()
            .flat_map(|s| s.blocks.iter())
            .filter(|b| b.state == BlockState::ActiveAllocated)
            .map(|b| (b.address, b.requested_size))
            .collect();
        in_snapshot.sort_unstable();
        let expected: Vec<(DevicePtr, u64)> =
            self.live.iter().map(|(&p, l)| (p, l.requested)).collect();
        if in_snapshot != expected {
            return Err(format!(
                "snapshot's allocated blocks {in_snapshot:x?} != live allocations {expected:x?}"
            ));
        }
        Ok(())
    }

    /// Frees everything, completes all work, empties the cache; nothing may be left.
    fn finish(&mut self) -> Result<(), String> {
        self.sim().clear_faults();
        self.faults_armed = false;
        if self.capturing {
            self.capturing = false;
            self.log("end capture".into());
            self.alloc
                .set_capture_underway(false)
                .map_err(|e| format!("final end of the capture: {e}"))?;
        }
        self.log("finish: free all, complete_all, empty_cache".into());
        let ptrs: Vec<DevicePtr> = self.live.keys().copied().collect();
        for ptr in ptrs {
            self.alloc
                .free(ptr)
                .map_err(|e| format!("final free({ptr:#x}): {e}"))?;
            self.live.remove(&ptr);
        }
        self.check()?;
        self.sim().complete_all();
        self.alloc
            .empty_cache()
            .map_err(|e| format!("final empty_cache: {e}"))?;
        self.check()?;
        let sim = self.sim();
        if sim.used_bytes() != 0 {
            return Err(format!(
                "leak: device still holds {} bytes after freeing everything and empty_cache",
                sim.used_bytes()
            ));
        }
        if sim.pending_events() != 0 {
            return Err(format!(
                "{} events still pending after complete_all and empty_cache",
                sim.pending_events()
            ));
        }
        let s = self.alloc.stats();
        let current = [
            ("allocation", &s.allocation),
            ("segment", &s.segment),
            ("active", &s.active),
            ("inactive_split", &s.inactive_split),
            ("allocated_bytes", &s.allocated_bytes),
            ("reserved_bytes", &s.reserved_bytes),
            ("active_bytes", &s.active_bytes),
            ("inactive_split_bytes", &s.inactive_split_bytes),
            ("requested_bytes", &s.requested_bytes),
        ];
        for (name, stat) in current {
            if stat.iter().any(|v| v.current != 0) {
                return Err(format!("stat {name} not zero at the end: {stat:?}"));
            }
        }
        if s.oversize_allocations.current != 0 || s.oversize_segments.current != 0 {
            return Err("oversize stats not zero at the end".into());
        }
        Ok(())
    }
}

/// Runs `seeds` consecutive seeds starting at `first` under `settings`;
/// stops at the first failure.
pub fn run_seeds(
    settings: &str,
    first: u64,
    seeds: u64,
    opts: &SimOptions,
) -> Result<SeedReport, SimFailure> {
    let mut total = SeedReport::default();
    for seed in first..first + seeds {
        total.add(&run_seed(settings, seed, opts)?);
    }
    Ok(total)
}

/// The calls a capture forbids that `SimDevice` has counted so far.
fn forbidden_during_capture(sim: &SimDevice) -> u64 {
    let counts = sim.call_counts();
    crate::capture::FORBIDDEN_DURING_CAPTURE
        .iter()
        .map(|&kind| counts.get(kind))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_run() {
        let opts = SimOptions::default();
        for settings in ["policy:pytorch", "policy:pytorch,expandable_segments:True"] {
            let a = run_seed(settings, 7, &opts).unwrap();
            let b = run_seed(settings, 7, &opts).unwrap();
            assert_eq!(a, b);
            assert!(a.ops == opts.steps as u64 && a.mallocs > 0 && a.uses > 0);
        }
    }

    #[test]
    fn prng_is_splitmix64() {
        // Reference values of SplitMix64 seeded with 0.
        let mut rng = SplitMix64::new(0);
        assert_eq!(rng.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(rng.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        for _ in 0..1000 {
            let v = rng.log_range(1, 1 << 20);
            assert!((1..=1 << 20).contains(&v));
            assert!(rng.below(3) < 3);
        }
    }

    /// Runs `settings` with a sabotage `flag` set until a seed fails (within
    /// `seeds`), with faults off so that the failure is the sabotage's.
    fn failure_with(
        flag: &'static std::thread::LocalKey<std::cell::Cell<bool>>,
        settings: &str,
        seeds: u64,
    ) -> SimFailure {
        flag.with(|f| f.set(true));
        let opts = SimOptions {
            faults: false,
            ..SimOptions::default()
        };
        let found = (0..seeds).find_map(|seed| run_seed(settings, seed, &opts).err());
        flag.with(|f| f.set(false));
        let failure =
            found.unwrap_or_else(|| panic!("broken {settings} went unnoticed for {seeds} seeds"));
        println!("{failure}");
        failure
    }

    /// Broken variant: an `hbm` that hands memory aliased from another
    /// stream's free range to a new block without waiting for that stream.
    /// The pending kernel there still touches the memory (through the other
    /// address): a use-after-free the harness must report.
    #[test]
    fn catches_hbm_reusing_aliased_memory_without_waiting() {
        let failure = failure_with(&crate::hbm::testing::SKIP_ALIAS_WAIT, "policy:hbm", 300);
        assert!(
            failure.message.contains("use-after-free"),
            "{}",
            failure.message
        );
    }

    /// Broken variant (b): an allocator that never coalesces free neighbours
    /// must be caught within a bounded number of seeds.
    #[test]
    fn catches_an_allocator_that_skips_coalescing() {
        let failure = failure_with(
            &crate::pytorch::testing::SKIP_COALESCING,
            "policy:pytorch",
            20,
        );
        assert!(
            failure.message.contains("not coalesced"),
            "{}",
            failure.message
        );
    }
}

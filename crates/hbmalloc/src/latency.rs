//! What each driver call costs on a real GPU, for the simulated device.
//!
//! A call's latency can grow with the bytes it touches (releasing or freeing
//! 256 MiB costs ten times what 2 MiB does), so each kind of call has a curve
//! of (bytes, nanoseconds) points, interpolated linearly between them, held
//! flat below the first and extended along the last segment's slope above
//! the last. The default, [`LatencyModel::h100`], is measured; anything
//! kinder is a what-if the caller asks for by name.
//!
//! A curve prices one call over one mapping. Granting access to a range
//! costs one grant per mapping in it (the driver's time grows with the
//! handles, not the bytes), so the simulated device charges `set_access`
//! mapping by mapping.

use crate::device::CallKind;

const MIB: u64 = 1 << 20;

/// Latency of one kind of call as a function of the bytes it touches.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct LatencyCurve {
    /// (bytes, nanoseconds), sorted by bytes; empty means free.
    points: Vec<(u64, u64)>,
}

impl LatencyCurve {
    /// The same latency whatever the size.
    pub fn constant(ns: u64) -> Self {
        LatencyCurve {
            points: vec![(0, ns)],
        }
    }

    /// A curve through `points` (bytes, nanoseconds). Panics if the sizes
    /// are not strictly increasing: curves are written in code, not read
    /// from input.
    pub fn through(points: &[(u64, u64)]) -> Self {
        assert!(
            points.windows(2).all(|w| w[0].0 < w[1].0),
            "latency points must have strictly increasing sizes"
        );
        LatencyCurve {
            points: points.to_vec(),
        }
    }

    /// Nanoseconds for a call touching `bytes`.
    pub fn at(&self, bytes: u64) -> u64 {
        let points = &self.points;
        let Some(&(first_bytes, first_ns)) = points.first() else {
            return 0;
        };
        if points.len() == 1 || bytes <= first_bytes {
            return first_ns;
        }
        // The segment that holds `bytes`, or the last one to extend.
        let i = points
            .windows(2)
            .position(|w| bytes <= w[1].0)
            .unwrap_or(points.len() - 2);
        let (b0, n0) = points[i];
        let (b1, n1) = points[i + 1];
        let along = (bytes - b0) as f64 / (b1 - b0) as f64;
        let ns = n0 as f64 + along * (n1 as f64 - n0 as f64);
        ns.max(0.0).round() as u64
    }

    /// The least a call can cost at any size: the lowest point, or nothing
    /// when the last segment's slope, extended, falls to zero.
    pub fn min_ns(&self) -> u64 {
        let falls = self.points.len() >= 2 && {
            let (_, a) = self.points[self.points.len() - 2];
            let (_, b) = self.points[self.points.len() - 1];
            b < a
        };
        if falls {
            return 0;
        }
        self.points.iter().map(|p| p.1).min().unwrap_or(0)
    }
}

/// Simulated latency of each driver call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LatencyModel {
    /// One curve per kind of call, indexed like [`CallKind::ALL`].
    curves: [LatencyCurve; CallKind::ALL.len()],
}

impl LatencyModel {
    /// One NVIDIA H100 80GB HBM3 (driver 580, CUDA 13): the median of 400
    /// calls (100 at 256 MiB) at 2, 20 and 256 MiB, measured through libcuda.
    /// Calls that were not measured (address reserve and free, device
    /// synchronize, memory info) keep estimates of the same order as their
    /// neighbours; `docs/driver-latency.md` has the table.
    pub fn h100() -> Self {
        let sized = |ns_2: u64, ns_20: u64, ns_256: u64| {
            LatencyCurve::through(&[(2 * MIB, ns_2), (20 * MIB, ns_20), (256 * MIB, ns_256)])
        };
        let mut model = LatencyModel::zero();
        for kind in CallKind::ALL {
            model.curves[kind as usize] = match kind {
                CallKind::SegmentAlloc => sized(52_700, 70_100, 90_600),
                CallKind::SegmentFree => sized(47_000, 66_400, 201_500),
                CallKind::PhysicalCreate => sized(14_600, 14_800, 19_300),
                CallKind::PhysicalRelease => sized(16_300, 27_000, 154_900),
                CallKind::Map => LatencyCurve::constant(3_500),
                CallKind::SetAccess => sized(35_400, 33_900, 51_000),
                CallKind::Unmap => sized(24_400, 24_900, 30_100),
                CallKind::EventRecord => LatencyCurve::constant(1_360),
                CallKind::EventQuery => LatencyCurve::constant(1_050),
                CallKind::EventSynchronize => LatencyCurve::constant(1_380),
                CallKind::AddressReserve => LatencyCurve::constant(5_000),
                CallKind::AddressFree => LatencyCurve::constant(5_000),
                CallKind::DeviceSynchronize => LatencyCurve::constant(10_000),
                CallKind::MemoryInfo => LatencyCurve::constant(1_000),
                CallKind::Setup => LatencyCurve::default(),
            };
        }
        model
    }

    /// Every call is free: a what-if, and for measuring the allocator's own
    /// CPU time.
    pub fn zero() -> Self {
        LatencyModel {
            curves: std::array::from_fn(|_| LatencyCurve::default()),
        }
    }

    /// This model with `kind`'s curve replaced.
    pub fn with(mut self, kind: CallKind, curve: LatencyCurve) -> Self {
        self.curves[kind as usize] = curve;
        self
    }

    /// The least driver time in which any allocator can get new memory
    /// once: one `cudaMalloc`, or a physical create, a map and an access
    /// grant (memory is usable only once all three are done), each at the
    /// size where it costs least.
    pub fn cheapest_growth_ns(&self) -> u64 {
        let min = |kind: CallKind| self.curves[kind as usize].min_ns();
        let mapped = min(CallKind::PhysicalCreate) + min(CallKind::Map) + min(CallKind::SetAccess);
        min(CallKind::SegmentAlloc).min(mapped)
    }

    /// The latency of one call of `kind` touching `bytes` (0 for calls that
    /// touch no memory).
    pub fn of(&self, kind: CallKind, bytes: u64) -> u64 {
        self.curves[kind as usize].at(bytes)
    }
}

impl Default for LatencyModel {
    fn default() -> Self {
        LatencyModel::h100()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cheapest_growth_is_a_create_map_and_access_at_their_cheapest_sizes() {
        // 14.6 + 3.5 + 33.9 µs (access is cheapest at 20 MiB) against a
        // cudaMalloc's 52.7.
        assert_eq!(LatencyModel::h100().cheapest_growth_ns(), 52_000);
        assert_eq!(LatencyModel::zero().cheapest_growth_ns(), 0);
        let falling = LatencyCurve::through(&[(MIB, 10), (2 * MIB, 5)]);
        assert_eq!(falling.min_ns(), 0, "extended down to nothing");
        let cheap_malloc =
            LatencyModel::h100().with(CallKind::SegmentAlloc, LatencyCurve::constant(7));
        assert_eq!(cheap_malloc.cheapest_growth_ns(), 7);
    }

    #[test]
    fn curves_interpolate_between_points_and_extend_the_last_slope() {
        let curve = LatencyCurve::through(&[(2 * MIB, 10), (20 * MIB, 28), (120 * MIB, 128)]);
        assert_eq!(curve.at(0), 10, "flat below the first point");
        assert_eq!(curve.at(2 * MIB), 10);
        assert_eq!(curve.at(11 * MIB), 19, "halfway between the first two");
        assert_eq!(curve.at(20 * MIB), 28);
        assert_eq!(curve.at(70 * MIB), 78);
        assert_eq!(curve.at(220 * MIB), 228, "the last slope, extended");
        assert_eq!(LatencyCurve::default().at(MIB), 0);
        assert_eq!(LatencyCurve::constant(7).at(1 << 40), 7);
    }

    #[test]
    fn a_falling_curve_never_goes_below_zero() {
        let curve = LatencyCurve::through(&[(0, 100), (MIB, 10)]);
        assert_eq!(curve.at(100 * MIB), 0);
    }

    #[test]
    fn the_h100_model_reproduces_its_measured_points() {
        let h100 = LatencyModel::h100();
        assert_eq!(h100.of(CallKind::SetAccess, 2 * MIB), 35_400);
        assert_eq!(h100.of(CallKind::PhysicalRelease, 256 * MIB), 154_900);
        assert_eq!(h100.of(CallKind::SegmentFree, 20 * MIB), 66_400);
        assert_eq!(h100.of(CallKind::Map, 256 * MIB), 3_500);
        assert_eq!(LatencyModel::zero().of(CallKind::SegmentAlloc, MIB), 0);
        assert_eq!(LatencyModel::default(), h100);
    }
}

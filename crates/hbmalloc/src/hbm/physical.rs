//! The physical memory held ([`Physical`]): handles, spare pieces, the
//! bytes held and their peak, and stretches left mapped without access.
//! Neither addresses nor regions are seen here: `backing.rs` maps this
//! memory under blocks.

use std::collections::{BTreeMap, BTreeSet};

use crate::device::{DevicePtr, PhysicalHandle};
use crate::fastmap::FastMap;

use super::{
    PhysicalGranule, View, WHOLE_HANDLE_GRANULES_RANGE, WHOLE_HANDLE_HEAP_DIVISOR,
    WHOLE_HANDLE_MIN_GRANULES,
};

/// Physical memory held but not mapped: `bytes` of `handle` from `offset`.
#[derive(Copy, Clone, Debug)]
pub(super) struct Piece {
    pub(super) handle: PhysicalHandle,
    pub(super) offset: u64,
    pub(super) bytes: u64,
}

/// A physical handle: its size and how much of it is mapped now.
#[derive(Copy, Clone, Debug)]
struct HandleInfo {
    bytes: u64,
    mapped: u64,
}

/// A stretch mapped without access: (region, its base, first granule, end
/// granule).
pub(super) type Stretch = (u32, DevicePtr, u64, u64);

/// The physical memory held, and how it may move.
#[derive(Debug)]
pub(super) struct Physical {
    /// The device maps part of a handle ([`Device::maps_handle_parts`]);
    /// false: every handle is mapped whole, so only whole handles move.
    maps_handle_parts: bool,
    /// Physical memory held but not mapped: pieces of handles, taken from
    /// unmapped chunks (stolen, unpinned, or left over from failed maps).
    /// Any piece can be split at granule boundaries and mapped elsewhere.
    spare: Vec<Piece>,
    /// Every physical handle held, with how much of it is mapped (counting
    /// each view of an aliased granule).
    handles: FastMap<PhysicalHandle, HandleInfo>,
    /// Stretches mapped whose `set_access` failed and whose unmap did not
    /// happen: access is granted again before the next request is served.
    without_access: Vec<Stretch>,
    /// Physical memory held: mapped granules, spare handles and segments.
    held_bytes: u64,
    /// Highest `held_bytes` seen: the peak reserved memory (kept here, not
    /// read from the statistics, whose peaks the program may reset).
    peak_held_bytes: u64,
}

impl Physical {
    /// Nothing held, on a device that maps parts of handles or not.
    pub(super) fn new(maps_handle_parts: bool) -> Self {
        Physical {
            maps_handle_parts,
            spare: Vec::new(),
            handles: FastMap::default(),
            without_access: Vec::new(),
            held_bytes: 0,
            peak_held_bytes: 0,
        }
    }

    /// The device maps part of a handle; false: only whole handles move.
    #[inline]
    pub(super) fn maps_handle_parts(&self) -> bool {
        self.maps_handle_parts
    }

    /// Physical memory held: mapped granules, spare handles and segments.
    #[inline]
    pub(super) fn held_bytes(&self) -> u64 {
        self.held_bytes
    }

    /// The most memory held so far.
    #[inline]
    pub(super) fn peak_held_bytes(&self) -> u64 {
        self.peak_held_bytes
    }

    pub(super) fn add_held(&mut self, bytes: u64) {
        self.held_bytes += bytes;
        self.peak_held_bytes = self.peak_held_bytes.max(self.held_bytes);
    }

    pub(super) fn sub_held(&mut self, bytes: u64) {
        self.held_bytes -= bytes;
    }

    /// A handle of `bytes` was created: held, nothing of it mapped yet.
    pub(super) fn add_handle(&mut self, handle: PhysicalHandle, bytes: u64) {
        self.add_held(bytes);
        self.handles.insert(handle, HandleInfo { bytes, mapped: 0 });
    }

    /// `bytes` of `handle` were mapped (`mapped`) or unmapped at one view.
    pub(super) fn count_mapped(&mut self, handle: PhysicalHandle, bytes: u64, mapped: bool) {
        if let Some(info) = self.handles.get_mut(&handle) {
            if mapped {
                info.mapped += bytes;
            } else {
                info.mapped -= bytes;
            }
        }
    }

    /// `bytes` of `handle` from `offset` are held but no longer mapped.
    pub(super) fn add_spare(&mut self, handle: PhysicalHandle, offset: u64, bytes: u64) {
        self.spare.push(Piece {
            handle,
            offset,
            bytes,
        });
    }

    /// Takes the spare piece to map into `room` bytes ([`Physical::spare_for`]),
    /// cut to `room` where handles map in part (the rest stays spare).
    pub(super) fn take_spare(&mut self, room: u64, past: u64) -> Option<Piece> {
        let best = self.spare_for(room, past)?;
        let piece = self.spare.swap_remove(best);
        let take = if self.maps_handle_parts {
            piece.bytes.min(room)
        } else {
            piece.bytes
        };
        if piece.bytes > take {
            self.add_spare(piece.handle, piece.offset + take, piece.bytes - take);
        }
        Some(Piece {
            bytes: take,
            ..piece
        })
    }

    /// The spare piece to map into `room` bytes: the smallest that covers
    /// them, else the largest (cut to fit); where handles map whole only
    /// (pieces are whole handles then, never cut), the largest that fits,
    /// else the smallest that fits in `past` bytes (mapped on past `room`).
    /// The first of equals; `None` when no piece will do.
    fn spare_for(&self, room: u64, past: u64) -> Option<usize> {
        let mut best: Option<usize> = None;
        for (i, piece) in self.spare.iter().enumerate() {
            let Some(b) = best.map(|b| &self.spare[b]) else {
                if self.maps_handle_parts || piece.bytes <= past.max(room) {
                    best = Some(i);
                }
                continue;
            };
            let better = if !self.maps_handle_parts {
                match (piece.bytes <= room, b.bytes <= room) {
                    (true, true) => piece.bytes > b.bytes,
                    (true, false) => true,
                    (false, true) => false,
                    (false, false) => piece.bytes <= past && piece.bytes < b.bytes,
                }
            } else {
                match (piece.bytes >= room, b.bytes >= room) {
                    (true, true) => piece.bytes < b.bytes,
                    (true, false) => true,
                    (false, true) => false,
                    (false, false) => piece.bytes > b.bytes,
                }
            };
            if better {
                best = Some(i);
            }
        }
        debug_assert!(best.is_none_or(|b| {
            let piece = &self.spare[b];
            self.movable(piece.handle, piece.offset, piece.bytes)
        }));
        best
    }

    /// Whether `bytes` of `handle` from byte `offset` may be mapped
    /// somewhere on their own: any part of a handle where the device maps
    /// parts, else all of it only.
    #[inline]
    pub(super) fn movable(&self, handle: PhysicalHandle, offset: u64, bytes: u64) -> bool {
        self.maps_handle_parts
            || (offset == 0 && self.handles.get(&handle).is_some_and(|h| h.bytes == bytes))
    }

    /// The size of `handle`, which is held.
    pub(super) fn handle_bytes(&self, handle: PhysicalHandle) -> u64 {
        self.handles[&handle].bytes
    }

    /// The most granules a new handle holds on a device that maps whole
    /// handles only: `configured` (`whole_handle_granules`,
    /// [`super::HbmConfig`]), or by default a share of the most memory held
    /// so far ([`WHOLE_HANDLE_HEAP_DIVISOR`]). That never shrinks, so no
    /// handle made earlier is larger than one made now.
    pub(super) fn whole_handle_granules(&self, configured: Option<u64>, granule: u64) -> u64 {
        configured.unwrap_or_else(|| {
            let scaled = self.peak_held_bytes / granule / WHOLE_HANDLE_HEAP_DIVISOR;
            scaled.clamp(
                WHOLE_HANDLE_MIN_GRANULES,
                *WHOLE_HANDLE_GRANULES_RANGE.end(),
            )
        })
    }

    /// Every handle of which nothing is mapped, in handle order.
    pub(super) fn idle_handles(&self) -> Vec<PhysicalHandle> {
        let mut idle: Vec<PhysicalHandle> = self
            .handles
            .iter()
            .filter(|(_, info)| info.mapped == 0)
            .map(|(&h, _)| h)
            .collect();
        idle.sort_unstable();
        idle
    }

    /// Forgets released `handle` and its spare pieces; returns its bytes.
    pub(super) fn forget_handle(&mut self, handle: PhysicalHandle) -> u64 {
        let info = self.handles.remove(&handle).expect("a held handle");
        self.spare.retain(|p| p.handle != handle);
        self.sub_held(info.bytes);
        info.bytes
    }

    /// Some stretch is mapped without access.
    #[inline]
    pub(super) fn missing_access(&self) -> bool {
        !self.without_access.is_empty()
    }

    /// A stretch left mapped without access, to be granted it later.
    pub(super) fn left_without_access(&mut self, stretch: Stretch) {
        self.without_access.push(stretch);
    }

    /// The stretch without access to grant next, if any.
    pub(super) fn next_without_access(&self) -> Option<Stretch> {
        self.without_access.last().copied()
    }

    /// The stretch [`Physical::next_without_access`] named has access now.
    pub(super) fn access_granted(&mut self) {
        self.without_access.pop();
    }

    /// Each granule of each handle is mapped (`views`: at one or more
    /// places) or spare, never both. Returns the spare granules and the
    /// bytes of every handle.
    pub(super) fn check(
        &self,
        views: &BTreeMap<PhysicalGranule, Vec<View>>,
        granule: u64,
    ) -> Result<(BTreeSet<PhysicalGranule>, u64), String> {
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
        Ok((spare_granules, handle_bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 2 << 20;

    /// Where handles map in part, a spare is cut to the room and the rest
    /// stays spare; where they map whole, a piece larger than the room is
    /// taken whole only if it fits in `past`.
    #[test]
    fn spares_are_cut_only_where_handles_map_in_part() {
        let mut parts = Physical::new(true);
        parts.add_handle(PhysicalHandle(1), 8 * G);
        parts.add_spare(PhysicalHandle(1), 0, 8 * G);
        let piece = parts.take_spare(3 * G, 3 * G).unwrap();
        assert_eq!((piece.offset, piece.bytes), (0, 3 * G));
        let rest = parts.take_spare(8 * G, 8 * G).unwrap();
        assert_eq!((rest.offset, rest.bytes), (3 * G, 5 * G));
        assert!(parts.take_spare(G, G).is_none());

        let mut whole = Physical::new(false);
        whole.add_handle(PhysicalHandle(2), 8 * G);
        whole.add_spare(PhysicalHandle(2), 0, 8 * G);
        assert!(whole.take_spare(3 * G, 4 * G).is_none());
        let piece = whole.take_spare(3 * G, 8 * G).unwrap();
        assert_eq!((piece.offset, piece.bytes), (0, 8 * G));
        assert!(whole.movable(PhysicalHandle(2), 0, 8 * G));
        assert!(!whole.movable(PhysicalHandle(2), 0, 4 * G));
    }

    /// Held bytes and their peak follow handles created and forgotten.
    #[test]
    fn held_bytes_keep_their_peak() {
        let mut physical = Physical::new(true);
        physical.add_handle(PhysicalHandle(1), 4 * G);
        physical.add_handle(PhysicalHandle(2), 2 * G);
        physical.count_mapped(PhysicalHandle(2), 2 * G, true);
        assert_eq!(physical.idle_handles(), vec![PhysicalHandle(1)]);
        assert_eq!(physical.forget_handle(PhysicalHandle(1)), 4 * G);
        assert_eq!(physical.held_bytes(), 2 * G);
        assert_eq!(physical.peak_held_bytes(), 6 * G);
    }
}

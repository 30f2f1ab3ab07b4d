//! The lock every engine-level mutex is taken through.

use std::sync::{Mutex, MutexGuard};

/// Locks `mutex`, also after another thread panicked holding it.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic in another thread cannot leave an allocator half-updated in a
    // way later calls could not detect (`check_invariants` would say so), and
    // refusing every later call would lose track of live memory.
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

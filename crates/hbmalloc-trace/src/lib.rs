//! Allocation traces: the model and the importers for real formats.
//!
//! This crate knows file formats and nothing of the engine: it turns a
//! PyTorch memory snapshot, a torch.profiler chrome trace or an RMM log into a
//! [`Trace`] with [`load`] or [`parse_bytes`]. Replay lives in `hbmalloc-replay`.

mod chrome;
mod draw;
mod error;
mod import;
mod jitter;
pub mod model;
pub mod pickle;
mod repeat;
mod rmm;
mod rng;
mod snapshot;

pub use draw::draw_steps;
pub use error::{Location, TraceError};
pub use import::{load, parse_bytes, MAX_DECOMPRESSED_BYTES};
pub use jitter::{jitter_sizes, JITTER_PERCENT};
pub use model::*;
pub use repeat::{find_last_step, repeat_last_step, Step, MIN_STEP_OPS};
pub use snapshot::DEFERRED_FREE_STREAM_BASE;

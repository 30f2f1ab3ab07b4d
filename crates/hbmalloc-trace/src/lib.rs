//! Allocation traces: the model and the importers for real formats.
//!
//! This crate knows file formats and nothing of the engine: it turns a
//! PyTorch memory snapshot, a torch.profiler chrome trace or an RMM log into a
//! [`Trace`]. Replay lives in `hbmalloc-replay`.

pub mod model;

pub use model::*;

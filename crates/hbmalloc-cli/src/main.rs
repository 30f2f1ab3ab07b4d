//! The `hbmalloc` command.
fn main() {}

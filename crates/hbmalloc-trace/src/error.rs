//! The one error type every importer returns.

use std::fmt;

/// Where in the input a problem was found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location {
    /// Nowhere in particular (the file as a whole).
    File,
    /// A byte offset into the (decompressed) input.
    Byte(u64),
    /// A 1-based line (and, where known, 1-based column).
    Line {
        /// Line number, from 1.
        line: usize,
        /// Column number, from 1 (0 when unknown).
        column: usize,
    },
    /// A path to an entry of the decoded document, e.g. `device_traces[0][12].size`.
    Entry(String),
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::File => f.write_str("file"),
            Location::Byte(offset) => write!(f, "byte {offset}"),
            Location::Line { line, column: 0 } => write!(f, "line {line}"),
            Location::Line { line, column } => write!(f, "line {line} column {column}"),
            Location::Entry(path) => f.write_str(path),
        }
    }
}

/// Why a file could not be turned into a [`Trace`](crate::Trace).
///
/// Displays as one line: `file: format: where: what`, e.g.
/// `traces/cs336.pickle: pickle: byte 1234: refused global 'os.system' (only plain data is accepted)`;
/// `where` is left out when it is the file as a whole, and a file that could
/// not be read says so: `traces/x.pickle: cannot read: No such file or directory`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceError {
    /// The path as given to [`load`](crate::load) (or the name given to
    /// [`parse_bytes`](crate::parse_bytes)).
    pub file: String,
    /// The format being read: `pickle`, `snapshot`, `chrome-trace`, `rmm-csv`, `gzip`, `io`, ...
    pub format: &'static str,
    /// Where the problem is.
    pub location: Location,
    /// What is wrong.
    pub message: String,
}

impl TraceError {
    /// Builds an error; the file name is filled in by the caller that knows it.
    pub(crate) fn new(
        format: &'static str,
        location: Location,
        message: impl Into<String>,
    ) -> Self {
        TraceError {
            file: String::new(),
            format,
            location,
            message: message.into(),
        }
    }

    /// Names the file the error came from.
    pub(crate) fn in_file(mut self, file: &str) -> Self {
        self.file = file.to_string();
        self
    }
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.location, self.format) {
            (Location::File, "io") => write!(f, "{}: cannot read: {}", self.file, self.message),
            (Location::File, format) => write!(f, "{}: {format}: {}", self.file, self.message),
            (location, format) => {
                write!(f, "{}: {format}: {location}: {}", self.file, self.message)
            }
        }
    }
}

impl std::error::Error for TraceError {}

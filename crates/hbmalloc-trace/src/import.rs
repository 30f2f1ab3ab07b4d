//! Format detection and the public entry points.

use std::io::Read;
use std::path::Path;

use crate::chrome::parse_chrome_trace;
use crate::error::{Location, TraceError};
use crate::model::Trace;
use crate::rmm::{parse_rmm_csv, RMM_HEADER};
use crate::{pickle, snapshot};

/// Largest decompressed size accepted from a gzip file, so a small
/// compressed bomb cannot exhaust memory.
pub const MAX_DECOMPRESSED_BYTES: u64 = 1 << 30;

/// Reads the trace in `path`, detecting its format from its content.
pub fn load(path: &Path) -> Result<Trace, TraceError> {
    let name = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    // Errors name the path as given, so that the directory is not lost.
    let shown = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|e| {
        let mut message = e.to_string();
        if e.kind() == std::io::ErrorKind::NotFound && shown.contains(['*', '?', '[']) {
            message += ": no file matches this pattern";
        }
        TraceError::new("io", Location::File, message).in_file(&shown)
    })?;
    parse_bytes(&name, &bytes).map_err(|e| e.in_file(&shown))
}

/// Parses `bytes` (the content of a file called `name`, used in errors and as
/// [`Trace::source`]), detecting the format from the content:
/// a pickle (protocol header `0x80`) is a PyTorch memory snapshot, gzip is
/// unpacked and detected again, JSON (`{` or `[`) is a torch.profiler chrome
/// trace, and a `Thread,Time,Action,Pointer,Size,Stream` header is an RMM log.
pub fn parse_bytes(name: &str, bytes: &[u8]) -> Result<Trace, TraceError> {
    let result = if bytes.starts_with(&[0x1f, 0x8b]) {
        gunzip(bytes).and_then(|inner| {
            if inner.starts_with(&[0x1f, 0x8b]) {
                Err(TraceError::new("gzip", Location::File, "gzip inside gzip"))
            } else {
                parse_plain(name, &inner)
            }
        })
    } else {
        parse_plain(name, bytes)
    };
    match result {
        Ok(mut trace) => {
            trace.source = name.to_string();
            Ok(trace)
        }
        Err(error) => Err(error.in_file(name)),
    }
}

fn parse_plain(name: &str, bytes: &[u8]) -> Result<Trace, TraceError> {
    let text_start = bytes
        .strip_prefix("\u{feff}".as_bytes())
        .unwrap_or(bytes)
        .trim_ascii_start();
    if bytes.first() == Some(&0x80) {
        let doc = pickle::parse(bytes)?;
        snapshot::snapshot_to_trace(&doc)
    } else if text_start.starts_with(b"{") || text_start.starts_with(b"[") {
        parse_chrome_trace(bytes)
    } else if text_start.starts_with(RMM_HEADER.as_bytes()) {
        parse_rmm_csv(name, bytes)
    } else {
        Err(TraceError::new(
            "detect",
            Location::Byte(0),
            "unrecognized format (expected a pickle, gzip, JSON or an RMM CSV header)",
        ))
    }
}

fn gunzip(bytes: &[u8]) -> Result<Vec<u8>, TraceError> {
    gunzip_at_most(bytes, MAX_DECOMPRESSED_BYTES)
}

fn gunzip_at_most(bytes: &[u8], max_bytes: u64) -> Result<Vec<u8>, TraceError> {
    let mut inner = Vec::new();
    flate2::read::GzDecoder::new(bytes)
        .take(max_bytes + 1)
        .read_to_end(&mut inner)
        .map_err(|e| TraceError::new("gzip", Location::File, format!("cannot decompress: {e}")))?;
    if inner.len() as u64 > max_bytes {
        return Err(TraceError::new(
            "gzip",
            Location::File,
            format!("decompresses to more than {max_bytes} bytes"),
        ));
    }
    Ok(inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gzip_is_unpacked_whole_up_to_the_limit_and_refused_past_it() {
        let text = b"0123456789";
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, text).unwrap();
        let gz = gz.finish().unwrap();
        assert_eq!(gunzip_at_most(&gz, 10).unwrap(), text);
        let error = gunzip_at_most(&gz, 9).unwrap_err().to_string();
        assert!(
            error.contains("decompresses to more than 9 bytes"),
            "{error}"
        );
    }
}

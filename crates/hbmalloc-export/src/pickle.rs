//! A minimal pickle writer for plain data (protocol 2).
//!
//! It writes only the opcodes any unpickler since Python 2.3 reads and that
//! build no object: `None`, booleans, integers, floats, `str`, lists, tuples
//! and dicts. No memo, no globals, so the output loads in Python's
//! `pickle.load` and in `hbmalloc_trace`'s safe unpickler alike.

/// A plain-data value, as Python sees it after unpickling.
#[derive(Clone, Debug, PartialEq)]
pub enum PickleValue {
    /// `None`.
    None,
    /// `True` / `False`.
    Bool(bool),
    /// An `int` (any value of `i128`; pointers and sizes fit).
    Int(i128),
    /// A `float`.
    Float(f64),
    /// A `str`.
    Str(String),
    /// A `list`.
    List(Vec<PickleValue>),
    /// A `tuple`.
    Tuple(Vec<PickleValue>),
    /// A `dict`, keys in the order given (Python keeps insertion order).
    Dict(Vec<(PickleValue, PickleValue)>),
}

impl PickleValue {
    /// A `str` value.
    pub fn str(text: impl Into<String>) -> Self {
        PickleValue::Str(text.into())
    }

    /// An `int` value from anything that widens to `i128`.
    pub fn int(value: impl Into<i128>) -> Self {
        PickleValue::Int(value.into())
    }

    /// A dict keyed by strings.
    pub fn dict<K: Into<String>>(pairs: impl IntoIterator<Item = (K, PickleValue)>) -> Self {
        PickleValue::Dict(
            pairs
                .into_iter()
                .map(|(k, v)| (PickleValue::Str(k.into()), v))
                .collect(),
        )
    }
}

const PROTO: u8 = 0x80;
const STOP: u8 = b'.';
const MARK: u8 = b'(';
const NONE: u8 = b'N';
const NEWTRUE: u8 = 0x88;
const NEWFALSE: u8 = 0x89;
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const BININT: u8 = b'J';
const LONG1: u8 = 0x8a;
const BINFLOAT: u8 = b'G';
const BINUNICODE: u8 = b'X';
const EMPTY_LIST: u8 = b']';
const APPENDS: u8 = b'e';
const EMPTY_TUPLE: u8 = b')';
const TUPLE: u8 = b't';
const EMPTY_DICT: u8 = b'}';
const SETITEMS: u8 = b'u';

/// Items per `APPENDS`/`SETITEMS` batch, as CPython's pickler writes them.
const BATCH: usize = 1000;

/// Serialises `value` as a protocol-2 pickle.
pub fn to_pickle(value: &PickleValue) -> Vec<u8> {
    let mut out = vec![PROTO, 2];
    write_value(&mut out, value);
    out.push(STOP);
    out
}

fn write_value(out: &mut Vec<u8>, value: &PickleValue) {
    match value {
        PickleValue::None => out.push(NONE),
        PickleValue::Bool(true) => out.push(NEWTRUE),
        PickleValue::Bool(false) => out.push(NEWFALSE),
        PickleValue::Int(n) => write_int(out, *n),
        PickleValue::Float(x) => {
            out.push(BINFLOAT);
            out.extend_from_slice(&x.to_be_bytes());
        }
        PickleValue::Str(s) => write_str(out, s),
        PickleValue::List(items) => {
            out.push(EMPTY_LIST);
            for batch in items.chunks(BATCH) {
                out.push(MARK);
                for item in batch {
                    write_value(out, item);
                }
                out.push(APPENDS);
            }
        }
        PickleValue::Tuple(items) if items.is_empty() => out.push(EMPTY_TUPLE),
        PickleValue::Tuple(items) => {
            out.push(MARK);
            for item in items {
                write_value(out, item);
            }
            out.push(TUPLE);
        }
        PickleValue::Dict(pairs) => {
            out.push(EMPTY_DICT);
            for batch in pairs.chunks(BATCH) {
                out.push(MARK);
                for (key, value) in batch {
                    write_value(out, key);
                    write_value(out, value);
                }
                out.push(SETITEMS);
            }
        }
    }
}

fn write_int(out: &mut Vec<u8>, n: i128) {
    if let Ok(small) = u8::try_from(n) {
        out.extend_from_slice(&[BININT1, small]);
    } else if let Ok(medium) = u16::try_from(n) {
        out.push(BININT2);
        out.extend_from_slice(&medium.to_le_bytes());
    } else if let Ok(word) = i32::try_from(n) {
        out.push(BININT);
        out.extend_from_slice(&word.to_le_bytes());
    } else {
        // LONG1: the shortest little-endian two's complement encoding.
        let bytes = n.to_le_bytes();
        let mut len = bytes.len();
        while len > 1 {
            let top = bytes[len - 1];
            let sign_of_next = bytes[len - 2] & 0x80;
            if (top == 0 && sign_of_next == 0) || (top == 0xff && sign_of_next != 0) {
                len -= 1;
            } else {
                break;
            }
        }
        out.push(LONG1);
        // At most 16 bytes: always fits in the one-byte length.
        out.push(len as u8);
        out.extend_from_slice(&bytes[..len]);
    }
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    out.push(BINUNICODE);
    // Strings here are keys and names, far below 4 GiB; saturate rather
    // than wrap should one ever be larger (the unpickler then rejects it).
    let len = u32::try_from(s.len()).unwrap_or(u32::MAX);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn int_bytes(n: i128) -> Vec<u8> {
        let mut out = Vec::new();
        write_int(&mut out, n);
        out
    }

    #[test]
    fn integers_use_the_shortest_opcode() {
        assert_eq!(int_bytes(0), vec![BININT1, 0]);
        assert_eq!(int_bytes(255), vec![BININT1, 255]);
        assert_eq!(int_bytes(256), vec![BININT2, 0, 1]);
        assert_eq!(int_bytes(-1), vec![BININT, 0xff, 0xff, 0xff, 0xff]);
        // 2**31 needs a fifth byte so the sign bit stays clear.
        assert_eq!(int_bytes(1 << 31), vec![LONG1, 5, 0, 0, 0, 0x80, 0]);
        assert_eq!(int_bytes(-(1 << 40)), vec![LONG1, 6, 0, 0, 0, 0, 0, 0xff]);
        assert_eq!(
            int_bytes(i128::from(u64::MAX)),
            vec![LONG1, 9, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0]
        );
    }

    #[test]
    fn a_small_dict_matches_cpython() {
        // pickle.dumps({"a": [1, True, None]}, protocol=2) without memo
        // (pickletools.optimize drops the BINPUTs).
        let value = PickleValue::dict([(
            "a",
            PickleValue::List(vec![
                PickleValue::int(1),
                PickleValue::Bool(true),
                PickleValue::None,
            ]),
        )]);
        let expected: &[u8] = b"\x80\x02}(X\x01\x00\x00\x00a](K\x01\x88Neu.";
        assert_eq!(to_pickle(&value), expected);
    }

    #[test]
    fn tuples_are_empty_or_marked() {
        // pickle.dumps((), protocol=2); a non-empty tuple is MARK ... TUPLE,
        // which pickle.loads reads as (1, 2).
        assert_eq!(to_pickle(&PickleValue::Tuple(Vec::new())), b"\x80\x02).");
        let pair = PickleValue::Tuple(vec![PickleValue::int(1), PickleValue::int(2)]);
        assert_eq!(to_pickle(&pair), b"\x80\x02(K\x01K\x02t.");
    }
}

//! A safe reader for Python pickles that hold plain data only.
//!
//! Snapshots from `torch.cuda.memory._dump_snapshot` are dicts, lists, tuples,
//! strings and numbers. Loading a pickle with Python would run whatever code it
//! names, so this reader understands only the data opcodes of protocols 2–5
//! and refuses every opcode that imports a name, calls something or builds an
//! object (`GLOBAL`, `REDUCE`, `BUILD`, ...).
//!
//! Values live in an arena ([`Document`]) and refer to each other by
//! [`ValueId`]. Pickles share objects through the memo and mutate containers
//! after memoizing them, so an arena keeps those aliases right without
//! reference counting, and dropping or walking a document never recurses.
//!
//! Every length read from the input is checked against the bytes that remain,
//! and the stack, the mark stack, the memo and the arena are bounded. An
//! opcode of one or two bytes can make a value of 32, so the arena is what
//! bounds memory: at most [`MAX_VALUES`] values, about 4 GiB, more than a
//! snapshot within the importer's 1 GiB input limit holds (real ones hold a
//! value for every 12 bytes or more).

use std::collections::HashMap;

use crate::error::{Location, TraceError};

/// Names one value in a [`Document`].
pub type ValueId = usize;

/// One decoded Python value. Containers hold the ids of their items.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// `None`.
    None,
    /// `True` / `False`.
    Bool(bool),
    /// An integer (at most 16 bytes wide; wider ones are refused).
    Int(i128),
    /// A float.
    Float(f64),
    /// A text string.
    Str(String),
    /// A byte string (`bytes`, `bytearray`, or a protocol-2 `str`).
    Bytes(Vec<u8>),
    /// A list.
    List(Vec<ValueId>),
    /// A tuple.
    Tuple(Vec<ValueId>),
    /// A dict, as (key, value) pairs in insertion order; a later pair wins.
    Dict(Vec<(ValueId, ValueId)>),
}

impl Value {
    /// The Python type name, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::None => "None",
            Value::Bool(_) => "bool",
            Value::Int(_) => "int",
            Value::Float(_) => "float",
            Value::Str(_) => "str",
            Value::Bytes(_) => "bytes",
            Value::List(_) => "list",
            Value::Tuple(_) => "tuple",
            Value::Dict(_) => "dict",
        }
    }
}

/// A decoded pickle: an arena of values and the one the pickle returned.
#[derive(Clone, Debug, PartialEq)]
pub struct Document {
    values: Vec<Value>,
    root: ValueId,
    /// String-key indexes of the large dicts, so that a dict shared through
    /// the memo by many entries costs one scan, not one per lookup.
    large_dict_keys: HashMap<ValueId, HashMap<String, ValueId>>,
}

/// Dicts with more pairs than this are indexed; smaller ones are scanned.
const INDEXED_DICT_PAIRS: usize = 32;

impl Document {
    fn new(values: Vec<Value>, root: ValueId) -> Self {
        let mut large_dict_keys = HashMap::new();
        for (id, value) in values.iter().enumerate() {
            let Value::Dict(pairs) = value else { continue };
            if pairs.len() <= INDEXED_DICT_PAIRS {
                continue;
            }
            let mut index = HashMap::new();
            for &(key, value) in pairs {
                if let Value::Str(key) = &values[key] {
                    // Later pairs win, as in Python.
                    index.insert(key.clone(), value);
                }
            }
            large_dict_keys.insert(id, index);
        }
        Document {
            values,
            root,
            large_dict_keys,
        }
    }

    /// How many values the pickle built.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// True when the pickle built no values (never, for a parsed document).
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The value the pickle returned.
    pub fn root(&self) -> ValueId {
        self.root
    }

    /// The value named `id`.
    pub fn get(&self, id: ValueId) -> &Value {
        &self.values[id]
    }

    /// Every value decoded, in the order the pickle built them.
    pub fn values(&self) -> impl Iterator<Item = &Value> {
        self.values.iter()
    }

    /// The value stored under the string key `key` of the dict `id`, if `id`
    /// is a dict that has it (the last pair wins, as in Python).
    pub fn dict_get(&self, id: ValueId, key: &str) -> Option<ValueId> {
        if let Some(index) = self.large_dict_keys.get(&id) {
            return index.get(key).copied();
        }
        match self.get(id) {
            Value::Dict(pairs) => pairs
                .iter()
                .rev()
                .find(|(k, _)| matches!(self.get(*k), Value::Str(s) if s == key))
                .map(|&(_, v)| v),
            _ => None,
        }
    }
}

/// Most items the value stack may hold.
const MAX_STACK: usize = 1 << 20;
/// Most nested `MARK`s.
const MAX_MARKS: usize = 1 << 16;
/// Most memo entries.
const MAX_MEMO: usize = 1 << 24;
/// Longest text line (in `GLOBAL`, `GET`, `PUT` arguments).
const MAX_LINE: usize = 1 << 10;
/// Most values a document holds.
const MAX_VALUES: usize = 1 << 27;

/// The bounds a parse keeps (smaller ones in tests).
struct Limits {
    memo: usize,
    values: usize,
}

/// Decodes `bytes` as a pickle of plain data.
///
/// Errors carry the byte offset of the offending opcode and format `pickle`;
/// the caller adds the file name.
pub fn parse(bytes: &[u8]) -> Result<Document, TraceError> {
    parse_with_limits(
        bytes,
        Limits {
            memo: MAX_MEMO,
            values: MAX_VALUES,
        },
    )
}

fn parse_with_limits(bytes: &[u8], limits: Limits) -> Result<Document, TraceError> {
    Parser {
        input: bytes,
        pos: 0,
        op_start: 0,
        values: Vec::new(),
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
        limits,
    }
    .run()
}

struct Parser<'a> {
    input: &'a [u8],
    pos: usize,
    /// Offset of the opcode being executed, for errors.
    op_start: usize,
    values: Vec<Value>,
    stack: Vec<ValueId>,
    /// Stack heights at each open `MARK`.
    marks: Vec<usize>,
    memo: HashMap<u32, ValueId>,
    /// [`MAX_MEMO`] and [`MAX_VALUES`] but in tests.
    limits: Limits,
}

impl Parser<'_> {
    fn error(&self, message: impl Into<String>) -> TraceError {
        TraceError::new("pickle", Location::Byte(self.op_start as u64), message)
    }

    fn take(&mut self, len: usize) -> Result<&[u8], TraceError> {
        let remaining = self.input.len() - self.pos;
        if len > remaining {
            return Err(self.error(format!(
                "needs {len} bytes but only {remaining} remain (truncated, or a corrupt length)"
            )));
        }
        let bytes = &self.input[self.pos..self.pos + len];
        self.pos += len;
        Ok(bytes)
    }

    fn take_array<const N: usize>(&mut self) -> Result<[u8; N], TraceError> {
        let mut array = [0u8; N];
        array.copy_from_slice(self.take(N)?);
        Ok(array)
    }

    fn take_u8(&mut self) -> Result<u8, TraceError> {
        Ok(self.take_array::<1>()?[0])
    }

    /// A length field of `N` little-endian bytes, as usize.
    fn take_len<const N: usize>(&mut self) -> Result<usize, TraceError> {
        let bytes = self.take_array::<N>()?;
        let mut wide = [0u8; 8];
        wide[..N].copy_from_slice(&bytes);
        let len = u64::from_le_bytes(wide);
        usize::try_from(len).map_err(|_| self.error(format!("declared length {len} is too large")))
    }

    fn take_line(&mut self) -> Result<String, TraceError> {
        let rest = &self.input[self.pos..];
        let end = rest
            .iter()
            .take(MAX_LINE)
            .position(|&b| b == b'\n')
            .ok_or_else(|| self.error("unterminated text argument"))?;
        let line = String::from_utf8_lossy(&rest[..end]).into_owned();
        self.pos += end + 1;
        Ok(line)
    }

    fn push_value(&mut self, value: Value) -> Result<(), TraceError> {
        if self.values.len() >= self.limits.values {
            return Err(self.error(format!(
                "more than {} values (larger than any memory snapshot)",
                self.limits.values
            )));
        }
        self.values.push(value);
        self.push_id(self.values.len() - 1)
    }

    fn push_id(&mut self, id: ValueId) -> Result<(), TraceError> {
        if self.stack.len() >= MAX_STACK {
            return Err(self.error(format!("stack deeper than {MAX_STACK} items")));
        }
        self.stack.push(id);
        Ok(())
    }

    fn pop(&mut self) -> Result<ValueId, TraceError> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(self.error("stack underflow"));
        }
        Ok(self.stack.pop().expect("checked non-empty above"))
    }

    fn top(&self) -> Result<ValueId, TraceError> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(self.error("stack underflow"));
        }
        Ok(self.stack[self.stack.len() - 1])
    }

    /// Pops everything above the last `MARK`, and the mark.
    fn pop_to_mark(&mut self) -> Result<Vec<ValueId>, TraceError> {
        let mark = self
            .marks
            .pop()
            .ok_or_else(|| self.error("no MARK to pop to"))?;
        Ok(self.stack.split_off(mark))
    }

    fn memo_put(&mut self, key: u32) -> Result<(), TraceError> {
        let id = self.top()?;
        if self.memo.len() >= self.limits.memo && !self.memo.contains_key(&key) {
            return Err(self.error(format!("memo larger than {} entries", self.limits.memo)));
        }
        self.memo.insert(key, id);
        Ok(())
    }

    fn memo_get(&mut self, key: u32) -> Result<(), TraceError> {
        let id = *self
            .memo
            .get(&key)
            .ok_or_else(|| self.error(format!("memo key {key} was never stored")))?;
        self.push_id(id)
    }

    fn memo_key_from_line(&mut self) -> Result<u32, TraceError> {
        let line = self.take_line()?;
        line.trim()
            .parse()
            .map_err(|_| self.error(format!("bad memo key {line:?}")))
    }

    /// A text string. Python writes `str` with `surrogatepass`, so a lone
    /// surrogate (say, in a frame's file name) arrives as bytes that are not
    /// UTF-8; such strings are decoded with replacement characters rather
    /// than refusing the file.
    fn push_str(&mut self, len: usize) -> Result<(), TraceError> {
        let text = String::from_utf8_lossy(self.take(len)?).into_owned();
        self.push_value(Value::Str(text))
    }

    fn push_bytes(&mut self, len: usize) -> Result<(), TraceError> {
        let bytes = self.take(len)?.to_vec();
        self.push_value(Value::Bytes(bytes))
    }

    /// A little-endian two's-complement integer of `len` bytes (LONG1/LONG4).
    fn push_long(&mut self, len: usize) -> Result<(), TraceError> {
        if len > 16 {
            // Check the bytes exist first, so truncation is reported as such.
            self.take(len)?;
            return Err(self.error(format!("integer of {len} bytes is too large")));
        }
        let bytes = self.take(len)?;
        let negative = bytes.last().is_some_and(|&b| b & 0x80 != 0);
        let mut wide = if negative { [0xffu8; 16] } else { [0u8; 16] };
        wide[..len].copy_from_slice(bytes);
        self.push_value(Value::Int(i128::from_le_bytes(wide)))
    }

    fn container_mut(&mut self, id: ValueId) -> &mut Value {
        &mut self.values[id]
    }

    fn append(&mut self, items: Vec<ValueId>, opcode: &str) -> Result<(), TraceError> {
        let target = self.top()?;
        match self.container_mut(target) {
            Value::List(list) => {
                list.extend(items);
                Ok(())
            }
            other => {
                let found = other.type_name();
                Err(self.error(format!("{opcode} to a {found}, not a list")))
            }
        }
    }

    fn set_items(&mut self, items: Vec<ValueId>, opcode: &str) -> Result<(), TraceError> {
        if items.len() & 1 == 1 {
            return Err(self.error(format!("{opcode} with an odd number of items")));
        }
        let target = self.top()?;
        match self.container_mut(target) {
            Value::Dict(pairs) => {
                pairs.extend(items.chunks_exact(2).map(|pair| (pair[0], pair[1])));
                Ok(())
            }
            other => {
                let found = other.type_name();
                Err(self.error(format!("{opcode} on a {found}, not a dict")))
            }
        }
    }

    fn string_on_stack(&self, id: ValueId) -> String {
        match &self.values[id] {
            Value::Str(s) => s.clone(),
            other => format!("<{}>", other.type_name()),
        }
    }

    fn refuse(&self, what: impl std::fmt::Display) -> TraceError {
        self.error(format!("refused {what} (only plain data is accepted)"))
    }

    fn run(mut self) -> Result<Document, TraceError> {
        loop {
            self.op_start = self.pos;
            if self.pos >= self.input.len() {
                return Err(self.error("input ended before STOP (truncated)"));
            }
            let opcode = self.take_u8()?;
            match opcode {
                0x80 => {
                    let protocol = self.take_u8()?;
                    if protocol > 5 {
                        return Err(self.error(format!("unsupported protocol {protocol}")));
                    }
                }
                // FRAME: a length hint for buffering; the opcodes follow inline.
                0x95 => {
                    self.take_array::<8>()?;
                }
                b'.' => {
                    let root = self.pop()?;
                    if !self.marks.is_empty() {
                        return Err(self.error("STOP with an open MARK"));
                    }
                    return Ok(Document::new(self.values, root));
                }
                b'(' => {
                    if self.marks.len() >= MAX_MARKS {
                        return Err(self.error(format!("more than {MAX_MARKS} nested MARKs")));
                    }
                    self.marks.push(self.stack.len());
                }
                b'0' => {
                    self.pop()?;
                }
                b'1' => {
                    self.pop_to_mark()?;
                }
                b'2' => {
                    let id = self.top()?;
                    self.push_id(id)?;
                }
                b'N' => self.push_value(Value::None)?,
                0x88 => self.push_value(Value::Bool(true))?,
                0x89 => self.push_value(Value::Bool(false))?,
                b'J' => {
                    let n = i32::from_le_bytes(self.take_array()?);
                    self.push_value(Value::Int(n.into()))?;
                }
                b'K' => {
                    let n = self.take_u8()?;
                    self.push_value(Value::Int(n.into()))?;
                }
                b'M' => {
                    let n = u16::from_le_bytes(self.take_array()?);
                    self.push_value(Value::Int(n.into()))?;
                }
                0x8a => {
                    let len = self.take_u8()?.into();
                    self.push_long(len)?;
                }
                0x8b => {
                    let len = i32::from_le_bytes(self.take_array()?);
                    let len = usize::try_from(len)
                        .map_err(|_| self.error(format!("negative length {len}")))?;
                    self.push_long(len)?;
                }
                b'G' => {
                    let x = f64::from_be_bytes(self.take_array()?);
                    self.push_value(Value::Float(x))?;
                }
                0x8c => {
                    let len = self.take_len::<1>()?;
                    self.push_str(len)?;
                }
                b'X' => {
                    let len = self.take_len::<4>()?;
                    self.push_str(len)?;
                }
                0x8d => {
                    let len = self.take_len::<8>()?;
                    self.push_str(len)?;
                }
                b'U' | b'C' => {
                    let len = self.take_len::<1>()?;
                    self.push_bytes(len)?;
                }
                b'B' => {
                    let len = self.take_len::<4>()?;
                    self.push_bytes(len)?;
                }
                b'T' => {
                    let len = i32::from_le_bytes(self.take_array()?);
                    let len = usize::try_from(len)
                        .map_err(|_| self.error(format!("negative length {len}")))?;
                    self.push_bytes(len)?;
                }
                0x8e | 0x96 => {
                    let len = self.take_len::<8>()?;
                    self.push_bytes(len)?;
                }
                b'}' => self.push_value(Value::Dict(Vec::new()))?,
                b']' => self.push_value(Value::List(Vec::new()))?,
                b')' => self.push_value(Value::Tuple(Vec::new()))?,
                b'd' => {
                    let items = self.pop_to_mark()?;
                    if items.len() & 1 == 1 {
                        return Err(self.error("DICT with an odd number of items"));
                    }
                    let pairs = items.chunks_exact(2).map(|p| (p[0], p[1])).collect();
                    self.push_value(Value::Dict(pairs))?;
                }
                b'l' => {
                    let items = self.pop_to_mark()?;
                    self.push_value(Value::List(items))?;
                }
                b't' => {
                    let items = self.pop_to_mark()?;
                    self.push_value(Value::Tuple(items))?;
                }
                0x85..=0x87 => {
                    let count = usize::from(opcode - 0x84);
                    let mut items = Vec::with_capacity(count);
                    for _ in 0..count {
                        items.push(self.pop()?);
                    }
                    items.reverse();
                    self.push_value(Value::Tuple(items))?;
                }
                b'a' => {
                    let item = self.pop()?;
                    self.append(vec![item], "APPEND")?;
                }
                b'e' => {
                    let items = self.pop_to_mark()?;
                    self.append(items, "APPENDS")?;
                }
                b's' => {
                    let value = self.pop()?;
                    let key = self.pop()?;
                    self.set_items(vec![key, value], "SETITEM")?;
                }
                b'u' => {
                    let items = self.pop_to_mark()?;
                    self.set_items(items, "SETITEMS")?;
                }
                b'q' => {
                    let key = self.take_u8()?.into();
                    self.memo_put(key)?;
                }
                b'r' => {
                    let key = u32::from_le_bytes(self.take_array()?);
                    self.memo_put(key)?;
                }
                0x94 => {
                    let key =
                        u32::try_from(self.memo.len()).map_err(|_| self.error("memo overflow"))?;
                    self.memo_put(key)?;
                }
                b'p' => {
                    let key = self.memo_key_from_line()?;
                    self.memo_put(key)?;
                }
                b'h' => {
                    let key = self.take_u8()?.into();
                    self.memo_get(key)?;
                }
                b'j' => {
                    let key = u32::from_le_bytes(self.take_array()?);
                    self.memo_get(key)?;
                }
                b'g' => {
                    let key = self.memo_key_from_line()?;
                    self.memo_get(key)?;
                }
                b'c' | b'i' => {
                    let module = self.take_line()?;
                    let name = self.take_line()?;
                    let kind = if opcode == b'c' { "global" } else { "INST of" };
                    return Err(self.refuse(format!("{kind} '{module}.{name}'")));
                }
                0x93 => {
                    // Name the global if the stack holds its two strings.
                    let described = match self.stack.as_slice() {
                        [.., module, name] => format!(
                            "global '{}.{}'",
                            self.string_on_stack(*module),
                            self.string_on_stack(*name)
                        ),
                        _ => "STACK_GLOBAL".to_string(),
                    };
                    return Err(self.refuse(described));
                }
                _ => {
                    return Err(match refused_opcode_name(opcode) {
                        Some(name) => self.refuse(format!("opcode {name}")),
                        None => self.error(format!("unsupported opcode 0x{opcode:02x}")),
                    })
                }
            }
        }
    }
}

/// Names the opcodes that call code, import names or build objects.
fn refused_opcode_name(opcode: u8) -> Option<&'static str> {
    Some(match opcode {
        b'R' => "REDUCE",
        b'b' => "BUILD",
        b'o' => "OBJ",
        0x81 => "NEWOBJ",
        0x92 => "NEWOBJ_EX",
        b'P' => "PERSID",
        b'Q' => "BINPERSID",
        0x82 => "EXT1",
        0x83 => "EXT2",
        0x84 => "EXT4",
        0x97 => "NEXT_BUFFER",
        0x98 => "READONLY_BUFFER",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_memo_refuses_a_new_key_but_takes_an_old_one_again() {
        // Three lists memoized under keys 0, 1, 2, then key 1 again.
        let bytes = b"\x80\x02]q\x00]q\x01]q\x02q\x01h\x01.";
        let limits = |memo| Limits {
            memo,
            values: MAX_VALUES,
        };
        let doc = parse_with_limits(bytes, limits(3)).unwrap();
        assert_eq!(doc.root(), 2, "key 1 now names the third list");
        let error = parse_with_limits(bytes, limits(2)).unwrap_err().to_string();
        assert!(
            error.contains("byte 9: memo larger than 2 entries"),
            "{error}"
        );
    }

    /// Values that cost the input a byte or two each (`N` and `POP`, over
    /// and over) stop at the arena's bound with an error, not at the
    /// machine's memory.
    #[test]
    fn the_arena_is_bounded() {
        let mut bytes = b"\x80\x02".to_vec();
        for _ in 0..5 {
            bytes.extend_from_slice(b"N0");
        }
        bytes.extend_from_slice(b"N.");
        let limits = |values| Limits {
            memo: MAX_MEMO,
            values,
        };
        // What the module's bound on memory counts per value.
        assert_eq!(std::mem::size_of::<Value>(), 32);
        assert!(parse_with_limits(&bytes, limits(6)).is_ok());
        let error = parse_with_limits(&bytes, limits(5))
            .unwrap_err()
            .to_string();
        assert!(error.contains("byte 12: more than 5 values"), "{error}");
    }
}

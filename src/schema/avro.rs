//! Avro: a payload's JSON written in Avro's binary encoding against a
//! registry schema.
//!
//! The schema is parsed by `apache-avro` and compiled once into a tree of
//! [`Node`]s (named types resolved to indexes, so recursive records work).
//! A payload is then written straight from its JSON: no intermediate
//! value, and the first field that does not fit is named by its path.
//!
//! How JSON maps onto Avro (the payload is plain JSON, as writers store
//! it, not Avro's JSON encoding):
//! * `null`, booleans, strings: as themselves. `int` and `long` take
//!   integers in range; `float` and `double` take any fraction (as the
//!   nearest one) and the integers they hold exactly. An integer beyond
//!   64 bits fits no number type: a JSON reader has already rounded it
//!   (see [`super::numbers`]).
//! * a record takes an object: every field of the schema, in the schema's
//!   order; a field the payload lacks takes its default, and without one
//!   is a mismatch. A key the schema does not name is a mismatch too:
//!   encoding would drop it, and outboxd drops nothing silently.
//! * a union takes the first branch the value fits, or Avro's JSON form
//!   `{"<branch name>": value}`.
//! * an enum takes one of its symbols; `bytes` and `fixed` take a string
//!   whose code points are the bytes (Avro's JSON encoding).
//! * logical types: `decimal` takes a number or a decimal string with at
//!   most its scale of fractional digits; `uuid` a UUID string; `date`,
//!   `time-*` and `timestamp-*` their integer, or for `date` an ISO date
//!   and for `timestamp-*` an RFC 3339 time.

use std::collections::HashMap;

use apache_avro::schema::{InnerDecimalSchema, UuidSchema};
use apache_avro::Schema;
use serde_json::Value;

use super::numbers;

/// A compiled schema.
#[derive(Debug)]
pub struct AvroCodec {
    nodes: Vec<Node>,
    root: usize,
    /// The top record's full name (the record-name strategies' subject).
    pub name: Option<String>,
    /// Whether any decimal is in the schema.
    has_decimal: bool,
}

#[derive(Debug)]
enum Node {
    Null,
    Boolean,
    Int,
    Long,
    Float,
    Double,
    Bytes,
    String,
    Array(usize),
    Map(usize),
    Union(Vec<(String, usize)>),
    Record {
        name: String,
        fields: Vec<Field>,
        index: HashMap<String, usize>,
    },
    Enum {
        name: String,
        symbols: Vec<String>,
    },
    Fixed {
        name: String,
        size: usize,
    },
    Decimal {
        scale: usize,
        precision: usize,
        fixed: Option<usize>,
    },
    UuidString,
    UuidBytes(Option<usize>),
    Date,
    TimeMillis,
    TimeMicros,
    /// Timestamps: how many units a second holds, and whether local (no
    /// time zone).
    Timestamp(i64, bool),
    /// Placeholder while a named type's own node is being compiled.
    Pending,
}

#[derive(Debug)]
struct Field {
    name: String,
    node: usize,
    default: Option<Value>,
}

/// How deep an encoded body may nest (recursive records included).
const MAX_DEPTH: usize = 512;

/// How many items of no bytes (nulls) an encoded body's arrays and maps
/// may hold.
const MAX_EMPTY_ITEMS: u64 = 1 << 20;

/// The next `n` bytes of `rest`.
fn take<'a>(rest: &mut &'a [u8], n: usize) -> Result<&'a [u8], String> {
    if rest.len() < n {
        return Err(format!("it ends {} bytes short", n - rest.len()));
    }
    let (head, tail) = rest.split_at(n);
    *rest = tail;
    Ok(head)
}

/// A zig-zag varint long.
fn read_long(rest: &mut &[u8]) -> Result<i64, String> {
    let mut v: u64 = 0;
    for shift in (0..64).step_by(7) {
        let b = take(rest, 1)?[0];
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Ok((v >> 1) as i64 ^ -((v & 1) as i64));
        }
    }
    Err("a varint longer than 10 bytes".into())
}

/// A length-prefixed byte string.
fn read_bytes<'a>(rest: &mut &'a [u8]) -> Result<&'a [u8], String> {
    let len = read_long(rest)?;
    let len = usize::try_from(len).map_err(|_| format!("a negative length {len}"))?;
    take(rest, len)
}

/// Array and map blocks: a count (negative: followed by the block's
/// size in bytes), its items, until a count of 0.
fn read_blocks(
    rest: &mut &[u8],
    mut item: impl FnMut(&mut &[u8]) -> Result<(), String>,
) -> Result<(), String> {
    let mut items: u64 = 0;
    loop {
        let count = read_long(rest)?;
        if count == 0 {
            return Ok(());
        }
        if count < 0 {
            read_long(rest)?;
        }
        // Items of no bytes (nulls) are the only ones a body can hold
        // more of than it has bytes; bound them too.
        items = items.saturating_add(count.unsigned_abs());
        if items > (rest.len() as u64).max(MAX_EMPTY_ITEMS) {
            return Err(format!(
                "a block promises {items} items and the body holds {} bytes",
                rest.len()
            ));
        }
        for _ in 0..count.unsigned_abs() {
            item(rest)?;
        }
    }
}

/// Why a schema cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum AvroSchemaError {
    #[error("not a valid Avro schema: {0}")]
    Parse(String),
    #[error("type {0} is not defined in the schema (schema references are not followed)")]
    UnknownName(String),
    #[error("{0} is not supported")]
    Unsupported(&'static str),
}

/// Where a payload does not fit: the path of the first offending value,
/// and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {reason}")]
pub struct Misfit {
    pub path: String,
    pub reason: String,
}

impl AvroCodec {
    pub fn parse(text: &str) -> Result<Self, AvroSchemaError> {
        let schema = Schema::parse_str(text).map_err(|e| AvroSchemaError::Parse(e.to_string()))?;
        let mut c = Compiler {
            nodes: Vec::new(),
            named: HashMap::new(),
        };
        let root = c.compile(&schema)?;
        let name = match &c.nodes[root] {
            Node::Record { name, .. } | Node::Enum { name, .. } | Node::Fixed { name, .. } => {
                Some(name.clone())
            }
            _ => None,
        };
        let has_decimal = c.nodes.iter().any(|n| matches!(n, Node::Decimal { .. }));
        Ok(AvroCodec {
            nodes: c.nodes,
            root,
            name,
            has_decimal,
        })
    }

    /// Checks an Avro body that arrived encoded (a `bytea` payload): it
    /// must read as one datum of the schema, with no byte left over. Read
    /// by the compiled nodes, with nesting bounded by [`MAX_DEPTH`]: a
    /// recursive schema cannot make a hostile body exhaust the stack, and
    /// a block count cannot promise more items than the body holds.
    pub fn check_datum(&self, body: &[u8]) -> Result<(), Misfit> {
        let mut rest = body;
        self.read(self.root, &mut rest, 0).map_err(|reason| Misfit {
            path: "$".into(),
            reason: format!("the encoded body does not decode against the schema: {reason}"),
        })?;
        if !rest.is_empty() {
            return Err(Misfit {
                path: "$".into(),
                reason: format!("{} bytes are left over after one datum of the schema", rest.len()),
            });
        }
        Ok(())
    }

    /// Reads one datum of `node` off `rest`.
    fn read(&self, node: usize, rest: &mut &[u8], depth: usize) -> Result<(), String> {
        if depth > MAX_DEPTH {
            return Err(format!("it nests deeper than {MAX_DEPTH} levels"));
        }
        let next = depth + 1;
        match &self.nodes[node] {
            Node::Null => {}
            Node::Boolean => match take(rest, 1)? {
                [0 | 1] => {}
                other => return Err(format!("{other:?} is no boolean")),
            },
            Node::Int | Node::Date | Node::TimeMillis => {
                let v = read_long(rest)?;
                i32::try_from(v).map_err(|_| format!("{v} is beyond an int"))?;
            }
            Node::Long | Node::TimeMicros | Node::Timestamp(..) => {
                read_long(rest)?;
            }
            Node::Float => {
                take(rest, 4)?;
            }
            Node::Double => {
                take(rest, 8)?;
            }
            Node::Bytes | Node::UuidBytes(None) | Node::Decimal { fixed: None, .. } => {
                read_bytes(rest)?;
            }
            Node::String | Node::UuidString => {
                std::str::from_utf8(read_bytes(rest)?)
                    .map_err(|e| format!("a string that is not UTF-8: {e}"))?;
            }
            Node::Fixed { size, .. } => {
                take(rest, *size)?;
            }
            Node::UuidBytes(Some(f)) | Node::Decimal { fixed: Some(f), .. } => self.read(*f, rest, next)?,
            Node::Enum { name, symbols } => {
                let i = read_long(rest)?;
                if usize::try_from(i).map_or(true, |i| i >= symbols.len()) {
                    return Err(format!("{i} is no symbol of enum {name}"));
                }
            }
            Node::Union(branches) => {
                let i = read_long(rest)?;
                let (_, branch) = usize::try_from(i)
                    .ok()
                    .and_then(|i| branches.get(i))
                    .ok_or_else(|| format!("{i} is no branch of the union"))?;
                self.read(*branch, rest, next)?;
            }
            Node::Record { fields, .. } => {
                for f in fields {
                    self.read(f.node, rest, next)?;
                }
            }
            Node::Array(items) => read_blocks(rest, |rest| self.read(*items, rest, next))?,
            Node::Map(values) => read_blocks(rest, |rest| {
                std::str::from_utf8(read_bytes(rest)?)
                    .map_err(|e| format!("a map key that is not UTF-8: {e}"))?;
                self.read(*values, rest, next)
            })?,
            Node::Pending => return Err("the schema names a type it never defines".into()),
        }
        Ok(())
    }

    /// Appends the Avro encoding of `value` to `out`.
    /// `text` is the payload `value` was read from: a decimal written as a
    /// JSON number is refused when the text holds a number too long for a
    /// float to keep (the value has already been rounded).
    pub fn encode(&self, value: &Value, text: &str, out: &mut Vec<u8>) -> Result<(), Misfit> {
        let mut path = Path {
            steps: Vec::new(),
            long_numbers: if self.has_decimal {
                numbers::long_numbers(text)
            } else {
                Vec::new()
            },
            huge: numbers::Huge::new(text),
        };
        self.write(self.root, value, &mut path, out, false)
    }

    fn write(
        &self,
        node: usize,
        v: &Value,
        path: &mut Path<'_>,
        out: &mut Vec<u8>,
        default: bool,
    ) -> Result<(), Misfit> {
        match (&self.nodes[node], v) {
            (Node::Null, Value::Null) => Ok(()),
            (Node::Boolean, Value::Bool(b)) => {
                out.push(u8::from(*b));
                Ok(())
            }
            (Node::Int | Node::Long | Node::Float | Node::Double, Value::Number(n))
                if path.huge.holds_number(n) =>
            {
                Err(path.misfit(numbers::HUGE_REASON))
            }
            (Node::Int, Value::Number(n)) => {
                let i = n.as_i64().and_then(|i| i32::try_from(i).ok());
                let i = i.ok_or_else(|| path.misfit(format!("{n} is not an int (a 32-bit integer)")))?;
                zigzag(i64::from(i), out);
                Ok(())
            }
            (Node::Long, Value::Number(n)) => {
                let i = n
                    .as_i64()
                    .ok_or_else(|| path.misfit(format!("{n} is not a long (a 64-bit integer)")))?;
                zigzag(i, out);
                Ok(())
            }
            (Node::Float, Value::Number(n)) => {
                let f = n
                    .as_f64()
                    .ok_or_else(|| path.misfit(format!("{n} is not a number")))?;
                if !numbers::exact_in_f32(n) {
                    return Err(path.misfit(numbers::inexact_reason(n, 32)));
                }
                let narrow = f as f32;
                if !narrow.is_finite() {
                    return Err(path.misfit(format!("{n} is beyond a float (32 bits)")));
                }
                out.extend_from_slice(&narrow.to_le_bytes());
                Ok(())
            }
            (Node::Double, Value::Number(n)) => {
                let f = n
                    .as_f64()
                    .ok_or_else(|| path.misfit(format!("{n} is not a number")))?;
                if !numbers::exact_in_f64(n) {
                    return Err(path.misfit(numbers::inexact_reason(n, 64)));
                }
                out.extend_from_slice(&f.to_le_bytes());
                Ok(())
            }
            (Node::String | Node::UuidString, Value::String(s)) => {
                if matches!(self.nodes[node], Node::UuidString) && uuid::Uuid::parse_str(s).is_err() {
                    return Err(path.misfit(format!("{s:?} is not a UUID")));
                }
                bytes(s.as_bytes(), out);
                Ok(())
            }
            (Node::Bytes, Value::String(s)) => {
                let b = code_points(s)
                    .ok_or_else(|| path.misfit("bytes are written as a string of code points 0 to 255"))?;
                bytes(&b, out);
                Ok(())
            }
            (Node::Fixed { size, .. }, Value::String(s)) => {
                let b = code_points(s).ok_or_else(|| {
                    path.misfit("fixed bytes are written as a string of code points 0 to 255")
                })?;
                if b.len() != *size {
                    return Err(path.misfit(format!("{} bytes where the fixed type holds {size}", b.len())));
                }
                out.extend_from_slice(&b);
                Ok(())
            }
            (Node::UuidBytes(fixed), Value::String(s)) => {
                let u = uuid::Uuid::parse_str(s).map_err(|_| path.misfit(format!("{s:?} is not a UUID")))?;
                if fixed.is_none() {
                    zigzag(16, out);
                }
                out.extend_from_slice(u.as_bytes());
                Ok(())
            }
            (
                Node::Decimal {
                    scale,
                    precision,
                    fixed,
                },
                Value::Number(_) | Value::String(_),
            ) => {
                if v.as_number()
                    .filter(|n| n.is_f64())
                    .and_then(serde_json::Number::as_f64)
                    .is_some_and(|x| path.long_numbers.contains(&x))
                {
                    return Err(path.misfit(
                        "this number has more significant digits than a JSON reader keeps (15 in a fraction), so it was rounded when read: write decimals as strings",
                    ));
                }
                let text = match v {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                };
                let unscaled = unscaled(&text, *scale, *precision).map_err(|r| path.misfit(r))?;
                let be = twos_complement(unscaled);
                match fixed {
                    None => bytes(&be, out),
                    Some(f) => {
                        let Node::Fixed { size, .. } = self.nodes[*f] else {
                            return Err(path.misfit("decimal's fixed type is not fixed"));
                        };
                        if be.len() > size {
                            return Err(path.misfit(format!("{text} does not fit in {size} bytes")));
                        }
                        let pad = if unscaled < 0 { 0xff } else { 0 };
                        out.extend(std::iter::repeat_n(pad, size - be.len()));
                        out.extend_from_slice(&be);
                    }
                }
                Ok(())
            }
            (Node::Date, Value::Number(n)) | (Node::TimeMillis, Value::Number(n)) => {
                let i = n.as_i64().and_then(|i| i32::try_from(i).ok());
                let i = i.ok_or_else(|| path.misfit(format!("{n} is not an int")))?;
                zigzag(i64::from(i), out);
                Ok(())
            }
            (Node::Date, Value::String(s)) => {
                let d = chrono::NaiveDate::parse_from_str(s, "%Y-%m-%d")
                    .map_err(|_| path.misfit(format!("{s:?} is not a date (YYYY-MM-DD)")))?;
                let epoch = chrono::NaiveDate::from_ymd_opt(1970, 1, 1).unwrap_or_default();
                zigzag((d - epoch).num_days(), out);
                Ok(())
            }
            (Node::TimeMicros | Node::Timestamp(..), Value::Number(n)) => {
                let i = n
                    .as_i64()
                    .ok_or_else(|| path.misfit(format!("{n} is not a long")))?;
                zigzag(i, out);
                Ok(())
            }
            (Node::Timestamp(per_sec, local), Value::String(s)) => {
                let t = if *local {
                    chrono::NaiveDateTime::parse_from_str(s, "%Y-%m-%dT%H:%M:%S%.f")
                        .map_err(|_| {
                            path.misfit(format!(
                                "{s:?} is not a local time (YYYY-MM-DDTHH:MM:SS[.f], no offset)"
                            ))
                        })?
                        .and_utc()
                } else {
                    chrono::DateTime::parse_from_rfc3339(s)
                        .map_err(|_| path.misfit(format!("{s:?} is not an RFC 3339 time")))?
                        .to_utc()
                };
                let unit_nanos = 1_000_000_000 / per_sec;
                if i64::from(t.timestamp_subsec_nanos()) % unit_nanos != 0 {
                    return Err(
                        path.misfit(format!("{s} is more precise than the type holds (1/{per_sec} s)"))
                    );
                }
                let units = match per_sec {
                    1_000 => Some(t.timestamp_millis()),
                    1_000_000 => Some(t.timestamp_micros()),
                    _ => t.timestamp_nanos_opt(),
                };
                zigzag(
                    units.ok_or_else(|| path.misfit(format!("{s} is out of range")))?,
                    out,
                );
                Ok(())
            }
            (Node::Enum { symbols, .. }, Value::String(s)) => {
                let i = symbols.iter().position(|x| x == s).ok_or_else(|| {
                    path.misfit(format!(
                        "{s:?} is not a symbol of the enum ({})",
                        symbols.join(", ")
                    ))
                })?;
                zigzag(i as i64, out);
                Ok(())
            }
            (Node::Array(items), Value::Array(a)) => {
                if !a.is_empty() {
                    zigzag(a.len() as i64, out);
                    for (i, item) in a.iter().enumerate() {
                        path.push_index(i);
                        self.write(*items, item, path, out, default)?;
                        path.pop();
                    }
                }
                out.push(0);
                Ok(())
            }
            (Node::Map(values), Value::Object(m)) => {
                if !m.is_empty() {
                    zigzag(m.len() as i64, out);
                    for (k, item) in m {
                        bytes(k.as_bytes(), out);
                        path.push_key(k);
                        self.write(*values, item, path, out, default)?;
                        path.pop();
                    }
                }
                out.push(0);
                Ok(())
            }
            (Node::Record { fields, index, name }, Value::Object(m)) => {
                if let Some(extra) = m.keys().find(|k| !index.contains_key(k.as_str())) {
                    path.push_key(extra);
                    return Err(path.misfit(format!("record {name} has no field {extra:?}")));
                }
                for f in fields {
                    path.push_key(&f.name);
                    match (m.get(&f.name), &f.default) {
                        (Some(v), _) => self.write(f.node, v, path, out, default)?,
                        (None, Some(d)) => self.write(f.node, d, path, out, true)?,
                        (None, None) => {
                            return Err(path.misfit("a required field is missing (it has no default)"))
                        }
                    }
                    path.pop();
                }
                Ok(())
            }
            (Node::Union(branches), v) => self.write_union(branches, v, path, out, default),
            (n, v) => Err(path.misfit(format!("expected {}, found {}", n.kind(), json_kind(v)))),
        }
    }

    fn write_union(
        &self,
        branches: &[(String, usize)],
        v: &Value,
        path: &mut Path<'_>,
        out: &mut Vec<u8>,
        default: bool,
    ) -> Result<(), Misfit> {
        // A field's default is the union's first branch.
        if default {
            if let Some((_, first)) = branches.first() {
                zigzag(0, out);
                return self.write(*first, v, path, out, true);
            }
        }
        let start = out.len();
        let mut first_misfit = None;
        // The exact branch before a lossy or reinterpreting one: an
        // integer goes to int or long before double, a fraction to double
        // before float, a string to string before bytes, an object to a
        // record before a map; ties keep the schema's order.
        let mut order: Vec<usize> = (0..branches.len()).collect();
        order.sort_by_key(|&i| self.nodes[branches[i].1].rank(v));
        for i in order {
            let b = &branches[i].1;
            if !self.nodes[*b].could_take(v) {
                continue;
            }
            zigzag(i as i64, out);
            match self.write(*b, v, path, out, default) {
                Ok(()) => return Ok(()),
                Err(m) => {
                    out.truncate(start);
                    first_misfit.get_or_insert(m);
                }
            }
        }
        // Avro's JSON form of a union value: {"<branch>": value}.
        if let Value::Object(m) = v {
            if m.len() == 1 {
                if let Some((k, inner)) = m.iter().next() {
                    if let Some(i) = branches.iter().position(|(name, _)| name == k) {
                        zigzag(i as i64, out);
                        path.push_key(k);
                        self.write(branches[i].1, inner, path, out, default)?;
                        path.pop();
                        return Ok(());
                    }
                }
            }
        }
        Err(first_misfit.unwrap_or_else(|| {
            let names: Vec<&str> = branches.iter().map(|(n, _)| n.as_str()).collect();
            path.misfit(format!(
                "{} fits no branch of the union [{}]",
                json_kind(v),
                names.join(", ")
            ))
        }))
    }
}

impl Node {
    fn kind(&self) -> &'static str {
        match self {
            Node::Null => "null",
            Node::Boolean => "a boolean",
            Node::Int | Node::Date | Node::TimeMillis => "an int",
            Node::Long | Node::TimeMicros | Node::Timestamp(..) => "a long",
            Node::Float | Node::Double => "a number",
            Node::Bytes | Node::Fixed { .. } => "bytes (a string)",
            Node::String | Node::UuidString | Node::UuidBytes(_) => "a string",
            Node::Decimal { .. } => "a decimal (a number or a string)",
            Node::Array(_) => "an array",
            Node::Map(_) | Node::Record { .. } => "an object",
            Node::Enum { .. } => "an enum symbol (a string)",
            Node::Union(_) => "a union",
            Node::Pending => "a type being defined",
        }
    }

    /// How exactly this node keeps `v` (0: as is), to order union
    /// branches.
    fn rank(&self, v: &Value) -> u8 {
        match (self, v) {
            (Node::Float, Value::Number(_)) => 3,
            (Node::Double, Value::Number(n)) if !n.is_f64() => 2,
            (Node::Double, Value::Number(_)) => 1,
            (Node::Bytes | Node::Fixed { .. }, Value::String(_)) => 1,
            (Node::Map(_), Value::Object(_)) => 1,
            _ => 0,
        }
    }

    /// Whether a value of this JSON kind can be this node at all (the
    /// cheap test that picks union branches).
    fn could_take(&self, v: &Value) -> bool {
        match self {
            Node::Null => v.is_null(),
            Node::Boolean => v.is_boolean(),
            Node::Int | Node::Long | Node::Float | Node::Double | Node::TimeMillis | Node::TimeMicros => {
                v.is_number()
            }
            Node::Date | Node::Timestamp(..) | Node::Decimal { .. } => v.is_number() || v.is_string(),
            Node::Bytes
            | Node::Fixed { .. }
            | Node::String
            | Node::UuidString
            | Node::UuidBytes(_)
            | Node::Enum { .. } => v.is_string(),
            Node::Array(_) => v.is_array(),
            Node::Map(_) | Node::Record { .. } => v.is_object(),
            Node::Union(_) | Node::Pending => true,
        }
    }
}

struct Compiler {
    nodes: Vec<Node>,
    named: HashMap<String, usize>,
}

impl Compiler {
    fn push(&mut self, n: Node) -> usize {
        self.nodes.push(n);
        self.nodes.len() - 1
    }

    fn compile(&mut self, s: &Schema) -> Result<usize, AvroSchemaError> {
        Ok(match s {
            Schema::Null => self.push(Node::Null),
            Schema::Boolean => self.push(Node::Boolean),
            Schema::Int => self.push(Node::Int),
            Schema::Long => self.push(Node::Long),
            Schema::Float => self.push(Node::Float),
            Schema::Double => self.push(Node::Double),
            Schema::Bytes => self.push(Node::Bytes),
            Schema::String => self.push(Node::String),
            Schema::Array(a) => {
                let items = self.compile(&a.items)?;
                self.push(Node::Array(items))
            }
            Schema::Map(m) => {
                let values = self.compile(&m.types)?;
                self.push(Node::Map(values))
            }
            Schema::Union(u) => {
                let mut branches = Vec::new();
                for b in u.variants() {
                    let name = branch_name(b);
                    branches.push((name, self.compile(b)?));
                }
                self.push(Node::Union(branches))
            }
            Schema::Record(r) => {
                let name = r.name.fullname(None);
                let me = self.push(Node::Pending);
                self.named.insert(name.clone(), me);
                let mut fields = Vec::with_capacity(r.fields.len());
                let mut index = HashMap::new();
                for (i, f) in r.fields.iter().enumerate() {
                    let node = self.compile(&f.schema)?;
                    index.insert(f.name.clone(), i);
                    fields.push(Field {
                        name: f.name.clone(),
                        node,
                        default: f.default.clone(),
                    });
                }
                self.nodes[me] = Node::Record { name, fields, index };
                me
            }
            Schema::Enum(e) => {
                let name = e.name.fullname(None);
                let me = self.push(Node::Enum {
                    name: name.clone(),
                    symbols: e.symbols.clone(),
                });
                self.named.insert(name, me);
                me
            }
            Schema::Fixed(f) => self.fixed(f)?,
            Schema::Decimal(d) => {
                let fixed = match &d.inner {
                    InnerDecimalSchema::Bytes => None,
                    InnerDecimalSchema::Fixed(f) => Some(self.fixed(f)?),
                };
                self.push(Node::Decimal {
                    scale: d.scale,
                    precision: d.precision,
                    fixed,
                })
            }
            Schema::BigDecimal => return Err(AvroSchemaError::Unsupported("the big-decimal logical type")),
            Schema::Uuid(UuidSchema::String) => self.push(Node::UuidString),
            Schema::Uuid(UuidSchema::Bytes) => self.push(Node::UuidBytes(None)),
            Schema::Uuid(UuidSchema::Fixed(f)) => {
                let f = self.fixed(f)?;
                self.push(Node::UuidBytes(Some(f)))
            }
            Schema::Date => self.push(Node::Date),
            Schema::TimeMillis => self.push(Node::TimeMillis),
            Schema::TimeMicros => self.push(Node::TimeMicros),
            Schema::TimestampMillis => self.push(Node::Timestamp(1_000, false)),
            Schema::TimestampMicros => self.push(Node::Timestamp(1_000_000, false)),
            Schema::TimestampNanos => self.push(Node::Timestamp(1_000_000_000, false)),
            Schema::LocalTimestampMillis => self.push(Node::Timestamp(1_000, true)),
            Schema::LocalTimestampMicros => self.push(Node::Timestamp(1_000_000, true)),
            Schema::LocalTimestampNanos => self.push(Node::Timestamp(1_000_000_000, true)),
            Schema::Duration(_) => return Err(AvroSchemaError::Unsupported("the duration logical type")),
            Schema::Ref { name } => {
                let full = name.fullname(None);
                *self.named.get(&full).ok_or(AvroSchemaError::UnknownName(full))?
            }
        })
    }

    fn fixed(&mut self, f: &apache_avro::schema::FixedSchema) -> Result<usize, AvroSchemaError> {
        let name = f.name.fullname(None);
        let me = self.push(Node::Fixed {
            name: name.clone(),
            size: f.size,
        });
        self.named.insert(name, me);
        Ok(me)
    }
}

/// A union branch's name in Avro's JSON encoding.
fn branch_name(s: &Schema) -> String {
    match s {
        Schema::Record(r) => r.name.fullname(None),
        Schema::Enum(e) => e.name.fullname(None),
        Schema::Fixed(f) => f.name.fullname(None),
        Schema::Ref { name } => name.fullname(None),
        Schema::Null => "null".into(),
        Schema::Boolean => "boolean".into(),
        Schema::Int | Schema::Date | Schema::TimeMillis => "int".into(),
        Schema::Long
        | Schema::TimeMicros
        | Schema::TimestampMillis
        | Schema::TimestampMicros
        | Schema::TimestampNanos
        | Schema::LocalTimestampMillis
        | Schema::LocalTimestampMicros
        | Schema::LocalTimestampNanos => "long".into(),
        Schema::Float => "float".into(),
        Schema::Double => "double".into(),
        Schema::Bytes | Schema::Decimal(_) | Schema::BigDecimal => "bytes".into(),
        Schema::String | Schema::Uuid(_) => "string".into(),
        Schema::Array(_) => "array".into(),
        Schema::Map(_) => "map".into(),
        Schema::Union(_) => "union".into(),
        Schema::Duration(_) => "fixed".into(),
    }
}

/// A JSON path as Kafka users write it: `$.items[2].sku`, and what the
/// payload's text said of its numbers.
struct Path<'a> {
    steps: Vec<Step>,
    /// The values of the payload's numbers that were rounded when read.
    long_numbers: Vec<f64>,
    /// The payload's integers beyond 64 bits.
    huge: numbers::Huge<'a>,
}

enum Step {
    Key(String),
    Index(usize),
}

impl Path<'_> {
    fn push_key(&mut self, k: &str) {
        self.steps.push(Step::Key(k.to_owned()));
    }
    fn push_index(&mut self, i: usize) {
        self.steps.push(Step::Index(i));
    }
    fn pop(&mut self) {
        self.steps.pop();
    }
    fn misfit(&self, reason: impl Into<String>) -> Misfit {
        let mut path = String::from("$");
        for s in &self.steps {
            match s {
                Step::Key(k) => push_key(&mut path, k),
                Step::Index(i) => path.push_str(&format!("[{i}]")),
            }
        }
        Misfit {
            path,
            reason: reason.into(),
        }
    }
}

/// Appends `key` to a JSON path: `.key` for letters, digits and `_`,
/// `["key"]` for anything else.
pub(crate) fn push_key(path: &mut String, key: &str) {
    if !key.is_empty() && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        path.push('.');
        path.push_str(key);
    } else {
        path.push('[');
        path.push_str(&serde_json::to_string(key).unwrap_or_default());
        path.push(']');
    }
}

pub(crate) fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Avro's variable-length zig-zag `long`.
pub(crate) fn zigzag(i: i64, out: &mut Vec<u8>) {
    let mut n = ((i << 1) ^ (i >> 63)) as u64;
    while n >= 0x80 {
        out.push((n as u8) | 0x80);
        n >>= 7;
    }
    out.push(n as u8);
}

fn bytes(b: &[u8], out: &mut Vec<u8>) {
    zigzag(b.len() as i64, out);
    out.extend_from_slice(b);
}

/// A string of code points 0–255 as bytes (Avro's JSON form of bytes).
fn code_points(s: &str) -> Option<Vec<u8>> {
    s.chars().map(|c| u8::try_from(u32::from(c)).ok()).collect()
}

/// A decimal text as its unscaled integer at `scale`, within `precision`
/// digits.
fn unscaled(text: &str, scale: usize, precision: usize) -> Result<i128, String> {
    let bad = || {
        format!(
            "{text} is not a decimal with at most {scale} fractional digits and {precision} digits in all"
        )
    };
    let (neg, digits) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (whole, frac) = digits.split_once('.').unwrap_or((digits, ""));
    if whole.is_empty() && frac.is_empty()
        || !whole.chars().all(|c| c.is_ascii_digit())
        || !frac.chars().all(|c| c.is_ascii_digit())
    {
        return Err(bad());
    }
    let frac = frac.trim_end_matches('0');
    if frac.len() > scale {
        return Err(bad());
    }
    let all = format!("{whole}{frac}{}", "0".repeat(scale - frac.len()));
    let significant = all.trim_start_matches('0');
    if significant.len() > precision || significant.len() > 38 {
        return Err(bad());
    }
    let n: i128 = if significant.is_empty() {
        0
    } else {
        significant.parse().map_err(|_| bad())?
    };
    Ok(if neg { -n } else { n })
}

/// The shortest big-endian two's complement bytes of `n`.
fn twos_complement(n: i128) -> Vec<u8> {
    let be = n.to_be_bytes();
    let mut start = 0;
    while start < 15 {
        let (b, next) = (be[start], be[start + 1]);
        if (b == 0 && next & 0x80 == 0) || (b == 0xff && next & 0x80 != 0) {
            start += 1;
        } else {
            break;
        }
    }
    be[start..].to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;
    use apache_avro::types::Value as Avro;
    use serde_json::json;

    const ORDER: &str = r#"{
      "type": "record", "name": "OrderPlaced", "namespace": "shop",
      "fields": [
        {"name": "orderId", "type": "string"},
        {"name": "total", "type": {"type": "bytes", "logicalType": "decimal", "precision": 10, "scale": 2}},
        {"name": "count", "type": "int"},
        {"name": "status", "type": {"type": "enum", "name": "Status", "symbols": ["PLACED", "PAID"]}},
        {"name": "note", "type": ["null", "string"], "default": null},
        {"name": "items", "type": {"type": "array", "items": {
          "type": "record", "name": "Item",
          "fields": [{"name": "sku", "type": "string"}, {"name": "qty", "type": "long"}]}}},
        {"name": "tags", "type": {"type": "map", "values": "string"}, "default": {}},
        {"name": "placedAt", "type": {"type": "long", "logicalType": "timestamp-micros"}},
        {"name": "id", "type": {"type": "string", "logicalType": "uuid"}},
        {"name": "next", "type": ["null", "Item"], "default": null}
      ]}"#;

    fn encode(schema: &str, v: Value) -> Result<Vec<u8>, Misfit> {
        let c = AvroCodec::parse(schema).unwrap();
        let mut out = Vec::new();
        let text = v.to_string();
        c.encode(&v, &text, &mut out).map(|()| out)
    }

    fn decode(schema: &str, bytes: &[u8]) -> Avro {
        let s = Schema::parse_str(schema).unwrap();
        let reader = apache_avro::reader::datum::GenericDatumReader::builder(&s)
            .build()
            .unwrap();
        reader.read_value(&mut &bytes[..]).unwrap()
    }

    fn order() -> Value {
        json!({
            "orderId": "o-1", "total": "12.50", "count": 3, "status": "PAID",
            "items": [{"sku": "a", "qty": 2}, {"sku": "김", "qty": -9007199254740993i64}],
            "placedAt": "2026-12-02T10:00:00.123456Z",
            "id": "0190a5a4-8c1e-7000-8000-000000000001",
            "next": {"shop.Item": {"sku": "z", "qty": 1}}
        })
    }

    #[test]
    fn an_encoded_body_is_checked_whole() {
        let c = AvroCodec::parse(ORDER).unwrap();
        let bytes = encode(ORDER, order()).unwrap();
        c.check_datum(&bytes).unwrap();
        let mut longer = bytes.clone();
        longer.push(0);
        let e = c.check_datum(&longer).unwrap_err();
        assert!(e.reason.contains("1 bytes are left over"), "{}", e.reason);
        let e = c.check_datum(&bytes[..bytes.len() - 3]).unwrap_err();
        assert!(e.reason.contains("does not decode"), "{}", e.reason);
        // A string's length that runs past the body, and an enum index
        // past its symbols, are refused rather than read.
        let e = c.check_datum(&[0x7e, b'a']).unwrap_err();
        assert_eq!(e.path, "$");
        let other = r#"{"type": "enum", "name": "E", "symbols": ["A"]}"#;
        let c = AvroCodec::parse(other).unwrap();
        c.check_datum(&[0]).unwrap();
        assert!(c.check_datum(&[2]).is_err(), "index 1 of one symbol");
        // A recursive schema: a hostile body nests without end, and is
        // refused at the depth bound, not by the stack.
        let node =
            r#"{"type": "record", "name": "Node", "fields": [{"name": "next", "type": ["null", "Node"]}]}"#;
        let c = AvroCodec::parse(node).unwrap();
        c.check_datum(&[2, 2, 0]).unwrap();
        let deep = vec![2u8; 1 << 20];
        let e = c.check_datum(&deep).unwrap_err();
        assert!(e.reason.contains("deeper than"), "{}", e.reason);
        // A block that promises more nulls than any body holds.
        let nulls = AvroCodec::parse(r#"{"type": "array", "items": "null"}"#).unwrap();
        nulls.check_datum(&[6, 0]).unwrap();
        let e = nulls
            .check_datum(&[0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f, 0])
            .unwrap_err();
        assert!(e.reason.contains("promises"), "{}", e.reason);
    }

    #[test]
    fn what_it_writes_apache_avro_reads_back() {
        let bytes = encode(ORDER, order()).unwrap();
        let Avro::Record(fields) = decode(ORDER, &bytes) else {
            panic!()
        };
        let f: HashMap<_, _> = fields.into_iter().collect();
        assert_eq!(f["orderId"], Avro::String("o-1".into()));
        assert_eq!(f["count"], Avro::Int(3));
        assert_eq!(f["status"], Avro::Enum(1, "PAID".into()));
        assert_eq!(f["note"], Avro::Union(0, Box::new(Avro::Null)));
        assert_eq!(f["tags"], Avro::Map(Default::default()));
        assert_eq!(f["placedAt"], Avro::TimestampMicros(1_796_205_600_123_456));
        let Avro::Decimal(d) = &f["total"] else {
            panic!("{:?}", f["total"])
        };
        assert_eq!(<Vec<u8>>::try_from(d.clone()).unwrap(), vec![0x04, 0xe2], "1250");
        let Avro::Array(items) = &f["items"] else { panic!() };
        assert_eq!(
            items[1],
            Avro::Record(vec![
                ("sku".into(), Avro::String("김".into())),
                ("qty".into(), Avro::Long(-9007199254740993))
            ])
        );
        let Avro::Union(1, next) = &f["next"] else {
            panic!("{:?}", f["next"])
        };
        assert!(matches!(**next, Avro::Record(_)));
    }

    #[test]
    fn a_misfit_names_the_first_offending_field() {
        let cases = [
            (
                "orderId",
                json!(null),
                "$.orderId",
                "expected a string, found null",
            ),
            ("count", json!(1u64 << 40), "$.count", "is not an int"),
            ("status", json!("SHIPPED"), "$.status", "not a symbol of the enum"),
            ("total", json!("1.234"), "$.total", "at most 2 fractional digits"),
            ("id", json!("nope"), "$.id", "not a UUID"),
        ];
        for (field, value, path, reason) in cases {
            let mut v = order();
            v[field] = value;
            let m = encode(ORDER, v).unwrap_err();
            assert_eq!(m.path, path, "{m}");
            assert!(m.reason.contains(reason), "{m}");
        }
        let mut v = order();
        v["items"][1].as_object_mut().unwrap().remove("qty");
        let m = encode(ORDER, v).unwrap_err();
        assert_eq!(m.path, "$.items[1].qty");
        assert!(m.reason.contains("required field is missing"), "{m}");
        let mut v = order();
        v["extra key"] = json!(1);
        let m = encode(ORDER, v).unwrap_err();
        assert_eq!(m.path, "$[\"extra key\"]");
        assert!(m.reason.contains("has no field"), "{m}");
    }

    #[test]
    fn edges_of_each_type() {
        let s = r#"{"type":"record","name":"E","fields":[
            {"name":"i","type":"int"},{"name":"l","type":"long"},{"name":"d","type":"double"},
            {"name":"f","type":"float"},{"name":"b","type":"bytes"},
            {"name":"x","type":{"type":"fixed","name":"F","size":2}},
            {"name":"dec","type":{"type":"fixed","name":"D","size":4,"logicalType":"decimal","precision":9,"scale":0}},
            {"name":"day","type":{"type":"int","logicalType":"date"}}]}"#;
        let v = json!({"i": i32::MIN, "l": i64::MAX, "d": 1e308, "f": 0.5, "b": "\u{0}\u{ff}",
                       "x": "ab", "dec": -1, "day": "1969-12-31"});
        let Avro::Record(f) = decode(s, &encode(s, v).unwrap()) else {
            panic!()
        };
        assert_eq!(f[0].1, Avro::Int(i32::MIN));
        assert_eq!(f[1].1, Avro::Long(i64::MAX));
        assert_eq!(f[3].1, Avro::Float(0.5));
        assert_eq!(f[4].1, Avro::Bytes(vec![0, 255]));
        assert_eq!(f[5].1, Avro::Fixed(2, b"ab".to_vec()));
        let Avro::Decimal(d) = &f[6].1 else { panic!() };
        assert_eq!(<Vec<u8>>::try_from(d.clone()).unwrap(), vec![0xff; 4]);
        assert_eq!(f[7].1, Avro::Date(-1));
        let big = json!({"i": i64::from(i32::MAX) + 1, "l": 0, "d": 0, "f": 0, "b": "", "x": "ab", "dec": 0, "day": 0});
        assert_eq!(encode(s, big).unwrap_err().path, "$.i");
        let u64_big = json!({"i": 0, "l": u64::MAX, "d": 0, "f": 0, "b": "", "x": "ab", "dec": 0, "day": 0});
        assert_eq!(encode(s, u64_big).unwrap_err().path, "$.l");
        let beyond = json!({"i": 0, "l": 0, "d": 0, "f": 1e300, "b": "", "x": "ab", "dec": 0, "day": 0});
        assert_eq!(encode(s, beyond).unwrap_err().path, "$.f", "no silent infinity");
        let wide = json!({"i": 0, "l": 0, "d": 0, "f": 0, "b": "\u{100}", "x": "ab", "dec": 0, "day": 0});
        assert_eq!(encode(s, wide).unwrap_err().path, "$.b");
        let short = json!({"i": 0, "l": 0, "d": 0, "f": 0, "b": "", "x": "a", "dec": 0, "day": 0});
        assert_eq!(encode(s, short).unwrap_err().path, "$.x");
        let huge =
            json!({"i": 0, "l": 0, "d": 0, "f": 0, "b": "", "x": "ab", "dec": 9_999_999_999u64, "day": 0});
        assert_eq!(encode(s, huge).unwrap_err().path, "$.dec");
    }

    #[test]
    fn recursive_records_and_long_arrays() {
        let s = r#"{"type":"record","name":"Node","fields":[
            {"name":"v","type":"long"},{"name":"next","type":["null","Node"],"default":null}]}"#;
        let v = json!({"v": 1, "next": {"v": 2, "next": {"v": 3}}});
        let bytes = encode(s, v).unwrap();
        assert!(matches!(decode(s, &bytes), Avro::Record(_)));
        let a = r#"{"type":"array","items":"long"}"#;
        let v = Value::Array((0..300).map(|i| json!(i * 1000)).collect());
        let Avro::Array(items) = decode(a, &encode(a, v).unwrap()) else {
            panic!()
        };
        assert_eq!(items.len(), 300);
        assert_eq!(items[299], Avro::Long(299_000));
    }

    #[test]
    fn unions_take_the_exact_branch_and_nothing_is_rounded_silently() {
        let u = |types: &str, v: Value| -> Result<Avro, Misfit> {
            let s = format!(r#"{{"type":"record","name":"U","fields":[{{"name":"u","type":{types}}}]}}"#);
            let bytes = encode(&s, json!({"u": v}))?;
            let Avro::Record(f) = decode(&s, &bytes) else {
                panic!()
            };
            Ok(f[0].1.clone())
        };
        let big = 9_007_199_254_740_993i64;
        assert_eq!(
            u(r#"["null","double","long"]"#, json!(big)).unwrap(),
            Avro::Union(2, Box::new(Avro::Long(big)))
        );
        assert_eq!(
            u(r#"["null","float","double"]"#, json!(0.1)).unwrap(),
            Avro::Union(2, Box::new(Avro::Double(0.1)))
        );
        assert_eq!(
            u(r#"["bytes","string"]"#, json!("abc")).unwrap(),
            Avro::Union(1, Box::new(Avro::String("abc".into())))
        );
        assert_eq!(
            u(r#"["long","double"]"#, json!(1.5)).unwrap(),
            Avro::Union(1, Box::new(Avro::Double(1.5)))
        );
        let map_first = r#"[{"type":"map","values":"long"},{"type":"record","name":"R","fields":[{"name":"a","type":"long"}]}]"#;
        assert!(
            matches!(u(map_first, json!({"a": 1})).unwrap(), Avro::Union(1, _)),
            "the record before the map"
        );
        let dec_or_double =
            r#"["null",{"type":"bytes","logicalType":"decimal","precision":9,"scale":2},"double"]"#;
        assert!(
            matches!(u(dec_or_double, json!(12.34)).unwrap(), Avro::Union(1, _)),
            "the decimal keeps it exactly"
        );
        let ts_or_string = r#"["null",{"type":"long","logicalType":"timestamp-millis"},"string"]"#;
        assert!(
            matches!(
                u(ts_or_string, json!("2026-12-02T10:00:00Z")).unwrap(),
                Avro::Union(1, _)
            ),
            "schema order among exact branches"
        );
        // An integer a double (or float) would round is no double; one
        // beyond 64 bits was rounded on reading and fits no number type.
        for (types, text, path, why) in [
            (
                r#""double""#,
                r#"{"u": 9007199254740993}"#,
                "$.u",
                "cannot hold exactly",
            ),
            (
                r#""double""#,
                r#"{"u": 18446744073709551615}"#,
                "$.u",
                "cannot hold exactly",
            ),
            (r#""float""#, r#"{"u": 16777217}"#, "$.u", "cannot hold exactly"),
            (
                r#""double""#,
                r#"{"u": 123456789012345678901234567890}"#,
                "$.u",
                "beyond 64 bits",
            ),
            (
                r#"["long","double"]"#,
                r#"{"u": -123456789012345678901234567890}"#,
                "$.u",
                "beyond 64 bits",
            ),
            (
                r#"["null","float","double"]"#,
                r#"{"u": 99999999999999999999}"#,
                "$.u",
                "beyond 64 bits",
            ),
        ] {
            let s = format!(r#"{{"type":"record","name":"U","fields":[{{"name":"u","type":{types}}}]}}"#);
            let c = AvroCodec::parse(&s).unwrap();
            let m = c
                .encode(&serde_json::from_str(text).unwrap(), text, &mut Vec::new())
                .unwrap_err();
            assert_eq!(m.path, path, "{types} {text}");
            assert!(m.reason.contains(why), "{types} {text}: {m}");
        }
        // Written as floats, they are floats; exact integers stay.
        let s = r#"{"type":"record","name":"U","fields":[{"name":"u","type":"double"},{"name":"v","type":"double"}]}"#;
        let text = r#"{"u": 1.2345678901234568e29, "v": 9007199254740992}"#;
        AvroCodec::parse(s)
            .unwrap()
            .encode(&serde_json::from_str(text).unwrap(), text, &mut Vec::new())
            .unwrap();
        // A decimal written as a long JSON number was rounded on reading.
        let dec = r#"{"type":"bytes","logicalType":"decimal","precision":38,"scale":20}"#;
        let s = format!(r#"{{"type":"record","name":"D","fields":[{{"name":"d","type":{dec}}}]}}"#);
        let c = AvroCodec::parse(&s).unwrap();
        let text = r#"{"d": 1234567890123.4567}"#;
        let v: Value = serde_json::from_str(text).unwrap();
        let m = c.encode(&v, text, &mut Vec::new()).unwrap_err();
        assert!(m.reason.contains("write decimals as strings"), "{m}");
        let text = r#"{"d": "1234567890123.4567"}"#;
        c.encode(&serde_json::from_str(text).unwrap(), text, &mut Vec::new())
            .unwrap();
        let text = r#"{"d": 12.5}"#;
        c.encode(&serde_json::from_str(text).unwrap(), text, &mut Vec::new())
            .unwrap();
        // Another field's long number does not touch a decimal's own.
        let text = r#"{"d": 12.5, "lat": 52.52000659999999}"#;
        let s2 = format!(
            r#"{{"type":"record","name":"D2","fields":[{{"name":"d","type":{dec}}},{{"name":"lat","type":"double"}}]}}"#
        );
        let c2 = AvroCodec::parse(&s2).unwrap();
        c2.encode(&serde_json::from_str(text).unwrap(), text, &mut Vec::new())
            .unwrap();
    }

    #[test]
    fn timestamps_refuse_what_their_unit_cannot_hold() {
        let t = |logical: &str, v: &str| {
            let s = format!(
                r#"{{"type":"record","name":"T","fields":[{{"name":"t","type":{{"type":"long","logicalType":"{logical}"}}}}]}}"#
            );
            encode(&s, json!({"t": v}))
        };
        assert!(t("timestamp-millis", "2026-12-02T10:00:00.123Z").is_ok());
        assert!(t("timestamp-millis", "2026-12-02T10:00:00.1239Z")
            .unwrap_err()
            .reason
            .contains("more precise"));
        assert!(t("timestamp-micros", "2026-12-02T10:00:00.123456+09:00").is_ok());
        assert!(t("local-timestamp-millis", "2026-12-02T10:00:00.5").is_ok());
        assert!(
            t("local-timestamp-millis", "2026-12-02T10:00:00Z").is_err(),
            "an offset on a local time"
        );
    }

    #[test]
    fn decimals_and_twos_complement() {
        assert_eq!(unscaled("12.5", 2, 10), Ok(1250));
        assert_eq!(unscaled("-0.01", 2, 10), Ok(-1));
        assert_eq!(unscaled("1.230", 2, 10), Ok(123));
        assert!(unscaled("1e5", 2, 10).is_err());
        assert!(unscaled("", 2, 10).is_err());
        assert!(unscaled("123456789.00", 2, 10).is_err());
        assert_eq!(twos_complement(0), vec![0]);
        assert_eq!(twos_complement(127), vec![0x7f]);
        assert_eq!(twos_complement(128), vec![0, 0x80]);
        assert_eq!(twos_complement(-1), vec![0xff]);
        assert_eq!(twos_complement(-129), vec![0xff, 0x7f]);
    }

    #[test]
    fn schemas_it_cannot_use_are_named() {
        assert!(matches!(AvroCodec::parse("{"), Err(AvroSchemaError::Parse(_))));
        assert_eq!(
            AvroCodec::parse(ORDER).unwrap().name.as_deref(),
            Some("shop.OrderPlaced")
        );
    }
}

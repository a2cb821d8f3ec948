//! Outbox rows as they arrive from pgoutput.
//!
//! A `Relation` message tells which column sits where; [`OutboxColumns`]
//! remembers the positions of the columns outboxd needs, by name, so that a
//! table with extra columns or another column order still works. An `Insert`
//! tuple then becomes an [`OutboxRow`]. Values arrive in text form (the
//! replication connection fixes `DateStyle=ISO` and `TimeZone=UTC`).
//! `payload` and `headers` are kept as the JSON text PostgreSQL produced, so
//! the payload can be forwarded byte for byte. A `bytea` payload column
//! holds bytes that are already encoded (Avro, Protobuf or JSON Schema in
//! the Confluent wire format, or anything else under `routing.value =
//! "payload"`): its text form (`\x` hex, or the escape format) is decoded
//! back to those bytes, which are then forwarded unchanged.

use chrono::{DateTime, NaiveDateTime, Utc};
use uuid::Uuid;

use crate::postgres::pgoutput::{Relation, Tuple, TupleValue};

pub use outbox_sdk::schema::column;

/// One row inserted into the outbox table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxRow {
    pub id: Uuid,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    /// The payload: JSON text exactly as PostgreSQL rendered the jsonb,
    /// or a `bytea` column's bytes.
    pub payload: Payload,
    /// The headers object as JSON text (`{}` when the table has no headers
    /// column, or the row's `headers` is NULL).
    pub headers: String,
    pub created_at: CreatedAt,
}

/// The outbox columns in the order [`OutboxRow::from_table`] reads them,
/// as text where outboxd forwards the text (run with `DateStyle = ISO` and
/// `TimeZone = UTC`), and whether the payload is `bytea`; `o` is the
/// table's alias. [`TABLE_COLUMN_COUNT`] columns.
pub const TABLE_COLUMNS: &str = "o.id, o.aggregate_type, o.aggregate_id, o.type, o.payload::text, \
     o.headers::text, o.created_at::text, pg_typeof(o.payload) = 'bytea'::regtype";

/// How many columns [`TABLE_COLUMNS`] selects: a query's own columns
/// start at this index.
pub const TABLE_COLUMN_COUNT: usize = 8;

/// The PostgreSQL type oid of `bytea`.
pub const BYTEA_OID: u32 = 17;

/// An event's payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Payload {
    /// JSON text, exactly as PostgreSQL rendered it (a `jsonb`, `json` or
    /// `text` column).
    Json(String),
    /// A `bytea` column's bytes, forwarded unchanged.
    Bytes(Vec<u8>),
}

impl Payload {
    /// The bytes a record carries: the JSON text, or the bytea's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            Payload::Json(s) => s.as_bytes(),
            Payload::Bytes(b) => b,
        }
    }

    /// The JSON text, or `None` for bytes.
    pub fn json(&self) -> Option<&str> {
        match self {
            Payload::Json(s) => Some(s),
            Payload::Bytes(_) => None,
        }
    }

    pub fn len(&self) -> usize {
        self.as_bytes().len()
    }

    pub fn is_empty(&self) -> bool {
        self.as_bytes().is_empty()
    }

    /// Appends a JSON object member: `"<json_key>":<the JSON as stored>`,
    /// or `"<bytes_key>":"<base64>"` for bytes.
    pub fn push_member(&self, out: &mut Vec<u8>, json_key: &str, bytes_key: &str) {
        use base64::Engine as _;
        // Writing a &str to a Vec cannot fail.
        match self {
            Payload::Json(text) => {
                let _ = serde_json::to_writer(&mut *out, json_key);
                out.push(b':');
                out.extend_from_slice(text.as_bytes());
            }
            Payload::Bytes(b) => {
                let _ = serde_json::to_writer(&mut *out, bytes_key);
                out.extend_from_slice(b":\"");
                out.extend_from_slice(base64::engine::general_purpose::STANDARD.encode(b).as_bytes());
                out.push(b'"');
            }
        }
    }

    /// Reads a payload column's text: `bytea`'s as bytes, any other as
    /// JSON text.
    pub fn from_text(text: &str, bytea: bool) -> Result<Payload, String> {
        if bytea {
            decode_bytea(text).map(Payload::Bytes)
        } else {
            Ok(Payload::Json(text.to_owned()))
        }
    }
}

impl From<&str> for Payload {
    fn from(s: &str) -> Payload {
        Payload::Json(s.to_owned())
    }
}

/// `bytea`'s text output back to its bytes: the hex format (`\x0a1b`,
/// PostgreSQL's default) or the escape format (`bytea_output = escape`:
/// `\\` for a backslash, `\ooo` for a byte in octal, other bytes as
/// themselves).
pub fn decode_bytea(text: &str) -> Result<Vec<u8>, String> {
    let b = text.as_bytes();
    if let Some(hex) = text.strip_prefix("\\x") {
        let digit = |c: u8| match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            b'A'..=b'F' => Some(c - b'A' + 10),
            _ => None,
        };
        let h = hex.as_bytes();
        if h.len() % 2 != 0 {
            return Err("odd number of hex digits".into());
        }
        return h
            .chunks_exact(2)
            .map(|p| match (digit(p[0]), digit(p[1])) {
                (Some(hi), Some(lo)) => Ok(hi << 4 | lo),
                _ => Err(format!("{:?} is no hex byte", String::from_utf8_lossy(p))),
            })
            .collect();
    }
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] != b'\\' {
            out.push(b[i]);
            i += 1;
        } else if b.get(i + 1) == Some(&b'\\') {
            out.push(b'\\');
            i += 2;
        } else {
            let oct = b
                .get(i + 1..i + 4)
                .filter(|o| o[0] <= b'3' && o.iter().all(|c| (b'0'..=b'7').contains(c)))
                .ok_or_else(|| format!("a backslash at byte {i} starts no escape"))?;
            out.push((oct[0] - b'0') << 6 | (oct[1] - b'0') << 3 | (oct[2] - b'0'));
            i += 4;
        }
    }
    Ok(out)
}

impl OutboxRow {
    /// A row read from the table by a query that starts with
    /// [`TABLE_COLUMNS`] (polling mode, `outboxd replay`).
    /// A `bytea` payload whose text PostgreSQL printed but that does not
    /// read back (which it cannot be) is an error.
    pub fn from_table(r: &tokio_postgres::Row) -> Result<OutboxRow, RowError> {
        let created: String = r.get(6);
        let payload: String = r.get(4);
        let bytea: bool = r.get(7);
        Ok(OutboxRow {
            id: r.get(0),
            aggregate_type: r.get(1),
            aggregate_id: r.get(2),
            event_type: r.get(3),
            payload: Payload::from_text(&payload, bytea).map_err(|reason| RowError::Invalid {
                column: column::PAYLOAD,
                value: payload.chars().take(64).collect(),
                reason,
            })?,
            headers: r.get(5),
            created_at: CreatedAt::parse(&created),
        })
    }
}

/// `created_at` as PostgreSQL stored it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CreatedAt {
    /// A point in time.
    At(DateTime<Utc>),
    /// A value PostgreSQL accepts but that is no point outboxd can write
    /// (`infinity`, `-infinity`, a date BC), kept as PostgreSQL's text.
    Unrepresentable(String),
}

impl CreatedAt {
    /// Reads PostgreSQL's text; what is no point in time is kept as text.
    pub fn parse(s: &str) -> CreatedAt {
        parse_timestamptz(s).map_or_else(|_| CreatedAt::Unrepresentable(s.to_owned()), CreatedAt::At)
    }

    /// The time, when RFC 3339 can write it (years 0001 to 9999).
    pub fn rfc3339(&self) -> Option<&DateTime<Utc>> {
        use chrono::Datelike;
        match self {
            CreatedAt::At(t) if (1..=9999).contains(&t.year()) => Some(t),
            _ => None,
        }
    }
}

impl std::fmt::Display for CreatedAt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CreatedAt::At(t) => write!(f, "{}", t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)),
            CreatedAt::Unrepresentable(s) => f.write_str(s),
        }
    }
}

/// A row could not be read as an outbox event.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum RowError {
    #[error("outbox table {table} has no column {column:?}: it must follow migrations/0001_outbox.sql")]
    MissingColumn { table: String, column: &'static str },
    #[error("outbox row has {got} columns but its relation announced {want}")]
    ColumnCount { got: usize, want: usize },
    #[error("outbox column {column:?} is NULL or not sent as text")]
    NotText { column: &'static str },
    #[error("outbox column {column:?} has an invalid value {value:?}: {reason}")]
    Invalid {
        column: &'static str,
        value: String,
        reason: String,
    },
    #[error(
        "outbox message is no outbox event: {reason} (see migrations/0007_outbox_emit.sql for the format)"
    )]
    Message { reason: String },
}

/// An inserted row that cannot be read as an event (a NULL where a value
/// must be, an id that is no UUID, text that is not UTF-8), with what can
/// be read of it, so that it can be dead-lettered or named in a stop.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnreadableRow {
    /// The `id` column's text, or empty when it is unreadable too.
    pub id: String,
    /// The `aggregate_id` column's text, or empty.
    pub aggregate_id: String,
    pub error: RowError,
    /// Every column as a JSON object: its text, or null for NULL and
    /// non-text values.
    pub columns_json: String,
}

/// Where the outbox columns are in a relation's tuples.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxColumns {
    /// Every column's name, in tuple order.
    names: Vec<String>,
    width: usize,
    id: usize,
    aggregate_type: usize,
    aggregate_id: usize,
    event_type: usize,
    payload: usize,
    /// The payload column is `bytea`.
    payload_bytes: bool,
    headers: Option<usize>,
    created_at: Option<usize>,
}

impl OutboxColumns {
    /// Finds the outbox columns in a `Relation` message.
    pub fn from_relation(rel: &Relation) -> Result<Self, RowError> {
        let find = |name: &'static str| rel.columns.iter().position(|c| c.name == name);
        let need = |name: &'static str| {
            find(name).ok_or_else(|| RowError::MissingColumn {
                table: format!("{}.{}", rel.namespace, rel.name),
                column: name,
            })
        };
        Ok(OutboxColumns {
            names: rel.columns.iter().map(|c| c.name.clone()).collect(),
            width: rel.columns.len(),
            id: need(column::ID)?,
            aggregate_type: need(column::AGGREGATE_TYPE)?,
            aggregate_id: need(column::AGGREGATE_ID)?,
            event_type: need(column::TYPE)?,
            payload: need(column::PAYLOAD)?,
            payload_bytes: find(column::PAYLOAD).is_some_and(|i| rel.columns[i].type_oid == BYTEA_OID),
            headers: find(column::HEADERS),
            created_at: find(column::CREATED_AT),
        })
    }

    /// What can be read of a tuple that [`OutboxColumns::row`] refused.
    pub fn unreadable(&self, tuple: &Tuple, error: RowError) -> UnreadableRow {
        let text = |i: usize| {
            tuple
                .get(i)
                .and_then(TupleValue::as_text)
                .unwrap_or_default()
                .to_owned()
        };
        let columns: serde_json::Map<String, serde_json::Value> = self
            .names
            .iter()
            .zip(tuple.iter())
            .map(|(name, v)| {
                let value = v
                    .as_text()
                    .map_or(serde_json::Value::Null, |t| t.to_owned().into());
                (name.clone(), value)
            })
            .collect();
        UnreadableRow {
            id: text(self.id),
            aggregate_id: text(self.aggregate_id),
            error,
            columns_json: serde_json::Value::Object(columns).to_string(),
        }
    }

    /// Reads an inserted tuple.
    pub fn row(&self, tuple: &Tuple) -> Result<OutboxRow, RowError> {
        if tuple.len() != self.width {
            return Err(RowError::ColumnCount {
                got: tuple.len(),
                want: self.width,
            });
        }
        let text = |idx: usize, column: &'static str| -> Result<&str, RowError> {
            match &tuple[idx] {
                TupleValue::Text(_) => tuple[idx].as_text().ok_or(RowError::Invalid {
                    column,
                    value: String::new(),
                    reason: "not UTF-8".into(),
                }),
                _ => Err(RowError::NotText { column }),
            }
        };
        let id_text = text(self.id, column::ID)?;
        let id = Uuid::parse_str(id_text).map_err(|e| RowError::Invalid {
            column: column::ID,
            value: id_text.to_owned(),
            reason: e.to_string(),
        })?;
        // A NULL headers column (a schema without NOT NULL) means no headers.
        let headers = match self.headers {
            Some(i) if tuple[i] == TupleValue::Null => "{}".to_owned(),
            Some(i) => text(i, column::HEADERS)?.to_owned(),
            None => "{}".to_owned(),
        };
        let created_at = match self.created_at {
            Some(i) => CreatedAt::parse(text(i, column::CREATED_AT)?),
            None => CreatedAt::At(Utc::now()),
        };
        Ok(OutboxRow {
            id,
            aggregate_type: text(self.aggregate_type, column::AGGREGATE_TYPE)?.to_owned(),
            aggregate_id: text(self.aggregate_id, column::AGGREGATE_ID)?.to_owned(),
            event_type: text(self.event_type, column::TYPE)?.to_owned(),
            payload: {
                let t = text(self.payload, column::PAYLOAD)?;
                Payload::from_text(t, self.payload_bytes).map_err(|reason| RowError::Invalid {
                    column: column::PAYLOAD,
                    value: t.chars().take(64).collect(),
                    reason,
                })?
            },
            headers,
            created_at,
        })
    }
}

/// Parses a `timestamptz` in ISO DateStyle, e.g. `2026-11-30 11:50:36.123456+00`.
/// The fixed layout PostgreSQL prints is read byte by byte (this runs once
/// per event); anything else goes through chrono.
pub fn parse_timestamptz(s: &str) -> Result<DateTime<Utc>, RowError> {
    fast_timestamptz(s.as_bytes()).map_or_else(|| slow_timestamptz(s), Ok)
}

fn fast_timestamptz(b: &[u8]) -> Option<DateTime<Utc>> {
    let num = |r: std::ops::Range<usize>| -> Option<u32> {
        let mut v = 0u32;
        for &c in b.get(r)? {
            if !c.is_ascii_digit() {
                return None;
            }
            v = v * 10 + u32::from(c - b'0');
        }
        Some(v)
    };
    if b.len() < 22 || b[4] != b'-' || b[7] != b'-' || b[10] != b' ' || b[13] != b':' || b[16] != b':' {
        return None;
    }
    let date = chrono::NaiveDate::from_ymd_opt(num(0..4)? as i32, num(5..7)?, num(8..10)?)?;
    let (h, m, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
    let mut i = 19;
    let mut micros = 0u32;
    if b.get(i) == Some(&b'.') {
        let start = i + 1;
        i = start;
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        let digits = i - start;
        if digits == 0 || digits > 6 {
            return None;
        }
        micros = num(start..i)? * 10u32.pow(6 - digits as u32);
    }
    let sign: i64 = match b.get(i)? {
        b'+' => 1,
        b'-' => -1,
        _ => return None,
    };
    let off_h = i64::from(num(i + 1..i + 3)?);
    let off_m = match b.len() - (i + 3) {
        0 => 0,
        3 if b[i + 3] == b':' => i64::from(num(i + 4..i + 6)?),
        _ => return None,
    };
    let naive = date.and_hms_micro_opt(h, m, sec, micros)?;
    let local = DateTime::<Utc>::from_naive_utc_and_offset(naive, Utc);
    Some(local - chrono::Duration::seconds(sign * (off_h * 3600 + off_m * 60)))
}

fn slow_timestamptz(s: &str) -> Result<DateTime<Utc>, RowError> {
    let invalid = |reason: String| RowError::Invalid {
        column: column::CREATED_AT,
        value: s.to_owned(),
        reason,
    };
    // The offset is the trailing [+-]HH[:MM[:SS]]; find its sign after the time.
    let split = s
        .rfind(['+', '-'])
        .filter(|&i| i > 10)
        .ok_or_else(|| invalid("no UTC offset".into()))?;
    let (local, offset) = s.split_at(split);
    let naive =
        NaiveDateTime::parse_from_str(local, "%Y-%m-%d %H:%M:%S%.f").map_err(|e| invalid(e.to_string()))?;
    let sign: i64 = if offset.starts_with('-') { -1 } else { 1 };
    let mut parts = offset[1..].split(':');
    let mut secs = 0i64;
    for unit in [3600i64, 60, 1] {
        if let Some(p) = parts.next() {
            let v: i64 = p.parse().map_err(|_| invalid("bad UTC offset".into()))?;
            secs += v * unit;
        }
    }
    Ok(DateTime::<Utc>::from_naive_utc_and_offset(naive, Utc) - chrono::Duration::seconds(sign * secs))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::postgres::pgoutput::RelationColumn;
    use proptest::prelude::*;

    #[test]
    fn bytea_text_reads_back_in_both_output_formats() {
        assert_eq!(decode_bytea("\\x00010aFf").unwrap(), vec![0, 1, 10, 255]);
        assert_eq!(decode_bytea("\\x").unwrap(), Vec::<u8>::new());
        assert_eq!(decode_bytea("").unwrap(), Vec::<u8>::new());
        // bytea_output = escape: printable bytes as themselves, a backslash
        // doubled, the rest in octal.
        assert_eq!(
            decode_bytea("a\\\\b\\000\\377").unwrap(),
            b"a\\b\x00\xff".to_vec()
        );
        for bad in ["\\x0", "\\x0g", "\\x\u{e9}0", "\\", "a\\12", "\\400", "\\9aa"] {
            assert!(decode_bytea(bad).is_err(), "{bad:?} was read");
        }
        assert_eq!(
            Payload::from_text("\\x0102", true).unwrap(),
            Payload::Bytes(vec![1, 2])
        );
        assert_eq!(
            Payload::from_text("\\x0102", false).unwrap(),
            Payload::Json("\\x0102".into())
        );
    }

    proptest! {
        /// Every byte string reads back from both of PostgreSQL's output
        /// formats.
        #[test]
        fn bytea_round_trips(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
            prop_assert_eq!(decode_bytea(&format!("\\x{hex}")).unwrap(), bytes.clone());
            let escaped: String = bytes
                .iter()
                .map(|&b| match b {
                    b'\\' => "\\\\".to_string(),
                    0x20..=0x7e => (b as char).to_string(),
                    _ => format!("\\{b:03o}"),
                })
                .collect();
            prop_assert_eq!(decode_bytea(&escaped).unwrap(), bytes);
        }
    }

    proptest! {
        /// The fast path agrees with chrono on everything PostgreSQL prints.
        #[test]
        fn fast_and_slow_paths_agree(secs in 0i64..4_102_444_800, micros in 0u32..1_000_000, digits in 0usize..7,
                                     off_q in -48i64..56) {
            let t = DateTime::from_timestamp(secs, micros).unwrap();
            let off = chrono::FixedOffset::east_opt((off_q * 900) as i32).unwrap();
            let local = t.with_timezone(&off);
            let frac = if digits == 0 { String::new() } else { format!(".{:06}", micros)[..=digits].to_owned() };
            let oh = off_q * 900 / 3600;
            let om = (off_q * 900).abs() % 3600 / 60;
            let sign = if off_q < 0 { '-' } else { '+' };
            let zone = if om == 0 { format!("{sign}{:02}", oh.abs()) } else { format!("{sign}{:02}:{om:02}", oh.abs()) };
            let text = format!("{}{frac}{zone}", local.format("%Y-%m-%d %H:%M:%S"));
            prop_assert_eq!(fast_timestamptz(text.as_bytes()), slow_timestamptz(&text).ok(), "{}", text);
            prop_assert!(fast_timestamptz(text.as_bytes()).is_some(), "{}", text);
        }
    }
    use bytes::Bytes;

    fn relation(names: &[&str]) -> Relation {
        Relation {
            xid: None,
            id: 1,
            namespace: "public".into(),
            name: "outbox".into(),
            replica_identity: b'd',
            columns: names
                .iter()
                .map(|n| RelationColumn {
                    flags: 0,
                    name: (*n).into(),
                    type_oid: 25,
                    type_modifier: -1,
                })
                .collect(),
        }
    }

    fn t(s: &str) -> TupleValue {
        TupleValue::Text(Bytes::copy_from_slice(s.as_bytes()))
    }

    #[test]
    fn reads_a_row_in_any_column_order() {
        let rel = relation(&[
            "payload",
            "extra",
            "id",
            "type",
            "aggregate_id",
            "aggregate_type",
            "created_at",
            "headers",
        ]);
        let cols = OutboxColumns::from_relation(&rel).unwrap();
        let row = cols
            .row(&vec![
                t(r#"{"a": 1}"#),
                TupleValue::Null,
                t("0190a5a4-8c1e-7000-8000-000000000001"),
                t("ordering.order-placed.v1"),
                t("1001"),
                t("Order"),
                t("2026-11-30 11:50:36.123456+09"),
                t(r#"{"correlationId": "c-1"}"#),
            ])
            .unwrap();
        assert_eq!(row.aggregate_type, "Order");
        assert_eq!(row.event_type, "ordering.order-placed.v1");
        assert_eq!(row.payload.json(), Some(r#"{"a": 1}"#));
        assert_eq!(row.created_at.to_string(), "2026-11-30T02:50:36.123456Z");
    }

    #[test]
    fn missing_column_and_nulls_are_errors() {
        let err = OutboxColumns::from_relation(&relation(&["id", "type"])).unwrap_err();
        assert!(err.to_string().contains("aggregate_type"), "{err}");
        let cols = OutboxColumns::from_relation(&relation(&[
            "id",
            "aggregate_type",
            "aggregate_id",
            "type",
            "payload",
        ]))
        .unwrap();
        let err = cols
            .row(&vec![t("x"), t("A"), t("1"), t("t"), t("{}")])
            .unwrap_err();
        assert!(matches!(err, RowError::Invalid { column: "id", .. }));
        let err = cols
            .row(&vec![
                t("0190a5a4-8c1e-7000-8000-000000000001"),
                TupleValue::Null,
                t("1"),
                t("t"),
                t("{}"),
            ])
            .unwrap_err();
        assert_eq!(
            err,
            RowError::NotText {
                column: "aggregate_type"
            }
        );
        assert!(matches!(
            cols.row(&vec![t("x")]),
            Err(RowError::ColumnCount { .. })
        ));
    }

    #[test]
    fn timestamptz_offsets() {
        assert_eq!(
            parse_timestamptz("2026-01-02 03:04:05+00").unwrap().to_rfc3339(),
            "2026-01-02T03:04:05+00:00"
        );
        assert_eq!(
            parse_timestamptz("2026-01-02 03:04:05.5-05:30")
                .unwrap()
                .to_rfc3339(),
            "2026-01-02T08:34:05.500+00:00"
        );
        assert!(parse_timestamptz("infinity").is_err());
        // Seconds in the offset (historic zones) take the slow path.
        assert_eq!(
            parse_timestamptz("1900-01-01 00:00:00+00:19:32")
                .unwrap()
                .to_rfc3339(),
            "1899-12-31T23:40:28+00:00"
        );
        assert!(parse_timestamptz("2026-13-02 03:04:05+00").is_err());
        assert!(parse_timestamptz("2026-01-02 03:04:05").is_err());
    }
}

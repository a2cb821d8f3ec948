//! Kafka Connect's JSON (`routing.value = "connect-json"`,
//! `routing.key_format = "connect-json"`): the bytes Debezium's Outbox Event
//! Router writes through Connect's `JsonConverter`, so that consumers of a
//! Debezium deployment read outboxd's records unchanged.
//!
//! With `routing.connect_schemas = true` (the converter's
//! `schemas.enable`, and its default) each key and value is
//! `{"schema":<schema>,"payload":<value>}`; with `false`, the value alone.
//! Compact, UTF-8, `schema` before `payload`, and a schema's members in the
//! converter's order: `type`, `fields`, `optional`, `name`, `version`, and in
//! a struct each field's `field` last.
//!
//! | column | schema | value |
//! |---|---|---|
//! | `jsonb`, `json` | `string` named `io.debezium.data.Json`, version 1 | its JSON text, as a JSON string |
//! | `text`, `varchar`, others | `string` | the text |
//! | `uuid` | `string` named `io.debezium.data.Uuid`, version 1 | the text |
//! | `smallint`, `integer`, `bigint` | `int16`, `int32`, `int64` | the number |
//! | `boolean` | `boolean` | `true`/`false` |
//! | `bytea` | `bytes` | standard base64, padded |
//!
//! `optional` is true when the column may be NULL. The value is the
//! payload; with `envelope` placements it is a struct of `payload` and the
//! placed columns (under their names), named
//! `<connect_topic_prefix>.<schema>.<table>.<route value>.Value`.
//!
//! Where this differs from Debezium (documented in
//! docs/migrating-from-debezium.md): numeric, floating-point and time
//! columns placed in the envelope are written as strings of their text
//! (Debezium writes its logical types); a column's DEFAULT is not written
//! into the schema; the struct's name is the row's own (Debezium names it
//! after the first row a task saw).

use base64::Engine as _;

use crate::config::columns::Placement;
use crate::config::routing::RecordValue;
use crate::source::outbox::{ColumnFacts, Extra, Fact, Kind, OutboxRow, Payload};

/// A JSON string as Jackson's default generator writes it (Connect's
/// `JsonConverter` serialises through Jackson): `"` and `\` escaped, the
/// control characters as `\b`, `\t`, `\n`, `\f`, `\r` or `\u00XX`, and a
/// character beyond the Basic Multilingual Plane as its UTF-16 surrogate
/// pair, `\uD83D\uDE00`, hex digits in upper case; everything else as
/// its UTF-8. (serde_json writes the same but for the last two: it keeps
/// such characters as UTF-8 and writes lower-case hex.)
fn push_str(out: &mut Vec<u8>, s: &str) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let unicode = |out: &mut Vec<u8>, unit: u16| {
        out.extend_from_slice(b"\\u");
        for shift in [12, 8, 4, 0] {
            out.push(HEX[usize::from((unit >> shift) & 0xF)]);
        }
    };
    out.push(b'"');
    for c in s.chars() {
        match c {
            '"' => out.extend_from_slice(b"\\\""),
            '\\' => out.extend_from_slice(b"\\\\"),
            '\u{8}' => out.extend_from_slice(b"\\b"),
            '\t' => out.extend_from_slice(b"\\t"),
            '\n' => out.extend_from_slice(b"\\n"),
            '\u{c}' => out.extend_from_slice(b"\\f"),
            '\r' => out.extend_from_slice(b"\\r"),
            c if (c as u32) < 0x20 => unicode(out, c as u16),
            c if (c as u32) > 0xFFFF => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units).iter() {
                    unicode(out, *unit);
                }
            }
            c => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out.push(b'"');
}

/// A column's schema, without the closing brace (a struct field appends
/// its `field`).
fn open_schema(out: &mut Vec<u8>, fact: Fact) {
    let (kind, name) = match fact.kind {
        Kind::Json | Kind::Jsonb => ("string", Some("io.debezium.data.Json")),
        Kind::Uuid => ("string", Some("io.debezium.data.Uuid")),
        Kind::Int(16) => ("int16", None),
        Kind::Int(32) => ("int32", None),
        Kind::Int(_) => ("int64", None),
        Kind::Bool => ("boolean", None),
        Kind::Bytea => ("bytes", None),
        Kind::Text | Kind::Decimal | Kind::Timestamptz | Kind::Timestamp | Kind::Other => ("string", None),
    };
    out.extend_from_slice(b"{\"type\":\"");
    out.extend_from_slice(kind.as_bytes());
    out.extend_from_slice(if fact.optional {
        b"\",\"optional\":true"
    } else {
        b"\",\"optional\":false"
    });
    if let Some(name) = name {
        out.extend_from_slice(b",\"name\":\"");
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b"\",\"version\":1");
    }
}

/// A scalar value as the converter writes it for a column of `kind`.
fn push_text(out: &mut Vec<u8>, kind: Kind, text: Option<&str>) {
    match (kind, text) {
        (_, None) => out.extend_from_slice(b"null"),
        (Kind::Int(_), Some(t)) if t.parse::<i64>().is_ok() => out.extend_from_slice(t.as_bytes()),
        (Kind::Bool, Some(t)) => out.extend_from_slice(t.as_bytes()),
        (_, Some(t)) => push_str(out, t),
    }
}

fn push_payload(out: &mut Vec<u8>, payload: &Payload) {
    match payload {
        Payload::Json(t) | Payload::Text(t) => push_str(out, t),
        Payload::Bytes(b) => push_str(out, &base64::engine::general_purpose::STANDARD.encode(b)),
        Payload::Null => out.extend_from_slice(b"null"),
    }
}

/// The key: the key column's value, with its schema when `schemas`.
pub fn key(row: &OutboxRow, facts: &ColumnFacts, schemas: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(row.aggregate_id.len() + 64);
    if schemas {
        out.extend_from_slice(b"{\"schema\":");
        open_schema(&mut out, facts.key);
        out.extend_from_slice(b"},\"payload\":");
    }
    push_text(&mut out, facts.key.kind, Some(&row.aggregate_id));
    if schemas {
        out.push(b'}');
    }
    out
}

/// The value: the payload, or with `envelope` placements a struct of the
/// payload and the placed columns; with its schema when `schemas`.
pub fn value(
    row: &OutboxRow,
    facts: &ColumnFacts,
    rules: &RecordValue,
    schemas: bool,
    struct_prefix: &str,
) -> Vec<u8> {
    let placed: Vec<_> = rules
        .placements
        .iter()
        .filter(|p| p.placement == Placement::Envelope)
        .filter(|p| row.extra.get(p.extra).is_some_and(|e| *e != Extra::Missing))
        .collect();
    let mut out = Vec::with_capacity(row.payload.len() * 2 + 160);
    if placed.is_empty() {
        if schemas {
            out.extend_from_slice(b"{\"schema\":");
            open_schema(&mut out, facts.payload);
            out.extend_from_slice(b"},\"payload\":");
        }
        push_payload(&mut out, &row.payload);
        if schemas {
            out.push(b'}');
        }
        return out;
    }
    let fact_of = |i: usize| {
        facts.extra.get(i).copied().unwrap_or(Fact {
            kind: Kind::Text,
            optional: true,
        })
    };
    if schemas {
        out.extend_from_slice(b"{\"schema\":{\"type\":\"struct\",\"fields\":[");
        open_schema(&mut out, facts.payload);
        out.extend_from_slice(b",\"field\":\"payload\"}");
        for p in &placed {
            out.push(b',');
            open_schema(&mut out, fact_of(p.extra));
            out.extend_from_slice(b",\"field\":");
            push_str(&mut out, &p.name);
            out.push(b'}');
        }
        out.extend_from_slice(b"],\"optional\":false,\"name\":");
        push_str(&mut out, &format!("{struct_prefix}.{}.Value", row.aggregate_type));
        out.extend_from_slice(b"},\"payload\":");
    }
    out.extend_from_slice(b"{\"payload\":");
    push_payload(&mut out, &row.payload);
    for p in &placed {
        out.push(b',');
        push_str(&mut out, &p.name);
        out.push(b':');
        let extra = &row.extra[p.extra];
        let kind = fact_of(p.extra).kind;
        match extra {
            Extra::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
            other => push_text(&mut out, kind, other.text()),
        }
    }
    out.push(b'}');
    if schemas {
        out.push(b'}');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::columns::PlacedColumn;
    use crate::source::outbox::CreatedAt;

    fn row() -> OutboxRow {
        OutboxRow {
            id: "0190a5a4-8c1e-7000-8000-000000000001".into(),
            aggregate_type: "Order".into(),
            aggregate_id: "1001".into(),
            event_type: "OrderPlaced".into(),
            payload: Payload::Json(r#"{"a": 1}"#.into()),
            headers: "{}".into(),
            created_at: CreatedAt::Absent,
            extra: vec![Extra::Text("OrderPlaced".into())],
            facts: None,
        }
    }

    /// Debezium's default table: aggregateid varchar NOT NULL, payload
    /// jsonb NULL, type varchar NOT NULL.
    fn facts() -> ColumnFacts {
        ColumnFacts {
            key: Fact {
                kind: Kind::Text,
                optional: false,
            },
            payload: Fact {
                kind: Kind::Jsonb,
                optional: true,
            },
            extra: vec![Fact {
                kind: Kind::Text,
                optional: false,
            }],
            has_route: true,
            has_type: true,
        }
    }

    fn text(b: Vec<u8>) -> String {
        String::from_utf8(b).unwrap()
    }

    #[test]
    fn the_default_event_router_through_json_converter() {
        let r = row();
        let rules = RecordValue::of(crate::config::ValueFormat::Payload);
        assert_eq!(
            text(key(&r, &facts(), true)),
            r#"{"schema":{"type":"string","optional":false},"payload":"1001"}"#
        );
        assert_eq!(text(key(&r, &facts(), false)), r#""1001""#);
        assert_eq!(
            text(value(&r, &facts(), &rules, true, "dbserver1.public.outboxevent")),
            r#"{"schema":{"type":"string","optional":true,"name":"io.debezium.data.Json","version":1},"payload":"{\"a\": 1}"}"#
        );
        assert_eq!(text(value(&r, &facts(), &rules, false, "x")), r#""{\"a\": 1}""#);
        let mut null = r.clone();
        null.payload = Payload::Null;
        assert_eq!(text(value(&null, &facts(), &rules, false, "x")), "null");
        let mut bytes = r;
        bytes.payload = Payload::Bytes(br#"{"a": 1}"#.to_vec());
        let mut f = facts();
        f.payload.kind = Kind::Bytea;
        assert_eq!(
            text(value(&bytes, &f, &rules, true, "x")),
            r#"{"schema":{"type":"bytes","optional":true},"payload":"eyJhIjogMX0="}"#
        );
    }

    #[test]
    fn an_envelope_placement_makes_a_struct() {
        let mut rules = RecordValue::of(crate::config::ValueFormat::Payload);
        rules.placements = vec![PlacedColumn {
            extra: 0,
            placement: Placement::Envelope,
            name: "eventType".into(),
        }];
        assert_eq!(
            text(value(
                &row(),
                &facts(),
                &rules,
                true,
                "dbserver1.public.outboxevent"
            )),
            concat!(
                r#"{"schema":{"type":"struct","fields":[{"type":"string","optional":true,"name":"io.debezium.data.Json","version":1,"field":"payload"},"#,
                r#"{"type":"string","optional":false,"field":"eventType"}],"optional":false,"name":"dbserver1.public.outboxevent.Order.Value"},"#,
                r#""payload":{"payload":"{\"a\": 1}","eventType":"OrderPlaced"}}"#
            )
        );
        assert_eq!(
            text(value(&row(), &facts(), &rules, false, "x")),
            r#"{"payload":"{\"a\": 1}","eventType":"OrderPlaced"}"#
        );
    }

    #[test]
    fn strings_are_escaped_as_jackson_escapes_them() {
        let mut out = Vec::new();
        push_str(&mut out, "tab\there \u{1}\u{1f} \"q\" \\ 주문 ✓ 😀 \u{7f} /");
        let want = "\"tab\\there \\u0001\\u001F \\\"q\\\" \\\\ 주문 ✓ \\uD83D\\uDE00 \u{7f} /\"";
        assert_eq!(text(out), want);
    }

    #[test]
    fn keys_by_column_type() {
        let mut r = row();
        let mut f = facts();
        f.key = Fact {
            kind: Kind::Int(64),
            optional: false,
        };
        assert_eq!(
            text(key(&r, &f, true)),
            r#"{"schema":{"type":"int64","optional":false},"payload":1001}"#
        );
        assert_eq!(text(key(&r, &f, false)), "1001");
        f.key.kind = Kind::Uuid;
        r.aggregate_id = "0190a5a4-8c1e-7000-8000-000000000001".into();
        assert_eq!(
            text(key(&r, &f, true)),
            r#"{"schema":{"type":"string","optional":false,"name":"io.debezium.data.Uuid","version":1},"payload":"0190a5a4-8c1e-7000-8000-000000000001"}"#
        );
    }
}

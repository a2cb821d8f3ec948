//! CloudEvents 1.0 values, following the CloudEvents Kafka protocol
//! binding (`routing.value = "cloudevents"` or `"cloudevents-binary"`).
//!
//! Attributes mapped from the row:
//!
//! | attribute         | from                                                 |
//! |-------------------|------------------------------------------------------|
//! | `specversion`     | `1.0`                                                |
//! | `id`              | `id`                                                 |
//! | `source`          | `routing.cloudevents_source` (a template)            |
//! | `type`            | `type`                                               |
//! | `subject`         | `aggregate_id`                                       |
//! | `time`            | `created_at` (left out when RFC 3339 cannot write it) |
//! | `datacontenttype` | `application/json`; `application/octet-stream` for a `bytea` payload; `text/plain; charset=utf-8` for a text payload that is no JSON, or under `routing.text_payload = "string"` |
//! | `partitionkey`    | `aggregate_id`, the record key (partitioning extension) |
//! | `traceparent`, `tracestate` | the row's headers of that name (distributed tracing extension) |
//!
//! **Structured mode** (`cloudevents`): the value is the event as JSON
//! (`data` holds the payload as stored, byte for byte; a `bytea` payload
//! is `data_base64`, as the JSON event format writes binary data) and the
//! `content-type` header is `application/cloudevents+json; charset=UTF-8`.
//! **Binary mode** (`cloudevents-binary`): the value is the payload, each
//! attribute a `ce_<name>` header, and `datacontenttype` the
//! `content-type` header. In both, the relay's own headers (`id`, `type`,
//! …) stay; a row header that would collide with a CloudEvents header is
//! left out, so a row cannot forge an attribute.

use crate::config::routing::SourcePart;
use crate::config::routing::TextPayload;
pub use crate::config::routing::{SourceTemplate, DEFAULT_SOURCE};
use crate::kafka::records::{HeaderName, Headers};
use crate::source::outbox::{is_json, CreatedAt, OutboxRow, Payload};

/// The CloudEvents version written.
pub const SPEC_VERSION: &str = "1.0";
/// `datacontenttype`: payloads are jsonb.
pub const DATA_CONTENT_TYPE: &str = "application/json";
/// `datacontenttype` of a `bytea` payload, whose bytes outboxd does not
/// read.
pub const BYTES_CONTENT_TYPE: &str = "application/octet-stream";
/// `datacontenttype` of a text payload that is not JSON.
pub const TEXT_CONTENT_TYPE: &str = "text/plain; charset=utf-8";

/// The `datacontenttype` of a payload under `routing.text_payload`.
pub fn data_content_type(payload: &Payload, text: TextPayload) -> &'static str {
    match payload {
        Payload::Json(_) | Payload::Null => DATA_CONTENT_TYPE,
        Payload::Bytes(_) => BYTES_CONTENT_TYPE,
        Payload::Text(t) => match text {
            TextPayload::Json => DATA_CONTENT_TYPE,
            TextPayload::Auto if is_json(t) => DATA_CONTENT_TYPE,
            TextPayload::Auto | TextPayload::String => TEXT_CONTENT_TYPE,
        },
    }
}
/// `content-type` of a structured-mode record.
pub const STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json; charset=UTF-8";
/// The header that carries `datacontenttype` (binary) or the format
/// (structured).
pub const CONTENT_TYPE: &str = "content-type";
/// Binary-mode attribute headers start with this.
pub const HEADER_PREFIX: &str = "ce_";
/// Row headers passed on as the distributed tracing extension.
const TRACING: [&str; 2] = ["traceparent", "tracestate"];

impl SourceTemplate {
    /// The source of `row`; `None` when it renders empty.
    pub fn render(&self, row: &OutboxRow) -> Option<String> {
        use percent_encoding::{utf8_percent_encode, AsciiSet, NON_ALPHANUMERIC};
        // RFC 3986 unreserved characters stay as they are.
        const ENCODE: &AsciiSet = &NON_ALPHANUMERIC
            .remove(b'-')
            .remove(b'.')
            .remove(b'_')
            .remove(b'~');
        let mut out = String::new();
        for p in &self.parts {
            let value = match p {
                SourcePart::Literal(l) => {
                    out.push_str(l);
                    continue;
                }
                SourcePart::AggregateType => &row.aggregate_type,
                SourcePart::AggregateId => &row.aggregate_id,
                SourcePart::EventType => &row.event_type,
            };
            out.extend(utf8_percent_encode(value, ENCODE));
        }
        (!out.is_empty()).then_some(out)
    }
}

/// The attributes of one event, in the order they are written.
#[derive(Debug)]
pub struct Attributes<'a> {
    pairs: Vec<(&'static str, &'a str)>,
    /// `time`, owned: it is formatted here.
    time: Option<String>,
}

impl<'a> Attributes<'a> {
    /// The attributes of `row`; `row_headers` are its Kafka headers (for
    /// the tracing extension).
    pub fn of(
        row: &'a OutboxRow,
        id: &'a str,
        source: &'a str,
        row_headers: &'a [(HeaderName, Vec<u8>)],
        created_at: &CreatedAt,
        text: TextPayload,
    ) -> Self {
        let mut pairs = vec![
            ("specversion", SPEC_VERSION),
            ("id", id),
            ("source", source),
            ("type", row.event_type.as_str()),
            ("subject", row.aggregate_id.as_str()),
            ("datacontenttype", data_content_type(&row.payload, text)),
            ("partitionkey", row.aggregate_id.as_str()),
        ];
        for name in TRACING {
            if let Some(v) = row_headers
                .iter()
                .find(|(k, _)| k == name)
                .and_then(|(_, v)| std::str::from_utf8(v).ok())
                .filter(|v| !v.is_empty())
            {
                pairs.push((name, v));
            }
        }
        let time = created_at
            .rfc3339()
            .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true));
        Attributes { pairs, time }
    }

    /// The structured-mode value: the attributes, then `data` (the payload
    /// JSON as stored), or `data_base64` for bytes.
    pub fn structured(&self, payload: &Payload, text: TextPayload) -> Result<Vec<u8>, String> {
        let mut out = Vec::with_capacity(payload.len() + 320);
        out.push(b'{');
        for (name, value) in self.all() {
            push_json_string(&mut out, name);
            out.push(b':');
            push_json_string(&mut out, value);
            out.push(b',');
        }
        payload.push_member(&mut out, "data", "data_base64", text)?;
        out.push(b'}');
        Ok(out)
    }

    /// The binary-mode headers: `ce_<name>` for each attribute but
    /// `datacontenttype`, which is `content-type`.
    pub fn binary_headers(&self) -> Headers {
        self.all()
            .map(|(name, value)| {
                let key: HeaderName = if name == "datacontenttype" {
                    CONTENT_TYPE.into()
                } else {
                    format!("{HEADER_PREFIX}{name}").into()
                };
                (key, value.as_bytes().to_vec())
            })
            .collect()
    }

    fn all(&self) -> impl Iterator<Item = (&str, &str)> {
        self.pairs
            .iter()
            .map(|(k, v)| (*k, *v))
            .chain(self.time.as_deref().map(|t| ("time", t)))
    }
}

/// Whether a row header would collide with a CloudEvents header.
pub fn is_reserved_header(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    lower == CONTENT_TYPE || lower.starts_with(HEADER_PREFIX)
}

fn push_json_string(out: &mut Vec<u8>, s: &str) {
    // Writing a &str to a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::outbox::CreatedAt;
    use chrono::TimeZone;

    fn row() -> OutboxRow {
        OutboxRow {
            id: uuid::Uuid::nil().to_string(),
            aggregate_type: "Order Line".into(),
            aggregate_id: "o/1".into(),
            event_type: "ordering.order-placed.v1".into(),
            payload: r#"{"total": 1e400}"#.into(),
            headers: "{}".into(),
            created_at: CreatedAt::At(chrono::Utc.with_ymd_and_hms(2026, 11, 30, 1, 2, 3).unwrap()),
            extra: Vec::new(),
            facts: None,
        }
    }

    #[test]
    fn sources_are_uri_references_whatever_the_row_holds() {
        let t = SourceTemplate::parse(DEFAULT_SOURCE).unwrap();
        assert_eq!(t.render(&row()).as_deref(), Some("/outbox/Order%20Line"));
        let t = SourceTemplate::parse("urn:shop:{aggregate_type}:{aggregate_id}:{type}").unwrap();
        assert_eq!(
            t.render(&row()).as_deref(),
            Some("urn:shop:Order%20Line:o%2F1:ordering.order-placed.v1")
        );
        let mut empty = row();
        empty.aggregate_type.clear();
        assert_eq!(
            SourceTemplate::parse("{aggregate_type}").unwrap().render(&empty),
            None
        );
        for bad in ["", "{nope}", "/a b", "/{aggregate_type", "/ä"] {
            assert!(SourceTemplate::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn structured_and_binary_carry_the_same_attributes() {
        let r = row();
        let headers: Headers = vec![(
            "traceparent".into(),
            b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_vec(),
        )];
        let a = Attributes::of(
            &r,
            "id-1",
            "/outbox/Order",
            &headers,
            &r.created_at,
            TextPayload::Auto,
        );
        let v: serde_json::Value = serde_json::from_slice(
            &a.structured(&r#"{"total": 1}"#.into(), TextPayload::Auto)
                .unwrap(),
        )
        .unwrap();
        assert_eq!(v["specversion"], "1.0");
        assert_eq!(v["subject"], "o/1");
        assert_eq!(v["time"], "2026-11-30T01:02:03.000000Z");
        assert_eq!(
            v["traceparent"],
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        );
        // The payload is embedded as stored, even a number no float holds.
        assert!(
            String::from_utf8(a.structured(&r.payload, TextPayload::Auto).unwrap())
                .unwrap()
                .ends_with(r#""data":{"total": 1e400}}"#)
        );
        let h = a.binary_headers();
        assert!(h.contains(&("content-type".into(), b"application/json".to_vec())));
        assert!(h.contains(&("ce_id".into(), b"id-1".to_vec())));
        assert!(h.iter().all(|(k, _)| k == "content-type" || k.starts_with("ce_")));
        assert_eq!(
            h.len(),
            v.as_object().unwrap().len() - 1,
            "every attribute but data"
        );
        let mut forever = r.clone();
        forever.created_at = CreatedAt::Unrepresentable("infinity".into());
        let a = Attributes::of(
            &forever,
            "id-1",
            "/s",
            &[],
            &forever.created_at,
            TextPayload::Auto,
        );
        let v: serde_json::Value =
            serde_json::from_slice(&a.structured(&"{}".into(), TextPayload::Auto).unwrap()).unwrap();
        assert!(v.get("time").is_none(), "time is optional: left out, not made up");
        assert!(
            is_reserved_header("CE_id") && is_reserved_header("Content-Type") && !is_reserved_header("cents")
        );
    }
}

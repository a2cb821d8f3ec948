//! The table-less outbox: events written into the WAL as transactional
//! logical decoding messages (`pg_logical_emit_message(true, 'outbox',
//! content)`, or `outbox_emit(...)` from migration 0007, or the SDK's
//! `outbox::emit`), read back as [`OutboxRow`]s.
//!
//! outboxd asks pgoutput for messages (`messages 'true'`, PostgreSQL 14+).
//! A transactional message arrives inside its transaction, in WAL order
//! with the transaction's row inserts, and only if the transaction
//! commits; from there on it is an outbox row like any other: the same
//! routing, headers, values, dead letters and LSN rules. Messages with
//! another prefix are someone else's and are skipped; non-transactional
//! messages (`pg_logical_emit_message(false, …)`) are skipped too, because
//! they are not part of the transaction that wrote the domain change and
//! would reach Kafka even if it rolled back.
//!
//! # Content, format version 1
//!
//! ```json
//! {"v": 1, "id": "<uuid>", "aggregateType": "Order", "aggregateId": "1001",
//!  "type": "ordering.order-placed.v1", "payload": {…},
//!  "headers": {"traceparent": "…"}, "createdAt": "2026-12-01T10:00:00.123456+00:00"}
//! ```
//!
//! `v`, `id`, `aggregateType`, `aggregateId`, `type` and `payload` are
//! required; `headers` defaults to `{}`, and `createdAt` (RFC 3339) to the
//! transaction's commit time. Fields outboxd does not know are ignored, so
//! a writer may add its own. Content that is not such JSON, or of another
//! version, is an unreadable row: `routing.on_poison` decides, and its
//! dead letter keeps the content.

use serde::Deserialize;
use serde_json::value::RawValue;
use uuid::Uuid;

use crate::source::outbox::{CreatedAt, OutboxRow, Payload, RowError, UnreadableRow};

/// The content format version this outboxd reads.
pub const FORMAT_VERSION: u64 = 1;

/// The default `postgres.message_prefix`.
pub use crate::config::postgres::DEFAULT_MESSAGE_PREFIX as DEFAULT_PREFIX;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Content<'a> {
    v: u64,
    id: Uuid,
    aggregate_type: String,
    aggregate_id: String,
    #[serde(rename = "type")]
    event_type: String,
    #[serde(borrow)]
    payload: &'a RawValue,
    #[serde(default, borrow)]
    headers: Option<&'a RawValue>,
    #[serde(default)]
    created_at: Option<String>,
}

/// What a message's content is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Read {
    /// An outbox event.
    Event(OutboxRow),
    /// No outbox event: `routing.on_poison` decides.
    Unreadable(UnreadableRow),
}

/// Reads a message's content as an outbox row; `commit_time` stands in
/// for a missing `createdAt`.
pub fn read(content: &[u8], commit_time: chrono::DateTime<chrono::Utc>) -> Read {
    match row(content, commit_time) {
        Ok(r) => Read::Event(r),
        Err(u) => Read::Unreadable(*u),
    }
}

fn row(content: &[u8], commit_time: chrono::DateTime<chrono::Utc>) -> Result<OutboxRow, Box<UnreadableRow>> {
    let text = std::str::from_utf8(content).map_err(|e| unreadable(content, format!("not UTF-8: {e}")))?;
    if !text.trim_start().starts_with('{') {
        return Err(unreadable(content, "not a JSON object".into()));
    }
    // The version first, so that a future format is named as such.
    #[derive(Deserialize)]
    struct Version {
        v: Option<serde_json::Value>,
    }
    match serde_json::from_str::<Version>(text) {
        Ok(Version { v: Some(v) }) if v.as_u64() == Some(FORMAT_VERSION) => {}
        Ok(Version { v: Some(v) }) => {
            return Err(unreadable(
                content,
                format!("format version {v}; this outboxd reads version {FORMAT_VERSION}: upgrade outboxd"),
            ))
        }
        Ok(Version { v: None }) => return Err(unreadable(content, "no format version \"v\"".into())),
        Err(e) => return Err(unreadable(content, format!("not a JSON object: {e}"))),
    }
    let c: Content = serde_json::from_str(text).map_err(|e| unreadable(content, e.to_string()))?;
    debug_assert_eq!(c.v, FORMAT_VERSION);
    let headers = match c.headers {
        Some(h) if h.get() != "null" => h.get().to_owned(),
        _ => "{}".to_owned(),
    };
    let created_at = match c.created_at {
        Some(t) => match chrono::DateTime::parse_from_rfc3339(&t) {
            Ok(t) => CreatedAt::At(t.to_utc()),
            Err(e) => {
                return Err(unreadable(
                    content,
                    format!("createdAt {t:?} is not RFC 3339: {e}"),
                ))
            }
        },
        None => CreatedAt::At(commit_time),
    };
    Ok(OutboxRow {
        id: c.id.to_string(),
        aggregate_type: c.aggregate_type,
        aggregate_id: c.aggregate_id,
        event_type: c.event_type,
        payload: Payload::Json(c.payload.get().to_owned()),
        headers,
        created_at,
        // A message has no additional columns: a placement reads it as
        // missing, a topic template that reads one renders no topic.
        extra: Vec::new(),
        facts: None,
    })
}

/// What can be read of content that is no outbox event.
fn unreadable(content: &[u8], reason: String) -> Box<UnreadableRow> {
    let text = String::from_utf8_lossy(content);
    let field = |name: &str| {
        serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(&text)
            .ok()
            .and_then(|m| m.get(name).and_then(|v| v.as_str().map(str::to_owned)))
            .unwrap_or_default()
    };
    Box::new(UnreadableRow {
        id: field("id"),
        aggregate_id: field("aggregateId"),
        columns_json: serde_json::json!({ "content": text }).to_string(),
        error: RowError::Message { reason },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::TimeZone;

    fn commit() -> chrono::DateTime<chrono::Utc> {
        chrono::Utc.with_ymd_and_hms(2026, 12, 1, 10, 0, 0).unwrap()
    }

    #[test]
    fn version_one_content_is_a_row() {
        let id = Uuid::now_v7();
        let content = format!(
            r#"{{"v": 1, "id": "{id}", "aggregateType": "Order", "aggregateId": "1001", "type": "t",
                "payload": {{"total": 1e400, "n": [1, 2]}}, "headers": {{"traceparent": "x"}},
                "createdAt": "2026-12-01T09:59:59.5+00:00", "extra": true}}"#
        );
        let r = row(content.as_bytes(), commit()).unwrap();
        assert_eq!(r.id, id.to_string());
        assert_eq!(
            (r.aggregate_type.as_str(), r.aggregate_id.as_str()),
            ("Order", "1001")
        );
        assert_eq!(
            r.payload.json(),
            Some(r#"{"total": 1e400, "n": [1, 2]}"#),
            "the payload as written"
        );
        assert_eq!(r.headers, r#"{"traceparent": "x"}"#);
        assert_eq!(
            r.created_at,
            CreatedAt::At(
                chrono::Utc.with_ymd_and_hms(2026, 12, 1, 9, 59, 59).unwrap()
                    + chrono::Duration::milliseconds(500)
            )
        );
        let bare = format!(
            r#"{{"v":1,"id":"{id}","aggregateType":"A","aggregateId":"1","type":"t","payload":null}}"#
        );
        let r = row(bare.as_bytes(), commit()).unwrap();
        assert_eq!((r.headers.as_str(), r.payload.json()), ("{}", Some("null")));
        assert_eq!(
            r.created_at,
            CreatedAt::At(commit()),
            "no createdAt: the commit time"
        );
    }

    #[test]
    fn anything_else_is_unreadable_with_a_reason_and_its_content() {
        let id = Uuid::now_v7();
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (b"\xff\xfe".to_vec(), "not UTF-8"),
            (b"plain text".to_vec(), "not a JSON object"),
            (b"[1]".to_vec(), "not a JSON object"),
            (format!(r#"{{"id":"{id}"}}"#).into_bytes(), "no format version"),
            (format!(r#"{{"v":2,"id":"{id}","aggregateId":"k"}}"#).into_bytes(), "format version 2"),
            (br#"{"v":1,"id":"nope"}"#.to_vec(), "UUID"),
            (
                format!(r#"{{"v":1,"id":"{id}","aggregateType":"A","aggregateId":"1","type":"t"}}"#).into_bytes(),
                "missing field `payload`",
            ),
            (
                format!(r#"{{"v":1,"id":"{id}","aggregateType":"A","aggregateId":"1","type":"t","payload":1,"createdAt":"yesterday"}}"#)
                    .into_bytes(),
                "not RFC 3339",
            ),
        ];
        for (content, why) in cases {
            let u = row(&content, commit()).unwrap_err();
            assert!(u.error.to_string().contains(why), "{why}: {}", u.error);
            assert!(u.columns_json.contains("content"), "{}", u.columns_json);
        }
        let u = row(
            format!(r#"{{"v":2,"id":"{id}","aggregateId":"k"}}"#).as_bytes(),
            commit(),
        )
        .unwrap_err();
        assert_eq!((u.id, u.aggregate_id), (id.to_string(), "k".to_owned()));
    }
}

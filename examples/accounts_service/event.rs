//! One `account.events` record, as outboxd publishes what the SDK's event
//! store appends: the key is the account id; the headers carry `id`,
//! `aggregateId`, `type`, `version`, `occurredAt` (the event store's time)
//! and the application's own (`correlationId`, `traceparent`, …); the value
//! is outboxd's envelope (the payload under `data`) or the bare payload.

use chrono::{DateTime, Utc};
use rdkafka::message::{BorrowedMessage, Headers, Message};
use serde_json::{Map, Value};
use uuid::Uuid;

/// Headers outboxd itself adds (the rest are the application's metadata).
const ROUTING_HEADERS: [&str; 4] = ["id", "aggregateType", "aggregateId", "type"];

#[derive(Clone, Debug, PartialEq)]
pub struct AccountRecord {
    pub account_id: String,
    pub version: i64,
    pub event_id: Uuid,
    pub event_type: String,
    pub data: Value,
    pub occurred_at: DateTime<Utc>,
    /// The application's headers: everything but outboxd's routing headers,
    /// `version` and `occurredAt`.
    pub metadata: Map<String, Value>,
}

impl AccountRecord {
    pub fn correlation_id(&self) -> Option<&str> {
        self.metadata.get("correlationId").and_then(Value::as_str)
    }

    /// Reads a record; the error says why it cannot be handled at all.
    pub fn decode(m: &BorrowedMessage<'_>, envelope: bool) -> Result<Self, String> {
        let mut headers = Map::new();
        if let Some(hs) = m.headers() {
            for h in hs.iter() {
                let value = std::str::from_utf8(h.value.unwrap_or_default())
                    .map_err(|_| format!("header {} is not UTF-8", h.key))?;
                headers.insert(h.key.to_owned(), Value::String(value.to_owned()));
            }
        }
        let text = |name: &str| -> Result<String, String> {
            headers
                .get(name)
                .and_then(Value::as_str)
                .map(str::to_owned)
                .ok_or_else(|| format!("the {name} header is missing"))
        };
        let account_id = text("aggregateId")?;
        let event_type = text("type")?;
        let version = text("version")?;
        let version: i64 = version
            .parse()
            .ok()
            .filter(|v| *v > 0)
            .ok_or_else(|| format!("version header {version:?} is not a positive number"))?;
        let id = text("id")?;
        let event_id: Uuid = id
            .parse()
            .map_err(|_| format!("id header {id:?} is not a UUID"))?;
        let body: Value = serde_json::from_slice(m.payload().unwrap_or_default())
            .map_err(|e| format!("value is not JSON: {e}"))?;
        let (data, envelope_time) = if envelope {
            let data = body.get("data").cloned().ok_or("the envelope has no data")?;
            (
                data,
                body.get("occurredAt").and_then(Value::as_str).map(str::to_owned),
            )
        } else {
            (body, None)
        };
        // The event store's time; the envelope's is the outbox row's (the
        // start of the writing transaction), for records written without
        // the SDK's event store.
        let when = headers
            .get("occurredAt")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .or(envelope_time)
            .ok_or("no occurredAt header and no envelope time")?;
        let occurred_at = DateTime::parse_from_rfc3339(&when)
            .map_err(|e| format!("occurredAt {when:?} is not RFC 3339: {e}"))?
            .with_timezone(&Utc);
        let metadata = headers
            .into_iter()
            .filter(|(k, _)| !ROUTING_HEADERS.contains(&k.as_str()) && k != "version" && k != "occurredAt")
            .collect();
        Ok(AccountRecord {
            account_id,
            version,
            event_id,
            event_type,
            data,
            occurred_at,
            metadata,
        })
    }
}

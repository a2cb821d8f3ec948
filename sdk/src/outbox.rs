//! Appending events to the outbox table.
//!
//! Call [`append`] with the same [`Transaction`](tokio_postgres::Transaction)
//! that writes your domain rows: both commit together or not at all. A
//! batch of any size costs one round trip (one `INSERT … SELECT FROM
//! unnest(…)` sent with its parameter types, so no separate prepare).

use std::collections::BTreeMap;

use serde_json::Value;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::GenericClient;
use uuid::Uuid;

use crate::error::SdkError;
use crate::schema::TableName;

/// Header that carries the correlation id.
pub const CORRELATION_ID: &str = "correlationId";
/// Header that carries the W3C trace context.
pub const TRACEPARENT: &str = "traceparent";

/// Event headers: a JSON object; outboxd turns each key into a Kafka header
/// (strings raw, other values as JSON text).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Headers(BTreeMap<String, Value>);

impl Headers {
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets a header.
    pub fn insert(&mut self, key: impl Into<String>, value: impl Into<Value>) -> &mut Self {
        self.0.insert(key.into(), value.into());
        self
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key)
    }

    /// Sets the correlation id.
    pub fn set_correlation_id(&mut self, id: impl Into<String>) -> &mut Self {
        self.insert(CORRELATION_ID, id.into())
    }

    pub fn correlation_id(&self) -> Option<&str> {
        self.0.get(CORRELATION_ID).and_then(Value::as_str)
    }

    /// Sets a W3C `traceparent` (`00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`),
    /// after checking its format.
    pub fn set_traceparent(&mut self, traceparent: &str) -> Result<&mut Self, SdkError> {
        validate_traceparent(traceparent)?;
        Ok(self.insert(TRACEPARENT, traceparent))
    }

    pub fn traceparent(&self) -> Option<&str> {
        self.0.get(TRACEPARENT).and_then(Value::as_str)
    }

    pub(crate) fn to_json(&self) -> Value {
        Value::Object(self.0.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
    }
}

fn validate_traceparent(tp: &str) -> Result<(), SdkError> {
    let bad =
        |why: &str| SdkError::InvalidEvent(format!("traceparent {tp:?} is not W3C trace context: {why}"));
    let parts: Vec<&str> = tp.split('-').collect();
    let [version, trace_id, span_id, flags] = parts.as_slice() else {
        return Err(bad("expected four dash-separated fields"));
    };
    let hex = |s: &str, len: usize| {
        s.len() == len
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    if !hex(version, 2) || *version == "ff" {
        return Err(bad("bad version"));
    }
    if !hex(trace_id, 32) || trace_id.bytes().all(|b| b == b'0') {
        return Err(bad("trace id must be 32 lowercase hex digits, not all zero"));
    }
    if !hex(span_id, 16) || span_id.bytes().all(|b| b == b'0') {
        return Err(bad("parent id must be 16 lowercase hex digits, not all zero"));
    }
    if !hex(flags, 2) {
        return Err(bad("flags must be 2 lowercase hex digits"));
    }
    Ok(())
}

/// One event to publish.
#[derive(Clone, Debug, PartialEq)]
pub struct OutboxEvent {
    /// The event id; a time-ordered UUIDv7 is generated when `None`.
    pub id: Option<Uuid>,
    /// `Order`: outboxd routes it to `order.events`.
    pub aggregate_type: String,
    /// The Kafka key: events of one aggregate keep their order.
    pub aggregate_id: String,
    /// `ordering.order-placed.v1`.
    pub event_type: String,
    pub payload: Value,
    pub headers: Headers,
}

impl OutboxEvent {
    /// An event with a generated id and no headers.
    ///
    /// ```
    /// use outbox_sdk::outbox::OutboxEvent;
    /// let mut e = OutboxEvent::new("Order", "1001", "ordering.order-placed.v1", serde_json::json!({"total": 1250}));
    /// e.headers.set_correlation_id("req-42");
    /// assert_eq!(e.headers.correlation_id(), Some("req-42"));
    /// ```
    pub fn new(
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        event_type: impl Into<String>,
        payload: Value,
    ) -> Self {
        OutboxEvent {
            id: None,
            aggregate_type: aggregate_type.into(),
            aggregate_id: aggregate_id.into(),
            event_type: event_type.into(),
            payload,
            headers: Headers::new(),
        }
    }

    /// Uses a caller-chosen event id.
    pub fn with_id(mut self, id: Uuid) -> Self {
        self.id = Some(id);
        self
    }

    fn validate(&self) -> Result<(), SdkError> {
        for (field, value) in [
            ("aggregate_type", &self.aggregate_type),
            ("aggregate_id", &self.aggregate_id),
            ("type", &self.event_type),
        ] {
            if value.trim().is_empty() {
                return Err(SdkError::InvalidEvent(format!("{field} must not be empty")));
            }
        }
        Ok(())
    }
}

/// Appends events to `public.outbox`; returns their ids in order.
///
/// ```no_run
/// # async fn example(client: &mut tokio_postgres::Client) -> Result<(), Box<dyn std::error::Error>> {
/// use outbox_sdk::outbox::{append, OutboxEvent};
/// let tx = client.transaction().await?;
/// tx.execute("UPDATE orders SET status = 'PAID' WHERE id = $1", &[&uuid::Uuid::nil()]).await?;
/// append(&tx, &[OutboxEvent::new("Order", "1001", "ordering.order-paid.v1", serde_json::json!({}))]).await?;
/// tx.commit().await?; // the update and the event commit together
/// # Ok(()) }
/// ```
pub async fn append<C: GenericClient>(client: &C, events: &[OutboxEvent]) -> Result<Vec<Uuid>, SdkError> {
    append_to(client, &TableName::outbox(), events).await
}

/// Appends events to another outbox table.
pub async fn append_to<C: GenericClient>(
    client: &C,
    table: &TableName,
    events: &[OutboxEvent],
) -> Result<Vec<Uuid>, SdkError> {
    if events.is_empty() {
        return Ok(Vec::new());
    }
    let columns = Columns::of(events)?;
    let sql = format!(
        "INSERT INTO {} (id, aggregate_type, aggregate_id, type, payload, headers)
         SELECT id, aggregate_type, aggregate_id, type, payload, headers
           FROM unnest($1, $2, $3, $4, $5, $6)
                WITH ORDINALITY AS e(id, aggregate_type, aggregate_id, type, payload, headers, ord)
          ORDER BY ord",
        table.quoted()
    );
    client.execute_typed(&sql, &columns.params()).await?;
    Ok(columns.ids)
}

/// Emits events into the WAL instead of the outbox table: the table-less
/// outbox. Each event is a transactional logical decoding message with
/// the prefix `outbox` (through `outbox_emit`, migration 0007), so it
/// commits or rolls back with `client`'s transaction, in order with the
/// transaction's outbox rows, and outboxd publishes it exactly like a row.
/// Nothing is stored, so there is nothing to clean up, and nothing for
/// `outboxd replay` to re-publish later: only the WAL ever holds it.
/// Returns the event ids in order.
///
/// ```no_run
/// # async fn example(client: &mut tokio_postgres::Client) -> Result<(), Box<dyn std::error::Error>> {
/// use outbox_sdk::outbox::{emit, OutboxEvent};
/// let tx = client.transaction().await?;
/// tx.execute("UPDATE orders SET status = 'PAID' WHERE id = $1", &[&uuid::Uuid::nil()]).await?;
/// emit(&tx, &[OutboxEvent::new("Order", "1001", "ordering.order-paid.v1", serde_json::json!({}))]).await?;
/// tx.commit().await?; // the event reaches the WAL, and Kafka, only now
/// # Ok(()) }
/// ```
pub async fn emit<C: GenericClient>(client: &C, events: &[OutboxEvent]) -> Result<Vec<Uuid>, SdkError> {
    if events.is_empty() {
        return Ok(Vec::new());
    }
    let columns = Columns::of(events)?;
    // The subquery's ORDER BY … OFFSET 0 fixes the order the messages are
    // written in: the order of `events`.
    let sql = "SELECT count(outbox_emit(aggregate_type, aggregate_id, type, payload, headers, id))
                 FROM (SELECT * FROM unnest($1, $2, $3, $4, $5, $6)
                            WITH ORDINALITY AS e(id, aggregate_type, aggregate_id, type, payload, headers, ord)
                       ORDER BY ord OFFSET 0) e";
    client.execute_typed(sql, &columns.params()).await?;
    Ok(columns.ids)
}

/// The events as the column arrays of one statement.
struct Columns<'a> {
    ids: Vec<Uuid>,
    aggregate_types: Vec<&'a str>,
    aggregate_ids: Vec<&'a str>,
    types: Vec<&'a str>,
    payloads: Vec<Value>,
    headers: Vec<Value>,
}

impl<'a> Columns<'a> {
    fn of(events: &'a [OutboxEvent]) -> Result<Self, SdkError> {
        let mut c = Columns {
            ids: Vec::with_capacity(events.len()),
            aggregate_types: Vec::with_capacity(events.len()),
            aggregate_ids: Vec::with_capacity(events.len()),
            types: Vec::with_capacity(events.len()),
            payloads: Vec::with_capacity(events.len()),
            headers: Vec::with_capacity(events.len()),
        };
        for e in events {
            e.validate()?;
            c.ids.push(e.id.unwrap_or_else(Uuid::now_v7));
            c.aggregate_types.push(e.aggregate_type.as_str());
            c.aggregate_ids.push(e.aggregate_id.as_str());
            c.types.push(e.event_type.as_str());
            c.payloads.push(e.payload.clone());
            c.headers.push(e.headers.to_json());
        }
        Ok(c)
    }

    fn params(&self) -> [(&(dyn ToSql + Sync), Type); 6] {
        [
            (&self.ids, Type::UUID_ARRAY),
            (&self.aggregate_types, Type::TEXT_ARRAY),
            (&self.aggregate_ids, Type::TEXT_ARRAY),
            (&self.types, Type::TEXT_ARRAY),
            (&self.payloads, Type::JSONB_ARRAY),
            (&self.headers, Type::JSONB_ARRAY),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_is_checked() {
        let mut h = Headers::new();
        h.set_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
            .unwrap();
        assert_eq!(
            h.traceparent(),
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        );
        for bad in [
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        ] {
            assert!(Headers::new().set_traceparent(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn empty_fields_are_refused() {
        let e = OutboxEvent::new("Order", " ", "t", Value::Null);
        assert!(e.validate().unwrap_err().to_string().contains("aggregate_id"));
    }
}

//! From outbox row to Kafka record (seed 000's relay, made exact).
//!
//! The row arrives read through the column map ([`crate::source::outbox`]);
//! here it becomes a record:
//!
//! * topic: `routing.topic`, a template over `{aggregate_type}` (the route
//!   column; the default `{aggregate_type}.events` lowercases it: `Order` →
//!   `order.events`), `{type}`, any other `{column}`, and with
//!   `routing.topic_regex` its capture groups `{$1}`, `{$name}`;
//! * key: the key column (`aggregate_id`), so one aggregate's events share
//!   a partition and keep their order; the partition is the partitioner's
//!   unless a `partition` placement picks it;
//! * value: the envelope `{"eventId","type","occurredAt","aggregateType",
//!   "aggregateId","data"}` (plus `envelope` placements), the payload byte
//!   for byte, or CloudEvents; a `bytea` payload is forwarded as its bytes
//!   (`dataBase64` in the envelope); a text payload follows
//!   `routing.text_payload` wherever it is embedded in JSON. A NULL
//!   payload is a null value where the value is the payload, `null` where
//!   it is embedded; with `routing.tombstone_on_empty_payload`, a NULL or
//!   blank payload is a tombstone in every format (the key, headers, a
//!   null value);
//! * headers: `id`, then (with `routing.standard_headers`) `type`,
//!   `aggregateType` and `aggregateId` (the first two left out when the
//!   table has no such column), then one header per
//!   key of the row's headers object (strings raw, other values as JSON
//!   text; keys that collide with the ones above are skipped), then the
//!   `header` placements (a NULL or missing column sets none);
//! * timestamp: the timestamp column, when Kafka can take it: after the
//!   Unix epoch and at most [`MAX_AHEAD_OF_COMMIT_MS`] after the
//!   transaction's commit. Otherwise the commit time (see
//!   [`kafka_timestamp`]).
//!
//! A row that can never become a valid record (an illegal topic name, an
//! empty key, headers that are not an object) is a [`RecordError`]; the
//! relay never drops it silently.

use std::borrow::Cow;

use chrono::SecondsFormat;

use crate::config::columns::Placement;
pub use crate::config::routing::{topic_name_problem, RecordValue, TextPayload, TopicTemplate};
use crate::config::routing::{Capture, TopicPart};
use crate::config::ValueFormat;
use crate::kafka::{cloudevents, connect};
use crate::source::outbox::{is_json, CreatedAt, Extra, OutboxRow, Payload, UnreadableRow};

/// Header names outboxd sets on every record.
pub mod header {
    pub const ID: &str = "id";
    pub const TYPE: &str = "type";
    pub const AGGREGATE_TYPE: &str = "aggregateType";
    pub const AGGREGATE_ID: &str = "aggregateId";
    /// On records `outboxd replay` published: when the replay started.
    pub const REPLAYED: &str = "replayed";
}

/// What a template reads of a row: the route and type values, and the
/// additional columns' text (`None`: NULL or missing).
pub trait TopicValues {
    fn route(&self) -> &str;
    fn event_type(&self) -> &str;
    fn column(&self, extra: usize) -> Option<&str>;
}

impl TopicValues for OutboxRow {
    fn route(&self) -> &str {
        &self.aggregate_type
    }
    fn event_type(&self) -> &str {
        &self.event_type
    }
    fn column(&self, extra: usize) -> Option<&str> {
        self.extra.get(extra).and_then(Extra::text)
    }
}

impl TopicTemplate {
    /// The topic of `row`: the template filled in, an allowed aggregate
    /// type, a legal name.
    pub fn render(&self, row: &impl TopicValues) -> Result<String, RecordError> {
        let mut topic = String::with_capacity(32);
        self.render_into(row, &mut topic)?;
        Ok(topic)
    }

    /// [`TopicTemplate::render`] into `topic`, which it overwrites (its
    /// allocation is reused).
    pub fn render_into(&self, row: &impl TopicValues, topic: &mut String) -> Result<(), RecordError> {
        if !self.allows(row.route()) {
            return Err(RecordError::AggregateTypeNotAllowed(row.route().to_owned()));
        }
        self.fill_into(row, true, topic)?;
        validate_topic(topic)
    }

    /// Whether the topic depends on the event type (`{type}`).
    pub fn uses_event_type(&self) -> bool {
        self.parts.contains(&TopicPart::EventType)
    }

    /// The template filled in, whether or not the aggregate type is
    /// allowed and the name is a legal topic (a NULL column renders
    /// empty): the sequence a row belongs to when it is parked (see
    /// [`crate::park`]).
    pub fn render_unchecked(&self, row: &impl TopicValues) -> String {
        self.fill(row, false).unwrap_or_default()
    }

    fn push_route(&self, route: &str, topic: &mut String) {
        if self.lowercase_aggregate_type {
            topic.extend(route.chars().flat_map(char::to_lowercase));
        } else {
            topic.push_str(route);
        }
    }

    fn fill(&self, row: &impl TopicValues, strict: bool) -> Result<String, RecordError> {
        let mut topic = String::with_capacity(32);
        self.fill_into(row, strict, &mut topic)?;
        Ok(topic)
    }

    fn fill_into(&self, row: &impl TopicValues, strict: bool, topic: &mut String) -> Result<(), RecordError> {
        topic.clear();
        let captures = match &self.regex {
            Some(re) => match re.anchored.captures(row.route()) {
                Some(c) => Some(c),
                // Kafka Connect's RegexRouter leaves the topic unchanged
                // when the value does not match: the value is the topic.
                None => {
                    self.push_route(row.route(), topic);
                    return Ok(());
                }
            },
            None => None,
        };
        for p in &self.parts {
            match p {
                TopicPart::Literal(l) => topic.push_str(l),
                TopicPart::AggregateType => self.push_route(row.route(), topic),
                TopicPart::EventType => topic.push_str(row.event_type()),
                TopicPart::Column(i) => match row.column(*i) {
                    Some(v) => topic.push_str(v),
                    None if strict => {
                        return Err(RecordError::IllegalTopic {
                            topic: topic.clone(),
                            reason: "a column the topic template reads is NULL",
                        })
                    }
                    None => {}
                },
                TopicPart::Capture(c) => {
                    let group = captures.as_ref().and_then(|caps| match c {
                        Capture::Index(i) => caps.get(*i),
                        Capture::Name(n) => caps.name(n),
                    });
                    topic.push_str(group.map_or("", |m| m.as_str()));
                }
            }
        }
        Ok(())
    }
}

/// Kafka's rules for topic names.
pub fn validate_topic(topic: &str) -> Result<(), RecordError> {
    match topic_name_problem(topic) {
        Some(reason) => Err(RecordError::IllegalTopic {
            topic: topic.to_owned(),
            reason,
        }),
        None => Ok(()),
    }
}

/// A row that cannot become a Kafka record.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum RecordError {
    #[error("topic name {topic:?} is illegal: {reason}")]
    IllegalTopic { topic: String, reason: &'static str },
    #[error("the key column is empty or NULL; the Kafka key must identify the aggregate")]
    EmptyKey,
    #[error("headers must be a JSON object, found {0}")]
    HeadersNotObject(String),
    #[error("headers cannot be made Kafka headers: {0}")]
    HeadersUnreadable(String),
    #[error("the timestamp {0} cannot be written as an RFC 3339 time (years 0001 to 9999) in the envelope's occurredAt")]
    Timestamp(String),
    #[error("aggregate_type {0:?} is not in routing.allowed_aggregate_types, so no topic is made for it")]
    AggregateTypeNotAllowed(String),
    #[error("a CloudEvent needs {0}")]
    CloudEvent(&'static str),
    /// The payload does not fit its registry schema (see [`crate::schema`]).
    #[error("{0}")]
    SchemaMismatch(String),
    /// `routing.text_payload = "json"` and the text is no JSON.
    #[error("{0}")]
    Payload(String),
    /// The partition placement's value is no partition.
    #[error("the partition column holds {0}, which is no partition number (0 to 2147483647)")]
    Partition(String),
}

impl RecordError {
    /// A short, bounded label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            RecordError::IllegalTopic { .. } => "illegal_topic",
            RecordError::EmptyKey => "empty_key",
            RecordError::HeadersNotObject(_) | RecordError::HeadersUnreadable(_) => "bad_headers",
            RecordError::Timestamp(_) => "bad_timestamp",
            RecordError::AggregateTypeNotAllowed(_) => "aggregate_type_not_allowed",
            RecordError::CloudEvent(_) => "bad_cloudevent",
            RecordError::SchemaMismatch(_) => "schema_mismatch",
            RecordError::Payload(_) => "bad_payload",
            RecordError::Partition(_) => "bad_partition",
        }
    }
}

/// A header's name: outboxd's own names are borrowed, not allocated per
/// record.
pub type HeaderName = std::borrow::Cow<'static, str>;

/// A record's headers, in order.
pub type Headers = Vec<(HeaderName, Vec<u8>)>;

/// A record ready to produce.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KafkaRecord {
    pub topic: String,
    /// The key as sent: the key column's UTF-8, or its registry encoding
    /// under `routing.key_format`.
    pub key: Vec<u8>,
    /// `None`: a null value (a tombstone, or a NULL payload forwarded).
    pub value: Option<Vec<u8>>,
    pub headers: Headers,
    pub timestamp_ms: i64,
    /// The partition a `partition` placement picked; `None`: the
    /// partitioner's, from the key.
    pub partition: Option<i32>,
}

impl KafkaRecord {
    /// Bytes of key, value and headers: what it costs in a batch.
    pub fn size(&self) -> usize {
        self.key.len() + self.value_len() + self.headers.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>()
    }

    /// The value's length (0 for a null value).
    pub fn value_len(&self) -> usize {
        self.value.as_ref().map_or(0, Vec::len)
    }

    /// The value's bytes (empty for a null value).
    pub fn value_bytes(&self) -> &[u8] {
        self.value.as_deref().unwrap_or_default()
    }

    /// The value of header `name` as text (empty when it is missing).
    pub fn header_text(&self, name: &str) -> String {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
            .unwrap_or_default()
    }
}

/// How far past its transaction's commit the timestamp column may lie and
/// still be the record's timestamp. A later one was set by the writer, not
/// by the clock, and Kafka 4 refuses timestamps more than an hour ahead of
/// the broker's clock (`log.message.timestamp.after.max.ms`).
pub const MAX_AHEAD_OF_COMMIT_MS: i64 = 5 * 60 * 1000;

/// How far before its transaction's commit the timestamp column may lie
/// and still be the record's timestamp. An earlier one is no insert time
/// (a business date, seconds where milliseconds were meant): Kafka's
/// time-based retention would delete such a record at the next segment
/// roll, long before consumers read it.
pub const MAX_BEHIND_COMMIT_MS: i64 = 24 * 60 * 60 * 1000;

/// The Kafka record timestamp (CreateTime) for a row committed at
/// `commit_ms`: its timestamp when it lies within
/// [`MAX_BEHIND_COMMIT_MS`] before and [`MAX_AHEAD_OF_COMMIT_MS`] after the
/// commit; otherwise the commit time. Kafka takes neither negative
/// timestamps nor far-future ones (and to librdkafka a timestamp of 0 means
/// "now"), deletes far-past ones by retention, and a timestamp out there (a
/// date before 1970, year 20000, `infinity`) is still an event that
/// happened when it committed.
pub fn kafka_timestamp(created_at: &CreatedAt, commit_ms: i64) -> i64 {
    match created_at {
        CreatedAt::At(t) => {
            let ms = t.timestamp_millis();
            let earliest = commit_ms.saturating_sub(MAX_BEHIND_COMMIT_MS).max(1);
            if (earliest..=commit_ms.saturating_add(MAX_AHEAD_OF_COMMIT_MS)).contains(&ms) {
                ms
            } else {
                commit_ms
            }
        }
        CreatedAt::Unrepresentable(_) | CreatedAt::Absent => commit_ms,
    }
}

/// Builds the record for a row whose transaction committed at `commit_ms`
/// (milliseconds since the Unix epoch).
pub fn build_record(
    row: &OutboxRow,
    topic: &TopicTemplate,
    value: &RecordValue,
    commit_ms: i64,
) -> Result<KafkaRecord, RecordError> {
    let mut record = KafkaRecord::default();
    build_record_into(row, topic, value, commit_ms, &mut record)?;
    Ok(record)
}

/// [`build_record`] into `into`, whose every field it overwrites: the
/// relay builds each record into the one before it, so that the topic,
/// key, value and header buffers are allocated once, not per record. On
/// an error `into` is left empty (a default record), never a mix of this
/// row's fields and the record before.
pub fn build_record_into(
    row: &OutboxRow,
    topic: &TopicTemplate,
    value: &RecordValue,
    commit_ms: i64,
    into: &mut KafkaRecord,
) -> Result<(), RecordError> {
    let built = fill_record(row, topic, value, commit_ms, into);
    if built.is_err() {
        *into = KafkaRecord::default();
    }
    built
}

/// What [`build_record_into`] does, leaving `into` half-written on an
/// error.
fn fill_record(
    row: &OutboxRow,
    topic: &TopicTemplate,
    value: &RecordValue,
    commit_ms: i64,
    into: &mut KafkaRecord,
) -> Result<(), RecordError> {
    if row.aggregate_id.is_empty() {
        return Err(RecordError::EmptyKey);
    }
    topic.render_into(row, &mut into.topic)?;
    let created_at = row.created_at.or_commit(commit_ms);
    let id = row.id.as_str();
    let mut headers = HeaderSlots::new(&mut into.headers);
    headers.put(header::ID, id.as_bytes());
    if value.standard_headers {
        // A row of a table without a type (or route) column has no such
        // header; a message or a row read back from the park tables (no
        // facts) has both columns.
        let facts = row.facts.as_deref();
        if facts.is_none_or(|f| f.has_type) {
            headers.put(header::TYPE, row.event_type.as_bytes());
        }
        if facts.is_none_or(|f| f.has_route) {
            headers.put(header::AGGREGATE_TYPE, row.aggregate_type.as_bytes());
        }
        headers.put(header::AGGREGATE_ID, row.aggregate_id.as_bytes());
    }
    let cloudevent = matches!(
        value.format,
        ValueFormat::CloudEvents | ValueFormat::CloudEventsBinary
    );
    user_headers(&row.headers, |k, v| {
        let taken = [
            header::ID,
            header::TYPE,
            header::AGGREGATE_TYPE,
            header::AGGREGATE_ID,
        ]
        .contains(&k)
            || (cloudevent && cloudevents::is_reserved_header(k));
        if !taken {
            headers.put_named(k, v);
        }
    })?;
    let mut partition = None;
    for p in &value.placements {
        let extra = row.extra.get(p.extra).unwrap_or(&Extra::Missing);
        match p.placement {
            Placement::Header => {
                if let Some(text) = extra.text() {
                    headers.put_named(&p.name, text.as_bytes());
                }
            }
            Placement::Partition => {
                partition = match extra.text() {
                    None => None,
                    Some(t) => Some(
                        t.parse::<i32>()
                            .ok()
                            .filter(|p| *p >= 0)
                            .ok_or_else(|| RecordError::Partition(t.to_owned()))?,
                    ),
                };
            }
            Placement::Envelope => {}
        }
    }
    headers.finish();
    let tombstone = value.tombstones && row.payload.is_blank();
    let value_rules = value;
    // The value buffer of the record before, to fill again.
    let mut reused = emptied(into.value.take().unwrap_or_default());
    let value = if tombstone {
        None
    } else {
        match value.format {
            // Registry formats start from the payload: crate::schema encodes it.
            ValueFormat::Payload | ValueFormat::Avro | ValueFormat::Protobuf | ValueFormat::JsonSchema => {
                (row.payload != Payload::Null).then(|| {
                    reused.extend_from_slice(row.payload.as_bytes());
                    reused
                })
            }
            ValueFormat::ConnectJson => {
                let facts = row.facts.clone().unwrap_or_default();
                Some(connect::value(
                    row,
                    &facts,
                    value,
                    value.connect_schemas,
                    &value.connect_struct_prefix,
                ))
            }
            ValueFormat::Envelope => {
                let at = created_at
                    .rfc3339()
                    .ok_or_else(|| RecordError::Timestamp(created_at.to_string()))?;
                envelope(row, id, at, value, &mut reused)?;
                Some(reused)
            }
            ValueFormat::CloudEvents | ValueFormat::CloudEventsBinary => {
                if row.event_type.is_empty() {
                    return Err(RecordError::CloudEvent("a type: the row's type is empty"));
                }
                let source = value.source.render(row).ok_or(RecordError::CloudEvent(
                    "a source: routing.cloudevents_source renders empty for this row",
                ))?;
                let attributes = cloudevents::Attributes::of(
                    row,
                    id,
                    &source,
                    &into.headers,
                    &created_at,
                    value.text_payload,
                );
                if value.format == ValueFormat::CloudEvents {
                    let v = attributes
                        .structured(&row.payload, value.text_payload)
                        .map_err(RecordError::Payload)?;
                    into.headers.push((
                        cloudevents::CONTENT_TYPE.into(),
                        cloudevents::STRUCTURED_CONTENT_TYPE.as_bytes().to_vec(),
                    ));
                    Some(v)
                } else {
                    let ce = attributes.binary_headers();
                    into.headers.extend(ce);
                    (row.payload != Payload::Null).then(|| row.payload.as_bytes().to_vec())
                }
            }
        }
    };
    into.value = value;
    if value_rules.connect_key {
        into.key = connect::key(
            row,
            &row.facts.clone().unwrap_or_default(),
            value_rules.connect_key_schemas,
        );
    } else {
        refill(&mut into.key, row.aggregate_id.as_bytes());
    }
    into.timestamp_ms = kafka_timestamp(&created_at, commit_ms);
    into.partition = partition;
    Ok(())
}

/// The largest buffer a record keeps for the next one: a rare large row
/// does not hold its size for the rest of the session.
const REUSED_CAPACITY_MAX: usize = 64 * 1024;

/// The most header slots a record keeps for the next one.
const REUSED_HEADERS_MAX: usize = 64;

impl KafkaRecord {
    /// The record with only what is worth keeping for the next
    /// [`build_record_into`]: no buffer past [`REUSED_CAPACITY_MAX`], no
    /// more than [`REUSED_HEADERS_MAX`] header slots. A relay that goes
    /// idle after a large row holds a few small buffers, not the row.
    pub fn recycled(mut self) -> KafkaRecord {
        self.value = self.value.map(emptied).filter(|v| v.capacity() > 0);
        self.key = emptied(std::mem::take(&mut self.key));
        if self.headers.capacity() > REUSED_HEADERS_MAX {
            self.headers = Headers::new();
        }
        for (_, v) in &mut self.headers {
            *v = emptied(std::mem::take(v));
        }
        self
    }
}

/// `buf` emptied for reuse, or a new buffer when it grew past
/// [`REUSED_CAPACITY_MAX`].
fn emptied(mut buf: Vec<u8>) -> Vec<u8> {
    if buf.capacity() > REUSED_CAPACITY_MAX {
        return Vec::new();
    }
    buf.clear();
    buf
}

/// Sets `buf` to `value`, keeping its allocation unless it grew past
/// [`REUSED_CAPACITY_MAX`].
fn refill(buf: &mut Vec<u8>, value: &[u8]) {
    *buf = emptied(std::mem::take(buf));
    buf.extend_from_slice(value);
}

/// Writes a record's headers over those of the record before: a slot
/// whose name is the same keeps its name, and every value its buffer.
struct HeaderSlots<'h> {
    headers: &'h mut Headers,
    used: usize,
}

impl<'h> HeaderSlots<'h> {
    fn new(headers: &'h mut Headers) -> Self {
        HeaderSlots { headers, used: 0 }
    }

    /// Sets the next header, one of outboxd's own names.
    fn put(&mut self, name: &'static str, value: &[u8]) {
        self.put_with(name, || HeaderName::Borrowed(name), value);
    }

    /// Sets the next header, named by the row or the configuration: the
    /// name is copied only when the slot's differs.
    fn put_named(&mut self, name: &str, value: &[u8]) {
        self.put_with(name, || HeaderName::Owned(name.to_owned()), value);
    }

    /// Sets the next header to `value`; `make` names a slot whose name is
    /// not `name` already.
    fn put_with(&mut self, name: &str, make: impl FnOnce() -> HeaderName, value: &[u8]) {
        match self.headers.get_mut(self.used) {
            Some((k, v)) => {
                if k != name {
                    *k = make();
                }
                refill(v, value);
            }
            None => self.headers.push((make(), value.to_vec())),
        }
        self.used += 1;
    }

    /// Drops the slots the record before used past this record's.
    fn finish(self) {
        self.headers.truncate(self.used);
    }
}

/// The row's headers object as Kafka headers, in key order, each handed
/// to `put`: strings raw, other values as compact JSON text. A value that
/// holds a number no float can hold (jsonb keeps `1e400` exactly) or is
/// nested too deep to read as a value is passed on as PostgreSQL wrote it,
/// not refused.
fn user_headers(text: &str, mut put: impl FnMut(&str, &[u8])) -> Result<(), RecordError> {
    if !text.trim_start().starts_with('{') {
        let kind = serde_json::from_str::<serde_json::Value>(text).map_or("invalid JSON", |v| json_kind(&v));
        return Err(RecordError::HeadersNotObject(kind.into()));
    }
    let mut members = serde_json::from_str::<Members<'_>>(text)
        .map_err(|e| RecordError::HeadersUnreadable(e.to_string()))?
        .0;
    // Key order; of members with one key, the last (a stable sort keeps
    // their order), as a map would keep them.
    members.sort_by(|a, b| a.0.cmp(&b.0));
    for (i, (k, v)) in members.iter().enumerate() {
        if members.get(i + 1).is_some_and(|(next, _)| next == k) {
            continue;
        }
        let raw = v.get();
        if let Some(plain) = raw
            .strip_prefix('"')
            .and_then(|r| r.strip_suffix('"'))
            .filter(|r| !r.contains('\\'))
        {
            // A string without escapes is its text between the quotes.
            put(k, plain.as_bytes());
        } else if raw.starts_with('"') {
            let text = serde_json::from_str::<String>(raw)
                .map_err(|e| RecordError::HeadersUnreadable(e.to_string()))?;
            put(k, text.as_bytes());
        } else {
            match serde_json::from_str::<serde_json::Value>(raw) {
                Ok(v) => put(k, v.to_string().as_bytes()),
                Err(_) => put(k, raw.as_bytes()),
            }
        }
    }
    Ok(())
}

/// A JSON object's members in the order written, each key borrowed from
/// the text unless it holds an escape: read without a map's allocations
/// (it runs for every event whose row has headers).
struct Members<'a>(Vec<(Cow<'a, str>, &'a serde_json::value::RawValue)>);

impl<'de> serde::Deserialize<'de> for Members<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a map")
            }
            fn visit_map<M: serde::de::MapAccess<'de>>(self, mut map: M) -> Result<Members<'de>, M::Error> {
                let mut members = Vec::with_capacity(map.size_hint().unwrap_or(4));
                while let Some(Key(k)) = map.next_key()? {
                    members.push((k, map.next_value()?));
                }
                Ok(Members(members))
            }
        }
        d.deserialize_map(Visit)
    }
}

/// A member's key: borrowed when it holds no escape.
struct Key<'a>(Cow<'a, str>);

impl<'de> serde::Deserialize<'de> for Key<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string key")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E>(self, v: String) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v)))
            }
        }
        d.deserialize_str(Visit)
    }
}

/// Header names on dead-letter records.
pub mod dlq_header {
    /// A short, bounded reason (`illegal_topic`, `too_large`, …).
    pub const REASON: &str = "dlq.reason";
    /// The full error text.
    pub const ERROR: &str = "dlq.error";
    /// WAL position of the row's INSERT.
    pub const SOURCE_LSN: &str = "dlq.source.lsn";
    /// The topic the record was meant for, when it had one.
    pub const TOPIC: &str = "dlq.topic";
    /// Set when the payload was left out because it is too large.
    pub const PAYLOAD_OMITTED: &str = "dlq.payload.omitted";
}

/// Why a row is dead-lettered, and where it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Poison {
    pub reason: &'static str,
    pub error: String,
    pub lsn: crate::Lsn,
    pub intended_topic: Option<String>,
    /// Leave the payload out of the dead letter (it is what is too large).
    pub omit_payload: bool,
}

fn dlq_headers(p: &Poison, mut headers: Headers) -> Headers {
    headers.push((dlq_header::REASON.into(), p.reason.as_bytes().to_vec()));
    headers.push((dlq_header::ERROR.into(), p.error.as_bytes().to_vec()));
    headers.push((dlq_header::SOURCE_LSN.into(), p.lsn.to_string().into_bytes()));
    if let Some(t) = &p.intended_topic {
        headers.push((dlq_header::TOPIC.into(), t.as_bytes().to_vec()));
    }
    if p.omit_payload {
        headers.push((dlq_header::PAYLOAD_OMITTED.into(), b"too large".to_vec()));
    }
    headers
}

/// A dead letter for a row: the original row as JSON (id, aggregate type
/// and id, type, createdAt, headers and payload, the last two as stored
/// where they are JSON, else as JSON strings), with the `dlq.*` headers.
/// The payload is replaced by its size when it is itself the problem; the
/// row stays in the outbox table.
pub fn dead_letter_for_row(row: &OutboxRow, poison: &Poison, topic: &str) -> KafkaRecord {
    let mut out = Vec::with_capacity(row.payload.len() + row.headers.len() + 256);
    out.extend_from_slice(b"{\"id\":");
    push_json_string(&mut out, &row.id);
    out.extend_from_slice(b",\"aggregateType\":");
    push_json_string(&mut out, &row.aggregate_type);
    out.extend_from_slice(b",\"aggregateId\":");
    push_json_string(&mut out, &row.aggregate_id);
    out.extend_from_slice(b",\"type\":");
    push_json_string(&mut out, &row.event_type);
    out.extend_from_slice(b",\"createdAt\":");
    match (&row.created_at, row.created_at.rfc3339()) {
        (_, Some(t)) => {
            out.push(b'"');
            push_rfc3339_micros(&mut out, t);
            out.push(b'"');
        }
        (CreatedAt::Absent, None) => out.extend_from_slice(b"null"),
        (c, None) => push_json_string(&mut out, &c.to_string()),
    }
    out.extend_from_slice(b",\"headers\":");
    // A text headers column that is no JSON is what a dead letter may be
    // about: it goes as a string, never as broken JSON.
    if is_json(&row.headers) {
        out.extend_from_slice(row.headers.as_bytes());
    } else {
        push_json_string(&mut out, &row.headers);
    }
    if poison.omit_payload {
        out.extend_from_slice(format!(",\"payloadBytes\":{}}}", row.payload.len()).as_bytes());
    } else {
        out.push(b',');
        // Auto never refuses: JSON as it is, any other text as a string.
        let _ = row
            .payload
            .push_member(&mut out, "payload", "payloadBase64", TextPayload::Auto);
        out.push(b'}');
    }
    let ids = vec![
        (header::ID.into(), row.id.as_bytes().to_vec()),
        (header::TYPE.into(), row.event_type.as_bytes().to_vec()),
        (
            header::AGGREGATE_TYPE.into(),
            row.aggregate_type.as_bytes().to_vec(),
        ),
        (header::AGGREGATE_ID.into(), row.aggregate_id.as_bytes().to_vec()),
    ];
    dead_letter(
        topic,
        row.aggregate_id.clone().into_bytes(),
        out,
        dlq_headers(poison, ids),
    )
}

/// A dead letter for a row that could not be read as an event: its id and
/// every column as text (`{"id", "columns": {...}}`), with the `dlq.*`
/// headers. The key is the row's aggregate_id text, as an event's would be.
pub fn dead_letter_for_unreadable(row: &UnreadableRow, poison: &Poison, topic: &str) -> KafkaRecord {
    let mut out = Vec::with_capacity(row.columns_json.len() + 64);
    out.extend_from_slice(b"{\"id\":");
    push_json_string(&mut out, &row.id);
    out.extend_from_slice(b",\"columns\":");
    out.extend_from_slice(row.columns_json.as_bytes());
    out.push(b'}');
    let ids = vec![(header::ID.into(), row.id.as_bytes().to_vec())];
    dead_letter(
        topic,
        row.aggregate_id.clone().into_bytes(),
        out,
        dlq_headers(poison, ids),
    )
}

/// A dead letter for a record the broker refused: the record as it was
/// (key, value, headers), plus the `dlq.*` headers.
pub fn dead_letter_for_record(rec: KafkaRecord, poison: &Poison, topic: &str) -> KafkaRecord {
    let value = if poison.omit_payload {
        Vec::new()
    } else {
        rec.value.unwrap_or_default()
    };
    dead_letter(topic, rec.key, value, dlq_headers(poison, rec.headers))
}

/// Headers of a dead letter that its stub keeps, when they are short.
const STUB_KEEPS: [&str; 5] = [
    header::ID,
    dlq_header::REASON,
    dlq_header::SOURCE_LSN,
    dlq_header::TOPIC,
    header::TYPE,
];

/// Longest key, header value or error text a stub carries.
const STUB_FIELD_MAX: usize = 1024;

/// What is left of a dead letter that Kafka refused too (its key, headers
/// or value are too large for the dead-letter topic): the row's id, the
/// reason, where it came from, and the sizes of what was left out. Small
/// enough for any topic, so a poison row is still accounted for; the row
/// itself stays in the outbox table.
pub fn dead_letter_stub(rec: &KafkaRecord, refused: &str) -> KafkaRecord {
    let short = |v: &[u8]| v.len() <= STUB_FIELD_MAX;
    let mut headers: Headers = rec
        .headers
        .iter()
        .filter(|(k, v)| STUB_KEEPS.contains(&k.as_ref()) && short(v))
        .cloned()
        .collect();
    let earlier = rec.header_text(dlq_header::ERROR);
    let mut error = format!("{earlier}; the dead letter itself was refused: {refused}");
    if error.len() > STUB_FIELD_MAX {
        let mut end = STUB_FIELD_MAX;
        while !error.is_char_boundary(end) {
            end -= 1;
        }
        error.truncate(end);
    }
    headers.push((dlq_header::ERROR.into(), error.into_bytes()));
    headers.push((
        dlq_header::PAYLOAD_OMITTED.into(),
        b"dead letter too large".to_vec(),
    ));
    let header_bytes: usize = rec.headers.iter().map(|(k, v)| k.len() + v.len()).sum();
    let id = rec.header_text(header::ID);
    let mut value = Vec::with_capacity(128);
    value.extend_from_slice(b"{\"id\":");
    push_json_string(&mut value, &id);
    value.extend_from_slice(
        format!(
            ",\"keyBytes\":{},\"valueBytes\":{},\"headerBytes\":{header_bytes}}}",
            rec.key.len(),
            rec.value_len()
        )
        .as_bytes(),
    );
    let key = if short(&rec.key) {
        rec.key.clone()
    } else {
        Vec::new()
    };
    dead_letter(&rec.topic, key, value, headers)
}

/// A record for the dead-letter topic. Dead letters carry the time they
/// were written: the row's own time may be what Kafka refused, and the
/// dead-letter topic's limits are its own.
fn dead_letter(topic: &str, key: Vec<u8>, value: Vec<u8>, headers: Headers) -> KafkaRecord {
    KafkaRecord {
        topic: topic.to_owned(),
        key,
        value: Some(value),
        headers,
        timestamp_ms: chrono::Utc::now().timestamp_millis(),
        partition: None,
    }
}

/// `2026-11-30T01:02:03.000000Z`, as `to_rfc3339_opts(Micros, true)` writes
/// it, without chrono's format-string machinery (once per event).
fn push_rfc3339_micros(out: &mut Vec<u8>, t: &chrono::DateTime<chrono::Utc>) {
    use chrono::{Datelike, Timelike};
    // The events of one transaction mostly share their time: the text
    // written last is kept per thread.
    thread_local! {
        static LAST: std::cell::Cell<Option<(chrono::DateTime<chrono::Utc>, [u8; 27])>> =
            const { std::cell::Cell::new(None) };
    }
    if let Some((_, text)) = LAST.get().filter(|(at, _)| at == t) {
        out.extend_from_slice(&text);
        return;
    }
    let year = t.year();
    if !(0..=9999).contains(&year) {
        out.extend_from_slice(t.to_rfc3339_opts(SecondsFormat::Micros, true).as_bytes());
        return;
    }
    // By hand: the envelope of every event carries it, and `write!` costs
    // ten times as much.
    let mut buf = *b"0000-00-00T00:00:00.000000Z";
    put_digits(&mut buf[0..4], year.unsigned_abs());
    put_digits(&mut buf[5..7], t.month());
    put_digits(&mut buf[8..10], t.day());
    put_digits(&mut buf[11..13], t.hour());
    put_digits(&mut buf[14..16], t.minute());
    put_digits(&mut buf[17..19], t.second());
    // (PostgreSQL has no leap seconds: the nanoseconds stay below 10^9.)
    put_digits(&mut buf[20..26], t.nanosecond() / 1000 % 1_000_000);
    out.extend_from_slice(&buf);
    LAST.set(Some((*t, buf)));
}

/// Writes `n`'s last `dst.len()` decimal digits into `dst`, zero-padded.
fn put_digits(dst: &mut [u8], mut n: u32) {
    for d in dst.iter_mut().rev() {
        *d = b'0' + (n % 10) as u8;
        n /= 10;
    }
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

fn push_json_string(out: &mut Vec<u8>, s: &str) {
    // Ids, types and keys rarely hold what JSON escapes, and copying is
    // cheaper.
    if !needs_json_escape(s.as_bytes()) {
        out.reserve(s.len() + 2);
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
        return;
    }
    // Writing a &str to a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, s);
}

/// Whether `s` holds a byte serde_json escapes: a quote, a backslash, a
/// control character (below 0x20). Eight bytes at a time: a lane of
/// `x - 0x01…` borrows into its top bit only where the byte was below the
/// subtrahend, and `& !x` leaves out bytes that had the top bit set.
fn needs_json_escape(s: &[u8]) -> bool {
    const ONES: u64 = u64::from_le_bytes([1; 8]);
    const TOPS: u64 = ONES << 7;
    let below = |x: u64, n: u8| x.wrapping_sub(ONES * u64::from(n)) & !x & TOPS;
    let mut chunks = s.chunks_exact(8);
    for c in &mut chunks {
        let x = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
        let control = below(x, 0x20);
        let quote = below(x ^ (ONES * u64::from(b'"')), 1);
        let backslash = below(x ^ (ONES * u64::from(b'\\')), 1);
        if control | quote | backslash != 0 {
            return true;
        }
    }
    chunks
        .remainder()
        .iter()
        .any(|&b| b < 0x20 || b == b'"' || b == b'\\')
}

/// The seed relay's envelope, with the payload embedded without
/// re-encoding, then the `envelope` placements as members.
fn envelope(
    row: &OutboxRow,
    id: &str,
    occurred_at: &chrono::DateTime<chrono::Utc>,
    value: &RecordValue,
    out: &mut Vec<u8>,
) -> Result<(), RecordError> {
    out.reserve(row.payload.len() + 192);
    out.extend_from_slice(b"{\"eventId\":");
    push_json_string(out, id);
    out.extend_from_slice(b",\"type\":");
    push_json_string(out, &row.event_type);
    out.extend_from_slice(b",\"occurredAt\":\"");
    push_rfc3339_micros(out, occurred_at);
    out.extend_from_slice(b"\",\"aggregateType\":");
    push_json_string(out, &row.aggregate_type);
    out.extend_from_slice(b",\"aggregateId\":");
    push_json_string(out, &row.aggregate_id);
    out.push(b',');
    row.payload
        .push_member(out, "data", "dataBase64", value.text_payload)
        .map_err(RecordError::Payload)?;
    for p in value
        .placements
        .iter()
        .filter(|p| p.placement == Placement::Envelope)
    {
        let extra = row.extra.get(p.extra).unwrap_or(&Extra::Missing);
        if *extra == Extra::Missing {
            continue;
        }
        out.push(b',');
        push_json_string(out, &p.name);
        out.push(b':');
        extra.push_json(out);
    }
    out.push(b'}');
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::columns::ColumnMap;
    use crate::source::outbox::Payload;
    use chrono::TimeZone;

    /// A route and an event type, as a template reads a row.
    impl TopicValues for (&str, &str) {
        fn route(&self) -> &str {
            self.0
        }
        fn event_type(&self) -> &str {
            self.1
        }
        fn column(&self, _: usize) -> Option<&str> {
            None
        }
    }

    /// The row headers `user_headers` hands out, collected.
    fn headers_of(text: &str) -> Result<Headers, RecordError> {
        let mut h = Headers::new();
        user_headers(text, |k, v| h.push((k.to_owned().into(), v.to_vec())))?;
        Ok(h)
    }

    #[test]
    fn row_headers_come_in_key_order_and_the_last_of_a_repeated_key_wins() {
        // What a map of the members gives (what user_headers read before).
        let by_map = |text: &str| -> Vec<(String, String)> {
            let map: std::collections::BTreeMap<String, &serde_json::value::RawValue> =
                serde_json::from_str(text).unwrap();
            map.into_iter().map(|(k, v)| (k, v.get().to_owned())).collect()
        };
        let texts = [
            r#"{"b": "2", "a": "1", "b": "3"}"#,
            r#"{"\u0061": "x", "a": "y", "\u0062": "z"}"#,
            r#"{"a": "y", "\u0061": "x"}"#,
            r#"{"é": "1", "e": "2", "z": "3", "": "4", "E": "5", "a\"b": "6"}"#,
            r#"{"k": 1, "k": [1, 2], "k": {"n": null}, "j": true}"#,
            r#"{}"#,
            r#"{"x": "1"}"#,
        ];
        for text in texts {
            let mut want: Vec<(String, Vec<u8>)> = Vec::new();
            for (k, raw) in by_map(text) {
                let mut single = Headers::new();
                let member = format!("{{{}: {raw}}}", serde_json::to_string(&k).unwrap());
                user_headers(&member, |_, v| single.push((k.clone().into(), v.to_vec()))).unwrap();
                want.extend(single.into_iter().map(|(k, v)| (k.into_owned(), v)));
            }
            let got: Vec<(String, Vec<u8>)> = headers_of(text)
                .unwrap()
                .into_iter()
                .map(|(k, v)| (k.into_owned(), v))
                .collect();
            assert_eq!(got, want, "{text}");
        }
        assert!(matches!(
            headers_of(r#"{"a": 1,}"#),
            Err(RecordError::HeadersUnreadable(_))
        ));
        assert!(matches!(
            headers_of(r#"{"a" 1}"#),
            Err(RecordError::HeadersUnreadable(_))
        ));
        assert!(matches!(
            headers_of(r#"{1: 1}"#),
            Err(RecordError::HeadersUnreadable(_))
        ));
    }

    fn template(text: &str, lowercase: bool) -> Result<TopicTemplate, String> {
        TopicTemplate::parse(text, lowercase, &mut ColumnMap::default(), None)
    }

    fn row() -> OutboxRow {
        OutboxRow {
            id: "0190a5a4-8c1e-7000-8000-000000000001".into(),
            aggregate_type: "Order".into(),
            aggregate_id: "1001".into(),
            event_type: "ordering.order-placed.v1".into(),
            payload: r#"{"total": 12.5, "name": "김 \"q\""}"#.into(),
            headers: r#"{"correlationId": "c-1", "attempt": 2, "id": "spoof"}"#.into(),
            created_at: CreatedAt::At(chrono::Utc.with_ymd_and_hms(2026, 11, 30, 1, 2, 3).unwrap()),
            extra: Vec::new(),
            facts: None,
        }
    }

    /// A commit a second after the row's created_at.
    const COMMIT_MS: i64 = 1_796_000_524_000;

    fn default_topic() -> TopicTemplate {
        template("{aggregate_type}.events", true).unwrap()
    }

    /// `r`'s record in the envelope, to the default topic.
    fn envelope_of(r: &OutboxRow) -> KafkaRecord {
        build_record(
            r,
            &default_topic(),
            &RecordValue::of(ValueFormat::Envelope),
            COMMIT_MS,
        )
        .unwrap()
    }

    #[test]
    fn envelope_record() {
        let r = envelope_of(&row());
        assert_eq!(r.topic, "order.events");
        assert_eq!(r.key, b"1001");
        assert_eq!(r.timestamp_ms, 1_796_000_523_000);
        let v: serde_json::Value = serde_json::from_slice(r.value_bytes()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "eventId": "0190a5a4-8c1e-7000-8000-000000000001",
                "type": "ordering.order-placed.v1",
                "occurredAt": "2026-11-30T01:02:03.000000Z",
                "aggregateType": "Order",
                "aggregateId": "1001",
                "data": {"total": 12.5, "name": "김 \"q\""},
            })
        );
        let h: Vec<(&str, &[u8])> = r
            .headers
            .iter()
            .map(|(k, v)| (k.as_ref(), v.as_slice()))
            .collect();
        assert_eq!(
            h,
            vec![
                ("id", b"0190a5a4-8c1e-7000-8000-000000000001".as_slice()),
                ("type", b"ordering.order-placed.v1".as_slice()),
                ("aggregateType", b"Order".as_slice()),
                ("aggregateId", b"1001".as_slice()),
                ("attempt", b"2".as_slice()),
                ("correlationId", b"c-1".as_slice()),
            ]
        );
    }

    #[test]
    fn json_strings_match_serde_json() {
        for s in [
            "",
            "plain",
            "q\"uote",
            "back\\slash",
            "tab\there",
            "\u{7f}del",
            "김 é",
            "\u{1f}",
            "/",
        ] {
            let mut out = Vec::new();
            push_json_string(&mut out, s);
            assert_eq!(out, serde_json::to_vec(s).unwrap(), "{s:?}");
        }
    }

    #[test]
    fn occurred_at_matches_chrono() {
        for secs in [
            0i64,
            1_796_000_523,
            4_102_444_799,
            951_782_400,
            -62_135_596_800,
            253_402_300_799,
            -1,
        ] {
            for nanos in [0u32, 1_000, 123_456_000, 999_999_000] {
                let t = chrono::DateTime::from_timestamp(secs, nanos).unwrap();
                let mut out = Vec::new();
                push_rfc3339_micros(&mut out, &t);
                assert_eq!(
                    String::from_utf8(out).unwrap(),
                    t.to_rfc3339_opts(SecondsFormat::Micros, true)
                );
            }
        }
    }

    #[test]
    fn payload_record_is_byte_for_byte() {
        let r = build_record(
            &row(),
            &default_topic(),
            &RecordValue::of(ValueFormat::Payload),
            COMMIT_MS,
        )
        .unwrap();
        assert_eq!(r.value_bytes(), row().payload.as_bytes());
    }

    fn poison() -> Poison {
        Poison {
            reason: "illegal_topic",
            error: "bad".into(),
            lsn: crate::Lsn(0x10),
            intended_topic: None,
            omit_payload: false,
        }
    }

    #[test]
    fn dead_letters_carry_the_row_and_the_reason() {
        let poison = poison();
        let d = dead_letter_for_row(&row(), &poison, "outboxd.dead-letter");
        assert_eq!(d.topic, "outboxd.dead-letter");
        let v: serde_json::Value = serde_json::from_slice(d.value_bytes()).unwrap();
        assert_eq!(v["payload"]["total"], 12.5);
        assert_eq!(v["headers"]["correlationId"], "c-1");
        assert_eq!(v["aggregateType"], "Order");
        let h: std::collections::HashMap<_, _> = d.headers.iter().cloned().collect();
        assert_eq!(h["dlq.reason"], b"illegal_topic");
        assert_eq!(h["dlq.source.lsn"], b"0/10");
        assert_eq!(h["id"], b"0190a5a4-8c1e-7000-8000-000000000001");
        let big = Poison {
            omit_payload: true,
            ..poison
        };
        let v: serde_json::Value =
            serde_json::from_slice(dead_letter_for_row(&row(), &big, "d").value_bytes()).unwrap();
        assert!(v.get("payload").is_none() && v["payloadBytes"].as_u64().unwrap() > 0);
    }

    #[test]
    fn templates() {
        let t = template("app.{aggregate_type}.{type}", false).unwrap();
        assert_eq!(t.render(&("Order", "placed")).unwrap(), "app.Order.placed");
        assert!(template("{$1}", true)
            .unwrap_err()
            .contains("topic_regex is not set"));
        assert!(template("a b", true).is_err());
        assert!(template("{aggregate_type", true).is_err());
        assert!(template("", true).is_err());
        assert!(template("{}", true).is_err());
    }

    #[test]
    fn poison_rows_are_errors() {
        let mut r = row();
        r.aggregate_type = "Bad Type!".into();
        let e = build_record(
            &r,
            &default_topic(),
            &RecordValue::of(ValueFormat::Envelope),
            COMMIT_MS,
        )
        .unwrap_err();
        assert!(matches!(e, RecordError::IllegalTopic { .. }), "{e}");
        assert_eq!(e.reason(), "illegal_topic");
        let mut r = row();
        r.aggregate_id = String::new();
        assert_eq!(
            build_record(
                &r,
                &default_topic(),
                &RecordValue::of(ValueFormat::Envelope),
                COMMIT_MS
            ),
            Err(RecordError::EmptyKey)
        );
        let mut r = row();
        r.headers = "[1]".into();
        assert_eq!(
            build_record(
                &r,
                &default_topic(),
                &RecordValue::of(ValueFormat::Envelope),
                COMMIT_MS
            ),
            Err(RecordError::HeadersNotObject("an array".into()))
        );
        assert!(validate_topic(&"a".repeat(250)).is_err());
        assert!(validate_topic("..").is_err());
    }

    #[test]
    fn header_values_keep_what_jsonb_holds() {
        let text = format!(
            r#"{{"big": 1{}, "n": {{"a": [1, 2.5]}}, "s": "x\"y", "t": true}}"#,
            "0".repeat(400)
        );
        let h = headers_of(&text).unwrap();
        let text: Vec<(&str, String)> = h
            .iter()
            .map(|(k, v)| (k.as_ref(), String::from_utf8(v.clone()).unwrap()))
            .collect();
        assert_eq!(text[0].0, "big");
        assert!(
            text[0].1.starts_with("1000") && text[0].1.len() == 401,
            "as PostgreSQL wrote it"
        );
        assert_eq!(text[1], ("n", r#"{"a":[1,2.5]}"#.to_owned()));
        assert_eq!(text[2], ("s", "x\"y".to_owned()));
        assert_eq!(text[3], ("t", "true".to_owned()));
        // Strings with and without escapes, and beyond ASCII.
        let h = headers_of(r#"{"a": "plain", "b": "\u00e9\n", "c": "김", "d": "", "e": "\\"}"#).unwrap();
        let values: Vec<&[u8]> = h.iter().map(|(_, v)| v.as_slice()).collect();
        assert_eq!(
            values,
            [&b"plain"[..], "é\n".as_bytes(), "김".as_bytes(), b"", b"\\"]
        );
        let deep = format!("{}1{}", r#"{"a": "#.repeat(200), "}".repeat(200));
        // Nested deeper than serde_json reads into a value: passed on as
        // written (the raw read keeps no stack).
        let h = headers_of(&deep).unwrap();
        assert_eq!(h[0].0, "a");
        assert_eq!(h[0].1, &deep.as_bytes()[6..deep.len() - 1]);
        assert_eq!(
            headers_of("null").unwrap_err(),
            RecordError::HeadersNotObject("null".into())
        );
    }

    #[test]
    fn a_dead_letter_stub_is_small_and_names_the_row() {
        let mut r = row();
        r.aggregate_id = "k".repeat(5000);
        r.payload = crate::source::outbox::Payload::Json(format!("\"{}\"", "x".repeat(2_000_000)));
        let poison = Poison {
            reason: "illegal_topic",
            error: "topic name is illegal".into(),
            lsn: crate::Lsn(42),
            intended_topic: None,
            omit_payload: false,
        };
        let full = dead_letter_for_row(&r, &poison, "dlq");
        let stub = dead_letter_stub(&full, "Message size too large");
        let size = stub.key.len()
            + stub.value_len()
            + stub.headers.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>();
        assert!(size < 4096, "{size} bytes");
        assert!(stub.key.is_empty(), "a key too long to keep");
        let header = |name: &str| {
            stub.headers
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
        };
        assert_eq!(header("id"), Some(r.id.to_string()));
        assert_eq!(header("dlq.reason").as_deref(), Some("illegal_topic"));
        assert!(header("dlq.error")
            .unwrap()
            .contains("the dead letter itself was refused"));
        let value: serde_json::Value = serde_json::from_slice(stub.value_bytes()).unwrap();
        assert_eq!(value["keyBytes"], 5000);
        assert!(value["valueBytes"].as_u64().unwrap() > 2_000_000);
    }

    #[test]
    fn kafka_timestamp_is_created_at_only_where_kafka_takes_it() {
        let at = |y, mo, d| CreatedAt::At(chrono::Utc.with_ymd_and_hms(y, mo, d, 0, 0, 0).unwrap());
        let commit = COMMIT_MS;
        assert_eq!(kafka_timestamp(&row().created_at, commit), 1_796_000_523_000);
        // Before the epoch, far ahead of the commit, beyond year 9999, infinity.
        assert_eq!(kafka_timestamp(&at(1960, 1, 1), commit), commit);
        assert_eq!(kafka_timestamp(&at(2026, 12, 2), commit), commit);
        assert_eq!(kafka_timestamp(&at(20000, 1, 1), commit), commit);
        assert_eq!(kafka_timestamp(&CreatedAt::parse("infinity"), commit), commit);
        assert_eq!(
            kafka_timestamp(&CreatedAt::parse("0044-03-15 00:00:00+00 BC"), commit),
            commit
        );
        // A little ahead of the commit (clock skew between writers) is kept.
        let ahead = commit + MAX_AHEAD_OF_COMMIT_MS;
        let t = CreatedAt::At(chrono::DateTime::from_timestamp_millis(ahead).unwrap());
        assert_eq!(kafka_timestamp(&t, commit), ahead);
        assert_eq!(
            kafka_timestamp(&at(1970, 1, 1), commit),
            commit,
            "0 is \"now\" to librdkafka"
        );
        let first = CreatedAt::At(chrono::DateTime::from_timestamp_millis(1).unwrap());
        assert_eq!(kafka_timestamp(&first, commit), commit, "far behind the commit");
        assert_eq!(
            kafka_timestamp(&first, 1000),
            1,
            "within a day of an early commit"
        );
        // A day behind is kept; further back (a business date, seconds for
        // milliseconds) Kafka's retention would delete it: the commit time.
        let behind = commit - MAX_BEHIND_COMMIT_MS;
        let t = CreatedAt::At(chrono::DateTime::from_timestamp_millis(behind).unwrap());
        assert_eq!(kafka_timestamp(&t, commit), behind);
        let t = CreatedAt::At(chrono::DateTime::from_timestamp_millis(behind - 1).unwrap());
        assert_eq!(kafka_timestamp(&t, commit), commit);
        let seconds = CreatedAt::read(&(commit / 1000).to_string(), crate::source::outbox::Kind::Int(64));
        assert_eq!(
            kafka_timestamp(&seconds, commit),
            commit,
            "epoch seconds in a milliseconds column"
        );
    }

    #[test]
    fn the_time_written_last_is_reused_only_for_the_same_time() {
        let at = |s: &str| chrono::DateTime::parse_from_rfc3339(s).unwrap().to_utc();
        let times = [
            at("2026-01-02T03:04:05.123456Z"),
            at("2026-01-02T03:04:05.123456Z"),
            at("2026-01-02T03:04:05.123457Z"),
            at("2026-01-02T03:04:05.123456Z"),
            at("1999-12-31T23:59:59Z"),
            chrono::DateTime::from_timestamp(253_402_300_800, 0).unwrap(), // year 10000
            chrono::DateTime::from_timestamp(253_402_300_800, 0).unwrap(),
            at("2026-01-02T03:04:05.123456Z"),
            at("2026-01-02T03:04:05.123456789Z"),
        ];
        for t in times {
            let mut out = b"x".to_vec();
            push_rfc3339_micros(&mut out, &t);
            assert_eq!(
                out,
                format!("x{}", t.to_rfc3339_opts(SecondsFormat::Micros, true)).into_bytes(),
                "{t:?}"
            );
        }
    }

    #[test]
    fn the_envelope_refuses_what_rfc3339_cannot_write_and_payload_mode_publishes_it() {
        for text in [
            "infinity",
            "-infinity",
            "0044-03-15 00:00:00+00 BC",
            "20000-01-01 00:00:00+00",
        ] {
            let mut r = row();
            r.created_at = CreatedAt::parse(text);
            let e = build_record(
                &r,
                &default_topic(),
                &RecordValue::of(ValueFormat::Envelope),
                COMMIT_MS,
            )
            .unwrap_err();
            assert_eq!(e.reason(), "bad_timestamp", "{text}");
            assert!(e.to_string().contains(text), "{e}");
            let rec = build_record(
                &r,
                &default_topic(),
                &RecordValue::of(ValueFormat::Payload),
                COMMIT_MS,
            )
            .unwrap();
            assert_eq!(rec.timestamp_ms, COMMIT_MS, "{text}");
            let dl = dead_letter_for_row(&r, &poison(), "dlq");
            let v: serde_json::Value = serde_json::from_slice(dl.value_bytes()).unwrap();
            assert_eq!(v["createdAt"], text, "the dead letter keeps PostgreSQL's text");
        }
    }

    #[test]
    fn every_reason_is_a_known_metric_label() {
        use crate::metrics::DEAD_LETTER_REASONS;
        let errors = [
            RecordError::IllegalTopic {
                topic: "x".into(),
                reason: "r",
            },
            RecordError::EmptyKey,
            RecordError::HeadersNotObject("array".into()),
            RecordError::Timestamp("infinity".into()),
            RecordError::SchemaMismatch("$.x: missing".into()),
        ];
        for e in errors {
            assert!(DEAD_LETTER_REASONS.contains(&e.reason()), "{}", e.reason());
        }
        // (Kafka's refusals of a record: kafka::sink's tests.)
        assert!(DEAD_LETTER_REASONS.contains(&"unreadable"));
    }

    #[test]
    fn only_allowed_aggregate_types_become_topics() {
        let t = default_topic().allowing(vec!["Order".into(), "Pay*".into()]);
        assert_eq!(t.render(&("Order", "x")).unwrap(), "order.events");
        assert_eq!(t.render(&("Payment", "x")).unwrap(), "payment.events");
        for bad in ["order", "Orders", "Spam", "", "Pa"] {
            let e = t.render(&(bad, "x")).unwrap_err();
            assert_eq!(e.reason(), "aggregate_type_not_allowed", "{bad:?}");
            assert!(crate::metrics::DEAD_LETTER_REASONS.contains(&e.reason()));
        }
        assert!(
            default_topic().render(&("Anything", "x")).is_ok(),
            "no list: any type"
        );
    }

    fn routed(text: &str, regex: Option<&str>, map: &mut ColumnMap) -> TopicTemplate {
        let regex = regex.map(|r| crate::config::routing::TopicRegex::parse(r).unwrap());
        TopicTemplate::parse(text, false, map, regex).unwrap()
    }

    #[test]
    fn topics_from_any_column_and_from_a_regex() {
        let mut map = ColumnMap::default();
        let t = routed("{tenant}.{aggregate_type}", None, &mut map);
        let mut r = row();
        r.extra = vec![Extra::Text("acme".into())];
        assert_eq!(t.render(&r).unwrap(), "acme.Order");
        r.extra = vec![Extra::Null];
        assert_eq!(
            t.render(&r).unwrap_err().reason(),
            "illegal_topic",
            "a NULL column routes nowhere"
        );
        // Kafka Connect's RegexRouter: a whole match is replaced, anything
        // else is the topic as it is.
        let t = routed(
            "outbox.{$kind}.{$2}",
            Some("(?<kind>[a-z]+)-(.*)"),
            &mut ColumnMap::default(),
        );
        assert_eq!(t.render(&("order-placed", "")).unwrap(), "outbox.order.placed");
        assert_eq!(t.render(&("Order", "")).unwrap(), "Order");
        assert_eq!(
            t.render(&("x-order-placed", "")).unwrap(),
            "outbox.x.order-placed",
            "the first group is as short as the regex makes it"
        );
        assert!(
            routed("{$1}", Some("a(b)?"), &mut ColumnMap::default())
                .render(&("a", ""))
                .is_err(),
            "an empty name is no topic"
        );
    }

    fn placed(
        placement: crate::config::columns::Placement,
        name: &str,
        extra: usize,
    ) -> crate::config::columns::PlacedColumn {
        crate::config::columns::PlacedColumn {
            extra,
            placement,
            name: name.into(),
        }
    }

    #[test]
    fn placements_headers_partition_and_envelope() {
        use crate::config::columns::Placement;
        let value = placing(&[
            (Placement::Header, "eventType", 0),
            (Placement::Partition, "", 1),
            (Placement::Envelope, "tenant", 2),
            (Placement::Header, "gone", 3),
            (Placement::Envelope, "flag", 4),
        ]);
        let mut r = row();
        r.extra = vec![
            Extra::Text("OrderPlaced".into()),
            Extra::Number("2".into()),
            Extra::Null,
            Extra::Missing,
            Extra::Bool(true),
        ];
        let rec = build_record(&r, &default_topic(), &value, COMMIT_MS).unwrap();
        assert_eq!(rec.partition, Some(2));
        assert_eq!(rec.header_text("eventType"), "OrderPlaced");
        assert!(
            rec.headers.iter().all(|(k, _)| k != "gone"),
            "a missing column sets no header"
        );
        let v: serde_json::Value = serde_json::from_slice(rec.value_bytes()).unwrap();
        assert_eq!(v["tenant"], serde_json::Value::Null);
        assert_eq!(v["flag"], true);
        r.extra[1] = Extra::Number("-1".into());
        assert_eq!(
            build_record(&r, &default_topic(), &value, COMMIT_MS)
                .unwrap_err()
                .reason(),
            "bad_partition"
        );
        r.extra[1] = Extra::Null;
        assert_eq!(
            build_record(&r, &default_topic(), &value, COMMIT_MS)
                .unwrap()
                .partition,
            None,
            "NULL: the partitioner's"
        );
    }

    /// `n` members `"h000": "0"`, … of a headers object, without braces.
    fn numbered_headers(n: usize) -> String {
        (0..n)
            .map(|i| format!("\"h{i:03}\": \"{i}\""))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// An envelope with `placements` (placement, name, extra column).
    fn placing(placements: &[(crate::config::columns::Placement, &str, usize)]) -> RecordValue {
        let mut value = RecordValue::of(ValueFormat::Envelope);
        value.placements = placements
            .iter()
            .map(|&(p, name, extra)| placed(p, name, extra))
            .collect();
        value
    }

    /// Building each record into the one before gives what building it
    /// fresh gives, whatever came before: more or fewer headers, other
    /// names, a tombstone, another format, a row that failed half-way.
    #[test]
    fn a_record_built_into_the_one_before_is_the_record_built_fresh() {
        use crate::config::columns::Placement;
        let placed_value = placing(&[(Placement::Header, "eventType", 0), (Placement::Partition, "", 1)]);
        let mut tombstones = RecordValue::of(ValueFormat::Payload);
        tombstones.tombstones = true;
        let mut rows = Vec::new();
        let mut r = row();
        r.extra = vec![Extra::Text("OrderPlaced".into()), Extra::Number("2".into())];
        rows.push((r.clone(), placed_value.clone()));
        r.extra[1] = Extra::Number("-1".into());
        rows.push((r.clone(), placed_value.clone()));
        rows.push((row(), RecordValue::of(ValueFormat::Envelope)));
        let mut few = row();
        few.headers = "{}".into();
        few.aggregate_id = "a-much-longer-aggregate-id-than-the-one-before".into();
        rows.push((few.clone(), RecordValue::of(ValueFormat::Payload)));
        let mut other = row();
        other.headers = r#"{"b": "2", "a": "1", "z": {"n": 1}}"#.into();
        rows.push((other, RecordValue::of(ValueFormat::Envelope)));
        let mut blank = row();
        blank.payload = Payload::Text("  ".into());
        rows.push((blank, tombstones));
        let mut null = row();
        null.payload = Payload::Null;
        rows.push((null, RecordValue::of(ValueFormat::Payload)));
        let mut large = row();
        large.payload = Payload::Json(format!("{{\"n\": \"{}\"}}", "x".repeat(100_000)));
        large.headers = format!(r#"{{"big": "{}"}}"#, "y".repeat(100_000));
        rows.push((large, RecordValue::of(ValueFormat::Envelope)));
        for format in [
            ValueFormat::CloudEvents,
            ValueFormat::CloudEventsBinary,
            ValueFormat::ConnectJson,
        ] {
            rows.push((row(), RecordValue::of(format)));
        }
        let mut bare = RecordValue::of(ValueFormat::Envelope);
        bare.standard_headers = false;
        rows.push((row(), bare));
        let mut keyed = RecordValue::of(ValueFormat::Payload);
        keyed.connect_key = true;
        rows.push((row(), keyed));
        let mut untyped = row();
        untyped.facts = Some(std::sync::Arc::new(crate::source::outbox::ColumnFacts {
            has_type: false,
            ..Default::default()
        }));
        rows.push((untyped, RecordValue::of(ValueFormat::Envelope)));
        // A placement named as a row header of the record before.
        let renamed = placing(&[(Placement::Header, "correlationId", 0)]);
        let mut r = row();
        r.headers = "{}".into();
        r.extra = vec![Extra::Text("from-a-column".into())];
        rows.push((r, renamed));
        let mut many = row();
        many.headers = format!("{{{}}}", numbered_headers(200));
        rows.push((many, RecordValue::of(ValueFormat::Envelope)));
        let mut bad = row();
        bad.headers = "[1]".into();
        rows.push((bad, RecordValue::of(ValueFormat::Envelope)));
        let mut bad_topic = row();
        bad_topic.aggregate_type = "Bad Type!".into();
        rows.push((bad_topic, RecordValue::of(ValueFormat::Envelope)));
        let topic = default_topic();
        let order: Vec<usize> = (0..rows.len())
            .chain((0..rows.len()).rev())
            .chain([3, 0, 7, 2])
            .collect();
        let mut into = KafkaRecord::default();
        for i in order {
            let (r, value) = &rows[i];
            let fresh = build_record(r, &topic, value, COMMIT_MS);
            let reused = build_record_into(r, &topic, value, COMMIT_MS, &mut into);
            match (fresh, reused) {
                (Ok(fresh), Ok(())) => assert_eq!(into, fresh, "row {i}"),
                (Err(a), Err(b)) => {
                    assert_eq!(a, b, "row {i}");
                    assert_eq!(
                        into,
                        KafkaRecord::default(),
                        "row {i}: a failed build leaves nothing"
                    );
                }
                (a, b) => panic!("row {i}: fresh {a:?}, into the one before {b:?}"),
            }
            if i != 7 {
                let kept = into.value.iter().chain(into.headers.iter().map(|(_, v)| v));
                assert!(
                    kept.map(Vec::capacity).all(|c| c <= REUSED_CAPACITY_MAX),
                    "row {i}: a large row's buffers are not kept"
                );
            }
        }
    }

    /// A row that fails half-way (its partition placement) after one
    /// that had a key, a partition and more headers leaves none of them.
    #[test]
    fn a_failed_build_keeps_nothing_of_the_record_before() {
        use crate::config::columns::Placement;
        let value = placing(&[(Placement::Partition, "", 0)]);
        let mut a = row();
        a.extra = vec![Extra::Number("3".into())];
        let mut into = KafkaRecord::default();
        build_record_into(&a, &default_topic(), &value, COMMIT_MS, &mut into).unwrap();
        assert_eq!(into.partition, Some(3));
        let mut b = row();
        b.aggregate_id = "other".into();
        b.headers = r#"{"a": "1"}"#.into();
        b.extra = vec![Extra::Number("-1".into())];
        let e = build_record_into(&b, &default_topic(), &value, COMMIT_MS, &mut into).unwrap_err();
        assert_eq!(e.reason(), "bad_partition");
        assert_eq!(into, KafkaRecord::default());
    }

    /// What a record keeps between rows is bounded, whatever the last row
    /// held.
    #[test]
    fn a_recycled_record_keeps_no_large_buffer() {
        let mut r = row();
        r.payload = Payload::Json(format!("{{\"n\": \"{}\"}}", "x".repeat(200_000)));
        r.headers = format!(
            "{{\"big\": \"{}\", {}}}",
            "y".repeat(200_000),
            numbered_headers(200)
        );
        r.aggregate_id = "k".repeat(200_000);
        let rec = envelope_of(&r).recycled();
        assert!(rec
            .value
            .as_ref()
            .is_none_or(|v| v.capacity() <= REUSED_CAPACITY_MAX));
        assert!(rec.key.capacity() <= REUSED_CAPACITY_MAX);
        assert!(rec.headers.capacity() <= REUSED_HEADERS_MAX);
        assert!(rec
            .headers
            .iter()
            .all(|(_, v)| v.capacity() <= REUSED_CAPACITY_MAX));
        let small = envelope_of(&row());
        let kept = small.clone().recycled();
        assert_eq!(kept.headers.len(), small.headers.len(), "small buffers are kept");
        assert!(kept.value.is_some_and(|v| v.capacity() > 0 && v.is_empty()));
    }

    /// Every byte, at every place of an eight-byte lane and of the tail,
    /// among bytes that need no escape and bytes with the top bit set.
    #[test]
    fn the_escape_check_finds_every_byte_json_escapes() {
        let naive = |s: &[u8]| s.iter().any(|&b| b < 0x20 || b == b'"' || b == b'\\');
        for fill in [b'a', 0x80, 0xff, 0x21, 0x5d, 0x1f + 1] {
            for len in 0..20 {
                for at in 0..len {
                    for b in 0..=255u8 {
                        let mut s = vec![fill; len];
                        s[at] = b;
                        assert_eq!(needs_json_escape(&s), naive(&s), "{s:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn null_and_blank_payloads_and_tombstones() {
        let mut r = row();
        r.payload = Payload::Null;
        for format in [ValueFormat::Payload, ValueFormat::CloudEventsBinary] {
            let rec = build_record(&r, &default_topic(), &RecordValue::of(format), COMMIT_MS).unwrap();
            assert_eq!(rec.value, None, "{format:?}: a NULL payload is a null value");
        }
        let env = build_record(
            &r,
            &default_topic(),
            &RecordValue::of(ValueFormat::Envelope),
            COMMIT_MS,
        )
        .unwrap();
        let v: serde_json::Value = serde_json::from_slice(env.value_bytes()).unwrap();
        assert_eq!(v["data"], serde_json::Value::Null);
        // With tombstones, NULL and blank text are tombstones in every
        // format: the key and headers, a null value.
        r.payload = Payload::Text("  ".into());
        for format in [
            ValueFormat::Envelope,
            ValueFormat::CloudEvents,
            ValueFormat::ConnectJson,
            ValueFormat::Payload,
        ] {
            let mut value = RecordValue::of(format);
            value.tombstones = true;
            let rec = build_record(&r, &default_topic(), &value, COMMIT_MS).unwrap();
            assert_eq!(rec.value, None, "{format:?}");
            assert_eq!(rec.key, b"1001");
            assert_eq!(rec.header_text("id"), r.id);
        }
        r.payload = Payload::Json("{}".into());
        let mut value = RecordValue::of(ValueFormat::Payload);
        value.tombstones = true;
        assert_eq!(
            build_record(&r, &default_topic(), &value, COMMIT_MS)
                .unwrap()
                .value
                .as_deref(),
            Some(b"{}".as_slice())
        );
    }

    #[test]
    fn a_text_payload_never_makes_invalid_json() {
        let mut r = row();
        r.payload = Payload::Text("not json {".into());
        let raw = build_record(
            &r,
            &default_topic(),
            &RecordValue::of(ValueFormat::Payload),
            COMMIT_MS,
        )
        .unwrap();
        assert_eq!(raw.value_bytes(), b"not json {", "the bytes as they are");
        for format in [ValueFormat::Envelope, ValueFormat::CloudEvents] {
            let rec = build_record(&r, &default_topic(), &RecordValue::of(format), COMMIT_MS).unwrap();
            let v: serde_json::Value = serde_json::from_slice(rec.value_bytes()).unwrap();
            assert_eq!(v["data"], "not json {", "{format:?}");
            let mut strict = RecordValue::of(format);
            strict.text_payload = TextPayload::Json;
            assert_eq!(
                build_record(&r, &default_topic(), &strict, COMMIT_MS)
                    .unwrap_err()
                    .reason(),
                "bad_payload"
            );
        }
        r.payload = Payload::Text(r#"{"a": [1]}"#.into());
        let rec = build_record(
            &r,
            &default_topic(),
            &RecordValue::of(ValueFormat::Envelope),
            COMMIT_MS,
        )
        .unwrap();
        assert!(String::from_utf8_lossy(rec.value_bytes()).ends_with(r#""data":{"a": [1]}}"#));
        // A headers text that is no JSON: a dead letter still is JSON.
        r.headers = "{not".into();
        assert_eq!(
            build_record(
                &r,
                &default_topic(),
                &RecordValue::of(ValueFormat::Envelope),
                COMMIT_MS
            )
            .unwrap_err()
            .reason(),
            "bad_headers"
        );
        let dl = dead_letter_for_row(&r, &poison(), "dlq");
        let v: serde_json::Value = serde_json::from_slice(dl.value_bytes()).unwrap();
        assert_eq!(v["headers"], "{not");
    }

    #[test]
    fn without_standard_headers_only_the_id() {
        let mut value = RecordValue::of(ValueFormat::Payload);
        value.standard_headers = false;
        let mut r = row();
        r.headers = "{}".into();
        let rec = build_record(&r, &default_topic(), &value, COMMIT_MS).unwrap();
        let names: Vec<&str> = rec.headers.iter().map(|(k, _)| k.as_ref()).collect();
        assert_eq!(names, ["id"]);
        // An empty type of a type column is a header all the same; a table
        // without a type column has none, even with standard headers.
        r.event_type.clear();
        let standard = RecordValue::of(ValueFormat::Payload);
        let rec = build_record(&r, &default_topic(), &standard, COMMIT_MS).unwrap();
        assert!(rec.headers.iter().any(|(k, v)| k == "type" && v.is_empty()));
        r.facts = Some(std::sync::Arc::new(crate::source::outbox::ColumnFacts {
            has_type: false,
            ..Default::default()
        }));
        let rec = build_record(&r, &default_topic(), &standard, COMMIT_MS).unwrap();
        assert!(rec.headers.iter().all(|(k, _)| k != "type"));
    }
}

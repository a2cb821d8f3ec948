//! Schema Registry values: `routing.value` = `avro`, `protobuf` or
//! `json-schema`, in the Confluent wire format.
//!
//! # Flow
//!
//! A row becomes a record as in every format ([`crate::kafka::records`]),
//! with the payload JSON as its value. Before it is sent, the relay asks
//! the [`Registry`] for the schema of the record's topic and event type:
//!
//! 1. [`Registry::ready`]: is a schema for this (event type, topic) in
//!    the cache? On the hot path it is, and nothing else happens.
//! 2. Otherwise [`Registry::resolve`] asks the registry (the subject the
//!    strategy names, at the latest or a pinned version, or a pinned id),
//!    compiles the schema and caches it. While the registry is
//!    unreachable it waits and retries: a transient outage is never a
//!    dead letter, and the relay keeps the replication connection alive
//!    meanwhile. Refused credentials, a missing subject and a schema
//!    outboxd cannot use stop the relay with the setting to fix.
//! 3. [`Registry::encode`] writes the value: magic byte 0, the schema id
//!    (4 bytes, big-endian), Protobuf's message indexes, then the body. A
//!    payload that does not fit is a [`SchemaError::Mismatch`] naming the
//!    first offending field: it follows `routing.on_poison` with the
//!    reason `schema_mismatch`.
//!
//! A `bytea` payload arrives already encoded (as Debezium's
//! `BinaryDataConverter` passes through): it must be in the wire format,
//! and its schema id is looked up ([`Registry::resolve`] again, by id):
//! the id must exist, be a schema of the configured format, be registered
//! under the subject the strategy names (at the pinned version, or be the
//! pinned id), and the body must decode against it. Then the bytes are
//! published unchanged; anything else is a `schema_mismatch`.
//!
//! Keys are encoded too under `routing.key_format` ([`keys`]): the same
//! ready, resolve and encode steps look up the topic's key schema.
//!
//! LSN progress is untouched: encoding happens before the record is sent,
//! so an event the registry holds up is simply not in flight yet, and the
//! slot cannot move past it.
//!
//! A `latest` schema is looked up again after
//! `schema_registry.refresh_interval`; a failed look-up keeps the schema in
//! use. Schemas by id never change and are cached for good.

pub mod avro;
pub mod client;
pub mod infer;
pub mod json_schema;
pub mod keys;
pub mod numbers;
pub mod protobuf;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::config::routing::TextPayload;
use crate::config::{KeyFormat, SchemaRouting, SchemaRule, SchemaSource, SubjectStrategy, ValueFormat};
use crate::kafka::records::{KafkaRecord, RecordError};
use crate::metrics::Metrics;
use crate::source::outbox::{JsonPayload, OutboxRow, Payload};
pub use avro::Misfit;
use client::{Client, ClientError, Served};

/// The Confluent wire format's first byte.
pub const MAGIC: u8 = 0;

/// How far the registry's answer must follow a row's commit for a
/// mismatch not to send outboxd looking for a newer version.
pub const CLOCK_SKEW_MS: i64 = 5_000;

/// CloudEvents' `dataschema` in binary mode.
pub const DATASCHEMA_HEADER: &str = "ce_dataschema";

/// A schema compiled for encoding.
#[derive(Debug)]
pub enum Codec {
    Avro(avro::AvroCodec),
    Protobuf(protobuf::ProtobufCodec),
    JsonSchema(json_schema::JsonSchemaCodec),
}

/// What goes wrong with schemas.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SchemaError {
    /// The payload does not fit its schema: the row's own problem.
    #[error("the payload does not fit {}: {misfit}", match id {
        Some(id) => format!("schema id {id} of {subject}"),
        None => format!("a schema of {subject}"),
    })]
    Mismatch {
        subject: String,
        /// The registered schema it was checked against (`None`: no
        /// schema was registered for it, as when no schema can be
        /// inferred from it).
        id: Option<u32>,
        misfit: Misfit,
    },
    /// The registry answered, and the answer stops the relay.
    #[error("{0}")]
    Registry(ClientError),
    /// Shutdown came while waiting for an unreachable registry: the event
    /// was not sent, and nothing past it is confirmed.
    #[error("shutdown requested while waiting for the Schema Registry")]
    Interrupted,
    /// The registry refused the string schema of a key subject.
    #[error("the Schema Registry refused the string key schema under subject {subject:?} ({source}): register \"string\" (Avro) or {{\"type\": \"string\"}} (JSON Schema) under it, or set routing.key_format = \"string\"")]
    KeySchema { subject: String, source: ClientError },
    /// A text payload that is no JSON under `routing.text_payload =
    /// "json"`: the row's own problem.
    #[error("{0}")]
    Payload(String),
    /// The registry served a schema outboxd cannot encode with.
    #[error("schema {what} cannot be used for routing.value = {format:?}: {reason}; register a schema of that kind, or pin another in [routing.schemas]")]
    Unusable {
        what: String,
        format: &'static str,
        reason: String,
    },
}

impl SchemaError {
    /// The row is the cause: `routing.on_poison` applies.
    pub fn is_row_problem(&self) -> bool {
        matches!(self, SchemaError::Mismatch { .. } | SchemaError::Payload(_))
    }

    /// A new session may succeed (only a wait that shutdown cut short).
    pub fn is_transient(&self) -> bool {
        matches!(self, SchemaError::Interrupted)
    }
}

/// Where one event type's schema comes from, once resolved.
#[derive(Debug)]
struct InUse {
    /// The subject, or `None` for a pinned id.
    subject: Option<String>,
    id: u32,
    codec: Arc<Codec>,
    fetched: Instant,
    /// Looked up as `latest`: refreshed after the refresh interval.
    latest: bool,
    /// When the registry last answered for it, in Unix milliseconds.
    fetched_ms: i64,
    /// A mismatch asked for a newer version: the next look-up waits out
    /// an unreachable registry instead of keeping this one.
    must_refresh: bool,
}

/// A schema in use, as `outboxd status` and the HTTP status show it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SchemaInUse {
    pub event_type: String,
    pub topic: String,
    pub subject: Option<String>,
    pub version: Option<u32>,
    pub id: u32,
}

/// An inferred schema, once the registry has answered.
#[derive(Debug)]
enum Inferred {
    Registered {
        id: u32,
        codec: Arc<Codec>,
    },
    /// The registry refused it (409: incompatible with the subject's
    /// history; 422: invalid): payloads of this shape are mismatches until
    /// the refusal is older than the refresh interval, then it is asked
    /// again.
    Refused(String, Instant),
}

/// A row's payload as the registry sees it.
enum Body<'a> {
    /// JSON to encode.
    Json(std::borrow::Cow<'a, str>),
    /// Bytes already encoded by the application, to check.
    Encoded(&'a [u8]),
    /// NULL: a null value, nothing to encode.
    Null,
    /// Text that is no JSON under `routing.text_payload = "json"`: why.
    NotJson(String),
}

/// A schema id read from an encoded (`bytea`) payload, once the registry
/// has answered.
#[derive(Debug)]
enum ById {
    Known {
        /// `None` for a schema that references others: outboxd does not
        /// follow references, so the body is passed on unchecked.
        codec: Option<Arc<Codec>>,
        /// The (subject, version) pairs that hold the id.
        subjects: Vec<(String, u32)>,
        fetched: Instant,
        fetched_ms: i64,
    },
    /// No schema of this id, or one of another format: payloads encoded
    /// with it are mismatches until the answer is older than the refresh
    /// interval.
    Refused { reason: String, at: Instant, at_ms: i64 },
}

impl ById {
    fn fetched(&self) -> (Instant, i64) {
        match self {
            ById::Known {
                fetched, fetched_ms, ..
            } => (*fetched, *fetched_ms),
            ById::Refused { at, at_ms, .. } => (*at, *at_ms),
        }
    }
}

/// The schema id and body of a value in the wire format.
fn framed(bytes: &[u8]) -> Option<(u32, &[u8])> {
    match bytes {
        [MAGIC, a, b, c, d, body @ ..] => Some((u32::from_be_bytes([*a, *b, *c, *d]), body)),
        _ => None,
    }
}

impl Codec {
    /// Checks a body that arrived encoded; for Protobuf, returns the full
    /// name of the message its indexes name.
    fn check_encoded(&self, body: &[u8]) -> Result<Option<String>, Misfit> {
        match self {
            Codec::Avro(c) => c.check_datum(body).map(|()| None),
            Codec::Protobuf(c) => c.check_message(body).map(Some),
            Codec::JsonSchema(c) => c.check_body(body).map(|()| None),
        }
    }
}

/// The schemas the relay encodes with, shared with the HTTP status.
pub type InUseBoard = Arc<Mutex<BTreeMap<(String, String), SchemaInUse>>>;

/// The registry client with its cache.
#[derive(Debug)]
pub struct Registry {
    client: Client,
    format: ValueFormat,
    /// `routing.text_payload`: what a text payload is as JSON.
    text_payload: TextPayload,
    /// The values are CloudEvents in binary mode: the encoding is their
    /// `data`, with `content-type` and `ce_dataschema` set to match.
    cloudevents: bool,
    routing: SchemaRouting,
    refresh: Duration,
    /// event type → topic → schema.
    resolved: HashMap<String, HashMap<String, InUse>>,
    /// Compiled schemas by (id, message name).
    compiled: HashMap<(u32, Option<String>), Arc<Codec>>,
    /// Inferred schemas: subject → derived schema text → its id.
    inferred: HashMap<String, HashMap<String, Inferred>>,
    /// Schema ids of encoded payloads.
    by_id: HashMap<u32, ById>,
    /// `routing.key_format`, and the key schema id of each topic.
    key_format: KeyFormat,
    keys: HashMap<String, u32>,
    counters: Option<Counters>,
    board: InUseBoard,
    /// Ends the waits for an unreachable registry (the relay's shutdown).
    stop: Option<tokio::sync::watch::Receiver<bool>>,
}

/// The registry's metrics, resolved once: a cache hit is one atomic add.
#[derive(Debug)]
struct Counters {
    requests: prometheus::IntCounterVec,
    hit: prometheus::IntCounter,
    miss: prometheus::IntCounter,
    mismatches: prometheus::IntCounter,
}

fn format_name(f: ValueFormat) -> &'static str {
    match f {
        ValueFormat::Avro => "avro",
        ValueFormat::Protobuf => "protobuf",
        ValueFormat::JsonSchema => "json-schema",
        _ => "json",
    }
}

fn outcome_of(e: &ClientError) -> &'static str {
    match e {
        ClientError::Unavailable { .. } => "unavailable",
        ClientError::Unauthorized { .. } => "unauthorized",
        ClientError::NotFound { .. } => "not_found",
        ClientError::Refused { .. } => "refused",
        ClientError::Unreadable { .. } | ClientError::Impossible { .. } => "unreadable",
    }
}

impl Registry {
    /// The registry of `config`'s format, or `None` when the format uses
    /// none.
    pub fn from_config(
        config: &crate::config::Config,
        metrics: Option<Metrics>,
    ) -> Result<Option<Registry>, String> {
        let format = config.registry_format();
        let key_format = config.routing.key_format;
        if !format.uses_registry() && !key_format.uses_registry() {
            return Ok(None);
        }
        let cfg = config
            .schema_registry
            .as_ref()
            .ok_or("routing.value and routing.key_format need [schema_registry]")?;
        Ok(Some(Registry {
            client: Client::new(cfg)?,
            format,
            text_payload: config.routing.text_payload,
            cloudevents: config.routing.value == ValueFormat::CloudEventsBinary,
            routing: config.schema_routing(),
            refresh: cfg.refresh_interval.0,
            resolved: HashMap::new(),
            compiled: HashMap::new(),
            inferred: HashMap::new(),
            by_id: HashMap::new(),
            key_format,
            keys: HashMap::new(),
            counters: metrics.map(|m| Counters {
                hit: m.schema_cache.with_label_values(&["hit"]),
                miss: m.schema_cache.with_label_values(&["miss"]),
                requests: m.schema_registry_requests.clone(),
                mismatches: m.schema_mismatches.clone(),
            }),
            board: Arc::default(),
            stop: None,
        }))
    }

    /// Waits for an unreachable registry end when `stop` turns true.
    pub fn stop_on(&mut self, stop: tokio::sync::watch::Receiver<bool>) {
        self.stop = Some(stop);
    }

    /// Sleeps `pause` before a retry; `Err` when shutdown came first.
    async fn pause(&self, pause: Duration) -> Result<(), SchemaError> {
        let Some(mut stop) = self.stop.clone() else {
            tokio::time::sleep(pause).await;
            return Ok(());
        };
        if *stop.borrow_and_update() {
            return Err(SchemaError::Interrupted);
        }
        tokio::select! {
            _ = tokio::time::sleep(pause) => Ok(()),
            _ = stop.wait_for(|s| *s) => Err(SchemaError::Interrupted),
        }
    }

    /// The schemas in use, for status.
    pub fn board(&self) -> InUseBoard {
        self.board.clone()
    }

    /// The registry's base URL.
    pub fn url(&self) -> &str {
        self.client.url()
    }

    /// The subject an event of `event_type` bound for `topic` uses, or
    /// `None` with a pinned id.
    pub fn subject(&self, event_type: &str, topic: &str) -> Option<String> {
        let rule = self.routing.rule(event_type, topic);
        if rule.and_then(|r| r.id).is_some() {
            return None;
        }
        if let Some(s) = rule.and_then(|r| r.subject.clone()) {
            return Some(s);
        }
        let record = rule.and_then(|r| r.record.as_deref()).unwrap_or(event_type);
        Some(match self.routing.strategy {
            SubjectStrategy::Topic => format!("{topic}-value"),
            SubjectStrategy::Record => record.to_owned(),
            SubjectStrategy::TopicRecord => format!("{topic}-{record}"),
        })
    }

    fn entry(&self, event_type: &str, topic: &str) -> Option<&InUse> {
        self.resolved.get(event_type).and_then(|m| m.get(topic))
    }

    /// Whether the row's schema comes from its shape.
    fn is_inferred(&self, event_type: &str, topic: &str) -> bool {
        self.routing
            .rule(event_type, topic)
            .and_then(|r| r.schema)
            .unwrap_or(self.routing.source)
            == SchemaSource::Inferred
    }

    /// The root record name of an inferred schema.
    fn inferred_name(&self, event_type: &str, topic: &str) -> String {
        self.routing
            .rule(event_type, topic)
            .and_then(|r| r.record.clone())
            .unwrap_or_else(|| infer::record_name(event_type))
    }

    /// What the row's payload is to the registry.
    fn body<'a>(&self, row: &'a OutboxRow) -> Body<'a> {
        match &row.payload {
            Payload::Bytes(b) => Body::Encoded(b),
            Payload::Null => Body::Null,
            p => match p.json_value(self.text_payload) {
                Ok(JsonPayload::Json(j)) => Body::Json(j),
                Ok(JsonPayload::Bytes(b)) => Body::Encoded(b),
                Err(e) => Body::NotJson(e),
            },
        }
    }

    /// Whether the schema for this row on `topic` is cached and fresh (a
    /// payload no schema can be inferred from is "ready": encoding
    /// reports it).
    pub fn ready(&self, row: &OutboxRow, topic: &str) -> bool {
        if !self.key_ready(topic) {
            return false;
        }
        if !self.format.uses_registry() {
            return true;
        }
        let text = match self.body(row) {
            Body::Encoded(b) => {
                return framed(b).is_none_or(|(id, _)| {
                    self.by_id
                        .get(&id)
                        .is_some_and(|e| e.fetched().0.elapsed() < self.refresh)
                })
            }
            Body::Null | Body::NotJson(_) => return true,
            Body::Json(text) => text,
        };
        let text = text.as_ref();
        if self.is_inferred(&row.event_type, topic) {
            let Some(subject) = self.subject(&row.event_type, topic) else {
                return true;
            };
            return match infer::derive(text, &self.inferred_name(&row.event_type, topic)) {
                Ok(text) => match self.inferred.get(&subject).and_then(|m| m.get(&text)) {
                    Some(Inferred::Registered { .. }) => true,
                    Some(Inferred::Refused(_, at)) => at.elapsed() < self.refresh,
                    None => false,
                },
                Err(_) => true,
            };
        }
        self.entry(&row.event_type, topic)
            .is_some_and(|e| !e.latest || e.fetched.elapsed() < self.refresh)
    }

    /// After a mismatch against a `latest` schema: whether a newer version
    /// may fit, in which case the cached one is marked stale (and must be
    /// looked up, waiting out an unreachable registry), so that the next
    /// [`Registry::ready`] asks the registry again. Not when the registry
    /// answered after the row was committed (`commit_ms`, with 5 s for
    /// clocks that disagree): a version the row was written for existed
    /// then, and that answer had it.
    pub fn recheck_after_mismatch(&mut self, row: &OutboxRow, topic: &str, commit_ms: i64) -> bool {
        if !self.format.uses_registry() {
            return false;
        }
        if let Payload::Bytes(b) = &row.payload {
            // The id's answer is dropped, so that the look-up waits out an
            // unreachable registry rather than keep it.
            let Some((id, _)) = framed(b) else {
                return false;
            };
            let stale = self
                .by_id
                .get(&id)
                .is_some_and(|e| e.fetched().1 <= commit_ms.saturating_add(CLOCK_SKEW_MS));
            if stale {
                self.by_id.remove(&id);
            }
            return stale;
        }
        let refresh = self.refresh;
        let Some(entry) = self
            .resolved
            .get_mut(&row.event_type)
            .and_then(|m| m.get_mut(topic))
        else {
            return false;
        };
        if !entry.latest || entry.fetched_ms > commit_ms.saturating_add(CLOCK_SKEW_MS) {
            return false;
        }
        entry.must_refresh = true;
        entry.fetched = Instant::now().checked_sub(refresh).unwrap_or(entry.fetched);
        true
    }

    /// Counts a payload that did not fit, once it is final.
    pub fn count_mismatch(&self) {
        if let Some(c) = &self.counters {
            c.mismatches.inc();
        }
    }

    fn count(&self, outcome: &str) {
        if let Some(c) = &self.counters {
            c.requests.with_label_values(&[outcome]).inc();
        }
    }

    async fn ask<T: Send + 'static>(
        &self,
        call: impl FnOnce(&Client) -> Result<T, ClientError> + Send + 'static,
    ) -> Result<T, ClientError> {
        let client = self.client.clone();
        tokio::task::spawn_blocking(move || call(&client))
            .await
            .unwrap_or_else(|e| {
                Err(ClientError::Unavailable {
                    url: String::new(),
                    reason: format!("the request's thread failed: {e}"),
                })
            })
    }

    /// One look-up of the schema for `rule`: by id, or the subject's
    /// version.
    async fn fetch(&self, subject: Option<&str>, rule: Option<&SchemaRule>) -> Result<Served, ClientError> {
        let r = match (rule.and_then(|r| r.id), subject) {
            (Some(id), _) => self.ask(move |c| c.by_id(id)).await,
            (None, Some(subject)) => {
                let subject = subject.to_owned();
                let version = rule.and_then(|r| r.version);
                self.ask(move |c| c.version(&subject, version)).await
            }
            (None, None) => unreachable!("a subject is named unless an id is pinned"),
        };
        self.count(r.as_ref().map_or_else(outcome_of, |_| "ok"));
        r
    }

    /// Looks the schema for this event type and topic up, waiting out a
    /// registry that is unreachable (retrying with a growing pause, up to
    /// 10 s). A `latest` schema already cached is kept when its refresh
    /// fails.
    pub async fn resolve(&mut self, row: &OutboxRow, topic: &str) -> Result<(), SchemaError> {
        if let Some(c) = &self.counters {
            c.miss.inc();
        }
        if !self.key_ready(topic) {
            self.resolve_key(topic).await?;
        }
        if !self.format.uses_registry() {
            return Ok(());
        }
        let event_type = row.event_type.as_str();
        let text = match self.body(row) {
            Body::Encoded(b) => match framed(b) {
                Some((id, _)) => return self.resolve_id(id).await,
                None => return Ok(()),
            },
            Body::Null | Body::NotJson(_) => return Ok(()),
            Body::Json(text) => text,
        };
        if self.is_inferred(event_type, topic) {
            return self.register_inferred(row, &text, topic).await;
        }
        let rule = self.routing.rule(event_type, topic).cloned();
        let subject = self.subject(event_type, topic);
        let mut pause = Duration::from_millis(250);
        let served = loop {
            match self.fetch(subject.as_deref(), rule.as_ref()).await {
                Ok(s) => break s,
                // A refresh that fails, for whatever reason (the subject
                // deleted, a token expired, the registry away), keeps the
                // schema in use: the events it encodes were valid a moment
                // ago, and stopping would cure nothing.
                Err(e)
                    if self
                        .entry(event_type, topic)
                        .is_some_and(|cached| !(cached.must_refresh && e.is_transient())) =>
                {
                    tracing::warn!(error = %e, "could not refresh a schema; the one in use stays until the next try");
                    if let Some(entry) = self.resolved.get_mut(event_type).and_then(|m| m.get_mut(topic)) {
                        entry.fetched = Instant::now();
                    }
                    return Ok(());
                }
                Err(e) if e.is_transient() => {
                    tracing::warn!(error = %e, subject = subject.as_deref().unwrap_or(""), retry_in = ?pause,
                        "waiting for the Schema Registry: no event goes to Kafka until its schema is known");
                    self.pause(pause).await?;
                    pause = (pause * 2).min(Duration::from_secs(10));
                }
                Err(e) => return Err(SchemaError::Registry(e)),
            }
        };
        let what = match (&subject, served.version) {
            (Some(s), Some(v)) => format!("{s:?} version {v}"),
            (Some(s), None) => format!("{s:?}"),
            (None, _) => format!("id {}", served.id.unwrap_or_default()),
        };
        let id = served.id.ok_or_else(|| SchemaError::Unusable {
            what: what.clone(),
            format: format_name(self.format),
            reason: "the registry gave no schema id".into(),
        })?;
        let message = rule.as_ref().and_then(|r| r.record.clone());
        let codec = match self.compiled.get(&(id, message.clone())) {
            Some(c) => c.clone(),
            None => {
                let compiled = self.compile(&served, message.as_deref());
                let c = match compiled {
                    Ok(c) => Arc::new(c),
                    // A newer version outboxd cannot use: the one in use
                    // stays (it encoded valid events a moment ago).
                    Err(reason) if self.entry(event_type, topic).is_some() => {
                        tracing::warn!(
                            schema = what,
                            reason,
                            "a newer schema cannot be used; the one in use stays"
                        );
                        if let Some(entry) = self.resolved.get_mut(event_type).and_then(|m| m.get_mut(topic))
                        {
                            entry.fetched = Instant::now();
                            entry.fetched_ms = chrono::Utc::now().timestamp_millis();
                            entry.must_refresh = false;
                        }
                        return Ok(());
                    }
                    Err(reason) => {
                        return Err(SchemaError::Unusable {
                            what: what.clone(),
                            format: format_name(self.format),
                            reason,
                        })
                    }
                };
                self.compiled.insert((id, message), c.clone());
                c
            }
        };
        let latest = rule
            .as_ref()
            .is_none_or(|r| r.id.is_none() && r.version.is_none());
        tracing::info!(
            subject = subject.as_deref().unwrap_or(""),
            id,
            version = served.version,
            event_type,
            topic,
            "schema in use"
        );
        self.show(event_type, topic, subject.clone(), served.version, id);
        self.resolved.entry(event_type.to_owned()).or_default().insert(
            topic.to_owned(),
            InUse {
                subject,
                id,
                codec,
                fetched: Instant::now(),
                latest,
                fetched_ms: chrono::Utc::now().timestamp_millis(),
                must_refresh: false,
            },
        );
        Ok(())
    }

    /// Registers the schema derived from the row's payload (waiting out an
    /// unreachable registry); a refusal marks the shape as a mismatch.
    async fn register_inferred(
        &mut self,
        row: &OutboxRow,
        payload: &str,
        topic: &str,
    ) -> Result<(), SchemaError> {
        let Some(subject) = self.subject(&row.event_type, topic) else {
            return Ok(());
        };
        let Ok(text) = infer::derive(payload, &self.inferred_name(&row.event_type, topic)) else {
            return Ok(());
        };
        let mut pause = Duration::from_millis(250);
        let answer = loop {
            let (s, t) = (subject.clone(), text.clone());
            let r = self.ask(move |c| c.register(&s, &t, "AVRO")).await;
            self.count(match &r {
                Ok(_) => "ok",
                Err(e) => outcome_of(e),
            });
            match r {
                Err(e) if e.is_transient() => {
                    tracing::warn!(error = %e, subject, retry_in = ?pause,
                        "waiting for the Schema Registry to register an inferred schema: no event goes to Kafka until it does");
                    self.pause(pause).await?;
                    pause = (pause * 2).min(Duration::from_secs(10));
                }
                other => break other,
            }
        };
        let entry = match answer {
            Ok(id) => {
                let codec = avro::AvroCodec::parse(&text).map_err(|e| SchemaError::Unusable {
                    what: format!("inferred for {subject:?}"),
                    format: "avro",
                    reason: e.to_string(),
                })?;
                tracing::info!(
                    subject,
                    id,
                    event_type = row.event_type,
                    topic,
                    "inferred schema registered"
                );
                self.show(&row.event_type, topic, Some(subject.clone()), None, id);
                Inferred::Registered {
                    id,
                    codec: Arc::new(Codec::Avro(codec)),
                }
            }
            // Incompatible with the subject's history (409) or an invalid
            // schema (42201); not 42205 (a read-only registry: stop).
            Err(e @ ClientError::Refused { status: 409, .. })
            | Err(e @ ClientError::Refused { code: 42201, .. }) => {
                Inferred::Refused(e.to_string(), Instant::now())
            }
            Err(e) => return Err(SchemaError::Registry(e)),
        };
        self.inferred.entry(subject).or_default().insert(text, entry);
        Ok(())
    }

    /// Looks up schema `id` of an encoded payload and the subjects that
    /// hold it, waiting out an unreachable registry. An id the registry
    /// does not have, or a schema of another format, is remembered as
    /// refused; a failed refresh keeps what is known.
    async fn resolve_id(&mut self, id: u32) -> Result<(), SchemaError> {
        let mut pause = Duration::from_millis(250);
        let answer = loop {
            let r = self
                .ask(move |c| c.by_id(id).and_then(|s| c.versions_of_id(id).map(|v| (s, v))))
                .await;
            self.count(r.as_ref().map_or_else(outcome_of, |_| "ok"));
            match r {
                Ok(found) => break Ok(found),
                // A refresh that fails, however it fails (the registry
                // away, or answering 404 while it restarts or fails
                // over), keeps what is known, as for schemas by subject.
                Err(e) if matches!(self.by_id.get(&id), Some(ById::Known { .. })) => {
                    tracing::warn!(error = %e, id, "could not refresh the subjects of a schema id; what is known stays until the next try");
                    if let Some(ById::Known { fetched, .. }) = self.by_id.get_mut(&id) {
                        *fetched = Instant::now();
                    }
                    return Ok(());
                }
                Err(e @ ClientError::NotFound { .. }) => break Err(e.to_string()),
                Err(e) if e.is_transient() => {
                    tracing::warn!(error = %e, id, retry_in = ?pause,
                        "waiting for the Schema Registry: no event goes to Kafka until the schema id of an encoded payload is checked");
                    self.pause(pause).await?;
                    pause = (pause * 2).min(Duration::from_secs(10));
                }
                Err(e) => return Err(SchemaError::Registry(e)),
            }
        };
        let (at, at_ms) = (Instant::now(), chrono::Utc::now().timestamp_millis());
        let entry = match answer {
            Ok((served, subjects)) if !served.references.is_empty() => {
                tracing::warn!(
                    id,
                    "schema id references other schemas, which outboxd does not follow: encoded payloads of it are checked by id and subject only"
                );
                if self.kind_fits(&served) {
                    ById::Known {
                        codec: None,
                        subjects,
                        fetched: at,
                        fetched_ms: at_ms,
                    }
                } else {
                    ById::Refused {
                        reason: format!(
                            "schema id {id} is a {} schema, not one for routing.value = {:?}",
                            served.schema_type.as_deref().unwrap_or("AVRO"),
                            format_name(self.format)
                        ),
                        at,
                        at_ms,
                    }
                }
            }
            Ok((served, subjects)) => {
                let compiled = match self.compiled.get(&(id, None)) {
                    Some(c) => Ok(c.clone()),
                    None => self.compile(&served, None).map(Arc::new),
                };
                match compiled {
                    Ok(codec) => {
                        self.compiled.insert((id, None), codec.clone());
                        ById::Known {
                            codec: Some(codec),
                            subjects,
                            fetched: at,
                            fetched_ms: at_ms,
                        }
                    }
                    Err(reason) => ById::Refused {
                        reason: format!(
                            "schema id {id} cannot be used for routing.value = {:?}: {reason}",
                            format_name(self.format)
                        ),
                        at,
                        at_ms,
                    },
                }
            }
            Err(reason) => ById::Refused { reason, at, at_ms },
        };
        self.by_id.insert(id, entry);
        Ok(())
    }

    /// Whether a served schema is of the configured format.
    fn kind_fits(&self, served: &Served) -> bool {
        let kind = served
            .schema_type
            .as_deref()
            .unwrap_or("AVRO")
            .to_ascii_uppercase();
        matches!(
            (self.format, kind.as_str()),
            (ValueFormat::Avro, "AVRO")
                | (ValueFormat::Protobuf, "PROTOBUF")
                | (ValueFormat::JsonSchema, "JSON")
        )
    }

    /// An encoded payload (`bytes`) checked against the registry: the
    /// value stays the bytes, unchanged.
    fn check_encoded(
        &self,
        record: &mut KafkaRecord,
        row: &OutboxRow,
        bytes: &[u8],
    ) -> Result<(), SchemaError> {
        let expected = self.subject(&row.event_type, &record.topic);
        let label = expected.clone().unwrap_or_else(|| "a pinned id".into());
        let mismatch = |id: Option<u32>, reason: String| SchemaError::Mismatch {
            subject: label.clone(),
            id,
            misfit: Misfit {
                path: "$".into(),
                reason,
            },
        };
        let Some((id, body)) = framed(bytes) else {
            return Err(mismatch(
                None,
                "the bytea payload is not in the Confluent wire format: an encoded payload starts with the magic byte 0 and a 4-byte schema id".into(),
            ));
        };
        let rule = self.routing.rule(&row.event_type, &record.topic);
        if let Some(pinned) = rule.and_then(|r| r.id).filter(|p| *p != id) {
            return Err(mismatch(
                Some(id),
                format!("the payload was encoded with schema id {id}, but routing.schemas pins id {pinned}"),
            ));
        }
        match self.by_id.get(&id) {
            Some(ById::Known { codec, subjects, .. }) => {
                if let Some(subject) = &expected {
                    let version = rule.and_then(|r| r.version);
                    if !subjects
                        .iter()
                        .any(|(s, v)| s == subject && version.is_none_or(|want| *v == want))
                    {
                        let under: Vec<String> = subjects.iter().map(|(s, v)| format!("{s} v{v}")).collect();
                        let at = version.map(|v| format!(" at version {v}")).unwrap_or_default();
                        return Err(mismatch(
                            Some(id),
                            format!(
                                "schema id {id} is not registered under subject {subject:?}{at} (it is under: {})",
                                if under.is_empty() { "no subject".into() } else { under.join(", ") }
                            ),
                        ));
                    }
                }
                if let Some(codec) = codec {
                    let message = codec
                        .check_encoded(body)
                        .map_err(|misfit| SchemaError::Mismatch {
                            subject: label.clone(),
                            id: Some(id),
                            misfit,
                        })?;
                    // The message a rule names is the one to carry, as
                    // when outboxd encodes it.
                    let wanted = rule.and_then(|r| r.record.as_deref());
                    if let (Some(found), Some(wanted)) = (&message, wanted) {
                        if found.as_str() != wanted.trim_start_matches('.') {
                            return Err(mismatch(
                                Some(id),
                                format!("the body is a {found} message, but routing.schemas names {wanted}"),
                            ));
                        }
                    }
                }
                if let Some(c) = &self.counters {
                    c.hit.inc();
                }
                record.value = Some(bytes.to_vec());
                self.describe_data(record, id);
                self.show(&row.event_type, &record.topic, expected, None, id);
                Ok(())
            }
            Some(ById::Refused { reason, .. }) => Err(mismatch(Some(id), reason.clone())),
            None => Err(SchemaError::Unusable {
                what: format!("id {id}"),
                format: format_name(self.format),
                reason: "it was not looked up before checking (a bug: please report it)".into(),
            }),
        }
    }

    /// Puts the schema an event type uses on `topic` on the status board.
    fn show(&self, event_type: &str, topic: &str, subject: Option<String>, version: Option<u32>, id: u32) {
        if let Ok(mut board) = self.board.lock() {
            board.insert(
                (event_type.to_owned(), topic.to_owned()),
                SchemaInUse {
                    event_type: event_type.to_owned(),
                    topic: topic.to_owned(),
                    subject,
                    version,
                    id,
                },
            );
        }
    }

    fn compile(&self, served: &Served, message: Option<&str>) -> Result<Codec, String> {
        if !served.references.is_empty() {
            return Err("it references other schemas, which outboxd does not follow yet".into());
        }
        let kind = served
            .schema_type
            .as_deref()
            .unwrap_or("AVRO")
            .to_ascii_uppercase();
        match (self.format, kind.as_str()) {
            (ValueFormat::Avro, "AVRO") => avro::AvroCodec::parse(&served.schema)
                .map(Codec::Avro)
                .map_err(|e| e.to_string()),
            (ValueFormat::Protobuf, "PROTOBUF") => {
                protobuf::ProtobufCodec::parse(&served.schema, message).map(Codec::Protobuf)
            }
            (ValueFormat::JsonSchema, "JSON") => {
                json_schema::JsonSchemaCodec::parse(&served.schema).map(Codec::JsonSchema)
            }
            (_, other) => Err(format!("it is a {other} schema")),
        }
    }

    /// Replaces the record's value (the payload JSON) with its encoding
    /// in the Confluent wire format. [`Registry::resolve`] must have made
    /// the schema [`Registry::ready`]; a stale `latest` one is still used.
    pub fn encode(&self, record: &mut KafkaRecord, row: &OutboxRow) -> Result<(), SchemaError> {
        if self.format.uses_registry() {
            self.encode_value(record, row)?;
        }
        self.encode_key(record, row)
    }

    fn encode_value(&self, record: &mut KafkaRecord, row: &OutboxRow) -> Result<(), SchemaError> {
        // A null value (a tombstone, a NULL payload) is encoded as null,
        // as the Confluent serializers write it.
        if record.value.is_none() {
            return Ok(());
        }
        let text = match self.body(row) {
            Body::Encoded(b) => return self.check_encoded(record, row, b),
            Body::Null => return Ok(()),
            Body::NotJson(e) => return Err(SchemaError::Payload(e)),
            Body::Json(text) => text,
        };
        let text = text.as_ref();
        if self.is_inferred(&row.event_type, &record.topic) {
            return self.encode_inferred(record, row, text);
        }
        let Some(entry) = self.entry(&row.event_type, &record.topic) else {
            return Err(SchemaError::Unusable {
                what: format!("for {:?} on {}", row.event_type, record.topic),
                format: format_name(self.format),
                reason: "it was not looked up before encoding (a bug: please report it)".into(),
            });
        };
        let subject = entry.subject.as_deref().unwrap_or("a pinned id");
        self.write_value(record, text, &entry.codec, entry.id, subject)
    }

    /// Writes the value of `record` (built from `row`) with `codec`, schema
    /// `id` of `subject`: magic byte, id, then the body.
    fn write_value(
        &self,
        record: &mut KafkaRecord,
        payload: &str,
        codec: &Codec,
        id: u32,
        subject: &str,
    ) -> Result<(), SchemaError> {
        if let Some(c) = &self.counters {
            c.hit.inc();
        }
        let mismatch = |misfit: Misfit| SchemaError::Mismatch {
            subject: subject.to_owned(),
            id: Some(id),
            misfit,
        };
        let mut out = Vec::with_capacity(payload.len() + 8);
        out.push(MAGIC);
        out.extend_from_slice(&id.to_be_bytes());
        match codec {
            Codec::Avro(c) => {
                let v = parse_payload(payload).map_err(mismatch)?;
                c.encode(&v, payload, &mut out).map_err(mismatch)?;
            }
            Codec::JsonSchema(c) => {
                let v = parse_payload(payload).map_err(mismatch)?;
                c.check(&v).map_err(mismatch)?;
                out.extend_from_slice(payload.as_bytes());
            }
            Codec::Protobuf(c) => c.encode(payload, &mut out).map_err(mismatch)?,
        }
        record.value = Some(out);
        self.describe_data(record, id);
        Ok(())
    }

    /// CloudEvents in binary mode: the `data`'s content type, and
    /// `dataschema` as the registry's URL of schema `id`.
    fn describe_data(&self, record: &mut KafkaRecord, id: u32) {
        if !self.cloudevents {
            return;
        }
        let content_type = match self.format {
            ValueFormat::Avro => "application/avro",
            ValueFormat::Protobuf => "application/protobuf",
            _ => "application/json",
        };
        record
            .headers
            .retain(|(k, _)| k != crate::kafka::cloudevents::CONTENT_TYPE && k != DATASCHEMA_HEADER);
        record.headers.push((
            crate::kafka::cloudevents::CONTENT_TYPE.into(),
            content_type.as_bytes().to_vec(),
        ));
        record.headers.push((
            DATASCHEMA_HEADER.into(),
            format!("{}/schemas/ids/{id}", self.client.url()).into_bytes(),
        ));
    }

    fn encode_inferred(
        &self,
        record: &mut KafkaRecord,
        row: &OutboxRow,
        payload: &str,
    ) -> Result<(), SchemaError> {
        let subject = self.subject(&row.event_type, &record.topic).unwrap_or_default();
        let mismatch = |misfit: Misfit| SchemaError::Mismatch {
            subject: subject.clone(),
            id: None,
            misfit,
        };
        let text =
            infer::derive(payload, &self.inferred_name(&row.event_type, &record.topic)).map_err(mismatch)?;
        match self.inferred.get(&subject).and_then(|m| m.get(&text)) {
            Some(Inferred::Registered { id, codec }) => {
                self.write_value(record, payload, codec, *id, &subject)
            }
            Some(Inferred::Refused(why, _)) => Err(mismatch(Misfit {
                path: "$".into(),
                reason: format!("the registry refused the schema inferred from this payload's shape: {why}"),
            })),
            None => Err(SchemaError::Unusable {
                what: format!("inferred for {subject:?}"),
                format: "avro",
                reason: "it was not registered before encoding (a bug: please report it)".into(),
            }),
        }
    }

    /// Encodes `record` (built from `row`) in place: `Ok(None)` when it
    /// is, `Ok(Some(error))` when the payload does not fit (the record is
    /// left as it was, so that it can be encoded again after a recheck),
    /// `Err` for an error that stops the relay. The schema must be
    /// [`Registry::ready`] (or cached, if stale).
    pub fn try_encode(
        &self,
        record: &mut KafkaRecord,
        row: &OutboxRow,
    ) -> Result<Option<RecordError>, SchemaError> {
        match self.encode(record, row) {
            Ok(()) => Ok(None),
            Err(SchemaError::Payload(e)) => Ok(Some(RecordError::Payload(e))),
            Err(e) if e.is_row_problem() => Ok(Some(RecordError::SchemaMismatch(e.to_string()))),
            Err(e) => Err(e),
        }
    }

    /// The whole step for callers that need not keep a replication
    /// connection alive meanwhile: [`Registry::resolve`] unless the schema
    /// is [`Registry::ready`], [`Registry::try_encode`], and after a
    /// mismatch one recheck for a newer version. A payload that does not
    /// fit becomes [`RecordError::SchemaMismatch`], which
    /// `routing.on_poison` handles like every row problem. `commit_ms`:
    /// when the row was committed (or written), in Unix milliseconds.
    pub async fn prepare(
        &mut self,
        built: Result<KafkaRecord, RecordError>,
        row: &OutboxRow,
        commit_ms: i64,
    ) -> Result<Result<KafkaRecord, RecordError>, SchemaError> {
        let mut record = match built {
            Ok(r) => r,
            Err(e) => return Ok(Err(e)),
        };
        if !self.ready(row, &record.topic) {
            self.resolve(row, &record.topic).await?;
        }
        let mut misfit = self.try_encode(&mut record, row)?;
        if misfit.is_some() && self.recheck_after_mismatch(row, &record.topic, commit_ms) {
            self.resolve(row, &record.topic).await?;
            misfit = self.try_encode(&mut record, row)?;
        }
        Ok(match misfit {
            None => Ok(record),
            Some(e) => {
                self.count_mismatch();
                Err(e)
            }
        })
    }

    /// The start-up check: refused credentials, or a subject named in
    /// `[routing.schemas]` that does not exist, stop outboxd before it
    /// streams; an unreachable registry only warns (cached schemas are
    /// fetched when first needed, and waited for).
    pub async fn check_at_start(&self) -> Result<(), SchemaError> {
        match self.reachable().await {
            // A registry that answers, but not as the API does, is most
            // likely the wrong URL: stop now rather than wait at the
            // first event.
            Err(
                e @ (ClientError::Unauthorized { .. }
                | ClientError::Unreadable { .. }
                | ClientError::Impossible { .. }),
            ) => return Err(SchemaError::Registry(e)),
            Err(e) => {
                tracing::warn!(error = %e, "the Schema Registry is not reachable at start; events wait for it");
                return Ok(());
            }
            Ok(_) => {}
        }
        for (what, r) in self.check_configured().await {
            match r {
                Ok(found) => tracing::info!(rule = what, found, "schema rule resolves"),
                Err(e) if e.is_transient() => {
                    tracing::warn!(rule = what, error = %e, "could not check a schema rule at start")
                }
                Err(e) => return Err(SchemaError::Registry(e)),
            }
        }
        Ok(())
    }

    /// Whether the registry answers and takes outboxd's credentials: the
    /// number of subjects it holds.
    pub async fn reachable(&self) -> Result<usize, ClientError> {
        self.ask(Client::subjects).await
    }

    /// What an event of `event_type` bound for `topic` will use, looked
    /// up once: `subject: id N, version V`, or that its schema will be
    /// inferred.
    pub async fn check_event(&self, event_type: &str, topic: &str) -> Result<String, ClientError> {
        let key = self.check_key(topic).await?;
        if !self.format.uses_registry() {
            return Ok(key.unwrap_or_default());
        }
        let value = self.check_value(event_type, topic).await?;
        Ok(match key {
            Some(k) => format!("{value}; {k}"),
            None => value,
        })
    }

    async fn check_value(&self, event_type: &str, topic: &str) -> Result<String, ClientError> {
        let subject = self.subject(event_type, topic);
        let label = subject.clone().unwrap_or_else(|| "a pinned id".into());
        if self.is_inferred(event_type, topic) {
            return Ok(format!(
                "{label}: inferred from each payload, registered on first use"
            ));
        }
        let rule = self.routing.rule(event_type, topic);
        let s = self.fetch(subject.as_deref(), rule).await?;
        Ok(format!("{label}: {}", found(&s, rule)))
    }

    /// The subjects configured in `[routing.schemas]` that can be named
    /// without an event (an explicit subject or a pinned id), looked up
    /// once: for `outboxd check` and the start.
    pub async fn check_configured(&self) -> Vec<(String, Result<String, ClientError>)> {
        let mut out = Vec::new();
        for (key, rule) in &self.routing.rules {
            // Only rules that name their subject (or pin an id): a rule's
            // key may be an event type or a topic, and the strategy's
            // subject is known with the event.
            if rule.schema.unwrap_or(self.routing.source) == SchemaSource::Inferred {
                continue;
            }
            let subject = match (rule.id, &rule.subject) {
                (Some(_), _) => None,
                (None, Some(s)) => Some(s.clone()),
                (None, None) => continue,
            };
            let label = subject
                .clone()
                .unwrap_or_else(|| format!("id {}", rule.id.unwrap_or_default()));
            let r = self
                .fetch(subject.as_deref(), Some(rule))
                .await
                .map(|s| found(&s, Some(rule)));
            out.push((format!("{key} → {label}"), r));
        }
        out
    }
}

/// What a look-up found, for `outboxd check`: `id N, version V`.
fn found(s: &Served, rule: Option<&SchemaRule>) -> String {
    format!(
        "id {}{}",
        s.id.or(rule.and_then(|r| r.id)).unwrap_or_default(),
        s.version.map(|v| format!(", version {v}")).unwrap_or_default()
    )
}

/// The payload as a JSON value. jsonb may hold numbers no `f64` holds
/// (`1e400`): such a payload fits no schema of these formats.
fn parse_payload(text: &str) -> Result<Value, Misfit> {
    serde_json::from_str(text).map_err(|e| Misfit {
        path: "$".into(),
        reason: format!("the payload cannot be read as JSON values: {e}"),
    })
}

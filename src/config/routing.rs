//! `[routing]`: how rows become Kafka records.

use serde::Deserialize;

use super::columns::{ColumnMap, ColumnName, PlacedColumn, Role};
use super::registry::{SchemaRule, SchemaSource, SubjectStrategy};
use super::yes;

fn default_cloudevents_source() -> String {
    DEFAULT_SOURCE.to_owned()
}

/// How a record's value is built.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum ValueFormat {
    /// `{"eventId","type","occurredAt","aggregateType","aggregateId","data"}`.
    #[default]
    Envelope,
    /// The payload JSON as stored.
    Payload,
    /// A CloudEvent 1.0 in structured mode (see [`crate::kafka::cloudevents`]).
    #[serde(rename = "cloudevents")]
    CloudEvents,
    /// A CloudEvent 1.0 in binary mode: `ce_*` headers, the payload as value.
    #[serde(rename = "cloudevents-binary")]
    CloudEventsBinary,
    /// The payload encoded in Avro against a registry schema, in the
    /// Confluent wire format (see [`crate::schema`]).
    Avro,
    /// The payload encoded in Protobuf against a registry schema, in the
    /// Confluent wire format (with the message indexes).
    Protobuf,
    /// The payload as JSON, validated against a registry JSON Schema, in
    /// the Confluent wire format.
    #[serde(rename = "json-schema")]
    JsonSchema,
    /// What Debezium's Event Router writes through Kafka Connect's
    /// `JsonConverter` (see [`crate::kafka::connect`]).
    #[serde(rename = "connect-json")]
    ConnectJson,
}

impl ValueFormat {
    /// Whether values of this format are framed with a registry schema id.
    pub fn uses_registry(self) -> bool {
        matches!(
            self,
            ValueFormat::Avro | ValueFormat::Protobuf | ValueFormat::JsonSchema
        )
    }
}

/// The `data` of a CloudEvent in binary mode.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "kebab-case")]
pub enum CloudEventsData {
    /// The payload JSON as stored (`application/json`).
    #[default]
    Json,
    /// Registry-encoded Avro (`application/avro`), with `dataschema`.
    Avro,
    /// Registry-encoded Protobuf (`application/protobuf`), with `dataschema`.
    Protobuf,
    /// Registry-checked JSON (`application/json`), with `dataschema`.
    JsonSchema,
}

/// How the record key (the `aggregate_id`) is written.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "kebab-case")]
pub enum KeyFormat {
    /// The `aggregate_id`'s UTF-8, as Kafka's `StringSerializer` writes it.
    #[default]
    String,
    /// An Avro `"string"` in the Confluent wire format, its schema under
    /// `<topic>-key`.
    Avro,
    /// A JSON string in the Confluent wire format, its schema
    /// `{"type": "string"}` under `<topic>-key`.
    JsonSchema,
    /// Kafka Connect's `JsonConverter` form of the key column (what a
    /// Debezium deployment with that key converter wrote).
    ConnectJson,
}

impl KeyFormat {
    /// Whether keys of this format are framed with a registry schema id.
    pub fn uses_registry(self) -> bool {
        matches!(self, KeyFormat::Avro | KeyFormat::JsonSchema)
    }
}

/// What to do with a row Kafka will never accept.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "kebab-case")]
pub enum OnPoison {
    /// Stop with a clear error; the slot does not move past the row.
    #[default]
    Stop,
    /// Send the row to `routing.dead_letter_topic` and go on.
    DeadLetter,
    /// Park the row, and every later event of its topic and key, in the
    /// `outboxd_parked` table until `outboxd parked redrive` (see
    /// [`crate::park`]); other aggregates go on.
    Park,
}

impl OnPoison {
    /// Its name in the configuration file.
    pub fn name(self) -> &'static str {
        match self {
            OnPoison::Stop => "stop",
            OnPoison::DeadLetter => "dead-letter",
            OnPoison::Park => "park",
        }
    }
}

/// `[routing]`
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutingConfig {
    /// Topic name template with `{aggregate_type}` and `{type}`.
    #[serde(default = "default_topic")]
    pub topic: String,
    /// Lowercase the aggregate type in the topic name (`Order` → `order.events`).
    #[serde(default = "yes")]
    pub lowercase_aggregate_type: bool,
    /// `envelope`, `payload`, `cloudevents`, `cloudevents-binary`, `avro`,
    /// `protobuf` or `json-schema`.
    #[serde(default)]
    pub value: ValueFormat,
    /// The CloudEvents `source`: a URI-reference template over
    /// `{aggregate_type}`, `{aggregate_id}` and `{type}`.
    #[serde(default = "default_cloudevents_source")]
    pub cloudevents_source: String,
    /// With `cloudevents-binary`: the `data`, `json` (default) or
    /// registry-encoded (`avro`, `protobuf`, `json-schema`).
    #[serde(default)]
    pub cloudevents_data: CloudEventsData,
    /// The key: `string` (default), or registry-encoded (`avro`,
    /// `json-schema`).
    #[serde(default)]
    pub key_format: KeyFormat,
    /// `stop`, `dead-letter` or `park`.
    #[serde(default)]
    pub on_poison: OnPoison,
    /// With `park`: how much may be parked before outboxd stops.
    #[serde(default)]
    pub park: ParkLimits,
    /// Where dead letters go.
    #[serde(default = "default_dead_letter_topic")]
    pub dead_letter_topic: String,
    /// The aggregate types that may become topics: exact names, or
    /// prefixes ending in `*`. A row of another type follows `on_poison`
    /// and creates no topic. Unset: any aggregate type.
    #[serde(default)]
    pub allowed_aggregate_types: Option<Vec<String>>,
    /// With a registry format: how subjects are named (`topic`, `record`
    /// or `topic-record`).
    #[serde(default)]
    pub subject_strategy: SubjectStrategy,
    /// With a registry format: `registered` (default) or `inferred`.
    #[serde(default)]
    pub schema: SchemaSource,
    /// Per event type (or per topic) schema settings.
    #[serde(default)]
    pub schemas: std::collections::BTreeMap<String, SchemaRule>,
    /// A regex matched against the whole route value (Kafka Connect's
    /// `RegexRouter`, Debezium's `route.topic.regex`): `topic` is then the
    /// replacement, with `{$1}` or `{$name}` for its groups, and a value
    /// it does not match is the topic as it is.
    #[serde(default)]
    pub topic_regex: Option<String>,
    /// A NULL or blank payload becomes a tombstone: the key, a null value
    /// (Debezium's `route.tombstone.on.empty.payload`), for compacted
    /// topics.
    #[serde(default)]
    pub tombstone_on_empty_payload: bool,
    /// What a text payload is inside a JSON value: `auto` (JSON when it
    /// parses, else a JSON string), `string` or `json` (else a bad row).
    #[serde(default)]
    pub text_payload: TextPayload,
    /// Set the `type`, `aggregateType` and `aggregateId` headers besides
    /// `id` (false: `id` only, as Debezium's Event Router).
    #[serde(default = "yes")]
    pub standard_headers: bool,
    /// With `value = "connect-json"`: write the value with its schema
    /// (the value converter's `schemas.enable`, default true).
    #[serde(default = "yes")]
    pub connect_schemas: bool,
    /// With `key_format = "connect-json"`: write the key with its schema
    /// (the key converter's `schemas.enable`, default true).
    #[serde(default = "yes")]
    pub connect_key_schemas: bool,
    /// With `connect-json` and `envelope` placements: the first part of
    /// the value struct's name (Debezium's `topic.prefix`).
    #[serde(default = "default_connect_topic_prefix")]
    pub connect_topic_prefix: String,
}

fn default_connect_topic_prefix() -> String {
    "outboxd".into()
}

impl Default for RoutingConfig {
    fn default() -> Self {
        RoutingConfig {
            topic: default_topic(),
            lowercase_aggregate_type: true,
            value: ValueFormat::Envelope,
            cloudevents_source: default_cloudevents_source(),
            cloudevents_data: CloudEventsData::Json,
            key_format: KeyFormat::String,
            on_poison: OnPoison::Stop,
            park: Default::default(),
            dead_letter_topic: default_dead_letter_topic(),
            allowed_aggregate_types: None,
            subject_strategy: SubjectStrategy::Topic,
            schema: SchemaSource::Registered,
            schemas: Default::default(),
            topic_regex: None,
            tombstone_on_empty_payload: false,
            text_payload: TextPayload::Auto,
            standard_headers: true,
            connect_schemas: true,
            connect_key_schemas: true,
            connect_topic_prefix: default_connect_topic_prefix(),
        }
    }
}

fn default_topic() -> String {
    "{aggregate_type}.events".into()
}

fn default_dead_letter_topic() -> String {
    "outboxd.dead-letter".into()
}

/// The header every record carries: the event id.
pub const ID_HEADER: &str = "id";

/// The headers `routing.standard_headers` adds besides `id`.
pub const STANDARD_HEADERS: [&str; 3] = ["type", "aggregateType", "aggregateId"];

/// Kafka's limit on topic name length.
const MAX_TOPIC_LEN: usize = 249;

/// The default `routing.cloudevents_source`.
pub const DEFAULT_SOURCE: &str = "/outbox/{aggregate_type}";

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum TopicPart {
    Literal(String),
    /// The route column's value (`{aggregate_type}`, or the route column's
    /// own name).
    AggregateType,
    /// The type column's value.
    EventType,
    /// Another column's value: the row's additional value at this index.
    Column(usize),
    /// A capture group of `routing.topic_regex` (`{$1}`, `{$name}`).
    Capture(Capture),
}

/// A capture group of the topic regex.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Capture {
    Index(usize),
    Name(String),
}

/// `routing.topic_regex`, matched against the whole route value as Kafka
/// Connect's `RegexRouter` matches (`Matcher.matches()`).
#[derive(Clone, Debug)]
pub struct TopicRegex {
    pub(crate) anchored: regex::Regex,
    pub(crate) source: String,
}

impl PartialEq for TopicRegex {
    fn eq(&self, other: &Self) -> bool {
        self.source == other.source
    }
}

impl Eq for TopicRegex {}

impl TopicRegex {
    pub fn parse(source: &str) -> Result<Self, String> {
        let anchored = regex::Regex::new(&format!("^(?:{source})$")).map_err(|e| {
            format!("{source:?} is not a regex outboxd can run (lookaround and backreferences are not supported): {e}")
        })?;
        Ok(TopicRegex {
            anchored,
            source: source.to_owned(),
        })
    }

    /// How many groups it has, the whole match (group 0) included.
    pub fn group_count(&self) -> usize {
        self.anchored.captures_len()
    }

    fn has_group(&self, c: &Capture) -> bool {
        match c {
            Capture::Index(i) => *i < self.anchored.captures_len(),
            Capture::Name(n) => self.anchored.capture_names().any(|g| g == Some(n.as_str())),
        }
    }
}

/// A parsed `routing.topic` template.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopicTemplate {
    pub(crate) parts: Vec<TopicPart>,
    pub(crate) lowercase_aggregate_type: bool,
    /// `routing.allowed_aggregate_types`: exact names, or prefixes ending
    /// in `*`. `None` allows any aggregate type.
    pub(crate) allowed: Option<Vec<String>>,
    /// `routing.topic_regex`: the template is then the replacement, and a
    /// route value it does not match is the topic as it is.
    pub(crate) regex: Option<TopicRegex>,
}

fn topic_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')
}

impl TopicTemplate {
    /// Parses a template such as `{aggregate_type}.events`. Placeholders:
    /// `{aggregate_type}` (the route column), `{type}` (the type column),
    /// `{$1}` and `{$name}` (capture groups of `regex`), and any other
    /// `{column}`, which `columns` then reads.
    pub fn parse(
        template: &str,
        lowercase_aggregate_type: bool,
        columns: &mut ColumnMap,
        regex: Option<TopicRegex>,
    ) -> Result<Self, String> {
        let mut parts = Vec::new();
        let mut rest = template;
        while !rest.is_empty() {
            match rest.find('{') {
                Some(0) => {
                    let end = rest
                        .find('}')
                        .ok_or_else(|| format!("unclosed {{ in {template:?}"))?;
                    let name = &rest[1..end];
                    let part = match name {
                        "" => return Err(format!("empty placeholder {{}} in {template:?}")),
                        "aggregate_type" => TopicPart::AggregateType,
                        "type" => TopicPart::EventType,
                        _ if name.starts_with('$') => {
                            let group = &name[1..];
                            let capture = match group.parse::<usize>() {
                                Ok(i) => Capture::Index(i),
                                Err(_) => Capture::Name(group.to_owned()),
                            };
                            match &regex {
                                None => {
                                    return Err(format!(
                                        "{{{name}}} is a capture group, but routing.topic_regex is not set"
                                    ))
                                }
                                Some(r) if !r.has_group(&capture) => {
                                    return Err(format!(
                                        "routing.topic_regex {:?} has no group {group:?}",
                                        r.source
                                    ))
                                }
                                Some(_) => TopicPart::Capture(capture),
                            }
                        }
                        _ => match columns.role_of(name) {
                            Some(Role::Route) => TopicPart::AggregateType,
                            Some(Role::Type) => TopicPart::EventType,
                            _ => {
                                let column = ColumnName::new(name)?;
                                TopicPart::Column(columns.read_column(&column))
                            }
                        },
                    };
                    match part {
                        TopicPart::AggregateType => columns.need(Role::Route).map_err(|e| {
                            format!(
                                "{{aggregate_type}} stands for the route column, but {e}; use a fixed topic"
                            )
                        })?,
                        TopicPart::EventType => columns
                            .need(Role::Type)
                            .map_err(|e| format!("{{type}} stands for the type column, but {e}"))?,
                        _ => {}
                    }
                    parts.push(part);
                    rest = &rest[end + 1..];
                }
                found => {
                    let end = found.unwrap_or(rest.len());
                    let lit = &rest[..end];
                    if let Some(bad) = lit.chars().find(|&c| !topic_char(c)) {
                        return Err(format!(
                            "{bad:?} cannot appear in a topic name; use letters, digits, '.', '_' and '-'"
                        ));
                    }
                    parts.push(TopicPart::Literal(lit.to_owned()));
                    rest = &rest[end..];
                }
            }
        }
        if parts.is_empty() {
            return Err("the topic template is empty".into());
        }
        if regex.is_some() {
            columns
                .need(Role::Route)
                .map_err(|e| format!("routing.topic_regex is matched against the route column, but {e}"))?;
        }
        Ok(TopicTemplate {
            parts,
            allowed: None,
            lowercase_aggregate_type,
            regex,
        })
    }

    /// Only these aggregate types may become topics: exact names, or
    /// prefixes ending in `*` (`Order*`).
    pub fn allowing(mut self, allowed: Vec<String>) -> Self {
        self.allowed = Some(allowed);
        self
    }

    pub(crate) fn allows(&self, aggregate_type: &str) -> bool {
        self.allowed.as_ref().is_none_or(|list| {
            list.iter().any(|a| match a.strip_suffix('*') {
                Some(prefix) => aggregate_type.starts_with(prefix),
                None => a == aggregate_type,
            })
        })
    }

    /// Whether the topic is the same for every row.
    pub fn is_fixed(&self) -> bool {
        self.regex.is_none() && self.parts.iter().all(|p| matches!(p, TopicPart::Literal(_)))
    }
}

/// Why `topic` breaks Kafka's rules for topic names, if it does.
pub fn topic_name_problem(topic: &str) -> Option<&'static str> {
    if topic.is_empty() {
        Some("it is empty")
    } else if topic.len() > MAX_TOPIC_LEN {
        Some("it is longer than 249 characters")
    } else if topic == "." || topic == ".." {
        Some("\".\" and \"..\" are reserved")
    } else if !topic.chars().all(topic_char) {
        Some("only letters, digits, '.', '_' and '-' are allowed")
    } else {
        None
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum SourcePart {
    Literal(String),
    AggregateType,
    AggregateId,
    EventType,
}

/// A parsed `routing.cloudevents_source`: a URI-reference with
/// `{aggregate_type}`, `{aggregate_id}` and `{type}`, whose values are
/// percent-encoded into it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceTemplate {
    pub(crate) parts: Vec<SourcePart>,
}

impl SourceTemplate {
    pub fn parse(template: &str) -> Result<Self, String> {
        let mut parts = Vec::new();
        let mut rest = template;
        while let Some(open) = rest.find('{') {
            if open > 0 {
                parts.push(SourcePart::Literal(rest[..open].to_owned()));
            }
            let close = rest[open..]
                .find('}')
                .ok_or_else(|| format!("unclosed {{ in {template:?}"))?;
            parts.push(match &rest[open + 1..open + close] {
                "aggregate_type" => SourcePart::AggregateType,
                "aggregate_id" => SourcePart::AggregateId,
                "type" => SourcePart::EventType,
                other => {
                    return Err(format!(
                    "unknown placeholder {{{other}}}: use {{aggregate_type}}, {{aggregate_id}} or {{type}}"
                ))
                }
            });
            rest = &rest[open + close + 1..];
        }
        if !rest.is_empty() {
            parts.push(SourcePart::Literal(rest.to_owned()));
        }
        let literal: String = parts
            .iter()
            .filter_map(|p| match p {
                SourcePart::Literal(l) => Some(l.as_str()),
                _ => None,
            })
            .collect();
        if parts.is_empty() {
            return Err("must not be empty: CloudEvents requires a source".into());
        }
        if let Some(c) = literal
            .chars()
            .find(|c| c.is_whitespace() || c.is_control() || !c.is_ascii() || "\"<>\\^`{|}".contains(*c))
        {
            return Err(format!(
                "{c:?} cannot stand in a URI-reference; percent-encode it"
            ));
        }
        Ok(SourceTemplate { parts })
    }
}

/// How record values and headers are built: `routing.value`, the
/// CloudEvents `source` template, what a text payload is, which headers
/// outboxd sets, tombstones, and where the additional columns go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordValue {
    pub format: ValueFormat,
    pub source: SourceTemplate,
    /// `routing.text_payload`.
    pub text_payload: TextPayload,
    /// `routing.standard_headers`: `type`, `aggregateType` and
    /// `aggregateId` besides `id`.
    pub standard_headers: bool,
    /// `routing.tombstone_on_empty_payload`.
    pub tombstones: bool,
    /// `[[columns.additional]]`, resolved.
    pub placements: Vec<PlacedColumn>,
    /// `routing.key_format = "connect-json"`.
    pub connect_key: bool,
    /// `routing.connect_schemas`.
    pub connect_schemas: bool,
    /// `routing.connect_key_schemas`.
    pub connect_key_schemas: bool,
    /// The `connect-json` struct's name before the route value:
    /// `<connect_topic_prefix>.<schema>.<table>`.
    pub connect_struct_prefix: String,
}

impl RecordValue {
    pub fn new(format: ValueFormat, source: SourceTemplate) -> Self {
        RecordValue {
            format,
            source,
            text_payload: TextPayload::Auto,
            standard_headers: true,
            tombstones: false,
            placements: Vec::new(),
            connect_key: false,
            connect_schemas: true,
            connect_key_schemas: true,
            connect_struct_prefix: "outboxd.public.outbox".into(),
        }
    }

    /// `format`, with the default CloudEvents source and every other
    /// setting at its default.
    pub fn of(format: ValueFormat) -> Self {
        let source = SourceTemplate::parse(DEFAULT_SOURCE);
        RecordValue::new(
            format,
            source.unwrap_or_else(|e| unreachable!("the default source parses: {e}")),
        )
    }
}

/// `routing.text_payload`: what a `text` or `varchar` payload is where a
/// value embeds the payload as JSON (the envelope, structured CloudEvents,
/// the registry formats, dead letters). Under `value = "payload"` and in
/// CloudEvents' binary mode the text's bytes go as they are, whatever this
/// says.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum TextPayload {
    /// The text itself when it is one JSON value; otherwise a JSON string
    /// holding it.
    #[default]
    Auto,
    /// Always a JSON string holding the text.
    String,
    /// The text must be JSON; a row whose text is not follows
    /// `routing.on_poison` (`bad_payload`).
    Json,
}

/// `[routing.park]`: how much may be parked before outboxd stops.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ParkLimits {
    /// Parked sequences (aggregates), at most.
    #[serde(default = "default_sequences")]
    pub max_sequences: u64,
    /// Parked events, at most.
    #[serde(default = "default_events")]
    pub max_events: u64,
    /// Bytes of parked payloads, headers and columns, at most.
    #[serde(default = "default_bytes")]
    pub max_bytes: u64,
}

fn default_sequences() -> u64 {
    10_000
}

fn default_events() -> u64 {
    1_000_000
}

fn default_bytes() -> u64 {
    1 << 30
}

impl Default for ParkLimits {
    fn default() -> Self {
        ParkLimits {
            max_sequences: default_sequences(),
            max_events: default_events(),
            max_bytes: default_bytes(),
        }
    }
}

//! The TOML configuration file.
//!
//! Every key is documented in `config/outboxd.toml`. Loading goes:
//!
//! 1. read the file and parse it as TOML;
//! 2. in every string value, replace `${VAR}` and `${VAR:-default}` from
//!    the environment (`$$` writes a literal `$`); an unset variable without
//!    a default is an error naming the key. Replacing *after* parsing means
//!    a secret holding `"`, `\` or a newline can never break the TOML, and
//!    no parse error can quote it;
//! 3. deserialize with `deny_unknown_fields`, so a misspelt key fails;
//! 4. [`Config::validate`] checks values that types cannot (URLs, names,
//!    templates, ranges).
//!
//! Every error names the key by its dotted path (`kafka.max_inflight`) and
//! says what is wrong.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Deserializer};

pub mod columns;
pub mod conninfo;
pub mod coordination;
pub mod ident;
pub mod kafka;
pub mod ops;
pub mod polling;
pub mod postgres;
pub mod registry;
pub mod routing;
pub mod sources;

pub use coordination::CoordinationConfig;
pub use kafka::{Delivery, ExactlyOnceConfig, KafkaConfig};
pub use ops::{HealthConfig, HttpConfig, LogConfig, LogFormat, OtelConfig, ShutdownConfig, Thresholds};
pub use polling::{Mode, PollingConfig};
pub use postgres::PostgresConfig;
pub use registry::{SchemaRegistryConfig, SchemaRouting, SchemaRule, SchemaSource, SubjectStrategy};
pub use routing::{CloudEventsData, KeyFormat, OnPoison, ParkLimits, RoutingConfig, ValueFormat};

use crate::config::conninfo::PgConnectConfig;
use crate::config::ident::{PublicationName, SlotName, TableName};
use routing::{RecordValue, SourceTemplate, TopicTemplate};

/// The configuration could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("config key {path}: environment variable {var} is not set; set it or write ${{{var}:-default}}")]
    MissingEnv { var: String, path: String },
    #[error("config key {path}: unterminated ${{")]
    Unterminated { path: String },
    #[error("config key {path}: {reason}")]
    Invalid { path: String, reason: String },
    #[error("config: {0}")]
    Syntax(String),
    #[error("the config file has {} sources ({}); name one with --source", .0.len(), .0.join(", "))]
    WhichSource(Vec<String>),
    #[error("the config file has no source {name:?}; it has {}", .known.join(", "))]
    NoSuchSource { name: String, known: Vec<String> },
}

/// The source `name` of `all`, or with `None` the only one.
fn pick(all: Vec<sources::SourceConfig>, name: Option<&str>) -> Result<(Config, Validated), ConfigError> {
    let names = || all.iter().map(|s| s.name.clone()).collect::<Vec<_>>();
    let found = match name {
        None if all.len() == 1 => all.first(),
        None => return Err(ConfigError::WhichSource(names())),
        Some(n) => all.iter().find(|s| s.name == n),
    };
    match found {
        Some(s) => Ok((s.config.clone(), s.validated.clone())),
        None => Err(ConfigError::NoSuchSource {
            name: name.unwrap_or_default().to_owned(),
            known: names(),
        }),
    }
}

fn invalid(path: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        path: path.to_owned(),
        reason: reason.into(),
    }
}

/// The members a value of `format` writes itself, which an envelope
/// placement may not be named.
fn envelope_members(format: ValueFormat) -> &'static [&'static str] {
    match format {
        ValueFormat::ConnectJson => &["payload"],
        _ => &[
            "eventId",
            "type",
            "occurredAt",
            "aggregateType",
            "aggregateId",
            "data",
            "dataBase64",
        ],
    }
}

/// A fixed topic name (not a template) that Kafka accepts.
fn topic_allowed(topic: &str, path: &str) -> Result<(), ConfigError> {
    match routing::topic_name_problem(topic) {
        Some(reason) => Err(invalid(
            path,
            format!("topic name {topic:?} is illegal: {reason}"),
        )),
        None => Ok(()),
    }
}

/// A duration written with a unit: `500ms`, `10s`, `2m`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HumanDuration(pub Duration);

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_duration(&s).map(HumanDuration).map_err(|e| {
            serde::de::Error::custom(format!(
                "{s:?} is not a duration such as \"500ms\" or \"10s\": {e}"
            ))
        })
    }
}

pub(crate) fn secs(n: u64) -> HumanDuration {
    HumanDuration(Duration::from_secs(n))
}

/// The whole file.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// `cdc` (default) or `polling`.
    #[serde(default)]
    pub mode: Mode,
    /// Polling mode settings.
    #[serde(default)]
    pub polling: PollingConfig,
    /// Where the outbox lives.
    pub postgres: PostgresConfig,
    /// Which column of the outbox table plays which role.
    #[serde(default)]
    pub columns: columns::ColumnsConfig,
    /// Where events go.
    pub kafka: KafkaConfig,
    /// How rows become Kafka records.
    #[serde(default)]
    pub routing: RoutingConfig,
    /// Metrics and health endpoints.
    #[serde(default)]
    pub http: HttpConfig,
    /// What liveness and readiness mean.
    #[serde(default)]
    pub health: HealthConfig,
    /// Stopping.
    #[serde(default)]
    pub shutdown: ShutdownConfig,
    /// Logs.
    #[serde(default)]
    pub log: LogConfig,
    /// OpenTelemetry spans of published events (off by default).
    #[serde(default)]
    pub opentelemetry: OtelConfig,
    /// The Schema Registry of `routing.value` = `avro`, `protobuf` or
    /// `json-schema`.
    #[serde(default)]
    pub schema_registry: Option<SchemaRegistryConfig>,
    /// Several replicas sharing the file's sources through a Kafka
    /// consumer group (off by default: every replica tries every source).
    #[serde(default)]
    pub coordination: Option<CoordinationConfig>,
}

/// A value that is never printed: `Debug` shows `***`, and a value of the
/// wrong type is refused without quoting it (serde's own message would).
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(pub String);

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        match toml::Value::deserialize(d) {
            Ok(toml::Value::String(s)) => Ok(Secret(s)),
            _ => Err(serde::de::Error::custom(
                "a secret must be a string (quote it); its value is not shown",
            )),
        }
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

pub(crate) fn yes() -> bool {
    true
}

/// Values checked and converted once, at start.
#[derive(Clone, Debug)]
pub struct Validated {
    pub pg: PgConnectConfig,
    pub table: TableName,
    pub slot: SlotName,
    pub publication: PublicationName,
    /// Which column plays which role, and the additional columns read.
    pub columns: columns::ColumnMap,
    pub topic: TopicTemplate,
    /// How record values are built (`routing.value`, and the CloudEvents
    /// source).
    pub value: RecordValue,
    pub listen: SocketAddr,
    /// The producer's `transactional.id` when delivery is exactly-once.
    pub transactional_id: Option<String>,
    /// The file the configuration was read from, for the commands outboxd
    /// prints (`None` when it came from text).
    pub source: Option<std::path::PathBuf>,
    /// The source's name in a file of `[[sources]]` (`None` for a file of
    /// one source), for the commands outboxd prints.
    pub source_name: Option<String>,
}

impl Validated {
    /// `--config <file> [--source <name>]`, for the commands outboxd
    /// prints.
    pub fn config_args(&self) -> String {
        use crate::shell::shell_word;
        let file = self.source.as_ref().map_or("<config file>".to_owned(), |p| {
            shell_word(&p.display().to_string())
        });
        match &self.source_name {
            Some(name) => format!("--config {file} --source {name}"),
            None => format!("--config {file}"),
        }
    }
}

/// Replaces `${VAR}` and `${VAR:-default}` in one string value (at the
/// dotted key `path`, for errors); `$$` is a literal `$`.
pub fn interpolate(
    text: &str,
    path: &str,
    env: &impl Fn(&str) -> Option<String>,
) -> Result<String, ConfigError> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(pos) = rest.find('$') {
        out.push_str(&rest[..pos]);
        let after = &rest[pos + 1..];
        if let Some(stripped) = after.strip_prefix('$') {
            out.push('$');
            rest = stripped;
        } else if let Some(body) = after.strip_prefix('{') {
            let end = body.find('}').ok_or_else(|| ConfigError::Unterminated {
                path: path.to_owned(),
            })?;
            let expr = &body[..end];
            let (var, default) = match expr.split_once(":-") {
                Some((v, d)) => (v, Some(d)),
                None => (expr, None),
            };
            match (env(var).filter(|v| !v.is_empty() || default.is_none()), default) {
                (Some(v), _) => out.push_str(&v),
                (None, Some(d)) => out.push_str(d),
                (None, None) => {
                    return Err(ConfigError::MissingEnv {
                        var: var.to_owned(),
                        path: path.to_owned(),
                    })
                }
            }
            rest = &body[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    Ok(out)
}

/// Interpolates every string in a parsed TOML value, in place.
fn interpolate_value(
    value: &mut toml::Value,
    path: &str,
    env: &impl Fn(&str) -> Option<String>,
) -> Result<(), ConfigError> {
    match value {
        toml::Value::String(s) => *s = interpolate(s, path, env)?,
        toml::Value::Array(items) => {
            for (i, v) in items.iter_mut().enumerate() {
                interpolate_value(v, &format!("{path}[{i}]"), env)?;
            }
        }
        toml::Value::Table(t) => {
            for (k, v) in t.iter_mut() {
                let child = if path.is_empty() {
                    k.clone()
                } else {
                    format!("{path}.{k}")
                };
                interpolate_value(v, &child, env)?;
            }
        }
        _ => {}
    }
    Ok(())
}

impl Config {
    /// Reads, interpolates, parses and validates a config file of one
    /// source (see [`Config::load_source`] for a file of several).
    pub fn load(path: &Path) -> Result<(Config, Validated), ConfigError> {
        Self::load_source(path, None)
    }

    /// Every source of a config file (one, `default`, for a file without
    /// `[[sources]]`).
    pub fn load_sources(path: &Path) -> Result<Vec<sources::SourceConfig>, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let mut all = sources::from_toml(&text, |v| std::env::var(v).ok())?;
        for s in &mut all {
            s.validated.source = Some(path.to_owned());
        }
        Ok(all)
    }

    /// The source `name` of a config file; with `None`, its only source.
    pub fn load_source(path: &Path, name: Option<&str>) -> Result<(Config, Validated), ConfigError> {
        let all = Self::load_sources(path)?;
        pick(all, name)
    }

    /// Parses and validates config text of one source with the given
    /// environment.
    pub fn from_toml(
        text: &str,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<(Config, Validated), ConfigError> {
        pick(sources::from_toml(text, env)?, None)
    }

    /// Deserializes and validates one source's table (already
    /// interpolated and merged with the shared sections).
    pub(crate) fn from_table(table: toml::Table) -> Result<(Config, Validated), ConfigError> {
        let config: Config = serde_path_to_error::deserialize(toml::Value::Table(table)).map_err(|e| {
            let path = e.path().to_string();
            let reason = e.into_inner().message().to_owned();
            if path == "." || path.is_empty() {
                ConfigError::Syntax(reason)
            } else {
                invalid(&path, reason)
            }
        })?;
        let validated = config.validate()?;
        Ok((config, validated))
    }

    /// Checks what the types cannot.
    pub fn validate(&self) -> Result<Validated, ConfigError> {
        let mut pg: PgConnectConfig = self
            .postgres
            .url
            .parse()
            .map_err(|e: crate::config::conninfo::ConnInfoError| invalid("postgres.url", e.to_string()))?;
        if let Some(password) = &self.postgres.password {
            if pg.password.is_some() {
                return Err(invalid(
                    "postgres.password",
                    "the url has a password too; keep one of them",
                ));
            }
            pg.password = Some(password.0.clone());
        }
        let table =
            TableName::new(&self.postgres.table).map_err(|e| invalid("postgres.table", e.to_string()))?;
        let slot = SlotName::new(&self.postgres.slot).map_err(|e| invalid("postgres.slot", e.to_string()))?;
        let publication = PublicationName::new(&self.postgres.publication)
            .map_err(|e| invalid("postgres.publication", e.to_string()))?;
        if self.postgres.status_interval.0 < Duration::from_millis(10) {
            return Err(invalid("postgres.status_interval", "must be at least 10ms"));
        }
        if self.postgres.leader_timeout.0 < Duration::from_secs(2) {
            return Err(invalid(
                "postgres.leader_timeout",
                "must be at least 2s: the leader renews the lease every quarter of it",
            ));
        }
        if let Some(c) = &self.coordination {
            c.check().map_err(|(key, reason)| invalid(key, reason))?;
        }
        if self.kafka.brokers.trim().is_empty() {
            return Err(invalid("kafka.brokers", "must list at least one host:port"));
        }
        if self.polling.batch_size == 0 {
            return Err(invalid("polling.batch_size", "must be at least 1"));
        }
        if self.kafka.max_inflight == Some(0) {
            return Err(invalid("kafka.max_inflight", "must be at least 1"));
        }
        if self.kafka.max_inflight_bytes == Some(0) {
            return Err(invalid("kafka.max_inflight_bytes", "must be at least 1"));
        }
        if self.kafka.topic_partitions < 1 {
            return Err(invalid("kafka.topic_partitions", "must be at least 1"));
        }
        if self.kafka.topic_replication_factor == 0 || self.kafka.topic_replication_factor < -1 {
            return Err(invalid(
                "kafka.topic_replication_factor",
                "must be -1 (broker default) or at least 1",
            ));
        }
        if self.kafka.options.contains_key("bootstrap.servers") {
            return Err(invalid(
                "kafka.options.bootstrap.servers",
                "set kafka.brokers instead",
            ));
        }
        if self
            .kafka
            .options
            .get("enable.idempotence")
            .is_some_and(|v| v != "true")
        {
            return Err(invalid(
                "kafka.options.enable.idempotence",
                "must stay true: without it retries can reorder an aggregate's events",
            ));
        }
        self.validate_delivery()?;
        if self.health.poll_interval.0 < Duration::from_millis(100) {
            return Err(invalid("health.poll_interval", "must be at least 100ms"));
        }
        if self.health.status_max_age.0 <= self.postgres.status_interval.0 {
            return Err(invalid(
                "health.status_max_age",
                "must be longer than postgres.status_interval, or outboxd is never ready",
            ));
        }
        let mut columns = columns::ColumnMap::new(&self.columns).map_err(|(path, e)| invalid(&path, e))?;
        let regex = self
            .routing
            .topic_regex
            .as_deref()
            .map(routing::TopicRegex::parse)
            .transpose()
            .map_err(|e| invalid("routing.topic_regex", e))?;
        let mut topic = TopicTemplate::parse(
            &self.routing.topic,
            self.routing.lowercase_aggregate_type,
            &mut columns,
            regex,
        )
        .map_err(|e| invalid("routing.topic", e))?;
        self.validate_columns(&mut columns)?;
        if let Some(allowed) = &self.routing.allowed_aggregate_types {
            columns.need(columns::Role::Route).map_err(|e| {
                invalid(
                    "routing.allowed_aggregate_types",
                    format!("is matched against the route column, but {e}"),
                )
            })?;
            if allowed.is_empty() || allowed.iter().any(|a| a.is_empty() || a == "*") {
                return Err(invalid(
                    "routing.allowed_aggregate_types",
                    "list the aggregate types (or prefixes ending in *); leave it out to allow any",
                ));
            }
            topic = topic.allowing(allowed.clone());
        }
        self.opentelemetry
            .validate()
            .map_err(|e| invalid("opentelemetry.endpoint", e))?;
        if self.postgres.messages != postgres::Messages::Off && self.postgres.message_prefix.is_empty() {
            return Err(invalid(
                "postgres.message_prefix",
                "must not be empty: every logical decoding message would be read as an outbox event",
            ));
        }
        topic_allowed(&self.routing.dead_letter_topic, "routing.dead_letter_topic")?;
        let source = SourceTemplate::parse(&self.routing.cloudevents_source)
            .map_err(|e| invalid("routing.cloudevents_source", e))?;
        let mut value = RecordValue::new(self.routing.value, source);
        value.text_payload = self.routing.text_payload;
        value.standard_headers = self.routing.standard_headers;
        value.tombstones = self.routing.tombstone_on_empty_payload;
        value.placements = columns.placements.clone();
        value.connect_key = self.routing.key_format == KeyFormat::ConnectJson;
        value.connect_schemas = self.routing.connect_schemas;
        value.connect_key_schemas = self.routing.connect_key_schemas;
        value.connect_struct_prefix = format!(
            "{}.{}.{}",
            self.routing.connect_topic_prefix, table.schema, table.name
        );
        self.validate_schemas()?;
        let listen: SocketAddr = self.http.listen.parse().map_err(|_| {
            invalid(
                "http.listen",
                format!("{:?} is not an address such as 0.0.0.0:9187", self.http.listen),
            )
        })?;
        if let Some(token) = &self.http.admin_token {
            if token.0.len() < 16 || token.0.chars().any(char::is_whitespace) {
                return Err(invalid(
                    "http.admin_token",
                    "must be at least 16 characters without spaces (for example `openssl rand -hex 24`)",
                ));
            }
        }
        let transactional_id = match self.kafka.delivery {
            Delivery::AtLeastOnce => None,
            Delivery::ExactlyOnce => Some(
                self.kafka
                    .exactly_once
                    .transactional_id
                    .clone()
                    .unwrap_or_else(|| format!("outboxd.{}", slot.as_str())),
            ),
        };
        Ok(Validated {
            pg,
            table,
            slot,
            publication,
            columns,
            topic,
            listen,
            transactional_id,
            value,
            source: None,
            source_name: None,
        })
    }

    /// What the column map needs of the other settings: CloudEvents need
    /// a type column; envelope placements an envelope; header placements
    /// names outboxd does not set itself.
    fn validate_columns(&self, columns: &mut columns::ColumnMap) -> Result<(), ConfigError> {
        use columns::Placement;
        if matches!(
            self.routing.value,
            ValueFormat::CloudEvents | ValueFormat::CloudEventsBinary
        ) {
            columns.need(columns::Role::Type).map_err(|e| {
                invalid(
                    "routing.value",
                    format!("a CloudEvent needs a type, from the type column, but {e}"),
                )
            })?;
        }
        let mut reserved = vec![crate::config::routing::ID_HEADER];
        if self.routing.standard_headers {
            reserved.extend(crate::config::routing::STANDARD_HEADERS);
        }
        for (i, p) in columns.placements.iter().enumerate() {
            let key = format!("columns.additional[{i}]");
            match p.placement {
                Placement::Header if reserved.contains(&p.name.as_str()) => {
                    return Err(invalid(
                        &format!("{key}.name"),
                        format!(
                            "outboxd sets the {:?} header itself; name the placement otherwise{}",
                            p.name,
                            if self.routing.standard_headers && p.name != crate::config::routing::ID_HEADER {
                                " (or set routing.standard_headers = false)"
                            } else {
                                ""
                            }
                        ),
                    ))
                }
                Placement::Envelope
                    if !matches!(self.routing.value, ValueFormat::Envelope | ValueFormat::ConnectJson) =>
                {
                    return Err(invalid(
                        &format!("{key}.placement"),
                        "an envelope placement needs routing.value = \"envelope\" or \"connect-json\"; place the column as a header",
                    ))
                }
                // A member of the value's own would be written twice, and
                // most readers keep the last: the payload would be lost.
                Placement::Envelope if envelope_members(self.routing.value).contains(&p.name.as_str()) => {
                    return Err(invalid(
                        &format!("{key}.name"),
                        format!(
                            "{:?} is a member of the value itself ({}); name the placement otherwise",
                            p.name,
                            envelope_members(self.routing.value).join(", ")
                        ),
                    ))
                }
                _ => {}
            }
        }
        if self.mode == Mode::Polling {
            columns::ColumnName::new(&self.polling.published_column)
                .map_err(|e| invalid("polling.published_column", e))?;
            columns.need(columns::Role::Timestamp).map_err(|e| {
                invalid(
                    "columns.timestamp",
                    format!("polling mode publishes rows in timestamp order, but {e}"),
                )
            })?;
        }
        Ok(())
    }

    /// The format the Schema Registry encodes: `routing.value`, or with
    /// CloudEvents in binary mode `routing.cloudevents_data`.
    pub fn registry_format(&self) -> ValueFormat {
        match (self.routing.value, self.routing.cloudevents_data) {
            (ValueFormat::CloudEventsBinary, CloudEventsData::Avro) => ValueFormat::Avro,
            (ValueFormat::CloudEventsBinary, CloudEventsData::Protobuf) => ValueFormat::Protobuf,
            (ValueFormat::CloudEventsBinary, CloudEventsData::JsonSchema) => ValueFormat::JsonSchema,
            (format, _) => format,
        }
    }

    /// `[schema_registry]` and the schema settings of `[routing]`.
    fn validate_schemas(&self) -> Result<(), ConfigError> {
        if self.routing.cloudevents_data != CloudEventsData::Json
            && self.routing.value != ValueFormat::CloudEventsBinary
        {
            return Err(invalid(
                "routing.cloudevents_data",
                "applies to routing.value = \"cloudevents-binary\" only",
            ));
        }
        let format = self.registry_format();
        let Some(registry) = &self.schema_registry else {
            if format.uses_registry() {
                return Err(invalid(
                    "schema_registry.url",
                    "routing.value needs a Schema Registry: add [schema_registry] with its url",
                ));
            }
            if self.routing.key_format.uses_registry() {
                return Err(invalid(
                    "schema_registry.url",
                    "routing.key_format needs a Schema Registry: add [schema_registry] with its url",
                ));
            }
            return Ok(());
        };
        match url::Url::parse(&registry.url) {
            Ok(u) if matches!(u.scheme(), "http" | "https") && u.host().is_some() => {
                if !u.username().is_empty()
                    || u.password().is_some()
                    || u.query().is_some()
                    || u.fragment().is_some()
                {
                    return Err(invalid(
                        "schema_registry.url",
                        "must hold no credentials, query or fragment (it is shown in errors and in ce_dataschema); use schema_registry.username and password, or token",
                    ));
                }
            }
            _ => {
                return Err(invalid(
                    "schema_registry.url",
                    "must be an http:// or https:// URL such as http://registry:8081",
                ))
            }
        }
        match (&registry.username, &registry.password, &registry.token) {
            (Some(_), None, _) | (None, Some(_), _) => {
                return Err(invalid(
                    "schema_registry.password",
                    "basic authentication needs both username and password",
                ))
            }
            (Some(_), Some(_), Some(_)) => {
                return Err(invalid(
                    "schema_registry.token",
                    "set a token or a username and password, not both",
                ))
            }
            _ => {}
        }
        if registry.timeout.0 < Duration::from_millis(100) {
            return Err(invalid("schema_registry.timeout", "must be at least 100ms"));
        }
        if registry.refresh_interval.0 < Duration::from_secs(1) {
            return Err(invalid("schema_registry.refresh_interval", "must be at least 1s"));
        }
        if let Some(ca) = &registry.ca_file {
            if !Path::new(ca).is_file() {
                return Err(invalid(
                    "schema_registry.ca_file",
                    format!("{ca:?} is not a readable file"),
                ));
            }
        }
        let inferred_ok = format == ValueFormat::Avro;
        if self.routing.schema == SchemaSource::Inferred && !inferred_ok {
            return Err(invalid(
                "routing.schema",
                "inferred schemas are made for routing.value = \"avro\" only",
            ));
        }
        for (key, rule) in &self.routing.schemas {
            let at = |field: &str| format!("routing.schemas.{key}.{field}");
            if rule.version.is_some() && rule.id.is_some() {
                return Err(invalid(&at("id"), "pin a version or an id, not both"));
            }
            if rule.version == Some(0) {
                return Err(invalid(&at("version"), "versions start at 1"));
            }
            if rule.schema.unwrap_or(self.routing.schema) == SchemaSource::Inferred {
                if !inferred_ok {
                    return Err(invalid(
                        &at("schema"),
                        "inferred schemas are made for routing.value = \"avro\" only",
                    ));
                }
                if rule.version.is_some() || rule.id.is_some() {
                    return Err(invalid(
                        &at("schema"),
                        "an inferred schema is registered by outboxd: it takes no version or id",
                    ));
                }
            }
            if rule.subject.as_deref().is_some_and(str::is_empty)
                || rule.record.as_deref().is_some_and(str::is_empty)
            {
                return Err(invalid(&at("subject"), "must not be empty"));
            }
        }
        Ok(())
    }

    /// The schema settings of `[routing]`, for the registry.
    pub fn schema_routing(&self) -> SchemaRouting {
        SchemaRouting {
            strategy: self.routing.subject_strategy,
            source: self.routing.schema,
            rules: self.routing.schemas.clone(),
        }
    }

    /// The delivery mode's own rules.
    fn validate_delivery(&self) -> Result<(), ConfigError> {
        let options = &self.kafka.options;
        if let (Some(new), Some(old)) = (
            &self.kafka.progress_topic,
            &self.kafka.exactly_once.progress_topic,
        ) {
            if new != old {
                return Err(invalid(
                    "kafka.progress_topic",
                    "differs from kafka.exactly_once.progress_topic (its older spelling): keep one",
                ));
            }
        }
        let progress_topic = self.kafka.progress_topic();
        topic_allowed(progress_topic, "kafka.progress_topic")?;
        if progress_topic == self.routing.dead_letter_topic {
            return Err(invalid(
                "kafka.progress_topic",
                "must differ from routing.dead_letter_topic",
            ));
        }
        if options.contains_key("transactional.id") {
            return Err(invalid(
                "kafka.options.transactional.id",
                "set kafka.delivery = \"exactly-once\" (and, to choose the id, kafka.exactly_once.transactional_id) instead",
            ));
        }
        if self.routing.on_poison == OnPoison::Park {
            if self.mode == Mode::Polling {
                return Err(invalid(
                    "routing.on_poison",
                    "\"park\" needs mode = \"cdc\": the polling relay publishes rows in created_at order and marks them, so use \"stop\" or \"dead-letter\" there",
                ));
            }
            let park = &self.routing.park;
            for (key, v) in [
                ("routing.park.max_sequences", park.max_sequences),
                ("routing.park.max_events", park.max_events),
                ("routing.park.max_bytes", park.max_bytes),
            ] {
                if v == 0 {
                    return Err(invalid(key, "must be at least 1"));
                }
            }
        }
        if self.kafka.delivery == Delivery::AtLeastOnce {
            return Ok(());
        }
        let eo = &self.kafka.exactly_once;
        if self.mode == Mode::Polling {
            return Err(invalid(
                "kafka.delivery",
                "exactly-once needs mode = \"cdc\": the polling relay marks rows in PostgreSQL, not in Kafka's transaction",
            ));
        }
        if eo
            .transactional_id
            .as_deref()
            .is_some_and(|id| id.trim().is_empty())
        {
            return Err(invalid(
                "kafka.exactly_once.transactional_id",
                "must not be empty; leave it out for outboxd.<slot>",
            ));
        }
        if eo.max_events == 0 {
            return Err(invalid("kafka.exactly_once.max_events", "must be at least 1"));
        }
        if eo.max_bytes == 0 {
            return Err(invalid("kafka.exactly_once.max_bytes", "must be at least 1"));
        }
        if eo.commit_timeout.0 < Duration::from_secs(1) {
            return Err(invalid(
                "kafka.exactly_once.commit_timeout",
                "must be at least 1s",
            ));
        }
        // The broker aborts a transaction left open longer than
        // transaction.timeout.ms; a commit must be tried well before that.
        if let Some(t) = options.get("transaction.timeout.ms") {
            let ms: u64 = t.parse().map_err(|_| {
                invalid(
                    "kafka.options.transaction.timeout.ms",
                    "must be a number of milliseconds",
                )
            })?;
            if Duration::from_millis(ms) <= eo.commit_timeout.0 + eo.max_wait.0 {
                return Err(invalid(
                    "kafka.options.transaction.timeout.ms",
                    "must be longer than kafka.exactly_once.commit_timeout plus max_wait",
                ));
            }
        }
        let txn_timeout = self.kafka.transaction_timeout();
        if options
            .get("message.timeout.ms")
            .and_then(|t| t.parse::<u64>().ok())
            .is_some_and(|m| Duration::from_millis(m) > txn_timeout)
        {
            return Err(invalid(
                "kafka.options.message.timeout.ms",
                "must not exceed transaction.timeout.ms (default 60000) with exactly-once delivery",
            ));
        }
        if options.get("acks").is_some_and(|a| a != "all" && a != "-1") {
            return Err(invalid(
                "kafka.options.acks",
                "must be all with exactly-once delivery (Kafka transactions require it)",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: Vec<(String, String)> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    }

    const MINIMAL: &str = "[postgres]\nurl = \"postgres://u@h/db\"\n[kafka]\nbrokers = \"k:9092\"\n";

    #[test]
    fn interpolation() {
        let e = env(&[("A", "x"), ("EMPTY", "")]);
        let i = |t: &str| interpolate(t, "k", &e);
        assert_eq!(i("${A}-${B:-d}-$$-$x").unwrap(), "x-d-$-$x");
        assert_eq!(i("${EMPTY:-fallback}").unwrap(), "fallback");
        assert_eq!(i("${EMPTY}").unwrap(), "");
        let err = interpolate("a${MISSING}", "postgres.url", &e)
            .unwrap_err()
            .to_string();
        assert!(err.contains("MISSING") && err.contains("postgres.url"), "{err}");
        assert!(i("${A").is_err());
        // Comments are gone after parsing: an unset variable there is fine.
        let text = format!("# ${{UNSET}} in a comment\n{MINIMAL}");
        assert!(Config::from_toml(&text, env(&[])).is_ok());
    }

    /// Secrets that break each parser on the way (TOML, the URL, librdkafka)
    /// work where they may, and no error ever quotes them.
    #[test]
    fn no_error_echoes_a_secret() {
        let secrets = [
            "pa\"ss",
            "back\\slash",
            "new\nline",
            "p@ss/w?rd#1",
            "%zz%",
            "tab\tand ]] [[ ''' \"\"\"",
            "${NESTED}",
        ];
        for secret in secrets {
            let e = env(&[("PGPASSWORD", secret), ("KAFKA_PASSWORD", secret)]);
            // In postgres.password: any characters work.
            let text = "[postgres]\nurl = \"postgres://u@h/db\"\npassword = \"${PGPASSWORD}\"\n[kafka]\nbrokers = \"k:9092\"\n";
            let (_, v) = Config::from_toml(text, &e).unwrap_or_else(|err| panic!("{secret:?}: {err}"));
            assert_eq!(v.pg.password.as_deref(), Some(secret));
            // In the URL, unencoded: may fail, but never quotes it.
            let text =
                "[postgres]\nurl = \"postgres://u:${PGPASSWORD}@h/db\"\n[kafka]\nbrokers = \"k:9092\"\n";
            if let Err(err) = Config::from_toml(text, &e) {
                assert!(!err.to_string().contains(secret), "{secret:?} in {err}");
            }
            // (Bad values for librdkafka properties: kafka::sink's tests.)
            // A TOML syntax error elsewhere in the file quotes the file,
            // which holds ${VAR}, never the value.
            let text = "[postgres]\nurl = \"postgres://u:${PGPASSWORD}@h/db\"\nbad = = 1\n";
            let err = Config::from_toml(text, &e).unwrap_err().to_string();
            assert!(!err.contains(secret), "{secret:?} in {err}");
        }
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let (c, v) = Config::from_toml(MINIMAL, env(&[])).unwrap();
        assert_eq!(c.postgres.table, "public.outbox");
        assert_eq!(v.slot.as_str(), "outboxd");
        assert_eq!(c.routing.value, ValueFormat::Envelope);
        assert_eq!(c.kafka.max_inflight, None);
        assert_eq!(c.kafka.max_inflight_bytes, None);
        assert_eq!(c.kafka.inflight_budget(3), (5_000, 4 << 20));
        assert_eq!(c.kafka.inflight_budget(150), (18_000, 7_372_800));
        assert_eq!(c.kafka.inflight_budget(10_000), (20_000, 16 << 20));
        assert_eq!(c.shutdown.drain_timeout.0, Duration::from_secs(30));
        assert_eq!(v.listen.port(), 9187);
    }

    #[test]
    fn progress_topic_takes_either_spelling_but_not_two_different_ones() {
        let parse = |extra: &str| Config::from_toml(&format!("{MINIMAL}{extra}"), env(&[]));
        let (c, _) = parse("").unwrap();
        assert_eq!(c.kafka.progress_topic(), "outboxd.progress");
        assert!(c.kafka.keeps_slot_register());
        let (c, _) = parse("progress_topic = \"p.new\"\n").unwrap();
        assert_eq!(c.kafka.progress_topic(), "p.new");
        let (c, _) = parse("[kafka.exactly_once]\nprogress_topic = \"p.old\"\n").unwrap();
        assert_eq!(c.kafka.progress_topic(), "p.old");
        let e = parse("progress_topic = \"p.new\"\n[kafka.exactly_once]\nprogress_topic = \"p.old\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("kafka.progress_topic") && e.contains("older spelling"),
            "{e}"
        );
        let e = parse("progress_topic = \"bad topic\"\n").unwrap_err().to_string();
        assert!(e.contains("kafka.progress_topic"), "{e}");
        // Exactly-once keeps the register whatever slot_register says.
        let (c, _) = parse("slot_register = false\n").unwrap();
        assert!(!c.kafka.keeps_slot_register());
        let (c, _) = parse("slot_register = false\ndelivery = \"exactly-once\"\n").unwrap();
        assert!(c.kafka.keeps_slot_register());
    }

    #[test]
    fn unknown_keys_and_bad_values_name_the_field() {
        let err = |extra: &str| {
            Config::from_toml(&format!("{MINIMAL}{extra}"), env(&[]))
                .unwrap_err()
                .to_string()
        };
        let e = err("[routing]\nvalu = \"payload\"\n");
        assert!(e.contains("routing") && e.contains("valu"), "{e}");
        let e = err("[routing]\nvalue = \"xml\"\n");
        assert!(e.contains("routing.value"), "{e}");
        let e = err("[shutdown]\ndrain_timeout = \"soon\"\n");
        assert!(
            e.contains("shutdown.drain_timeout") && e.contains("duration"),
            "{e}"
        );
        let e = Config::from_toml(
            &MINIMAL
                .replace("outbox", "x")
                .replace("[kafka]", "slot = \"Bad-Slot\"\n[kafka]"),
            env(&[]),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("postgres.slot"), "{e}");
        let e = Config::from_toml(&MINIMAL.replace("u@h", "u@h?sslmode=nope"), env(&[]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("postgres.url") && e.contains("sslmode"), "{e}");
        let e = err("[kafka.options]\n\"enable.idempotence\" = \"false\"\n");
        assert!(
            e.contains("duplicate key") || e.contains("enable.idempotence"),
            "{e}"
        );
        let e = err("[http]\nlisten = \"nowhere\"\n");
        assert!(e.contains("http.listen"), "{e}");
        let e = err("[routing]\ntopic = \"{$1}.events\"\n");
        assert!(e.contains("routing.topic"), "{e}");
    }

    #[test]
    fn columns_and_routing_agree_or_name_the_key() {
        use crate::config::columns::Role;
        let ok = |extra: &str| {
            Config::from_toml(&format!("{MINIMAL}{extra}"), env(&[]))
                .unwrap_or_else(|e| panic!("{extra}: {e}"))
        };
        let err = |extra: &str| {
            Config::from_toml(&format!("{MINIMAL}{extra}"), env(&[]))
                .unwrap_err()
                .to_string()
        };
        // A topic over any column reads it; the route column's own name is
        // {aggregate_type}.
        let (_, v) = ok(
            "[columns]\nroute = \"aggregatetype\"\n[routing]\ntopic = \"{tenant}.{aggregatetype}.events\"\n",
        );
        assert_eq!(v.columns.extra.len(), 1);
        assert!(v.columns.role(Role::Route).needed);
        // A regex's groups.
        let (_, v) = ok("[routing]\ntopic_regex = \"(?<kind>[a-z]+)-(.*)\"\ntopic = \"{$kind}.{$2}\"\n");
        assert!(v.topic.regex.is_some());
        for (extra, key) in [
            ("[routing]\ntopic_regex = \"(a\"\n", "routing.topic_regex"),
            ("[routing]\ntopic_regex = \"(a)\"\ntopic = \"{$2}\"\n", "routing.topic"),
            ("[routing]\ntopic_regex = \"(?=a)\"\n", "routing.topic_regex"),
            // No route column: the default topic needs one.
            ("[columns]\nroute = false\n", "routing.topic"),
            (
                "[columns]\nroute = false\n[routing]\ntopic = \"fixed\"\nallowed_aggregate_types = [\"A\"]\n",
                "routing.allowed_aggregate_types",
            ),
            ("[columns]\ntype = false\n[routing]\nvalue = \"cloudevents\"\n", "routing.value"),
            (
                "[columns]\nadditional = [{ column = \"t\", placement = \"header\", name = \"type\" }]\n",
                "columns.additional[0].name",
            ),
            (
                "[columns]\nadditional = [{ column = \"t\", placement = \"header\", name = \"id\" }]\n[routing]\nstandard_headers = false\n",
                "columns.additional[0].name",
            ),
            (
                "[columns]\nadditional = [{ column = \"t\", placement = \"envelope\" }]\n[routing]\nvalue = \"payload\"\n",
                "columns.additional[0].placement",
            ),
            (
                "[columns]\nadditional = [{ column = \"t\", placement = \"envelope\", name = \"data\" }]\n",
                "columns.additional[0].name",
            ),
            (
                "[columns]\nadditional = [{ column = \"t\", placement = \"envelope\", name = \"payload\" }]\n[routing]\nvalue = \"connect-json\"\n",
                "columns.additional[0].name",
            ),
            ("[columns]\nid = false\n", "columns.id"),
            ("[routing]\ntext_payload = \"yaml\"\n", "routing.text_payload"),
        ] {
            let e = err(extra);
            assert!(e.contains(key), "{extra}: {e}");
        }
        let polling = Config::from_toml(
            &format!("mode = \"polling\"\n{MINIMAL}[columns]\ntimestamp = false\n"),
            env(&[]),
        )
        .unwrap_err()
        .to_string();
        assert!(polling.contains("columns.timestamp"), "{polling}");
        // Without standard headers, `type` is a name a placement may take.
        ok("[columns]\nadditional = [{ column = \"t\", placement = \"header\", name = \"type\" }]\n[routing]\nstandard_headers = false\n");
        ok("[columns]\nadditional = [{ column = \"t\", placement = \"envelope\" }]\n[routing]\nvalue = \"connect-json\"\nkey_format = \"connect-json\"\n");
    }

    #[test]
    fn shipped_examples_parse() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
        for file in ["outboxd.toml", "minimal.toml"] {
            let text = std::fs::read_to_string(root.join(file)).unwrap();
            let e = env(&[("PGPASSWORD", "secret"), ("KAFKA_PASSWORD", "k")]);
            if let Err(err) = Config::from_toml(&text, e) {
                panic!("config/{file}: {err}");
            }
        }
    }

    #[test]
    fn no_debug_output_shows_a_secret() {
        let text = "[postgres]\nurl = \"postgres://app:url-secret%40x@db:5432/app\"\n\
                    [kafka]\nbrokers = \"k:9092\"\n[kafka.options]\n\"sasl.password\" = \"${KAFKA_PASSWORD}\"\n\
                    \"ssl.key.password\" = \"key-secret\"\n";
        let (config, validated) = Config::from_toml(text, env(&[("KAFKA_PASSWORD", "sasl-secret")])).unwrap();
        let shown = format!(
            "{config:?} {validated:?} {:?} {:?}",
            config.postgres, config.kafka
        );
        for secret in ["url-secret", "sasl-secret", "key-secret"] {
            assert!(!shown.contains(secret), "{secret} in {shown}");
        }
        assert!(
            shown.contains("sasl.password") && shown.contains("db:5432"),
            "{shown}"
        );
        let with_password = "[postgres]\nurl = \"postgres://app@db/app\"\npassword = \"pw-secret\"\n[kafka]\nbrokers = \"k:9092\"\n";
        let (config, validated) = Config::from_toml(with_password, |_| None).unwrap();
        assert!(!format!("{config:?} {validated:?}").contains("pw-secret"));
    }
}

//! `[schema_registry]` and the schema parts of `[routing]`: where schemas
//! come from when `routing.value` is `avro`, `protobuf` or `json-schema`.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::{secs, HumanDuration, Secret};

/// `[schema_registry]`: a registry that speaks the Confluent REST API
/// (Confluent Schema Registry, Apicurio's `/apis/ccompat/v7`, Karapace,
/// Redpanda).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchemaRegistryConfig {
    /// The API's base URL, such as `http://registry:8081` or
    /// `http://apicurio:8080/apis/ccompat/v7`.
    pub url: String,
    /// Basic authentication: the user (with `password`).
    #[serde(default)]
    pub username: Option<String>,
    /// Basic authentication: the password.
    #[serde(default)]
    pub password: Option<Secret>,
    /// A bearer token, instead of basic authentication.
    #[serde(default)]
    pub token: Option<Secret>,
    /// PEM file of the certificate authorities to trust for an `https`
    /// URL (unset: the system's).
    #[serde(default)]
    pub ca_file: Option<String>,
    /// The longest one request may take, connecting included.
    #[serde(default = "default_timeout")]
    pub timeout: HumanDuration,
    /// How long a `latest` version is trusted before it is looked up again
    /// (a failed look-up keeps the one in use).
    #[serde(default = "default_refresh")]
    pub refresh_interval: HumanDuration,
}

fn default_timeout() -> HumanDuration {
    secs(10)
}

fn default_refresh() -> HumanDuration {
    secs(300)
}

/// How the subject of a value's schema is named (Confluent's strategies).
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "kebab-case")]
pub enum SubjectStrategy {
    /// `<topic>-value` (`TopicNameStrategy`).
    #[default]
    Topic,
    /// The record's full name (`RecordNameStrategy`).
    Record,
    /// `<topic>-<record>` (`TopicRecordNameStrategy`).
    TopicRecord,
}

/// Where a value's schema comes from.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "kebab-case")]
pub enum SchemaSource {
    /// Looked up in the registry (latest, or a pinned version or id); the
    /// payload must fit it.
    #[default]
    Registered,
    /// Derived from each payload's shape as Debezium's
    /// `expand.json.payload` does, registered, and reused while the shape
    /// stays the same (Avro only).
    Inferred,
}

/// `[routing.schemas."<event type or topic>"]`: one event type's (or one
/// topic's) schema settings. An event type's entry wins over its topic's.
#[derive(Clone, Debug, Deserialize, Default, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SchemaRule {
    /// `registered` or `inferred` (default: `routing.schema`).
    #[serde(default)]
    pub schema: Option<SchemaSource>,
    /// The subject, instead of the one the strategy names.
    #[serde(default)]
    pub subject: Option<String>,
    /// The record (Avro), message (Protobuf) or title (JSON Schema) name
    /// the `record` and `topic-record` strategies use; default: the event
    /// type. For Protobuf, also which message of the schema to encode.
    #[serde(default)]
    pub record: Option<String>,
    /// A pinned version of the subject (default: the latest).
    #[serde(default)]
    pub version: Option<u32>,
    /// A pinned schema id, instead of a subject's version.
    #[serde(default)]
    pub id: Option<u32>,
}

/// The schema parts of `[routing]`, gathered for the registry.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SchemaRouting {
    pub strategy: SubjectStrategy,
    pub source: SchemaSource,
    pub rules: BTreeMap<String, SchemaRule>,
}

impl SchemaRouting {
    /// The rule for an event of `event_type` bound for `topic`.
    pub fn rule(&self, event_type: &str, topic: &str) -> Option<&SchemaRule> {
        self.rules.get(event_type).or_else(|| self.rules.get(topic))
    }
}

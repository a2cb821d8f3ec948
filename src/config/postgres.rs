//! `[postgres]`: where the outbox lives.

use serde::{Deserialize, Deserializer};

use super::{secs, yes, HumanDuration, Secret};

/// `[postgres]`
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PostgresConfig {
    /// libpq-style URL; the role needs REPLICATION.
    pub url: String,
    /// The password, when the URL has none: any characters, no URL
    /// encoding (for example `"${PGPASSWORD}"`).
    #[serde(default)]
    pub password: Option<Secret>,
    /// The outbox table, `schema.table`.
    #[serde(default = "default_table")]
    pub table: String,
    /// The logical replication slot.
    #[serde(default = "default_name")]
    pub slot: String,
    /// The publication.
    #[serde(default = "default_name")]
    pub publication: String,
    /// Create the publication when it is missing.
    #[serde(default = "yes")]
    pub create_publication: bool,
    /// PostgreSQL 17+: make the slot a failover slot, so that a standby
    /// with `sync_replication_slots = on` keeps a copy that outlives a
    /// promotion (see docs/failover.md). Ignored on older
    /// servers.
    #[serde(default = "yes")]
    pub failover_slot: bool,
    /// How often to report progress to the server.
    #[serde(default = "default_status_interval")]
    pub status_interval: HumanDuration,
    /// Longest wait between reconnection attempts.
    #[serde(default = "default_backoff_max")]
    pub reconnect_backoff_max: HumanDuration,
    /// The leader lease: PostgreSQL ends the leader lock's session when
    /// the leader has not renewed it for this long (stopped, or its host
    /// gone), and a hot standby takes over. The at-least-once producer's
    /// `message.timeout.ms` defaults to it, so that what a stopped leader
    /// had queued times out instead of reaching Kafka after a takeover.
    #[serde(default = "default_leader_timeout")]
    pub leader_timeout: HumanDuration,
    /// Also publish transactional logical decoding messages with
    /// `message_prefix` (the table-less outbox, `outbox_emit`; PostgreSQL
    /// 14+): `"auto"` (the default) when `outbox_emit` is installed, `true`
    /// or `false`. While they are read, outboxd refuses to start if PUBLIC
    /// may call `pg_logical_emit_message` (any role could forge an event);
    /// while they are not, if `outbox_emit` is installed (its events would
    /// be lost).
    #[serde(default, deserialize_with = "messages")]
    pub messages: Messages,
    /// The prefix of the messages that are outbox events.
    #[serde(default = "default_message_prefix")]
    pub message_prefix: String,
}

/// The default `postgres.message_prefix`.
pub const DEFAULT_MESSAGE_PREFIX: &str = "outbox";

fn default_message_prefix() -> String {
    DEFAULT_MESSAGE_PREFIX.to_owned()
}

/// `postgres.messages`: whether the session asks pgoutput for logical
/// decoding messages (the table-less outbox).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Messages {
    /// When the database is set up to emit them (`outbox_emit` exists).
    #[default]
    Auto,
    On,
    Off,
}

/// `postgres.messages`: `true`, `false` or `"auto"`.
fn messages<'de, D: Deserializer<'de>>(d: D) -> Result<Messages, D::Error> {
    use Messages;
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Value {
        Bool(bool),
        Text(String),
    }
    match Value::deserialize(d)? {
        Value::Bool(true) => Ok(Messages::On),
        Value::Bool(false) => Ok(Messages::Off),
        Value::Text(t) if t == "auto" => Ok(Messages::Auto),
        Value::Text(t) => Err(serde::de::Error::custom(format!(
            "{t:?} is not true, false or \"auto\""
        ))),
    }
}

/// `postgres.url` for `Debug`: its password, if any, replaced.
fn url_without_password(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) if u.password().is_some() => {
            let _ = u.set_password(Some("***"));
            u.to_string()
        }
        Ok(u) => u.to_string(),
        Err(_) => "<unparsed url>".to_owned(),
    }
}

// No Debug output may show a secret: the URL's password, the password,
// and every value of [kafka.options] (sasl.password, ssl.key.password, …)
// are left out.
impl std::fmt::Debug for PostgresConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresConfig")
            .field("url", &url_without_password(&self.url))
            .field("password", &self.password)
            .field("table", &self.table)
            .field("slot", &self.slot)
            .field("publication", &self.publication)
            .field("create_publication", &self.create_publication)
            .field("failover_slot", &self.failover_slot)
            .field("status_interval", &self.status_interval)
            .field("reconnect_backoff_max", &self.reconnect_backoff_max)
            .field("leader_timeout", &self.leader_timeout)
            .field("messages", &self.messages)
            .field("message_prefix", &self.message_prefix)
            .finish()
    }
}

fn default_table() -> String {
    "public.outbox".into()
}

fn default_name() -> String {
    "outboxd".into()
}

fn default_status_interval() -> HumanDuration {
    secs(1)
}

fn default_backoff_max() -> HumanDuration {
    secs(30)
}

fn default_leader_timeout() -> HumanDuration {
    secs(8)
}

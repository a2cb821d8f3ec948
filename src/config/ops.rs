//! `[http]`, `[health]`, `[shutdown]`, `[log]` and `[opentelemetry]`:
//! running outboxd.

use std::time::Duration;

use serde::Deserialize;

use super::{secs, HumanDuration, Secret};

/// `[http]`
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    /// Address of /metrics, /healthz and /readyz.
    #[serde(default = "default_listen")]
    pub listen: String,
    /// A bearer token that turns on the source verbs (`/sources`, pause,
    /// resume, restart); unset, those routes do not exist.
    #[serde(default)]
    pub admin_token: Option<Secret>,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            listen: default_listen(),
            admin_token: None,
        }
    }
}

/// `[health]`
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HealthConfig {
    /// /healthz fails when the replication loop has not run for this long.
    #[serde(default = "default_liveness")]
    pub liveness_timeout: HumanDuration,
    /// /readyz fails when the last status update to PostgreSQL is older.
    #[serde(default = "default_status_max_age")]
    pub status_max_age: HumanDuration,
    /// /readyz fails when events are in flight and Kafka has not acknowledged any for this long.
    #[serde(default = "default_ack_max_age")]
    pub ack_max_age: HumanDuration,
    /// /readyz fails when the replication lag exceeds this many bytes (unset: no limit).
    #[serde(default)]
    pub max_lag_bytes: Option<u64>,
    /// /readyz fails, and an error is logged, when the slot retains more WAL than this (unset: no limit).
    #[serde(default)]
    pub max_retained_wal_bytes: Option<u64>,
    /// How often to poll the slot's retained WAL and failover protection,
    /// and probe the brokers.
    #[serde(default = "default_poll_interval")]
    pub poll_interval: HumanDuration,
    /// /readyz fails while the slot would not survive a promotion (see
    /// `outboxd check`, "failover"). Off by default: a server without a
    /// standby is a valid setup.
    #[serde(default)]
    pub require_failover_protection: bool,
}

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            liveness_timeout: default_liveness(),
            status_max_age: default_status_max_age(),
            ack_max_age: default_ack_max_age(),
            max_lag_bytes: None,
            max_retained_wal_bytes: None,
            poll_interval: default_poll_interval(),
            require_failover_protection: false,
        }
    }
}

impl HealthConfig {
    pub fn thresholds(&self) -> Thresholds {
        Thresholds {
            liveness_timeout: self.liveness_timeout.0,
            status_max_age: self.status_max_age.0,
            ack_max_age: self.ack_max_age.0,
            max_lag_bytes: self.max_lag_bytes,
            max_retained_wal_bytes: self.max_retained_wal_bytes,
            require_failover_protection: self.require_failover_protection,
        }
    }
}

/// `[shutdown]`
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShutdownConfig {
    /// On SIGTERM, how long to wait for in-flight events to be acknowledged.
    #[serde(default = "default_drain")]
    pub drain_timeout: HumanDuration,
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        ShutdownConfig {
            drain_timeout: default_drain(),
        }
    }
}

/// Log output format.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// `[log]`
#[derive(Clone, Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    /// `text` or `json`.
    #[serde(default)]
    pub format: LogFormat,
    /// A tracing filter such as `info` or `outboxd=debug`; `RUST_LOG` wins.
    #[serde(default)]
    pub level: Option<String>,
}

fn default_listen() -> String {
    "127.0.0.1:9187".into()
}

fn default_liveness() -> HumanDuration {
    secs(60)
}

fn default_status_max_age() -> HumanDuration {
    secs(10)
}

fn default_ack_max_age() -> HumanDuration {
    secs(30)
}

fn default_poll_interval() -> HumanDuration {
    secs(10)
}

fn default_drain() -> HumanDuration {
    secs(30)
}

/// Limits that decide readiness and liveness.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Thresholds {
    pub liveness_timeout: Duration,
    pub status_max_age: Duration,
    pub ack_max_age: Duration,
    pub max_lag_bytes: Option<u64>,
    pub max_retained_wal_bytes: Option<u64>,
    pub require_failover_protection: bool,
}

/// `[opentelemetry]`
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OtelConfig {
    /// Emit and export spans. Off by default.
    #[serde(default)]
    pub enabled: bool,
    /// The OTLP/HTTP traces endpoint.
    #[serde(default = "default_endpoint")]
    pub endpoint: String,
    /// `service.name` of the spans.
    #[serde(default = "default_service_name")]
    pub service_name: String,
    /// Extra HTTP headers for the collector (for example an API key,
    /// `"${OTLP_TOKEN}"`); their values never show in `Debug` output.
    #[serde(default)]
    pub headers: std::collections::HashMap<String, Secret>,
    /// How long one export may take.
    #[serde(default = "default_timeout")]
    pub timeout: HumanDuration,
}

impl Default for OtelConfig {
    fn default() -> Self {
        OtelConfig {
            enabled: false,
            endpoint: default_endpoint(),
            service_name: default_service_name(),
            headers: Default::default(),
            timeout: default_timeout(),
        }
    }
}

fn default_endpoint() -> String {
    "http://127.0.0.1:4318/v1/traces".into()
}

fn default_service_name() -> String {
    "outboxd".into()
}

fn default_timeout() -> HumanDuration {
    HumanDuration(Duration::from_secs(10))
}

impl OtelConfig {
    /// Checks what can be checked without a collector.
    pub fn validate(&self) -> Result<(), String> {
        if !self.enabled {
            return Ok(());
        }
        let url =
            url::Url::parse(&self.endpoint).map_err(|e| format!("{:?} is not a URL: {e}", self.endpoint))?;
        if url.scheme() != "http" {
            return Err(format!(
                "{:?}: only http:// is supported; send to a local OpenTelemetry Collector, which forwards over TLS",
                self.endpoint
            ));
        }
        if self.service_name.is_empty() {
            return Err("service_name must not be empty".into());
        }
        Ok(())
    }
}

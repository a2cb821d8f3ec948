//! `[coordination]`: several replicas of one file share its sources.
//!
//! Without this section every replica of a file tries to lead every
//! source, and the first to take a source's lease keeps it (hot standby).
//! With it, the replicas join one Kafka consumer group and each leads only
//! the sources the group assigns it (see [`crate::coordination`]); the
//! PostgreSQL lease still decides who may publish.
//!
//! ```toml
//! [coordination]
//! group = "outboxd-payments"        # the consumer group (and topic prefix)
//! replica = "${POD_NAME}"           # default: the host name
//! session_timeout = "10s"           # a silent replica's sources move after this
//! heartbeat_interval = "1s"
//! ```
//!
//! A source may set `weight` (1 to 3, default 1) in its `[[sources]]`
//! table: sources of one weight are spread apart from the others, so two
//! busy sources do not land on one replica while another leads idle ones.

use serde::Deserialize;

use super::{secs, HumanDuration};

/// `[coordination]`
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct CoordinationConfig {
    /// The Kafka consumer group the replicas join; it also names the
    /// coordination topics (`<group>.sources...`).
    pub group: String,
    /// This replica's name, shown in `/status` and to the group
    /// (`client.id`); default: the host name.
    #[serde(default)]
    pub replica: Option<String>,
    /// How long the group waits for a silent replica before its sources
    /// are assigned to the others (`session.timeout.ms`; the broker
    /// bounds it, 6 s to 30 min by default).
    #[serde(default = "default_session_timeout")]
    pub session_timeout: HumanDuration,
    /// How often a replica tells the group it is alive
    /// (`heartbeat.interval.ms`); at most a third of `session_timeout`.
    #[serde(default = "default_heartbeat_interval")]
    pub heartbeat_interval: HumanDuration,
}

fn default_session_timeout() -> HumanDuration {
    secs(10)
}

fn default_heartbeat_interval() -> HumanDuration {
    secs(1)
}

/// The heaviest weight a source may declare.
pub const MAX_WEIGHT: u32 = 3;

impl CoordinationConfig {
    /// Checks the section; the reason names the key.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        let legal = |s: &str| {
            !s.is_empty()
                && s.len() <= 200
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
        };
        if !legal(&self.group) {
            return Err((
                "coordination.group",
                format!(
                    "{:?} cannot name a Kafka group and topic: use 1 to 200 of a-z, A-Z, 0-9, '.', '_' and '-'",
                    self.group
                ),
            ));
        }
        if self.replica.as_deref().is_some_and(str::is_empty) {
            return Err((
                "coordination.replica",
                "is empty: leave it out to use the host name".into(),
            ));
        }
        let (session, heartbeat) = (self.session_timeout.0, self.heartbeat_interval.0);
        if session.as_millis() < 6000 || session.as_millis() > 1_800_000 {
            return Err((
                "coordination.session_timeout",
                "must be between 6s and 30m: a broker refuses a member outside group.min.session.timeout.ms and group.max.session.timeout.ms (6s and 30m by default)".into(),
            ));
        }
        if heartbeat.is_zero() || heartbeat * 3 > session {
            return Err((
                "coordination.heartbeat_interval",
                format!(
                    "must be above zero and at most a third of session_timeout ({}): a replica that misses two heartbeats would lose its sources",
                    humantime::format_duration(session)
                ),
            ));
        }
        Ok(())
    }

    /// The replica's name: `replica`, else the host name, else `outboxd`.
    pub fn replica_name(&self) -> String {
        self.replica.clone().unwrap_or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|h| h.trim().to_owned())
                .filter(|h| !h.is_empty())
                .or_else(|| std::env::var("HOSTNAME").ok())
                .unwrap_or_else(|| "outboxd".to_owned())
        })
    }
}

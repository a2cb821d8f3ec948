//! `mode` and `[polling]`: how outboxd finds new outbox rows.

use std::time::Duration;

use serde::Deserialize;

use super::HumanDuration;

/// How outboxd finds new outbox rows.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, Default)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Logical replication (pgoutput): no polling, commit order, low latency.
    #[default]
    Cdc,
    /// Rounds of `SELECT … FOR UPDATE` in write order by one elected
    /// poller (see `crate::relay::polling`), for databases without
    /// logical replication.
    Polling,
}

/// `[polling]`
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PollingConfig {
    /// Rows per round.
    #[serde(default = "default_batch_size")]
    pub batch_size: usize,
    /// Pause after a round that found fewer than `batch_size` rows.
    #[serde(default = "default_poll_pause")]
    pub interval: HumanDuration,
    /// The `timestamptz` column a round sets once a row is published (NULL
    /// until then), `published_at` in migration 0001.
    #[serde(default = "default_published_column")]
    pub published_column: String,
}

impl Default for PollingConfig {
    fn default() -> Self {
        PollingConfig {
            batch_size: default_batch_size(),
            interval: default_poll_pause(),
            published_column: default_published_column(),
        }
    }
}

fn default_published_column() -> String {
    "published_at".into()
}

fn default_batch_size() -> usize {
    500
}

fn default_poll_pause() -> HumanDuration {
    HumanDuration(Duration::from_millis(500))
}

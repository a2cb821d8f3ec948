//! The Kafka clients of one process, shared by its sources.
//!
//! Every at-least-once source of an outboxd process sends through one
//! producer (per distinct producer configuration: the shared `[kafka]`
//! section and the source's `postgres.leader_timeout`, which sets
//! `message.timeout.ms`), each of its sessions on a lane of its own
//! ([`crate::kafka::delivery`]). A source's budget is its relay's:
//! `kafka.max_inflight` records and `kafka.max_inflight_bytes` bytes
//! unacknowledged, counted per session, so a source with a huge backlog
//! holds at most that much of the shared queue. librdkafka's own queue
//! bounds (`queue.buffering.max.messages`, `.kbytes`) are raised so that
//! they never bind before the sum of the budgets does, unless
//! `kafka.options` sets them.
//!
//! What stays per source: a transactional producer pair (a Kafka
//! transaction belongs to one producer, and exactly-once sources commit
//! each at its own pace), and a producer of its own while a relay sends
//! one record per batch or caps its batches after a refusal
//! ([`SinkKind`]). The admin client (topic creation, configurations,
//! metadata probes) is shared by every sink of one `[kafka]` section.
//!
//! `enable.gapless.guarantee = "true"` in `kafka.options` turns sharing
//! off: with it librdkafka fails for good when a purge takes a record it is
//! retrying, so each source keeps a producer of its own.
//!
//! A shared producer lives while a sink uses it; one with a fatal error is
//! replaced for the next sink that asks, and the sinks still on it fail
//! their sessions and come back for the new one.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use rdkafka::admin::AdminClient;
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;

use crate::config::KafkaConfig;
use crate::kafka::delivery::{Producer, Sharing};
use crate::kafka::sink::{
    client_config, describe_config_error, producer_config, KafkaSink, KafkaSinkError, SinkKind,
    SHARED_QUEUE_KBYTES, SHARED_QUEUE_MESSAGES,
};

/// Whether `kafka.options` sets `enable.gapless.guarantee` (librdkafka
/// takes `true` in any case, and refuses anything but `true` or `false`):
/// then no source shares a producer.
fn gapless(cfg: &KafkaConfig) -> bool {
    cfg.options
        .get("enable.gapless.guarantee")
        .is_some_and(|v| v.eq_ignore_ascii_case("true"))
}

/// The process's shared Kafka clients, by configuration.
#[derive(Default)]
pub struct KafkaClients {
    producers: Mutex<HashMap<String, Weak<Producer>>>,
    admins: Mutex<HashMap<String, Weak<AdminClient<DefaultClientContext>>>>,
}

impl std::fmt::Debug for KafkaClients {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let producers = lock(&self.producers)
            .values()
            .filter(|p| p.strong_count() > 0)
            .count();
        f.debug_struct("KafkaClients")
            .field("producers", &producers)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A configuration as a key: every setting, sorted. It holds secrets, and
/// is never shown.
fn key(config: &ClientConfig) -> String {
    let map = config.config_map();
    let mut pairs: Vec<_> = map.iter().collect();
    pairs.sort();
    pairs.into_iter().map(|(k, v)| format!("{k}={v}\n")).collect()
}

impl KafkaClients {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// A sink of `kind`: on the shared producer of its configuration when
    /// the kind can share one, else with producers of its own; either way
    /// with the shared admin client.
    pub fn sink(
        &self,
        cfg: &KafkaConfig,
        timeout: Duration,
        kind: &SinkKind,
    ) -> Result<KafkaSink, KafkaSinkError> {
        if !kind.can_share() || gapless(cfg) {
            return KafkaSink::build(cfg, timeout, kind);
        }
        let admin = self.admin(cfg)?;
        let producer = self.producer(cfg, kind)?;
        Ok(KafkaSink::on_lane(cfg, timeout, &producer, admin))
    }

    /// The shared producer for `cfg` and `kind`, made if none is alive or
    /// the one alive has a fatal error.
    pub fn producer(&self, cfg: &KafkaConfig, kind: &SinkKind) -> Result<Arc<Producer>, KafkaSinkError> {
        let mut config = producer_config(cfg, kind);
        for (option, value) in [
            ("queue.buffering.max.messages", SHARED_QUEUE_MESSAGES),
            ("queue.buffering.max.kbytes", SHARED_QUEUE_KBYTES),
        ] {
            if !cfg.options.contains_key(option) {
                config.set(option, value);
            }
        }
        let key = key(&config);
        let mut producers = lock(&self.producers);
        producers.retain(|_, p| p.strong_count() > 0);
        if let Some(p) = producers.get(&key).and_then(Weak::upgrade) {
            match p.client().fatal_error() {
                None => return Ok(p),
                Some((code, reason)) => {
                    tracing::warn!(%code, reason, "the shared Kafka producer has a fatal error: the sources that use it start again on a new one")
                }
            }
        }
        let p = Producer::create(&config, Sharing::PurgeOnFailure)
            .map_err(|e| KafkaSinkError::Config(describe_config_error(&e, cfg)))?;
        producers.insert(key, Arc::downgrade(&p));
        Ok(p)
    }

    /// The shared admin client for `cfg`.
    fn admin(&self, cfg: &KafkaConfig) -> Result<Arc<AdminClient<DefaultClientContext>>, KafkaSinkError> {
        let config = client_config(cfg);
        let key = key(&config);
        let mut admins = lock(&self.admins);
        admins.retain(|_, a| a.strong_count() > 0);
        if let Some(a) = admins.get(&key).and_then(Weak::upgrade) {
            return Ok(a);
        }
        let admin: AdminClient<DefaultClientContext> = config
            .create()
            .map_err(|e| KafkaSinkError::Config(describe_config_error(&e, cfg)))?;
        let admin = Arc::new(admin);
        admins.insert(key, Arc::downgrade(&admin));
        Ok(admin)
    }

    /// Live shared producers (for tests and the status page).
    pub fn shared_producers(&self) -> usize {
        lock(&self.producers)
            .values()
            .filter(|p| p.strong_count() > 0)
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kafka(options: &[(&str, &str)]) -> KafkaConfig {
        let mut text = String::from("brokers = \"127.0.0.1:9\"\n[options]\n");
        for (k, v) in options {
            text.push_str(&format!("\"{k}\" = \"{v}\"\n"));
        }
        toml::from_str(&text).expect("a [kafka] table")
    }

    #[tokio::test]
    async fn gapless_turns_sharing_off_and_other_options_do_not() {
        let timeout = Duration::from_secs(1);
        let kind = SinkKind::default();
        for value in ["true", "TRUE", "True"] {
            let clients = KafkaClients::new();
            let cfg = kafka(&[("enable.gapless.guarantee", value)]);
            let a = clients.sink(&cfg, timeout, &kind).expect("a sink");
            let b = clients.sink(&cfg, timeout, &kind).expect("a sink");
            assert!(!a.shares_producer() && !b.shares_producer(), "{value:?}");
            assert_eq!(clients.shared_producers(), 0, "{value:?}");
        }
        for options in [
            &[("enable.gapless.guarantee", "false")][..],
            &[("linger.ms", "7")][..],
            &[],
        ] {
            let clients = KafkaClients::new();
            let cfg = kafka(options);
            let a = clients.sink(&cfg, timeout, &kind).expect("a sink");
            let b = clients.sink(&cfg, timeout, &kind).expect("a sink");
            assert!(a.shares_producer() && b.shares_producer(), "{options:?}");
            assert_eq!(clients.shared_producers(), 1, "{options:?}");
        }
    }
}

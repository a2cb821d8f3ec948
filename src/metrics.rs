//! Every metric outboxd exports, in one place, on an owned registry.
//!
//! Names follow `outboxd_<name>_<unit>[_total]`. Labels have bounded
//! values only (`reason` comes from a fixed list). The relay updates
//! counters per batch (at each status tick) and the commit-to-ack
//! histogram per transaction, never per event on the hot path.

use prometheus::{
    Encoder, Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

/// The metrics of one outboxd process.
#[derive(Clone, Debug)]
pub struct Metrics {
    registry: Registry,
    /// Events acknowledged by Kafka.
    pub events_published: IntCounter,
    /// Transactions whose events are all acknowledged (including empty ones).
    pub transactions: IntCounter,
    /// Failures by reason (bounded set).
    pub publish_errors: IntCounterVec,
    /// Rows sent to the dead-letter topic, by reason (bounded set).
    pub dead_letters: IntCounterVec,
    /// Last WAL position received from PostgreSQL.
    pub received_lsn: IntGauge,
    /// Last WAL position confirmed to PostgreSQL (flush).
    pub confirmed_lsn: IntGauge,
    /// Server WAL end minus the confirmed LSN.
    pub replication_lag_bytes: IntGauge,
    /// WAL the slot keeps on the primary: current WAL LSN minus `restart_lsn`.
    pub slot_retained_wal_bytes: IntGauge,
    /// 1 when the slot would survive a promotion (PostgreSQL 17+ failover
    /// slot with a verified synced copy on a standby), else 0.
    pub failover_protected: IntGauge,
    /// Events sent and not yet acknowledged.
    pub inflight_events: IntGauge,
    /// From the PostgreSQL commit timestamp to the last Kafka ack of the transaction.
    pub commit_to_ack_seconds: Histogram,
    /// Unix time of the last Kafka acknowledgement.
    pub last_ack_timestamp_seconds: Gauge,
    /// Replication sessions restarted after a transient failure.
    pub reconnects: IntCounter,
    /// Records sent again after the shared producer purged its unsent
    /// records because a delivery failed (see `crate::kafka::delivery`).
    pub resent_records: IntCounter,
    /// 1 while /readyz answers ready.
    pub ready: IntGauge,
    /// 1 while this process may lead the source: always without
    /// `[coordination]`, else while the replicas' group assigns it here.
    pub assigned: IntGauge,
    /// Polling mode: age of the oldest row with published_at NULL (seed 000's query).
    pub oldest_unpublished_seconds: Gauge,
    /// 1, labelled with the version.
    pub build_info: IntGaugeVec,
    /// Exactly-once: Kafka transactions by outcome (`committed`, `aborted`).
    pub kafka_transactions: IntCounterVec,
    /// Exactly-once: how long a Kafka commit took (progress record to commit).
    pub kafka_commit_seconds: Histogram,
    /// Exactly-once: the commit LSN in the last committed progress record.
    pub progress_lsn: IntGauge,
    /// Exactly-once: PostgreSQL transactions skipped at start because the
    /// progress record says they are in Kafka already.
    pub skipped_transactions: IntCounter,
    /// Schema Registry requests by outcome (see [`REGISTRY_OUTCOMES`]).
    pub schema_registry_requests: IntCounterVec,
    /// Schema look-ups by `result`: `hit` (cached) or `miss` (asked the
    /// registry).
    pub schema_cache: IntCounterVec,
    /// Payloads that did not fit their registered schema.
    pub schema_mismatches: IntCounter,
    /// `routing.on_poison = "park"`: parked sequences, events and their
    /// bytes, and the oldest sequence's age (as last read).
    pub parked_sequences: IntGauge,
    pub parked_events: IntGauge,
    pub parked_bytes: IntGauge,
    pub parked_oldest_age_seconds: Gauge,
    /// Events parked, by the reason their sequence's head was parked for
    /// (`behind` for an event parked behind its head).
    pub parked_total: IntCounterVec,
    pub parked_handed_back: IntCounter,
}

/// Every `outcome` of `outboxd_schema_registry_requests_total`.
pub const REGISTRY_OUTCOMES: &[&str] = &[
    "ok",
    "unavailable",
    "unauthorized",
    "not_found",
    "refused",
    "unreadable",
];

fn register<M: prometheus::core::Collector + Clone + 'static>(
    registry: &Registry,
    m: M,
) -> Result<M, prometheus::Error> {
    registry.register(Box::new(m.clone()))?;
    Ok(m)
}

fn counter(registry: &Registry, name: &str, help: &str) -> Result<IntCounter, prometheus::Error> {
    register(registry, IntCounter::new(name, help)?)
}

fn gauge(registry: &Registry, name: &str, help: &str) -> Result<IntGauge, prometheus::Error> {
    register(registry, IntGauge::new(name, help)?)
}

/// Every `reason` of `outboxd_publish_errors_total`. Each starts at zero,
/// so that `rate()` and `increase()` see the first error.
pub const PUBLISH_ERROR_REASONS: &[&str] = &[
    "postgres_setup",
    "postgres_stream",
    "decode",
    "poison",
    "batch_refused",
    "denied",
    "dead_letter",
    "config",
    "unreachable",
    "topic_missing",
    "topic_create",
    "produce",
    "delivery",
    "canceled",
    "fenced",
    "transaction",
    "progress",
    "slot_register",
    "not_stored",
    "purged",
    "publication_unproven",
    "schema_registry",
];

/// Every `reason` of `outboxd_dead_letters_total` (and of a dead letter's
/// `dlq.reason` header), each starting at zero.
pub const DEAD_LETTER_REASONS: &[&str] = &[
    "too_large",
    "bad_timestamp",
    "refused",
    "illegal_topic",
    "empty_key",
    "bad_headers",
    "unreadable",
    "aggregate_type_not_allowed",
    "bad_cloudevent",
    "schema_mismatch",
    "bad_payload",
    "bad_partition",
];

impl Metrics {
    /// Creates the metrics on a fresh registry, without labels of their own.
    pub fn new() -> Result<Self, prometheus::Error> {
        Self::on(Registry::new())
    }

    /// Creates the metrics of one source: every series carries
    /// `source="<name>"` (a validated name, so the label stays bounded).
    /// [`encode_all`] writes several sources as one exposition.
    pub fn for_source(name: &str) -> Result<Self, prometheus::Error> {
        let labels = std::collections::HashMap::from([("source".to_owned(), name.to_owned())]);
        Self::on(Registry::new_custom(None, Some(labels))?)
    }

    fn on(registry: Registry) -> Result<Self, prometheus::Error> {
        let publish_errors = register(
            &registry,
            IntCounterVec::new(
                Opts::new("outboxd_publish_errors_total", "Publishing failures by reason."),
                &["reason"],
            )?,
        )?;
        let dead_letters = register(
            &registry,
            IntCounterVec::new(
                Opts::new(
                    "outboxd_dead_letters_total",
                    "Rows sent to the dead-letter topic, by reason.",
                ),
                &["reason"],
            )?,
        )?;
        for reason in PUBLISH_ERROR_REASONS {
            publish_errors.with_label_values(&[reason]);
        }
        for reason in DEAD_LETTER_REASONS {
            dead_letters.with_label_values(&[reason]);
        }
        let commit_to_ack_seconds = register(
            &registry,
            Histogram::with_opts(
                HistogramOpts::new(
                    "outboxd_commit_to_ack_seconds",
                    "Time from the PostgreSQL commit to Kafka acknowledging the transaction's last event.",
                )
                .buckets(vec![
                    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                    0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                ]),
            )?,
        )?;
        let last_ack_timestamp_seconds = register(
            &registry,
            Gauge::new(
                "outboxd_last_ack_timestamp_seconds",
                "Unix time of the last Kafka acknowledgement.",
            )?,
        )?;
        let oldest_unpublished_seconds = register(
            &registry,
            Gauge::new(
                "outboxd_oldest_unpublished_seconds",
                "Polling mode: age of the oldest outbox row not yet published.",
            )?,
        )?;
        let build_info = register(
            &registry,
            IntGaugeVec::new(
                Opts::new("outboxd_build_info", "Build information."),
                &["version"],
            )?,
        )?;
        build_info.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);
        let kafka_transactions = register(
            &registry,
            IntCounterVec::new(
                Opts::new(
                    "outboxd_kafka_transactions_total",
                    "Exactly-once: Kafka transactions by outcome (committed, aborted).",
                ),
                &["outcome"],
            )?,
        )?;
        for outcome in ["committed", "aborted"] {
            kafka_transactions.with_label_values(&[outcome]);
        }
        let kafka_commit_seconds = register(
            &registry,
            Histogram::with_opts(
                HistogramOpts::new(
                    "outboxd_kafka_commit_seconds",
                    "Exactly-once: time to commit a Kafka transaction (after its records are acknowledged).",
                )
                .buckets(vec![
                    0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5,
                    1.0, 2.5, 5.0, 10.0, 30.0,
                ]),
            )?,
        )?;
        let schema_registry_requests = register(
            &registry,
            IntCounterVec::new(
                Opts::new(
                    "outboxd_schema_registry_requests_total",
                    "Schema Registry requests by outcome (ok, unavailable, unauthorized, not_found, refused, unreadable).",
                ),
                &["outcome"],
            )?,
        )?;
        for outcome in REGISTRY_OUTCOMES {
            schema_registry_requests.with_label_values(&[outcome]);
        }
        let schema_cache = register(
            &registry,
            IntCounterVec::new(
                Opts::new(
                    "outboxd_schema_cache_total",
                    "Schema look-ups by result: hit (cached) or miss (asked the registry).",
                ),
                &["result"],
            )?,
        )?;
        for result in ["hit", "miss"] {
            schema_cache.with_label_values(&[result]);
        }
        let schema_mismatches = counter(
            &registry,
            "outboxd_schema_mismatches_total",
            "Payloads that did not fit their registered schema (each follows routing.on_poison).",
        )?;
        let parked_total = register(
            &registry,
            IntCounterVec::new(
                Opts::new(
                    "outboxd_parked_total",
                    "Events parked (routing.on_poison = \"park\"), by reason; `behind` for events parked behind their sequence's head.",
                ),
                &["reason"],
            )?,
        )?;
        for reason in DEAD_LETTER_REASONS.iter().chain(&["behind"]) {
            parked_total.with_label_values(&[reason]);
        }
        let parked_handed_back = counter(
            &registry,
            "outboxd_parked_handed_back_total",
            "Parked events the relay published itself after a redrive handed their sequence back (a busy aggregate).",
        )?;
        let parked_oldest_age_seconds = register(
            &registry,
            Gauge::new(
                "outboxd_parked_oldest_age_seconds",
                "Age of the oldest parked sequence (0 when none is parked).",
            )?,
        )?;
        Ok(Metrics {
            parked_sequences: gauge(
                &registry,
                "outboxd_parked_sequences",
                "Parked sequences (topic and key) waiting for `outboxd parked redrive`.",
            )?,
            parked_events: gauge(&registry, "outboxd_parked_events", "Parked events, heads included.")?,
            parked_bytes: gauge(&registry, "outboxd_parked_bytes", "Bytes of parked events.")?,
            parked_oldest_age_seconds,
            parked_total,
            parked_handed_back,
            schema_registry_requests,
            schema_cache,
            schema_mismatches,
            events_published: counter(
                &registry,
                "outboxd_events_published_total",
                "Events acknowledged by Kafka.",
            )?,
            transactions: counter(
                &registry,
                "outboxd_transactions_total",
                "Transactions fully acknowledged (including those without outbox rows).",
            )?,
            received_lsn: gauge(
                &registry,
                "outboxd_received_lsn",
                "Last WAL position received from PostgreSQL.",
            )?,
            confirmed_lsn: gauge(
                &registry,
                "outboxd_confirmed_lsn",
                "Last WAL position confirmed to PostgreSQL.",
            )?,
            replication_lag_bytes: gauge(
                &registry,
                "outboxd_replication_lag_bytes",
                "Server WAL end minus the confirmed LSN.",
            )?,
            slot_retained_wal_bytes: gauge(
                &registry,
                "outboxd_slot_retained_wal_bytes",
                "WAL retained by the slot: current WAL LSN minus restart_lsn.",
            )?,
            failover_protected: gauge(
                &registry,
                "outboxd_failover_protected",
                "1 when the slot would survive a promotion: a failover slot (PostgreSQL 17+) with a synced copy on a standby in postgres.url.",
            )?,
            inflight_events: gauge(
                &registry,
                "outboxd_inflight_events",
                "Events sent and not yet acknowledged.",
            )?,
            reconnects: counter(
                &registry,
                "outboxd_reconnects_total",
                "Replication sessions restarted after a transient failure.",
            )?,
            resent_records: counter(
                &registry,
                "outboxd_resent_records_total",
                "Records sent again, in order, after the shared producer purged its unsent records because a delivery (of any source) failed.",
            )?,
            ready: gauge(&registry, "outboxd_ready", "1 while /readyz answers ready.")?,
            assigned: {
                let g = gauge(
                    &registry,
                    "outboxd_source_assigned",
                    "1 while this replica may lead the source: always without [coordination], else while the replicas' group assigns it here.",
                )?;
                g.set(1);
                g
            },
            publish_errors,
            dead_letters,
            commit_to_ack_seconds,
            last_ack_timestamp_seconds,
            oldest_unpublished_seconds,
            build_info,
            kafka_transactions,
            kafka_commit_seconds,
            progress_lsn: gauge(
                &registry,
                "outboxd_progress_lsn",
                "Exactly-once: the commit LSN in the last committed progress record.",
            )?,
            skipped_transactions: counter(
                &registry,
                "outboxd_skipped_transactions_total",
                "Exactly-once: transactions skipped because the progress record says they are in Kafka.",
            )?,
            registry,
        })
    }

    /// Counts a failure under a bounded reason label.
    pub fn error(&self, reason: &'static str) {
        self.publish_errors.with_label_values(&[reason]).inc();
    }

    /// The Prometheus text exposition.
    pub fn encode(&self) -> String {
        encode_all(std::slice::from_ref(self))
    }
}

/// One exposition of several sources' metrics: each family once, with
/// every source's series under it (a family repeated would be refused by
/// Prometheus).
pub fn encode_all<'a>(sources: impl IntoIterator<Item = &'a Metrics>) -> String {
    let mut families: Vec<prometheus::proto::MetricFamily> = Vec::new();
    for m in sources {
        for mut family in m.registry.gather() {
            match families.iter_mut().find(|f| f.name() == family.name()) {
                Some(known) => known.mut_metric().extend(family.take_metric()),
                None => families.push(family),
            }
        }
    }
    let mut buf = Vec::new();
    if TextEncoder::new().encode(&families, &mut buf).is_err() {
        return String::new();
    }
    String::from_utf8(buf).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposes_every_documented_name() {
        let m = Metrics::new().unwrap();
        m.error("delivery");
        m.commit_to_ack_seconds.observe(0.01);
        let text = m.encode();
        for name in [
            "outboxd_events_published_total",
            "outboxd_transactions_total",
            "outboxd_publish_errors_total{reason=\"delivery\"}",
            "outboxd_received_lsn",
            "outboxd_confirmed_lsn",
            "outboxd_replication_lag_bytes",
            "outboxd_slot_retained_wal_bytes",
            "outboxd_failover_protected",
            "outboxd_inflight_events",
            "outboxd_commit_to_ack_seconds_bucket",
            "outboxd_last_ack_timestamp_seconds",
            "outboxd_reconnects_total",
            "outboxd_build_info{version=",
            "outboxd_ready",
            "outboxd_source_assigned 1",
            "outboxd_kafka_transactions_total{outcome=\"committed\"} 0",
            "outboxd_kafka_transactions_total{outcome=\"aborted\"} 0",
            "outboxd_kafka_commit_seconds_bucket",
            "outboxd_progress_lsn",
            "outboxd_skipped_transactions_total",
        ] {
            assert!(text.contains(name), "missing {name}");
        }
        assert!(text.contains("outboxd_publish_errors_total{reason=\"delivery\"} 1"));
        // Two sources: each family once, a series per source.
        let (a, b) = (
            Metrics::for_source("a").unwrap(),
            Metrics::for_source("b").unwrap(),
        );
        a.events_published.inc_by(3);
        let both = encode_all([&a, &b]);
        assert_eq!(both.matches("# TYPE outboxd_events_published_total").count(), 1);
        assert!(
            both.contains("outboxd_events_published_total{source=\"a\"} 3"),
            "{both}"
        );
        assert!(both.contains("outboxd_events_published_total{source=\"b\"} 0"));
        assert!(both.contains("outboxd_publish_errors_total{reason=\"delivery\",source=\"b\"} 0"));
        // Every reason is there from the start, at zero.
        let fresh = Metrics::new().unwrap().encode();
        for reason in PUBLISH_ERROR_REASONS {
            assert!(
                fresh.contains(&format!("outboxd_publish_errors_total{{reason=\"{reason}\"}} 0")),
                "{reason}"
            );
        }
        for reason in DEAD_LETTER_REASONS {
            assert!(
                fresh.contains(&format!("outboxd_dead_letters_total{{reason=\"{reason}\"}} 0")),
                "{reason}"
            );
        }
    }
}

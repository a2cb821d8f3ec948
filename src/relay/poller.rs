//! The background poller: retained WAL, the server's WAL end, failover
//! protection, brokers.

use std::sync::Arc;
use std::time::Duration;

use crate::config::Validated;
use crate::kafka::sink::BrokerProbe;
use crate::lsn::Lsn;
use crate::metrics::Metrics;
use crate::ops::health::Health;
use crate::postgres::{admin, failover};

/// Every `health.poll_interval`: the slot's retained WAL (and the guard on
/// it) from `pg_replication_slots`, whether the slot would survive a
/// promotion ([`failover::inspect`]), and a broker probe (`None`: the
/// supervisor watches the slot of a paused or failed source, whose lag is
/// then read here too).
pub(crate) async fn poll_slot_and_brokers(
    v: Validated,
    probe: Option<BrokerProbe>,
    interval: Duration,
    max_retained: Option<u64>,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
) {
    let mut client: Option<tokio_postgres::Client> = None;
    let mut last_failover: Option<String> = None;
    loop {
        if client.as_ref().is_none_or(|c| c.is_closed()) {
            client = admin::connect(&v.pg).await.ok();
        }
        if let Some(c) = &client {
            let row = c
                .query_opt(
                    "SELECT (pg_current_wal_lsn() - restart_lsn)::bigint, wal_status, pg_current_wal_lsn()::text,
                            (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint
                       FROM pg_catalog.pg_replication_slots WHERE slot_name = $1",
                    &[&v.slot.as_str()],
                )
                .await;
            match row {
                Ok(Some(row)) => {
                    let retained = row.get::<_, Option<i64>>(0).unwrap_or(0).max(0);
                    if let Some(end) = row
                        .get::<_, Option<String>>(2)
                        .and_then(|l| l.parse::<Lsn>().ok())
                    {
                        health.set_server_wal_end(end.0);
                    }
                    metrics.slot_retained_wal_bytes.set(retained);
                    if probe.is_none() {
                        // No relay streams (paused or failed): the lag
                        // comes from here, not from status updates.
                        let lag = row.get::<_, Option<i64>>(3).unwrap_or(0).max(0);
                        metrics.replication_lag_bytes.set(lag);
                    }
                    health.set_retained_wal(retained as u64);
                    if max_retained.is_some_and(|max| retained as u64 > max) {
                        tracing::error!(
                            slot = v.slot.as_str(),
                            retained_bytes = retained,
                            "the slot retains more WAL than health.max_retained_wal_bytes: the primary's disk is at risk; check why outboxd cannot confirm (Kafka down? lag?)"
                        );
                    }
                    if row.get::<_, Option<String>>(1).as_deref() == Some("lost") {
                        tracing::error!(
                            slot = v.slot.as_str(),
                            "the replication slot was invalidated (max_slot_wal_keep_size exceeded); see docs/recovery.md, \"An invalidated slot\""
                        );
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    tracing::debug!(error = %e, "slot poll failed");
                    client = None;
                }
            }
        }
        if let Some(c) = &client {
            match failover::inspect(c, &v.pg, &v.slot).await {
                Ok(p) => {
                    let description = p.describe();
                    if last_failover.as_ref() != Some(&description) {
                        if matches!(p, failover::Protection::Unprotected { .. }) {
                            tracing::warn!(slot = v.slot.as_str(), "failover {description}");
                        } else {
                            tracing::info!(slot = v.slot.as_str(), "failover {description}");
                        }
                        last_failover = Some(description.clone());
                    }
                    metrics.failover_protected.set(p.gauge());
                    health.set_failover(p.gauge() == 1, description);
                }
                Err(e) => tracing::debug!(error = %e, "failover poll failed"),
            }
        }
        if let Some(probe) = &probe {
            let reachable = probe.check().await.is_ok();
            if !reachable {
                tracing::warn!("Kafka brokers are unreachable");
            }
            health.set_kafka_reachable(reachable);
        }
        tokio::time::sleep(interval).await;
    }
}

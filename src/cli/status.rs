//! `outboxd status`: one screen for an operator.
//!
//! From PostgreSQL: the slot (active? which walsender PID?), its confirmed
//! and restart LSNs, the current WAL LSN, lag and retained WAL. From the
//! running outboxd (its `/status` on `http.listen`, when reachable): the
//! received LSN, events in flight and the age of the oldest unconfirmed
//! event. When the slot is idle (no outboxd running), that age comes from
//! the commit time of the first transaction still waiting in the slot
//! (a peek, which decodes that one transaction on the server). Kafka: a
//! metadata probe. No password is ever printed.

use std::fmt::Write as _;
use std::time::Duration;

use bytes::Bytes;
use serde::Serialize;

use crate::config::{Config, Validated};
use crate::kafka::sink::KafkaSink;
use crate::ops::health::Snapshot;
use crate::postgres::admin;
use crate::postgres::pgoutput::{decode, LogicalMessage};

/// Everything `status` reports.
#[derive(Clone, Debug, Serialize)]
pub struct StatusReport {
    /// The source of the config file (`default` without `[[sources]]`).
    pub source: String,
    pub postgres: String,
    pub slot: String,
    pub slot_exists: bool,
    pub slot_active: Option<bool>,
    pub walsender_pid: Option<i32>,
    pub wal_status: Option<String>,
    /// PostgreSQL 17+: why the slot was invalidated, if it was.
    pub invalidation_reason: Option<String>,
    /// PostgreSQL 17+: since when no one streams from the slot.
    pub inactive_since: Option<String>,
    /// PostgreSQL 17+: whether the slot is a failover slot.
    pub failover_slot: Option<bool>,
    pub confirmed_lsn: Option<String>,
    pub restart_lsn: Option<String>,
    pub current_wal_lsn: Option<String>,
    pub received_lsn: Option<String>,
    pub lag_bytes: Option<u64>,
    pub retained_wal_bytes: Option<u64>,
    pub oldest_unconfirmed_event_age_seconds: Option<f64>,
    /// Where that age came from: `outboxd` or `slot`.
    pub oldest_unconfirmed_source: Option<&'static str>,
    pub inflight_events: Option<u64>,
    pub outboxd: Option<Snapshot>,
    pub outboxd_error: Option<String>,
    /// `[coordination]`: this replica's name and group, and whether the
    /// group assigns it the source (from the local outboxd's `/status`).
    pub replica: Option<ReplicaView>,
    pub kafka_reachable: bool,
    pub kafka_error: Option<String>,
    /// Exactly-once: the last committed progress record, read from Kafka
    /// with `read_committed` (`None` in at-least-once mode or when there
    /// is none).
    pub progress: Option<crate::relay::exactly_once::ProgressRecord>,
    pub progress_error: Option<String>,
    /// `routing.on_poison = "park"`: the parked sequences, oldest first,
    /// read from the table (so also while outboxd is down).
    pub parked: Option<Vec<crate::cli::parked::Listed>>,
    pub parked_error: Option<String>,
}

/// The local replica's part in the replicas' group.
#[derive(Clone, Debug, Serialize)]
pub struct ReplicaView {
    pub replica: String,
    pub group: String,
    pub assigned: bool,
    /// Sources this replica is assigned, of every source of the file.
    pub assigned_count: usize,
    pub rebalances: u64,
}

/// The status could not be read at all.
#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    #[error(transparent)]
    Admin(#[from] admin::AdminError),
}

/// Asks the running outboxd for its `/status`, and takes `source`'s part.
fn daemon_snapshot(
    config: &Config,
    v: &Validated,
    source: &str,
) -> Result<(Snapshot, Option<ReplicaView>), String> {
    if v.listen.port() == 0 {
        return Err("http.listen uses port 0, so the daemon cannot be found".into());
    }
    let host = if v.listen.ip().is_unspecified() {
        "127.0.0.1".to_owned()
    } else {
        v.listen.ip().to_string()
    };
    let url = format!("http://{}:{}/status", host, v.listen.port());
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_secs(2)))
        .build()
        .into();
    let body = agent
        .get(&url)
        .call()
        .map_err(|e| format!("no outboxd answering at {} ({e})", config.http.listen))?
        .body_mut()
        .read_to_string()
        .map_err(|e| e.to_string())?;
    let mut all: serde_json::Value =
        serde_json::from_str(&body).map_err(|e| format!("unexpected /status answer: {e}"))?;
    let part = match all.get_mut("sources").and_then(|s| s.get_mut(source)) {
        Some(p) => p.take(),
        None => {
            return Err(format!(
                "the outboxd at {} runs no source {source:?}",
                config.http.listen
            ))
        }
    };
    let replica = all
        .get_mut("coordination")
        .map(serde_json::Value::take)
        .and_then(|c| serde_json::from_value::<crate::coordination::Status>(c).ok())
        .map(|c| ReplicaView {
            assigned: c.assigned.contains(source),
            assigned_count: c.assigned.len(),
            replica: c.replica,
            group: c.group,
            rebalances: c.rebalances,
        });
    let snapshot = serde_json::from_value(part).map_err(|e| format!("unexpected /status answer: {e}"))?;
    Ok((snapshot, replica))
}

/// Gathers the report.
pub async fn gather(config: &Config, v: &Validated, source: &str) -> Result<StatusReport, StatusError> {
    let client = admin::connect(&v.pg).await?;
    let row = client
        .query_opt(
            "SELECT s.active, s.active_pid, s.wal_status, s.confirmed_flush_lsn::text, s.restart_lsn::text,
                    pg_current_wal_lsn()::text,
                    (pg_current_wal_lsn() - s.confirmed_flush_lsn)::bigint,
                    (pg_current_wal_lsn() - s.restart_lsn)::bigint,
                    to_jsonb(s) ->> 'invalidation_reason',
                    to_jsonb(s) ->> 'inactive_since',
                    (to_jsonb(s) ->> 'failover')::boolean
               FROM pg_catalog.pg_replication_slots s WHERE s.slot_name = $1",
            &[&v.slot.as_str()],
        )
        .await
        .map_err(admin::AdminError::from)?;
    let mut r = StatusReport {
        source: source.to_owned(),
        postgres: v.pg.target(),
        slot: v.slot.as_str().to_owned(),
        slot_exists: row.is_some(),
        slot_active: None,
        walsender_pid: None,
        wal_status: None,
        invalidation_reason: None,
        inactive_since: None,
        failover_slot: None,
        confirmed_lsn: None,
        restart_lsn: None,
        current_wal_lsn: None,
        received_lsn: None,
        lag_bytes: None,
        retained_wal_bytes: None,
        oldest_unconfirmed_event_age_seconds: None,
        oldest_unconfirmed_source: None,
        inflight_events: None,
        outboxd: None,
        outboxd_error: None,
        replica: None,
        kafka_reachable: false,
        kafka_error: None,
        progress: None,
        progress_error: None,
        parked: None,
        parked_error: None,
    };
    let bytes = |v: Option<i64>| v.and_then(|b| u64::try_from(b).ok());
    if let Some(row) = &row {
        r.slot_active = Some(row.get(0));
        r.walsender_pid = row.get(1);
        r.wal_status = row.get(2);
        r.confirmed_lsn = row.get(3);
        r.restart_lsn = row.get(4);
        r.current_wal_lsn = row.get(5);
        r.lag_bytes = bytes(row.get(6));
        r.retained_wal_bytes = bytes(row.get(7));
        r.invalidation_reason = row.get(8);
        r.inactive_since = row.get(9);
        r.failover_slot = row.get(10);
    }
    let cfg = config.clone();
    let val = v.clone();
    let name = source.to_owned();
    match tokio::task::spawn_blocking(move || daemon_snapshot(&cfg, &val, &name)).await {
        Ok(Ok((snap, replica))) => {
            r.replica = replica;
            r.received_lsn = Some(snap.received_lsn.clone());
            r.inflight_events = Some(snap.inflight_events);
            r.oldest_unconfirmed_event_age_seconds =
                Some(snap.oldest_unacked_event_age_seconds.unwrap_or(0.0));
            r.oldest_unconfirmed_source = Some("outboxd");
            r.outboxd = Some(snap);
        }
        Ok(Err(e)) => r.outboxd_error = Some(e),
        Err(e) => r.outboxd_error = Some(e.to_string()),
    }
    if r.slot_active == Some(false) && r.outboxd.is_none() {
        r.oldest_unconfirmed_event_age_seconds = oldest_pending_in_slot(&client, v).await;
        r.oldest_unconfirmed_source = Some("slot");
    }
    match KafkaSink::new(&config.kafka, config.kafka.admin_timeout.0) {
        Ok(sink) => match sink.check_brokers().await {
            Ok(_) => r.kafka_reachable = true,
            Err(e) => r.kafka_error = Some(e.to_string()),
        },
        Err(e) => r.kafka_error = Some(e.to_string()),
    }
    if v.transactional_id.is_some() && r.kafka_reachable {
        let kafka = &config.kafka;
        match crate::relay::exactly_once::read_progress(
            kafka,
            kafka.progress_topic(),
            v.slot.as_str(),
            kafka.admin_timeout.0,
        )
        .await
        {
            Ok(p) => r.progress = p,
            Err(e) => r.progress_error = Some(e.to_string()),
        }
    }
    let parks = match config.routing.on_poison {
        crate::config::OnPoison::Park => Ok(true),
        _ => left_parked(v).await,
    };
    match parks {
        Ok(true) => match crate::cli::parked::list(v).await {
            Ok(l) => r.parked = Some(l),
            Err(e) => r.parked_error = Some(e.to_string()),
        },
        Ok(false) => {}
        Err(e) => r.parked_error = Some(e),
    }
    Ok(r)
}

/// Sequences left from `routing.on_poison = "park"`, which the relay still
/// parks behind.
async fn left_parked(v: &Validated) -> Result<bool, String> {
    let client = admin::connect(&v.pg).await.map_err(|e| e.to_string())?;
    crate::park::ParkStore::waiting(&client, &v.table, v.slot.as_str())
        .await
        .map(|n| n.is_some_and(|n| n > 0))
        .map_err(|e| e.to_string())
}

/// The age of the first transaction still waiting in an idle slot (0 when
/// none is waiting).
async fn oldest_pending_in_slot(client: &tokio_postgres::Client, v: &Validated) -> Option<f64> {
    let rows = client
        .query(
            "SELECT data FROM pg_logical_slot_peek_binary_changes($1::text::name, NULL, 1,
                 'proto_version', '1', 'publication_names', $2::text)",
            &[&v.slot.as_str(), &v.publication.as_str()],
        )
        .await
        .ok()?;
    for row in rows {
        let data: Vec<u8> = row.get(0);
        if let Ok(LogicalMessage::Begin(b)) = decode(Bytes::from(data), false) {
            let now = chrono::Utc::now().timestamp_micros();
            return Some(now.saturating_sub(b.commit_time.unix_micros()).max(0) as f64 / 1e6);
        }
    }
    Some(0.0)
}

fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {} ({b} bytes)", UNITS[unit])
    }
}

impl StatusReport {
    /// The one-screen text form.
    pub fn render(&self) -> String {
        let mut o = String::new();
        let dash = || "-".to_owned();
        if self.source != crate::config::sources::DEFAULT_SOURCE {
            let _ = writeln!(o, "source          {}", self.source);
        }
        let _ = writeln!(o, "postgres        {}", self.postgres);
        if !self.slot_exists {
            let _ = writeln!(
                o,
                "slot            {} does not exist (outboxd creates it at start)",
                self.slot
            );
        } else {
            let active = match (self.slot_active, self.walsender_pid) {
                (Some(true), Some(pid)) => format!("active, walsender PID {pid}"),
                (Some(true), None) => "active".to_owned(),
                _ => "inactive (no outboxd is streaming)".to_owned(),
            };
            let _ = writeln!(o, "slot            {} {active}", self.slot);
            let _ = writeln!(
                o,
                "wal status      {}{}",
                self.wal_status.clone().unwrap_or_else(dash),
                match &self.invalidation_reason {
                    Some(reason) => format!(" (invalidated: {reason})"),
                    None => String::new(),
                }
            );
            if let (Some(false), Some(since)) = (self.slot_active, &self.inactive_since) {
                let _ = writeln!(o, "inactive since  {since}");
            }
            let failover = match self.failover_slot {
                Some(true) => "failover slot",
                Some(false) => "not a failover slot",
                None => "no failover slots before PostgreSQL 17",
            };
            let reading = self
                .outboxd
                .as_ref()
                .and_then(|s| s.failover.clone())
                .map(|f| format!("; {f}"))
                .unwrap_or_default();
            let _ = writeln!(o, "failover        {failover}{reading}");
            let _ = writeln!(
                o,
                "confirmed LSN   {}",
                self.confirmed_lsn.clone().unwrap_or_else(dash)
            );
            let _ = writeln!(
                o,
                "received LSN    {}",
                self.received_lsn.clone().unwrap_or_else(dash)
            );
            let _ = writeln!(
                o,
                "current WAL     {}",
                self.current_wal_lsn.clone().unwrap_or_else(dash)
            );
            let _ = writeln!(
                o,
                "lag             {}",
                self.lag_bytes.map(human_bytes).unwrap_or_else(dash)
            );
            let _ = writeln!(
                o,
                "retained WAL    {}",
                self.retained_wal_bytes.map(human_bytes).unwrap_or_else(dash)
            );
            let age = match (
                self.oldest_unconfirmed_event_age_seconds,
                self.oldest_unconfirmed_source,
            ) {
                (Some(a), Some(src)) if a > 0.0 => format!("{a:.1}s (from {src})"),
                (Some(_), Some(_)) => "none waiting".to_owned(),
                _ => dash(),
            };
            let _ = writeln!(o, "oldest waiting  {age}");
        }
        let daemon = match (&self.outboxd, &self.outboxd_error) {
            (Some(s), _) if s.ready => format!("ready, {} event(s) in flight", s.inflight_events),
            (Some(s), _) => format!("NOT READY: {}", s.not_ready_reasons.join("; ")),
            (None, Some(e)) => e.clone(),
            (None, None) => dash(),
        };
        let _ = writeln!(o, "outboxd         {daemon}");
        if let Some(r) = &self.replica {
            let _ = writeln!(
                o,
                "replica         {} of group {}: {} ({} source(s) assigned here, {} rebalance(s))",
                r.replica,
                r.group,
                if r.assigned {
                    "assigned here"
                } else {
                    "the group assigns this source to another replica"
                },
                r.assigned_count,
                r.rebalances
            );
        }
        let kafka = match &self.kafka_error {
            None => "reachable".to_owned(),
            Some(e) => format!("UNREACHABLE: {e}"),
        };
        let _ = writeln!(o, "kafka           {kafka}");
        match (&self.progress, &self.progress_error) {
            (Some(p), _) => {
                let _ = writeln!(
                    o,
                    "progress        {} (commit {}, by {} at {})",
                    p.commit_lsn, p.commit_time, p.writer, p.written_at
                );
            }
            (None, Some(e)) => {
                let _ = writeln!(o, "progress        UNREADABLE: {e}");
            }
            (None, None) => {}
        }
        match (&self.parked, &self.parked_error) {
            (Some(l), _) if l.is_empty() => {
                let _ = writeln!(o, "parked          none");
            }
            (Some(l), _) => {
                let events: i64 = l.iter().map(|s| s.events).sum();
                let _ = writeln!(
                    o,
                    "parked          {} sequence(s), {events} event(s): `outboxd parked list`",
                    l.len()
                );
                for s in l.iter().take(5) {
                    let _ = writeln!(
                        o,
                        "                {} key {:?}: {} event(s) since {}, head {} ({})",
                        s.topic, s.key, s.events, s.parked_at, s.head_id, s.head_reason
                    );
                }
            }
            (None, Some(e)) => {
                let _ = writeln!(o, "parked          UNREADABLE: {e}");
            }
            (None, None) => {}
        }
        if let Some(s) = &self.outboxd {
            if s.kafka_transactions_committed + s.kafka_transactions_aborted > 0 {
                let _ = writeln!(
                    o,
                    "kafka txns      {} committed, {} aborted",
                    s.kafka_transactions_committed, s.kafka_transactions_aborted
                );
            }
            for schema in &s.schemas {
                let subject = schema.subject.as_deref().unwrap_or("pinned id");
                let version = schema
                    .version
                    .map(|v| format!(" version {v}"))
                    .unwrap_or_default();
                let _ = writeln!(
                    o,
                    "schema          {} on {}: {subject}{version}, id {}",
                    schema.event_type, schema.topic, schema.id
                );
            }
        }
        o
    }
}

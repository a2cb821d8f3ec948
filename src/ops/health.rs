//! Liveness and readiness, shared between the relay and the HTTP server.
//!
//! * **Live** (`/healthz`): the replication loop has beaten within
//!   `health.liveness_timeout`. The loop beats on every status tick and
//!   while it waits to reconnect, so only a stuck loop fails this.
//! * **Ready** (`/readyz`): streaming from the slot right now; the last
//!   status update to PostgreSQL is recent; Kafka answered the last probe;
//!   if events are in flight, Kafka acknowledged one recently; the lag is
//!   within `health.max_lag_bytes`; the slot's retained WAL is within
//!   `health.max_retained_wal_bytes`. Not ready while reconnecting, while
//!   Kafka is down, or while lag is over its limit. Each failing condition
//!   is reported by name.
//!
//! All fields are atomics: the relay writes them without locks.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::Serialize;

pub use crate::config::Thresholds;

/// The relay's state as the probes see it.
#[derive(Debug)]
pub struct Health {
    start: Instant,
    thresholds: Thresholds,
    heartbeat_ms: AtomicU64,
    streaming: AtomicBool,
    last_status_ms: AtomicU64,
    last_ack_ms: AtomicU64,
    inflight: AtomicU64,
    kafka_ok: AtomicBool,
    lag_bytes: AtomicU64,
    retained_wal_bytes: AtomicU64,
    oldest_unacked_ms: AtomicU64,
    received_lsn: AtomicU64,
    confirmed_lsn: AtomicU64,
    walsender_pid: AtomicU64,
    standby: AtomicBool,
    server_wal_end: AtomicU64,
    /// Exactly-once: the last progress record's commit LSN (0: none yet).
    progress_lsn: AtomicU64,
    kafka_commits: AtomicU64,
    kafka_aborts: AtomicU64,
    /// The last failover-protection reading: whether protected, and its
    /// description (`None` before the first poll).
    failover: Mutex<Option<(bool, String)>>,
    /// The schemas the relay encodes with (registry formats only).
    schemas: Mutex<Option<crate::schema::InUseBoard>>,
    /// `routing.on_poison = "park"`: the parked sequences, as last read.
    parked: Mutex<Option<Parked>>,
}

/// The parked sequences, for `/status` (see [`crate::park`]).
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize, PartialEq)]
pub struct Parked {
    pub sequences: u64,
    pub events: u64,
    pub bytes: u64,
    pub oldest_age_seconds: Option<f64>,
    /// The oldest sequences (at most [`PARKED_SHOWN`]).
    pub oldest: Vec<ParkedSequence>,
}

/// One parked sequence in `/status`.
#[derive(Clone, Debug, Serialize, serde::Deserialize, PartialEq)]
pub struct ParkedSequence {
    pub topic: String,
    pub key: String,
    pub head_id: String,
    pub head_reason: String,
    pub events: i64,
    pub parked_at: String,
}

/// How many parked sequences `/status` lists.
pub const PARKED_SHOWN: usize = 20;

/// A point-in-time view for `/status` and `outboxd status`.
#[derive(Clone, Debug, Serialize, serde::Deserialize, PartialEq)]
pub struct Snapshot {
    pub live: bool,
    pub ready: bool,
    pub not_ready_reasons: Vec<String>,
    pub streaming: bool,
    /// Another outboxd leads this slot; this one waits to take over.
    pub standby: bool,
    pub walsender_pid: Option<u64>,
    pub received_lsn: String,
    pub confirmed_lsn: String,
    pub inflight_events: u64,
    pub oldest_unacked_event_age_seconds: Option<f64>,
    pub replication_lag_bytes: u64,
    pub slot_retained_wal_bytes: u64,
    pub kafka_reachable: bool,
    /// Exactly-once: the commit LSN in the last progress record committed
    /// (or read at start).
    #[serde(default)]
    pub progress_lsn: Option<String>,
    #[serde(default)]
    pub kafka_transactions_committed: u64,
    #[serde(default)]
    pub kafka_transactions_aborted: u64,
    /// Whether the slot would survive a promotion, and why (not) (see
    /// `outboxd check`).
    #[serde(default)]
    pub failover: Option<String>,
    /// Registry formats: the schema each (event type, topic) is encoded
    /// with.
    #[serde(default)]
    pub schemas: Vec<crate::schema::SchemaInUse>,
    /// Why the relay works but needs an operator (parked events); ready
    /// all the same.
    #[serde(default)]
    pub degraded: Vec<String>,
    /// `routing.on_poison = "park"`: the parked sequences.
    #[serde(default)]
    pub parked: Option<Parked>,
}

const NEVER: u64 = u64::MAX;

impl Health {
    pub fn new(thresholds: Thresholds) -> Self {
        Health {
            start: Instant::now(),
            thresholds,
            heartbeat_ms: AtomicU64::new(0),
            streaming: AtomicBool::new(false),
            last_status_ms: AtomicU64::new(NEVER),
            last_ack_ms: AtomicU64::new(NEVER),
            inflight: AtomicU64::new(0),
            kafka_ok: AtomicBool::new(true),
            lag_bytes: AtomicU64::new(0),
            retained_wal_bytes: AtomicU64::new(0),
            oldest_unacked_ms: AtomicU64::new(NEVER),
            received_lsn: AtomicU64::new(0),
            confirmed_lsn: AtomicU64::new(0),
            walsender_pid: AtomicU64::new(0),
            standby: AtomicBool::new(false),
            server_wal_end: AtomicU64::new(0),
            progress_lsn: AtomicU64::new(0),
            kafka_commits: AtomicU64::new(0),
            kafka_aborts: AtomicU64::new(0),
            failover: Mutex::new(None),
            schemas: Mutex::new(None),
            parked: Mutex::new(None),
        }
    }

    /// The parked sequences as last read (see [`crate::park`]).
    pub fn set_parked(&self, parked: Parked) {
        if let Ok(mut p) = self.parked.lock() {
            *p = Some(parked);
        }
    }

    fn parked(&self) -> Option<Parked> {
        self.parked.lock().ok().and_then(|p| p.clone())
    }

    /// Why the relay works but needs an operator: it stays ready.
    pub fn degraded_reasons(&self) -> Vec<String> {
        match self.parked() {
            Some(p) if p.sequences > 0 => vec![format!(
                "{} parked sequence(s), {} event(s): see `outboxd parked list`",
                p.sequences, p.events
            )],
            _ => Vec::new(),
        }
    }

    /// The server's current WAL end (`pg_current_wal_lsn()`), from a poll.
    pub fn set_server_wal_end(&self, lsn: u64) {
        self.server_wal_end.fetch_max(lsn, Ordering::Relaxed);
    }

    /// The highest server WAL end seen by a poll.
    pub fn server_wal_end(&self) -> u64 {
        self.server_wal_end.load(Ordering::Relaxed)
    }

    /// Waiting as a hot standby (another outboxd leads the slot), or not.
    pub fn set_standby(&self, standby: bool) {
        self.standby.store(standby, Ordering::Relaxed);
        self.beat();
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(NEVER - 1)
    }

    fn age(&self, at_ms: &AtomicU64) -> Option<Duration> {
        match at_ms.load(Ordering::Relaxed) {
            NEVER => None,
            t => Some(Duration::from_millis(self.now_ms().saturating_sub(t))),
        }
    }

    /// The loop is alive.
    pub fn beat(&self) {
        self.heartbeat_ms.store(self.now_ms(), Ordering::Relaxed);
    }

    /// Streaming started (with the walsender's PID) or stopped (`None`).
    pub fn set_streaming(&self, walsender_pid: Option<i32>) {
        self.streaming.store(walsender_pid.is_some(), Ordering::Relaxed);
        let pid = walsender_pid.and_then(|p| u64::try_from(p).ok()).unwrap_or(0);
        self.walsender_pid.store(pid, Ordering::Relaxed);
        self.beat();
    }

    /// A status update went to PostgreSQL.
    pub fn status_sent(&self, received: u64, confirmed: u64, lag_bytes: u64) {
        self.last_status_ms.store(self.now_ms(), Ordering::Relaxed);
        self.received_lsn.store(received, Ordering::Relaxed);
        self.confirmed_lsn.store(confirmed, Ordering::Relaxed);
        self.lag_bytes.store(lag_bytes, Ordering::Relaxed);
        self.beat();
    }

    /// Kafka acknowledged something at `at`.
    pub fn acked_at(&self, at: Instant) {
        let ms = u64::try_from(at.saturating_duration_since(self.start).as_millis()).unwrap_or(0);
        self.last_ack_ms.fetch_max(ms, Ordering::Relaxed);
    }

    /// Events in flight, and when the oldest of them was sent.
    pub fn set_inflight(&self, n: u64, oldest_sent: Option<Instant>) {
        self.inflight.store(n, Ordering::Relaxed);
        let ms = oldest_sent
            .map(|t| u64::try_from(t.saturating_duration_since(self.start).as_millis()).unwrap_or(0))
            .unwrap_or(NEVER);
        self.oldest_unacked_ms.store(ms, Ordering::Relaxed);
    }

    /// The result of the latest broker probe.
    pub fn set_kafka_reachable(&self, ok: bool) {
        self.kafka_ok.store(ok, Ordering::Relaxed);
    }

    /// The slot's retained WAL, from the latest poll.
    pub fn set_retained_wal(&self, bytes: u64) {
        self.retained_wal_bytes.store(bytes, Ordering::Relaxed);
    }

    /// `Ok` when live; otherwise why not.
    pub fn live(&self) -> Result<(), String> {
        let since = Duration::from_millis(
            self.now_ms()
                .saturating_sub(self.heartbeat_ms.load(Ordering::Relaxed)),
        );
        if since > self.thresholds.liveness_timeout {
            return Err(format!(
                "the replication loop has not run for {}s",
                since.as_secs()
            ));
        }
        Ok(())
    }

    /// Every reason not to be ready; empty when ready.
    pub fn not_ready_reasons(&self) -> Vec<String> {
        let t = &self.thresholds;
        let mut reasons = Vec::new();
        if self.standby.load(Ordering::Relaxed) {
            reasons.push("standby: another outboxd leads this slot".to_owned());
        } else if !self.streaming.load(Ordering::Relaxed) {
            reasons.push("not streaming from the replication slot (connecting or reconnecting)".to_owned());
        }
        match self.age(&self.last_status_ms) {
            None => reasons.push("no status update sent to PostgreSQL yet".to_owned()),
            Some(a) if a > t.status_max_age => reasons.push(format!(
                "last status update to PostgreSQL was {}s ago",
                a.as_secs()
            )),
            Some(_) => {}
        }
        if !self.kafka_ok.load(Ordering::Relaxed) {
            reasons.push("Kafka brokers are unreachable".to_owned());
        }
        if self.inflight.load(Ordering::Relaxed) > 0 {
            // With events waiting, Kafka must be acknowledging.
            let since_ack = self.age(&self.last_ack_ms);
            let oldest = self.age(&self.oldest_unacked_ms);
            let waited = since_ack.into_iter().chain(oldest).min().unwrap_or_default();
            if oldest.is_some_and(|o| o > t.ack_max_age) && waited > t.ack_max_age {
                reasons.push(format!(
                    "no Kafka acknowledgement for {}s with events in flight",
                    waited.as_secs()
                ));
            }
        }
        let lag = self.lag_bytes.load(Ordering::Relaxed);
        if t.max_lag_bytes.is_some_and(|max| lag > max) {
            reasons.push(format!(
                "replication lag {lag} bytes is over health.max_lag_bytes"
            ));
        }
        let retained = self.retained_wal_bytes.load(Ordering::Relaxed);
        if t.max_retained_wal_bytes.is_some_and(|max| retained > max) {
            reasons.push(format!(
                "the slot retains {retained} bytes of WAL, over health.max_retained_wal_bytes"
            ));
        }
        if t.require_failover_protection {
            match self.failover() {
                Some((true, _)) => {}
                Some((false, why)) => {
                    reasons.push(format!("failover {why} (health.require_failover_protection)"))
                }
                None => reasons.push(
                    "failover protection not checked yet (health.require_failover_protection)".to_owned(),
                ),
            }
        }
        reasons
    }

    /// The latest failover-protection reading.
    pub fn set_failover(&self, protected: bool, description: String) {
        if let Ok(mut f) = self.failover.lock() {
            *f = Some((protected, description));
        }
    }

    fn failover(&self) -> Option<(bool, String)> {
        self.failover.lock().ok().and_then(|f| f.clone())
    }

    /// Exactly-once: the progress record read at start.
    pub fn set_progress_lsn(&self, lsn: u64) {
        self.progress_lsn.store(lsn, Ordering::Relaxed);
    }

    /// Exactly-once: a Kafka transaction committed with this progress LSN.
    pub fn kafka_transaction_committed(&self, progress_lsn: u64) {
        self.kafka_commits.fetch_add(1, Ordering::Relaxed);
        self.progress_lsn.store(progress_lsn, Ordering::Relaxed);
    }

    /// Exactly-once: a Kafka transaction was aborted.
    pub fn kafka_transaction_aborted(&self) {
        self.kafka_aborts.fetch_add(1, Ordering::Relaxed);
    }

    /// The state for `/status`.
    pub fn snapshot(&self) -> Snapshot {
        let reasons = self.not_ready_reasons();
        let pid = self.walsender_pid.load(Ordering::Relaxed);
        Snapshot {
            live: self.live().is_ok(),
            ready: reasons.is_empty(),
            not_ready_reasons: reasons,
            streaming: self.streaming.load(Ordering::Relaxed),
            standby: self.standby.load(Ordering::Relaxed),
            walsender_pid: (pid != 0).then_some(pid),
            received_lsn: crate::Lsn(self.received_lsn.load(Ordering::Relaxed)).to_string(),
            confirmed_lsn: crate::Lsn(self.confirmed_lsn.load(Ordering::Relaxed)).to_string(),
            inflight_events: self.inflight.load(Ordering::Relaxed),
            oldest_unacked_event_age_seconds: self.age(&self.oldest_unacked_ms).map(|d| d.as_secs_f64()),
            replication_lag_bytes: self.lag_bytes.load(Ordering::Relaxed),
            slot_retained_wal_bytes: self.retained_wal_bytes.load(Ordering::Relaxed),
            kafka_reachable: self.kafka_ok.load(Ordering::Relaxed),
            progress_lsn: match self.progress_lsn.load(Ordering::Relaxed) {
                0 => None,
                lsn => Some(crate::Lsn(lsn).to_string()),
            },
            kafka_transactions_committed: self.kafka_commits.load(Ordering::Relaxed),
            kafka_transactions_aborted: self.kafka_aborts.load(Ordering::Relaxed),
            failover: self.failover().map(|(_, why)| why),
            schemas: self
                .schemas
                .lock()
                .ok()
                .and_then(|b| {
                    b.as_ref()
                        .and_then(|b| b.lock().ok().map(|m| m.values().cloned().collect()))
                })
                .unwrap_or_default(),
            degraded: self.degraded_reasons(),
            parked: self.parked(),
        }
    }

    /// Shows `board` (the schemas in use) in `/status`.
    pub fn show_schemas(&self, board: crate::schema::InUseBoard) {
        if let Ok(mut s) = self.schemas.lock() {
            *s = Some(board);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn thresholds() -> Thresholds {
        Thresholds {
            liveness_timeout: Duration::from_secs(60),
            status_max_age: Duration::from_secs(10),
            ack_max_age: Duration::from_millis(50),
            max_lag_bytes: Some(1000),
            max_retained_wal_bytes: Some(5000),
            require_failover_protection: false,
        }
    }

    #[test]
    fn readiness_names_each_problem() {
        let h = Health::new(thresholds());
        assert!(h.live().is_ok());
        let r = h.not_ready_reasons();
        assert!(
            r.iter().any(|r| r.contains("not streaming")) && r.iter().any(|r| r.contains("no status update"))
        );
        h.set_streaming(Some(42));
        h.status_sent(10, 5, 5);
        assert_eq!(h.not_ready_reasons(), Vec::<String>::new());
        assert_eq!(h.snapshot().walsender_pid, Some(42));

        h.set_kafka_reachable(false);
        assert!(h.not_ready_reasons()[0].contains("Kafka"));
        h.set_kafka_reachable(true);

        h.status_sent(10, 5, 2000);
        assert!(h.not_ready_reasons()[0].contains("lag"));
        h.status_sent(10, 5, 5);
        h.set_retained_wal(6000);
        assert!(h.not_ready_reasons()[0].contains("retains"));
        h.set_retained_wal(0);

        h.set_inflight(3, Some(Instant::now()));
        std::thread::sleep(Duration::from_millis(80));
        assert!(h.not_ready_reasons()[0].contains("acknowledgement"));
        h.acked_at(Instant::now());
        h.set_inflight(2, Some(Instant::now()));
        assert!(h.not_ready_reasons().is_empty());

        h.set_streaming(None);
        assert!(!h.snapshot().ready);
    }

    #[test]
    fn failover_protection_gates_readiness_only_when_required() {
        let ready = |h: &Health| {
            h.set_streaming(Some(1));
            h.status_sent(10, 5, 5);
            h.not_ready_reasons()
        };
        let h = Health::new(thresholds());
        h.set_failover(false, "unprotected: no standby".into());
        assert!(ready(&h).is_empty(), "not required: reported, not gating");
        assert_eq!(h.snapshot().failover.as_deref(), Some("unprotected: no standby"));

        let h = Health::new(Thresholds {
            require_failover_protection: true,
            ..thresholds()
        });
        assert!(ready(&h)[0].contains("not checked yet"));
        h.set_failover(false, "unprotected: no standby".into());
        assert!(ready(&h)[0].contains("failover unprotected: no standby"));
        h.set_failover(true, "protected: b holds a synced copy".into());
        assert!(ready(&h).is_empty());
    }
}

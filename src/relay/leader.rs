//! One streamer per slot (or polled table): leader election with a
//! PostgreSQL advisory lock held as a lease.
//!
//! Before it streams, outboxd takes a session-level advisory lock keyed by
//! the slot name (polling mode: the table), on a connection of its own. A
//! second outboxd with the same key fails to take it and waits as a hot
//! standby, trying again every second.
//!
//! # A lease, not a lock for ever
//!
//! A lock lives as long as its session, and a session outlives its client
//! in two ways: a client that is stopped (SIGSTOP, a paused VM, a hung
//! host) keeps its socket open, and one whose host vanished keeps it until
//! TCP gives up, hours later. Either would keep the standby waiting. So the
//! lock's session is a lease of `postgres.leader_timeout`:
//!
//! * PostgreSQL ends the session when it has heard no query for that long
//!   (`idle_session_timeout`, PostgreSQL 14+), and notices a vanished host
//!   by TCP keepalives (`tcp_keepalives_*`, `tcp_user_timeout`) set on the
//!   session. The lock goes with it, and the standby takes over within
//!   `leader_timeout` plus its one-second retry.
//! * The leader renews the lease with a query every quarter of
//!   `leader_timeout`, in a task of its own, so that nothing the relay
//!   waits for can let it lapse while the process runs.
//! * **Fencing.** The relay reads and sends only while the lease is
//!   fresh: renewed within three quarters of `leader_timeout` ([`Lease::fresh`]).
//!   A leader that wakes up after being stopped finds its lease stale
//!   before anything else, sends nothing while the renewal fails, and stops
//!   (its session is gone, and so is its walsender, which the new leader
//!   ended). What librdkafka had queued before the stop has been there
//!   longer than `message.timeout.ms`, which is `leader_timeout` by default,
//!   so librdkafka times it out instead of sending it.
//!
//! The slot itself is the second guard: PostgreSQL lets one walsender use
//! it, so two leaders could never both stream; the new leader ends the
//! walsender the stale one left behind ([`crate::postgres::admin::end_stale_walsender`]).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;
use tokio_postgres::Client;

use crate::config::conninfo::PgConnectConfig;
use crate::postgres::admin::{self, AdminError};

/// Advisory lock class for outboxd ("ob").
const LOCK_CLASS: i32 = 0x6f62;

/// The state of the lease, as the renewing task last saw it.
#[derive(Clone, Copy, Debug)]
pub struct Lease {
    /// When a renewal last succeeded.
    renewed_at: Instant,
    /// The lock's session is gone: leadership is lost for good.
    lost: bool,
    timeout: Duration,
}

impl Lease {
    /// Whether the leader may act: renewed recently enough that
    /// PostgreSQL cannot have ended the session, with a quarter of
    /// `leader_timeout` to spare.
    pub fn fresh(&self) -> bool {
        self.fresh_at(Instant::now())
    }

    /// [`Lease::fresh`] as of `now` (a clock read the caller already has).
    pub fn fresh_at(&self, now: Instant) -> bool {
        !self.lost && now.saturating_duration_since(self.renewed_at) < self.timeout * 3 / 4
    }

    pub fn lost(&self) -> bool {
        self.lost
    }
}

/// Leader election for one key. Keeps its connection between tries and
/// while leading: the lock lives exactly as long as that session.
#[derive(Debug)]
pub struct LeaderElection {
    pg: PgConnectConfig,
    /// What the lock is for, hashed into its key: `outboxd slot <slot>`.
    key: String,
    timeout: Duration,
    client: Option<Arc<Client>>,
    leading: bool,
    lease: watch::Sender<Lease>,
    renewer: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for LeaderElection {
    fn drop(&mut self) {
        if let Some(r) = self.renewer.take() {
            r.abort();
        }
    }
}

impl LeaderElection {
    /// An election for `key` (for example `outboxd slot outboxd`) with a
    /// lease of `timeout` (`postgres.leader_timeout`).
    pub fn new(pg: PgConnectConfig, key: String, timeout: Duration) -> Self {
        let (lease, _) = watch::channel(Lease {
            renewed_at: Instant::now(),
            lost: true,
            timeout,
        });
        LeaderElection {
            pg,
            key,
            timeout,
            client: None,
            leading: false,
            lease,
            renewer: None,
        }
    }

    /// The key of the lock that leads a slot.
    pub fn slot_key(slot: &str) -> String {
        format!("outboxd slot {slot}")
    }

    /// The key of the lock that leads polling of a table.
    pub fn polling_key(table: &str) -> String {
        format!("outboxd polling {table}")
    }

    /// Follows the lease: the relay stops acting when it is not fresh.
    pub fn lease(&self) -> watch::Receiver<Lease> {
        self.lease.subscribe()
    }

    /// Tries once to become (or stay) the leader. `Ok(false)`: another
    /// process leads.
    pub async fn try_lead(&mut self) -> Result<bool, AdminError> {
        // Held, fresh, and its session still open (a server restart closes
        // it before the next renewal notices).
        if self.still_held() && self.client.as_ref().is_some_and(|c| !c.is_closed()) {
            return Ok(true);
        }
        self.stop_renewing();
        if self.client.as_ref().is_none_or(|c| c.is_closed()) {
            self.client = Some(Arc::new(self.connect().await?));
        }
        let Some(client) = self.client.clone() else {
            return Ok(false);
        };
        let result = client
            .query_one(
                "SELECT pg_try_advisory_lock($1, hashtext($2::text))",
                &[&LOCK_CLASS, &self.key],
            )
            .await;
        match result {
            Ok(row) => {
                self.leading = row.get(0);
                if self.leading {
                    self.start_renewing(client);
                }
                Ok(self.leading)
            }
            Err(e) => {
                self.client = None;
                Err(e.into())
            }
        }
    }

    /// Whether the lease is held and fresh.
    pub fn still_held(&self) -> bool {
        self.still_held_at(Instant::now())
    }

    /// [`LeaderElection::still_held`] as of `now`.
    pub fn still_held_at(&self, now: Instant) -> bool {
        self.leading && self.lease.borrow().fresh_at(now)
    }

    /// A connection whose session PostgreSQL ends when this process stops
    /// renewing it, or its host disappears.
    async fn connect(&self) -> Result<Client, AdminError> {
        let client = admin::connect(&self.pg).await?;
        let version = crate::postgres::publication::server_version(&client).await?;
        let idle = self.timeout.as_millis().max(1);
        let mut settings = format!(
            "SET tcp_keepalives_idle = {keepalive}; SET tcp_keepalives_interval = 1; SET tcp_keepalives_count = 3;",
            keepalive = (self.timeout.as_secs() / 2).max(1),
        );
        if version >= 120_000 {
            settings.push_str(&format!(" SET tcp_user_timeout = {idle};"));
        }
        if version >= 140_000 {
            settings.push_str(&format!(" SET idle_session_timeout = {idle};"));
        } else {
            tracing::warn!("PostgreSQL before 14 has no idle_session_timeout: a stopped (not crashed) leader keeps the leader lock until its host's TCP gives up");
        }
        client.batch_execute(&settings).await?;
        Ok(client)
    }

    fn start_renewing(&mut self, client: Arc<Client>) {
        let (lease, timeout) = (self.lease.clone(), self.timeout);
        // send_replace: the value changes even while no one subscribes.
        lease.send_replace(Lease {
            renewed_at: Instant::now(),
            lost: false,
            timeout,
        });
        self.renewer = Some(tokio::spawn(async move {
            let every = timeout / 4;
            loop {
                tokio::time::sleep(every).await;
                let ping = tokio::time::timeout(timeout / 2, client.simple_query("SELECT 1")).await;
                let renewed = matches!(ping, Ok(Ok(_))) && !client.is_closed();
                lease.send_modify(|l| {
                    if renewed {
                        l.renewed_at = Instant::now();
                    } else {
                        l.lost = true;
                    }
                });
                if !renewed {
                    tracing::warn!("the leader lock's session did not answer: leadership is lost");
                    return;
                }
            }
        }));
    }

    fn stop_renewing(&mut self) {
        let was_leading = std::mem::take(&mut self.leading);
        if let Some(r) = self.renewer.take() {
            r.abort();
        }
        self.lease.send_modify(|l| l.lost = true);
        // The lease lapsed or its session ended: give the lock up for
        // certain (closing the session) and start over. A standby keeps
        // its session between tries.
        if was_leading {
            self.client = None;
        }
    }
}

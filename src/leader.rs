//! One streamer per slot: leader election with a PostgreSQL advisory lock.
//!
//! Before it streams, outboxd takes a session-level advisory lock keyed by
//! the slot name, on a connection of its own that it keeps open. A second
//! outboxd configured for the same slot fails to take it and waits as a hot
//! standby, trying again every second. When the leader dies (even by
//! SIGKILL), PostgreSQL closes its session and releases the lock, and the
//! standby takes over.
//!
//! While streaming, the leader checks its lock connection on a timer; if
//! that connection is gone, so is the lock, and it stops streaming at once
//! (another instance may already be taking over). The slot itself is the
//! second guard: PostgreSQL lets only one walsender use it, so even two
//! leaders could never both stream.

use tokio_postgres::Client;

use crate::pg::admin::{self, AdminError};
use crate::pg::conninfo::PgConnectConfig;
use crate::pg::ident::SlotName;

/// Advisory lock class for outboxd ("ob").
const LOCK_CLASS: i32 = 0x6f62;

/// Leader election for one slot. Keeps its connection between tries and
/// while leading: the lock lives exactly as long as that session.
#[derive(Debug)]
pub struct LeaderElection {
    pg: PgConnectConfig,
    slot: SlotName,
    client: Option<Client>,
    leading: bool,
}

impl LeaderElection {
    pub fn new(pg: PgConnectConfig, slot: SlotName) -> Self {
        LeaderElection {
            pg,
            slot,
            client: None,
            leading: false,
        }
    }

    /// Tries once to become (or stay) the leader. `Ok(false)`: another
    /// process leads.
    pub async fn try_lead(&mut self) -> Result<bool, AdminError> {
        if self.leading && self.still_held().await {
            return Ok(true);
        }
        self.leading = false;
        if self.client.as_ref().is_none_or(Client::is_closed) {
            self.client = Some(admin::connect(&self.pg).await?);
        }
        let Some(client) = &self.client else {
            return Ok(false);
        };
        let result = client
            .query_one(
                "SELECT pg_try_advisory_lock($1, hashtext('outboxd slot ' || $2::text))",
                &[&LOCK_CLASS, &self.slot.as_str()],
            )
            .await;
        match result {
            Ok(row) => {
                self.leading = row.get(0);
                Ok(self.leading)
            }
            Err(e) => {
                self.client = None;
                Err(e.into())
            }
        }
    }

    /// Whether the lock is still held: its session must still answer.
    pub async fn still_held(&self) -> bool {
        match &self.client {
            Some(c) if self.leading => !c.is_closed() && c.simple_query("SELECT 1").await.is_ok(),
            _ => false,
        }
    }
}

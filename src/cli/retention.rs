//! `outboxd retention` for a partitioned outbox: old partitions are
//! dropped whole, which is what tables are partitioned for, instead of
//! deleted row by row.
//!
//! A partition may go once every row in it is older than the cutoff and
//! the slot has confirmed past every row in it. The first holds when the
//! outbox is range-partitioned on `created_at` and the partition's upper
//! bound lies at or before the cutoff. The second is shown per partition,
//! in one transaction:
//!
//! 1. `LOCK TABLE <partition> IN SHARE MODE` waits for every transaction
//!    that inserted into it to end, and keeps new inserts out (an old
//!    partition gets none, so nobody waits on it in practice);
//! 2. `pg_current_wal_insert_lsn()` is then past the commit of every row
//!    the partition holds;
//! 3. once the slot's `confirmed_flush_lsn` reaches that position (waited
//!    for, bounded), Kafka has acknowledged every one of them, and the
//!    partition is dropped in the same transaction.
//!
//! In polling mode (and with `--published-only`) a partition that still
//! holds a row without `published_at` is kept instead. Logical decoding
//! reads a dropped table's rows with the catalog as it was when they were
//! written, so dropping a partition never disturbs the stream. Partitions
//! that straddle the cutoff are trimmed row by row afterwards, as an
//! unpartitioned table is.

use std::time::Duration;

use tokio_postgres::Client;

use crate::config::ident::{SlotName, TableName};
use crate::lsn::Lsn;
use crate::postgres::admin::AdminError;

/// What happened to one old partition.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PartitionOutcome {
    /// Dropped: every row in it was older than `upper` and delivered.
    Dropped { partition: String, upper: String },
    /// Kept, and why (run retention again later).
    Kept { partition: String, reason: String },
}

impl std::fmt::Display for PartitionOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PartitionOutcome::Dropped { partition, upper } => {
                write!(f, "dropped partition {partition} (rows created before {upper})")
            }
            PartitionOutcome::Kept { partition, reason } => write!(f, "kept partition {partition}: {reason}"),
        }
    }
}

/// Who must have passed a partition before it goes.
#[derive(Clone, Copy, Debug)]
pub enum Passed<'a> {
    /// CDC: the slot must have confirmed past every row in it, within
    /// `wait`.
    Slot { slot: &'a SlotName, wait: Duration },
    /// Polling: every row in it must be published.
    Published,
}

/// The outbox's partitions whose rows are all older than `older_than`,
/// oldest first, when the table is range-partitioned on `created_at`;
/// empty otherwise. Each as (`schema.name`, its upper bound).
async fn old_partitions(
    client: &Client,
    table: &TableName,
    older_than: Duration,
) -> Result<Vec<(String, String)>, AdminError> {
    // pg_get_expr writes the bound's constant in the session's DateStyle.
    client
        .batch_execute("SET DateStyle = 'ISO'; SET TimeZone = 'UTC'")
        .await?;
    let rows = client
        .query(
            r"SELECT format('%I.%I', n.nspname, c.relname), b.upper::text
                FROM pg_catalog.pg_class r
                JOIN pg_catalog.pg_namespace rn ON rn.oid = r.relnamespace
                JOIN pg_catalog.pg_partitioned_table pt ON pt.partrelid = r.oid
                JOIN pg_catalog.pg_attribute a ON a.attrelid = r.oid AND a.attnum = pt.partattrs[0]
                JOIN pg_catalog.pg_inherits i ON i.inhparent = r.oid
                JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid
                JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace,
                LATERAL (SELECT substring(pg_catalog.pg_get_expr(c.relpartbound, c.oid)
                                          FROM $$TO \('([^']*)'\)$$)::timestamptz AS upper) b
               WHERE rn.nspname = $1 AND r.relname = $2 AND r.relkind = 'p'
                 AND pt.partstrat = 'r' AND pt.partnatts = 1 AND a.attname = 'created_at'
                 AND b.upper IS NOT NULL AND b.upper <= now() - make_interval(secs => $3)
               ORDER BY b.upper",
            &[&table.schema, &table.name, &older_than.as_secs_f64()],
        )
        .await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// Drops the partitions of `table` whose rows are all older than
/// `older_than` and that `passed` says are delivered (see the module doc).
pub async fn drop_old_partitions(
    client: &mut Client,
    table: &TableName,
    older_than: Duration,
    passed: Passed<'_>,
) -> Result<Vec<PartitionOutcome>, AdminError> {
    let mut out = Vec::new();
    for (partition, upper) in old_partitions(client, table, older_than).await? {
        let outcome = drop_one(client, &partition, &upper, passed).await?;
        tracing::info!(%outcome, "retention");
        out.push(outcome);
    }
    Ok(out)
}

async fn drop_one(
    client: &mut Client,
    partition: &str,
    upper: &str,
    passed: Passed<'_>,
) -> Result<PartitionOutcome, AdminError> {
    let kept = |reason: String| PartitionOutcome::Kept {
        partition: partition.to_owned(),
        reason,
    };
    let tx = client.transaction().await?;
    tx.batch_execute("SET LOCAL lock_timeout = '10s'").await?;
    // `partition` is format('%I.%I'): quoted as an identifier already.
    if let Err(e) = tx
        .batch_execute(&format!("LOCK TABLE {partition} IN SHARE MODE"))
        .await
    {
        if e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) {
            return Ok(kept(
                "a transaction holding it did not end within 10 s".to_owned(),
            ));
        }
        return Err(e.into());
    }
    match passed {
        Passed::Published => {
            let unpublished: bool = tx
                .query_one(
                    &format!("SELECT EXISTS (SELECT 1 FROM {partition} WHERE published_at IS NULL)"),
                    &[],
                )
                .await?
                .get(0);
            if unpublished {
                return Ok(kept("it holds rows not yet published".to_owned()));
            }
        }
        Passed::Slot { slot, wait } => {
            let end: String = tx
                .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
                .await?
                .get(0);
            let end: Lsn = end.parse().unwrap_or(Lsn::ZERO);
            let deadline = tokio::time::Instant::now() + wait;
            loop {
                let confirmed: Option<String> = tx
                    .query_opt(
                        "SELECT confirmed_flush_lsn::text FROM pg_catalog.pg_replication_slots WHERE slot_name = $1",
                        &[&slot.as_str()],
                    )
                    .await?
                    .and_then(|r| r.get(0));
                let confirmed: Option<Lsn> = confirmed.and_then(|c| c.parse().ok());
                match confirmed {
                    None => return Ok(kept(format!("slot {} does not exist", slot.as_str()))),
                    Some(c) if c >= end => break,
                    Some(c) if tokio::time::Instant::now() >= deadline => {
                        return Ok(kept(format!(
                        "slot {} has confirmed {c}, not yet past its rows (WAL {end}); is outboxd running?",
                        slot.as_str()
                    )))
                    }
                    Some(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                }
            }
        }
    }
    if let Err(e) = tx.batch_execute(&format!("DROP TABLE {partition}")).await {
        if e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) {
            return Ok(kept(
                "the outbox table was busy for 10 s (dropping a partition locks it briefly)".to_owned(),
            ));
        }
        return Err(e.into());
    }
    tx.commit().await?;
    Ok(PartitionOutcome::Dropped {
        partition: partition.to_owned(),
        upper: upper.to_owned(),
    })
}

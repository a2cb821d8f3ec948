//! Outbox retention and monitoring (seed 000).
//!
//! In CDC mode the outbox table is only an audit trail: outboxd reads the
//! rows from the WAL, so a row may be deleted at any time after its
//! transaction commits, even in the same transaction that inserted it.
//! [`delete_older_than`] trims the table in small batches, each its own
//! short statement that skips locked rows, so it never holds long locks.

use std::time::Duration;

use tokio_postgres::GenericClient;

use crate::error::SdkError;
use crate::schema::TableName;

/// Which rows retention may delete.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retain {
    /// CDC mode: every row older than the cutoff (the WAL already carried it).
    Cdc,
    /// Polling mode: only rows already published (`published_at` set).
    PublishedOnly,
}

/// Deletes rows created before `now() - older_than`, `batch` rows per
/// statement, until none are left; returns the number deleted.
///
/// ```no_run
/// # async fn example(client: &tokio_postgres::Client) -> Result<(), outbox_sdk::SdkError> {
/// use outbox_sdk::retention::{delete_older_than, Retain};
/// use outbox_sdk::schema::TableName;
/// let week = std::time::Duration::from_secs(7 * 24 * 3600);
/// let deleted = delete_older_than(client, &TableName::outbox(), week, 5_000, Retain::Cdc).await?;
/// # Ok(()) }
/// ```
pub async fn delete_older_than<C: GenericClient>(
    client: &C,
    table: &TableName,
    older_than: Duration,
    batch: i64,
    retain: Retain,
) -> Result<u64, SdkError> {
    let only_published = retain == Retain::PublishedOnly;
    let sql = format!(
        "DELETE FROM {t} WHERE id IN (
             SELECT id FROM {t}
              WHERE created_at < now() - make_interval(secs => $1)
                AND ($2 = false OR published_at IS NOT NULL)
              LIMIT $3
                FOR UPDATE SKIP LOCKED)",
        t = table.quoted()
    );
    let secs = older_than.as_secs_f64();
    let batch = batch.max(1);
    let mut total = 0;
    loop {
        let n = client.execute(&sql, &[&secs, &only_published, &batch]).await?;
        total += n;
        if n < batch as u64 {
            return Ok(total);
        }
    }
}

/// The seed's monitoring query: how long the oldest unpublished row has
/// waited (`None` when every row is published). Meaningful in polling mode;
/// in CDC mode `published_at` stays NULL and the slot's lag is the measure.
pub async fn oldest_unpublished_age<C: GenericClient>(
    client: &C,
    table: &TableName,
) -> Result<Option<Duration>, SdkError> {
    let sql = format!(
        "SELECT EXTRACT(EPOCH FROM now() - MIN(created_at))::float8 FROM {} WHERE published_at IS NULL",
        table.quoted()
    );
    let row = client.query_one(&sql, &[]).await?;
    Ok(row
        .get::<_, Option<f64>>(0)
        .map(|s| Duration::from_secs_f64(s.max(0.0))))
}

//! Applying the shipped migrations.
//!
//! Each migration runs once, in order, in its own transaction, and is
//! recorded in `outbox_schema_migrations` with a checksum of its text. A
//! session-level advisory lock serializes concurrent runs (two pods starting
//! at once): the second waits, then finds everything applied. A migration
//! whose text changed after it was applied is an error: migrations are
//! append-only.

use tokio_postgres::Client;

use crate::error::SdkError;
use crate::schema::{Migration, MIGRATIONS};

/// Advisory lock key: "outbox" in ASCII.
const LOCK_KEY: i64 = 0x6f75_7462_6f78;

/// FNV-1a 64-bit: a stable fingerprint of a migration's text.
fn checksum(sql: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in sql.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// Applies every pending migration; returns the names it applied.
///
/// ```no_run
/// # async fn example(client: &mut tokio_postgres::Client) -> Result<(), outbox_sdk::SdkError> {
/// let applied = outbox_sdk::migrate::migrate(client).await?;
/// println!("applied {applied:?}");
/// # Ok(()) }
/// ```
pub async fn migrate(client: &mut Client) -> Result<Vec<&'static str>, SdkError> {
    migrate_to(client, i32::MAX).await
}

/// Applies the pending migrations numbered up to `last_version` only: for a
/// rollout in stages, or to stay on a schema an older release expects.
pub async fn migrate_to(client: &mut Client, last_version: i32) -> Result<Vec<&'static str>, SdkError> {
    let wanted: Vec<Migration> = MIGRATIONS
        .iter()
        .filter(|m| m.version <= last_version)
        .copied()
        .collect();
    client
        .execute("SELECT pg_advisory_lock($1)", &[&LOCK_KEY])
        .await?;
    let result = apply_pending(client, &wanted).await;
    // Unlock even after a failure; the lock also ends with the session.
    let unlocked = client
        .execute("SELECT pg_advisory_unlock($1)", &[&LOCK_KEY])
        .await;
    let applied = result?;
    unlocked?;
    Ok(applied)
}

async fn apply_pending(client: &mut Client, migrations: &[Migration]) -> Result<Vec<&'static str>, SdkError> {
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS outbox_schema_migrations (
                 version    int         PRIMARY KEY,
                 name       text        NOT NULL,
                 checksum   text        NOT NULL,
                 applied_at timestamptz NOT NULL DEFAULT now()
             )",
        )
        .await?;
    let rows = client
        .query("SELECT version, checksum FROM outbox_schema_migrations", &[])
        .await?;
    let done: std::collections::HashMap<i32, String> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    let mut applied = Vec::new();
    for m in migrations {
        let sum = checksum(m.sql);
        if let Some(previous) = done.get(&m.version) {
            if *previous != sum {
                return Err(SdkError::MigrationChanged {
                    name: m.name,
                    applied: previous.clone(),
                    current: sum,
                });
            }
            continue;
        }
        let tx = client.transaction().await?;
        tx.batch_execute(m.sql).await?;
        tx.execute(
            "INSERT INTO outbox_schema_migrations (version, name, checksum) VALUES ($1, $2, $3)",
            &[&m.version, &m.name, &sum],
        )
        .await?;
        tx.commit().await?;
        applied.push(m.name);
    }
    Ok(applied)
}

#[cfg(test)]
mod tests {
    use super::checksum;

    #[test]
    fn checksum_is_stable_and_sensitive() {
        assert_eq!(checksum(""), "cbf29ce484222325");
        assert_eq!(checksum("a"), "af63dc4c8601ec8c");
        assert_ne!(checksum("CREATE TABLE a ()"), checksum("CREATE TABLE b ()"));
    }
}

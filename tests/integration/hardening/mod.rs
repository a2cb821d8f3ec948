//! The second hardening round: each class of loss, misrouting or wedge
//! that the adversarial review found on real shapes, reproduced against
//! the real binary, PostgreSQL and Apache Kafka (README, "Guarantees").
//!
//! | class | test |
//! |---|---|
//! | 1. a partitioned outbox | `every_version::partitioned` |
//! | 2. a publication changed while no session streamed | `every_version::publication_window` |
//! | 3. a WAL history that went back (a restored copy) | `every_version::rewound` |
//! | 4. librdkafka's implicit acknowledgements | `implicit_ack` |
//! | 5. a slot register that cannot be read; 12. its commit time kept | `register` |
//! | 6. emitted messages outboxd would not receive; 7. forged ones | `every_version::emit` |
//! | 8. exactly-once: a refused record in an open transaction, and COPY | `refused_in_transaction` |
//! | 9. polling and replay on a record the broker refuses; 10. polling order | `polling` |
//! | 11. a frozen leader | `frozen_leader` |
//! | 13. a gap replayed before the relay resumes | `recovery` |
//!
//! Classes 1, 2, 3, 6 and 7 depend on the server's version, so their
//! tests live in `every_version` (run on each supported PostgreSQL).
//! Class 14 (no secret in `Debug` output) is a unit test in `config/`.

mod frozen_leader;
mod implicit_ack;
mod polling;
mod recovery;
mod refused_in_transaction;
mod register;

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use uuid::Uuid;

use crate::harness::broker::{consume_to_end, Consumed};
use crate::harness::wait_for;
use crate::relay::{bin, config_text, write_config, Daemon};

/// A unique prefix for a test's topics.
pub(crate) fn prefix(hint: &str) -> String {
    format!("{hint}{}", &Uuid::new_v4().simple().to_string()[..8])
}

/// Writes a daemon config for `db_url` and `slot`, topics `<prefix>.<type>`,
/// with `routing` and `kafka` appended to their sections and `extra` at the
/// end; returns its path.
#[allow(clippy::too_many_arguments)]
pub(crate) fn daemon_config(
    dir: &Path,
    name: &str,
    db_url: &str,
    slot: &str,
    brokers: &str,
    prefix: &str,
    routing: &str,
    kafka: &str,
    extra: &str,
) -> PathBuf {
    let text = config_text(
        db_url,
        slot,
        brokers,
        &format!("topic = \"{prefix}.{{aggregate_type}}\"\n{routing}"),
        kafka,
    );
    write_config(dir, name, &format!("{text}\n{extra}\n"))
}

/// Runs `outboxd <args>` to its end: its exit code, stdout and stderr.
pub(crate) fn outboxd(args: &[&str]) -> (Option<i32>, String, String) {
    let out = Command::new(bin())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `outboxd <args>` off the async threads.
pub(crate) async fn outboxd_async(args: &[&str]) -> (Option<i32>, String, String) {
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    tokio::task::spawn_blocking(move || {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        outboxd(&refs)
    })
    .await
    .unwrap()
}

/// Waits until the daemon has exited; its exit code.
pub(crate) async fn exits(d: &mut Daemon, within: Duration, log: &Path) -> Option<i32> {
    let deadline = std::time::Instant::now() + within;
    let status = loop {
        if let Some(status) = d.try_wait() {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "outboxd did not exit within {within:?}; its log ends:\n{}",
            last_lines(log, 40)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!("outboxd exited with {status}: {}", tail(log));
    status.code()
}

/// The last lines of a log.
pub(crate) fn tail(log: &Path) -> String {
    last_lines(log, 8)
}

/// The last `n` lines of a log.
fn last_lines(log: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The whole log.
pub(crate) fn log_text(log: &Path) -> String {
    std::fs::read_to_string(log).unwrap_or_default()
}

/// The records of `topics` up to their ends now.
pub(crate) async fn records(brokers: &str, topics: &[&str]) -> Vec<Consumed> {
    let brokers = brokers.to_owned();
    let topics: Vec<String> = topics.iter().map(|t| (*t).to_owned()).collect();
    tokio::task::spawn_blocking(move || {
        let refs: Vec<&str> = topics.iter().map(String::as_str).collect();
        consume_to_end(&brokers, &refs, Duration::from_secs(60))
    })
    .await
    .unwrap()
}

/// The `id` headers of `records`.
pub(crate) fn ids(records: &[Consumed]) -> HashSet<Uuid> {
    records
        .iter()
        .filter_map(|r| r.header("id")?.parse().ok())
        .collect()
}

/// Waits until every id of `want` is in `topics`; their records.
pub(crate) async fn wait_ids(brokers: &str, topics: &[&str], want: &HashSet<Uuid>) -> Vec<Consumed> {
    wait_for("the events in Kafka", Duration::from_secs(120), || async {
        let recs = records(brokers, topics).await;
        want.is_subset(&ids(&recs)).then_some(recs)
    })
    .await
}

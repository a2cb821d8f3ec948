//! Class 3: a WAL history that went back. A data directory restored from a
//! copy keeps the system identifier and the timeline, and new transactions
//! reuse the LSNs after the copy's end. In exactly-once mode, before, the
//! progress record made outboxd skip them as "already in Kafka".

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use uuid::Uuid;

use crate::hardening::{daemon_config, exits, log_text, outboxd_async, prefix, wait_ids};
use crate::harness::broker::{broker, consume};
use crate::harness::postgres::{self, PgServer};
use crate::harness::wait_for;
use crate::relay::{confirmed_flush, write_events, Daemon};

/// Stops the server, or starts it.
fn pg_ctl(pg: &PgServer, args: &[&str]) {
    pg.pg_ctl(args).unwrap_or_else(|e| panic!("{e}"));
}

/// Copies a stopped server's data directory (`cp -a`, keeping owners).
fn copy_dir(from: &Path, to: &Path) {
    let status = std::process::Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .status()
        .unwrap();
    assert!(status.success(), "cp -a {} {}", from.display(), to.display());
}

/// The data directory as it was in `backup`: the WAL goes back to the
/// copy's end.
fn restore(pg: &PgServer, backup: &Path) {
    pg_ctl(pg, &["stop", "-m", "fast"]);
    std::fs::remove_dir_all(&pg.data_dir).unwrap();
    copy_dir(backup, &pg.data_dir);
    start(pg);
}

fn start(pg: &PgServer) {
    pg_ctl(
        pg,
        &[
            "start",
            "-w",
            "-t",
            "60",
            "-l",
            &pg.log_file.display().to_string(),
        ],
    );
}

/// Runs the restore scenario in one delivery mode: `kafka` is appended to
/// `[kafka]`; `read` reads the topic's records.
/// A dedicated server with the outbox, and outboxd's config for it (slot
/// `rewound`); `kafka` is appended to `[kafka]` (`{prefix}` replaced).
struct Rewinding {
    pg: PgServer,
    dir: tempfile::TempDir,
    cfg: std::path::PathBuf,
    log: std::path::PathBuf,
    topic: String,
    kafka: String,
}

impl Rewinding {
    async fn new(name: &str, kafka: &str) -> Rewinding {
        let pg = postgres::dedicated("");
        let mut admin = pg.client("postgres").await;
        outbox_sdk::migrate::migrate(&mut admin).await.unwrap();
        let dir = tempfile::tempdir().unwrap();
        let p = prefix(name);
        let kafka = kafka.replace("{prefix}", &p);
        let cfg = daemon_config(
            dir.path(),
            "rw.toml",
            &pg.url("postgres", None, "postgres"),
            "rewound",
            &broker().brokers,
            &p,
            "",
            &kafka,
            "",
        );
        let log = dir.path().join("rw.log");
        Rewinding {
            pg,
            dir,
            cfg,
            log,
            topic: format!("{p}.order"),
            kafka,
        }
    }

    /// Starts outboxd, has it publish 40 events, and stops it.
    async fn publish_first(&self) {
        let daemon = Daemon::start(&self.cfg, &self.log);
        let client = self.pg.client("postgres").await;
        wait_for("the slot", Duration::from_secs(30), || async {
            confirmed_flush(&client, "rewound").await
        })
        .await;
        let (first, _) = write_events(&client, 20, 2, 4, &["Order"], 0).await;
        wait_ids(
            &broker().brokers,
            &[&self.topic],
            &first.iter().map(|e| e.id).collect(),
        )
        .await;
        assert!(daemon.sigterm().success());
    }
}

async fn scenario(name: &str, kafka: &str) {
    let r = Rewinding::new(name, kafka).await;
    let (pg, cfg, log, topic, kafka) = (&r.pg, &r.cfg, &r.log, &r.topic, &r.kafka);
    let brokers = &broker().brokers;
    let c = cfg.to_str().unwrap();
    r.publish_first().await;

    // The copy, then more events published from the original.
    pg_ctl(pg, &["stop", "-m", "fast"]);
    let backup = pg.scratch_dir("outboxd-rewound-").join("data");
    copy_dir(&pg.data_dir, &backup);
    start(pg);
    let client = pg.client("postgres").await;
    let daemon = Daemon::start(cfg, log);
    let (second, _) = write_events(&client, 20, 2, 4, &["Order"], 20).await;
    wait_ids(brokers, &[topic], &second.iter().map(|e| e.id).collect()).await;
    assert!(daemon.sigterm().success());
    drop(client);

    // Back to the copy: the WAL of `second` is gone. At once, what Kafka
    // remembers lies past the server's WAL.
    restore(pg, &backup);
    let (code, out, _) = outboxd_async(&["check", "--config", c]).await;
    assert_ne!(code, Some(0), "{out}");
    assert!(out.contains("went back"), "{out}");
    let mut refused = Daemon::start(cfg, log);
    assert_eq!(exits(&mut refused, Duration::from_secs(30), log).await, Some(1));
    assert!(log_text(log).contains("WAL history of this PostgreSQL system went back"));

    // New transactions reuse the LSNs, far past where `second` ended.
    let client = pg.client("postgres").await;
    let slot_before = confirmed_flush(&client, "rewound").await.unwrap();
    let (third, _) = write_events(&client, 200, 5, 10, &["Order"], 40).await;
    let mut refused = Daemon::start(cfg, log);
    assert_eq!(exits(&mut refused, Duration::from_secs(60), log).await, Some(1));
    let text = log_text(log);
    assert!(
        text.matches("WAL history of this PostgreSQL system went back")
            .count()
            >= 2,
        "{text}"
    );
    assert_eq!(
        confirmed_flush(&client, "rewound").await,
        Some(slot_before),
        "nothing was confirmed past the slot's position"
    );

    // The operator accepts this server's history: everything new arrives.
    let (code, out, err) = outboxd_async(&["progress", "--config", c, "--reset"]).await;
    assert_eq!(code, Some(0), "{out}{err}");
    let daemon = Daemon::start(cfg, log);
    let want: HashSet<Uuid> = third.iter().map(|e| e.id).collect();
    let recs = wait_ids(brokers, &[topic], &want).await;
    assert!(daemon.sigterm().success());
    if kafka.contains("exactly-once") {
        // read_committed: each new event once.
        let brokers = brokers.to_owned();
        let topic2 = topic.clone();
        let committed = tokio::task::spawn_blocking(move || {
            consume(&brokers, &[&topic2], usize::MAX, Duration::from_secs(5))
        })
        .await
        .unwrap();
        let new: Vec<&str> = committed
            .iter()
            .filter_map(|r| r.header("id"))
            .filter(|id| id.parse().is_ok_and(|id: Uuid| want.contains(&id)))
            .collect();
        assert_eq!(new.len(), want.len(), "each new event once to read_committed");
    }
    drop(recs);
    pg_ctl(pg, &["stop", "-m", "immediate"]);
    drop(r.dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_refuses_a_restored_database_instead_of_skipping_its_new_transactions() {
    scenario(
        "rwe",
        "delivery = \"exactly-once\"\nprogress_topic = \"{prefix}.progress\"",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_least_once_refuses_to_stream_a_restored_database_silently() {
    scenario("rwa", "progress_topic = \"{prefix}.progress\"").await;
}

/// A base backup has no slots (pg_basebackup leaves `pg_replslot` out): a
/// server restored from one has neither the WAL Kafka's position lies in
/// nor the slot. It is named a rewind, whose recovery warns of events
/// Kafka holds for transactions the server no longer has, not a dropped
/// slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_without_the_slot_is_named_a_rewind_not_a_drop() {
    let r = Rewinding::new("rwslot", "progress_topic = \"{prefix}.progress\"").await;
    let c = r.cfg.to_str().unwrap();
    r.publish_first().await;
    pg_ctl(&r.pg, &["stop", "-m", "fast"]);
    let backup = r.pg.scratch_dir("outboxd-rewound-").join("data");
    copy_dir(&r.pg.data_dir, &backup);
    std::fs::remove_dir_all(backup.join("pg_replslot").join("rewound")).unwrap();
    start(&r.pg);
    let client = r.pg.client("postgres").await;
    let daemon = Daemon::start(&r.cfg, &r.log);
    let (second, _) = write_events(&client, 20, 2, 4, &["Order"], 20).await;
    wait_ids(
        &broker().brokers,
        &[&r.topic],
        &second.iter().map(|e| e.id).collect(),
    )
    .await;
    assert!(daemon.sigterm().success());
    drop(client);

    restore(&r.pg, &backup);
    let (code, out, _) = outboxd_async(&["check", "--config", c]).await;
    assert_ne!(code, Some(0), "{out}");
    assert!(
        out.contains("went back") && out.contains("no longer has"),
        "{out}"
    );
    assert!(!out.contains("dropped"), "{out}");
    let mut refused = Daemon::start(&r.cfg, &r.log);
    assert_eq!(
        exits(&mut refused, Duration::from_secs(30), &r.log).await,
        Some(1)
    );
    let text = log_text(&r.log);
    assert!(
        text.contains("went back") && text.contains("no longer has") && text.contains("--create-slot"),
        "{text}"
    );
    assert!(!text.contains("dropped"), "{text}");

    // The recovery it prints: the slot made now, then what is written on.
    let (code, out, err) = outboxd_async(&["progress", "--config", c, "--reset", "--create-slot"]).await;
    assert_eq!(code, Some(0), "{out}{err}");
    let client = r.pg.client("postgres").await;
    let (third, _) = write_events(&client, 5, 2, 4, &["Order"], 40).await;
    let daemon = Daemon::start(&r.cfg, &r.log);
    wait_ids(
        &broker().brokers,
        &[&r.topic],
        &third.iter().map(|e| e.id).collect(),
    )
    .await;
    assert!(daemon.sigterm().success());
    pg_ctl(&r.pg, &["stop", "-m", "immediate"]);
}

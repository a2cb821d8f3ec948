//! Surviving a primary failover: a primary and a streaming physical
//! standby on loopback, outboxd given both (`host=a,b` with
//! `target_session_attrs=read-write`), the primary stopped with
//! `-m immediate` and the standby promoted while four writers insert.
//!
//! * With failover slots (PostgreSQL 17+), outboxd resumes from the
//!   standby's synced copy of its slot: no event is lost, order per
//!   aggregate holds, duplicates stay bounded, and the takeover (from the
//!   promotion to an event written after it being confirmed) is timed over
//!   several promotions. The two servers' ports are reused: each round's
//!   new standby takes the dead primary's port, so one URL serves all.
//! * Without a synced copy (any version), the promoted server has no slot:
//!   outboxd must refuse to create one (that would skip events), stop with
//!   the recovery steps, keep refusing after a restart, and go on only
//!   after `outboxd progress --reset`.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use outboxd::config::Config;
use outboxd::metrics::Metrics;
use outboxd::ops::health::Health;
use outboxd::relay::{Relay, RelayError};
use outboxd::Lsn;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_postgres::NoTls;
use uuid::Uuid;

use crate::harness::broker::{broker, consume, record_count};
use crate::harness::postgres::{self, PgServer};
use crate::harness::wait_for;
use crate::relay::{bin, config_text, confirmed_flush, current_lsn, write_config};

/// The standby's physical slot on whichever server is the primary.
const STANDBY_SLOT: &str = "standby1";
const WRITERS: usize = 4;

struct InProcess {
    handle: JoinHandle<Result<(), RelayError>>,
    stop: watch::Sender<bool>,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
}

fn start_relay(text: &str) -> InProcess {
    crate::harness::init_logs();
    let (config, validated) = Config::from_toml(text, |_| None).expect("test config is valid");
    let metrics = Arc::new(Metrics::new().unwrap());
    let health = Arc::new(Health::new(config.health.thresholds()));
    let (stop, rx) = watch::channel(false);
    let (m, h) = (metrics.clone(), health.clone());
    let handle = tokio::spawn(async move {
        let mut relay = Relay::new(config, validated, m, h)?;
        relay.run(rx).await
    });
    InProcess {
        handle,
        stop,
        metrics,
        health,
    }
}

fn both_url(a: u16, b: u16) -> String {
    format!("postgres://postgres@127.0.0.1:{a},127.0.0.1:{b}/postgres?sslmode=disable&target_session_attrs=read-write")
}

fn relay_config(url: &str, slot: &str, topic_prefix: &str) -> String {
    config_text(
        url,
        slot,
        &broker().brokers,
        &format!("topic = \"{topic_prefix}.{{aggregate_type}}\""),
        "",
    )
    .replace(
        "reconnect_backoff_max = \"2s\"",
        "reconnect_backoff_max = \"500ms\"",
    ) + "\n[health]\npoll_interval = \"500ms\"\n"
}

async fn sql(server: &PgServer) -> tokio_postgres::Client {
    server.client("postgres").await
}

/// What the primary needs so that its failover slots stay behind the
/// standby: synchronous commit to it, and `synchronized_standby_slots`.
async fn protect_with_standby(primary: &PgServer) {
    settings(
        primary,
        &[
            "ALTER SYSTEM SET synchronous_standby_names = '*'",
            &format!("ALTER SYSTEM SET synchronized_standby_slots = '{STANDBY_SLOT}'"),
        ],
    )
    .await;
}

/// `ALTER SYSTEM` statements (each in a transaction of its own), then a reload.
async fn settings(server: &PgServer, statements: &[&str]) {
    let client = sql(server).await;
    for statement in statements.iter().copied().chain(["SELECT pg_reload_conf()"]) {
        client.batch_execute(statement).await.unwrap();
    }
}

/// What an HA manager does right after a promotion while the new primary
/// has no standby yet: writes and logical decoding must not wait for one.
async fn run_alone(primary: &PgServer) {
    settings(
        primary,
        &[
            "ALTER SYSTEM SET synchronous_standby_names = ''",
            "ALTER SYSTEM SET synchronized_standby_slots = ''",
        ],
    )
    .await;
}

/// Four writers, one aggregate each, one row per transaction, sequence
/// numbers in the payload. A writer that loses its server reconnects
/// through the multi-host URL and goes on after the highest sequence the
/// new primary holds (a commit whose answer was lost may or may not be
/// there).
fn spawn_writers(url: String, stop: Arc<AtomicBool>) -> Vec<JoinHandle<u64>> {
    (0..WRITERS)
        .map(|w| {
            let (url, stop) = (url.clone(), stop.clone());
            tokio::spawn(async move {
                let aggregate = format!("acc-{w}");
                let mut written = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let client = match tokio_postgres::connect(&url, NoTls).await {
                        Ok((client, conn)) => {
                            tokio::spawn(conn);
                            client
                        }
                        Err(_) => {
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    };
                    let Ok(row) = client
                        .query_one(
                            "SELECT coalesce(max((payload->>'seq')::bigint), -1) FROM outbox WHERE aggregate_id = $1",
                            &[&aggregate],
                        )
                        .await
                    else {
                        continue;
                    };
                    let mut seq: i64 = row.get::<_, i64>(0) + 1;
                    while !stop.load(Ordering::Relaxed) {
                        let inserted = client
                            .execute(
                                "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload)
                                 VALUES ($1, 'failover', $2, 'Seq', jsonb_build_object('seq', $3::bigint))",
                                &[&Uuid::new_v4(), &aggregate, &seq],
                            )
                            .await;
                        if inserted.is_err() {
                            break;
                        }
                        seq += 1;
                        written += 1;
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
                written
            })
        })
        .collect()
}

/// `outboxd check`'s output.
fn check_output(cfg: &std::path::Path) -> String {
    let out = std::process::Command::new(bin())
        .args(["check", "--config"])
        .arg(cfg)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Waits until the relay reports the slot protected, or fails with the
/// relay's last reason.
async fn wait_protected(r: &InProcess, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while r.metrics.failover_protected.get() != 1 {
        assert!(
            Instant::now() < deadline,
            "failover protection not reported within {timeout:?}: {:?}",
            r.health.snapshot().failover
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn outboxd_follows_promotions_through_failover_slots() {
    let rounds = crate::relay::env_usize("OUTBOXD_FAILOVER_ROUNDS", 5);
    follow_promotions(Delivery::AtLeastOnce, rounds).await;
}

/// Exactly-once across a promotion: the progress record was written on the
/// old timeline, before its switch point (the standby had every change
/// outboxd saw, by `synchronized_standby_slots`), so the new primary's
/// timeline history lets outboxd trust it: a `read_committed` consumer
/// reads each event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exactly_once_follows_promotions_with_each_event_read_once() {
    let rounds = crate::relay::env_usize("OUTBOXD_EO_FAILOVER_ROUNDS", 2);
    follow_promotions(Delivery::ExactlyOnce, rounds).await;
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Delivery {
    AtLeastOnce,
    ExactlyOnce,
}

async fn follow_promotions(delivery: Delivery, rounds: usize) {
    let first = postgres::dedicated("");
    let (port_a, port_b) = (first.port, postgres::free_port());
    let version: i32 = sql(&first)
        .await
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await
        .unwrap()
        .get(0);
    let mut c = sql(&first).await;
    outbox_sdk::migrate::migrate(&mut c).await.unwrap();
    let (slot, prefix) = match delivery {
        Delivery::AtLeastOnce => ("fo_slot", format!("fo{}", std::process::id())),
        Delivery::ExactlyOnce => ("fo_eo_slot", format!("fo-eo{}", std::process::id())),
    };
    let url = both_url(port_a, port_b);
    let mut text = relay_config(&url, slot, &prefix);
    if delivery == Delivery::ExactlyOnce {
        text = text.replace("[kafka]\n", "[kafka]\ndelivery = \"exactly-once\"\n");
    }

    if version < 170_000 {
        // No failover slots before 17: the relay says so, and nothing else
        // here applies (the unsafe case below runs on every version).
        let r = start_relay(&text);
        wait_for("the failover reading", Duration::from_secs(30), || async {
            r.health
                .snapshot()
                .failover
                .filter(|f| f.contains("not available"))
        })
        .await;
        assert_eq!(r.metrics.failover_protected.get(), 0);
        r.stop.send(true).unwrap();
        r.handle.await.unwrap().unwrap();
        eprintln!(
            "failover: PostgreSQL {version} has no failover slots; run with OUTBOXD_PG_VERSION=17 or 18"
        );
        return;
    }

    let sync = "sync_replication_slots = on";
    let mut primary = first;
    let mut standby = primary.standby(port_b, STANDBY_SLOT, sync);
    protect_with_standby(&primary).await;

    let r = start_relay(&text);
    wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(&sql(&primary).await, slot).await
    })
    .await;
    let stop_writers = Arc::new(AtomicBool::new(false));
    let writers = spawn_writers(url.clone(), stop_writers.clone());

    let mut takeovers = Vec::new();
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "failover.toml", &text);
    let mut standby_started = Instant::now();
    for round in 1..=rounds {
        wait_protected(&r, Duration::from_secs(120)).await;
        eprintln!(
            "failover ({delivery:?}) round {round}: the standby's copy protects the slot {:?} after the standby started",
            standby_started.elapsed()
        );
        if round == 1 {
            let out = check_output(&cfg);
            assert!(
                out.lines().any(|l| l.starts_with("ok   failover")
                    && l.contains("protected: 127.0.0.1:")
                    && l.contains("holds a synced copy")),
                "{out}"
            );
        }
        // Let the writers and the relay run on the protected pair a while.
        tokio::time::sleep(Duration::from_secs(2)).await;

        primary.pg_ctl(&["stop", "-m", "immediate"]).unwrap();
        standby.promote();
        let promoted = Instant::now();
        run_alone(&standby).await;
        let client = sql(&standby).await;
        client
            .execute(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload)
                 VALUES ($1, 'failover', 'marker', 'Marker', jsonb_build_object('round', $2::int))",
                &[&Uuid::new_v4(), &(round as i32)],
            )
            .await
            .unwrap();
        let marker = current_lsn(&client).await;
        wait_for(
            "outboxd to confirm past the marker on the new primary",
            Duration::from_secs(60),
            || async { confirmed_flush(&client, slot).await.filter(|l| *l >= marker) },
        )
        .await;
        let took = promoted.elapsed();
        eprintln!(
            "failover ({delivery:?}) round {round}: takeover {took:?} (promotion to an event written after it confirmed)"
        );
        takeovers.push(took);

        // The dead primary's port becomes the next standby's.
        let old = std::mem::replace(&mut primary, standby);
        let free_port = old.port;
        drop(old);
        standby = primary.standby(free_port, STANDBY_SLOT, sync);
        standby_started = Instant::now();
        protect_with_standby(&primary).await;
    }

    stop_writers.store(true, Ordering::Relaxed);
    let mut written = 0;
    for w in writers {
        written += w.await.unwrap();
    }
    let client = sql(&primary).await;
    let end = current_lsn(&client).await;
    wait_for(
        "outboxd to confirm everything",
        Duration::from_secs(60),
        || async { confirmed_flush(&client, slot).await.filter(|l| *l >= end) },
    )
    .await;
    // Exactly-once: each new primary's copy of the slot trailed the
    // progress record, and the record (of the old timeline) was trusted to
    // skip what Kafka already held.
    let skipped = r.metrics.skipped_transactions.get();
    if delivery == Delivery::ExactlyOnce {
        assert!(
            skipped > 0,
            "no transaction was skipped by a progress record of an earlier timeline"
        );
    }
    r.stop.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(30), r.handle)
        .await
        .expect("relay stops")
        .unwrap()
        .expect("clean stop");

    // Ground truth: the rows the last primary holds.
    let rows: Vec<(Uuid, String, i64)> = client
        .query(
            "SELECT id, aggregate_id, coalesce((payload->>'seq')::bigint, -1) FROM outbox ORDER BY aggregate_id, (payload->>'seq')::bigint",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let topic = format!("{prefix}.failover");
    let brokers = broker().brokers.clone();
    // Every record, duplicates included. With exactly-once the offsets
    // also hold transaction markers and aborted records, which a
    // read_committed consumer skips: one record per row is all it may see
    // (a duplicate among them fails the check below).
    let rows_written = rows.len();
    let records = tokio::task::spawn_blocking(move || {
        let want = match delivery {
            Delivery::AtLeastOnce => record_count(&brokers, &topic),
            Delivery::ExactlyOnce => rows_written,
        };
        consume(&brokers, &[&topic], want, Duration::from_secs(60))
    })
    .await
    .unwrap();
    let mut seen = HashSet::new();
    let mut order: HashMap<String, Vec<i64>> = HashMap::new();
    let mut duplicates = 0;
    for rec in &records {
        let id: Uuid = rec.header("id").unwrap().parse().unwrap();
        if !seen.insert(id) {
            duplicates += 1;
            continue;
        }
        let v: serde_json::Value = serde_json::from_slice(&rec.value).unwrap();
        if let Some(seq) = v.get("seq").and_then(|s| s.as_i64()) {
            order.entry(rec.key.clone()).or_default().push(seq);
        }
    }
    if delivery == Delivery::ExactlyOnce {
        assert_eq!(duplicates, 0, "read_committed reads each event once");
    }
    let missing: Vec<_> = rows.iter().filter(|(id, _, _)| !seen.contains(id)).collect();
    assert!(
        missing.is_empty(),
        "{} of {} rows never reached Kafka: {:?}",
        missing.len(),
        rows.len(),
        &missing[..missing.len().min(5)]
    );
    for (aggregate, seqs) in &order {
        assert!(
            seqs.windows(2).all(|w| w[0] < w[1]),
            "events of {aggregate} out of order in Kafka: {seqs:?}"
        );
    }
    let mut sorted = takeovers.clone();
    sorted.sort();
    eprintln!(
        "failover ({delivery:?}): {rounds} promotions, {} rows ({written} inserts answered), {} records, {duplicates} duplicates, {skipped} transactions skipped by the progress record; takeover min {:?} median {:?} max {:?}",
        rows.len(),
        records.len(),
        sorted[0],
        sorted[sorted.len() / 2],
        sorted[sorted.len() - 1]
    );
    match delivery {
        // The synced copy trails the primary's slot by the slot sync
        // worker's nap (200 ms while busy) plus outboxd's status interval
        // (100 ms here); at ≤ 400 inserts a second, a promotion re-sends
        // well under 400 events.
        Delivery::AtLeastOnce => assert!(
            duplicates <= 400 * rounds,
            "{duplicates} duplicates over {rounds} promotions"
        ),
        Delivery::ExactlyOnce => assert_eq!(duplicates, 0, "read_committed reads each event once"),
    }
    assert!(
        sorted[sorted.len() - 1] < Duration::from_secs(10),
        "a takeover took {:?}",
        sorted[sorted.len() - 1]
    );
}

/// A promotion before the standby had a synced copy of the slot (here: the
/// standby does not sync slots at all, as on any server before 17).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_lost_in_a_promotion_stops_outboxd_with_the_recovery() {
    let primary = postgres::dedicated("");
    let (port_a, port_b) = (primary.port, postgres::free_port());
    let mut c = sql(&primary).await;
    outbox_sdk::migrate::migrate(&mut c).await.unwrap();
    let standby = primary.standby(port_b, STANDBY_SLOT, "");
    let slot = "lost_in_promotion";
    let prefix = format!("lost{}", std::process::id());
    let url = both_url(port_a, port_b);
    let text = relay_config(&url, slot, &prefix) + "require_failover_protection = true\n";
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "lost.toml", &text);

    let r = start_relay(&text);
    wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(&c, slot).await
    })
    .await;
    // The relay sees the danger before it happens, and (as asked for) is
    // not ready; `check` fails on it.
    let reading = wait_for("the failover reading", Duration::from_secs(30), || async {
        r.health.snapshot().failover
    })
    .await;
    assert!(
        reading.starts_with("unprotected") || reading.starts_with("not available"),
        "{reading}"
    );
    assert_eq!(r.metrics.failover_protected.get(), 0);
    assert!(
        r.health
            .not_ready_reasons()
            .iter()
            .any(|x| x.contains("require_failover_protection")),
        "{:?}",
        r.health.not_ready_reasons()
    );
    let out = check_output(&cfg);
    assert!(out.lines().any(|l| l.starts_with("FAIL failover")), "{out}");
    for i in 0..20 {
        c.execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload) VALUES ($1, 'lost', 'a', 'T', jsonb_build_object('i', $2::int))",
            &[&Uuid::new_v4(), &i],
        )
        .await
        .unwrap();
    }
    let end = current_lsn(&c).await;
    wait_for("confirmed", Duration::from_secs(30), || async {
        confirmed_flush(&c, slot).await.filter(|l| *l >= end)
    })
    .await;
    // Let the standby replay all of it, then lose the primary.
    let replayed = || async {
        let s = sql(&standby).await;
        let at: String = s
            .query_one("SELECT pg_last_wal_replay_lsn()::text", &[])
            .await
            .unwrap()
            .get(0);
        (at.parse::<Lsn>().unwrap() >= end).then_some(())
    };
    wait_for("the standby to replay", Duration::from_secs(30), replayed).await;
    drop(c);
    primary.pg_ctl(&["stop", "-m", "immediate"]).unwrap();
    standby.promote();

    let err = tokio::time::timeout(Duration::from_secs(60), r.handle)
        .await
        .expect("outboxd stops instead of streaming from a new slot")
        .unwrap()
        .expect_err("a lost slot is a definite error");
    let msg = err.to_string();
    assert!(!err.is_transient(), "{msg}");
    for part in ["does not exist", "promoted", "progress --reset", "re-publish"] {
        assert!(msg.contains(part), "{part:?} missing from: {msg}");
    }
    let new_primary = sql(&standby).await;
    assert_eq!(
        confirmed_flush(&new_primary, slot).await,
        None,
        "outboxd must not invent a position on the new primary"
    );

    // A restart (a new process, as Kubernetes would start) refuses again.
    let again = start_relay(&text);
    let err = tokio::time::timeout(Duration::from_secs(60), again.handle)
        .await
        .expect("stops again")
        .unwrap()
        .expect_err("still refused after a restart");
    assert!(err.to_string().contains("progress --reset"), "{err}");
    let out = check_output(&cfg);
    assert!(
        out.contains("FAIL register") && out.contains("does not exist"),
        "{out}"
    );

    // The operator acknowledges the gap; outboxd then starts a new slot.
    let reset = std::process::Command::new(bin())
        .args(["progress", "--reset", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(
        reset.status.success(),
        "{}{}",
        String::from_utf8_lossy(&reset.stdout),
        String::from_utf8_lossy(&reset.stderr)
    );
    let r = start_relay(&text);
    wait_for("a new slot after the reset", Duration::from_secs(30), || async {
        confirmed_flush(&new_primary, slot).await
    })
    .await;
    r.stop.send(true).unwrap();
    r.handle.await.unwrap().unwrap();
}

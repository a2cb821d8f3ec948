//! Never lose, never stall: faults, poison rows, WAL safety, high
//! availability and least privilege.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use outboxd::config::Config;
use outboxd::metrics::Metrics;
use outboxd::ops::health::Health;
use outboxd::relay::{Relay, RelayError};
use outboxd::Lsn;
use tokio::sync::watch;
use uuid::Uuid;

use crate::harness::broker::{self, broker, consume};
use crate::harness::postgres::{self, PgServer};
use crate::harness::{wait_for, TestDb};
use crate::relay::{
    config_text, confirmed_flush, current_lsn, expected_order, first_occurrence_order,
    pending_in_released_slot, spawn_relay, stop_relay, write_config, write_events, Daemon,
};

/// A relay with its metrics and health, in this process.
pub(crate) struct Observed {
    handle: tokio::task::JoinHandle<Result<(), RelayError>>,
    stop: watch::Sender<bool>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) health: Arc<Health>,
}

pub(crate) fn observe(text: &str) -> Observed {
    crate::harness::init_logs();
    let (config, validated) = Config::from_toml(text, |_| None).unwrap();
    let metrics = Arc::new(Metrics::new().unwrap());
    let health = Arc::new(Health::new(config.health.thresholds()));
    let (stop, rx) = watch::channel(false);
    let (m, h) = (metrics.clone(), health.clone());
    let handle = tokio::spawn(async move { Relay::new(config, validated, m, h)?.run(rx).await });
    Observed {
        handle,
        stop,
        metrics,
        health,
    }
}

impl Observed {
    pub(crate) async fn shutdown(self) {
        stop_relay(self.handle, self.stop).await;
    }
}

pub(crate) fn health_section(extra: &str) -> String {
    format!("\n[health]\npoll_interval = \"300ms\"\nstatus_max_age = \"3s\"\n{extra}\n")
}

pub(crate) async fn wait_slot(client: &tokio_postgres::Client, slot: &str) -> Lsn {
    wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(client, slot).await
    })
    .await
}

/// Re-reads `topics` until every id in `want` is there; returns all records.
async fn wait_all_in_kafka(
    what: &str,
    brokers: &str,
    topics: &'static [&'static str],
    want: &HashSet<Uuid>,
) -> Vec<crate::harness::broker::Consumed> {
    wait_for(what, Duration::from_secs(120), || {
        let brokers = brokers.to_owned();
        async move {
            let recs = tokio::task::spawn_blocking(move || consume_ids(&brokers, topics, usize::MAX, 3))
                .await
                .unwrap();
            let ids: HashSet<Uuid> = recs.iter().filter_map(|r| r.header("id")?.parse().ok()).collect();
            want.is_subset(&ids).then_some(recs)
        }
    })
    .await
}

fn consume_ids(
    brokers: &str,
    topics: &[&str],
    want: usize,
    secs: u64,
) -> Vec<crate::harness::broker::Consumed> {
    consume(brokers, topics, want, Duration::from_secs(secs))
}

/// Kafka down for 30 s while events are written: nothing confirmed past
/// them, not ready, and every event arrives once the broker is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_down_for_thirty_seconds_loses_nothing() {
    let pg = postgres::dedicated("");
    outbox_sdk::migrate::migrate(&mut pg.client("postgres").await)
        .await
        .unwrap();
    let client = pg.client("postgres").await;
    let own = broker::dedicated();
    let slot = "kafka_down";
    let text = config_text(
        &pg.url("postgres", None, "postgres"),
        slot,
        &own.brokers,
        "topic = \"down.{aggregate_type}\"",
        "[kafka.options]\n\"topic.metadata.propagation.max.ms\" = \"2000\"",
    ) + &health_section("ack_max_age = \"5s\"");
    let r = observe(&text);
    wait_slot(&client, slot).await;
    let (before, _) = write_events(&client, 5, 4, 6, &["Order"], 0).await;
    wait_for("the first events", Duration::from_secs(30), || async {
        (r.metrics.events_published.get() >= 20).then_some(())
    })
    .await;

    own.kill();
    let outage = Instant::now();
    let (during, bounds) = write_events(&client, 50, 4, 6, &["Order"], 5).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let frozen = confirmed_flush(&client, slot).await.unwrap();
    assert!(
        frozen < bounds[0].1,
        "nothing confirmed past the unacknowledged events"
    );
    wait_for(
        "not ready while Kafka is down",
        Duration::from_secs(20),
        || async {
            let reasons = r.health.not_ready_reasons();
            reasons.iter().any(|r| r.contains("Kafka")).then_some(())
        },
    )
    .await;
    while outage.elapsed() < Duration::from_secs(30) {
        assert_eq!(
            confirmed_flush(&client, slot).await.unwrap(),
            frozen,
            "the confirmed LSN does not move"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    own.restart();

    let want: HashSet<Uuid> = during.iter().map(|e| e.id).collect();
    let got = wait_all_in_kafka(
        "every event written during the outage",
        &own.brokers,
        &["down.order"],
        &want,
    )
    .await;
    let order = first_occurrence_order(&got);
    for (agg, ids) in expected_order(&during) {
        let seen: Vec<Uuid> = order[&agg]
            .iter()
            .copied()
            .filter(|id| want.contains(id))
            .collect();
        assert_eq!(seen, ids, "order of {agg}");
    }
    wait_for("ready again", Duration::from_secs(30), || async {
        r.health.not_ready_reasons().is_empty().then_some(())
    })
    .await;
    assert!(confirmed_flush(&client, slot).await.unwrap() > frozen);
    eprintln!(
        "kafka down: {} events before, {} during a {:?} outage, all delivered",
        before.len(),
        during.len(),
        outage.elapsed()
    );
    r.shutdown().await;
    own.kill();
}

/// Restarts (fast and immediate) and a terminated walsender, mid-stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restarts_and_killed_walsender_lose_nothing() {
    let pg = Arc::new(postgres::dedicated(""));
    outbox_sdk::migrate::migrate(&mut pg.client("postgres").await)
        .await
        .unwrap();
    let slot = "pg_restarts";
    let text = config_text(
        &pg.url("postgres", None, "postgres"),
        slot,
        &broker().brokers,
        "topic = \"restarts.{aggregate_type}\"",
        "",
    );
    let r = observe(&text);
    wait_slot(&pg.client("postgres").await, slot).await;

    // One writer, reconnecting through the outages; per aggregate its
    // order is the commit order.
    let stop_writing = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let pg = pg.clone();
        let stop = stop_writing.clone();
        tokio::spawn(async move {
            let mut n = 0u64;
            let mut client: Option<tokio_postgres::Client> = None;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if client.as_ref().is_none_or(|c| c.is_closed()) {
                    client = connect_quietly(&pg).await;
                    if client.is_none() {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                }
                let c = client.as_ref().unwrap();
                let res = c
                    .execute(
                        "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload)
                         VALUES ($1, 'Order', $2, 't', jsonb_build_object('n', $3::bigint))",
                        &[&Uuid::now_v7(), &format!("agg-{}", n % 5), &(n as i64)],
                    )
                    .await;
                if res.is_err() {
                    client = None;
                }
                n += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let admin = |pg: Arc<PgServer>| async move { connect_quietly(&pg).await };
    tokio::time::sleep(Duration::from_secs(2)).await;
    let c = admin(pg.clone()).await.unwrap();
    let killed: i64 = c
        .query_one(
            "SELECT count(pg_terminate_backend(active_pid)) FROM pg_replication_slots WHERE slot_name = $1 AND active",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(killed, 1, "terminated the walsender");
    tokio::time::sleep(Duration::from_secs(2)).await;
    pg.pg_ctl(&[
        "restart",
        "-m",
        "fast",
        "-w",
        "-l",
        &pg.log_file.display().to_string(),
    ])
    .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    pg.pg_ctl(&[
        "restart",
        "-m",
        "immediate",
        "-w",
        "-l",
        &pg.log_file.display().to_string(),
    ])
    .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop_writing.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.await.unwrap();

    // The committed rows are what the database holds after recovery.
    let c = wait_for("PostgreSQL back", Duration::from_secs(30), || admin(pg.clone())).await;
    let rows = c
        .query(
            "SELECT id, aggregate_id FROM outbox ORDER BY (payload->>'n')::bigint",
            &[],
        )
        .await
        .unwrap();
    let committed: Vec<(Uuid, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    let want: HashSet<Uuid> = committed.iter().map(|(id, _)| *id).collect();
    let recs = wait_all_in_kafka(
        "every committed event in Kafka",
        &broker().brokers,
        &["restarts.order"],
        &want,
    )
    .await;
    let order = first_occurrence_order(&recs);
    for agg in (0..5).map(|a| format!("agg-{a}")) {
        let expected: Vec<Uuid> = committed
            .iter()
            .filter(|(_, a)| *a == agg)
            .map(|(id, _)| *id)
            .collect();
        assert_eq!(order[&agg], expected, "order of {agg}");
    }
    assert!(r.metrics.reconnects.get() >= 3, "reconnected after each fault");
    eprintln!(
        "postgres faults: {} committed events, {} records, {} reconnects",
        committed.len(),
        recs.len(),
        r.metrics.reconnects.get()
    );
    r.shutdown().await;
}

pub(crate) async fn connect_quietly(pg: &PgServer) -> Option<tokio_postgres::Client> {
    let (client, conn) = tokio_postgres::Config::new()
        .host("127.0.0.1")
        .port(pg.port)
        .user("postgres")
        .dbname("postgres")
        .connect_timeout(Duration::from_secs(2))
        .connect(tokio_postgres::NoTls)
        .await
        .ok()?;
    tokio::spawn(conn);
    Some(client)
}

async fn status_of(port: u16) -> Option<outboxd::ops::health::Snapshot> {
    let url = format!("http://127.0.0.1:{port}/status");
    tokio::task::spawn_blocking(move || {
        let body = ureq::get(&url).call().ok()?.body_mut().read_to_string().ok()?;
        serde_json::from_str(&body).ok()
    })
    .await
    .unwrap()
}

/// Two outboxd for one slot: one streams, the other takes over within 10 s
/// of a SIGKILL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_standby_takes_over_within_ten_seconds() {
    let db = TestDb::new("rel_ha").await;
    let client = db.client().await;
    let dir = tempfile::tempdir().unwrap();
    let slot = "ha_slot";
    let ports = [postgres::free_port(), postgres::free_port()];
    let mut daemons: Vec<Daemon> = ports
        .iter()
        .enumerate()
        .map(|(i, port)| {
            let text = config_text(
                &db.superuser_url(),
                slot,
                &broker().brokers,
                "topic = \"ha.{aggregate_type}\"",
                "",
            )
            .replace(
                "listen = \"127.0.0.1:0\"",
                &format!("listen = \"127.0.0.1:{port}\""),
            );
            let cfg = write_config(dir.path(), &format!("ha{i}.toml"), &text);
            Daemon::start(&cfg, &dir.path().join(format!("ha{i}.log")))
        })
        .collect();
    let leader = wait_for(
        "exactly one leader and one standby",
        Duration::from_secs(30),
        || async {
            let (a, b) = (status_of(ports[0]).await?, status_of(ports[1]).await?);
            match (
                a.streaming && !b.streaming && b.standby,
                b.streaming && !a.streaming && a.standby,
            ) {
                (true, false) => Some(0),
                (false, true) => Some(1),
                _ => None,
            }
        },
    )
    .await;
    let standby = 1 - leader;
    let (first, _) = write_events(&client, 20, 5, 10, &["Order"], 0).await;
    tokio::time::sleep(Duration::from_millis(300)).await;

    let t = Instant::now();
    daemons[leader].kill9();
    wait_for("the standby to stream", Duration::from_secs(10), || async {
        status_of(ports[standby])
            .await
            .filter(|s| s.streaming && !s.standby)
            .map(|_| ())
    })
    .await;
    let takeover = t.elapsed();
    assert!(takeover < Duration::from_secs(10), "took over in {takeover:?}");
    let (second, _) = write_events(&client, 20, 5, 10, &["Order"], 20).await;
    let all: Vec<_> = first.iter().chain(&second).cloned().collect();
    let want: HashSet<Uuid> = all.iter().map(|e| e.id).collect();
    let recs = wait_all_in_kafka("every event", &broker().brokers, &["ha.order"], &want).await;
    let ids: HashSet<Uuid> = recs.iter().filter_map(|r| r.header("id")?.parse().ok()).collect();
    assert_eq!(ids, want, "nothing foreign");
    assert_eq!(first_occurrence_order(&recs), expected_order(&all));
    eprintln!("high availability: the standby took over in {takeover:?}");
    for d in daemons.drain(..) {
        let _ = d.sigterm();
    }
}

async fn dead_letters(brokers: &str, want: usize) -> Vec<crate::harness::broker::Consumed> {
    let brokers = brokers.to_owned();
    tokio::task::spawn_blocking(move || consume_ids(&brokers, &["poison.dead-letter"], want, 30))
        .await
        .unwrap()
}

/// Rows Kafka will never accept go to the dead-letter topic, with the
/// reason and the source LSN; the rest flows on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_rows_are_dead_lettered_with_the_reason() {
    let db = TestDb::new("rel_poison").await;
    let client = db.client().await;
    let slot = "poison_dlq";
    let text = config_text(
        &db.superuser_url(),
        slot,
        &broker().brokers,
        "topic = \"poison.{aggregate_type}\"\non_poison = \"dead-letter\"\ndead_letter_topic = \"poison.dead-letter\"",
        "[kafka.options]\n\"message.max.bytes\" = \"100000\"",
    );
    let r = observe(&text);
    wait_slot(&client, slot).await;
    let big: String = (0..150_000u32)
        .map(|i| char::from(b'a' + ((i * 7919 + i / 13) % 26) as u8))
        .collect();
    let insert =
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload) VALUES ($1, $2, $3, 't', $4)";
    let good = |n: i32| {
        (
            Uuid::now_v7(),
            "Order".to_owned(),
            "a-1".to_owned(),
            serde_json::json!({"n": n}),
        )
    };
    let rows = vec![
        good(1),
        (
            Uuid::now_v7(),
            "Order".to_owned(),
            "a-1".to_owned(),
            serde_json::json!({"blob": big}),
        ),
        good(2),
        (
            Uuid::now_v7(),
            "Bad Type!".to_owned(),
            "a-2".to_owned(),
            serde_json::json!({}),
        ),
        (
            Uuid::now_v7(),
            "Order".to_owned(),
            String::new(),
            serde_json::json!({}),
        ),
        good(3),
    ];
    let mut lsns = Vec::new();
    for (id, at, ai, payload) in &rows {
        lsns.push(current_lsn(&client).await);
        client.execute(insert, &[id, at, ai, payload]).await.unwrap();
    }
    let dlq = dead_letters(&broker().brokers, 3).await;
    assert_eq!(dlq.len(), 3, "three dead letters");
    // Dead letters of different keys land on different partitions: their
    // relative order is not defined, so match them by id.
    let by_id: std::collections::HashMap<&str, &crate::harness::broker::Consumed> =
        dlq.iter().map(|d| (d.header("id").unwrap(), d)).collect();
    for (i, reason) in [(1, "too_large"), (3, "illegal_topic"), (4, "empty_key")] {
        let id = rows[i].0.to_string();
        let d = by_id
            .get(id.as_str())
            .unwrap_or_else(|| panic!("no dead letter for row {i}"));
        assert_eq!(d.header("dlq.reason"), Some(reason), "reason of row {i}");
        let lsn: Lsn = d.header("dlq.source.lsn").unwrap().parse().unwrap();
        assert!(lsn >= lsns[i], "source LSN of row {i}");
        assert!(!d.header("dlq.error").unwrap().is_empty());
    }
    let bad_topic = by_id[rows[3].0.to_string().as_str()];
    let v: serde_json::Value = serde_json::from_slice(&bad_topic.value).unwrap();
    assert_eq!(v["aggregateType"], "Bad Type!", "the original row");
    let too_large = by_id[rows[1].0.to_string().as_str()];
    assert_eq!(too_large.header("dlq.payload.omitted"), Some("too large"));
    let good_ids: HashSet<String> = [0, 2, 5].iter().map(|&i| rows[i].0.to_string()).collect();
    let published = tokio::task::spawn_blocking(|| consume_ids(&broker().brokers, &["poison.order"], 3, 30))
        .await
        .unwrap();
    let got: HashSet<String> = published
        .iter()
        .map(|r| r.header("id").unwrap().to_owned())
        .collect();
    assert_eq!(got, good_ids, "the good rows flow on");
    wait_for("the dead-letter metric", Duration::from_secs(10), || async {
        let text = r.metrics.encode();
        (text.contains("outboxd_dead_letters_total{reason=\"too_large\"} 1")
            && text.contains("outboxd_dead_letters_total{reason=\"illegal_topic\"} 1")
            && text.contains("outboxd_dead_letters_total{reason=\"empty_key\"} 1"))
        .then_some(())
    })
    .await;
    r.shutdown().await;
}

/// `on_poison = "stop"` halts without moving the slot; so does a failing
/// dead-letter topic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_stop_and_a_failing_dead_letter_topic_hold_the_slot() {
    for (slot, routing, kafka, expect) in [
        ("poison_stop", "topic = \"stop.{aggregate_type}\"", "", "can never be published"),
        (
            "poison_dlq_fails",
            "topic = \"stop.{aggregate_type}\"\non_poison = \"dead-letter\"\ndead_letter_topic = \"missing.dead-letter\"",
            "create_topics = false",
            "dead-letter topic failed",
        ),
    ] {
        let db = TestDb::new(slot).await;
        let client = db.client().await;
        let (handle, _stop) = spawn_relay(&config_text(&db.superuser_url(), slot, &broker().brokers, routing, kafka));
        wait_slot(&client, slot).await;
        let id = Uuid::now_v7();
        client
            .execute(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload) VALUES ($1, 'Bad Type!', '1', 't', '{}')",
                &[&id],
            )
            .await
            .unwrap();
        let err = tokio::time::timeout(Duration::from_secs(30), handle)
            .await
            .expect("outboxd stops")
            .unwrap()
            .expect_err("a definite error");
        let text = err.to_string();
        assert!(text.contains(expect), "{slot}: {text}");
        assert!(!err.is_transient());
        if slot == "poison_stop" {
            assert!(text.contains(&id.to_string()), "names the row: {text}");
        }
        let pending = pending_in_released_slot(&client, slot).await;
        assert!(pending >= 3, "{slot}: the row is still in the slot ({pending} messages)");
    }
}

fn peak_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// One transaction of 200,000 rows: bounded memory, and its commit is
/// confirmed only once every row is acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_200k_row_transaction_flows_with_bounded_memory() {
    const ROWS: usize = 200_000;
    // A server of its own: no other WAL, so the commit's end is exactly
    // the insert position right after it.
    let pg = postgres::dedicated("");
    let mut client = pg.client("postgres").await;
    outbox_sdk::migrate::migrate(&mut client).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let slot = "large_txn";
    let cfg = write_config(
        dir.path(),
        "large.toml",
        &config_text(
            &pg.url("postgres", None, "postgres"),
            slot,
            &broker().brokers,
            "topic = \"large.{aggregate_type}\"",
            "",
        ),
    );
    let mut daemon = Daemon::start(&cfg, &dir.path().join("large.log"));
    wait_slot(&client, slot).await;
    client
        .batch_execute(&format!(
            "BEGIN;
             INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload)
             SELECT gen_random_uuid(), 'Order', 'agg-' || (g % 100), 'big.v1',
                    jsonb_build_object('n', g, 'pad', repeat(md5(g::text), 8))
               FROM generate_series(1, {ROWS}) g;
             COMMIT;"
        ))
        .await
        .unwrap();
    let commit_end = current_lsn(&client).await;
    // The moment the commit is confirmed, every row must already be in Kafka.
    let t = Instant::now();
    loop {
        let confirmed = confirmed_flush(&client, slot).await.unwrap();
        if confirmed >= commit_end {
            let n = tokio::task::spawn_blocking(|| {
                consume_ids(&broker().brokers, &["large.order"], ROWS, 60).len()
            })
            .await
            .unwrap();
            assert_eq!(n, ROWS, "confirmed only after the last row was acknowledged");
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(240), "not confirmed in time");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let rss = peak_rss_kib(daemon.pid()).unwrap();
    eprintln!(
        "large transaction: {ROWS} rows in {:?}, peak RSS {} MiB",
        t.elapsed(),
        rss / 1024
    );
    assert!(rss < 512 * 1024, "peak RSS {rss} KiB");
    daemon.kill9();
}

/// The least-privilege role from deploy/least-privilege.sql runs `check`
/// and `run`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_privilege_role_runs_check_and_run() {
    let db = TestDb::new("rel_lp").await;
    let client = db.client().await;
    let sql =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/least-privilege.sql")).unwrap();
    client.batch_execute(&sql).await.unwrap();
    client
        .batch_execute("ALTER ROLE outboxd PASSWORD 'lp-test-password'")
        .await
        .unwrap();
    let url = crate::harness::server().url("outboxd", Some("lp-test-password"), &db.name);
    let port = postgres::free_port();
    let text = config_text(
        &url,
        "outboxd",
        &broker().brokers,
        "topic = \"lp.{aggregate_type}\"",
        "",
    )
    .replace(
        "publication = \"outboxd\"",
        "publication = \"outboxd\"\ncreate_publication = false",
    )
    .replace(
        "listen = \"127.0.0.1:0\"",
        &format!("listen = \"127.0.0.1:{port}\""),
    );
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "lp.toml", &text);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args(["check", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "check under the least-privilege role:\n{stdout}"
    );
    let daemon = Daemon::start(&cfg, &dir.path().join("lp.log"));
    wait_slot(&client, "outboxd").await;
    let (events, _) = write_events(&client, 3, 2, 2, &["Order"], 0).await;
    let want: HashSet<String> = events.iter().map(|e| e.id.to_string()).collect();
    let got = wait_for(
        "events under the least-privilege role",
        Duration::from_secs(30),
        || {
            let want = want.clone();
            async move {
                let recs =
                    tokio::task::spawn_blocking(|| consume_ids(&broker().brokers, &["lp.order"], 6, 3))
                        .await
                        .unwrap();
                let ids: HashSet<String> = recs
                    .iter()
                    .filter_map(|r| r.header("id").map(str::to_owned))
                    .collect();
                (ids == want).then_some(ids)
            }
        },
    )
    .await;
    assert_eq!(got.len(), 6);
    assert!(daemon.sigterm().success());
}

async fn all_published(client: &tokio_postgres::Client) {
    wait_for("every row published", Duration::from_secs(60), || async {
        let left: i64 = client
            .query_one("SELECT count(*) FROM outbox WHERE published_at IS NULL", &[])
            .await
            .unwrap()
            .get(0);
        (left == 0).then_some(())
    })
    .await;
}

/// Polling mode: seed 000's relay as a product feature.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_mode_publishes_in_order_and_one_instance_polls_at_a_time() {
    let db = TestDb::new("rel_polling").await;
    let client = db.client().await;
    let (events, _) = write_events(&client, 60, 10, 12, &["Order", "Invoice"], 0).await;
    let text = |topic: &str| {
        format!(
            "mode = \"polling\"\n[polling]\nbatch_size = 10\ninterval = \"100ms\"\n{}",
            config_text(
                &db.superuser_url(),
                "unused",
                &broker().brokers,
                &format!("topic = \"{topic}.{{aggregate_type}}\""),
                ""
            )
        )
    };
    let run = |text: String| {
        let (config, validated) = Config::from_toml(&text, |_| None).unwrap();
        let metrics = Arc::new(Metrics::new().unwrap());
        let health = Arc::new(Health::new(config.health.thresholds()));
        let (stop, rx) = watch::channel(false);
        let m = metrics.clone();
        let handle = tokio::spawn(async move {
            outboxd::relay::polling::PollingRelay::new(config, validated, m, health)
                .unwrap()
                .run(rx)
                .await
        });
        (handle, stop, metrics)
    };
    // One instance: every row once, in order per aggregate, published_at set.
    let (handle, stop, metrics) = run(text("poll1"));
    all_published(&client).await;
    let recs = tokio::task::spawn_blocking(|| {
        consume_ids(&broker().brokers, &["poll1.order", "poll1.invoice"], 600, 30)
    })
    .await
    .unwrap();
    assert_eq!(recs.len(), 600);
    assert_eq!(first_occurrence_order(&recs), expected_order(&events));
    assert_eq!(metrics.events_published.get(), 600);
    stop.send(true).unwrap();
    handle.await.unwrap().unwrap();

    // Two instances at once: one polls, the other waits as a hot standby,
    // so one producer publishes each aggregate in order; none twice.
    client
        .batch_execute("UPDATE outbox SET published_at = NULL")
        .await
        .unwrap();
    let (h1, s1, m1) = run(text("poll2"));
    let (h2, s2, m2) = run(text("poll2"));
    all_published(&client).await;
    let recs = tokio::task::spawn_blocking(|| {
        consume_ids(&broker().brokers, &["poll2.order", "poll2.invoice"], 601, 10)
    })
    .await
    .unwrap();
    let ids: HashSet<&str> = recs.iter().filter_map(|r| r.header("id")).collect();
    assert_eq!(
        (recs.len(), ids.len()),
        (600, 600),
        "each row exactly once across instances"
    );
    assert_eq!(
        m1.events_published.get() + m2.events_published.get(),
        600,
        "one instance published every row"
    );
    assert!(
        m1.events_published.get() == 0 || m2.events_published.get() == 0,
        "the other stood by"
    );
    assert_eq!(first_occurrence_order(&recs), expected_order(&events));
    assert_eq!(m1.oldest_unpublished_seconds.get(), 0.0);
    for (h, s) in [(h1, s1), (h2, s2)] {
        s.send(true).unwrap();
        h.await.unwrap().unwrap();
    }
}

/// A slot held by another process (here a plain replication connection):
/// outboxd waits and retries, then streams once it is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_in_use_is_retried_not_a_crash_loop() {
    use outboxd::config::ident::{PublicationName, SlotName};
    use outboxd::postgres::connection::{ReplicationConnection, StartOptions};
    let db = TestDb::new("rel_busy").await;
    let client = db.client().await;
    let slot = "busy_slot";
    client
        .batch_execute("CREATE PUBLICATION busy_slot FOR TABLE outbox WITH (publish = 'insert')")
        .await
        .unwrap();
    client
        .batch_execute("SELECT pg_create_logical_replication_slot('busy_slot', 'pgoutput')")
        .await
        .unwrap();
    // Another consumer (not an outboxd: those hold the leader lock, and a
    // leader ends the walsender one that lost it left behind).
    let other = format!("{}&application_name=other_consumer", db.superuser_url());
    let holder = ReplicationConnection::connect(&other.parse().unwrap())
        .await
        .unwrap()
        .start_replication(&StartOptions {
            slot: SlotName::new(slot).unwrap(),
            publication: PublicationName::new(slot).unwrap(),
            start_lsn: Lsn::ZERO,
            messages: false,
        })
        .await
        .unwrap();
    let r = observe(&config_text(
        &db.superuser_url(),
        slot,
        &broker().brokers,
        "topic = \"busy.{aggregate_type}\"",
        "",
    ));
    // Several attempts fail with "slot is active"; outboxd keeps trying.
    wait_for("a few retries", Duration::from_secs(20), || async {
        (r.metrics.reconnects.get() >= 2).then_some(())
    })
    .await;
    assert!(!r.handle.is_finished(), "outboxd did not give up");
    assert!(r
        .metrics
        .encode()
        .contains("outboxd_publish_errors_total{reason=\"postgres_stream\"}"));
    assert!(!r.health.not_ready_reasons().is_empty());
    holder.stop(Duration::from_secs(5)).await.unwrap();
    wait_for(
        "streaming once the slot is free",
        Duration::from_secs(30),
        || async { r.health.snapshot().streaming.then_some(()) },
    )
    .await;
    // PostgreSQL 17+: the session that got the slot made it a failover
    // slot (postgres.failover_slot, on by default); before 17 there is no
    // such flag.
    let failover: Option<bool> = client
        .query_one(
            "SELECT (to_jsonb(s) ->> 'failover')::boolean FROM pg_replication_slots s WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0);
    assert_ne!(
        failover,
        Some(false),
        "the slot was not altered to a failover slot"
    );
    r.shutdown().await;
}

/// A step that waits on Kafka for longer than `wal_sender_timeout` (here
/// every request to the broker takes 1.5 s: the topic lookup and creation,
/// and a producer queue of one message that is always full) must keep
/// sending status updates: the walsender stays the same process from the
/// first event to the last, and nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waits_longer_than_wal_sender_timeout_keep_the_session() {
    use rdkafka::mocking::MockCluster;

    let db = TestDb::new("rel_slow_broker").await;
    let client = db.client().await;
    client
        .batch_execute(&format!(
            "ALTER DATABASE {} SET wal_sender_timeout = '1s'",
            db.name
        ))
        .await
        .unwrap();
    let mock = MockCluster::new(1).unwrap();
    let brokers = mock.bootstrap_servers();
    let slot = "rel_slow_broker";
    let text = config_text(
        &db.superuser_url(),
        slot,
        &brokers,
        "topic = \"slow.{aggregate_type}\"",
        "[kafka.options]\n\"queue.buffering.max.messages\" = \"1\"\n",
    )
    .replace("admin_timeout = \"5s\"", "admin_timeout = \"20s\"");
    let (handle, stop) = spawn_relay(&text);
    wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(&client, slot).await
    })
    .await;
    let walsender = || async {
        client
            .query_one(
                "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .unwrap()
            .get::<_, Option<i32>>(0)
    };
    // The slot exists before the session starts streaming from it, and it
    // is active while it is created, on the same connection: wait for the
    // walsender to stream.
    let pid = wait_for("the relay streams", Duration::from_secs(30), || async {
        crate::sources::streaming_pid(&client, slot).await
    })
    .await;
    let applied: String = db
        .client()
        .await
        .query_one(
            "SELECT setting FROM pg_settings WHERE name = 'wal_sender_timeout'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(applied, "1000", "the database's wal_sender_timeout is in force");

    mock.broker_round_trip_time(1, Duration::from_millis(1500))
        .unwrap();
    let started = Instant::now();
    let (events, bounds) = write_events(&client, 3, 2, 4, &["Order"], 0).await;
    let last = bounds.last().unwrap().1;
    let mut pids = HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        pids.insert(walsender().await);
        if confirmed_flush(&client, slot).await.is_some_and(|c| c >= last) {
            break;
        }
        assert!(Instant::now() < deadline, "events not confirmed in 120 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let took = started.elapsed();
    assert!(
        took > Duration::from_secs(3),
        "the waits were long enough to matter: {took:?}"
    );
    assert_eq!(
        pids,
        HashSet::from([Some(pid)]),
        "one walsender from the first event to the last: no session was ended by wal_sender_timeout"
    );
    mock.broker_round_trip_time(1, Duration::ZERO).unwrap();
    let want = events.len();
    let got = tokio::task::spawn_blocking(move || {
        consume(&brokers, &["slow.order"], want, Duration::from_secs(30))
    })
    .await
    .unwrap();
    let ids: HashSet<String> = got
        .iter()
        .filter_map(|m| m.header("id").map(str::to_owned))
        .collect();
    for e in &events {
        assert!(ids.contains(&e.id.to_string()), "{} is in Kafka", e.id);
    }
    stop_relay(handle, stop).await;
}

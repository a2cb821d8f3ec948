//! Class 9: polling mode and replay on a record the broker refuses (a
//! crash loop before). Class 10: polling order with several instances and
//! concurrent writers (records published behind a later version before).

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::time::Duration;

use uuid::Uuid;

use super::{daemon_config, ids, outboxd_async, prefix, records, wait_ids};
use crate::harness::broker::{broker, create_topics_with, Consumed};
use crate::harness::{wait_for, TestDb};
use crate::relay::Daemon;

/// A polling-mode config for `db`, topics `<prefix>.<type>`.
fn polling_config(
    dir: &std::path::Path,
    name: &str,
    db: &TestDb,
    p: &str,
    polling: &str,
    routing: &str,
) -> PathBuf {
    let path = daemon_config(
        dir,
        name,
        &db.superuser_url(),
        "unused",
        &broker().brokers,
        p,
        routing,
        "",
        &format!("[polling]\n{polling}"),
    );
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, format!("mode = \"polling\"\n{text}")).unwrap();
    path
}

fn big() -> serde_json::Value {
    let pad: String = (0..1400).map(|_| Uuid::new_v4().simple().to_string()).collect();
    serde_json::json!({ "pad": pad })
}

async fn insert(client: &tokio_postgres::Client, agg: &str, payload: serde_json::Value) -> Uuid {
    let id = Uuid::now_v7();
    client
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload) VALUES ($1, 'Order', $2, 't', $3)",
            &[&id, &agg, &payload],
        )
        .await
        .unwrap();
    id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_and_replay_set_aside_a_row_the_broker_refuses_and_publish_its_neighbours() {
    let db = TestDb::new("hard_poll9").await;
    let client = db.client().await;
    let dir = tempfile::tempdir().unwrap();
    let brokers = &broker().brokers;
    let p = prefix("poll9");
    let (topic, dlq) = (format!("{p}.order"), format!("{p}.dlq"));
    let b = brokers.clone();
    let t = topic.clone();
    tokio::task::spawn_blocking(move || create_topics_with(&b, &[t], &[("max.message.bytes", "20000")]))
        .await
        .unwrap();
    let mut small = Vec::new();
    for i in 0..5 {
        small.push(insert(&client, "a", serde_json::json!({"i": i})).await);
    }
    let bad = insert(&client, "a", big()).await;
    for i in 5..10 {
        small.push(insert(&client, "a", serde_json::json!({"i": i})).await);
    }
    let routing = format!("on_poison = \"dead-letter\"\ndead_letter_topic = \"{dlq}\"");
    let cfg = polling_config(dir.path(), "p9.toml", &db, &p, "interval = \"100ms\"", &routing);
    let log = dir.path().join("p9.log");
    let mut d = Daemon::start(&cfg, &log);
    let want: HashSet<Uuid> = small.iter().copied().collect();
    let recs = wait_ids(brokers, &[&topic], &want).await;
    wait_ids(brokers, &[&dlq], &HashSet::from([bad])).await;
    let unpublished: i64 = wait_for("every row marked", Duration::from_secs(30), || async {
        let n: i64 = client
            .query_one("SELECT count(*) FROM outbox WHERE published_at IS NULL", &[])
            .await
            .unwrap()
            .get(0);
        (n == 0).then_some(n)
    })
    .await;
    assert_eq!(unpublished, 0);
    assert!(d.try_wait().is_none(), "polling goes on");
    // The first copies in the order written.
    assert_eq!(first_copies(&recs, "a"), small);
    assert!(d.sigterm().success());

    // The same rows replayed: published or set aside, never a stop.
    let (code, out, err) = replay_all(dir.path(), &db, &p, &routing, "unused_r9").await;
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(
        out.contains("published    10") && out.contains("dead-letter  1"),
        "{out}"
    );
}

/// A dead letter keeps the row's headers, so it can be refused in its
/// turn: for the dead-letter topic's `max.message.bytes` or by librdkafka
/// (larger than `message.max.bytes`). Its stub (id, reason, sizes) goes
/// instead, in polling and in replay, and nothing stops. A record too
/// large for its topic is refused before it is sent, so the rows around
/// it keep their order (before, the broker refused their whole batch and
/// the next batch was stored ahead of them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_and_replay_send_a_stub_when_the_dead_letter_is_refused_too() {
    let db = TestDb::new("hard_pollstub").await;
    let client = db.client().await;
    let dir = tempfile::tempdir().unwrap();
    let brokers = &broker().brokers;
    let p = prefix("pollstub");
    let (topic, dlq) = (format!("{p}.order"), format!("{p}.dlq"));
    let b = brokers.clone();
    let topics = vec![topic.clone(), dlq.clone()];
    tokio::task::spawn_blocking(move || create_topics_with(&b, &topics, &[("max.message.bytes", "20000")]))
        .await
        .unwrap();
    let mut small = Vec::new();
    small.push(insert(&client, "a", serde_json::json!({"i": 0})).await);
    // Refused by the broker, and so is its dead letter.
    let broker_refused = with_headers(&client, 30_000).await;
    small.push(insert(&client, "a", serde_json::json!({"i": 1})).await);
    // Refused by librdkafka before sending, and so is its dead letter.
    let client_refused = with_headers(&client, 1_100_000).await;
    small.push(insert(&client, "a", serde_json::json!({"i": 2})).await);
    let routing = format!("on_poison = \"dead-letter\"\ndead_letter_topic = \"{dlq}\"");
    let cfg = polling_config(dir.path(), "ps.toml", &db, &p, "interval = \"100ms\"", &routing);
    let log = dir.path().join("ps.log");
    let mut d = Daemon::start(&cfg, &log);
    let recs = wait_ids(brokers, &[&topic], &small.iter().copied().collect()).await;
    let stubs = wait_ids(brokers, &[&dlq], &HashSet::from([broker_refused, client_refused])).await;
    assert!(
        stubs
            .iter()
            .all(|r| r.header("dlq.payload.omitted") == Some("dead letter too large")),
        "each dead letter went as its stub"
    );
    assert!(
        d.try_wait().is_none(),
        "polling goes on:\n{}",
        super::log_text(&log)
    );
    assert_eq!(first_copies(&recs, "a"), small);
    assert!(d.sigterm().success());

    let (code, out, err) = replay_all(dir.path(), &db, &p, &routing, "unused_rs").await;
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(
        out.contains("published    3") && out.contains("dead-letter  2"),
        "{out}"
    );
}

/// A row whose `headers` hold one header of `bytes` bytes.
async fn with_headers(client: &tokio_postgres::Client, bytes: i32) -> Uuid {
    let id = Uuid::now_v7();
    client
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload, headers)
             VALUES ($1, 'Order', 'a', 't', '{}', jsonb_build_object('h', repeat('x', $2)))",
            &[&id, &bytes],
        )
        .await
        .unwrap();
    id
}

/// `outboxd replay --all` of `db`'s outbox into `<p>.<type>`, with this
/// routing: its exit code, stdout and stderr.
async fn replay_all(
    dir: &std::path::Path,
    db: &TestDb,
    p: &str,
    routing: &str,
    slot: &str,
) -> (Option<i32>, String, String) {
    let cfg = daemon_config(
        dir,
        &format!("{slot}.toml"),
        &db.superuser_url(),
        slot,
        &broker().brokers,
        p,
        routing,
        "",
        "",
    );
    let state = dir.join(format!("{slot}.json"));
    outboxd_async(&[
        "replay",
        "--config",
        cfg.to_str().unwrap(),
        "--all",
        "--state",
        state.to_str().unwrap(),
    ])
    .await
}

/// Per aggregate, the ids of the first copies in partition order.
fn first_copies(recs: &[Consumed], key: &str) -> Vec<Uuid> {
    let mut seen = HashSet::new();
    recs.iter()
        .filter(|r| r.key == key)
        .filter_map(|r| r.header("id")?.parse().ok())
        .filter(|id| seen.insert(*id))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_keeps_each_aggregates_order_with_two_instances_and_concurrent_writers() {
    const AGGREGATES: i64 = 5;
    const PER_WRITER: usize = 100;
    let db = TestDb::new("hard_poll10").await;
    let client = db.client().await;
    client
        .batch_execute("CREATE TABLE aggregates (id text PRIMARY KEY, version int NOT NULL)")
        .await
        .unwrap();
    for a in 0..AGGREGATES {
        client
            .execute("INSERT INTO aggregates VALUES ($1, 0)", &[&format!("agg-{a}")])
            .await
            .unwrap();
    }
    let dir = tempfile::tempdir().unwrap();
    let brokers = &broker().brokers;
    let p = prefix("poll10");
    let topic = format!("{p}.order");
    let mut daemons: Vec<Daemon> = (0..2)
        .map(|i| {
            let cfg = polling_config(
                dir.path(),
                &format!("p{i}.toml"),
                &db,
                &p,
                "batch_size = 1\ninterval = \"20ms\"",
                "",
            );
            Daemon::start(&cfg, &dir.path().join(format!("p{i}.log")))
        })
        .collect();

    // Four writers; each event takes its aggregate's next version under a
    // row lock, as an application that orders an aggregate's events does.
    // Some transactions insert first and commit a while later.
    let mut writers = Vec::new();
    for w in 0..4u64 {
        let mut c = db.client().await;
        writers.push(tokio::spawn(async move {
            let mut rng = w * 7919 + 1;
            for i in 0..PER_WRITER {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let agg = format!("agg-{}", rng % AGGREGATES as u64);
                let tx = c.transaction().await.unwrap();
                let v: i32 = tx
                    .query_one(
                        "UPDATE aggregates SET version = version + 1 WHERE id = $1 RETURNING version",
                        &[&agg],
                    )
                    .await
                    .unwrap()
                    .get(0);
                tx.execute(
                    "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload) VALUES ($1, 'Order', $2, 't', $3)",
                    &[&Uuid::now_v7(), &agg, &serde_json::json!({ "version": v, "writer": w, "i": i })],
                )
                .await
                .unwrap();
                if i % 25 == 0 {
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
                tx.commit().await.unwrap();
            }
        }));
    }
    for w in writers {
        w.await.unwrap();
    }
    let total = 4 * PER_WRITER;
    let recs = wait_for("every event", Duration::from_secs(120), || async {
        let recs = records(brokers, &[&topic]).await;
        (ids(&recs).len() >= total).then_some(recs)
    })
    .await;
    assert_eq!(ids(&recs).len(), total, "every event, nothing foreign");
    let mut versions: HashMap<String, Vec<i64>> = HashMap::new();
    let mut seen = HashSet::new();
    for r in &recs {
        let id: Uuid = r.header("id").unwrap().parse().unwrap();
        if !seen.insert(id) {
            continue;
        }
        let value: serde_json::Value = serde_json::from_slice(&r.value).unwrap();
        versions
            .entry(r.key.clone())
            .or_default()
            .push(value["data"]["version"].as_i64().unwrap());
    }
    for (agg, got) in &versions {
        let want: Vec<i64> = (1..=got.len() as i64).collect();
        assert_eq!(got, &want, "aggregate {agg}: versions in the order written");
    }
    for d in daemons.drain(..) {
        assert!(d.sigterm().success());
    }
}

/// Polling publishes in `created_at` order, so `created_at` must be the
/// insert time of every row: a table whose `created_at` defaults to
/// `now()` (a transaction's start: a writer that waited for another can
/// get the earlier time) or may be NULL (never read) is refused, by `check`
/// and at start, with the statement that fixes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_refuses_a_created_at_that_does_not_give_the_write_order() {
    let db = TestDb::new("hard_pollcol").await;
    let client = db.client().await;
    let dir = tempfile::tempdir().unwrap();
    let p = prefix("pollcol");
    let cfg = polling_config(dir.path(), "c.toml", &db, &p, "interval = \"100ms\"", "");
    let c = cfg.to_str().unwrap();
    let refused = |sql: &'static str, says: &'static str| {
        let (client, cfg, dir) = (&client, &cfg, dir.path());
        async move {
            client.batch_execute(sql).await.unwrap();
            let (code, out, _) = outboxd_async(&["check", "--config", c]).await;
            assert_ne!(code, Some(0), "{out}");
            assert!(out.contains("FAIL table") && out.contains(says), "{out}");
            let log = dir.join("c.log");
            let mut d = Daemon::start(cfg, &log);
            assert_eq!(super::exits(&mut d, Duration::from_secs(30), &log).await, Some(1));
            assert!(super::log_text(&log).contains(says), "{}", super::log_text(&log));
        }
    };
    refused(
        "ALTER TABLE outbox ALTER COLUMN created_at SET DEFAULT now()",
        "SET DEFAULT clock_timestamp()",
    )
    .await;
    refused(
        "ALTER TABLE outbox ALTER COLUMN created_at SET DEFAULT clock_timestamp(), ALTER COLUMN created_at DROP NOT NULL",
        "SET NOT NULL",
    )
    .await;
    client
        .batch_execute("ALTER TABLE outbox ALTER COLUMN created_at SET NOT NULL")
        .await
        .unwrap();
    let (_, out, _) = outboxd_async(&["check", "--config", c]).await;
    assert!(
        out.lines()
            .any(|l| l.starts_with("ok   table") && l.contains("clock_timestamp()")),
        "{out}"
    );
}

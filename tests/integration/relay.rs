//! The relay end to end: PostgreSQL → outboxd → a real broker.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use std::sync::Arc;

use outboxd::config::Config;
use outboxd::metrics::Metrics;
use outboxd::ops::health::Health;
use outboxd::relay::{Relay, RelayError};
use outboxd::Lsn;
use serde_json::json;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use uuid::Uuid;

use crate::harness::broker::{broker, consume, Consumed};
use crate::harness::postgres::{self, SCRAM_USER};
use crate::harness::{wait_for, TestDb};

/// A config for `db`, with `extra` TOML appended inside the right tables.
pub(crate) fn config_text(
    db_url: &str,
    slot: &str,
    brokers: &str,
    routing: &str,
    kafka_extra: &str,
) -> String {
    format!(
        r#"
[postgres]
url = "{db_url}"
slot = "{slot}"
publication = "{slot}"
status_interval = "100ms"
reconnect_backoff_max = "2s"

[kafka]
brokers = "{brokers}"
topic_partitions = 3
topic_replication_factor = 1
admin_timeout = "5s"
{kafka_extra}

[routing]
{routing}

[http]
listen = "127.0.0.1:0"

[shutdown]
drain_timeout = "10s"
"#
    )
}

pub(crate) fn spawn_relay(text: &str) -> (JoinHandle<Result<(), RelayError>>, watch::Sender<bool>) {
    crate::harness::init_logs();
    let (config, validated) = Config::from_toml(text, |_| None).expect("test config is valid");
    let metrics = Arc::new(Metrics::new().unwrap());
    let health = Arc::new(Health::new(config.health.thresholds()));
    let (tx, rx) = watch::channel(false);
    let handle = tokio::spawn(async move {
        let mut relay = Relay::new(config, validated, metrics, health)?;
        relay.run(rx).await
    });
    (handle, tx)
}

/// Spawns a relay and waits until its slot exists.
pub(crate) async fn spawn_relay_with_slot(
    client: &tokio_postgres::Client,
    slot: &str,
    text: &str,
) -> (JoinHandle<Result<(), RelayError>>, watch::Sender<bool>) {
    let relay = spawn_relay(text);
    wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(client, slot).await
    })
    .await;
    relay
}

pub(crate) async fn stop_relay(handle: JoinHandle<Result<(), RelayError>>, tx: watch::Sender<bool>) {
    tx.send(true).unwrap();
    let result = tokio::time::timeout(Duration::from_secs(30), handle)
        .await
        .expect("relay stops within 30s")
        .expect("relay task");
    result.expect("relay stops cleanly");
}

pub(crate) async fn confirmed_flush(client: &tokio_postgres::Client, slot: &str) -> Option<Lsn> {
    client
        .query_opt(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .and_then(|r| r.get::<_, Option<String>>(0))
        .map(|s| s.parse().unwrap())
}

pub(crate) async fn current_lsn(client: &tokio_postgres::Client) -> Lsn {
    let s: String = client
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    s.parse().unwrap()
}

/// One written event.
#[derive(Clone, Debug)]
pub(crate) struct Event {
    pub(crate) id: Uuid,
    pub(crate) aggregate_type: String,
    pub(crate) aggregate_id: String,
    pub(crate) event_type: String,
    pub(crate) payload: serde_json::Value,
    pub(crate) txn: usize,
}

/// Writes `txns` transactions of `per_txn` events, over `aggregates`
/// aggregates whose type is one of `types` (fixed per aggregate). Returns
/// the events in commit order and each transaction's LSN bounds.
pub(crate) async fn write_events(
    client: &tokio_postgres::Client,
    txns: usize,
    per_txn: usize,
    aggregates: usize,
    types: &[&str],
    first_txn: usize,
) -> (Vec<Event>, Vec<(Lsn, Lsn)>) {
    let mut events = Vec::new();
    let mut bounds = Vec::new();
    for t in first_txn..first_txn + txns {
        let batch: Vec<Event> = (0..per_txn)
            .map(|r| {
                let n = t * per_txn + r;
                let agg = (n * 7 + t) % aggregates;
                Event {
                    id: Uuid::now_v7(),
                    aggregate_type: types[agg % types.len()].to_owned(),
                    aggregate_id: format!("agg-{agg}"),
                    event_type: format!("ordering.event-{}.v1", n % 4),
                    payload: json!({"n": n, "txn": t, "text": "주문 ✓", "nested": {"a": [1, 2, {"b": null}]}}),
                    txn: t,
                }
            })
            .collect();
        let before = current_lsn(client).await;
        insert_batch(client, &batch).await;
        let after = current_lsn(client).await;
        bounds.push((before, after));
        events.extend(batch);
    }
    (events, bounds)
}

/// Inserts a batch of events in one statement (one transaction), in order.
pub(crate) async fn insert_batch(client: &tokio_postgres::Client, batch: &[Event]) {
    let ids: Vec<Uuid> = batch.iter().map(|e| e.id).collect();
    let at: Vec<&str> = batch.iter().map(|e| e.aggregate_type.as_str()).collect();
    let ai: Vec<&str> = batch.iter().map(|e| e.aggregate_id.as_str()).collect();
    let ty: Vec<&str> = batch.iter().map(|e| e.event_type.as_str()).collect();
    let pl: Vec<serde_json::Value> = batch.iter().map(|e| e.payload.clone()).collect();
    let hd: Vec<serde_json::Value> = batch
        .iter()
        .map(|e| json!({"correlationId": format!("corr-{}", e.txn), "attempt": 1}))
        .collect();
    client
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload, headers)
             SELECT id, at, ai, ty, pl, hd
               FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::jsonb[], $6::jsonb[])
                    WITH ORDINALITY AS u(id, at, ai, ty, pl, hd, ord)
              ORDER BY ord",
            &[&ids, &at, &ai, &ty, &pl, &hd],
        )
        .await
        .unwrap();
}

/// Inserts `events` in one explicit transaction; returns its xid and the
/// WAL insert positions read before it began and after it committed (its
/// commit record lies between them).
pub(crate) async fn insert_with_bounds(
    client: &tokio_postgres::Client,
    events: &[Event],
) -> (String, Lsn, Lsn) {
    let before = current_lsn(client).await;
    client.batch_execute("BEGIN").await.unwrap();
    insert_batch(client, events).await;
    let xid: String = client
        .query_one("SELECT txid_current()::text", &[])
        .await
        .unwrap()
        .get(0);
    client.batch_execute("COMMIT").await.unwrap();
    (xid, before, current_lsn(client).await)
}

/// Per aggregate, the ids in the order their first copies were consumed.
pub(crate) fn first_occurrence_order(records: &[Consumed]) -> HashMap<String, Vec<Uuid>> {
    let mut seen = HashSet::new();
    let mut order: HashMap<String, Vec<Uuid>> = HashMap::new();
    for r in records {
        let id: Uuid = r.header("id").expect("id header").parse().unwrap();
        if seen.insert(id) {
            order.entry(r.key.clone()).or_default().push(id);
        }
    }
    order
}

/// Asserts that `records` hold every one of `events` at least once and
/// nothing else, the first copies of each aggregate's in the order written;
/// returns the ids written.
pub(crate) fn assert_at_least_once(records: &[Consumed], events: &[Event]) -> HashSet<Uuid> {
    let written: HashSet<Uuid> = events.iter().map(|e| e.id).collect();
    let got: HashSet<Uuid> = records
        .iter()
        .map(|r| r.header("id").unwrap().parse().unwrap())
        .collect();
    assert_eq!(got, written, "every event at least once, nothing foreign");
    assert_eq!(
        first_occurrence_order(records),
        expected_order(events),
        "per-aggregate order of first occurrences"
    );
    written
}

pub(crate) fn expected_order(events: &[Event]) -> HashMap<String, Vec<Uuid>> {
    let mut order: HashMap<String, Vec<Uuid>> = HashMap::new();
    for e in events {
        order.entry(e.aggregate_id.clone()).or_default().push(e.id);
    }
    order
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_events_arrive_exactly_as_specified_in_both_value_modes() {
    let db = TestDb::new("relay_e2e").await;
    let client = db.client().await;
    let brokers = &broker().brokers;
    let url = db.superuser_url();
    let (env_handle, env_stop) = spawn_relay(&config_text(
        &url,
        "e2e_envelope",
        brokers,
        "value = \"envelope\"",
        "",
    ));
    let (pay_handle, pay_stop) = spawn_relay(&config_text(
        &url,
        "e2e_payload",
        brokers,
        "value = \"payload\"\ntopic = \"payload.{aggregate_type}\"",
        "",
    ));
    // Both slots exist before the writes, so both see every event.
    for slot in ["e2e_envelope", "e2e_payload"] {
        wait_for("the slot", Duration::from_secs(30), || async {
            confirmed_flush(&client, slot).await
        })
        .await;
    }

    let types = ["Order", "Payment", "Shipment"];
    let (events, bounds) = write_events(&client, 1_000, 10, 100, &types, 0).await;
    assert_eq!(events.len(), 10_000);
    let created: HashMap<Uuid, chrono::DateTime<chrono::Utc>> = client
        .query("SELECT id, created_at FROM outbox", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let stored_payload: HashMap<Uuid, String> = client
        .query("SELECT id, payload::text FROM outbox", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();

    let by_id: HashMap<Uuid, &Event> = events.iter().map(|e| (e.id, e)).collect();
    let env = tokio::task::spawn_blocking({
        let brokers = brokers.clone();
        move || {
            consume(
                &brokers,
                &["order.events", "payment.events", "shipment.events"],
                10_000,
                Duration::from_secs(120),
            )
        }
    })
    .await
    .unwrap();
    assert_eq!(env.len(), 10_000, "every envelope event arrives");
    let unique: HashSet<&str> = env.iter().map(|r| r.header("id").unwrap()).collect();
    assert_eq!(unique.len(), 10_000, "no duplicates without failures");
    for r in &env {
        let id: Uuid = r.header("id").unwrap().parse().unwrap();
        let e = by_id[&id];
        assert_eq!(r.topic, format!("{}.events", e.aggregate_type.to_lowercase()));
        assert_eq!(r.key, e.aggregate_id);
        assert_eq!(r.header("type"), Some(e.event_type.as_str()));
        assert_eq!(r.header("aggregateType"), Some(e.aggregate_type.as_str()));
        assert_eq!(r.header("aggregateId"), Some(e.aggregate_id.as_str()));
        assert_eq!(
            r.header("correlationId"),
            Some(format!("corr-{}", e.txn).as_str())
        );
        assert_eq!(r.header("attempt"), Some("1"));
        assert_eq!(r.timestamp_ms, Some(created[&id].timestamp_millis()));
        let value: serde_json::Value = serde_json::from_slice(&r.value).unwrap();
        assert_eq!(
            value,
            json!({
                "eventId": id.to_string(),
                "type": e.event_type,
                "occurredAt": created[&id].to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
                "aggregateType": e.aggregate_type,
                "aggregateId": e.aggregate_id,
                "data": e.payload,
            })
        );
    }
    assert_eq!(
        first_occurrence_order(&env),
        expected_order(&events),
        "per-aggregate commit order"
    );

    let pay = tokio::task::spawn_blocking({
        let brokers = brokers.clone();
        move || {
            consume(
                &brokers,
                &["payload.order", "payload.payment", "payload.shipment"],
                10_000,
                Duration::from_secs(120),
            )
        }
    })
    .await
    .unwrap();
    assert_eq!(pay.len(), 10_000, "every payload-mode event arrives");
    for r in &pay {
        let id: Uuid = r.header("id").unwrap().parse().unwrap();
        assert_eq!(r.value, stored_payload[&id].as_bytes(), "payload byte for byte");
        assert_eq!(r.key, by_id[&id].aggregate_id);
    }
    assert_eq!(first_occurrence_order(&pay), expected_order(&events));

    // Everything is confirmed once acknowledged, and shutdown is clean.
    let last_commit_lower_bound = bounds.last().unwrap().0;
    for slot in ["e2e_envelope", "e2e_payload"] {
        wait_for(
            "the last transaction to be confirmed",
            Duration::from_secs(30),
            || async {
                confirmed_flush(&client, slot)
                    .await
                    .filter(|c| *c > last_commit_lower_bound)
            },
        )
        .await;
    }
    stop_relay(env_handle, env_stop).await;
    stop_relay(pay_handle, pay_stop).await;
}

/// The ack-order rule against MockCluster: produce requests for one
/// partition are slow, so acknowledgements arrive out of step with the
/// transactions; at every sample, each transaction at or below
/// `confirmed_flush_lsn` is fully in Kafka.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirmed_lsn_never_passes_an_unacknowledged_event() {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::message::{Headers, Message};
    use rdkafka::mocking::MockCluster;
    use rdkafka::{ClientConfig, Offset, TopicPartitionList};

    let db = TestDb::new("relay_ackorder").await;
    let client = db.client().await;
    let mock = MockCluster::new(3).unwrap();
    let topic = "ackorder.order";
    mock.create_topic(topic, 3, 1).unwrap();
    for p in 0..3 {
        mock.partition_leader(topic, p, Some(p + 1)).unwrap();
    }
    // One slow broker: its partition's acknowledgements lag the others'.
    mock.broker_round_trip_time(1, Duration::from_millis(400))
        .unwrap();
    let brokers = mock.bootstrap_servers();
    let slot = "ackorder";
    let (handle, stop) = spawn_relay(&config_text(
        &db.superuser_url(),
        slot,
        &brokers,
        "topic = \"ackorder.{aggregate_type}\"",
        "slot_register = false",
    ));
    wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(&client, slot).await
    })
    .await;

    // Transactions trickle in, so acknowledgements of early ones arrive
    // while later ones still wait on the slow partition.
    const TXNS: usize = 100;
    let written = std::sync::Arc::new(std::sync::Mutex::new((
        Vec::<Event>::new(),
        Vec::<(Lsn, Lsn)>::new(),
    )));
    let writer = {
        let client = db.client().await;
        let written = written.clone();
        tokio::spawn(async move {
            for t in 0..TXNS {
                let (events, bounds) = write_events(&client, 1, 5, 20, &["Order"], t).await;
                {
                    let mut w = written.lock().unwrap();
                    w.0.extend(events);
                    w.1.extend(bounds);
                }
                tokio::time::sleep(Duration::from_millis(60)).await;
            }
        })
    };
    let mut injected = 0;
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("group.id", "ackorder-check")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    for p in 0..3 {
        tpl.add_partition_offset(topic, p, Offset::Beginning).unwrap();
    }
    consumer.assign(&tpl).unwrap();
    let mut present: HashSet<Uuid> = HashSet::new();
    // (aggregate, id) in offset order within each partition.
    let mut arrivals: Vec<(String, Uuid)> = Vec::new();
    let mut positions = [0i64; 3];
    let mut partial_samples = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    loop {
        let confirmed = confirmed_flush(&client, slot).await.unwrap();
        // Everything acknowledged before `confirmed` was read is below the
        // high watermarks read now; consume up to them.
        let mut high = [0i64; 3];
        for p in 0..3 {
            high[p as usize] = consumer
                .fetch_watermarks(topic, p, Duration::from_secs(5))
                .unwrap()
                .1;
        }
        while (0..3).any(|p| positions[p] < high[p]) {
            if let Some(m) = consumer.poll(Duration::from_millis(100)) {
                let m = m.unwrap();
                positions[m.partition() as usize] = m.offset() + 1;
                let headers = m.headers().unwrap();
                let id: Uuid =
                    std::str::from_utf8(headers.iter().find(|h| h.key == "id").unwrap().value.unwrap())
                        .unwrap()
                        .parse()
                        .unwrap();
                present.insert(id);
                arrivals.push((String::from_utf8_lossy(m.key().unwrap()).into_owned(), id));
            }
        }
        let (events, bounds) = written.lock().unwrap().clone();
        // Retried Produce errors after the first batches. The mock accepts
        // a later request of a partition while an earlier one waits for its
        // retry, and librdkafka then acknowledges the earlier records
        // implicitly, with no offset, though the mock never stored them:
        // outboxd must not take those for stored (the README, "Reliability").
        if bounds.len() >= 10 * (injected + 1) && injected < 8 {
            injected += 1;
            mock.request_errors(
                rdkafka::types::RDKafkaApiKey::Produce,
                &[rdkafka::types::RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_LEADER_FOR_PARTITION; 3],
            );
        }
        let mut passed = 0;
        for (t, (_, after)) in bounds.iter().enumerate() {
            if *after <= confirmed {
                passed += 1;
                for e in events.iter().filter(|e| e.txn == t) {
                    assert!(
                        present.contains(&e.id),
                        "confirmed {confirmed} passed txn {t}, whose event {} is not in Kafka",
                        e.id
                    );
                }
            }
        }
        // Informative: the slot has moved past some transactions while a
        // committed event is still unacknowledged.
        if passed > 0 && events.iter().any(|e| !present.contains(&e.id)) {
            partial_samples += 1;
        }
        if bounds.len() == TXNS && present.len() == events.len() && confirmed >= bounds[TXNS - 1].0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "events did not all arrive: {} of {}",
            present.len(),
            events.len()
        );
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    writer.await.unwrap();
    eprintln!(
        "ack order: {partial_samples} samples with the slot advanced while events were still unacknowledged"
    );
    assert!(
        partial_samples > 0,
        "the test never saw acknowledgements out of step with the slot"
    );
    // Out-of-step acknowledgements lost nothing and kept each aggregate's
    // order.
    let (events, _) = written.lock().unwrap().clone();
    let mut seen = HashSet::new();
    let mut first: HashMap<String, Vec<Uuid>> = HashMap::new();
    for (key, id) in arrivals {
        if seen.insert(id) {
            first.entry(key).or_default().push(id);
        }
    }
    assert_eq!(
        first,
        expected_order(&events),
        "per-aggregate order despite produce errors"
    );
    stop_relay(handle, stop).await;
    drop(mock);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_outbox_does_not_pin_wal() {
    let db = TestDb::new("relay_idle").await;
    let client = db.client().await;
    client
        .batch_execute("CREATE TABLE busy (id serial PRIMARY KEY, v text)")
        .await
        .unwrap();
    let slot = "idle_slot";
    let (handle, stop) = spawn_relay(&config_text(
        &db.superuser_url(),
        slot,
        &broker().brokers,
        "topic = \"idle.{aggregate_type}\"",
        "",
    ));
    wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(&client, slot).await
    })
    .await;
    for _ in 0..200 {
        client
            .execute("INSERT INTO busy (v) VALUES (repeat('x', 500))", &[])
            .await
            .unwrap();
    }
    let after_writes = current_lsn(&client).await;
    let writer = {
        let client = db.client().await;
        tokio::spawn(async move {
            for _ in 0..100 {
                client
                    .execute("INSERT INTO busy (v) VALUES ('y')", &[])
                    .await
                    .unwrap();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let confirmed = wait_for(
        "confirmed_flush_lsn to follow other tables' WAL",
        Duration::from_secs(30),
        || async {
            confirmed_flush(&client, slot)
                .await
                .filter(|c| *c >= after_writes)
        },
    )
    .await;
    assert!(confirmed >= after_writes);
    writer.await.unwrap();
    stop_relay(handle, stop).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_topic_without_creation_stops_and_holds_the_slot() {
    let db = TestDb::new("relay_notopic").await;
    let client = db.client().await;
    let slot = "notopic";
    let text = config_text(
        &db.superuser_url(),
        slot,
        &broker().brokers,
        "topic = \"never-created.{aggregate_type}\"",
        "create_topics = false",
    );
    let (handle, _stop) = spawn_relay(&text);
    let start = wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(&client, slot).await
    })
    .await;
    let (_, bounds) = write_events(&client, 1, 3, 1, &["Order"], 0).await;
    let err = tokio::time::timeout(Duration::from_secs(30), handle)
        .await
        .expect("outboxd stops")
        .unwrap()
        .expect_err("a missing topic is a definite error");
    let text = err.to_string();
    assert!(
        text.contains("never-created.order") && text.contains("create_topics"),
        "{text}"
    );
    assert!(!err.is_transient());
    let confirmed = confirmed_flush(&client, slot).await.unwrap();
    assert!(confirmed >= start && confirmed < bounds[0].1, "{confirmed}");
    // The transaction is still in the slot, waiting to be decoded again.
    let pending = pending_in_released_slot(&client, slot).await;
    assert!(
        pending >= 5,
        "Begin, 3 inserts and Commit are still in the slot; found {pending} messages"
    );
}

/// Waits until no walsender holds `slot`, then counts the messages still
/// waiting in it (a peek: nothing is consumed).
pub(crate) async fn pending_in_released_slot(client: &tokio_postgres::Client, slot: &str) -> i64 {
    wait_for("the slot to be released", Duration::from_secs(10), || async {
        let active: bool = client
            .query_one(
                "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .unwrap()
            .get(0);
        (!active).then_some(())
    })
    .await;
    client
        .query_one(
            "SELECT count(*) FROM pg_logical_slot_peek_binary_changes($1::text::name, NULL, NULL,
                 'proto_version', '1', 'publication_names', $1::text)",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0)
}

pub(crate) fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_outboxd")
}

pub(crate) fn write_config(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn check(config: &Path) -> (bool, String) {
    let out = Command::new(bin())
        .args(["check", "--config"])
        .arg(config)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_reports_each_problem_with_a_clear_line() {
    let dir = tempfile::tempdir().unwrap();
    let db = TestDb::new("relay_check").await;
    let brokers = &broker().brokers;
    let routing = "topic = \"check.{aggregate_type}\"";

    let good = write_config(
        dir.path(),
        "good.toml",
        &config_text(&db.superuser_url(), "chk", brokers, routing, ""),
    );
    let (ok, out) = tokio::task::spawn_blocking(move || check(&good)).await.unwrap();
    assert!(ok, "a correct setup passes:\n{out}");
    for name in [
        "config",
        "postgres",
        "wal_level",
        "table",
        "privileges",
        "publication",
        "slot",
        "kafka",
    ] {
        assert!(
            out.lines().any(|l| l.starts_with("ok") && l.contains(name)),
            "no ok line for {name}:\n{out}"
        );
    }

    let replica = postgres::dedicated("wal_level = replica");
    replica.pg_ctl(&["status"]).unwrap();
    let url = replica.url("postgres", None, "postgres");
    let cfg = write_config(
        dir.path(),
        "replica.toml",
        &config_text(&url, "chk", brokers, routing, ""),
    );
    let (ok, out) = tokio::task::spawn_blocking(move || check(&cfg)).await.unwrap();
    assert!(!ok);
    assert!(
        out.contains("FAIL wal_level") && out.contains("must be logical"),
        "{out}"
    );
    replica.pg_ctl(&["stop", "-m", "fast"]).unwrap();

    let no_table = TestDb::new("relay_check_notable").await;
    no_table
        .client()
        .await
        .batch_execute("DROP TABLE outbox")
        .await
        .unwrap();
    let cfg = write_config(
        dir.path(),
        "notable.toml",
        &config_text(&no_table.superuser_url(), "chk", brokers, routing, ""),
    );
    let (ok, out) = tokio::task::spawn_blocking(move || check(&cfg)).await.unwrap();
    assert!(!ok);
    assert!(
        out.contains("FAIL table") && out.contains("does not exist"),
        "{out}"
    );

    let wrong = db.url(SCRAM_USER.0, Some("wrong-password"));
    let cfg = write_config(
        dir.path(),
        "wrongpw.toml",
        &config_text(&wrong, "chk", brokers, routing, ""),
    );
    let (ok, out) = tokio::task::spawn_blocking(move || check(&cfg)).await.unwrap();
    assert!(!ok);
    assert!(
        out.contains("FAIL postgres") && out.contains("password authentication failed"),
        "{out}"
    );

    let dead = format!("127.0.0.1:{}", postgres::free_port());
    let cfg = write_config(
        dir.path(),
        "nobroker.toml",
        &config_text(&db.superuser_url(), "chk", &dead, routing, "")
            .replace("admin_timeout = \"5s\"", "admin_timeout = \"2s\""),
    );
    let (ok, out) = tokio::task::spawn_blocking(move || check(&cfg)).await.unwrap();
    assert!(!ok);
    assert!(
        out.contains("FAIL kafka") && out.contains("cannot reach the Kafka brokers"),
        "{out}"
    );
}

#[test]
fn bad_config_fails_at_start_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let base = config_text("postgres://u@127.0.0.1:1/x", "s", "127.0.0.1:1", "", "");
    for (name, text, field) in [
        (
            "unknown.toml",
            base.replace("[routing]", "[routing]\nvalu = \"payload\""),
            "routing",
        ),
        (
            "invalid.toml",
            base.replace("[routing]", "[routing]\nvalue = \"xml\""),
            "routing.value",
        ),
        (
            "slot.toml",
            base.replace("slot = \"s\"", "slot = \"x\\\"; drop table t; --\""),
            "postgres.slot",
        ),
        (
            "env.toml",
            base.replace("u@127", "u:${OUTBOXD_TEST_UNSET_VAR}@127"),
            "OUTBOXD_TEST_UNSET_VAR",
        ),
    ] {
        let p = write_config(dir.path(), name, &text);
        let out = Command::new(bin())
            .args(["run", "--config"])
            .arg(&p)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{name}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(field), "{name}: {err}");
    }
    let out = Command::new(bin()).args(["run", "--help"]).output().unwrap();
    assert!(out.status.success() && String::from_utf8_lossy(&out.stdout).contains("--config"));
}

pub(crate) struct Daemon {
    child: crate::harness::Reaped,
    config: PathBuf,
    log: PathBuf,
}

impl Daemon {
    pub(crate) fn start(config: &Path, log: &Path) -> Daemon {
        let level = std::env::var("OUTBOXD_DAEMON_LOG").unwrap_or("warn".into());
        Daemon::start_logging(config, log, &level)
    }

    /// Starts outboxd with `RUST_LOG=level`, appending to `log`.
    pub(crate) fn start_logging(config: &Path, log: &Path, level: &str) -> Daemon {
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap();
        let child = crate::harness::Reaped::new(
            Command::new(bin())
                .args(["run", "--config"])
                .arg(config)
                .env("RUST_LOG", level)
                .stdin(Stdio::null())
                .stdout(log_file.try_clone().unwrap())
                .stderr(log_file)
                .spawn()
                .unwrap(),
        );
        Daemon {
            child,
            config: config.to_owned(),
            log: log.to_owned(),
        }
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The exit status, if outboxd has exited.
    pub(crate) fn try_wait(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().unwrap()
    }

    pub(crate) fn kill9(&mut self) {
        self.child.kill().unwrap(); // SIGKILL
        self.child.wait().unwrap();
    }

    pub(crate) fn restart(&mut self) {
        *self = Daemon::start(&self.config, &self.log);
    }

    /// Restarts with `RUST_LOG=level`.
    pub(crate) fn restart_logging(&mut self, level: &str) {
        *self = Daemon::start_logging(&self.config, &self.log, level);
    }

    /// Sends `signal` (e.g. "STOP", "CONT").
    pub(crate) fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(status.success(), "kill -{signal}");
    }

    pub(crate) fn sigterm(mut self) -> std::process::ExitStatus {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        self.child.wait().unwrap()
    }
}

/// A test that fails while outboxd runs shows the end of outboxd's log:
/// libtest prints what a failing test wrote, and the log file is in a
/// temporary directory that goes with the test.
impl Drop for Daemon {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        let tail = &lines[lines.len().saturating_sub(60)..];
        eprintln!(
            "--- the last {} lines of {} ---\n{}\n--- end of the log ---",
            tail.len(),
            self.log.display(),
            tail.join("\n")
        );
    }
}

/// `writers` tasks, each writing `txns` transactions of `per_txn` events
/// over 25 aggregates of its own; each returns its events in commit order.
pub(crate) async fn torture_writers(
    db: &TestDb,
    writers: usize,
    txns: usize,
    per_txn: usize,
) -> Vec<JoinHandle<Vec<Event>>> {
    torture_writers_over(db, writers, txns, per_txn, &["Order"]).await
}

/// As [`torture_writers`], each aggregate of one of `types` (the 25
/// aggregates of each writer spread over them).
pub(crate) async fn torture_writers_over(
    db: &TestDb,
    writers: usize,
    txns: usize,
    per_txn: usize,
    types: &[&str],
) -> Vec<JoinHandle<Vec<Event>>> {
    let types: Vec<String> = types.iter().map(|t| (*t).to_owned()).collect();
    let mut handles = Vec::new();
    for w in 0..writers {
        let client = db.client().await;
        let types = types.clone();
        handles.push(tokio::spawn(async move {
            let mut all = Vec::new();
            for t in 0..txns {
                let batch: Vec<Event> = (0..per_txn)
                    .map(|r| Event {
                        id: Uuid::now_v7(),
                        aggregate_type: types[(w * 25 + (t * per_txn + r) % 25) % types.len()].clone(),
                        aggregate_id: format!("w{w}-agg-{}", (t * per_txn + r) % 25),
                        event_type: "torture.v1".to_owned(),
                        payload: json!({"w": w, "t": t, "r": r}),
                        txn: t,
                    })
                    .collect();
                insert_batch(&client, &batch).await;
                all.extend(batch);
            }
            all
        }));
    }
    handles
}

/// A seed for the tests' xorshift: the clock's nanoseconds, never zero.
pub(crate) fn seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1
}

pub(crate) fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Torture: SIGKILL the daemon at random points while 4 writers stream
/// events. The suite runs a smaller N; the full run is
/// `OUTBOXD_TORTURE_EVENTS=100000 OUTBOXD_TORTURE_KILLS=20 cargo test --release --test integration torture -- --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn torture_sigkill_during_the_stream_loses_nothing_and_keeps_order() {
    const WRITERS: usize = 4;
    const PER_TXN: usize = 10;
    const MAX_INFLIGHT: usize = 2_000;
    let total = env_usize("OUTBOXD_TORTURE_EVENTS", 20_000);
    let kills = env_usize("OUTBOXD_TORTURE_KILLS", 6);
    let txns_per_writer = total / WRITERS / PER_TXN;
    let db = TestDb::new("relay_torture").await;
    let client = db.client().await;
    let dir = tempfile::tempdir().unwrap();
    let slot = "torture_slot";
    let cfg = write_config(
        dir.path(),
        "torture.toml",
        &config_text(
            &db.superuser_url(),
            slot,
            &broker().brokers,
            "topic = \"torture.{aggregate_type}\"",
            &format!("max_inflight = {MAX_INFLIGHT}"),
        ),
    );
    let log = dir.path().join("outboxd.log");
    let mut daemon = Daemon::start(&cfg, &log);
    wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(&client, slot).await
    })
    .await;

    let started = std::time::Instant::now();
    let writers = torture_writers(&db, WRITERS, txns_per_writer, PER_TXN).await;
    let mut rng = seed();
    for _ in 0..kills {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        tokio::time::sleep(Duration::from_millis(150 + rng % 900)).await;
        daemon.kill9();
        daemon.restart();
    }
    let mut events = Vec::new();
    for w in writers {
        events.extend(w.await.unwrap());
    }
    let written_in = started.elapsed();
    assert_eq!(events.len(), txns_per_writer * WRITERS * PER_TXN);

    let brokers = broker().brokers.clone();
    let want = events.len();
    let records = wait_for("every event to reach Kafka", Duration::from_secs(300), || {
        let brokers = brokers.clone();
        async move {
            let records = tokio::task::spawn_blocking(move || {
                consume(&brokers, &["torture.order"], usize::MAX, Duration::from_secs(3))
            })
            .await
            .unwrap();
            let unique: HashSet<&str> = records.iter().filter_map(|r| r.header("id")).collect();
            (unique.len() >= want).then_some(records)
        }
    })
    .await;
    let status = daemon.sigterm();
    assert!(status.success(), "SIGTERM exits 0: {status}");

    let written = assert_at_least_once(&records, &events);
    // The documented bound per crash: what was in flight, the transaction
    // being read, and one second (two guard rounds, generously) of events.
    let duplicates = records.len() - written.len();
    let per_second = written.len() as f64 / written_in.as_secs_f64();
    let bound = kills * (MAX_INFLIGHT + PER_TXN + per_second.ceil() as usize);
    eprintln!(
        "torture: {WRITERS} writers, {} events written in {written_in:?} ({per_second:.0}/s), {kills} SIGKILLs, {duplicates} duplicates (bound {bound})",
        written.len(),
    );
    assert!(
        duplicates <= bound,
        "{duplicates} duplicates exceed the documented bound {bound}"
    );
}

/// A URL with several hosts, as libpq takes it: with
/// `target_session_attrs=read-write`, outboxd passes over a server that
/// refuses connections and a read-only one (a server with
/// `default_transaction_read_only = on` stands in for a standby), and
/// streams from the writable one. Its slot and publication are made there
/// and nowhere else, and every event arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_hosts_skip_unreachable_and_read_only_servers() {
    let db = TestDb::new("relay_hosts").await;
    let client = db.client().await;
    let read_only = postgres::dedicated("");
    {
        let ro = read_only.client("postgres").await;
        ro.batch_execute(&format!("CREATE DATABASE {}", db.name))
            .await
            .unwrap();
        ro.batch_execute("ALTER SYSTEM SET default_transaction_read_only = on")
            .await
            .unwrap();
        ro.batch_execute("SELECT pg_reload_conf()").await.unwrap();
    }
    let nobody = postgres::free_port();
    let main = postgres::server().port;
    let url = format!(
        "postgres://postgres@127.0.0.1:{nobody},127.0.0.1:{ro},127.0.0.1:{main}/{name}?sslmode=disable&target_session_attrs=read-write&connect_timeout=2",
        ro = read_only.port,
        name = db.name
    );
    let slot = "several_hosts";
    let text = config_text(
        &url,
        slot,
        &broker().brokers,
        "topic = \"several-hosts.{aggregate_type}\"",
        "",
    );
    let (handle, stop) = spawn_relay_with_slot(&client, slot, &text).await;
    let (events, _) = write_events(&client, 20, 5, 7, &["Order"], 0).await;
    let brokers = broker().brokers.clone();
    let got = tokio::task::spawn_blocking(move || {
        consume(&brokers, &["several-hosts.order"], 100, Duration::from_secs(60))
    })
    .await
    .unwrap();
    let want: HashSet<String> = events.iter().map(|e| e.id.to_string()).collect();
    let seen: HashSet<String> = got
        .iter()
        .filter_map(|c| c.header("id"))
        .map(str::to_owned)
        .collect();
    assert_eq!(seen, want, "every event, from the writable server");
    stop_relay(handle, stop).await;
    // Nothing was made on the read-only server.
    let ro = read_only.client(&db.name).await;
    let slots: i64 = ro
        .query_one("SELECT count(*) FROM pg_replication_slots", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(slots, 0, "no slot on the read-only server");
}

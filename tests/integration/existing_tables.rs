//! The outbox tables teams already have, created with the DDL their
//! libraries document, read through `[columns]` end to end on Apache
//! Kafka: Debezium's default table, the Quarkus extension's, a TypeORM
//! entity with camelCase columns (seed 000's `OutboxEntity`), a
//! Kafka-record-shaped table, and Eventuate's text payload and text
//! headers. Each row arrives with the right topic, key, headers, value,
//! partition and timestamp; bad values in a mapped column follow
//! `routing.on_poison`. Also: `outboxd check` naming the column and the
//! setting for each way a mapping can be wrong, polling and replay through
//! a map, and parking and redriving a mapped row.

use std::collections::HashMap;
use std::time::Duration;

use serde_json::json;

use crate::harness::broker::{broker, consume, create_topics, create_topics_with, Consumed};
use crate::harness::{wait_for, TestDb};
use crate::relay::{bin, confirmed_flush, current_lsn, spawn_relay_with_slot, stop_relay, write_config};

/// outboxd on `table` of `db`, with `[columns]` and `[routing]` as given.
fn config(db: &TestDb, slot: &str, table: &str, columns: &str, routing: &str) -> String {
    format!(
        r#"
[postgres]
url = "{url}"
table = "{table}"
slot = "{slot}"
publication = "{slot}"
status_interval = "100ms"
reconnect_backoff_max = "2s"

[columns]
{columns}

[kafka]
brokers = "{brokers}"
topic_partitions = 3
topic_replication_factor = 1
admin_timeout = "5s"

[routing]
{routing}

[http]
listen = "127.0.0.1:0"

[shutdown]
drain_timeout = "10s"
"#,
        url = db.superuser_url(),
        brokers = broker().brokers
    )
}

/// Runs the relay until every write is confirmed, then stops it.
async fn relay_until_confirmed(
    client: &tokio_postgres::Client,
    slot: &str,
    text: &str,
    write: impl std::future::Future<Output = ()>,
) {
    let (handle, stop) = spawn_relay_with_slot(client, slot, text).await;
    write.await;
    let end = current_lsn(client).await;
    wait_for(
        "outboxd to confirm every write",
        Duration::from_secs(60),
        || async { confirmed_flush(client, slot).await.filter(|c| *c >= end) },
    )
    .await;
    stop_relay(handle, stop).await;
}

async fn read(topics: &[String], want: usize) -> Vec<Consumed> {
    let topics = topics.to_vec();
    tokio::task::spawn_blocking(move || {
        let names: Vec<&str> = topics.iter().map(String::as_str).collect();
        consume(&broker().brokers, &names, want, Duration::from_secs(30))
    })
    .await
    .unwrap()
}

fn by_id(records: &[Consumed]) -> HashMap<String, &Consumed> {
    records
        .iter()
        .map(|r| (r.header("id").unwrap_or_default().to_owned(), r))
        .collect()
}

fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// Debezium's documented default table (`id uuid, aggregatetype,
/// aggregateid, type, payload jsonb`): no headers, no timestamp column.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debeziums_default_table() {
    let db = TestDb::empty("tbl_dbz").await;
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE TABLE outbox (
                 id uuid NOT NULL PRIMARY KEY,
                 aggregatetype varchar(255) NOT NULL,
                 aggregateid varchar(255) NOT NULL,
                 type varchar(255) NOT NULL,
                 payload jsonb)",
        )
        .await
        .unwrap();
    let text = config(
        &db,
        "tbl_dbz",
        "public.outbox",
        "key = \"aggregateid\"\nroute = \"aggregatetype\"",
        "topic = \"tbl-dbz.{aggregate_type}\"\nvalue = \"payload\"\non_poison = \"dead-letter\"\ndead_letter_topic = \"tbl-dbz.dlq\"",
    );
    let before = now_ms();
    relay_until_confirmed(&client, "tbl_dbz", &text, async {
        client
            .batch_execute(
                r#"INSERT INTO outbox VALUES
                     ('00000000-0000-7000-8000-000000000001', 'Order', 'o-1', 'OrderPlaced', '{"total": 2.50}'),
                     ('00000000-0000-7000-8000-000000000002', 'Order', 'o-1', 'OrderPaid', NULL),
                     ('00000000-0000-7000-8000-000000000003', 'Payment', 'p-9', 'PaymentTaken', '[1, "two"]'),
                     ('00000000-0000-7000-8000-000000000004', 'Order', '', 'OrderLost', '{}')"#,
            )
            .await
            .unwrap();
    })
    .await;
    let after = now_ms();
    let records = read(&["tbl-dbz.order".into(), "tbl-dbz.payment".into()], 3).await;
    assert_eq!(records.len(), 3);
    let r = by_id(&records);
    let placed = r["00000000-0000-7000-8000-000000000001"];
    assert_eq!(
        (placed.topic.as_str(), placed.key.as_str()),
        ("tbl-dbz.order", "o-1")
    );
    assert_eq!(
        placed.value, br#"{"total": 2.50}"#,
        "the jsonb's text, byte for byte"
    );
    assert_eq!(placed.header("type"), Some("OrderPlaced"));
    assert_eq!(placed.header("aggregateType"), Some("Order"));
    assert_eq!(placed.header("aggregateId"), Some("o-1"));
    let t = placed.timestamp_ms.unwrap();
    assert!(
        (before - 1000..=after).contains(&t),
        "no timestamp column: the commit time ({t})"
    );
    let paid = r["00000000-0000-7000-8000-000000000002"];
    assert!(paid.null_value, "a NULL payload is a null value");
    assert_eq!(r["00000000-0000-7000-8000-000000000003"].value, br#"[1, "two"]"#);
    let dead = read(&["tbl-dbz.dlq".into()], 1).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].header("dlq.reason"), Some("empty_key"));
    assert_eq!(dead[0].header("id"), Some("00000000-0000-7000-8000-000000000004"));
}

/// The Quarkus extension's `OutboxEvent` (quoted, mixed case): a
/// `timestamp` without time zone, a varchar payload, the tracing column,
/// and rows deleted in the transaction that inserted them
/// (`remove-after-insert`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quarkus_extensions_table() {
    let db = TestDb::empty("tbl_qrk").await;
    let client = db.client().await;
    client
        .batch_execute(
            r#"CREATE TABLE "OutboxEvent" (
                   id uuid NOT NULL PRIMARY KEY,
                   aggregatetype varchar(255) NOT NULL,
                   aggregateid varchar(255) NOT NULL,
                   type varchar(255) NOT NULL,
                   "timestamp" timestamp NOT NULL,
                   payload varchar(8000),
                   tracingspancontext varchar(256))"#,
        )
        .await
        .unwrap();
    let text = config(
        &db,
        "tbl_qrk",
        "public.OutboxEvent",
        r#"key = "aggregateid"
route = "aggregatetype"
timestamp = "timestamp"
additional = [
  { column = "type", placement = "header", name = "eventType" },
  { column = "tracingspancontext", placement = "header" },
]"#,
        "topic = \"tbl-qrk.{aggregate_type}.events\"\nlowercase_aggregate_type = false\nvalue = \"payload\"\nstandard_headers = false",
    );
    relay_until_confirmed(&client, "tbl_qrk", &text, async {
        client
            .batch_execute(
                r#"BEGIN;
                   INSERT INTO "OutboxEvent" VALUES
                     ('00000000-0000-7000-8000-000000000011', 'Order', '1001', 'OrderCreated',
                      (now() AT TIME ZONE 'UTC') - interval '1 hour', '{"id":1001,"lines":[]}',
                      'traceid=abc');
                   DELETE FROM "OutboxEvent" WHERE id = '00000000-0000-7000-8000-000000000011';
                   COMMIT;
                   INSERT INTO "OutboxEvent" VALUES
                     ('00000000-0000-7000-8000-000000000012', 'Order', '1001', 'OrderShipped',
                      '2026-01-02 03:04:05.678', 'plain text ✓, not JSON', NULL);"#,
            )
            .await
            .unwrap();
    })
    .await;
    let records = read(&["tbl-qrk.Order.events".into()], 2).await;
    assert_eq!(records.len(), 2, "the DELETE after the INSERT takes nothing away");
    let r = by_id(&records);
    let created = r["00000000-0000-7000-8000-000000000011"];
    assert_eq!(created.value, br#"{"id":1001,"lines":[]}"#);
    assert_eq!(created.header("eventType"), Some("OrderCreated"));
    assert_eq!(created.header("tracingspancontext"), Some("traceid=abc"));
    let names: Vec<&str> = created.headers.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        names,
        ["id", "eventType", "tracingspancontext"],
        "standard_headers = false"
    );
    let hour_ago = now_ms() - 3_600_000;
    let t = created.timestamp_ms.unwrap();
    assert!(
        (t - hour_ago).abs() < 120_000,
        "the timestamp column, read as UTC ({t})"
    );
    let shipped = r["00000000-0000-7000-8000-000000000012"];
    assert_eq!(
        shipped.value,
        "plain text ✓, not JSON".as_bytes(),
        "text passes through"
    );
    let t = shipped.timestamp_ms.unwrap();
    assert!(
        (t - now_ms()).abs() < 120_000,
        "a date far before the commit (Kafka's retention would delete it): the commit time ({t})"
    );
    assert!(
        shipped.header("tracingspancontext").is_none(),
        "a NULL column sets no header"
    );
}

/// Seed 000's TypeORM entity: quoted camelCase columns, a jsonb headers
/// object, a `createdAt timestamp`, the envelope value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_typeorm_entity_with_camel_case_columns() {
    let db = TestDb::empty("tbl_orm").await;
    let client = db.client().await;
    client
        .batch_execute(
            r#"CREATE TABLE "outbox" (
                   "id" uuid NOT NULL,
                   "aggregateType" character varying NOT NULL,
                   "aggregateId" character varying NOT NULL,
                   "type" character varying NOT NULL,
                   "payload" jsonb NOT NULL,
                   "headers" jsonb NOT NULL DEFAULT '{}',
                   "createdAt" TIMESTAMP NOT NULL DEFAULT now(),
                   "publishedAt" TIMESTAMP WITH TIME ZONE,
                   CONSTRAINT "PK_outbox_id" PRIMARY KEY ("id"))"#,
        )
        .await
        .unwrap();
    let text = config(
        &db,
        "tbl_orm",
        "public.outbox",
        "key = \"aggregateId\"\nroute = \"aggregateType\"\ntimestamp = \"createdAt\"",
        "topic = \"tbl-orm.{aggregate_type}.events\"\non_poison = \"dead-letter\"\ndead_letter_topic = \"tbl-orm.dlq\"",
    );
    relay_until_confirmed(&client, "tbl_orm", &text, async {
        client
            .batch_execute(
                r#"INSERT INTO outbox ("id", "aggregateType", "aggregateId", "type", "payload", "headers", "createdAt") VALUES
                     ('00000000-0000-7000-8000-000000000021', 'Order', '1001', 'ordering.order-placed.v1',
                      '{"total": 12.5}', '{"correlationId": "c-1", "attempt": 2}',
                      date_trunc('second', now() AT TIME ZONE 'UTC') - interval '1 hour' + interval '0.5 second');
                   INSERT INTO outbox ("id", "aggregateType", "aggregateId", "type", "payload", "headers") VALUES
                     ('00000000-0000-7000-8000-000000000022', 'Order', '1001', 'ordering.order-paid.v1', '{}', '[1]');"#,
            )
            .await
            .unwrap();
    })
    .await;
    let records = read(&["tbl-orm.order.events".into()], 1).await;
    assert_eq!(records.len(), 1);
    let r = &records[0];
    assert_eq!(r.key, "1001");
    assert_eq!(r.header("correlationId"), Some("c-1"));
    assert_eq!(r.header("attempt"), Some("2"));
    let v: serde_json::Value = serde_json::from_slice(&r.value).unwrap();
    assert_eq!(v["eventId"], "00000000-0000-7000-8000-000000000021");
    let (text, ms): (String, i64) = {
        let row = client
            .query_one(
                r#"SELECT to_char("createdAt", 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
                          (extract(epoch FROM "createdAt" AT TIME ZONE 'UTC') * 1000)::bigint
                     FROM outbox WHERE id = '00000000-0000-7000-8000-000000000021'"#,
                &[],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert_eq!(v["occurredAt"], text.as_str(), "createdAt read as UTC");
    assert_eq!(v["aggregateType"], "Order");
    assert_eq!(v["data"]["total"], 12.5);
    assert_eq!(
        r.timestamp_ms,
        Some(ms),
        "the timestamp column, an hour before the commit"
    );
    let dead = read(&["tbl-orm.dlq".into()], 1).await;
    assert_eq!(dead[0].header("dlq.reason"), Some("bad_headers"));
    assert_eq!(dead[0].header("id"), Some("00000000-0000-7000-8000-000000000022"));
}

/// A Kafka-record-shaped table: the topic, key, value and partition are
/// columns; no route, no type; a bigint id; a NULL value is a tombstone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kafka_record_shaped_table() {
    let db = TestDb::empty("tbl_krec").await;
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE TABLE kafka_outbox (
                 id bigserial PRIMARY KEY,
                 topic text NOT NULL,
                 key text,
                 value bytea,
                 partition integer,
                 headers jsonb,
                 created_at timestamptz NOT NULL DEFAULT now())",
        )
        .await
        .unwrap();
    let topics: Vec<String> = ["tbl-krec.a", "tbl-krec.b"]
        .iter()
        .map(|t| (*t).to_owned())
        .collect();
    tokio::task::spawn_blocking({
        let topics = topics.clone();
        move || create_topics(&broker().brokers, &topics)
    })
    .await
    .unwrap();
    let text = config(
        &db,
        "tbl_krec",
        "public.kafka_outbox",
        r#"key = "key"
route = false
type = false
payload = "value"
additional = [{ column = "partition", placement = "partition" }]"#,
        "topic = \"{topic}\"\nvalue = \"payload\"\ntombstone_on_empty_payload = true\non_poison = \"dead-letter\"\ndead_letter_topic = \"tbl-krec.dlq\"",
    );
    relay_until_confirmed(&client, "tbl_krec", &text, async {
        client
            .batch_execute(
                r#"INSERT INTO kafka_outbox (topic, key, value, partition, headers) VALUES
                     ('tbl-krec.a', 'k1', '\x00ff10', 2, '{"source": "billing"}'),
                     ('tbl-krec.a', 'k2', NULL, NULL, NULL),
                     ('tbl-krec.b', 'k1', 'hello', 0, NULL),
                     ('tbl-krec.a', NULL, 'no key', NULL, NULL),
                     ('tbl-krec.a', 'k3', 'too far', 7, NULL),
                     ('bad topic!', 'k4', 'x', NULL, NULL),
                     ('tbl-krec.b', 'k1', '', 0, NULL)"#,
            )
            .await
            .unwrap();
    })
    .await;
    let records = read(&topics, 4).await;
    assert_eq!(records.len(), 4, "{records:#?}");
    let r = by_id(&records);
    let first = r["1"];
    assert_eq!(
        (first.topic.as_str(), first.partition, first.key.as_str()),
        ("tbl-krec.a", 2, "k1")
    );
    assert_eq!(first.value, [0x00, 0xff, 0x10], "bytea's bytes");
    assert_eq!(first.header("source"), Some("billing"));
    assert!(first.header("aggregateType").is_none() && first.header("type").is_none());
    let tomb = r["2"];
    assert!(
        tomb.null_value && tomb.key == "k2",
        "a NULL value: a tombstone with its key"
    );
    assert_eq!((r["3"].topic.as_str(), r["3"].partition), ("tbl-krec.b", 0));
    assert!(
        !r["7"].null_value && r["7"].value.is_empty(),
        "an empty bytea is an empty value, as with Debezium: only NULL is a tombstone"
    );
    let dead = read(&["tbl-krec.dlq".into()], 3).await;
    let reasons: HashMap<&str, &str> = dead
        .iter()
        .map(|d| (d.header("id").unwrap(), d.header("dlq.reason").unwrap()))
        .collect();
    assert_eq!(
        reasons,
        HashMap::from([("4", "empty_key"), ("5", "bad_partition"), ("6", "illegal_topic")])
    );
}

/// Eventuate Tram's `message`: a text payload (JSON or not) and a text
/// headers object, the topic in `destination`, epoch-millisecond times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_text_payload_and_text_headers() {
    let db = TestDb::empty("tbl_evt").await;
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE SCHEMA eventuate;
             CREATE TABLE eventuate.message (
                 id varchar(1000) PRIMARY KEY,
                 destination text NOT NULL,
                 headers text NOT NULL,
                 payload text NOT NULL,
                 published smallint DEFAULT 0,
                 creation_time bigint)",
        )
        .await
        .unwrap();
    let text = config(
        &db,
        "tbl_evt",
        "eventuate.message",
        "key = \"id\"\nroute = \"destination\"\ntype = false\ntimestamp = \"creation_time\"",
        "topic = \"{aggregate_type}\"\nlowercase_aggregate_type = false\non_poison = \"dead-letter\"\ndead_letter_topic = \"tbl-evt.dlq\"",
    );
    relay_until_confirmed(&client, "tbl_evt", &text, async {
        client
            .batch_execute(
                r#"INSERT INTO eventuate.message (id, destination, headers, payload, creation_time) VALUES
                     ('m-1', 'tbl-evt.Order', '{"PARTITION_ID": "1001", "event-type": "OrderCreated"}', '{"total": 1}',
                      (extract(epoch FROM now()) * 1000)::bigint - 60000),
                     ('m-2', 'tbl-evt.Order', '{}', 'not json {', NULL),
                     ('m-3', 'tbl-evt.Order', '[1, 2]', '{}', NULL),
                     ('m-4', 'tbl-evt.Order', '{oops', '{}', NULL)"#,
            )
            .await
            .unwrap();
    })
    .await;
    let records = read(&["tbl-evt.Order".into()], 2).await;
    assert_eq!(records.len(), 2);
    let r = by_id(&records);
    let created = r["m-1"];
    assert_eq!(created.header("PARTITION_ID"), Some("1001"));
    assert_eq!(created.header("event-type"), Some("OrderCreated"));
    let ms: i64 = client
        .query_one(
            "SELECT creation_time FROM eventuate.message WHERE id = 'm-1'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(created.timestamp_ms, Some(ms), "epoch milliseconds");
    let v: serde_json::Value = serde_json::from_slice(&created.value).unwrap();
    assert_eq!(v["data"]["total"], 1, "text that is JSON is embedded as JSON");
    let v: serde_json::Value = serde_json::from_slice(&r["m-2"].value).expect("always valid JSON");
    assert_eq!(v["data"], "not json {", "text that is not JSON is a JSON string");
    let dead = read(&["tbl-evt.dlq".into()], 2).await;
    assert_eq!(dead.len(), 2);
    for d in &dead {
        assert_eq!(
            d.header("dlq.reason"),
            Some("bad_headers"),
            "{:?}",
            d.header("id")
        );
        let v: serde_json::Value = serde_json::from_slice(&d.value).expect("a dead letter is JSON");
        match d.header("id") {
            Some("m-3") => assert_eq!(v["headers"], json!([1, 2]), "JSON that is no object, as JSON"),
            _ => assert_eq!(v["headers"], "{oops", "text that is no JSON, as a string"),
        }
    }
}

fn check(config: &std::path::Path) -> (bool, String) {
    let out = std::process::Command::new(bin())
        .args(["check", "--config"])
        .arg(config)
        .output()
        .unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// Every way a column map can be wrong is a FAIL of `outboxd check` that
/// names the column and the setting, where `run` would refuse; the right
/// map passes and lists each role's column.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_the_column_and_the_setting_of_a_wrong_map() {
    let db = TestDb::empty("tbl_check").await;
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE TABLE outbox (
                 id uuid NOT NULL PRIMARY KEY,
                 aggregatetype varchar(255) NOT NULL,
                 aggregateid varchar(255) NOT NULL,
                 type varchar(255) NOT NULL,
                 payload jsonb,
                 seq bigint,
                 created date)",
        )
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let good = "key = \"aggregateid\"\nroute = \"aggregatetype\"";
    let cases: Vec<(&str, &str, String, &[&str])> = vec![
        ("right", good, String::new(), &["ok   columns", "key=\"aggregateid\"", "timestamp=(commit time)"]),
        ("defaults", "", String::new(), &["FAIL columns", "\"aggregate_id\"", "columns.key"]),
        ("case", "key = \"aggregateId\"\nroute = \"aggregatetype\"", String::new(), &["FAIL columns", "it has \"aggregateid\"", "columns.key"]),
        ("type", "key = \"aggregateid\"\nroute = \"aggregatetype\"\ntimestamp = \"created\"", String::new(), &["FAIL columns", "\"created\"", "columns.timestamp", "date"]),
        ("payload", "key = \"aggregateid\"\nroute = \"aggregatetype\"\npayload = \"seq\"", String::new(), &["FAIL columns", "columns.payload", "bigint"]),
        (
            "missing",
            "key = \"aggregateid\"\nroute = \"aggregatetype\"\nadditional = [{ column = \"tenant\", placement = \"header\" }]",
            String::new(),
            &["FAIL columns", "\"tenant\"", "columns.additional"],
        ),
        (
            "partition",
            "key = \"aggregateid\"\nroute = \"aggregatetype\"\nadditional = [{ column = \"type\", placement = \"partition\" }]",
            String::new(),
            &["FAIL columns", "\"type\"", "integer"],
        ),
        ("template", good, "topic = \"{region}.events\"".to_owned(), &["FAIL columns", "\"region\"", "routing.topic"]),
    ];
    for (name, columns, routing, want) in cases {
        let text = config(&db, "tbl_check", "public.outbox", columns, &routing);
        let path = write_config(dir.path(), &format!("{name}.toml"), &text);
        let (ok, out) = tokio::task::spawn_blocking(move || check(&path)).await.unwrap();
        assert_eq!(ok, name == "right", "{name}:\n{out}");
        for w in want {
            assert!(out.contains(w), "{name}: {w:?} not in\n{out}");
        }
    }
    // What check refuses, run refuses at start with the same words.
    let text = config(&db, "tbl_check", "public.outbox", "", "");
    let path = write_config(dir.path(), "run.toml", &text);
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("timeout")
            .arg("60")
            .arg(bin())
            .args(["run", "--config"])
            .arg(&path)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(!out.status.success());
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains("columns.key"), "{log}");
    drop(client);
}

/// Polling mode reads a table through the map: renamed columns, its own
/// published column, rows marked once Kafka has them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_reads_a_mapped_table() {
    let db = TestDb::empty("tbl_poll").await;
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE TABLE app_events (
                 event_id uuid PRIMARY KEY,
                 entity text NOT NULL,
                 entity_id text NOT NULL,
                 name text NOT NULL,
                 body jsonb NOT NULL,
                 occurred_at timestamptz NOT NULL DEFAULT clock_timestamp(),
                 sent_at timestamptz)",
        )
        .await
        .unwrap();
    let text = format!(
        "mode = \"polling\"\n[polling]\ninterval = \"100ms\"\npublished_column = \"sent_at\"\n{}",
        config(
            &db,
            "tbl_poll",
            "public.app_events",
            "id = \"event_id\"\nkey = \"entity_id\"\nroute = \"entity\"\ntype = \"name\"\npayload = \"body\"\ntimestamp = \"occurred_at\"\nheaders = false",
            "topic = \"tbl-poll.{aggregate_type}\"",
        )
    );
    let (config, validated) = outboxd::config::Config::from_toml(&text, |_| None).unwrap();
    let metrics = std::sync::Arc::new(outboxd::metrics::Metrics::new().unwrap());
    let health = std::sync::Arc::new(outboxd::ops::health::Health::new(config.health.thresholds()));
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut relay = outboxd::relay::polling::PollingRelay::new(config, validated, metrics, health).unwrap();
    let handle = tokio::spawn(async move { relay.run(stopped).await });
    for i in 0..6 {
        client
            .execute(
                "INSERT INTO app_events (event_id, entity, entity_id, name, body) VALUES (gen_random_uuid(), 'Invoice', $1, 'InvoiceIssued', jsonb_build_object('n', $2::int))",
                &[&format!("inv-{}", i % 2), &i],
            )
            .await
            .unwrap();
    }
    wait_for("every row marked published", Duration::from_secs(60), || async {
        let left: i64 = client
            .query_one("SELECT count(*) FROM app_events WHERE sent_at IS NULL", &[])
            .await
            .unwrap()
            .get(0);
        (left == 0).then_some(())
    })
    .await;
    stop.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(30), handle)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let records = read(&["tbl-poll.invoice".into()], 6).await;
    assert_eq!(records.len(), 6);
    for key in ["inv-0", "inv-1"] {
        let order: Vec<i64> = records
            .iter()
            .filter(|r| r.key == key)
            .map(|r| {
                serde_json::from_slice::<serde_json::Value>(&r.value).unwrap()["data"]["n"]
                    .as_i64()
                    .unwrap()
            })
            .collect();
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{key}: {order:?}");
        assert_eq!(order.len(), 3);
    }
    assert!(records.iter().all(|r| r.header("type") == Some("InvoiceIssued")));
}

/// `outboxd replay` reads the table through the map: the same topic,
/// partition, headers and value as the relay's, marked `replayed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_reads_a_mapped_table() {
    let db = TestDb::empty("tbl_replay").await;
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE TABLE kafka_outbox (
                 id bigserial PRIMARY KEY,
                 topic text NOT NULL,
                 key text NOT NULL,
                 value text,
                 partition integer,
                 created_at timestamptz NOT NULL DEFAULT now());
             INSERT INTO kafka_outbox (topic, key, value, partition) VALUES
                 ('tbl-replay.a', 'k1', 'one', 1), ('tbl-replay.a', 'k1', 'two', 1), ('tbl-replay.a', 'k2', 'three', NULL);",
        )
        .await
        .unwrap();
    tokio::task::spawn_blocking(|| create_topics(&broker().brokers, &["tbl-replay.a".to_owned()]))
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let text = config(
        &db,
        "tbl_replay",
        "public.kafka_outbox",
        "key = \"key\"\nroute = false\ntype = false\npayload = \"value\"\nheaders = false\nadditional = [{ column = \"partition\", placement = \"partition\" }]",
        "topic = \"{topic}\"\nvalue = \"payload\"",
    );
    let path = write_config(dir.path(), "replay.toml", &text);
    let state = dir.path().join("state.json");
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(bin())
            .args(["replay", "--all", "--config"])
            .arg(&path)
            .arg("--state")
            .arg(&state)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let records = read(&["tbl-replay.a".into()], 3).await;
    assert_eq!(records.len(), 3);
    let values: Vec<(&[u8], i32)> = records
        .iter()
        .filter(|r| r.key == "k1")
        .map(|r| (r.value.as_slice(), r.partition))
        .collect();
    assert_eq!(
        values,
        [(b"one".as_slice(), 1), (b"two".as_slice(), 1)],
        "in order, on their partition"
    );
    assert!(records.iter().all(|r| r.header("replayed").is_some()));
    assert_eq!(
        records
            .iter()
            .map(|r| r.header("id").unwrap())
            .collect::<std::collections::BTreeSet<_>>(),
        ["1", "2", "3"].into_iter().collect()
    );
}

/// A mapped row parked (too large for its topic), with the row behind it,
/// comes back from the park tables whole: a redrive publishes both, in
/// order, with the text payload, the header placement and the partition
/// the relay would have given them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_mapped_row_is_redriven_whole() {
    let db = TestDb::new("tbl_park").await;
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE TABLE ledger_events (
                 id text PRIMARY KEY,
                 stream text NOT NULL,
                 stream_id text NOT NULL,
                 kind text NOT NULL,
                 body text NOT NULL,
                 part smallint,
                 at bigint NOT NULL)",
        )
        .await
        .unwrap();
    let topic = "tbl-park.ledger".to_owned();
    tokio::task::spawn_blocking({
        let topic = topic.clone();
        move || create_topics_with(&broker().brokers, &[topic], &[("max.message.bytes", "20000")])
    })
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let text = config(
        &db,
        "tbl_park",
        "public.ledger_events",
        "key = \"stream_id\"\nroute = \"stream\"\ntype = \"kind\"\npayload = \"body\"\nheaders = false\ntimestamp = \"at\"\nadditional = [{ column = \"kind\", placement = \"header\", name = \"eventKind\" }, { column = \"part\", placement = \"partition\" }]",
        "topic = \"tbl-park.{aggregate_type}\"\nvalue = \"payload\"\non_poison = \"park\"",
    );
    let big = "x".repeat(30_000);
    let (handle, stop) = spawn_relay_with_slot(&client, "tbl_park", &text).await;
    client
        .execute(
            "INSERT INTO ledger_events VALUES ('e-1', 'Ledger', 'acct-1', 'Opened', $1, 2, (extract(epoch FROM now()) * 1000)::bigint - 3000),
                                       ('e-2', 'Ledger', 'acct-1', 'Credited', 'plain ✓', 2, (extract(epoch FROM now()) * 1000)::bigint - 2000),
                                       ('e-3', 'Ledger', 'acct-2', 'Opened', '{}', NULL, (extract(epoch FROM now()) * 1000)::bigint - 1000)",
            &[&big],
        )
        .await
        .unwrap();
    let end = current_lsn(&client).await;
    wait_for(
        "the slot to confirm past the writes",
        Duration::from_secs(60),
        || async { confirmed_flush(&client, "tbl_park").await.filter(|c| *c >= end) },
    )
    .await;
    // A checkpoint lets the slot's restart_lsn (what a redrive waits
    // for) follow.
    client.batch_execute("CHECKPOINT").await.unwrap();
    let parked: i64 = client
        .query_one("SELECT count(*) FROM outboxd_parked", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(parked, 2, "the big one and the one behind it");
    let first = read(std::slice::from_ref(&topic), 1).await;
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].key, "acct-2", "the other aggregate flowed");
    crate::park::raise_max_message_bytes(&broker().brokers, &topic).await;
    let path = write_config(dir.path(), "park.toml", &text);
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("timeout")
            .arg("180")
            .arg(bin())
            .args(["parked", "redrive", "--all", "--config"])
            .arg(&path)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    stop_relay(handle, stop).await;
    let records = read(std::slice::from_ref(&topic), 3).await;
    let acct1: Vec<&Consumed> = records.iter().filter(|r| r.key == "acct-1").collect();
    assert_eq!(acct1.len(), 2);
    assert_eq!(acct1[0].header("id"), Some("e-1"));
    assert_eq!(acct1[0].value.len(), 30_000);
    assert_eq!(acct1[1].value, "plain ✓".as_bytes(), "the text payload as it was");
    assert!(acct1.iter().all(|r| r.partition == 2), "the partition placement");
    assert_eq!(acct1[1].header("eventKind"), Some("Credited"));
    let at: i64 = client
        .query_one("SELECT at FROM ledger_events WHERE id = 'e-2'", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(acct1[1].timestamp_ms, Some(at));
    assert!(acct1[1].header("redriven").is_some());
}

/// Runs `outboxd ARGS --config FILE` and returns (success, stdout + stderr).
fn outboxd(config: &std::path::Path, args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new("timeout")
        .arg("120")
        .arg(bin())
        .args(args)
        .arg("--config")
        .arg(config)
        .output()
        .unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// A replay reads rows by id: a selection in which rows share an id is
/// refused with the reason, never half replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_refuses_rows_it_cannot_tell_apart() {
    let db = TestDb::empty("tbl_replay_refuse").await;
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE TABLE fanout (event_id text NOT NULL, target text NOT NULL, k text NOT NULL, body jsonb NOT NULL);
             INSERT INTO fanout VALUES ('e-1', 'tbl-refuse.a', 'k', '{}'), ('e-2', 'tbl-refuse.a', 'k', '{}');",
        )
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let text = config(
        &db,
        "tbl_replay_refuse",
        "public.fanout",
        "id = \"event_id\"\nkey = \"k\"\nroute = \"target\"\ntype = false\npayload = \"body\"\nheaders = false\ntimestamp = false",
        "topic = \"{aggregate_type}\"\nlowercase_aggregate_type = false",
    );
    let path = write_config(dir.path(), "r.toml", &text);
    let state = dir.path().join("state.json").display().to_string();
    // (With track_commit_timestamp off, as this server does not run,
    // `--since` is refused here: `replay::select` tests that.)
    client
        .batch_execute("INSERT INTO fanout VALUES ('e-1', 'tbl-refuse.b', 'k', '{}')")
        .await
        .unwrap();
    let twice = tokio::task::spawn_blocking(move || outboxd(&path, &["replay", "--all", "--state", &state]))
        .await
        .unwrap();
    assert!(
        !twice.0 && twice.1.contains("share the id \"e-1\""),
        "{}",
        twice.1
    );
}

/// Polling marks the rows it published by where they are, not by id: a
/// fanned-out event (one id, two rows) is published twice and both rows
/// are marked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_marks_rows_that_share_an_id() {
    let db = TestDb::empty("tbl_poll_fanout").await;
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE TABLE msgs (
                 seq bigserial PRIMARY KEY,
                 event_id uuid NOT NULL,
                 destination text NOT NULL,
                 aggregate_id text NOT NULL,
                 payload jsonb NOT NULL,
                 created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
                 published_at timestamptz);
             INSERT INTO msgs (event_id, destination, aggregate_id, payload) VALUES
                 ('00000000-0000-7000-8000-0000000000f1', 'billing', 'o-1', '{\"n\": 1}'),
                 ('00000000-0000-7000-8000-0000000000f1', 'shipping', 'o-1', '{\"n\": 1}');",
        )
        .await
        .unwrap();
    let text = format!(
        "mode = \"polling\"\n[polling]\ninterval = \"100ms\"\nbatch_size = 1\n{}",
        config(
            &db,
            "tbl_poll_fanout",
            "public.msgs",
            "id = \"event_id\"\nroute = \"destination\"\ntype = false\nheaders = false",
            "topic = \"tbl-fanout.{aggregate_type}\"",
        )
    );
    let (config, validated) = outboxd::config::Config::from_toml(&text, |_| None).unwrap();
    let metrics = std::sync::Arc::new(outboxd::metrics::Metrics::new().unwrap());
    let health = std::sync::Arc::new(outboxd::ops::health::Health::new(config.health.thresholds()));
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut relay = outboxd::relay::polling::PollingRelay::new(config, validated, metrics, health).unwrap();
    let handle = tokio::spawn(async move { relay.run(stopped).await });
    let records = read(&["tbl-fanout.billing".into(), "tbl-fanout.shipping".into()], 2).await;
    wait_for("both rows marked", Duration::from_secs(30), || async {
        let left: i64 = client
            .query_one("SELECT count(*) FROM msgs WHERE published_at IS NULL", &[])
            .await
            .unwrap()
            .get(0);
        (left == 0).then_some(())
    })
    .await;
    stop.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(30), handle)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let topics: std::collections::BTreeSet<&str> = records.iter().map(|r| r.topic.as_str()).collect();
    assert_eq!(
        topics,
        ["tbl-fanout.billing", "tbl-fanout.shipping"]
            .into_iter()
            .collect()
    );
}

/// A payload column whose type changes while outboxd streams (jsonb to a
/// domain over text, which the catalog read at start did not know) is read
/// as what it is now: a value that is no JSON is embedded as a JSON
/// string, never spliced in as broken JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_whose_type_changes_while_streaming_never_makes_broken_json() {
    let db = TestDb::new("tbl_retype").await;
    let client = db.client().await;
    let text = config(
        &db,
        "tbl_retype",
        "public.outbox",
        "",
        "topic = \"tbl-retype.{aggregate_type}\"",
    );
    relay_until_confirmed(&client, "tbl_retype", &text, async {
        client
            .batch_execute(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload)
                   VALUES ('00000000-0000-7000-8000-0000000000a1', 'Doc', 'd-1', 't', '{\"n\": 1}');
                 CREATE DOMAIN loose_text AS text;
                 ALTER TABLE outbox ALTER COLUMN payload TYPE loose_text USING payload::text;
                 INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload)
                   VALUES ('00000000-0000-7000-8000-0000000000a2', 'Doc', 'd-1', 't', 'not json {');",
            )
            .await
            .unwrap();
    })
    .await;
    let records = read(&["tbl-retype.doc".into()], 2).await;
    assert_eq!(records.len(), 2);
    let v: serde_json::Value = serde_json::from_slice(&records[1].value).expect("valid JSON");
    assert_eq!(v["data"], "not json {");
    let v: serde_json::Value = serde_json::from_slice(&records[0].value).unwrap();
    assert_eq!(v["data"]["n"], 1);
}

/// A mapped column renamed while rows written before the rename wait in
/// the slot: naming both (`key = ["old", "new"]`) reads each row by the
/// name its relation has, and neither the rename nor the changed
/// `[columns]` is taken for a publication change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_column_renamed_behind_a_backlog_is_read_by_either_name() {
    let db = TestDb::empty("tbl_rename").await;
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE TABLE outbox (
                 id uuid NOT NULL PRIMARY KEY,
                 aggregatetype varchar(255) NOT NULL,
                 aggregateid varchar(255) NOT NULL,
                 type varchar(255) NOT NULL,
                 payload jsonb)",
        )
        .await
        .unwrap();
    let before = config(
        &db,
        "tbl_rename",
        "public.outbox",
        "key = \"aggregateid\"\nroute = \"aggregatetype\"",
        "topic = \"tbl-rename.{aggregate_type}\"\nvalue = \"payload\"",
    );
    relay_until_confirmed(&client, "tbl_rename", &before, async {
        client
            .batch_execute("INSERT INTO outbox VALUES ('00000000-0000-7000-8000-0000000000b1', 'Acct', 'a-1', 't', '{\"n\": 1}')")
            .await
            .unwrap();
    })
    .await;
    // While outboxd is stopped: a row, the rename, another row.
    client
        .batch_execute(
            "INSERT INTO outbox VALUES ('00000000-0000-7000-8000-0000000000b2', 'Acct', 'a-1', 't', '{\"n\": 2}');
             ALTER TABLE outbox RENAME COLUMN aggregateid TO aggregate_key;
             INSERT INTO outbox VALUES ('00000000-0000-7000-8000-0000000000b3', 'Acct', 'a-1', 't', '{\"n\": 3}');",
        )
        .await
        .unwrap();
    let after = before.replace(
        "key = \"aggregateid\"",
        "key = [\"aggregateid\", \"aggregate_key\"]",
    );
    relay_until_confirmed(&client, "tbl_rename", &after, async {}).await;
    let records = read(&["tbl-rename.acct".into()], 3).await;
    let values: Vec<&[u8]> = records.iter().map(|r| r.value.as_slice()).collect();
    assert_eq!(
        values,
        [br#"{"n": 1}"#.as_slice(), br#"{"n": 2}"#, br#"{"n": 3}"#],
        "each row once, in order, keyed a-1"
    );
    assert!(records.iter().all(|r| r.key == "a-1"));
}

/// Under `key_format = "connect-json"`, an event emitted as a message
/// (`outbox_emit`) is keyed as the key column's rows are: the same bytes,
/// so the same partition, for one aggregate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emitted_events_are_keyed_as_the_key_column_is() {
    let db = TestDb::new("tbl_emit_key").await;
    let client = db.client().await;
    client
        .batch_execute("ALTER TABLE outbox ALTER COLUMN aggregate_id TYPE uuid USING aggregate_id::uuid")
        .await
        .unwrap();
    let text = config(
        &db,
        "tbl_emit_key",
        "public.outbox",
        "",
        "topic = \"tbl-emit-key.{aggregate_type}\"\nvalue = \"payload\"\nkey_format = \"connect-json\"",
    );
    let aggregate = "0190a5a4-8c1e-7000-8000-0000000000c1";
    relay_until_confirmed(&client, "tbl_emit_key", &text, async {
        client
            .execute(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload)
                   VALUES (gen_random_uuid(), 'Cart', $1::text::uuid, 'row', '{}')",
                &[&aggregate],
            )
            .await
            .unwrap();
        client
            .execute("SELECT outbox_emit('Cart', $1, 'message', '{}')", &[&aggregate])
            .await
            .unwrap();
    })
    .await;
    let records = read(&["tbl-emit-key.cart".into()], 2).await;
    assert_eq!(records.len(), 2);
    assert_eq!(
        records[0].key_bytes, records[1].key_bytes,
        "one key for the aggregate"
    );
    assert_eq!(records[0].partition, records[1].partition);
    assert!(String::from_utf8_lossy(&records[0].key_bytes).contains("io.debezium.data.Uuid"));
}

//! Beside Debezium (3.6.1.Final on Kafka Connect, started by
//! `scripts/debezium.sh`): the same outbox rows through Debezium's Outbox
//! Event Router and through outboxd's Debezium-compatible configuration,
//! compared record for record; and outboxd taking over Debezium's slot
//! while writers keep writing.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use outboxd::Lsn;
use serde_json::json;
use uuid::Uuid;

use crate::harness::broker::{broker, consume, create_topics, Consumed};
use crate::harness::debezium::{Debezium, Source};
use crate::harness::postgres::server;
use crate::harness::{wait_for, TestDb};
use crate::relay::{confirmed_flush, current_lsn, spawn_relay_with_slot, stop_relay};

/// outboxd set up to write what Debezium's EventRouter writes: the payload
/// as the value, and the Java client's partitioner (murmur2), so a key
/// lands in the same partition under either relay.
fn compatible_config(db: &TestDb, slot: &str, publication: &str, brokers: &str, topic: &str) -> String {
    format!(
        r#"
[postgres]
url = "{url}"
slot = "{slot}"
publication = "{publication}"
create_publication = false
status_interval = "100ms"

[kafka]
brokers = "{brokers}"
topic_partitions = 3
topic_replication_factor = 1

[kafka.options]
partitioner = "murmur2_random"

[routing]
topic = "{topic}"
value = "payload"

[http]
listen = "127.0.0.1:0"
"#,
        url = db.superuser_url()
    )
}

/// A publication and slots created at one point, as a Debezium deployment
/// and outboxd would find them.
async fn publication_and_slots(client: &tokio_postgres::Client, publication: &str, slots: &[&str]) {
    client
        .batch_execute(&format!(
            "CREATE PUBLICATION {publication} FOR TABLE outbox WITH (publish = 'insert')"
        ))
        .await
        .unwrap();
    for slot in slots {
        client
            .execute(
                "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
                &[slot],
            )
            .await
            .unwrap();
    }
}

/// The rows users ask about: nested JSON, unicode, `2.50`, empty arrays,
/// nulls, a payload that is not an object, and 100 KB payloads.
fn payloads() -> Vec<String> {
    vec![
        r#"{"total": 2.50, "items": [], "note": null}"#.to_owned(),
        r#"{"order": {"lines": [{"sku": "A-1", "qty": 2, "price": 12.50}, {"sku": "B", "qty": 1, "price": 0.10}], "tags": ["x", "y"]}}"#.to_owned(),
        r#"{"name": "주문 ✓ 😀", "escaped": "a \"quote\" and \\ backslash", "ctrl": "tab\there"}"#.to_owned(),
        r#"{"big": 123456789012345678901234567890, "neg": -0.000001, "exp": 1.5e10, "t": true, "f": false}"#.to_owned(),
        r#"[1, "two", {"three": [3]}]"#.to_owned(),
        r#""just a string""#.to_owned(),
        json!({"blob": "x".repeat(100 * 1024)}).to_string(),
        r#"{"deep": {"a": {"b": {"c": {"d": [[], {}, [null]]}}}}}"#.to_owned(),
    ]
}

/// What both relays set: key, value bytes and the four shared headers.
fn shape(m: &Consumed) -> (String, Vec<u8>, Vec<Option<String>>) {
    let headers = ["id", "type", "aggregateType", "aggregateId"]
        .iter()
        .map(|h| m.header(h).map(str::to_owned))
        .collect();
    (m.key.clone(), m.value.clone(), headers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_match_debezium_record_for_record() {
    let db = TestDb::new("dbz_compat").await;
    let client = db.client().await;
    let brokers = broker().brokers.clone();
    publication_and_slots(&client, "dbz_compat", &["dbz_compat_d", "dbz_compat_o"]).await;

    let types = ["order", "payment", "shipment-notice"];
    let payloads = payloads();
    let mut written = 0;
    for t in 0..24usize {
        let tx_rows = 1 + t % 4;
        let mut sql =
            String::from("INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload) VALUES ");
        let mut params: Vec<String> = Vec::new();
        for r in 0..tx_rows {
            let n = written + r;
            if r > 0 {
                sql.push(',');
            }
            let base = params.len();
            sql.push_str(&format!(
                "(gen_random_uuid(), ${}, ${}, ${}, ${}::text::jsonb)",
                base + 1,
                base + 2,
                base + 3,
                base + 4
            ));
            params.push(types[n % types.len()].to_owned());
            params.push(format!("agg-{}", n % 7));
            params.push(format!("compat.event-{}.v1", n % 3));
            params.push(payloads[n % payloads.len()].clone());
        }
        let refs: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = params
            .iter()
            .map(|p| p as &(dyn tokio_postgres::types::ToSql + Sync))
            .collect();
        client.execute(&sql, &refs).await.unwrap();
        written += tx_rows;
    }

    let source = Source {
        pg_port: server().port,
        dbname: &db.name,
        slot: "dbz_compat_d",
        publication: "dbz_compat",
    };
    let topics: Vec<String> = ["dbz", "odz"]
        .iter()
        .flat_map(|p| types.iter().map(move |t| format!("{p}.{t}.events")))
        .collect();
    tokio::task::spawn_blocking({
        let brokers = brokers.clone();
        move || create_topics(&brokers, &topics)
    })
    .await
    .unwrap();
    let debezium = Debezium::start(&brokers, &source, "dbz.${routedByValue}.events", &[]);
    let (handle, stop) = spawn_relay_with_slot(
        &client,
        "dbz_compat_o",
        &compatible_config(
            &db,
            "dbz_compat_o",
            "dbz_compat",
            &brokers,
            "odz.{aggregate_type}.events",
        ),
    )
    .await;

    let read = |prefix: &'static str| {
        let brokers = brokers.clone();
        let topics: Vec<String> = types.iter().map(|t| format!("{prefix}.{t}.events")).collect();
        async move {
            tokio::task::spawn_blocking(move || {
                let names: Vec<&str> = topics.iter().map(String::as_str).collect();
                consume(&brokers, &names, written, Duration::from_secs(60))
            })
            .await
            .unwrap()
        }
    };
    let from_debezium = read("dbz").await;
    assert_eq!(
        from_debezium.len(),
        written,
        "Debezium's records\n{}",
        debezium.log()
    );
    let from_outboxd = read("odz").await;
    assert_eq!(from_outboxd.len(), written, "outboxd's records");

    // Per topic and partition, in offset order, record for record.
    let by_partition = |records: &[Consumed], prefix: &str| {
        let mut m: HashMap<(String, i32), Vec<_>> = HashMap::new();
        for r in records {
            let topic = r.topic.strip_prefix(prefix).unwrap().to_owned();
            m.entry((topic, r.partition)).or_default().push(shape(r));
        }
        m
    };
    let dbz = by_partition(&from_debezium, "dbz.");
    let odz = by_partition(&from_outboxd, "odz.");
    assert_eq!(
        dbz.keys().collect::<HashSet<_>>(),
        odz.keys().collect::<HashSet<_>>(),
        "the same topics and partitions"
    );
    for (place, records) in &dbz {
        let ours = &odz[place];
        assert_eq!(records.len(), ours.len(), "{place:?}");
        for (i, (d, o)) in records.iter().zip(ours).enumerate() {
            assert_eq!(d.0, o.0, "{place:?} record {i}: key");
            assert!(
                d.1 == o.1,
                "{place:?} record {i}: value bytes differ:\nDebezium {:.200}\noutboxd  {:.200}",
                String::from_utf8_lossy(&d.1),
                String::from_utf8_lossy(&o.1)
            );
            assert_eq!(
                d.2, o.2,
                "{place:?} record {i}: headers id, type, aggregateType, aggregateId"
            );
        }
    }
    stop_relay(handle, stop).await;
    debezium.stop();
}

/// One writer's transactions: each row's id, key, and the WAL position
/// right after its commit.
#[derive(Default)]
struct Written {
    rows: Vec<(Uuid, String, Lsn)>,
}

/// Writes single- and multi-row transactions until `stop` turns true.
async fn write_until(
    client: tokio_postgres::Client,
    aggregate_type: String,
    writer: usize,
    stop: tokio::sync::watch::Receiver<bool>,
) -> Written {
    let mut out = Written::default();
    let mut t = 0usize;
    while !*stop.borrow() {
        let rows = 1 + t % 3;
        let ids: Vec<Uuid> = (0..rows).map(|_| Uuid::now_v7()).collect();
        let keys: Vec<String> = (0..rows).map(|r| format!("w{writer}-{}", (t + r) % 5)).collect();
        client
            .execute(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload)
                 SELECT id, $3, key, 'takeover.v1', jsonb_build_object('writer', $4::int)
                   FROM unnest($1::uuid[], $2::text[]) AS r(id, key)",
                &[&ids, &keys, &aggregate_type, &(writer as i32)],
            )
            .await
            .unwrap();
        let after = current_lsn(&client).await;
        out.rows
            .extend(ids.into_iter().zip(keys).map(|(id, key)| (id, key, after)));
        t += 1;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    out
}

/// Debezium streams part of a load and is stopped (`sigterm`) or killed;
/// outboxd starts on Debezium's slot and publication while the writers go
/// on. Every event reaches Kafka; the only duplicates are events committed
/// after the LSN Debezium had confirmed; and each aggregate's first
/// occurrences keep their commit order, because outboxd partitions as the
/// Java client does.
async fn take_over(name: &str, sigterm: bool) -> usize {
    let db = TestDb::new(name).await;
    let client = db.client().await;
    let brokers = broker().brokers.clone();
    let (slot, publication) = (name, name);
    publication_and_slots(&client, publication, &[slot]).await;
    let aggregate_type = name.replace('_', "-");
    let topic = format!("{aggregate_type}.events");

    let source = Source {
        pg_port: server().port,
        dbname: &db.name,
        slot,
        publication,
    };
    tokio::task::spawn_blocking({
        let (brokers, topic) = (brokers.clone(), topic.clone());
        move || create_topics(&brokers, &[topic])
    })
    .await
    .unwrap();
    let debezium = Debezium::start(&brokers, &source, "${routedByValue}.events", &[]);
    let (stop_writers, writers_stop) = tokio::sync::watch::channel(false);
    let mut writers = Vec::new();
    for w in 0..2 {
        writers.push(tokio::spawn(write_until(
            db.client().await,
            aggregate_type.clone(),
            w,
            writers_stop.clone(),
        )));
    }
    // Debezium streams for a while.
    tokio::time::sleep(Duration::from_secs(4)).await;
    if sigterm {
        debezium.stop();
    } else {
        debezium.kill();
    }
    let handed_over = confirmed_flush(&client, slot).await.expect("Debezium's slot");
    let (handle, stop) = spawn_relay_with_slot(
        &client,
        slot,
        &compatible_config(&db, slot, publication, &brokers, "{aggregate_type}.events"),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop_writers.send(true).unwrap();
    let mut rows = Vec::new();
    for w in writers {
        rows.extend(w.await.unwrap().rows);
    }
    let end = current_lsn(&client).await;
    wait_for(
        "outboxd to confirm the last write",
        Duration::from_secs(60),
        || async { confirmed_flush(&client, slot).await.filter(|c| *c >= end) },
    )
    .await;
    stop_relay(handle, stop).await;

    let want = rows.len();
    let records = tokio::task::spawn_blocking({
        let topic = topic.clone();
        move || consume(&brokers, &[&topic], usize::MAX, Duration::from_secs(15))
    })
    .await
    .unwrap();
    let mut count: HashMap<String, usize> = HashMap::new();
    for r in &records {
        *count
            .entry(r.header("id").unwrap_or_default().to_owned())
            .or_default() += 1;
    }
    let mut duplicates = 0;
    for (id, _, after) in &rows {
        match count.get(&id.to_string()).copied().unwrap_or(0) {
            0 => panic!("event {id} was lost in the takeover (handed over at {handed_over})"),
            1 => {}
            n => {
                duplicates += n - 1;
                assert!(
                    *after > handed_over,
                    "event {id}, committed at or before the LSN Debezium confirmed ({handed_over}), was published again"
                );
            }
        }
    }
    // Per key, first occurrences in commit order.
    let position: HashMap<String, usize> = rows
        .iter()
        .enumerate()
        .map(|(i, (id, _, _))| (id.to_string(), i))
        .collect();
    let mut seen = HashSet::new();
    let mut per_key: HashMap<&str, Vec<usize>> = HashMap::new();
    for r in &records {
        let id = r.header("id").unwrap_or_default();
        if seen.insert(id.to_owned()) {
            per_key.entry(r.key.as_str()).or_default().push(position[id]);
        }
    }
    for (key, order) in per_key {
        assert!(
            order.windows(2).all(|w| w[0] < w[1]),
            "{key}: first occurrences out of commit order across the switch"
        );
    }
    eprintln!(
        "takeover ({}): {want} events, {duplicates} duplicates (published by Debezium, not yet confirmed at {handed_over})",
        if sigterm { "SIGTERM" } else { "kill -9" }
    );
    duplicates
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outboxd_takes_over_a_stopped_debeziums_slot_with_no_gap() {
    take_over("dbz_takeover_term", true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outboxd_takes_over_a_killed_debeziums_slot_with_no_gap() {
    take_over("dbz_takeover_kill", false).await;
}

/// Debezium's documented default outbox table.
const DEBEZIUM_TABLE: &str = "CREATE TABLE outbox (
    id uuid NOT NULL PRIMARY KEY,
    aggregatetype varchar(255) NOT NULL,
    aggregateid varchar(255) NOT NULL,
    type varchar(255) NOT NULL,
    payload jsonb)";

/// Kafka Connect's sample worker converters: JsonConverter, with schemas.
const JSON_WORKER: [&str; 2] = [
    "key.converter=org.apache.kafka.connect.json.JsonConverter",
    "value.converter=org.apache.kafka.connect.json.JsonConverter",
];

/// A Debezium connector on the default table with the Event Router at
/// its defaults: only its type is set.
fn default_connector(db: &TestDb, slot: &str, publication: &str) -> String {
    format!(
        "name=outbox-connector
connector.class=io.debezium.connector.postgresql.PostgresConnector
tasks.max=1
database.hostname=127.0.0.1
database.port={port}
database.user=postgres
database.password=unused
database.dbname={dbname}
topic.prefix=dbserver1
plugin.name=pgoutput
slot.name={slot}
publication.name={publication}
publication.autocreate.mode=disabled
table.include.list=public.outbox
snapshot.mode=no_data
transforms=outbox
transforms.outbox.type=io.debezium.transforms.outbox.EventRouter
",
        port = server().port,
        dbname = db.name
    )
}

/// `outboxd import debezium` on the connector and its worker, then what a
/// test changes: the slot (for a side-by-side run), the password line
/// (the test server trusts), a status interval and a listener.
fn imported(connector: &str, slot: Option<&str>) -> String {
    let dir = tempfile::tempdir().unwrap();
    let c = dir.path().join("connector.properties");
    std::fs::write(&c, connector).unwrap();
    let w = dir.path().join("worker.properties");
    std::fs::write(
        &w,
        format!(
            "bootstrap.servers={}\n{}\n",
            broker().brokers,
            JSON_WORKER.join("\n")
        ),
    )
    .unwrap();
    let out = std::process::Command::new(crate::relay::bin())
        .args(["import", "debezium"])
        .arg(&c)
        .arg("--worker")
        .arg(&w)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut text = String::from_utf8(out.stdout).unwrap();
    if let Some(slot) = slot {
        let line = text
            .lines()
            .find(|l| l.starts_with("slot = "))
            .expect("a slot line")
            .to_owned();
        text = text.replace(&line, &format!("slot = \"{slot}\""));
    }
    let password = text
        .lines()
        .find(|l| l.starts_with("password = "))
        .expect("a password line")
        .to_owned();
    text.replace(&password, "status_interval = \"100ms\"") + "\n[http]\nlisten = \"127.0.0.1:0\"\n"
}

/// Debezium on its own default table and its default Event Router, under
/// Kafka Connect's default converters (JsonConverter with schemas), and
/// outboxd under `outboxd import debezium`'s configuration of it, on the
/// same rows: per partition, in offset order, the same keys, value bytes
/// and `id` headers. Documented differences: Debezium's
/// `__debezium.context.*` headers and its processing-time timestamps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_imported_configuration_writes_what_debeziums_default_one_wrote() {
    let db = TestDb::empty("dbz_default").await;
    let client = db.client().await;
    client.batch_execute(DEBEZIUM_TABLE).await.unwrap();
    publication_and_slots(&client, "dbz_default", &["dbz_default_d", "dbz_default_o"]).await;
    let types = ["Order", "Payment", "ShipmentNotice"];
    let payloads = payloads();
    let mut written = 0;
    for t in 0..12usize {
        let rows = 1 + t % 3;
        for r in 0..rows {
            let n = written + r;
            let payload = (n % 9 != 8).then(|| payloads[n % payloads.len()].clone());
            client
                .execute(
                    "INSERT INTO outbox VALUES (gen_random_uuid(), $1, $2, $3, $4::text::jsonb)",
                    &[
                        &types[n % 3],
                        &format!("agg-{}", n % 5),
                        &format!("event-{}", n % 2),
                        &payload,
                    ],
                )
                .await
                .unwrap();
        }
        written += rows;
    }
    let topics: Vec<String> = types.iter().map(|t| format!("outbox.event.{t}")).collect();
    tokio::task::spawn_blocking({
        let topics = topics.clone();
        move || create_topics(&broker().brokers, &topics)
    })
    .await
    .unwrap();
    let connector = default_connector(&db, "dbz_default_d", "dbz_default");
    let read = |want: usize| {
        let topics = topics.clone();
        async move {
            tokio::task::spawn_blocking(move || {
                let names: Vec<&str> = topics.iter().map(String::as_str).collect();
                consume(&broker().brokers, &names, want, Duration::from_secs(90))
            })
            .await
            .unwrap()
        }
    };
    // Debezium first, on its slot; then outboxd, on its own slot made at
    // the same position, to the same topics.
    let debezium = Debezium::start_connector(&broker().brokers, &connector, &JSON_WORKER);
    let from_debezium = read(written).await;
    assert_eq!(
        from_debezium.len(),
        written,
        "Debezium's records\n{}",
        debezium.log()
    );
    debezium.stop();
    let text = imported(&connector, Some("dbz_default_o"));
    let (handle, stop) = spawn_relay_with_slot(&client, "dbz_default_o", &text).await;
    let both = read(2 * written).await;
    stop_relay(handle, stop).await;
    assert_eq!(both.len(), 2 * written, "outboxd's records too");
    let mut by_partition: HashMap<(String, i32), Vec<&Consumed>> = HashMap::new();
    for r in &both {
        by_partition
            .entry((r.topic.clone(), r.partition))
            .or_default()
            .push(r);
    }
    for (place, records) in &by_partition {
        let (theirs, ours) = records.split_at(records.len() / 2);
        assert_eq!(
            theirs.len(),
            ours.len(),
            "{place:?}: the same partition for each key"
        );
        for (i, (d, o)) in theirs.iter().zip(ours).enumerate() {
            assert!(
                d.header("__debezium.context.connectorLogicalName").is_some(),
                "{place:?} {i}: Debezium's first"
            );
            assert_eq!(d.key_bytes, o.key_bytes, "{place:?} record {i}: key");
            assert!(
                d.value == o.value && d.null_value == o.null_value,
                "{place:?} record {i}: value bytes differ:\nDebezium {:.300}\noutboxd  {:.300}",
                String::from_utf8_lossy(&d.value),
                String::from_utf8_lossy(&o.value)
            );
            assert_eq!(d.header("id"), o.header("id"), "{place:?} record {i}: id");
            let ours: Vec<&str> = o.headers.iter().map(|(k, _)| k.as_str()).collect();
            assert_eq!(
                ours,
                ["id"],
                "outboxd sets the id header only, as the Event Router"
            );
        }
    }
    // The shape both wrote, for the record.
    let sample = &both[0];
    let key: serde_json::Value = serde_json::from_slice(&sample.key_bytes).unwrap();
    assert_eq!(key["schema"], json!({"type": "string", "optional": false}));
}

/// A slot takeover from Debezium's default connector under the imported
/// configuration: writers keep writing; nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_imported_configuration_takes_over_debeziums_default_connector() {
    let db = TestDb::empty("dbz_default_takeover").await;
    let client = db.client().await;
    client.batch_execute(DEBEZIUM_TABLE).await.unwrap();
    let slot = "dbz_default_takeover";
    publication_and_slots(&client, slot, &[slot]).await;
    let topic = "outbox.event.Takeover".to_owned();
    tokio::task::spawn_blocking({
        let topic = topic.clone();
        move || create_topics(&broker().brokers, &[topic])
    })
    .await
    .unwrap();
    let connector = default_connector(&db, slot, slot);
    let debezium = Debezium::start_connector(&broker().brokers, &connector, &JSON_WORKER);
    let (stop_writers, writers_stop) = tokio::sync::watch::channel(false);
    let mut writers = Vec::new();
    for w in 0..2usize {
        let client = db.client().await;
        let mut stop = writers_stop.clone();
        writers.push(tokio::spawn(async move {
            let mut ids = Vec::new();
            let mut t = 0usize;
            while !*stop.borrow_and_update() {
                let id = Uuid::now_v7();
                client
                    .execute(
                        "INSERT INTO outbox VALUES ($1, 'Takeover', $2, 'Written', jsonb_build_object('n', $3::int))",
                        &[&id, &format!("w{w}-{}", t % 4), &(t as i32)],
                    )
                    .await
                    .unwrap();
                ids.push(id);
                t += 1;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            ids
        }));
    }
    tokio::time::sleep(Duration::from_secs(4)).await;
    debezium.stop();
    let handed_over = confirmed_flush(&client, slot).await.expect("Debezium's slot");
    let text = imported(&connector, None);
    let (handle, stop) = spawn_relay_with_slot(&client, slot, &text).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop_writers.send(true).unwrap();
    let mut ids = Vec::new();
    for w in writers {
        ids.extend(w.await.unwrap());
    }
    let end = current_lsn(&client).await;
    wait_for(
        "outboxd to confirm the last write",
        Duration::from_secs(60),
        || async { confirmed_flush(&client, slot).await.filter(|c| *c >= end) },
    )
    .await;
    stop_relay(handle, stop).await;
    let records = tokio::task::spawn_blocking(move || {
        crate::harness::broker::consume_to_end(&broker().brokers, &[&topic], Duration::from_secs(30))
    })
    .await
    .unwrap();
    let seen: HashSet<&str> = records.iter().filter_map(|r| r.header("id")).collect();
    for id in &ids {
        assert!(
            seen.contains(id.to_string().as_str()),
            "event {id} was lost in the takeover (handed over at {handed_over})"
        );
    }
    eprintln!(
        "takeover from Debezium's default connector: {} events, {} records",
        ids.len(),
        records.len()
    );
}

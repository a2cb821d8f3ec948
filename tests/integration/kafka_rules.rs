//! Apache Kafka's own rules on records, and rows PostgreSQL accepts that
//! Kafka or the envelope cannot take: every row is published or
//! dead-lettered with its reason, none stops a relay in dead-letter mode,
//! and one refused record never takes its batch neighbours with it.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use outboxd::relay::RelayError;
use uuid::Uuid;

use crate::harness::broker::{broker, consume, topics_with_prefix, Consumed};
use crate::harness::{wait_for, TestDb};
use crate::relay::{
    config_text, confirmed_flush, pending_in_released_slot, spawn_relay_with_slot, stop_relay,
};

fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as i64
}

/// Reads `topics` until `want` records are there (or 60 s).
async fn read(topics: &[&str], want: usize) -> Vec<Consumed> {
    let topics: Vec<String> = topics.iter().map(|t| (*t).to_owned()).collect();
    let brokers = broker().brokers.clone();
    wait_for("records in Kafka", Duration::from_secs(60), || {
        let (topics, brokers) = (topics.clone(), brokers.clone());
        async move {
            let recs = tokio::task::spawn_blocking(move || {
                let refs: Vec<&str> = topics.iter().map(String::as_str).collect();
                consume(&brokers, &refs, want, Duration::from_secs(5))
            })
            .await
            .unwrap();
            (recs.len() >= want).then_some(recs)
        }
    })
    .await
}

/// Starts a relay from `text`, writes one row with `insert` once its slot
/// exists, and returns the error it stops with (within 60 s).
async fn stop_after_one_row(
    client: &tokio_postgres::Client,
    slot: &str,
    text: &str,
    insert: &str,
) -> RelayError {
    let (handle, _stop) = spawn_relay_with_slot(client, slot, text).await;
    client.batch_execute(insert).await.unwrap();
    tokio::time::timeout(Duration::from_secs(60), handle)
        .await
        .expect("the relay stops")
        .unwrap()
        .unwrap_err()
}

const ONE_ROW: &str = "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload) VALUES (gen_random_uuid(), 'Order', 'a', 't', '{}')";

/// The slot still holds the row's transaction (BEGIN, INSERT, COMMIT at
/// least): nothing confirmed past it. Other databases' WAL may legitimately
/// move the slot, so a peek, not an LSN bound, is the proof.
async fn assert_row_still_in_slot(client: &tokio_postgres::Client, slot: &str) {
    let pending = pending_in_released_slot(client, slot).await;
    assert!(
        pending >= 3,
        "the slot moved past the row: {pending} messages pending"
    );
}

fn by_id(records: &[Consumed]) -> HashMap<String, Consumed> {
    records
        .iter()
        .map(|r| (r.header("id").unwrap_or_default().to_owned(), r.clone()))
        .collect()
}

/// `created_at` values PostgreSQL accepts, each with what must become of
/// it: published with created_at as the Kafka timestamp, published with the
/// commit time, or (envelope mode only) dead-lettered as `bad_timestamp`.
const EDGE_TIMESTAMPS: &[(&str, Edge)] = &[
    ("now()", Edge::CreatedAt),
    ("now() - interval '23 hours'", Edge::CreatedAt),
    // Far before the commit: Kafka's retention would delete the record.
    ("now() - interval '25 hours'", Edge::CommitTime),
    ("'1970-01-01 00:00:00.001+00'", Edge::CommitTime),
    ("'1970-01-01 00:00:00+00'", Edge::CommitTime),
    ("now() + interval '2 days'", Edge::CommitTime),
    ("'1960-06-01 12:00:00+00'", Edge::CommitTime),
    ("'0001-01-01 00:00:00+00'", Edge::CommitTime),
    ("'9999-12-31 23:59:59.999999+00'", Edge::CommitTime),
    ("'20000-01-01 00:00:00+00'", Edge::NotInEnvelope),
    ("'0044-03-15 00:00:00+00 BC'", Edge::NotInEnvelope),
    ("'infinity'", Edge::NotInEnvelope),
    ("'-infinity'", Edge::NotInEnvelope),
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Edge {
    CreatedAt,
    CommitTime,
    NotInEnvelope,
}

/// Inserts one row per edge timestamp in one transaction; returns the ids
/// and the wall-clock window around the commit.
async fn write_edges(client: &tokio_postgres::Client, prefix: &str) -> (Vec<Uuid>, i64, i64) {
    let ids: Vec<Uuid> = EDGE_TIMESTAMPS.iter().map(|_| Uuid::now_v7()).collect();
    let values: Vec<String> = EDGE_TIMESTAMPS
        .iter()
        .zip(&ids)
        .enumerate()
        .map(|(i, ((ts, _), id))| format!("('{id}', 'Clock', '{prefix}-{i}', 't', '{{\"i\": {i}}}', {ts})"))
        .collect();
    let before = now_ms();
    client
        .batch_execute(&format!(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload, created_at) VALUES {}",
            values.join(",")
        ))
        .await
        .unwrap();
    (ids, before, now_ms())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timestamps_at_every_edge_are_published_or_dead_lettered_in_both_value_modes() {
    for (mode, value) in [("envelope", "envelope"), ("payload", "payload")] {
        let db = TestDb::new(&format!("rules_ts_{mode}")).await;
        let client = db.client().await;
        let slot = format!("rules_ts_{mode}");
        let topic = format!("ts-{mode}.clock");
        let dlq = format!("ts-{mode}.dead-letter");
        let text = config_text(
            &db.superuser_url(),
            &slot,
            &broker().brokers,
            &format!(
                "topic = \"ts-{mode}.{{aggregate_type}}\"\nvalue = \"{value}\"\non_poison = \"dead-letter\"\ndead_letter_topic = \"{dlq}\""
            ),
            "",
        );
        let (handle, stop) = spawn_relay_with_slot(&client, &slot, &text).await;
        let (ids, before, after) = write_edges(&client, mode).await;
        let dead: Vec<usize> = (0..ids.len())
            .filter(|&i| mode == "envelope" && EDGE_TIMESTAMPS[i].1 == Edge::NotInEnvelope)
            .collect();
        let published = read(&[&topic], ids.len() - dead.len()).await;
        let published = by_id(&published);
        let dead_letters = if dead.is_empty() {
            HashMap::new()
        } else {
            by_id(&read(&[&dlq], dead.len()).await)
        };
        for (i, (ts, edge)) in EDGE_TIMESTAMPS.iter().enumerate() {
            let id = ids[i].to_string();
            if dead.contains(&i) {
                let d = dead_letters
                    .get(&id)
                    .unwrap_or_else(|| panic!("{mode}: no dead letter for created_at {ts}"));
                assert_eq!(d.header("dlq.reason"), Some("bad_timestamp"), "{mode} {ts}");
                assert!(d.header("dlq.error").unwrap().contains("RFC 3339"), "{mode} {ts}");
                assert!(!published.contains_key(&id), "{mode} {ts}: not published as well");
                continue;
            }
            let r = published
                .get(&id)
                .unwrap_or_else(|| panic!("{mode}: created_at {ts} was not published"));
            let kafka_ts = r.timestamp_ms.unwrap();
            match edge {
                Edge::CreatedAt if ts.contains("23 hours") => assert!(
                    (before - 23 * 3_600_000 - 1000..=after - 23 * 3_600_000 + 1000).contains(&kafka_ts),
                    "{mode} {ts}: Kafka timestamp {kafka_ts} is not created_at"
                ),
                Edge::CreatedAt | Edge::CommitTime | Edge::NotInEnvelope => assert!(
                    (before - 1000..=after + 1000).contains(&kafka_ts),
                    "{mode} {ts}: Kafka timestamp {kafka_ts} is not the commit time (between {before} and {after})"
                ),
            }
            if mode == "envelope" {
                let v: serde_json::Value = serde_json::from_slice(&r.value).unwrap();
                let at = v["occurredAt"].as_str().unwrap();
                assert!(
                    at.ends_with('Z') && at.len() == 27,
                    "{mode} {ts}: occurredAt {at}"
                );
            }
        }
        let last = crate::relay::current_lsn(&client).await;
        wait_for("the slot past every row", Duration::from_secs(30), || async {
            (confirmed_flush(&client, &slot).await? >= last).then_some(())
        })
        .await;
        assert!(!handle.is_finished(), "{mode}: the relay keeps running");
        stop_relay(handle, stop).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unrepresentable_timestamp_under_on_poison_stop_names_the_row() {
    let db = TestDb::new("rules_ts_stop").await;
    let client = db.client().await;
    let slot = "rules_ts_stop";
    let text = config_text(
        &db.superuser_url(),
        slot,
        &broker().brokers,
        "topic = \"ts-stop.{aggregate_type}\"\non_poison = \"stop\"",
        "",
    );
    let id = Uuid::now_v7();
    let insert = format!(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload, created_at)
         VALUES ('{id}', 'Clock', 'a', 't', '{{}}', 'infinity')"
    );
    let err = stop_after_one_row(&client, slot, &text, &insert).await;
    let text = err.to_string();
    assert!(
        text.contains(&id.to_string()) && text.contains("infinity"),
        "{text}"
    );
    assert_row_still_in_slot(&client, slot).await;
}

/// A topic whose `max.message.bytes` is below what librdkafka batches: the
/// broker refuses whole batches. Only the one record that is too large on
/// its own is dead-lettered; its neighbours are published, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_batch_sets_aside_only_the_record_that_is_too_large() {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    let db = TestDb::new("rules_batch").await;
    let client = db.client().await;
    let slot = "rules_batch";
    let topic = "batch.order";
    let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &broker().brokers)
        .create()
        .unwrap();
    let new = NewTopic::new(topic, 1, TopicReplication::Fixed(1)).set("max.message.bytes", "4000");
    admin
        .create_topics([&new], &AdminOptions::new())
        .await
        .unwrap()
        .into_iter()
        .for_each(|r| {
            r.unwrap();
        });
    let text = config_text(
        &db.superuser_url(),
        slot,
        &broker().brokers,
        "topic = \"batch.{aggregate_type}\"\nvalue = \"payload\"\non_poison = \"dead-letter\"\ndead_letter_topic = \"batch.dead-letter\"",
        // Batches of many records, well past the topic's limit.
        "[kafka.options]\n\"linger.ms\" = \"200\"",
    );
    let (handle, stop) = spawn_relay_with_slot(&client, slot, &text).await;
    // 60 rows of ~300 bytes in one transaction, the 31st of 6,000 bytes.
    let ids: Vec<Uuid> = (0..60).map(|_| Uuid::now_v7()).collect();
    let payloads: Vec<serde_json::Value> = (0..60)
        .map(|i| {
            let size = if i == 30 { 6_000 } else { 250 };
            serde_json::json!({ "i": i, "pad": "x".repeat(size) })
        })
        .collect();
    let ats: Vec<&str> = vec!["Order"; 60];
    let ais: Vec<String> = (0..60).map(|i| format!("agg-{}", i % 3)).collect();
    let tys: Vec<&str> = vec!["t"; 60];
    client
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload)
             SELECT a, b, c, d, e FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::jsonb[])
                    WITH ORDINALITY AS u(a, b, c, d, e, o) ORDER BY o",
            &[&ids, &ats, &ais, &tys, &payloads],
        )
        .await
        .unwrap();
    let dlq = read(&["batch.dead-letter"], 1).await;
    assert_eq!(
        dlq.len(),
        1,
        "exactly one dead letter: {:?}",
        dlq.iter().map(|d| d.header("id")).collect::<Vec<_>>()
    );
    assert_eq!(dlq[0].header("id"), Some(ids[30].to_string().as_str()));
    assert_eq!(dlq[0].header("dlq.reason"), Some("too_large"));
    let published = read(&[topic], 59).await;
    let got: Vec<Uuid> = published
        .iter()
        .map(|r| r.header("id").unwrap().parse().unwrap())
        .collect();
    let unique: HashSet<Uuid> = got.iter().copied().collect();
    let want: HashSet<Uuid> = ids
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 30)
        .map(|(_, id)| *id)
        .collect();
    assert_eq!(unique, want, "every other row is published");
    let mut seen = HashSet::new();
    let first: Vec<Uuid> = got.into_iter().filter(|id| seen.insert(*id)).collect();
    let expected: Vec<Uuid> = ids
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 30)
        .map(|(_, id)| *id)
        .collect();
    assert_eq!(first, expected, "in commit order (one partition)");
    let last = crate::relay::current_lsn(&client).await;
    wait_for(
        "the slot past the transaction",
        Duration::from_secs(30),
        || async { (confirmed_flush(&client, slot).await? >= last).then_some(()) },
    )
    .await;
    stop_relay(handle, stop).await;
}

/// A user's own outbox table with text ids and nullable columns: a NULL
/// `headers` means no headers; an id that is no UUID or a NULL payload is a
/// row outboxd cannot read, so it is dead-lettered with every column, and
/// the rows around it flow on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_rows_of_a_custom_schema_are_dead_lettered_with_their_columns() {
    let db = TestDb::empty("rules_custom").await;
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE TABLE events_out (id text PRIMARY KEY, aggregate_type text, aggregate_id text,
                                      type text, payload jsonb, headers jsonb,
                                      created_at timestamptz NOT NULL DEFAULT now())",
        )
        .await
        .unwrap();
    let slot = "rules_custom";
    let text = config_text(
        &db.superuser_url(),
        slot,
        &broker().brokers,
        "topic = \"custom.{aggregate_type}\"\non_poison = \"dead-letter\"\ndead_letter_topic = \"custom.dead-letter\"",
        "",
    )
    .replace("[postgres]\n", "[postgres]\ntable = \"public.events_out\"\n");
    let (handle, stop) = spawn_relay_with_slot(&client, slot, &text).await;
    let good = Uuid::now_v7().to_string();
    let after = Uuid::now_v7().to_string();
    let null_payload = Uuid::now_v7().to_string();
    client
        .batch_execute(&format!(
            "INSERT INTO events_out (id, aggregate_type, aggregate_id, type, payload, headers) VALUES
               ('{good}', 'Order', 'a-1', 't', '{{\"n\": 1}}', NULL),
               ('order-42', 'Order', 'a-1', 't', '{{\"n\": 2}}', '{{}}'),
               ('', 'Order', 'a-1', 't', '{{\"n\": 4}}', '{{}}'),
               ('{null_payload}', 'Order', 'a-1', 't', NULL, '{{}}'),
               ('{after}', 'Order', 'a-1', 't', '{{\"n\": 3}}', '{{\"k\": \"v\"}}')"
        ))
        .await
        .unwrap();
    let published = read(&["custom.order"], 4).await;
    let ids: Vec<&str> = published.iter().map(|r| r.header("id").unwrap()).collect();
    assert_eq!(
        ids,
        [good.as_str(), "order-42", null_payload.as_str(), after.as_str()],
        "the readable rows, in order: a text id is an id, a NULL payload a null value"
    );
    assert_eq!(published[0].headers.len(), 4, "NULL headers: no user headers");
    let v: serde_json::Value = serde_json::from_slice(&published[2].value).unwrap();
    assert_eq!(v["data"], serde_json::Value::Null, "the envelope's data is null");
    assert_eq!(published[3].header("k"), Some("v"));
    let dlq = read(&["custom.dead-letter"], 1).await;
    assert_eq!(dlq.len(), 1);
    let empty_id = &dlq[0];
    assert_eq!(empty_id.header("dlq.reason"), Some("unreadable"));
    assert!(
        empty_id.header("dlq.error").unwrap().contains("\"id\""),
        "names the column"
    );
    let v: serde_json::Value = serde_json::from_slice(&empty_id.value).unwrap();
    assert_eq!(v["columns"]["aggregate_id"], "a-1");
    assert_eq!(v["columns"]["payload"], "{\"n\": 4}");
    assert_eq!(empty_id.key, "a-1", "keyed like the event would be");
    assert!(!handle.is_finished());
    stop_relay(handle, stop).await;
}

/// A replication factor the cluster cannot meet stops outboxd at the
/// first topic it must create, naming the setting; the slot holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_impossible_replication_factor_stops_naming_the_setting() {
    let db = TestDb::new("rules_rf").await;
    let client = db.client().await;
    let slot = "rules_rf";
    let text = config_text(
        &db.superuser_url(),
        slot,
        &broker().brokers,
        "topic = \"rf.{aggregate_type}\"",
        "",
    )
    .replace("topic_replication_factor = 1", "topic_replication_factor = 3");
    let err = stop_after_one_row(&client, slot, &text, ONE_ROW).await;
    let text = err.to_string();
    assert!(!err.is_transient(), "{text}");
    assert!(text.contains("kafka.topic_replication_factor = 3"), "{text}");
    assert_row_still_in_slot(&client, slot).await;
}

/// A record that does not fit librdkafka's queue even when it is empty
/// (`queue.buffering.max.kbytes` below the record) used to wait for room
/// forever: no error, no status update, the slot held. It is a definite
/// error that names the setting, and nothing is confirmed past the row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_larger_than_the_whole_producer_queue_stops_naming_the_setting() {
    let db = TestDb::new("rules_queue").await;
    let client = db.client().await;
    let slot = "rules_queue";
    let text = config_text(
        &db.superuser_url(),
        slot,
        &broker().brokers,
        "topic = \"queue.{aggregate_type}\"",
        "",
    );
    let text = format!("{text}\n[kafka.options]\n\"queue.buffering.max.kbytes\" = \"1\"\n");
    let row = "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload) \
               VALUES (gen_random_uuid(), 'Order', 'a', 't', jsonb_build_object('pad', repeat('p', 4000)))";
    let err = stop_after_one_row(&client, slot, &text, row).await;
    let text = err.to_string();
    assert!(
        matches!(
            err,
            RelayError::Kafka(outboxd::kafka::sink::KafkaSinkError::QueueTooSmall { .. })
        ),
        "{text}"
    );
    assert!(!err.is_transient(), "{text}");
    assert!(text.contains("queue.buffering.max.kbytes"), "{text}");
    assert_row_still_in_slot(&client, slot).await;
}

/// The other side of the test above: a small queue that is merely full
/// (`queue.buffering.max.kbytes` holds a dozen records, and two thousand
/// are read) is waited out, never taken for a record that cannot fit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_producer_queue_that_is_only_full_is_waited_out() {
    let db = TestDb::new("rules_queue_full").await;
    let client = db.client().await;
    let slot = "rules_queue_full";
    let text = config_text(
        &db.superuser_url(),
        slot,
        &broker().brokers,
        "topic = \"queuefull.{aggregate_type}\"",
        "",
    );
    let text = format!("{text}\n[kafka.options]\n\"queue.buffering.max.kbytes\" = \"64\"\n");
    let (handle, stop) = spawn_relay_with_slot(&client, slot, &text).await;
    client
        .batch_execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload)
             SELECT gen_random_uuid(), 'Order', 'a' || (g % 7), 't', jsonb_build_object('pad', repeat('p', 4000), 'g', g)
               FROM generate_series(1, 2000) g",
        )
        .await
        .unwrap();
    let records = read(&["queuefull.order"], 2000).await;
    assert_eq!(records.len(), 2000, "every row arrives");
    assert!(!handle.is_finished(), "the relay is still running");
    stop_relay(handle, stop).await;
}

/// Kafka denying outboxd a topic (TopicAuthorizationFailed on produce) is
/// an operator problem: outboxd stops naming the grant, sets no valid event
/// aside as a dead letter, and does not confirm past it. The broker's
/// answer is injected with MockCluster: ACLs need an authorizer and SASL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denied_topic_stops_without_dead_letters() {
    use rdkafka::mocking::MockCluster;
    use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};
    let db = TestDb::new("rules_denied").await;
    let client = db.client().await;
    let mock = MockCluster::new(1).unwrap();
    mock.create_topic("denied.order", 1, 1).unwrap();
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED; 50],
    );
    let slot = "rules_denied";
    let text = config_text(
        &db.superuser_url(),
        slot,
        &mock.bootstrap_servers(),
        "topic = \"denied.{aggregate_type}\"\non_poison = \"dead-letter\"\ndead_letter_topic = \"denied.dead-letter\"",
        "",
    );
    let err = stop_after_one_row(&client, slot, &text, ONE_ROW).await;
    let text = err.to_string();
    assert!(matches!(err, RelayError::KafkaDenied { .. }), "{text}");
    assert!(text.contains("grant") && text.contains("denied.order"), "{text}");
    assert_row_still_in_slot(&client, slot).await;
    let md = {
        let brokers = mock.bootstrap_servers();
        tokio::task::spawn_blocking(move || {
            consume(&brokers, &["denied.dead-letter"], 1, Duration::from_secs(3))
        })
        .await
        .unwrap()
    };
    assert!(md.is_empty(), "no dead letter for a valid event");
}

/// The first records to a topic outboxd has just created all land. A new
/// topic's partitions come up one after another; producing into that
/// window made librdkafka's idempotent producer report records as
/// delivered that the broker never stored (the quick start lost its first
/// order in 2 of 7 runs on a fresh broker; this test, in-process, did not
/// reproduce it, so scripts/test.sh also runs the quick start, which checks
/// its own count). Here, as there: a fresh broker, its first topics created
/// by outboxd, a reader joining a group at once. Once the slot is past
/// every transaction, the watermarks count every record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_records_to_new_topics_all_land() {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    const ROUNDS: usize = 1;
    const TOPICS: usize = 3;
    let mut short = Vec::new();
    for round in 0..ROUNDS {
        // A fresh broker each round: no topic, no __consumer_offsets yet.
        let own = crate::harness::broker::dedicated();
        let db = TestDb::new(&format!("rules_fresh_{round}")).await;
        let client = db.client().await;
        let slot = format!("rules_fresh_{round}");
        let prefix = format!("fresh{round}");
        let (handle, stop) = spawn_relay_with_slot(
            &client,
            &slot,
            &config_text(
                &db.superuser_url(),
                &slot,
                &own.brokers,
                &format!("topic = \"{prefix}.{{aggregate_type}}\""),
                "",
            ),
        )
        .await;
        for t in 0..TOPICS {
            client
                .batch_execute(&format!(
                    "BEGIN; INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload) VALUES
                       (gen_random_uuid(), 't{t}', 'k{t}', 'placed', '{{}}'),
                       (gen_random_uuid(), 't{t}', 'k{t}', 'paid', '{{}}'); COMMIT;"
                ))
                .await
                .unwrap();
        }
        // A reader that asks for the topics while they are created.
        let (brokers, p) = (own.brokers.clone(), prefix.clone());
        let reader = tokio::task::spawn_blocking(move || {
            let c: BaseConsumer = rdkafka::ClientConfig::new()
                .set("bootstrap.servers", &brokers)
                .set("group.id", "fresh-reader")
                .create()
                .unwrap();
            // Joining a group on a fresh broker creates __consumer_offsets
            // while outboxd's topics are being created.
            let mut tpl = rdkafka::TopicPartitionList::new();
            for t in 0..TOPICS {
                let _ = c.fetch_metadata(Some(&format!("{p}.t{t}")), Duration::from_secs(5));
                tpl.add_partition(&format!("{p}.t{t}"), 0);
            }
            let _ = c.committed_offsets(tpl, Duration::from_secs(5));
        });
        let last = crate::relay::current_lsn(&client).await;
        wait_for(
            "the slot past every transaction",
            Duration::from_secs(120),
            || async { (confirmed_flush(&client, &slot).await? >= last).then_some(()) },
        )
        .await;
        reader.await.unwrap();
        let brokers = own.brokers.clone();
        let counts: Vec<(String, i64)> = tokio::task::spawn_blocking(move || {
            let c: BaseConsumer = rdkafka::ClientConfig::new()
                .set("bootstrap.servers", &brokers)
                .create()
                .unwrap();
            (0..TOPICS)
                .map(|t| {
                    let topic = format!("{prefix}.t{t}");
                    let n = (0..3)
                        .map(|p| c.fetch_watermarks(&topic, p, Duration::from_secs(10)).unwrap().1)
                        .sum();
                    (topic, n)
                })
                .collect()
        })
        .await
        .unwrap();
        short.extend(counts.into_iter().filter(|(_, n)| *n != 2));
        stop_relay(handle, stop).await;
        own.kill();
    }
    assert!(
        short.is_empty(),
        "topics without their 2 records after the slot confirmed them: {short:?}"
    );
}

/// With `routing.allowed_aggregate_types`, a row of another aggregate type
/// creates no topic: it follows `on_poison` (here a dead letter) and the
/// rows around it flow on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregate_types_outside_the_allow_list_create_no_topic() {
    let db = TestDb::new("rules_allow").await;
    let client = db.client().await;
    let slot = "rules_allow";
    let (handle, stop) = spawn_relay_with_slot(&client, slot, &config_text(
        &db.superuser_url(),
        slot,
        &broker().brokers,
        "topic = \"allow.{aggregate_type}\"\nallowed_aggregate_types = [\"Order\", \"Pay*\"]\non_poison = \"dead-letter\"\ndead_letter_topic = \"allow.dead-letter\"",
        "",
    )).await;
    client
        .batch_execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload) VALUES
               (gen_random_uuid(), 'Order', 'a', 't', '{}'),
               (gen_random_uuid(), 'Spam', 'a', 't', '{}'),
               (gen_random_uuid(), 'Payment', 'a', 't', '{}'),
               (gen_random_uuid(), 'spam-typo', 'a', 't', '{}'),
               (gen_random_uuid(), 'Order', 'a', 't', '{}')",
        )
        .await
        .unwrap();
    let dlq = read(&["allow.dead-letter"], 2).await;
    assert_eq!(dlq.len(), 2);
    assert!(dlq
        .iter()
        .all(|d| d.header("dlq.reason") == Some("aggregate_type_not_allowed")));
    assert_eq!(read(&["allow.order"], 2).await.len(), 2);
    assert_eq!(read(&["allow.payment"], 1).await.len(), 1);
    let last = crate::relay::current_lsn(&client).await;
    wait_for("the slot past the rows", Duration::from_secs(30), || async {
        (confirmed_flush(&client, slot).await? >= last).then_some(())
    })
    .await;
    let brokers = broker().brokers.clone();
    let made: Vec<String> = tokio::task::spawn_blocking(move || topics_with_prefix(&brokers, "allow."))
        .await
        .unwrap();
    assert!(
        !made.iter().any(|t| t.contains("spam")),
        "no topic for a type outside the list: {made:?}"
    );
    stop_relay(handle, stop).await;
}

/// A record larger than its topic's `max.message.bytes` is refused before
/// it is sent (so no batch around it is refused), by the size the broker
/// computes: one at the limit is stored, one byte over is refused here,
/// and the broker, asked without the check, refuses that one too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_over_its_topics_limit_is_refused_before_it_is_sent() {
    use outboxd::kafka::records::KafkaRecord;
    use outboxd::kafka::sink::{batch_bytes_alone, KafkaSink, KafkaSinkError, Report, SendOutcome};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let brokers = broker().brokers.clone();
    let topic = format!("limit{}.order", &Uuid::new_v4().simple().to_string()[..8]);
    let (b, t) = (brokers.clone(), topic.clone());
    tokio::task::spawn_blocking(move || {
        crate::harness::broker::create_topics_with(&b, &[t], &[("max.message.bytes", "20000")])
    })
    .await
    .unwrap();
    let text = config_text("postgres://unused@127.0.0.1/unused", "limit", &brokers, "", "");
    let (config, _) = outboxd::config::Config::from_toml(&text, |_| None).unwrap();
    let mut sink = KafkaSink::new(&config.kafka, Duration::from_secs(10)).unwrap();
    sink.ensure_topic(&topic).await.unwrap();
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as i64;
    let record = |len: usize| KafkaRecord {
        topic: topic.clone(),
        key: b"agg-1".to_vec(),
        value: Some(vec![b'x'; len]),
        headers: vec![
            ("id".into(), b"0193a1c2".to_vec()),
            ("type".into(), vec![b't'; 200]),
        ],
        timestamp_ms: now,
        partition: None,
    };
    let mut len = 19_000;
    while batch_bytes_alone(&record(len)) < 20_000 {
        len += 1;
    }
    assert_eq!(batch_bytes_alone(&record(len)), 20_000);
    let SendOutcome::Sent(at_limit) = sink.send(&record(len)).unwrap() else {
        panic!("queue full");
    };
    assert!(
        matches!(at_limit.await, Report::Stored { .. }),
        "a record of exactly max.message.bytes is stored"
    );
    let over = record(len + 1);
    assert!(
        matches!(sink.send(&over), Err(KafkaSinkError::Produce { .. })),
        "one byte over is refused before it is sent"
    );
    let plain: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("linger.ms", "0")
        .create()
        .unwrap();
    let mut headers = rdkafka::message::OwnedHeaders::new();
    for (k, v) in &over.headers {
        headers = headers.insert(rdkafka::message::Header {
            key: k,
            value: Some(v.as_slice()),
        });
    }
    let sent = plain
        .send(
            FutureRecord::to(&topic)
                .key(over.key.as_slice())
                .payload(over.value_bytes())
                .headers(headers)
                .timestamp(now),
            Duration::from_secs(10),
        )
        .await;
    let err = sent.expect_err("the broker refuses it too").0;
    assert_eq!(
        err.rdkafka_error_code(),
        Some(rdkafka::types::RDKafkaErrorCode::MessageSizeTooLarge),
        "{err}"
    );
}

//! Generated rows through the real relay, PostgreSQL and Kafka.
//!
//! Each run writes a few hundred rows drawn from strategies that reach for
//! the edges: timestamps PostgreSQL takes and Kafka or the envelope cannot
//! (`infinity`, 4713 BC, year 294276, before 1970, hours ahead), JSON that
//! is huge, deeply nested or holds numbers no float can hold, unicode and
//! empty or over-long aggregate types and keys, and headers of every JSON
//! type. The property: with `on_poison = "dead-letter"` every row ends up
//! either published (key, headers, order per aggregate) or dead-lettered
//! with a reason, never both and never neither, and the relay keeps
//! running; with `on_poison = "stop"` the same rows stop the relay exactly
//! at the first row the other run dead-lettered, without confirming past it.
//!
//! `OUTBOXD_FUZZ_SEED` replays a run (the seed is printed), and
//! `OUTBOXD_FUZZ_ROWS` sets its size.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config as RunnerConfig, RngAlgorithm, TestRng, TestRunner};
use serde_json::{json, Value};
use uuid::Uuid;

use crate::harness::broker::{broker, consume_to_end, topics_with_prefix, Consumed};
use crate::harness::TestDb;
use crate::relay::{
    config_text, confirmed_flush, current_lsn, env_usize, pending_in_released_slot, spawn_relay_with_slot,
    stop_relay,
};

/// One generated outbox row, as the text PostgreSQL is given.
#[derive(Clone, Debug)]
struct GenRow {
    id: Uuid,
    aggregate_type: String,
    aggregate_id: String,
    event_type: String,
    payload: String,
    headers: String,
    created_at: String,
}

/// Strings PostgreSQL's `text` takes: anything but NUL.
fn text(max: usize) -> impl Strategy<Value = String> {
    proptest::collection::vec(any::<char>().prop_filter("NUL", |c| *c != '\0'), 0..=max)
        .prop_map(|cs| cs.into_iter().collect())
}

/// Aggregate types that make legal topic names.
const GOOD_TYPES: [&str; 6] = ["Order", "order", "Payment", "inventory-item", "a.b_c", "X"];

/// `created_at` values the envelope's RFC 3339 `occurredAt` cannot write.
const UNWRITABLE_TIMES: [&str; 5] = [
    "infinity",
    "-infinity",
    "4713-01-01 00:00:00+00 BC",
    "10000-01-01 00:00:00+00",
    "294276-12-31 23:59:59+00",
];

/// What must become of a row, as far as the rules decide it alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expect {
    Publish,
    DeadLetter,
    /// Depends on more than the oracle models (a generated topic name).
    Either,
}

/// The oracle: rules the README states, applied to a generated row.
fn expect(r: &GenRow) -> Expect {
    let refused = r.aggregate_id.is_empty()
        || !r.headers.starts_with('{')
        || UNWRITABLE_TIMES.contains(&r.created_at.as_str())
        || r.payload.len() > 1_050_000;
    if refused {
        return Expect::DeadLetter;
    }
    if GOOD_TYPES.contains(&r.aggregate_type.as_str()) && r.payload.len() < 900_000 {
        return Expect::Publish;
    }
    Expect::Either
}

fn aggregate_type() -> impl Strategy<Value = String> {
    prop_oneof![
        12 => prop::sample::select(GOOD_TYPES.to_vec()).prop_map(str::to_owned),
        2 => text(12),
        1 => "[a-z]{246,260}",
        1 => Just(String::new()),
        1 => "[ /#äö주文]{1,5}",
    ]
}

fn aggregate_id() -> impl Strategy<Value = String> {
    prop_oneof![
        10 => "[a-z0-9-]{1,3}",
        3 => text(20),
        1 => Just(String::new()),
        1 => "[a-z]{3000,5000}",
    ]
}

fn json_leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        (-1e300f64..1e300f64).prop_map(|f| json!(f)),
        text(24).prop_map(Value::String),
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    json_leaf().prop_recursive(6, 48, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::btree_map(text(10), inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// JSON text, including what `serde_json::Value` cannot hold.
fn json_text() -> impl Strategy<Value = String> {
    prop_oneof![
        20 => json_value().prop_map(|v| v.to_string()),
        2 => (100usize..400).prop_map(|d| format!("{}1{}", "[".repeat(d), "]".repeat(d))),
        2 => Just(r#"{"big": 1e400, "tiny": -1e-400, "long": 123456789012345678901234567890.5}"#.to_owned()),
        1 => (1_100_000usize..1_300_000).prop_map(|n| json!({"blob": "x".repeat(n)}).to_string()),
    ]
}

fn headers_text() -> impl Strategy<Value = String> {
    prop_oneof![
        12 => proptest::collection::btree_map(text(12), json_value(), 0..6)
            .prop_map(|m| Value::Object(m.into_iter().collect()).to_string()),
        2 => json_leaf().prop_map(|v| v.to_string()),
        1 => Just("[1, 2]".to_owned()),
        1 => (129usize..200).prop_map(|d| format!("{}1{}", "{\"a\": ".repeat(d), "}".repeat(d))),
        1 => Just(r#"{"big": 1e400, "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}"#.to_owned()),
        1 => Just(r#"{"id": "not the event id", "type": 1}"#.to_owned()),
    ]
}

fn created_at() -> impl Strategy<Value = String> {
    let now = chrono::Utc::now();
    let literal = prop::sample::select(vec![
        UNWRITABLE_TIMES[0],
        UNWRITABLE_TIMES[1],
        UNWRITABLE_TIMES[2],
        UNWRITABLE_TIMES[3],
        UNWRITABLE_TIMES[4],
        "0001-01-01 00:00:00+00",
        "1969-12-31 23:59:59.999999+00",
        "1970-01-01 00:00:00+00",
        "1970-01-01 00:00:00.001+00",
        "9999-12-31 23:59:59.999999+00",
        "now",
    ])
    .prop_map(str::to_owned);
    let around_now =
        (-400_000_000i64..400_000_000).prop_map(move |s| (now + chrono::Duration::seconds(s)).to_rfc3339());
    let hours_ahead = (1i64..48).prop_map(move |h| (now + chrono::Duration::hours(h)).to_rfc3339());
    prop_oneof![4 => Just("now".to_owned()), 3 => literal, 2 => around_now, 1 => hours_ahead]
}

fn row() -> impl Strategy<Value = GenRow> {
    (
        any::<u128>(),
        aggregate_type(),
        aggregate_id(),
        text(30),
        json_text(),
        headers_text(),
        created_at(),
    )
        .prop_map(
            |(id, aggregate_type, aggregate_id, event_type, payload, headers, created_at)| GenRow {
                id: Uuid::from_u128(id),
                aggregate_type,
                aggregate_id,
                event_type,
                payload,
                headers,
                created_at,
            },
        )
}

/// Rows in transactions of 1 to 8.
fn generate(seed: u64, rows: usize) -> Vec<Vec<GenRow>> {
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let mut runner = TestRunner::new_with_rng(
        RunnerConfig::default(),
        TestRng::from_seed(RngAlgorithm::ChaCha, &bytes),
    );
    let strategy = proptest::collection::vec(proptest::collection::vec(row(), 1..=8), 1..=rows);
    let mut txns = strategy.new_tree(&mut runner).unwrap().current();
    // Exactly `rows` rows: trim the tail.
    let mut left = rows;
    txns.retain_mut(|t| {
        t.truncate(left);
        left -= t.len();
        !t.is_empty()
    });
    txns
}

/// Writes the transactions, in order.
async fn write(client: &mut tokio_postgres::Client, txns: &[Vec<GenRow>]) {
    for rows in txns {
        let tx = client.transaction().await.unwrap();
        for r in rows {
            tx.execute(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload, headers, created_at)
                 VALUES ($1, $2, $3, $4, $5::text::jsonb, $6::text::jsonb, $7::text::timestamptz)",
                &[
                    &r.id,
                    &r.aggregate_type,
                    &r.aggregate_id,
                    &r.event_type,
                    &r.payload,
                    &r.headers,
                    &r.created_at,
                ],
            )
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL refused generated row {r:?}: {e}"));
        }
        tx.commit().await.unwrap();
    }
}

fn seed() -> u64 {
    match std::env::var("OUTBOXD_FUZZ_SEED") {
        Ok(s) => s.parse().expect("OUTBOXD_FUZZ_SEED is a u64"),
        Err(_) => Uuid::new_v4().as_u64_pair().0,
    }
}

fn routing(run: &str, on_poison: &str) -> String {
    format!(
        "topic = \"{run}.{{aggregate_type}}\"\non_poison = \"{on_poison}\"\ndead_letter_topic = \"{run}-dlq\"\nvalue = \"envelope\""
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generated_rows_are_published_or_dead_lettered_never_lost() {
    let seed = seed();
    let rows = env_usize("OUTBOXD_FUZZ_ROWS", 300);
    let txns = generate(seed, rows);
    let all: Vec<&GenRow> = txns.iter().flatten().collect();
    eprintln!(
        "fuzz seed: {seed} (OUTBOXD_FUZZ_SEED={seed} replays this run), {} rows in {} transactions",
        all.len(),
        txns.len()
    );
    let brokers = broker().brokers.clone();
    let run = format!("fz{}", seed % 1_000_000_007);

    // Dead-letter mode: everything is accounted for, the relay keeps going.
    let db = TestDb::new("fuzz_dead_letter").await;
    let mut client = db.client().await;
    let slot = "fuzz_dead_letter";
    let text = config_text(
        &db.superuser_url(),
        slot,
        &brokers,
        &routing(&run, "dead-letter"),
        "",
    );
    let (handle, stop) = spawn_relay_with_slot(&client, slot, &text).await;
    write(&mut client, &txns).await;
    let end = current_lsn(&client).await;
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        assert!(
            !handle.is_finished(),
            "seed {seed}: the relay stopped in dead-letter mode: {:?}",
            handle.await
        );
        if confirmed_flush(&client, slot).await.is_some_and(|c| c >= end) {
            break;
        }
        assert!(Instant::now() < deadline, "seed {seed}: not confirmed in 180 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let topics = topics_with_prefix(&brokers, &run);
    let dlq = format!("{run}-dlq");
    let records = tokio::task::spawn_blocking({
        let (b, topics) = (brokers.clone(), topics.clone());
        move || {
            let names: Vec<&str> = topics.iter().map(String::as_str).collect();
            // Everything is acknowledged (the slot is confirmed past
            // it): read each partition to its end, however long it takes.
            consume_to_end(&b, &names, Duration::from_secs(180))
        }
    })
    .await
    .unwrap();
    let mut published: HashMap<String, Vec<&Consumed>> = HashMap::new();
    let mut dead: HashMap<String, Vec<&Consumed>> = HashMap::new();
    for m in &records {
        let id = m.header("id").unwrap_or_default().to_owned();
        if m.topic == dlq {
            dead.entry(id).or_default().push(m);
        } else {
            published.entry(id).or_default().push(m);
        }
    }
    let mut first_dead: Option<Uuid> = None;
    let mut reasons: HashMap<String, usize> = HashMap::new();
    for r in &all {
        let id = r.id.to_string();
        let outcome = match (published.get(&id), dead.get(&id)) {
            (Some(_), None) => Expect::Publish,
            (None, Some(_)) => Expect::DeadLetter,
            (Some(_), Some(_)) => panic!("seed {seed}: {id} was both published and dead-lettered"),
            (None, None) => panic!(
                "seed {seed}: row {id} is lost ({} records read from {} topics): {r:?}",
                records.len(),
                topics.len()
            ),
        };
        let want = expect(r);
        assert!(
            want == Expect::Either || want == outcome,
            "seed {seed}: row {id} should {want:?}, but {outcome:?}: {:.300}",
            format!("{r:?}")
        );
        match (published.get(&id), dead.get(&id)) {
            (Some(p), None) => {
                let m = p[0];
                assert_eq!(m.key, r.aggregate_id, "seed {seed}: key of {id}");
                assert_eq!(m.header("aggregateType"), Some(r.aggregate_type.as_str()));
                assert_eq!(m.header("type"), Some(r.event_type.as_str()));
                assert_eq!(
                    m.topic,
                    format!("{run}.{}", r.aggregate_type.to_lowercase()),
                    "seed {seed}: topic of {id}"
                );
            }
            (None, Some(d)) => {
                let reason = d[0].header("dlq.reason").unwrap_or_default();
                assert!(
                    !reason.is_empty(),
                    "seed {seed}: dead letter of {id} has no reason"
                );
                *reasons.entry(reason.to_owned()).or_default() += 1;
                first_dead.get_or_insert(r.id);
            }
            _ => unreachable!("the outcome above has failed on both and on neither"),
        }
    }
    // One aggregate's published events keep their commit order.
    let mut seen: HashSet<&str> = HashSet::new();
    let mut order: HashMap<(&str, &str), Vec<&str>> = HashMap::new();
    for m in records.iter().filter(|m| m.topic != dlq) {
        let id = m.header("id").unwrap_or_default();
        if seen.insert(id) {
            order
                .entry((m.topic.as_str(), m.key.as_str()))
                .or_default()
                .push(id);
        }
    }
    let ids: Vec<String> = all.iter().map(|r| r.id.to_string()).collect();
    let position: HashMap<&str, usize> = ids.iter().enumerate().map(|(i, id)| (id.as_str(), i)).collect();
    for ((topic, key), got) in &order {
        let mut want = got.clone();
        want.sort_by_key(|id| position[id]);
        assert_eq!(got, &want, "seed {seed}: order of {topic} key {key:.40}");
    }
    eprintln!(
        "seed {seed}: {} rows, {} published, dead letters by reason {reasons:?}",
        all.len(),
        published.len()
    );
    stop_relay(handle, stop).await;

    // Stop mode: the same rows stop the relay at the first of them that
    // was dead-lettered, and the slot does not pass it.
    // The strategies make bad rows in every run; a run without one would
    // test nothing here.
    let first_dead = first_dead.unwrap_or_else(|| panic!("seed {seed}: no row was dead-lettered"));
    let db = TestDb::new("fuzz_stop").await;
    let mut client = db.client().await;
    let slot = "fuzz_stop";
    let text = config_text(&db.superuser_url(), slot, &brokers, &routing(&run, "stop"), "");
    let (handle, _stop) = spawn_relay_with_slot(&client, slot, &text).await;
    write(&mut client, &txns).await;
    let stopped = tokio::time::timeout(Duration::from_secs(120), handle)
        .await
        .unwrap_or_else(|_| panic!("seed {seed}: the relay did not stop at {first_dead}"))
        .unwrap();
    let err = stopped.expect_err("stop mode stops at a bad row");
    assert!(
        err.to_string().contains(&first_dead.to_string()),
        "seed {seed}: the stop names {first_dead}: {err}"
    );
    assert!(pending_in_released_slot(&client, slot).await > 0);
    let row_pending: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_logical_slot_peek_binary_changes($1::text::name, NULL, NULL,
                 'proto_version', '1', 'publication_names', $1::text)
              WHERE position(convert_to($2, 'UTF8') in data) > 0",
            &[&slot, &first_dead.to_string()],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        row_pending, 1,
        "seed {seed}: the slot still holds the row it stopped at"
    );
}

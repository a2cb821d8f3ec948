//! Many topics under SIGKILL, in both delivery modes, on Apache Kafka: 50
//! aggregate types, each its own topic of 3 partitions, so the relay's
//! in-flight budget grows to its many-partitions size
//! (`outboxd::config::kafka::budget`) and librdkafka holds records for 150
//! partitions at once when the daemon is killed. Every event must arrive
//! (exactly once for `read_committed` consumers in exactly-once mode), each
//! aggregate's events in the order they were written.

use std::collections::HashSet;
use std::time::Duration;

use uuid::Uuid;

use crate::exactly_once::{assert_exactly_once, eo_config};
use crate::harness::broker::{broker, consume, Consumed};
use crate::harness::{wait_for, TestDb};
use crate::relay::{
    config_text, confirmed_flush, current_lsn, env_usize, expected_order, first_occurrence_order, seed,
    torture_writers_over, write_config, Daemon, Event,
};

const TYPES: usize = 50;
const WRITERS: usize = 4;
const PER_TXN: usize = 10;

fn types() -> Vec<String> {
    (0..TYPES).map(|t| format!("t{t}")).collect()
}

fn topics(prefix: &str) -> Vec<String> {
    types().iter().map(|t| format!("{prefix}.{t}")).collect()
}

/// Writes `total` events over the 50 types while the daemon is SIGKILLed
/// `kills` times, each kill while it streams (its log shows a new session
/// since the last kill), and returns what was written.
async fn write_while_killing(
    db: &TestDb,
    daemon: &mut Daemon,
    log: &std::path::Path,
    total: usize,
    kills: usize,
    level: &str,
) -> Vec<Event> {
    let types = types();
    let types: Vec<&str> = types.iter().map(String::as_str).collect();
    let writers = torture_writers_over(db, WRITERS, total / WRITERS / PER_TXN, PER_TXN, &types).await;
    let sessions = |log: &std::path::Path| {
        std::fs::read_to_string(log)
            .unwrap_or_default()
            .matches("relay: streaming")
            .count()
    };
    let mut rng = seed();
    for k in 0..kills {
        wait_for("the daemon to stream", Duration::from_secs(60), || async {
            (sessions(log) > k).then_some(())
        })
        .await;
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        tokio::time::sleep(Duration::from_millis(200 + rng % 800)).await;
        daemon.kill9();
        daemon.restart_logging(level);
    }
    let mut events = Vec::new();
    for w in writers {
        events.extend(w.await.unwrap());
    }
    assert_eq!(events.len(), total / WRITERS / PER_TXN * WRITERS * PER_TXN);
    events
}

/// Reads the 50 topics until every one of `want` ids is there.
async fn read_all(brokers: &str, prefix: &str, want: usize) -> Vec<Consumed> {
    let (brokers, topics) = (brokers.to_owned(), topics(prefix));
    wait_for("every event in Kafka", Duration::from_secs(300), || {
        let (brokers, topics) = (brokers.clone(), topics.clone());
        async move {
            tokio::task::spawn_blocking(move || {
                let topics: Vec<&str> = topics.iter().map(String::as_str).collect();
                let records = consume(&brokers, &topics, usize::MAX, Duration::from_secs(3));
                let unique: HashSet<&str> = records.iter().filter_map(|r| r.header("id")).collect();
                (unique.len() >= want).then_some(records)
            })
            .await
            .unwrap()
        }
    })
    .await
}

/// At-least-once: every event at least once, the first occurrences of each
/// aggregate's events in order, duplicates within what each kill had in
/// flight (the grown budget: 150 partitions × 100 records).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_topics_under_sigkill_lose_nothing_and_keep_each_aggregates_order() {
    let total = env_usize("OUTBOXD_MANY_TOPICS_EVENTS", 20_000);
    let kills = env_usize("OUTBOXD_MANY_TOPICS_KILLS", 5);
    let db = TestDb::new("many_topics").await;
    let client = db.client().await;
    let dir = tempfile::tempdir().unwrap();
    let (slot, prefix) = ("many_topics", "many");
    let cfg = write_config(
        dir.path(),
        "many.toml",
        &config_text(
            &db.superuser_url(),
            slot,
            &broker().brokers,
            &format!("topic = \"{prefix}.{{aggregate_type}}\""),
            "",
        ),
    );
    let log = dir.path().join("outboxd.log");
    let level = "warn,outboxd::relay=info";
    let mut daemon = Daemon::start_logging(&cfg, &log, level);
    wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(&client, slot).await
    })
    .await;
    let started = std::time::Instant::now();
    let events = write_while_killing(&db, &mut daemon, &log, total, kills, level).await;
    let written_in = started.elapsed();
    let records = read_all(&broker().brokers, prefix, events.len()).await;
    let status = daemon.sigterm();
    assert!(status.success(), "SIGTERM exits 0: {status}");

    let written: HashSet<Uuid> = events.iter().map(|e| e.id).collect();
    let got: HashSet<Uuid> = records
        .iter()
        .map(|r| r.header("id").unwrap().parse().unwrap())
        .collect();
    assert_eq!(got, written, "every event at least once, nothing foreign");
    assert_eq!(
        first_occurrence_order(&records),
        expected_order(&events),
        "per-aggregate order of first occurrences"
    );
    let per_topic: HashSet<&str> = records.iter().map(|r| r.topic.as_str()).collect();
    assert_eq!(per_topic.len(), TYPES, "each aggregate type on its own topic");
    let in_flight = outboxd::config::kafka::budget::CEILING_RECORDS;
    let per_second = written.len() as f64 / written_in.as_secs_f64();
    let bound = kills * (in_flight + PER_TXN + per_second.ceil() as usize);
    let duplicates = records.len() - written.len();
    eprintln!(
        "many topics: {} events over {TYPES} topics in {written_in:?}, {kills} SIGKILLs, {duplicates} duplicates (bound {bound})",
        written.len()
    );
    assert!(
        duplicates <= bound,
        "{duplicates} duplicates exceed the bound {bound}"
    );
}

/// Exactly-once: a `read_committed` consumer of the 50 topics sees every
/// event once, each aggregate's in order, and the slot confirms it all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_topics_under_sigkill_exactly_once() {
    let total = env_usize("OUTBOXD_MANY_TOPICS_EVENTS", 20_000);
    let kills = env_usize("OUTBOXD_MANY_TOPICS_KILLS", 5);
    let db = TestDb::new("many_topics_eo").await;
    let client = db.client().await;
    let brokers = broker().brokers.clone();
    let dir = tempfile::tempdir().unwrap();
    let (slot, prefix) = ("many_topics_eo", "many-eo");
    let cfg = write_config(
        dir.path(),
        "eo.toml",
        &eo_config(&db.superuser_url(), slot, &brokers, prefix, ""),
    );
    let log = dir.path().join("outboxd.log");
    let level = "warn,outboxd::relay=info";
    let mut daemon = Daemon::start_logging(&cfg, &log, level);
    wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(&client, slot).await
    })
    .await;
    let events = write_while_killing(&db, &mut daemon, &log, total, kills, level).await;
    let _ = read_all(&brokers, prefix, events.len()).await;
    let last = current_lsn(&client).await;
    wait_for(
        "the slot to confirm everything",
        Duration::from_secs(120),
        || async { (confirmed_flush(&client, slot).await? >= last).then_some(()) },
    )
    .await;
    let status = daemon.sigterm();
    assert!(status.success(), "SIGTERM exits 0: {status}");
    // Read again once the daemon is gone: nothing more may have arrived.
    let topics = topics(prefix);
    let records = tokio::task::spawn_blocking(move || {
        let topics: Vec<&str> = topics.iter().map(String::as_str).collect();
        consume(&brokers, &topics, usize::MAX, Duration::from_secs(3))
    })
    .await
    .unwrap();
    assert_exactly_once(&records, &events);
}

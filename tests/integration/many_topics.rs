//! Many topics under SIGKILL, in both delivery modes, on Apache Kafka: 50
//! aggregate types, each its own topic of 3 partitions, so the relay's
//! in-flight budget grows to its many-partitions size
//! (`outboxd::config::kafka::budget`) and librdkafka holds records for 150
//! partitions at once when the daemon is killed. Every event must arrive
//! (exactly once for `read_committed` consumers in exactly-once mode), each
//! aggregate's events in the order they were written.

use std::collections::HashSet;
use std::time::Duration;

use crate::exactly_once::{assert_exactly_once, eo_config};
use crate::harness::broker::{broker, consume, consume_to_end};
use crate::harness::{wait_for, TestDb};
use crate::relay::{
    assert_at_least_once, config_text, confirmed_flush, current_lsn, env_usize, seed, torture_writers_over,
    write_config, Daemon, Event,
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

/// Starts outboxd on `cfg`, writes while killing it (see
/// [`write_while_killing`]), and stops it with SIGTERM once the slot
/// confirmed everything.
async fn run_killed(db: &TestDb, cfg: &std::path::Path, dir: &std::path::Path, slot: &str) -> Vec<Event> {
    let total = env_usize("OUTBOXD_MANY_TOPICS_EVENTS", 10_000);
    let kills = env_usize("OUTBOXD_MANY_TOPICS_KILLS", 4);
    let client = db.client().await;
    let log = dir.join("outboxd.log");
    let level = "warn,outboxd::relay=info";
    let mut daemon = Daemon::start_logging(cfg, &log, level);
    wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(&client, slot).await
    })
    .await;
    let events = write_while_killing(db, (&mut daemon, &log, level), slot, total, kills).await;
    let status = daemon.sigterm();
    assert!(status.success(), "SIGTERM exits 0: {status}");
    events
}

/// Writes about `total` events over the 50 types in `kills` waves, and
/// SIGKILLs the daemon during each (once it streams again: its log shows a
/// new session since the last kill); waits until the slot confirmed every
/// event. Fails unless at least two kills hit the
/// daemon with WAL it had not confirmed (mid-stream, records in flight).
async fn write_while_killing(
    db: &TestDb,
    (daemon, log, level): (&mut Daemon, &std::path::Path, &str),
    slot: &str,
    total: usize,
    kills: usize,
) -> Vec<Event> {
    let client = db.client().await;
    let types = types();
    let types: Vec<&str> = types.iter().map(String::as_str).collect();
    let sessions = |log: &std::path::Path| {
        std::fs::read_to_string(log)
            .unwrap_or_default()
            .matches("relay: streaming")
            .count()
    };
    // A wave of writers per kill, so that each kill lands while events
    // are written and relayed.
    let wave = total / kills / WRITERS / PER_TXN;
    let mut rng = seed();
    let (mut events, mut mid_stream) = (Vec::new(), 0);
    for k in 0..kills {
        wait_for("the daemon to stream", Duration::from_secs(60), || async {
            (sessions(log) > k).then_some(())
        })
        .await;
        let writers = torture_writers_over(db, WRITERS, wave, PER_TXN, &types).await;
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        tokio::time::sleep(Duration::from_millis(100 + rng % 500)).await;
        let behind = match confirmed_flush(&client, slot).await {
            Some(confirmed) => confirmed < current_lsn(&client).await,
            None => false,
        };
        daemon.kill9();
        mid_stream += usize::from(behind);
        daemon.restart_logging(level);
        for w in writers {
            events.extend(w.await.unwrap());
        }
    }
    assert_eq!(events.len(), wave * kills * WRITERS * PER_TXN);
    assert!(
        mid_stream >= 2,
        "only {mid_stream} kills hit the daemon mid-stream: raise OUTBOXD_MANY_TOPICS_EVENTS"
    );
    let last = current_lsn(&client).await;
    wait_for(
        "the slot to confirm everything",
        Duration::from_secs(180),
        || async { (confirmed_flush(&client, slot).await? >= last).then_some(()) },
    )
    .await;
    eprintln!(
        "many topics: {} events, {mid_stream} SIGKILLs mid-stream",
        events.len()
    );
    events
}

/// At-least-once: every event at least once, the first occurrences of each
/// aggregate's events in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_topics_under_sigkill_lose_nothing_and_keep_each_aggregates_order() {
    let db = TestDb::new("many_topics").await;
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
    let events = run_killed(&db, &cfg, dir.path(), slot).await;
    // The slot confirmed every event, so Kafka acknowledged each: all are
    // below the high watermarks.
    let (brokers, topics) = (broker().brokers.clone(), topics(prefix));
    let records = tokio::task::spawn_blocking(move || {
        let topics: Vec<&str> = topics.iter().map(String::as_str).collect();
        consume_to_end(&brokers, &topics, Duration::from_secs(120))
    })
    .await
    .unwrap();

    let written = assert_at_least_once(&records, &events);
    let per_topic: HashSet<&str> = records.iter().map(|r| r.topic.as_str()).collect();
    assert_eq!(per_topic.len(), TYPES, "each aggregate type on its own topic");
    eprintln!(
        "many topics, at-least-once: {} duplicates",
        records.len() - written.len()
    );
}

/// Exactly-once: a `read_committed` consumer of the 50 topics sees every
/// event once, each aggregate's in order, and the slot confirms it all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_topics_under_sigkill_exactly_once() {
    let db = TestDb::new("many_topics_eo").await;
    let brokers = broker().brokers.clone();
    let dir = tempfile::tempdir().unwrap();
    let (slot, prefix) = ("many_topics_eo", "many-eo");
    let cfg = write_config(
        dir.path(),
        "eo.toml",
        &eo_config(&db.superuser_url(), slot, &brokers, prefix, ""),
    );
    let events = run_killed(&db, &cfg, dir.path(), slot).await;
    // Every Kafka transaction is committed once the slot confirmed it; the
    // read runs to its timeout (it wants one record more than written), so
    // it sees any duplicate too.
    let (want, topics) = (events.len() + 1, topics(prefix));
    let records = tokio::task::spawn_blocking(move || {
        let topics: Vec<&str> = topics.iter().map(String::as_str).collect();
        consume(&brokers, &topics, want, Duration::from_secs(30))
    })
    .await
    .unwrap();
    assert_exactly_once(&records, &events);
}

//! Exactly-once delivery (`kafka.delivery = "exactly-once"`) on Apache
//! Kafka: the progress record, skipping what it covers, fencing a zombie,
//! and SIGKILLs at random points, all read by `read_committed` consumers.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use outboxd::config::KafkaConfig;
use outboxd::relay::exactly_once::{read_progress, ProgressRecord, PROGRESS_VERSION};
use outboxd::Lsn;
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use serde_json::json;
use uuid::Uuid;

use crate::harness::broker::{broker, consume, consume_uncommitted, Consumed};
use crate::harness::{wait_for, wait_for_showing, TestDb};
use crate::relay::{
    config_text, confirmed_flush, current_lsn, env_usize, expected_order, insert_batch, insert_with_bounds,
    seed, spawn_relay, spawn_relay_with_slot, stop_relay, torture_writers, write_config, Daemon, Event,
};

/// A config in exactly-once mode: topics `<prefix>.<aggregate type>`, the
/// progress in `<prefix>.progress`.
pub(crate) fn eo_config(db_url: &str, slot: &str, brokers: &str, prefix: &str, kafka_extra: &str) -> String {
    eo_config_with(db_url, slot, brokers, prefix, kafka_extra, "")
}

/// As [`eo_config`], with `eo_extra` in `[kafka.exactly_once]`.
pub(crate) fn eo_config_with(
    db_url: &str,
    slot: &str,
    brokers: &str,
    prefix: &str,
    kafka_extra: &str,
    eo_extra: &str,
) -> String {
    config_text(
        db_url,
        slot,
        brokers,
        &format!("topic = \"{prefix}.{{aggregate_type}}\""),
        &format!(
            "delivery = \"exactly-once\"\n{kafka_extra}\n[kafka.exactly_once]\nprogress_topic = \"{prefix}.progress\"\n{eo_extra}\n"
        ),
    )
}

/// One written transaction: its events, its xid, and WAL insert positions
/// read before it began and after it committed.
#[derive(Clone, Debug)]
pub(crate) struct Written {
    pub(crate) events: Vec<Event>,
    pub(crate) xid: String,
    pub(crate) before: Lsn,
    pub(crate) after: Lsn,
}

/// `txns` transactions of `per_txn` events over `aggregates` aggregates.
pub(crate) async fn write_txns(
    client: &tokio_postgres::Client,
    tag: &str,
    txns: usize,
    per_txn: usize,
    aggregates: usize,
) -> Vec<Written> {
    let mut out = Vec::new();
    for t in 0..txns {
        let events: Vec<Event> = (0..per_txn)
            .map(|r| Event {
                id: Uuid::now_v7(),
                aggregate_type: "Order".to_owned(),
                aggregate_id: format!("{tag}-agg-{}", (t * per_txn + r) % aggregates),
                event_type: "eo.v1".to_owned(),
                payload: json!({"tag": tag, "t": t, "r": r}),
                txn: t,
            })
            .collect();
        let (xid, before, after) = insert_with_bounds(client, &events).await;
        out.push(Written {
            events,
            xid,
            before,
            after,
        });
    }
    out
}

/// The start and end of `txn`'s commit record, from the WAL.
pub(crate) async fn commit_record(client: &tokio_postgres::Client, txn: &Written) -> (Lsn, Lsn) {
    client
        .batch_execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        .await
        .unwrap();
    let row = client
        .query_one(
            "SELECT start_lsn::text, end_lsn::text FROM pg_get_wal_records_info($1::text::pg_lsn, $2::text::pg_lsn)
              WHERE resource_manager = 'Transaction' AND record_type LIKE 'COMMIT%' AND xid::text = $3",
            &[&txn.before.to_string(), &txn.after.to_string(), &txn.xid],
        )
        .await
        .unwrap();
    (
        row.get::<_, String>(0).parse().unwrap(),
        row.get::<_, String>(1).parse().unwrap(),
    )
}

/// `txn`'s commit time as a progress record writes it (the test server
/// has `track_commit_timestamp = on`).
pub(crate) async fn commit_time(client: &tokio_postgres::Client, txn: &Written) -> String {
    let at: chrono::DateTime<chrono::Utc> = client
        .query_one("SELECT pg_xact_commit_timestamp($1::text::xid)", &[&txn.xid])
        .await
        .unwrap()
        .get(0);
    at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
}

fn kafka_config(brokers: &str) -> KafkaConfig {
    toml::from_str(&format!("brokers = \"{brokers}\"")).unwrap()
}

/// The progress record for `slot`, read as outboxd reads it.
pub(crate) async fn progress(brokers: &str, topic: &str, slot: &str) -> Option<ProgressRecord> {
    read_progress(&kafka_config(brokers), topic, slot, Duration::from_secs(30))
        .await
        .expect("the progress topic reads")
}

/// This server's system identifier and timeline.
async fn system(client: &tokio_postgres::Client) -> (String, u32) {
    let row = client
        .query_one(
            "SELECT (SELECT system_identifier::text FROM pg_control_system()),
                    (SELECT timeline_id FROM pg_control_checkpoint())",
            &[],
        )
        .await
        .unwrap();
    (row.get(0), row.get::<_, i32>(1) as u32)
}

/// Writes a progress record by hand (an ordinary, non-transactional record,
/// which `read_committed` reads too).
fn put_progress(brokers: &str, topic: &str, record: &ProgressRecord) {
    let producer: BaseProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .unwrap();
    let value = serde_json::to_vec(record).unwrap();
    producer
        .send(BaseRecord::to(topic).key(record.slot.as_str()).payload(&value))
        .map_err(|(e, _)| e)
        .unwrap();
    producer.flush(Duration::from_secs(10)).unwrap();
}

/// Every record of `topic` visible to `read_committed`, read until `want`
/// distinct ids are there; then a further read proves nothing else comes.
async fn committed_ids(brokers: &str, topic: &str, want: usize) -> Vec<Consumed> {
    let (brokers, topic) = (brokers.to_owned(), topic.to_owned());
    wait_for("the events, read_committed", Duration::from_secs(120), || {
        let (brokers, topic) = (brokers.clone(), topic.clone());
        async move {
            let recs = tokio::task::spawn_blocking(move || {
                consume(&brokers, &[&topic], usize::MAX, Duration::from_secs(3))
            })
            .await
            .unwrap();
            let ids: HashSet<&str> = recs.iter().filter_map(|r| r.header("id")).collect();
            (ids.len() >= want).then_some(recs)
        }
    })
    .await
}

fn ids(records: &[Consumed]) -> Vec<Uuid> {
    records
        .iter()
        .map(|r| r.header("id").expect("id header").parse().unwrap())
        .collect()
}

/// Asserts that `records` hold each of `events` exactly once, in
/// per-aggregate order, and nothing else.
pub(crate) fn assert_exactly_once(records: &[Consumed], events: &[Event]) {
    let got = ids(records);
    let unique: HashSet<Uuid> = got.iter().copied().collect();
    let want: HashSet<Uuid> = events.iter().map(|e| e.id).collect();
    assert_eq!(unique, want, "every event, nothing foreign");
    let mut seen = HashSet::new();
    let dups: Vec<&Uuid> = got.iter().filter(|id| !seen.insert(**id)).collect();
    assert!(
        dups.is_empty(),
        "{} duplicates for read_committed, e.g. {:?}",
        dups.len(),
        dups.first()
    );
    let mut order: HashMap<String, Vec<Uuid>> = HashMap::new();
    for r in records {
        order
            .entry(r.key.clone())
            .or_default()
            .push(r.header("id").unwrap().parse().unwrap());
    }
    assert_eq!(order, expected_order(events), "per-aggregate order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_skips_what_the_progress_record_holds_and_confirms_past_it() {
    let db = TestDb::new("eo_skip").await;
    let client = db.client().await;
    let brokers = broker().brokers.clone();
    let (slot, prefix) = ("eo_skip", "eo-skip");
    let (topic, progress_topic) = (format!("{prefix}.order"), format!("{prefix}.progress"));
    let text = eo_config(&db.superuser_url(), slot, &brokers, prefix, "");

    // 1. Streaming: each event once, and the progress record names the
    // commit of the last transaction exactly.
    let (handle, stop) = spawn_relay_with_slot(&client, slot, &text).await;
    let first = write_txns(&client, "a", 50, 4, 7).await;
    let events: Vec<Event> = first.iter().flat_map(|t| t.events.clone()).collect();
    let records = committed_ids(&brokers, &topic, events.len()).await;
    assert_exactly_once(&records, &events);
    let (last_commit, last_end) = commit_record(&client, first.last().unwrap()).await;
    let record = wait_for("the last progress record", Duration::from_secs(30), || async {
        progress(&brokers, &progress_topic, slot)
            .await
            .filter(|r| r.commit_lsn().unwrap() >= last_commit)
    })
    .await;
    assert_eq!(record.commit_lsn().unwrap(), last_commit, "{record:?}");
    assert_eq!(record.end_lsn().unwrap(), last_end);
    assert_eq!(record.version, PROGRESS_VERSION);
    let (system_id, timeline) = system(&client).await;
    assert_eq!(
        (record.system_id.as_str(), record.timeline),
        (system_id.as_str(), timeline)
    );
    stop_relay(handle, stop).await;
    let confirmed = confirmed_flush(&client, slot).await.unwrap();
    assert!(
        confirmed >= last_end,
        "a clean stop confirms the last commit: {confirmed} < {last_end}"
    );

    // 2. A crash between a Kafka commit and the slot's confirmation, made by
    // hand: the progress record says the first 30 of these transactions are
    // in Kafka, the slot does not. They must be skipped, and the rest sent.
    let second = write_txns(&client, "b", 60, 4, 7).await;
    let (covered_commit, covered_end) = commit_record(&client, &second[29]).await;
    put_progress(
        &brokers,
        &progress_topic,
        &ProgressRecord {
            commit_lsn: covered_commit.to_string(),
            end_lsn: covered_end.to_string(),
            commit_time: commit_time(&client, &second[29]).await,
            writer: "by-hand/0".into(),
            ..record.clone()
        },
    );
    let (handle, stop) = spawn_relay(&text);
    let sent: Vec<Event> = second[30..].iter().flat_map(|t| t.events.clone()).collect();
    let all: Vec<Event> = events.iter().chain(sent.iter()).cloned().collect();
    let records = committed_ids(&brokers, &topic, all.len()).await;
    let last_after = second.last().unwrap().after;
    wait_for(
        "the slot past the last transaction",
        Duration::from_secs(30),
        || async { (confirmed_flush(&client, slot).await? >= last_after).then_some(()) },
    )
    .await;
    let records: Vec<Consumed> = {
        // Read again, now that everything is confirmed: nothing more came.
        let (b, t) = (brokers.clone(), topic.clone());
        let again =
            tokio::task::spawn_blocking(move || consume(&b, &[&t], usize::MAX, Duration::from_secs(3)))
                .await
                .unwrap();
        assert_eq!(
            again.len(),
            records.len(),
            "no record arrived after the slot confirmed"
        );
        again
    };
    assert_exactly_once(&records, &all);
    stop_relay(handle, stop).await;

    // 3. A progress record from another PostgreSQL cluster is refused.
    put_progress(
        &brokers,
        &progress_topic,
        &ProgressRecord {
            system_id: "1234567890".into(),
            ..record.clone()
        },
    );
    let (handle, _stop) = spawn_relay(&text);
    let err = tokio::time::timeout(Duration::from_secs(60), handle)
        .await
        .expect("outboxd stops")
        .unwrap()
        .expect_err("a foreign progress record stops outboxd");
    let msg = err.to_string();
    assert!(
        msg.contains("1234567890") && msg.contains("reset the progress"),
        "{msg}"
    );
    assert!(!err.is_transient());
}

/// Every progress record of `topic` visible to `read_committed`, in order
/// (the slot register's records, keyed `slot/…`, share the topic).
fn progress_history(brokers: &str, topic: &str) -> Vec<ProgressRecord> {
    consume(brokers, &[topic], usize::MAX, Duration::from_secs(3))
        .iter()
        .filter(|r| !r.key.starts_with(outboxd::relay::slot_register::KEY_PREFIX))
        .map(|r| ProgressRecord::decode(&r.value).expect("a progress record"))
        .collect()
}

/// Torture: 4 writers, 100,000 events, outboxd SIGKILLed at 20 random
/// points (in the suite; `OUTBOXD_EO_TORTURE_EVENTS` and
/// `OUTBOXD_EO_TORTURE_KILLS` change them). A `read_committed` consumer
/// must see every event exactly once, in per-aggregate order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_survives_sigkills_with_each_event_read_once() {
    const WRITERS: usize = 4;
    const PER_TXN: usize = 10;
    let total = env_usize("OUTBOXD_EO_TORTURE_EVENTS", 100_000);
    let kills = env_usize("OUTBOXD_EO_TORTURE_KILLS", 20);
    let txns_per_writer = total / WRITERS / PER_TXN;
    let db = TestDb::new("eo_torture").await;
    let client = db.client().await;
    let brokers = broker().brokers.clone();
    let dir = tempfile::tempdir().unwrap();
    let (slot, prefix) = ("eo_torture", "eo-torture");
    let cfg = write_config(
        dir.path(),
        "eo.toml",
        &eo_config(&db.superuser_url(), slot, &brokers, prefix, "max_inflight = 2000"),
    );
    let log = dir.path().join("outboxd.log");
    let level = "warn,outboxd::relay=info";
    let mut daemon = Daemon::start_logging(&cfg, &log, level);
    wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(&client, slot).await
    })
    .await;

    let started = std::time::Instant::now();
    let writers = torture_writers(&db, WRITERS, txns_per_writer, PER_TXN).await;
    let mut rng = seed();
    // Each kill lands while the daemon streams: a start takes a while in
    // this mode (init_transactions waits for the broker to abort what the
    // killed one left open), and killing during it would test little.
    let sessions = |log: &std::path::Path| {
        std::fs::read_to_string(log)
            .unwrap_or_default()
            .matches("relay: streaming")
            .count()
    };
    for k in 0..kills {
        wait_for("the daemon to stream", Duration::from_secs(60), || async {
            (sessions(&log) > k).then_some(())
        })
        .await;
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        tokio::time::sleep(Duration::from_millis(50 + rng % 700)).await;
        daemon.kill9();
        daemon.restart_logging(level);
    }
    let mut events = Vec::new();
    for w in writers {
        events.extend(w.await.unwrap());
    }
    let written_in = started.elapsed();
    assert_eq!(events.len(), txns_per_writer * WRITERS * PER_TXN);
    let topic = format!("{prefix}.order");
    let records = committed_ids(&brokers, &topic, events.len()).await;
    let last = current_lsn(&client).await;
    wait_for(
        "the slot to confirm everything",
        Duration::from_secs(60),
        || async { (confirmed_flush(&client, slot).await? >= last).then_some(()) },
    )
    .await;
    let status = daemon.sigterm();
    assert!(status.success(), "SIGTERM exits 0: {status}");
    let (b, t) = (brokers.clone(), topic.clone());
    let records_after =
        tokio::task::spawn_blocking(move || consume(&b, &[&t], usize::MAX, Duration::from_secs(3)))
            .await
            .unwrap();
    assert_eq!(records_after.len(), records.len(), "nothing more arrived");
    assert_exactly_once(&records_after, &events);

    // What the kills hit. read_uncommitted also sees aborted transactions:
    // the records a kill left in an open transaction, sent again after it.
    let (b, t) = (brokers.clone(), topic.clone());
    let uncommitted = tokio::task::spawn_blocking(move || {
        consume_uncommitted(&b, &[&t], usize::MAX, Duration::from_secs(3))
    })
    .await
    .unwrap();
    let text = std::fs::read_to_string(&log).unwrap();
    let ahead = text.matches("skipping them").count();
    eprintln!(
        "exactly-once torture: {WRITERS} writers, {} events written in {written_in:?}, {kills} SIGKILLs; \
         read_committed: {} records, 0 duplicates; read_uncommitted: {} records ({} from aborted transactions); \
         {ahead} of {} restarts found the progress record ahead of the slot (killed between a Kafka commit and its confirmation)",
        events.len(),
        records_after.len(),
        uncommitted.len(),
        uncommitted.len() - records_after.len(),
        kills
    );
    assert!(
        uncommitted.len() > records_after.len(),
        "no kill left an open Kafka transaction behind: the test did not test what it claims"
    );
    assert!(
        ahead > 0,
        "no restart found the progress record ahead of the slot: the skip path was not exercised"
    );
    // The progress history only moves forward.
    let history = progress_history(&brokers, &format!("{prefix}.progress"));
    let lsns: Vec<Lsn> = history.iter().map(|r| r.commit_lsn().unwrap()).collect();
    assert!(
        lsns.windows(2).all(|w| w[0] < w[1]),
        "progress records go forward"
    );
}

/// A zombie: outboxd A freezes (SIGSTOP) inside a Kafka transaction and
/// loses its leader lock; B takes the lock and starts with the same
/// transactional.id, which fences A at the broker. On waking, A goes on as
/// if nothing happened until it finds out, whichever comes first: the
/// broker refuses its commit (fenced), its lease check fails, or its
/// replication connection is gone (B ends the walsender of an outboxd that
/// lost the lock, to take the slot). Either way A must commit nothing
/// more and stop streaming.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_zombie_never_commits_after_its_successor_starts() {
    let db = TestDb::new("eo_fence").await;
    let client = db.client().await;
    let brokers = broker().brokers.clone();
    let dir = tempfile::tempdir().unwrap();
    let (slot, prefix) = ("eo_fence", "eo-fence");
    // Long-lived Kafka transactions, so that A is frozen inside one.
    let text = eo_config_with(
        &db.superuser_url(),
        slot,
        &brokers,
        prefix,
        "",
        "max_wait = \"400ms\"\nmax_events = 100000",
    );
    let cfg = write_config(dir.path(), "eo.toml", &text);
    let level = "warn,outboxd::relay=info";
    let a = Daemon::start_logging(&cfg, &dir.path().join("a.log"), level);
    wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(&client, slot).await
    })
    .await;
    let (stop_writing, mut stopped) = tokio::sync::watch::channel(false);
    let writer = {
        let client = db.client().await;
        tokio::spawn(async move {
            let mut all = Vec::new();
            let mut t = 0;
            while !*stopped.borrow_and_update() {
                let batch: Vec<Event> = (0..5)
                    .map(|r| Event {
                        id: Uuid::now_v7(),
                        aggregate_type: "Order".to_owned(),
                        aggregate_id: format!("agg-{}", (t * 5 + r) % 9),
                        event_type: "fence.v1".to_owned(),
                        payload: json!({"t": t, "r": r}),
                        txn: t,
                    })
                    .collect();
                insert_batch(&client, &batch).await;
                all.extend(batch);
                t += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            all
        })
    };
    let a_writer = format!("{}/{}", hostname(), a.pid());
    let progress_topic = format!("{prefix}.progress");
    let history = |brokers: String, topic: String| async move {
        tokio::task::spawn_blocking(move || progress_history(&brokers, &topic))
            .await
            .unwrap()
    };
    wait_for("A to commit", Duration::from_secs(60), || {
        let (history, a_writer) = (history(brokers.clone(), progress_topic.clone()), a_writer.clone());
        async move { history.await.iter().any(|r| r.writer == a_writer).then_some(()) }
    })
    .await;
    // Into the next Kafka transaction (each lasts max_wait = 400 ms).
    tokio::time::sleep(Duration::from_millis(250)).await;
    a.signal("STOP");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let a_commits = history(brokers.clone(), progress_topic.clone())
        .await
        .iter()
        .filter(|r| r.writer == a_writer)
        .count();
    // A's leader lock goes; B's start fences A's transactional.id, and B
    // ends A's walsender (A holds no lock) to take the slot.
    let terminated: i64 = client
        .query_one(
            "SELECT count(pg_terminate_backend(l.pid)) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
              WHERE l.locktype = 'advisory' AND l.granted AND a.datname = current_database()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(terminated, 1, "A's leader lock session");
    let b = Daemon::start_logging(&cfg, &dir.path().join("b.log"), level);
    let b_writer = format!("{}/{}", hostname(), b.pid());
    let (a_log_path, b_log_path) = (dir.path().join("a.log"), dir.path().join("b.log"));
    wait_for_showing(
        "B to fence A",
        Duration::from_secs(60),
        &[&a_log_path, &b_log_path],
        || async {
            let log = std::fs::read_to_string(dir.path().join("b.log")).unwrap_or_default();
            log.contains("progress record").then_some(())
        },
    )
    .await;
    a.signal("CONT");
    wait_for_showing(
        "B to commit",
        Duration::from_secs(60),
        &[&a_log_path, &b_log_path],
        || {
            let (history, b_writer) = (history(brokers.clone(), progress_topic.clone()), b_writer.clone());
            async move { history.await.iter().any(|r| r.writer == b_writer).then_some(()) }
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop_writing.send(true).unwrap();
    let events = writer.await.unwrap();
    let topic = format!("{prefix}.order");
    committed_ids(&brokers, &topic, events.len()).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (bk, t) = (brokers.clone(), topic.clone());
    let records =
        tokio::task::spawn_blocking(move || consume(&bk, &[&t], usize::MAX, Duration::from_secs(3)))
            .await
            .unwrap();
    assert_exactly_once(&records, &events);

    let after = history(brokers.clone(), progress_topic.clone()).await;
    let a_total = after.iter().filter(|r| r.writer == a_writer).count();
    assert_eq!(a_total, a_commits, "the zombie committed after it was fenced");
    // On waking, A finds out one way or another: the broker refuses its
    // commit (fenced), its leader lock check fails first, or its
    // replication connection is gone (B ended A's walsender, having found
    // A without the lock). Whichever comes first, A committed nothing more
    // (above).
    let a_log = std::fs::read_to_string(&a_log_path).unwrap();
    let b_log = std::fs::read_to_string(&b_log_path).unwrap();
    let fenced = a_log.contains("took over");
    let walsender_ended = b_log.contains("ended the walsender of an outboxd that lost the leader lock")
        && a_log.contains("connection to PostgreSQL lost");
    assert!(
        fenced || a_log.contains("lost the leader lock") || walsender_ended,
        "A stopped streaming; A's log:\n{a_log}\nB's log:\n{b_log}"
    );
    eprintln!(
        "fencing: A {a_writer} froze after {a_commits} commits; B {b_writer} started with the same transactional.id; \
         A woke and {}; it committed nothing more; {} events each read once",
        if fenced {
            "its commit was refused (fenced)"
        } else if walsender_ended {
            "found its walsender ended by B"
        } else {
            "saw its leader lock gone first"
        },
        events.len()
    );
    assert!(b.sigterm().success());
    assert!(a.sigterm().success(), "A (a standby by now) stops cleanly");
}

/// Two outboxd on two slots given the same transactional.id (a
/// misconfiguration): each start fences the other at the broker, so
/// neither commits while the other's producer is current. Each fenced
/// transaction is aborted and replayed: both topics hold every event once.
///
/// The rows are written only once both have initialised their producers
/// (logged "streaming"), so whichever started its producer first meets
/// the other's newer epoch in its first transaction: otherwise A may drain
/// every row before B's start fences it, and the two never collide. A
/// fence shows as "took over" (the producer's fatal error), or, when it
/// races the coordinator's commit, as a failed commit (Kafka 4.4 answers
/// that EndTxn with UNKNOWN_SERVER_ERROR): either ends a session, which is
/// what the test counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_outboxd_sharing_a_transactional_id_fence_each_other_and_lose_nothing() {
    let db = TestDb::new("eo_shared_id").await;
    let client = db.client().await;
    let brokers = broker().brokers.clone();
    let dir = tempfile::tempdir().unwrap();
    let level = "warn,outboxd::relay=info";
    let shared = "transactional_id = \"outboxd.shared-by-mistake\"\nmax_wait = \"50ms\"";
    let mut daemons = Vec::new();
    for name in ["a", "b"] {
        let text = eo_config_with(
            &db.superuser_url(),
            &format!("eo_shared_{name}"),
            &brokers,
            &format!("eo-shared-{name}"),
            "",
            shared,
        );
        let cfg = write_config(dir.path(), &format!("{name}.toml"), &text);
        let daemon = Daemon::start_logging(&cfg, &dir.path().join(format!("{name}.log")), level);
        wait_for("the slot", Duration::from_secs(30), || async {
            confirmed_flush(&client, &format!("eo_shared_{name}")).await
        })
        .await;
        daemons.push(daemon);
    }
    let logs: Vec<std::path::PathBuf> = ["a", "b"]
        .iter()
        .map(|n| dir.path().join(format!("{n}.log")))
        .collect();
    let log_refs: Vec<&std::path::Path> = logs.iter().map(|p| p.as_path()).collect();
    wait_for_showing(
        "both to init their producers",
        Duration::from_secs(60),
        &log_refs,
        || async {
            logs.iter()
                .all(|p| {
                    std::fs::read_to_string(p)
                        .unwrap_or_default()
                        .contains("relay: streaming")
                })
                .then_some(())
        },
    )
    .await;
    let written = write_txns(&client, "s", 300, 5, 11).await;
    let events: Vec<Event> = written.iter().flat_map(|t| t.events.clone()).collect();
    for name in ["a", "b"] {
        let records = committed_ids(&brokers, &format!("eo-shared-{name}.order"), events.len()).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (b, t) = (brokers.clone(), format!("eo-shared-{name}.order"));
        let again =
            tokio::task::spawn_blocking(move || consume(&b, &[&t], usize::MAX, Duration::from_secs(3)))
                .await
                .unwrap();
        assert!(again.len() >= records.len());
        assert_exactly_once(&again, &events);
    }
    // Every session end here is a collision (a takeover, or a commit the
    // coordinator failed): any other cause fails the test.
    let ended: Vec<(usize, usize)> = logs
        .iter()
        .map(|p| {
            let log = std::fs::read_to_string(p).unwrap();
            let ends: Vec<&str> = log.lines().filter(|l| l.contains("session ended")).collect();
            for end in &ends {
                assert!(
                    end.contains("took over") || end.contains("Kafka transaction"),
                    "a session ended for another cause than the collision: {end}"
                );
            }
            (
                ends.iter().filter(|l| l.contains("took over")).count(),
                ends.len(),
            )
        })
        .collect();
    eprintln!(
        "shared transactional.id: sessions ended {} times (a, {} named a takeover) and {} times (b, {}); {} events each read once per slot",
        ended[0].1,
        ended[0].0,
        ended[1].1,
        ended[1].0,
        events.len()
    );
    // Whichever initialised its producers first holds old epochs for both
    // ids (`-0` and `-1`) and fails its first transaction.
    assert!(
        ended[0].1 + ended[1].1 > 0,
        "neither failed a transaction: the two producers did not collide; a's log:\n{}\nb's log:\n{}",
        std::fs::read_to_string(dir.path().join("a.log")).unwrap_or_default(),
        std::fs::read_to_string(dir.path().join("b.log")).unwrap_or_default(),
    );
    for d in daemons {
        assert!(d.sigterm().success());
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap_or_default()
        .trim()
        .to_owned()
}

/// `outboxd <args> --config <config>`: success, and stdout and stderr.
fn outboxd(args: &[&str], config: &std::path::Path) -> (bool, String) {
    let config = config.to_str().expect("a UTF-8 path");
    let (ok, out, err) = crate::operations::outboxd(&[args, &["--config", config]].concat());
    (ok, out + &err)
}

/// `outboxd progress` shows the record, `check` and `status` name it, and
/// `--reset` is refused while outboxd runs; after a clean stop and a
/// reset, the next start publishes from the slot and duplicates nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn progress_command_shows_the_record_and_resets_only_a_stopped_slot() {
    let db = TestDb::new("eo_progress_cli").await;
    let client = db.client().await;
    let brokers = broker().brokers.clone();
    let dir = tempfile::tempdir().unwrap();
    let (slot, prefix) = ("eo_cli", "eo-cli");
    let cfg = write_config(
        dir.path(),
        "eo.toml",
        &eo_config(&db.superuser_url(), slot, &brokers, prefix, ""),
    );
    let daemon = Daemon::start(&cfg, &dir.path().join("outboxd.log"));
    wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(&client, slot).await
    })
    .await;
    let first = write_txns(&client, "p", 10, 3, 4).await;
    let (last_commit, _) = commit_record(&client, first.last().unwrap()).await;
    let progress_topic = format!("{prefix}.progress");
    wait_for("the progress record", Duration::from_secs(30), || async {
        progress(&brokers, &progress_topic, slot)
            .await
            .filter(|r| r.commit_lsn().unwrap() >= last_commit)
    })
    .await;

    let (ok, text) = outboxd(&["progress"], &cfg);
    assert!(
        ok && text.contains(&format!("\"commitLsn\": \"{last_commit}\"")),
        "{text}"
    );
    let (ok, text) = outboxd(&["check"], &cfg);
    assert!(
        ok && text.contains("progress") && text.contains(&last_commit.to_string()),
        "{text}"
    );
    let (ok, text) = outboxd(&["status"], &cfg);
    assert!(
        ok && text.contains("progress") && text.contains(&last_commit.to_string()),
        "{text}"
    );
    let (ok, text) = outboxd(&["progress", "--reset"], &cfg);
    assert!(
        !ok && text.contains("stop outboxd"),
        "refused while running: {text}"
    );

    assert!(daemon.sigterm().success());
    let (ok, text) = outboxd(&["progress", "--reset"], &cfg);
    assert!(ok && text.contains("reset"), "{text}");
    let (ok, text) = outboxd(&["progress"], &cfg);
    assert!(ok && text.contains("no progress record"), "{text}");

    let daemon = Daemon::start(&cfg, &dir.path().join("outboxd.log"));
    let second = write_txns(&client, "q", 5, 3, 4).await;
    let events: Vec<Event> = first
        .iter()
        .chain(second.iter())
        .flat_map(|t| t.events.clone())
        .collect();
    let topic = format!("{prefix}.order");
    committed_ids(&brokers, &topic, events.len()).await;
    let last = second.last().unwrap().after;
    wait_for(
        "the slot past the last transaction",
        Duration::from_secs(30),
        || async { (confirmed_flush(&client, slot).await? >= last).then_some(()) },
    )
    .await;
    let (b, t) = (brokers.clone(), topic.clone());
    let records = tokio::task::spawn_blocking(move || consume(&b, &[&t], usize::MAX, Duration::from_secs(3)))
        .await
        .unwrap();
    assert_exactly_once(&records, &events);
    assert!(daemon.sigterm().success());
}

/// A PostgreSQL transaction larger than every bound (100,000 rows against
/// `max_events = 10000` and `kafka.max_inflight = 2000`) is one Kafka
/// transaction, with one progress record, and memory stays bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_larger_than_the_bounds_is_one_kafka_transaction() {
    const ROWS: usize = 100_000;
    let db = TestDb::new("eo_large").await;
    let client = db.client().await;
    let brokers = broker().brokers.clone();
    let dir = tempfile::tempdir().unwrap();
    let (slot, prefix) = ("eo_large", "eo-large");
    let cfg = write_config(
        dir.path(),
        "eo.toml",
        &eo_config(&db.superuser_url(), slot, &brokers, prefix, "max_inflight = 2000"),
    );
    let daemon = Daemon::start(&cfg, &dir.path().join("outboxd.log"));
    wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(&client, slot).await
    })
    .await;
    client
        .batch_execute(&format!(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload)
             SELECT gen_random_uuid(), 'Order', 'agg-' || (g % 100), 'big.v1',
                    jsonb_build_object('n', g, 'pad', repeat(md5(g::text), 8))
               FROM generate_series(1, {ROWS}) g"
        ))
        .await
        .unwrap();
    let after = current_lsn(&client).await;
    wait_for(
        "the slot past the transaction",
        Duration::from_secs(240),
        || async { (confirmed_flush(&client, slot).await? >= after).then_some(()) },
    )
    .await;
    let rss_kib = std::fs::read_to_string(format!("/proc/{}/status", daemon.pid()))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap();
    let (b, t) = (brokers.clone(), format!("{prefix}.order"));
    let records = tokio::task::spawn_blocking(move || consume(&b, &[&t], usize::MAX, Duration::from_secs(5)))
        .await
        .unwrap();
    let unique: HashSet<&str> = records.iter().filter_map(|r| r.header("id")).collect();
    assert_eq!((records.len(), unique.len()), (ROWS, ROWS), "each row once");
    let history = progress_history(&brokers, &format!("{prefix}.progress"));
    let big: Vec<&ProgressRecord> = history.iter().filter(|r| r.events > 0).collect();
    assert_eq!(big.len(), 1, "one Kafka transaction: {history:?}");
    assert_eq!((big[0].events, big[0].transactions), (ROWS as u64, 1));
    eprintln!(
        "large transaction, exactly-once: {ROWS} rows in one Kafka transaction, peak RSS {} MiB",
        rss_kib / 1024
    );
    assert!(rss_kib < 256 * 1024, "peak RSS {rss_kib} KiB");
    assert!(daemon.sigterm().success());
}

/// One PostgreSQL transaction that takes longer to send than
/// `transaction.timeout.ms`: the broker aborts its Kafka transaction, and
/// outboxd says so (not "another outboxd took over"), and never confirms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_outlasting_the_transaction_timeout_is_named() {
    let db = TestDb::new("eo_txn_timeout").await;
    let client = db.client().await;
    let brokers = broker().brokers.clone();
    let dir = tempfile::tempdir().unwrap();
    let (slot, prefix) = ("eo_timeout", "eo-timeout");
    // One record in flight at a time: 3,000 rows take seconds to send.
    let text = eo_config_with(
        &db.superuser_url(),
        slot,
        &brokers,
        prefix,
        "max_inflight = 1",
        "commit_timeout = \"1s\"",
    ) + "\n[kafka.options]\n\"transaction.timeout.ms\" = \"3000\"\n";
    let cfg = write_config(dir.path(), "eo.toml", &text);
    let log = dir.path().join("outboxd.log");
    let mut daemon = Daemon::start(&cfg, &log);
    wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(&client, slot).await
    })
    .await;
    client
        .batch_execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload)
             SELECT gen_random_uuid(), 'Order', 'agg-' || (g % 10), 'slow.v1', jsonb_build_object('n', g)
               FROM generate_series(1, 3000) g",
        )
        .await
        .unwrap();
    let after = current_lsn(&client).await;
    let text = wait_for(
        "the timeout named in the log",
        Duration::from_secs(120),
        || async {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            text.contains("longer than transaction.timeout.ms")
                .then_some(text)
        },
    )
    .await;
    assert!(text.contains("raise kafka.options"), "{text}");
    let confirmed = confirmed_flush(&client, slot).await.unwrap();
    assert!(
        confirmed < after,
        "the aborted transaction is not confirmed: {confirmed} >= {after}"
    );
    let (b, t) = (brokers.clone(), format!("{prefix}.order"));
    let visible = tokio::task::spawn_blocking(move || consume(&b, &[&t], usize::MAX, Duration::from_secs(2)))
        .await
        .unwrap();
    assert!(
        visible.is_empty(),
        "{} records of an aborted transaction are visible",
        visible.len()
    );
    daemon.kill9();
}

/// A new topic `<prefix>-<uuid>.progress` with three partitions.
async fn new_topic(brokers: &str, prefix: &str) -> String {
    let topic = format!("{prefix}-{}.progress", Uuid::new_v4().simple());
    let (b, t) = (brokers.to_owned(), topic.clone());
    tokio::task::spawn_blocking(move || crate::harness::broker::create_topics_sized(&b, &[t], 1, &[]))
        .await
        .unwrap();
    topic
}

/// The progress topic is shared by every source and every outboxd, and a
/// source killed or frozen between its progress record and its commit
/// leaves a transaction open there until its successor's
/// `init_transactions` or the broker's `transaction.timeout.ms`. A
/// `read_committed` reader that took a partition's end from the last
/// stable offset would stop before that transaction and answer with an
/// older record of its own: every event since then published twice. The
/// reader waits for the transaction instead, and names it when it cannot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_transaction_of_another_source_never_hides_newer_progress() {
    use outboxd::relay::exactly_once::{read_latest, write_plain, Isolation, ProgressError};
    let brokers = broker().brokers.clone();
    let topic = new_topic(&brokers, "eo-open").await;
    let cfg = kafka_config(&brokers);
    let ten = Duration::from_secs(10);
    write_plain(&cfg, &topic, "mine", Some(b"older".to_vec()), ten)
        .await
        .unwrap();
    // Another source's transaction, open in the topic's one partition.
    let other = {
        let (b, t) = (brokers.clone(), topic.clone());
        tokio::task::spawn_blocking(move || {
            let p: BaseProducer = rdkafka::ClientConfig::new()
                .set("bootstrap.servers", &b)
                .set("transactional.id", format!("{t}-other"))
                .create()
                .unwrap();
            p.init_transactions(ten).unwrap();
            p.begin_transaction().unwrap();
            p.send(BaseRecord::to(&t).partition(0).key("other").payload("{}"))
                .map_err(|(e, _)| e)
                .unwrap();
            p.flush(ten).unwrap();
            p
        })
        .await
        .unwrap()
    };
    write_plain(&cfg, &topic, "mine", Some(b"newer".to_vec()), ten)
        .await
        .unwrap();
    let held = read_latest(
        &cfg,
        &topic,
        "mine",
        Isolation::ReadCommitted,
        Duration::from_secs(3),
    )
    .await;
    assert!(
        matches!(held, Err(ProgressError::Timeout { .. })),
        "an open transaction holds the read, never an older answer: {held:?}"
    );
    let commit = tokio::task::spawn_blocking(move || {
        std::thread::sleep(Duration::from_secs(1));
        other.commit_transaction(ten).unwrap();
    });
    let read = read_latest(
        &cfg,
        &topic,
        "mine",
        Isolation::ReadCommitted,
        Duration::from_secs(20),
    )
    .await
    .unwrap();
    commit.await.unwrap();
    assert_eq!(
        read.as_deref(),
        Some(&b"newer"[..]),
        "the newest record, once committed"
    );
}

/// A bootstrap broker that is down is librdkafka's to route around, and
/// it hands the connection error to the reader's `poll` all the same: the
/// read polls on, rather than fail every start whose first connection
/// went to that broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bootstrap_broker_that_is_down_does_not_fail_the_progress_read() {
    use outboxd::relay::exactly_once::{read_latest, write_plain, Isolation};
    let brokers = broker().brokers.clone();
    let topic = new_topic(&brokers, "eo-down").await;
    let ten = Duration::from_secs(10);
    write_plain(
        &kafka_config(&brokers),
        &topic,
        "mine",
        Some(b"kept".to_vec()),
        ten,
    )
    .await
    .unwrap();
    // A port nothing listens on, listed first.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let cfg = kafka_config(&format!("{closed},{brokers}"));
    for read in 0..6 {
        let got = read_latest(
            &cfg,
            &topic,
            "mine",
            Isolation::ReadCommitted,
            Duration::from_secs(20),
        )
        .await;
        assert_eq!(
            got.unwrap_or_else(|e| panic!("read {read}: {e}")).as_deref(),
            Some(&b"kept"[..]),
            "read {read}"
        );
    }
}

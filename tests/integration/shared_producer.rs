//! One producer shared by the at-least-once sources of a process
//! (`outboxd::kafka::clients`): a delivery that fails purges the shared
//! queue, and the other lanes send what came back purged again, in order,
//! without a session restart.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use outboxd::kafka::clients::KafkaClients;
use outboxd::kafka::delivery::{Report, ReportQueue, Ticket};
use outboxd::kafka::records::KafkaRecord;
use outboxd::kafka::sink::{KafkaSink, KafkaSinkError, SendOutcome, SinkKind};
use uuid::Uuid;

use crate::harness::broker::{broker, consume_to_end, create_topics_with, Consumed};
use crate::harness::{wait_for, TestDb};
use crate::relay::{config_text, write_config, Daemon};
use crate::sources::{slot_pid, streaming_pid};

fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as i64
}

/// Every report `queue` gets for `tickets`, within 30 s.
async fn reports(queue: &ReportQueue, tickets: &[Ticket]) -> HashMap<Ticket, Report> {
    let mut got = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while got.len() < tickets.len() {
        let mut batch = std::collections::VecDeque::new();
        queue.take(&mut batch);
        got.extend(batch);
        if got.len() < tickets.len() {
            assert!(
                Instant::now() < deadline,
                "{} of {} reports",
                got.len(),
                tickets.len()
            );
            let _ = tokio::time::timeout(Duration::from_millis(200), queue.arrived()).await;
        }
    }
    got
}

/// A topic that refuses a record timestamped more than a minute ahead.
async fn strict_topic(brokers: &str, topic: &str) {
    let (b, t) = (brokers.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        create_topics_with(&b, &[t], &[("message.timestamp.after.max.ms", "60000")])
    })
    .await
    .unwrap();
}

/// A free local address for outboxd's HTTP listener.
fn free_listen() -> SocketAddr {
    format!("127.0.0.1:{}", crate::harness::postgres::free_port())
        .parse()
        .unwrap()
}

fn send(sink: &mut KafkaSink, rec: &KafkaRecord) -> Result<Ticket, KafkaSinkError> {
    match sink.send_reported(rec)? {
        SendOutcome::Sent(t) => Ok(t),
        SendOutcome::QueueFull => panic!("queue full"),
    }
}

/// The producer level, on the real broker. Lane A's record is refused
/// (a timestamp past its topic's `message.timestamp.after.max.ms`) while
/// lane B's records still linger in the queue: the purge gives B's back
/// unsent, B's next send is refused until B catches up, B sends them again
/// in order and every one is stored once; the producer then goes on for
/// both lanes, on partitions whose queued sequence numbers were purged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_delivery_purges_the_shared_queue_and_the_other_lanes_send_theirs_again() {
    let brokers = broker().brokers.clone();
    let tag = &Uuid::new_v4().simple().to_string()[..8];
    let (strict, plain) = (format!("purge{tag}.strict"), format!("purge{tag}.plain"));
    {
        let (b, s, p) = (brokers.clone(), strict.clone(), plain.clone());
        tokio::task::spawn_blocking(move || {
            create_topics_with(&b, &[s], &[("message.timestamp.after.max.ms", "60000")]);
            create_topics_with(&b, &[p], &[]);
        })
        .await
        .unwrap();
    }
    // Records wait 3 s in the queue before a batch goes.
    let text = config_text(
        "postgres://unused@127.0.0.1/unused",
        "purge",
        &brokers,
        "",
        "[kafka.options]\n\"linger.ms\" = \"3000\"",
    );
    let (config, _) = outboxd::config::Config::from_toml(&text, |_| None).unwrap();
    let clients = KafkaClients::new();
    let kind = SinkKind::default();
    let timeout = Duration::from_secs(10);
    let mut a = clients.sink(&config.kafka, timeout, &kind).unwrap();
    let mut b = clients.sink(&config.kafka, timeout, &kind).unwrap();
    assert!(a.shares_producer() && b.shares_producer());
    assert_eq!(clients.shared_producers(), 1, "one producer for both");
    a.ensure_topic(&strict).await.unwrap();
    b.ensure_topic(&plain).await.unwrap();
    let record = |topic: &str, key: &str, value: String, ts: i64| KafkaRecord {
        topic: topic.to_owned(),
        key: key.as_bytes().to_vec(),
        value: Some(value.into_bytes()),
        headers: vec![("id".into(), Uuid::new_v4().to_string().into_bytes())],
        timestamp_ms: ts,
        partition: None,
    };
    // A's record is ten minutes ahead: the broker refuses its batch.
    let refused = send(&mut a, &record(&strict, "k", "ahead".into(), now_ms() + 600_000)).unwrap();
    tokio::time::sleep(Duration::from_millis(1000)).await;
    // B's records join the queue a second later: they still linger when
    // A's batch is refused.
    let mut b_records = Vec::new();
    let mut b_tickets = Vec::new();
    for i in 0..40 {
        let r = record(&plain, &format!("agg{}", i % 4), format!("{i}"), now_ms());
        b_tickets.push(send(&mut b, &r).unwrap());
        b_records.push(r);
    }
    let a_reports = reports(&a.reports(), &[refused]).await;
    assert!(a_reports[&refused].is_failure(), "{:?}", a_reports[&refused]);
    let b_reports = reports(&b.reports(), &b_tickets).await;
    // Read once the purge is over, as the relay does: its reports may all
    // be in while the purge call still holds the producer (it waits for
    // every broker thread), and a send meanwhile is refused as stale (seen
    // under a loaded suite). The relay reads the generation before it
    // hears the reports (a second purge's reports could otherwise be
    // adopted unheard); with the one purge of this test, reading after is
    // the same.
    let seen = b.quiet_generation().await;
    let purged = b_tickets
        .iter()
        .filter(|t| b_reports[t].was_purged_unsent())
        .count();
    assert_eq!(purged, 40, "every lingering record of B came back purged unsent");
    assert!(seen >= 1, "the producer moved to a new generation");
    // Nothing new from B until it caught up.
    let late = record(&plain, "agg0", "late".into(), now_ms());
    assert!(matches!(b.send_reported(&late), Err(KafkaSinkError::Purged)));
    b.adopt(seen);
    let mut again = Vec::new();
    for r in b_records.iter().chain([&late]) {
        again.push(send(&mut b, r).unwrap());
    }
    let b_reports = reports(&b.reports(), &again).await;
    assert!(
        again
            .iter()
            .all(|t| matches!(b_reports[t], Report::Stored { .. })),
        "every record sent again is stored: {:?}",
        b_reports.values().find(|r| !matches!(r, Report::Stored { .. }))
    );
    // A goes on too, on the same producer, once it caught up.
    assert!(a.is_stale());
    a.adopt(a.quiet_generation().await);
    let fine = send(&mut a, &record(&strict, "k", "now".into(), now_ms())).unwrap();
    assert!(matches!(
        reports(&a.reports(), &[fine]).await[&fine],
        Report::Stored { .. }
    ));
    // What B's topic holds: each record once, each aggregate in order.
    let p = plain.clone();
    let got = tokio::task::spawn_blocking(move || consume_to_end(&brokers, &[&p], Duration::from_secs(30)))
        .await
        .unwrap();
    let mut by_key: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for r in &got {
        by_key
            .entry(r.key.clone())
            .or_default()
            .push(String::from_utf8_lossy(&r.value).into_owned());
    }
    assert_eq!(got.len(), 41, "nothing lost, nothing twice: {by_key:?}");
    for (key, values) in &by_key {
        let mut expected: Vec<String> = (0..40)
            .filter(|i| format!("agg{}", i % 4) == *key)
            .map(|i| i.to_string())
            .collect();
        if key == "agg0" {
            expected.push("late".into());
        }
        assert_eq!(values, &expected, "{key} in order");
    }
}

/// Outbox rows of one source's table: `n` per transaction over aggregates
/// `a0`..`a4`, each carrying its per-aggregate sequence number; `ahead`
/// gives the last row a `created_at` four minutes ahead.
async fn write(
    client: &tokio_postgres::Client,
    table: &str,
    seq: &mut HashMap<String, i64>,
    n: usize,
    ahead: bool,
) {
    let mut sql = String::from("BEGIN;");
    for i in 0..n {
        let agg = format!("a{}", i % 5);
        let s = seq.entry(agg.clone()).or_default();
        *s += 1;
        let created = if ahead && i == n - 1 {
            "now() + interval '4 minutes'"
        } else {
            "clock_timestamp()"
        };
        sql.push_str(&format!(
            "INSERT INTO {table} (id, aggregate_type, aggregate_id, type, payload, created_at) VALUES ('{}', 'order', '{agg}', 'o.v1', '{{\"seq\": {s}}}', {created});",
            Uuid::new_v4()
        ));
    }
    sql.push_str("COMMIT;");
    client.batch_execute(&sql).await.unwrap();
}

/// Each aggregate's sequence numbers in `topic`, each event once (the
/// first copy, as a consumer that deduplicates by id sees them).
async fn first_copies(topic: &str) -> (BTreeMap<String, Vec<i64>>, usize) {
    let t = topic.to_owned();
    let got: Vec<Consumed> = tokio::task::spawn_blocking(move || {
        consume_to_end(&broker().brokers, &[&t], Duration::from_secs(30))
    })
    .await
    .unwrap();
    let mut seen = HashSet::new();
    let mut by_key: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for r in &got {
        if !seen.insert(r.header("id").unwrap().to_owned()) {
            continue;
        }
        let v: serde_json::Value = serde_json::from_slice(&r.value).unwrap();
        by_key
            .entry(r.key.clone())
            .or_default()
            .push(v["data"]["seq"].as_i64().unwrap());
    }
    (by_key, seen.len())
}

/// Waits until `topic` holds every event `seq` counts, each aggregate in
/// order, apart from `missing` (a row dead-lettered instead).
async fn arrive_in_order(topic: &str, seq: &HashMap<String, i64>, missing: &HashSet<(String, i64)>) {
    let want: usize = seq.values().map(|n| *n as usize).sum::<usize>() - missing.len();
    let deadline = Instant::now() + Duration::from_secs(180);
    let (by_key, unique) = loop {
        let (by_key, unique) = first_copies(topic).await;
        if unique >= want {
            break (by_key, unique);
        }
        if Instant::now() > deadline {
            let absent: Vec<(String, i64)> = seq
                .iter()
                .flat_map(|(agg, n)| (1..=*n).map(move |s| (agg.clone(), s)))
                .filter(|e| !missing.contains(e) && !by_key.get(&e.0).is_some_and(|v| v.contains(&e.1)))
                .collect();
            panic!("{topic}: {unique} of {want} events after 180 s; absent: {absent:?}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert_eq!(unique, want, "{topic}: nothing else");
    for (agg, n) in seq {
        let expected: Vec<i64> = (1..=*n)
            .filter(|s| !missing.contains(&(agg.clone(), *s)))
            .collect();
        assert_eq!(
            by_key.get(agg),
            Some(&expected),
            "{topic}: {agg}, every event, in order"
        );
    }
}

/// The value of `name{source="<source>"}` in Prometheus text (0 if absent).
fn sourced(metrics: &str, name: &str, source: &str) -> f64 {
    let series = format!("{name}{{source=\"{source}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&series))
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0)
}

async fn get(addr: SocketAddr, path: &str) -> Option<String> {
    let url = format!("http://{addr}{path}");
    tokio::task::spawn_blocking(move || {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(Duration::from_secs(30)))
            .build()
            .into();
        agent
            .get(&url)
            .call()
            .ok()
            .and_then(|mut r| r.body_mut().read_to_string().ok())
    })
    .await
    .unwrap()
}

/// A source `name` of run `run` on `table`: slot `sp_<name>_<run>`, topics
/// `sp<name><run>.<type>`, dead letters; `extra` at the source's top.
fn source_toml(run: &str, url: &str, name: &str, table: &str, extra: &str) -> String {
    format!(
        r#"
[[sources]]
name = "{name}"
{extra}
[sources.postgres]
url = "{url}"
table = "{table}"
slot = "sp_{name}_{run}"
publication = "sp_{name}_{run}"
status_interval = "100ms"
reconnect_backoff_max = "1s"
[sources.polling]
interval = "50ms"
[sources.routing]
topic = "sp{name}{run}.{{aggregate_type}}"
dead_letter_topic = "sp{name}{run}.dlq"
on_poison = "dead-letter"
"#
    )
}

/// The file: the shared settings (records linger 300 ms in the shared
/// queue), then `sources`.
fn file_text(brokers: &str, listen: SocketAddr, sources: &[String]) -> String {
    format!(
        r#"
[kafka]
brokers = "{brokers}"
topic_partitions = 3
topic_replication_factor = 1
admin_timeout = "5s"
[kafka.options]
"linger.ms" = "300"

[http]
listen = "{listen}"
admin_token = "{token}"

[shutdown]
drain_timeout = "10s"
{}"#,
        sources.concat(),
        token = crate::sources::TOKEN,
    )
}

/// The upper bound of the histogram bucket holding quantile `q` of
/// `source`'s commit-to-ack seconds observed between two scrapes.
fn ack_quantile(before: &str, after: &str, source: &str, q: f64) -> f64 {
    let buckets = |text: &str| -> Vec<(f64, f64)> {
        text.lines()
            .filter(|l| {
                l.starts_with("outboxd_commit_to_ack_seconds_bucket{")
                    && l.contains(&format!("source=\"{source}\""))
            })
            .filter_map(|l| {
                let le = l.split("le=\"").nth(1)?.split('"').next()?;
                let le = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().ok()?
                };
                Some((le, l.rsplit(' ').next()?.parse().ok()?))
            })
            .collect()
    };
    let (b, a) = (buckets(before), buckets(after));
    let delta: Vec<(f64, f64)> = a
        .iter()
        .map(|(le, n)| (*le, n - b.iter().find(|(l, _)| l == le).map_or(0.0, |(_, m)| *m)))
        .collect();
    let total = delta.iter().map(|(_, n)| *n).fold(0.0, f64::max);
    delta
        .iter()
        .filter(|(_, n)| *n >= q * total)
        .map(|(le, _)| *le)
        .fold(f64::INFINITY, f64::min)
}

/// `POST /sources/<name>/restart`: a new relay for the source alone.
async fn restart_source(listen: SocketAddr, name: &str) {
    let path = format!("/sources/{name}/restart");
    let (code, body) = crate::sources::http("POST", listen, &path, Some(crate::sources::TOKEN)).await;
    assert_eq!(code, 200, "{body}");
}

/// Threads of process `pid` whose name is `name`.
fn threads_named(pid: u32, name: &str) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.trim_end() == name)
        .count()
}

/// The real binary with three sources on one producer: `alpha` and `beta`
/// stream (CDC), `gamma` polls. Records linger 300 ms in the shared queue,
/// so the others always have some queued when Kafka refuses alpha's row
/// with a timestamp too far ahead for its topic. Alpha replays and
/// dead-letters that row alone; beta sends its purged records again
/// without a session restart (same walsender, no reconnect); gamma's round
/// ends and the next one sends its rows again. Every event of each source
/// arrives once first, each aggregate in order; one producer serves all
/// three (one librdkafka producer and one admin client in the process).
/// Beta's rows pick their partition (a `partition` placement, always 0,
/// where the key's hash puts four of its five aggregates elsewhere): what beta
/// sends again after a purge goes there too, not where the partitioner
/// would put it (found by review: the record rebuilt from librdkafka's
/// copy had lost its partition).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_in_one_source_costs_the_others_a_resend_in_order() {
    let run = &Uuid::new_v4().simple().to_string()[..6];
    let db = TestDb::new("shared_producer").await;
    let sql = db.client().await;
    sql.batch_execute(
        "CREATE TABLE outbox_b (LIKE outbox INCLUDING ALL); ALTER TABLE outbox_b ADD COLUMN part integer NOT NULL DEFAULT 0; CREATE TABLE outbox_c (LIKE outbox INCLUDING ALL);",
    )
    .await
    .unwrap();
    let prefix = |name: &str| format!("sp{name}{run}");
    let topic = |name: &str| format!("{}.order", prefix(name));
    let brokers = broker().brokers.clone();
    strict_topic(&brokers, &topic("alpha")).await;
    let listen = free_listen();
    let url = db.superuser_url();
    let source = |name: &str, table: &str, extra: &str| source_toml(run, &url, name, table, extra);
    let text = file_text(
        &brokers,
        listen,
        &[
            source("alpha", "outbox", ""),
            source(
                "beta",
                "outbox_b",
                "[sources.columns]\nadditional = [{ column = \"part\", placement = \"partition\" }]",
            ),
            source("gamma", "outbox_c", "mode = \"polling\""),
        ],
    );
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "outboxd.toml", &text);
    let log = dir.path().join("outboxd.log");
    let _log_on_failure = crate::sources::LogOnFailure(log.clone());
    let daemon = Daemon::start_logging(&config, &log, "info");
    wait_for("every source ready", Duration::from_secs(60), || async {
        get(listen, "/readyz").await
    })
    .await;
    let (mut sa, mut sb, mut sc) = (HashMap::new(), HashMap::new(), HashMap::new());
    for _ in 0..5 {
        write(&sql, "outbox", &mut sa, 5, false).await;
        write(&sql, "outbox_b", &mut sb, 5, false).await;
        write(&sql, "outbox_c", &mut sc, 5, false).await;
    }
    arrive_in_order(&topic("beta"), &sb, &HashSet::new()).await;
    let beta_pid = slot_pid(&sql, &format!("sp_beta_{run}")).await;
    assert!(beta_pid.is_some());

    // Beta and gamma write every 20 ms around alpha's refused rows. A
    // refusal purges what the shared producer holds at that moment, and
    // gamma (polling) holds nothing between its rounds: alpha writes a
    // refused row again, 2 s apart, until one refusal has caught beta's and
    // one gamma's records in the queue (four at most).
    let started = Instant::now();
    let mut ahead = HashSet::new();
    let mut last_refusal: Option<Instant> = None;
    let mut caught = false;
    while !caught || started.elapsed() < Duration::from_secs(6) {
        write(&sql, "outbox_b", &mut sb, 5, false).await;
        write(&sql, "outbox_c", &mut sc, 5, false).await;
        let due = last_refusal.map_or(started.elapsed(), |t| t.elapsed()) > Duration::from_secs(2);
        if !caught && due {
            caught = ahead.len() == 4
                || get(listen, "/metrics").await.is_some_and(|m| {
                    ["beta", "gamma"]
                        .iter()
                        .all(|s| sourced(&m, "outboxd_resent_records_total", s) > 0.0)
                });
            if !caught {
                // After its first failure alpha sends on a producer of its
                // own (its later failures cost the others nothing): a
                // restart of alpha alone puts it back on the shared one.
                if last_refusal.is_some() {
                    restart_source(listen, "alpha").await;
                }
                // The row ahead is the fifth in its transaction: aggregate a4.
                write(&sql, "outbox", &mut sa, 5, true).await;
                ahead.insert(("a4".to_owned(), sa["a4"]));
                last_refusal = Some(Instant::now());
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    write(&sql, "outbox", &mut sa, 5, false).await;
    arrive_in_order(&topic("alpha"), &sa, &ahead).await;
    arrive_in_order(&topic("beta"), &sb, &HashSet::new()).await;
    arrive_in_order(&topic("gamma"), &sc, &HashSet::new()).await;
    let beta_topic = topic("beta");
    let beta_records = tokio::task::spawn_blocking(move || {
        consume_to_end(&broker().brokers, &[&beta_topic], Duration::from_secs(30))
    })
    .await
    .unwrap();
    let elsewhere: Vec<(String, i32)> = beta_records
        .iter()
        .filter(|r| r.partition != 0)
        .map(|r| (r.key.clone(), r.partition))
        .collect();
    assert!(!beta_records.is_empty());
    assert!(
        elsewhere.is_empty(),
        "every beta record in the partition its row picked, sent again or not: {} of {} elsewhere: {elsewhere:?}",
        elsewhere.len(),
        beta_records.len()
    );
    let dlq = prefix("alpha") + ".dlq";
    let dead = tokio::task::spawn_blocking(move || {
        consume_to_end(&broker().brokers, &[&dlq], Duration::from_secs(30))
    })
    .await
    .unwrap();
    assert_eq!(
        dead.len(),
        ahead.len(),
        "alpha's rows ahead, each dead-lettered alone"
    );
    assert!(dead
        .iter()
        .all(|d| d.header("dlq.reason") == Some("bad_timestamp")));
    let unpublished: i64 = sql
        .query_one("SELECT count(*) FROM outbox_c WHERE published_at IS NULL", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(unpublished, 0, "gamma marked every row published");

    let metrics = wait_for("the status tick", Duration::from_secs(10), || async {
        get(listen, "/metrics")
            .await
            .filter(|m| sourced(m, "outboxd_events_published_total", "beta") >= 1.0)
    })
    .await;
    let resent = sourced(&metrics, "outboxd_resent_records_total", "beta");
    assert!(resent > 0.0, "the refusal purged beta's queued records: {resent}");
    assert_eq!(
        sourced(&metrics, "outboxd_reconnects_total", "beta"),
        0.0,
        "beta's session went on"
    );
    let rounds_purged = sourced(&metrics, "outboxd_resent_records_total", "gamma");
    assert!(
        rounds_purged > 0.0,
        "the refusal purged gamma's queued rows: {rounds_purged}"
    );
    assert_eq!(
        sourced(&metrics, "outboxd_reconnects_total", "gamma"),
        0.0,
        "gamma's rounds went on without a backoff"
    );
    assert!(sourced(&metrics, "outboxd_reconnects_total", "alpha") >= 1.0);
    assert_eq!(
        slot_pid(&sql, &format!("sp_beta_{run}")).await,
        beta_pid,
        "beta's walsender is the same"
    );
    // One producer and one admin client in the process, once alpha is
    // back on the shared one: after its isolation (a producer of its own,
    // sending one record per batch) it keeps a producer of its own for a
    // minute without a failure, or until it restarts.
    restart_source(listen, "alpha").await;
    let pid = daemon.pid();
    // (The slot register's writes come and go with clients of their own.)
    wait_for(
        "one producer and one admin client",
        Duration::from_secs(30),
        || async {
            let producers = threads_named(pid, "outboxd-produce");
            let clients = threads_named(pid, "rdk:main");
            (producers == 1 && clients == 2).then_some(())
        },
    )
    .await;
    assert!(daemon.sigterm().success());
}

/// The purge follows the failed delivery at once. One aggregate's
/// events, the second of which Kafka refuses (a timestamp too far ahead),
/// sent two records per batch, one request at a time: the batches queued
/// behind the refused one must not land before the replay, or the
/// aggregate's later events would come first. A second source, idle, keeps
/// the shared producer alive across the failing session (a producer of its
/// own would be dropped, which purges it). The purge once waited for the
/// poller's one-second window, and dozens of later events came first.
///
/// A few batches may still pass: librdkafka's broker thread sends the next
/// batch of the partition the moment the refusal comes back, and goes on
/// until the purge reaches the queue, while the delivery report travels to
/// the poller thread and wakes the purger. On an idle machine that is one
/// batch (3, 4 before 1), as with the earlier build's producer per source
/// dropped after the failure; on a loaded one, a round trip to a local
/// broker is as quick as a thread's wake-up and two or three batches pass
/// (CI saw 3, 4, 5, 6 before 1). The bound below, six batches, is far
/// from the 38 a purger that waits for the poller lets through;
/// docs/guarantees.md names the window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_failing_sources_queued_records_never_pass_its_replay() {
    let run = &Uuid::new_v4().simple().to_string()[..6];
    let db = TestDb::new("purge_at_once").await;
    let sql = db.client().await;
    sql.batch_execute("CREATE TABLE outbox_idle (LIKE outbox INCLUDING ALL)")
        .await
        .unwrap();
    let brokers = broker().brokers.clone();
    let topic = format!("pa{run}.order");
    strict_topic(&brokers, &topic).await;
    let listen = free_listen();
    let url = db.superuser_url();
    let source = |name: &str, table: &str| {
        format!(
            r#"
[[sources]]
name = "{name}"
[sources.postgres]
url = "{url}"
table = "{table}"
slot = "pa_{name}_{run}"
publication = "pa_{name}_{run}"
status_interval = "100ms"
reconnect_backoff_max = "1s"
[sources.routing]
topic = "pa{run}.{{aggregate_type}}"
dead_letter_topic = "pa{run}.{name}.dlq"
on_poison = "dead-letter"
"#
        )
    };
    let text = format!(
        r#"
[kafka]
brokers = "{brokers}"
topic_partitions = 3
topic_replication_factor = 1
admin_timeout = "5s"
[kafka.options]
"batch.num.messages" = "2"
"max.in.flight.requests.per.connection" = "1"

[http]
listen = "{listen}"
{}{}"#,
        source("alpha", "outbox"),
        source("idle", "outbox_idle"),
    );
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "outboxd.toml", &text);
    let log = dir.path().join("outboxd.log");
    let _log_on_failure = crate::sources::LogOnFailure(log.clone());
    let daemon = Daemon::start_logging(&config, &log, "info");
    wait_for("every source ready", Duration::from_secs(60), || async {
        get(listen, "/readyz").await
    })
    .await;
    let row = |seq: i64, created: &str| {
        format!(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload, created_at) VALUES ('{}', 'order', 'x', 'o.v1', '{{\"seq\": {seq}}}', {created});",
            Uuid::new_v4()
        )
    };
    sql.batch_execute(&row(1, "clock_timestamp()")).await.unwrap();
    let mut txn = String::from("BEGIN;");
    txn.push_str(&row(2, "now() + interval '4 minutes'"));
    for seq in 3..=40 {
        txn.push_str(&row(seq, "clock_timestamp()"));
    }
    txn.push_str("COMMIT;");
    sql.batch_execute(&txn).await.unwrap();
    let got = wait_for("every event of x", Duration::from_secs(90), || async {
        let (by_key, unique) = first_copies(&topic).await;
        (unique >= 39).then_some(by_key)
    })
    .await;
    let x = &got["x"];
    let mut all = x.clone();
    all.sort_unstable();
    let expected: Vec<i64> = std::iter::once(1).chain(3..=40).collect();
    assert_eq!(
        all, expected,
        "every event once, the refused one dead-lettered: {x:?}"
    );
    // Events stored ahead of an earlier one: the batches librdkafka sent
    // behind the refused one before the purge took the queue (the
    // at-least-once window of a refusal outboxd could not predict,
    // docs/parked.md "Limits of this version"). Bounded by what was in
    // flight; every other event in order.
    let early: Vec<i64> = x
        .iter()
        .enumerate()
        .filter(|(i, s)| x[i + 1..].iter().any(|later| later < s))
        .map(|(_, s)| *s)
        .collect();
    eprintln!(
        "{} events stored ahead of an earlier one: {early:?} in {x:?}",
        early.len()
    );
    assert!(early.len() <= 12, "{early:?} stored ahead: {x:?}");
    let rest: Vec<i64> = x.iter().copied().filter(|s| !early.contains(s)).collect();
    let mut sorted = rest.clone();
    sorted.sort_unstable();
    assert_eq!(rest, sorted, "the rest in order: {x:?}");
    assert!(daemon.sigterm().success());
}

/// A source whose deliveries keep failing restarts again and again: here
/// Kafka refuses one of its rows every 5 s (a timestamp too far ahead for
/// its topic), each dead-lettered after its session ends. Only its first
/// failure, on the shared producer, may purge the other sources' queues;
/// its sessions after it send on a producer of their own until a minute
/// has passed without a failure, so its neighbour sends nothing again
/// however long the fault lasts, and every event still arrives in order.
/// (A topic whose partitions have no leader fails the same way, every
/// `message.timeout.ms`; on one broker it cannot be made.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_that_keeps_failing_costs_its_neighbours_one_purge() {
    let run = &Uuid::new_v4().simple().to_string()[..6];
    let db = TestDb::new("shared_failing").await;
    let sql = db.client().await;
    sql.batch_execute("CREATE TABLE outbox_b (LIKE outbox INCLUDING ALL);")
        .await
        .unwrap();
    let topic = |name: &str| format!("sp{name}{run}.order");
    let brokers = broker().brokers.clone();
    strict_topic(&brokers, &topic("alpha")).await;
    let listen = free_listen();
    let url = db.superuser_url();
    let text = file_text(
        &brokers,
        listen,
        &[
            source_toml(run, &url, "alpha", "outbox", ""),
            source_toml(run, &url, "beta", "outbox_b", ""),
        ],
    );
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "outboxd.toml", &text);
    let log = dir.path().join("outboxd.log");
    let _log_on_failure = crate::sources::LogOnFailure(log.clone());
    let daemon = Daemon::start_logging(&config, &log, "info");
    for name in ["alpha", "beta"] {
        wait_for(&format!("{name} streaming"), Duration::from_secs(60), || async {
            streaming_pid(&sql, &format!("sp_{name}_{run}")).await
        })
        .await;
    }
    let (mut sa, mut sb) = (HashMap::new(), HashMap::new());
    let mut ahead = HashSet::new();
    // Beta writes every 20 ms; alpha a refused row every 5 s, for 30 s
    // (OUTBOXD_NEIGHBOUR_FAULT_SECS; with OUTBOXD_NEIGHBOUR_NO_FAULT=1 alpha's
    // rows are all good: the reference run of BENCHMARKS.md's figure).
    let secs: u64 = std::env::var("OUTBOXD_NEIGHBOUR_FAULT_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let fault = std::env::var("OUTBOXD_NEIGHBOUR_NO_FAULT").is_err();
    let started = Instant::now();
    let mut at_10s = None;
    let mut last_refusal: Option<Instant> = None;
    while started.elapsed() < Duration::from_secs(secs) {
        write(&sql, "outbox_b", &mut sb, 5, false).await;
        if last_refusal.is_none_or(|t| t.elapsed() > Duration::from_secs(5)) {
            write(&sql, "outbox", &mut sa, 5, false).await;
            write(&sql, "outbox", &mut sa, 5, fault).await;
            if fault {
                ahead.insert(("a4".to_owned(), sa["a4"]));
            }
            last_refusal = Some(Instant::now());
        }
        if at_10s.is_none() && started.elapsed() > Duration::from_secs(10) {
            at_10s = get(listen, "/metrics").await;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("alpha: refused rows written {ahead:?}, per aggregate {sa:?}");
    let at_10s = at_10s.unwrap();
    let resent_at_10s = sourced(&at_10s, "outboxd_resent_records_total", "beta");
    arrive_in_order(&topic("alpha"), &sa, &ahead).await;
    arrive_in_order(&topic("beta"), &sb, &HashSet::new()).await;
    let m = get(listen, "/metrics").await.unwrap();
    let failures = sourced(&m, "outboxd_reconnects_total", "alpha");
    let resent = sourced(&m, "outboxd_resent_records_total", "beta");
    let (p50, p99) = (
        ack_quantile(&at_10s, &m, "beta", 0.5),
        ack_quantile(&at_10s, &m, "beta", 0.99),
    );
    eprintln!(
        "neighbour figure: fault={fault} {secs} s: alpha restarts {failures}, beta resent {resent} ({} after 10 s), beta commit->ack p50 <= {p50} s, p99 <= {p99} s (after 10 s)",
        resent - resent_at_10s
    );
    if !fault {
        assert!(daemon.sigterm().success());
        return;
    }
    assert!(failures >= 4.0, "alpha kept failing: {failures} restarts");
    assert_eq!(
        resent, resent_at_10s,
        "beta sent nothing again from 10 s on while alpha failed {failures} times"
    );
    assert_eq!(sourced(&m, "outboxd_reconnects_total", "beta"), 0.0);
    // A minute without a failure: alpha is back on the shared producer.
    let pid = daemon.pid();
    write(&sql, "outbox", &mut sa, 5, false).await;
    wait_for("one producer again", Duration::from_secs(120), || async {
        (threads_named(pid, "outboxd-produce") == 1).then_some(())
    })
    .await;
    write(&sql, "outbox", &mut sa, 5, false).await;
    arrive_in_order(&topic("alpha"), &sa, &ahead).await;
    assert!(daemon.sigterm().success());
}

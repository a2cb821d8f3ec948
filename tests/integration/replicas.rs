//! Sources spread over replicas (`[coordination]`), with the real binary:
//! three replicas of one file of twelve sources (six at-least-once, six
//! exactly-once) on one PostgreSQL and Apache Kafka, writers running
//! throughout. The group spreads the sources 4/4/4; a SIGKILLed replica's
//! sources are led again by the others; a replica that joins takes a share
//! and only the moved sources restart; a SIGSTOPped replica's sources move,
//! and it rejoins when it wakes. Nothing is lost, each aggregate keeps its
//! order, and the exactly-once topics hold each event once.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::harness::broker::{broker, consume};
use crate::harness::postgres::free_port;
use crate::harness::TestDb;
use crate::relay::{write_config, Daemon};
use crate::sources::{arrive_in_order, http, sequences, streaming_pid, write};

const SOURCES: usize = 12;
const SESSION: Duration = Duration::from_secs(6);
const LEASE: Duration = Duration::from_secs(4);

fn name(i: usize) -> String {
    format!("s{i:02}")
}

fn exactly_once(i: usize) -> bool {
    i % 2 == 1
}

struct Replica {
    listen: SocketAddr,
    config: PathBuf,
    log: PathBuf,
    daemon: Option<Daemon>,
}

/// A replica's file: the first `sources` of the twelve sources, with or
/// without `[coordination]`.
fn file(
    run: &str,
    url: &str,
    listen: SocketAddr,
    replica: &str,
    sources: usize,
    coordination: bool,
) -> String {
    let mut text = format!(
        r#"
[kafka]
brokers = "{brokers}"
topic_partitions = 3
topic_replication_factor = 1
admin_timeout = "5s"
progress_topic = "rp{run}.progress"

[http]
listen = "{listen}"

[health]
poll_interval = "300ms"

[shutdown]
drain_timeout = "10s"
"#,
        brokers = broker().brokers,
    );
    if coordination {
        text.push_str(&format!(
            "\n[coordination]\ngroup = \"rp{run}\"\nreplica = \"{replica}\"\nsession_timeout = \"{}s\"\nheartbeat_interval = \"1s\"\n",
            SESSION.as_secs()
        ));
    }
    for i in 0..sources {
        let delivery = if exactly_once(i) {
            "[sources.kafka]\ndelivery = \"exactly-once\"\n"
        } else {
            ""
        };
        text.push_str(&format!(
            r#"
[[sources]]
name = "{name}"
[sources.postgres]
url = "{url}"
table = "ob{i}"
slot = "rp{run}_{name}"
publication = "rp{run}_{name}"
status_interval = "100ms"
reconnect_backoff_max = "1s"
leader_timeout = "{lease}s"
[sources.routing]
topic = "rp{run}{name}.{{aggregate_type}}"
{delivery}"#,
            name = name(i),
            lease = LEASE.as_secs(),
        ));
    }
    text
}

/// Which sources each live replica leads (streams, not standing by), and
/// its assignment, from its `/status`.
async fn leaders(replicas: &[Replica]) -> Vec<Option<(Vec<String>, Vec<String>)>> {
    let mut out = Vec::new();
    for r in replicas {
        if r.daemon.is_none() {
            out.push(None);
            continue;
        }
        let (code, body) = http("GET", r.listen, "/status", None).await;
        if code != 200 {
            out.push(None);
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        let leading = v["sources"]
            .as_object()
            .unwrap()
            .iter()
            .filter(|(_, s)| s["state"] == "running" && s["streaming"] == true)
            .map(|(n, _)| n.clone())
            .collect();
        let assigned = v["coordination"]["assigned"]
            .as_array()
            .map(|a| a.iter().map(|n| n.as_str().unwrap().to_owned()).collect())
            .unwrap_or_default();
        out.push(Some((leading, assigned)));
    }
    out
}

/// Waits until every source is led by exactly one of the replicas in
/// `live`, each leading `SOURCES / live.len()` ± 1, and every slot streams;
/// the leader of each source and its walsender.
async fn balanced(
    replicas: &[Replica],
    live: &[usize],
    sql: &tokio_postgres::Client,
    run: &str,
    within: Duration,
) -> BTreeMap<String, (usize, i32)> {
    balanced_n(replicas, live, sql, run, SOURCES, within).await
}

/// [`balanced`] over the first `sources` sources.
async fn balanced_n(
    replicas: &[Replica],
    live: &[usize],
    sql: &tokio_postgres::Client,
    run: &str,
    sources: usize,
    within: Duration,
) -> BTreeMap<String, (usize, i32)> {
    let share = sources / live.len();
    let deadline = Instant::now() + within;
    loop {
        let seen = leaders(replicas).await;
        let mut led: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        let mut counts = Vec::new();
        for &r in live {
            let leading = seen[r].as_ref().map(|(l, _)| l.clone()).unwrap_or_default();
            counts.push(leading.len());
            for n in leading {
                led.entry(n).or_default().push(r);
            }
        }
        let mut pids = BTreeMap::new();
        for i in 0..sources {
            if let (Some([r]), Some(pid)) = (
                led.get(&name(i)).map(Vec::as_slice),
                streaming_pid(sql, &format!("rp{run}_{}", name(i))).await,
            ) {
                pids.insert(name(i), (*r, pid));
            }
        }
        let even = counts.iter().all(|c| c.abs_diff(share) <= 1);
        if pids.len() == sources && even {
            return pids;
        }
        assert!(
            Instant::now() < deadline,
            "not spread within {within:?}: leading per replica {counts:?}; led once and streaming: {}",
            pids.len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A database with the outbox tables `ob0`.. of `sources` sources, a run
/// id, and `count` replicas of their file (not started).
struct Setup {
    db: TestDb,
    sql: tokio_postgres::Client,
    run: String,
    dir: tempfile::TempDir,
    replicas: Vec<Replica>,
}

async fn setup(name: &str, sources: usize, count: usize) -> Setup {
    let db = TestDb::new(name).await;
    let sql = db.client().await;
    let run = format!("{:08x}", rand_suffix());
    let mut ddl = String::new();
    for i in 0..sources {
        ddl.push_str(&format!("CREATE TABLE ob{i} (LIKE outbox INCLUDING ALL);"));
    }
    sql.batch_execute(&ddl).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let url = db.superuser_url();
    let replicas = (0..count)
        .map(|r| {
            let listen: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
            let text = file(&run, &url, listen, &format!("replica-{r}"), sources, true);
            Replica {
                listen,
                config: write_config(dir.path(), &format!("r{r}.toml"), &text),
                log: dir.path().join(format!("r{r}.log")),
                daemon: None,
            }
        })
        .collect();
    Setup {
        db,
        sql,
        run,
        dir,
        replicas,
    }
}

/// Three replicas, twelve sources, writers throughout: spread, SIGKILL,
/// a replica added, SIGSTOP; nothing lost, order kept in both modes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twelve_sources_spread_over_three_replicas_and_move_when_one_fails() {
    let Setup {
        db,
        sql,
        run,
        dir: _dir,
        mut replicas,
    } = setup("replicas", SOURCES, 3).await;
    let _logs = start_all(&mut replicas);

    // (a) Spread 4/4/4.
    let started = Instant::now();
    let before = balanced(&replicas, &[0, 1, 2], &sql, &run, Duration::from_secs(60)).await;
    eprintln!(
        "spread over three replicas after {:?}; sources started per replica {:?}",
        started.elapsed(),
        starts(&replicas)
    );
    // Each source started once: the first assignment waits for the group
    // to settle, so no source is started and moved in the first moments.
    assert_eq!(
        starts(&replicas).iter().sum::<usize>(),
        SOURCES,
        "each source started once"
    );

    // Writers, once every slot exists (a slot decodes only what commits
    // after it was made): every table, one transaction of 3 events a round.
    let writers = Writers::start(&db, SOURCES).await;

    // (b) SIGKILL replica 2: its sources are led by 0 and 1.
    replicas[2].daemon.as_mut().unwrap().kill9();
    replicas[2].daemon = None;
    let killed = Instant::now();
    let after_kill = balanced(
        &replicas,
        &[0, 1],
        &sql,
        &run,
        SESSION + LEASE + Duration::from_secs(20),
    )
    .await;
    let took = killed.elapsed();
    eprintln!(
        "a SIGKILLed replica's sources led again after {took:?} (session {SESSION:?}, lease {LEASE:?})"
    );
    assert!(
        took < SESSION + LEASE + Duration::from_secs(10),
        "takeover took {took:?}"
    );
    for (n, (r, _)) in &before {
        if *r != 2 {
            assert_eq!(after_kill[n].0, *r, "{n} stays with its replica");
        }
    }

    // (c) A replica joins: it takes a share, and only moved sources restart.
    replicas[2].daemon = Some(Daemon::start_logging(
        &replicas[2].config,
        &replicas[2].log,
        "info",
    ));
    let joined = Instant::now();
    let after_join = balanced(&replicas, &[0, 1, 2], &sql, &run, Duration::from_secs(60)).await;
    eprintln!("a joining replica took its share after {:?}", joined.elapsed());
    let mut moved = 0;
    for (n, (r, pid)) in &after_join {
        let (was, old_pid) = after_kill[n];
        if was == *r {
            assert_eq!(*pid, old_pid, "{n} did not move, so its walsender is the same");
        } else {
            moved += 1;
        }
    }
    assert!(
        (3..=5).contains(&moved),
        "moved {moved} sources to the new replica"
    );

    // (d) SIGSTOP replica 1: its sources move; it rejoins when it wakes.
    replicas[1].daemon.as_ref().unwrap().signal("STOP");
    let frozen = Instant::now();
    let stopped = std::mem::take(&mut replicas[1].daemon);
    let after_stop = balanced(
        &replicas,
        &[0, 2],
        &sql,
        &run,
        SESSION + LEASE + Duration::from_secs(20),
    )
    .await;
    eprintln!(
        "a SIGSTOPped replica's sources led again after {:?}",
        frozen.elapsed()
    );
    for (n, (r, _)) in &after_join {
        if *r != 1 {
            assert_eq!(after_stop[n].0, *r, "{n} stays with its replica");
        }
    }
    replicas[1].daemon = stopped;
    replicas[1].daemon.as_ref().unwrap().signal("CONT");
    let _ = balanced(&replicas, &[0, 1, 2], &sql, &run, Duration::from_secs(60)).await;
    eprintln!("the woken replica took a share again");

    // Everything written arrives, each aggregate in order; the
    // exactly-once topics hold each event once.
    all_arrive(&broker().brokers, &run, &writers.stop().await).await;
    for r in &mut replicas {
        if let Some(d) = r.daemon.take() {
            assert!(d.sigterm().success());
        }
    }
}

/// How many sources each replica's log says it started.
fn starts(replicas: &[Replica]) -> Vec<usize> {
    replicas
        .iter()
        .map(|r| {
            std::fs::read_to_string(&r.log)
                .unwrap_or_default()
                .matches("source starting")
                .count()
        })
        .collect()
}

fn rand_suffix() -> u32 {
    uuid::Uuid::new_v4().as_u128() as u32
}

/// Starts every replica (logging at info); their logs are printed if the
/// test fails.
fn start_all(replicas: &mut [Replica]) -> LogsOnFailure {
    for r in replicas.iter_mut() {
        r.daemon = Some(Daemon::start_logging(&r.config, &r.log, "info"));
    }
    LogsOnFailure(replicas.iter().map(|r| r.log.clone()).collect())
}

/// Writers on every table `ob0`.., one transaction of 3 events a round,
/// each event carrying its aggregate's sequence number.
struct Writers {
    seqs: Arc<Mutex<Vec<HashMap<String, i64>>>>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Writers {
    async fn start(db: &TestDb, tables: usize) -> Writers {
        let seqs = Arc::new(Mutex::new(vec![HashMap::new(); tables]));
        let stop = Arc::new(AtomicBool::new(false));
        let task = {
            let (seqs, stop, client) = (seqs.clone(), stop.clone(), db.client().await);
            tokio::spawn(async move {
                while !stop.load(Ordering::SeqCst) {
                    for i in 0..tables {
                        let mut seq = seqs.lock().unwrap()[i].clone();
                        write(&client, &format!("ob{i}"), &mut seq, 3).await;
                        seqs.lock().unwrap()[i] = seq;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
        };
        Writers { seqs, stop, task }
    }

    /// Stops writing; what each table was given.
    async fn stop(self) -> Vec<HashMap<String, i64>> {
        self.stop.store(true, Ordering::SeqCst);
        self.task.await.unwrap();
        let seqs = self.seqs.lock().unwrap().clone();
        seqs
    }
}

/// Everything written arrives, each aggregate in order; the exactly-once
/// topics hold each event once.
async fn all_arrive(brokers: &str, run: &str, seqs: &[HashMap<String, i64>]) {
    for (i, seq) in seqs.iter().enumerate() {
        let topic = format!("rp{run}{}.order", name(i));
        let total = arrive_in_order(
            brokers,
            &topic,
            seq,
            Duration::from_secs(60),
            exactly_once(i),
            &name(i),
        )
        .await;
        let want: usize = seq.values().map(|n| *n as usize).sum();
        eprintln!("{}: {want} events, {} duplicates", name(i), total - want);
    }
}

/// Kafka hangs past the group's session timeout (the broker SIGSTOPped):
/// every replica loses its place in the group. Its relays stream on under
/// their leases (losing the group stops no source), and when Kafka is back
/// the group assigns again, each source moving at most once. Writers run
/// throughout: nothing lost, each aggregate in order, the exactly-once
/// topics hold each event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_lost_with_kafka_stops_no_source_and_moves_each_at_most_once() {
    const N: usize = 4;
    let own = crate::harness::broker::dedicated();
    let Setup {
        db,
        sql,
        run,
        dir: _dir,
        mut replicas,
    } = setup("replicas_lost", N, 2).await;
    for r in &replicas {
        let text = std::fs::read_to_string(&r.config)
            .unwrap()
            .replace(&broker().brokers, &own.brokers);
        std::fs::write(&r.config, text).unwrap();
    }
    let _logs = start_all(&mut replicas);
    let before = balanced_n(&replicas, &[0, 1], &sql, &run, N, Duration::from_secs(60)).await;
    let writers = Writers::start(&db, N).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    own.signal("STOP");
    tokio::time::sleep(SESSION + Duration::from_secs(4)).await;
    // Out of the group, each replica keeps its sources (their sessions
    // restart while Kafka does not answer, on the same replica).
    for (r, replica) in replicas.iter().enumerate() {
        let v = status(replica.listen).await;
        for (n, (owner, _)) in &before {
            if *owner == r {
                assert_eq!(
                    v["sources"][n]["state"], "running",
                    "{n} stays on replica {r}: {v}"
                );
            }
        }
    }
    own.signal("CONT");
    let back = Instant::now();
    // Who leads each source while the group assigns again: the owner
    // before, and at most one more.
    let mut owners: BTreeMap<String, Vec<usize>> =
        before.iter().map(|(n, (r, _))| (n.clone(), vec![*r])).collect();
    let deadline = back + Duration::from_secs(60);
    loop {
        let seen = leaders(&replicas).await;
        let mut members = true;
        for (r, part) in seen.iter().enumerate() {
            let Some((leading, _)) = part else {
                members = false;
                continue;
            };
            for n in leading {
                let o = owners.entry(n.clone()).or_default();
                if o.last() != Some(&r) {
                    o.push(r);
                }
            }
            members &= status(replicas[r].listen).await["coordination"]["classes"][0]["member"] == true;
        }
        if members && back.elapsed() > SESSION * 2 {
            break;
        }
        assert!(Instant::now() < deadline, "the replicas did not rejoin");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let _ = balanced_n(&replicas, &[0, 1], &sql, &run, N, Duration::from_secs(60)).await;
    eprintln!("leaders of each source across the outage and the rejoin: {owners:?}");
    for (n, o) in &owners {
        assert!(o.len() <= 2, "{n} moved more than once: {o:?}");
    }
    all_arrive(&own.brokers, &run, &writers.stop().await).await;
    for r in &mut replicas {
        if let Some(d) = r.daemon.take() {
            assert!(d.sigterm().success());
        }
    }
}

/// Prints the replicas' logs when the test fails (always with
/// `OUTBOXD_TEST_SHOW_LOGS` set).
struct LogsOnFailure(Vec<PathBuf>);

impl Drop for LogsOnFailure {
    fn drop(&mut self) {
        if std::thread::panicking() || std::env::var_os("OUTBOXD_TEST_SHOW_LOGS").is_some() {
            for log in &self.0 {
                let text = std::fs::read_to_string(log).unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                let keep = if std::thread::panicking() { 80 } else { 400 };
                eprintln!("--- {} (last {keep} lines) ---", log.display());
                for l in &lines[lines.len().saturating_sub(keep)..] {
                    eprintln!("{l}");
                }
            }
        }
    }
}

/// A replica that cannot reach the group's broker is not a healthy member:
/// `/readyz` says so (a replica that leads nothing because the others lead
/// every source is ready), and no source starts on it meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_cannot_reach_its_group_is_not_ready_and_starts_nothing() {
    let db = TestDb::new("replicas_nokafka").await;
    let sql = db.client().await;
    let dir = tempfile::tempdir().unwrap();
    let listen: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let closed = free_port();
    let text = two_sources(
        &db,
        &sql,
        "nokafka",
        format!(
            "[kafka]\nbrokers = \"127.0.0.1:{closed}\"\n[http]\nlisten = \"{listen}\"\n[coordination]\ngroup = \"nokafka\"\nsession_timeout = \"6s\"\n"
        ),
    )
    .await;
    let config = write_config(dir.path(), "n.toml", &text);
    let log = dir.path().join("n.log");
    let _logs = LogsOnFailure(vec![log.clone()]);
    let daemon = Daemon::start_logging(&config, &log, "info");
    let deadline = Instant::now() + Duration::from_secs(30);
    let body = loop {
        let (code, body) = http("GET", listen, "/readyz", None).await;
        if code == 503 && body.contains("not a member of the replicas' group nokafka") {
            break body;
        }
        assert!(Instant::now() < deadline, "/readyz: {code} {body}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    eprintln!("{body}");
    let (_, status) = http("GET", listen, "/status", None).await;
    let v: serde_json::Value = serde_json::from_str(&status).unwrap();
    for i in 0..2 {
        assert_eq!(v["sources"][format!("s{i}")]["state"], "unassigned", "{status}");
    }
    let slots: i64 = sql
        .query_one(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE 'nokafka_%'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(slots, 0, "no source started");
    assert!(daemon.sigterm().success());
}

/// Deletes `topic` (an operator cleaning up coordination topics).
async fn delete_topic(topic: String) {
    use rdkafka::admin::{AdminClient, AdminOptions};
    use rdkafka::client::DefaultClientContext;
    use rdkafka::config::ClientConfig;
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &broker().brokers)
        .create()
        .unwrap();
    for r in admin
        .delete_topics(&[&topic], &AdminOptions::new())
        .await
        .unwrap()
    {
        r.unwrap();
    }
}

/// `/status` of the replica at `listen`.
async fn status(listen: SocketAddr) -> serde_json::Value {
    let (code, body) = http("GET", listen, "/status", None).await;
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// Two replicas of four sources. The live coordination topic deleted: it
/// is made again and the group assigns every source anew, none stopping
/// meanwhile. Then one replica's file drops `[coordination]`: a reload
/// there takes every source (also those the group had given the other),
/// and when the other dies, it leads all four. Events written at the end
/// all arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_group_topic_comes_back_and_a_reload_without_coordination_takes_every_source() {
    const N: usize = 4;
    let Setup {
        db,
        sql,
        run,
        dir: _dir,
        mut replicas,
    } = setup("replicas_reload", N, 2).await;
    let _logs = start_all(&mut replicas);
    let led = |m: &BTreeMap<String, (usize, i32)>| m.len();
    let spread = balanced_n(&replicas, &[0, 1], &sql, &run, N, Duration::from_secs(60)).await;
    assert_eq!(led(&spread), N);

    // The live topic deleted: made again, every source assigned anew.
    let topic = status(replicas[0].listen).await["coordination"]["classes"][0]["topic"]
        .as_str()
        .unwrap()
        .to_owned();
    let rebalances = |v: &serde_json::Value| v["coordination"]["rebalances"].as_u64().unwrap();
    let before = rebalances(&status(replicas[0].listen).await);
    delete_topic(topic.clone()).await;
    let deleted = Instant::now();
    let deadline = deleted + Duration::from_secs(60);
    loop {
        let mut assigned = 0;
        let mut moved = false;
        for r in &replicas {
            let v = status(r.listen).await;
            assigned += v["coordination"]["assigned"].as_array().unwrap().len();
            moved |= rebalances(&v) > before;
        }
        if moved && assigned == N {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the group did not come back: {assigned} assigned"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let _ = balanced_n(&replicas, &[0, 1], &sql, &run, N, Duration::from_secs(30)).await;
    eprintln!(
        "the deleted coordination topic {topic} was made again; every source assigned after {:?}",
        deleted.elapsed()
    );

    // Replica 0 without [coordination]: it takes every source.
    let listen = replicas[0].listen;
    std::fs::write(
        &replicas[0].config,
        file(&run, &db.superuser_url(), listen, "replica-0", N, false),
    )
    .unwrap();
    replicas[0].daemon.as_ref().unwrap().signal("HUP");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let v = status(listen).await;
        let running = (0..N)
            .filter(|i| v["sources"][name(*i)]["state"] == "running")
            .count();
        if running == N && v.get("coordination").is_none() {
            break;
        }
        assert!(Instant::now() < deadline, "after the reload: {v}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    replicas[1].daemon.as_mut().unwrap().kill9();
    replicas[1].daemon = None;
    let _ = balanced_n(&replicas, &[0], &sql, &run, N, Duration::from_secs(60)).await;
    eprintln!("the replica without [coordination] leads every source");

    // Events written now all arrive.
    let mut seqs = vec![HashMap::new(); N];
    for (i, seq) in seqs.iter_mut().enumerate() {
        write(&sql, &format!("ob{i}"), seq, 10).await;
    }
    for (i, seq) in seqs.iter().enumerate() {
        let topic = format!("rp{run}{}.order", name(i));
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let t = topic.clone();
            let got = tokio::task::spawn_blocking(move || {
                consume(&broker().brokers, &[&t], 10, Duration::from_secs(20))
            })
            .await
            .unwrap();
            let (by_key, _) = sequences(&got);
            if seq
                .iter()
                .all(|(agg, n)| by_key.get(agg).is_some_and(|v| v.contains(n)))
            {
                break;
            }
            assert!(Instant::now() < deadline, "{}: the events written last", name(i));
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    for r in &mut replicas {
        if let Some(d) = r.daemon.take() {
            assert!(d.sigterm().success());
        }
    }
}

/// A `kafka.options` value librdkafka refuses fails every source with the
/// reason, and the value (a secret, perhaps) is not in the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_consumer_librdkafka_refuses_fails_the_sources_without_printing_the_value() {
    let db = TestDb::new("replicas_badopt").await;
    let sql = db.client().await;
    let dir = tempfile::tempdir().unwrap();
    let listen: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let text = two_sources(
        &db,
        &sql,
        "badopt",
        format!(
            "[kafka]\nbrokers = \"{}\"\n[kafka.options]\n\"security.protocol\" = \"hunter2-not-a-protocol\"\n[http]\nlisten = \"{listen}\"\n[coordination]\ngroup = \"badopt\"\n",
            broker().brokers
        ),
    )
    .await;
    let config = write_config(dir.path(), "b.toml", &text);
    let log = dir.path().join("b.log");
    let _logs = LogsOnFailure(vec![log.clone()]);
    let mut daemon = Daemon::start_logging(&config, &log, "info");
    let code = crate::hardening::exits(&mut daemon, Duration::from_secs(30), &log).await;
    assert_eq!(code, Some(1));
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("cannot join the replicas' group badopt"), "{text}");
    assert!(
        !text.contains("hunter2"),
        "the option's value is in the log:\n{text}"
    );
}

/// Makes the tables `ob0` and `ob1` and returns `head` followed by two
/// sources on them, `s0` and `s1`, with slots and publications `<name>_<i>`.
async fn two_sources(db: &TestDb, sql: &tokio_postgres::Client, name: &str, mut head: String) -> String {
    sql.batch_execute(
        "CREATE TABLE ob0 (LIKE outbox INCLUDING ALL); CREATE TABLE ob1 (LIKE outbox INCLUDING ALL);",
    )
    .await
    .unwrap();
    for i in 0..2 {
        head.push_str(&format!(
            "[[sources]]\nname = \"s{i}\"\n[sources.postgres]\nurl = \"{}\"\ntable = \"ob{i}\"\nslot = \"{name}_{i}\"\npublication = \"{name}_{i}\"\n",
            db.superuser_url()
        ));
    }
    head
}

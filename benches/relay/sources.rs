//! Many sources in one process (`--sources`, or `--only-sources` for this
//! table alone): one outboxd drains one backlog of `n` events from one
//! source, then one outboxd drains three backlogs of `n` at once, from
//! three sources (three outbox tables, three slots and publications, one
//! database). Reported side by side: the total rate, CPU per 100k events,
//! the process's peak RSS and what each source adds to it, and the Kafka
//! clients the process holds (librdkafka instances and producers).
//!
//! Then the neighbour: a second source writes a trickle (one event per
//! transaction, 100 a second) while the first source is idle, and again
//! while it drains a backlog of `n`; the trickle's commit → ack p50 and p99
//! (from its own histogram) say what a busy source costs the others on the
//! producer they share.
//!
//! With `OUTBOXD_BENCH_REFERENCE` (an earlier build, in which each source
//! had a producer of its own), every run is made with both binaries, one
//! after the other, and the table has both.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::harness::postgres::free_port;
use super::measure::{histogram, histogram_quantile, scrape, started_at, unix_now, usage};
use super::relays::{reference_binary, Setting};
use super::{confirmed, create_slot, drop_slot, harness, watch, write_rows_into, Shape, PARTITIONS};

/// One drain of `sources` backlogs of `n` events each, by one process.
struct Run {
    binary: &'static str,
    sources: usize,
    events: usize,
    secs: f64,
    rss_mib: f64,
    cpu_s: f64,
    /// librdkafka instances (`rdk:main` threads) and producers
    /// (`outboxd-producer` threads) at the end of the drain.
    clients: usize,
    producers: usize,
}

impl Run {
    fn rate(&self) -> f64 {
        self.events as f64 / self.secs
    }

    fn cpu_per_100k(&self) -> f64 {
        self.cpu_s / (self.events as f64 / 100_000.0)
    }
}

fn table(i: usize) -> String {
    if i == 0 {
        "outbox".to_owned()
    } else {
        format!("outbox_s{i}")
    }
}

/// The HTTP verbs' token (pause and resume a source).
const TOKEN: &str = "bench-sources-token-0123456789";

/// `POST /sources/{source}/{verb}` with the token.
fn verb(port: u16, source: &str, verb: &str) {
    let url = format!("http://127.0.0.1:{port}/sources/{source}/{verb}");
    ureq::post(&url)
        .header("Authorization", &format!("Bearer {TOKEN}"))
        .send_empty()
        .unwrap_or_else(|e| panic!("{verb} {source}: {e}"));
}

/// Whether source `name`'s state (`GET /sources/{name}`) contains `state`.
fn state_is(port: u16, name: &str, state: &str) -> bool {
    ureq::get(&format!("http://127.0.0.1:{port}/sources/{name}"))
        .header("Authorization", &format!("Bearer {TOKEN}"))
        .call()
        .ok()
        .and_then(|mut r| r.body_mut().read_to_string().ok())
        .is_some_and(|b| b.contains(&format!("\"state\":\"{state}\"")))
}

fn config(s: &Setting, sources: usize, tag: &str, http_port: u16) -> String {
    let mut text = format!(
        "[kafka]\nbrokers = \"{}\"\ntopic_partitions = {PARTITIONS}\ntopic_replication_factor = 1\n{}\n[http]\nlisten = \"127.0.0.1:{http_port}\"\nadmin_token = \"{TOKEN}\"\n[log]\nlevel = \"warn\"\n",
        s.brokers,
        s.outboxd_kafka.join("\n"),
    );
    for i in 0..sources {
        text.push_str(&format!(
            r#"
[[sources]]
name = "s{i}"
[sources.postgres]
url = "postgres://postgres@127.0.0.1:{pg}/postgres?sslmode=disable"
table = "{table}"
slot = "many_{tag}_{i}"
publication = "many_{i}"
[sources.routing]
topic = "many{tag}-{i}-{{aggregate_type}}"
"#,
            pg = s.pg_port,
            table = table(i),
        ));
    }
    text
}

/// This build, or the reference one.
fn binary(reference: bool) -> (&'static str, PathBuf) {
    match reference_binary().filter(|_| reference) {
        Some(path) => ("reference", path),
        None => ("this build", PathBuf::from(env!("CARGO_BIN_EXE_outboxd"))),
    }
}

/// Threads of `pid` whose name starts with `prefix`.
fn threads(pid: u32, prefix: &str) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                .filter(|comm| comm.starts_with(prefix))
                .count()
        })
        .unwrap_or(0)
}

pub(super) fn start(binary: &Path, s: &Setting, path: &Path, log: &str) -> std::process::Child {
    let log = std::fs::File::create(s.dir.join(log)).unwrap();
    Command::new(binary)
        .args(["run", "--config"])
        .arg(path)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap()
}

async fn drain(
    client: &mut tokio_postgres::Client,
    s: &Setting,
    sources: usize,
    tag: &str,
    n: usize,
    reference: bool,
) -> Run {
    let (name, binary) = binary(reference);
    let topics: Vec<String> = (0..sources).map(|i| format!("many{tag}-{i}-order")).collect();
    let tables: Vec<(String, String)> = (0..sources)
        .map(|i| (table(i), format!("many_{tag}_{i}")))
        .collect();
    let targets = backlogs(client, s, &tables, &topics, n).await;
    eprintln!("bench: sources: {sources} source(s) of {n} events each");
    let http_port = free_port();
    let path = s.dir.join(format!("many-{tag}.toml"));
    std::fs::write(&path, config(s, sources, tag, http_port)).unwrap();
    let mut child = start(&binary, s, &path, &format!("many-{tag}.log"));
    let pid = child.id();
    wait_drained(client, s, &targets, &topics, n * sources, || ()).await;
    let secs = unix_now() - started_at(pid);
    let (rss_mib, cpu_s) = usage(pid);
    let (clients, producers) = (threads(pid, "rdk:main"), threads(pid, "outboxd-produce"));
    let _ = Command::new("kill").args(["-TERM", &pid.to_string()]).status();
    let _ = child.wait();
    for (slot, _) in &targets {
        drop_slot(client, slot).await;
    }
    Run {
        binary: name,
        sources,
        events: n * sources,
        secs,
        rss_mib,
        cpu_s,
        clients,
        producers,
    }
}

/// Backlogs of `n` events in each of `tables` (a table and the slot made
/// for it before its rows), and their topics made: the LSN each slot must
/// be confirmed past.
pub(super) async fn backlogs(
    client: &mut tokio_postgres::Client,
    s: &Setting,
    tables: &[(String, String)],
    topics: &[String],
    n: usize,
) -> Vec<(String, outboxd::Lsn)> {
    {
        let (brokers, topics) = (s.brokers.clone(), topics.to_vec());
        tokio::task::spawn_blocking(move || harness::broker::create_topics_with(&brokers, &topics, &[]))
            .await
            .unwrap();
    }
    let mut targets = Vec::new();
    for (table, slot) in tables {
        client.batch_execute(&format!("TRUNCATE {table}")).await.unwrap();
        create_slot(client, slot).await;
        targets.push((
            slot.clone(),
            write_rows_into(client, table, n, Shape::STANDARD).await,
        ));
    }
    targets
}

/// Waits until every slot of `targets` is confirmed past its backlog and
/// `topics` hold `events` records (an hour at most), calling `tick` each
/// round.
pub(super) async fn wait_drained(
    client: &tokio_postgres::Client,
    s: &Setting,
    targets: &[(String, outboxd::Lsn)],
    topics: &[String],
    events: usize,
    mut tick: impl FnMut(),
) {
    let wm = watch::client(&s.brokers);
    let deadline = Instant::now() + Duration::from_secs(3600);
    loop {
        tick();
        let mut done = true;
        for (slot, target) in targets {
            done &= confirmed(client, slot).await >= *target;
        }
        // The watermarks cost the broker a request per partition: they
        // are read once the slots are confirmed (outboxd confirms only
        // what Kafka acknowledged), not beside the drain.
        if done {
            let in_kafka: i64 = tokio::task::block_in_place(|| {
                topics
                    .iter()
                    .map(|t| watch::high_watermarks(&wm, t, PARTITIONS).iter().sum::<i64>())
                    .sum()
            });
            if in_kafka >= events as i64 {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{} slots did not drain within an hour",
            targets.len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The footprint of `sources` idle sources: resident memory (not the
/// peak), threads, librdkafka clients and open sockets, 10 s after every
/// source is ready.
struct Idle {
    binary: &'static str,
    sources: usize,
    rss_mib: f64,
    threads: usize,
    clients: usize,
    sockets: usize,
}

async fn idle(
    client: &mut tokio_postgres::Client,
    s: &Setting,
    sources: usize,
    tag: &str,
    reference: bool,
) -> Idle {
    let (name, binary) = binary(reference);
    let mut slots = Vec::new();
    for i in 0..sources {
        let slot = format!("many_{tag}_{i}");
        create_slot(client, &slot).await;
        slots.push(slot);
    }
    let http_port = free_port();
    let path = s.dir.join(format!("many-{tag}.toml"));
    std::fs::write(&path, config(s, sources, tag, http_port)).unwrap();
    let mut child = start(&binary, s, &path, &format!("many-{tag}.log"));
    let pid = child.id();
    let ready = Instant::now();
    while ureq::get(&format!("http://127.0.0.1:{http_port}/readyz"))
        .call()
        .is_err()
    {
        assert!(
            ready.elapsed() < Duration::from_secs(120),
            "{sources} sources not ready"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |key: &str| -> f64 {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
            .unwrap_or(0.0)
    };
    let sockets = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.filter_map(|f| std::fs::read_link(f.ok()?.path()).ok())
                .filter(|l| l.to_string_lossy().starts_with("socket:"))
                .count()
        })
        .unwrap_or(0);
    let out = Idle {
        binary: name,
        sources,
        rss_mib: field("VmRSS:") / 1024.0,
        threads: field("Threads:") as usize,
        clients: threads(pid, "rdk:main"),
        sockets,
    };
    let _ = Command::new("kill").args(["-TERM", &pid.to_string()]).status();
    let _ = child.wait();
    for slot in &slots {
        drop_slot(client, slot).await;
    }
    out
}

/// The trickle source's commit → ack while its neighbour idles or drains.
struct Neighbour {
    binary: &'static str,
    /// The neighbour's backlog (0: idle).
    backlog: usize,
    events: f64,
    p50_ms: f64,
    p99_ms: f64,
    /// How long the neighbour took to drain its backlog.
    drain_secs: f64,
}

/// `outboxd_commit_to_ack_seconds` buckets of `source`, as (le, count).
fn source_histogram(text: &str, source: &str) -> Vec<(f64, f64)> {
    histogram(
        text,
        "outboxd_commit_to_ack_seconds",
        &format!("source=\"{source}\""),
    )
}

/// Source s1 writes 100 one-event transactions a second; source s0 is
/// paused while its backlog of `backlog` events is written, then resumed a
/// second into the trickle, which goes on until s0 has drained (and for at
/// least 8 s; with no backlog s0 stays idle).
async fn neighbour(
    client: &mut tokio_postgres::Client,
    s: &Setting,
    tag: &str,
    backlog: usize,
    reference: bool,
) -> Neighbour {
    let (name, binary) = binary(reference);
    let topics: Vec<String> = (0..2).map(|i| format!("many{tag}-{i}-order")).collect();
    {
        let (brokers, topics) = (s.brokers.clone(), topics.clone());
        tokio::task::spawn_blocking(move || harness::broker::create_topics_with(&brokers, &topics, &[]))
            .await
            .unwrap();
    }
    let mut slots = Vec::new();
    for i in 0..2 {
        client
            .batch_execute(&format!("TRUNCATE {}", table(i)))
            .await
            .unwrap();
        let slot = format!("many_{tag}_{i}");
        create_slot(client, &slot).await;
        slots.push(slot);
    }
    let http_port = free_port();
    let path = s.dir.join(format!("many-{tag}.toml"));
    std::fs::write(&path, config(s, 2, tag, http_port)).unwrap();
    let mut child = start(&binary, s, &path, &format!("many-{tag}.log"));
    let pid = child.id();
    let url = format!(
        "postgres://postgres@127.0.0.1:{}/postgres?sslmode=disable",
        s.pg_port
    );
    let (writer, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let insert = format!(
        "INSERT INTO {} (id, aggregate_type, aggregate_id, type, payload) VALUES (gen_random_uuid(), 'Order', 'n-' || $1::int % 50, 'ordering.order-placed.v1', jsonb_build_object('i', $1::int))",
        table(1)
    );
    // Ready once s1 has acknowledged a first event.
    let mut i = 0i32;
    loop {
        writer.execute(&insert, &[&i]).await.unwrap();
        i += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let text = tokio::task::block_in_place(|| scrape(http_port));
        if source_histogram(&text, "s1").last().is_some_and(|b| b.1 > 0.0) {
            break;
        }
    }
    // s0 holds its slot while its backlog is written.
    tokio::task::block_in_place(|| {
        verb(http_port, "s0", "pause");
        while !state_is(http_port, "s0", "paused") {
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    let target = if backlog > 0 {
        Some(write_rows_into(client, &table(0), backlog, Shape::STANDARD).await)
    } else {
        None
    };
    let before = tokio::task::block_in_place(|| source_histogram(&scrape(http_port), "s1"));
    let started = Instant::now();
    let mut resumed: Option<Instant> = None;
    let mut drained_at = None;
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    loop {
        tick.tick().await;
        writer.execute(&insert, &[&i]).await.unwrap();
        i += 1;
        if resumed.is_none() && started.elapsed() >= Duration::from_secs(1) {
            tokio::task::block_in_place(|| verb(http_port, "s0", "resume"));
            resumed = Some(Instant::now());
        }
        if let (Some(at), None, true) = (resumed, drained_at, i % 20 == 0) {
            let done = match target {
                Some(t) => confirmed(client, &slots[0]).await >= t,
                None => true,
            };
            if done {
                drained_at = Some(at.elapsed());
            }
        }
        if drained_at.is_some() && started.elapsed() >= Duration::from_secs(8) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(3600),
            "no drain within an hour"
        );
    }
    // The last events' acknowledgements.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = tokio::task::block_in_place(|| source_histogram(&scrape(http_port), "s1"));
    let _ = Command::new("kill").args(["-TERM", &pid.to_string()]).status();
    let _ = child.wait();
    for slot in &slots {
        drop_slot(client, slot).await;
    }
    let delta: Vec<(f64, f64)> = after
        .iter()
        .map(|(le, c)| {
            let was = before.iter().find(|(l, _)| l == le).map_or(0.0, |b| b.1);
            (*le, c - was)
        })
        .collect();
    Neighbour {
        binary: name,
        backlog,
        events: delta.last().map_or(0.0, |b| b.1),
        p50_ms: histogram_quantile(&delta, 0.5) * 1000.0,
        p99_ms: histogram_quantile(&delta, 0.99) * 1000.0,
        drain_secs: drained_at.map_or(0.0, |d| d.as_secs_f64()),
    }
}

/// Idle sources in the footprint table's larger row.
const IDLE_SOURCES: usize = 8;

/// Runs one source, then three; a markdown table on stdout and JSON.
pub async fn run(client: &mut tokio_postgres::Client, s: &Setting, n: usize) -> Value {
    // Each source's table and publication exist before its slot: a slot
    // decodes with the catalog of its own past.
    for i in 0..IDLE_SOURCES {
        if i > 0 {
            client
                .batch_execute(&format!(
                    "CREATE TABLE IF NOT EXISTS {} (LIKE outbox INCLUDING ALL)",
                    table(i)
                ))
                .await
                .unwrap();
        }
        client
            .batch_execute(&format!("CREATE PUBLICATION many_{i} FOR TABLE {}", table(i)))
            .await
            .unwrap();
    }
    // One source drains first and again last, so the broker's warming up
    // favours neither side; the ratios use the faster one-source drain.
    // With a reference binary, each of its runs follows this build's
    // (precedes it with OUTBOXD_BENCH_REFERENCE_FIRST, so that a second
    // run can show the order did not make the ratio).
    let reference = reference_binary().is_some();
    let builds: &[bool] = match (reference, std::env::var_os("OUTBOXD_BENCH_REFERENCE_FIRST")) {
        (false, _) => &[false],
        (true, None) => &[false, true],
        (true, Some(_)) => &[true, false],
    };
    let mut runs = Vec::new();
    for (tag, count) in [("1a", 1), ("3", 3), ("1b", 1)] {
        for &r in builds {
            let tag = format!("{tag}{}", if r { "r" } else { "" });
            runs.push(drain(client, s, count, &tag, n, r).await);
        }
    }
    println!("| binary | sources | events | drain (total) | CPU per 100k events | peak RSS | RSS per source | librdkafka clients / producers |");
    println!("|---|---|---|---|---|---|---|---|");
    for r in &runs {
        println!(
            "| {} | {} | {} | {:.0} events/s | {:.2} core-s | {:.1} MiB | {:.1} MiB | {} / {} |",
            r.binary,
            r.sources,
            r.events,
            r.rate(),
            r.cpu_per_100k(),
            r.rss_mib,
            r.rss_mib / r.sources as f64,
            r.clients,
            r.producers
        );
    }
    let mut summary = serde_json::Map::new();
    for &r in builds {
        let name = binary(r).0;
        let of = |sources: usize| {
            runs.iter()
                .filter(move |x| x.binary == name && x.sources == sources)
        };
        let one = of(1).max_by(|a, b| a.rate().total_cmp(&b.rate())).unwrap();
        let three = of(3).next().unwrap();
        let added = (three.rss_mib - one.rss_mib) / 2.0;
        println!(
            "{name}: three sources beside one: total rate {:.2}x, CPU per event {:.2}x, each added source {added:.1} MiB of RSS",
            three.rate() / one.rate(),
            three.cpu_per_100k() / one.cpu_per_100k()
        );
        summary.insert(
            name.to_owned(),
            json!({"rate_ratio": three.rate() / one.rate(), "rss_mib_per_added_source": added,
                   "three_sources_peak_rss_mib": three.rss_mib, "three_sources_events_per_second": three.rate()}),
        );
    }
    // The neighbour: idle, then busy, then busy again, each with both builds.
    let mut neighbours = Vec::new();
    for (round, backlog) in [(0, 0), (1, n), (2, n)] {
        for &r in builds {
            let tag = format!("n{round}{}", if r { "r" } else { "" });
            neighbours.push(neighbour(client, s, &tag, backlog, r).await);
        }
    }
    println!();
    println!(
        "| binary | neighbour's backlog | trickle events | commit → ack p50 | p99 | neighbour drained in |"
    );
    println!("|---|---|---|---|---|---|");
    for x in &neighbours {
        println!(
            "| {} | {} | {:.0} | {:.1} ms | {:.1} ms | {:.1} s |",
            x.binary, x.backlog, x.events, x.p50_ms, x.p99_ms, x.drain_secs
        );
    }
    // Idle: one source, then IDLE_SOURCES, each with both builds.
    let mut idles = Vec::new();
    for count in [1, IDLE_SOURCES] {
        for &r in builds {
            let tag = format!("i{count}{}", if r { "r" } else { "" });
            idles.push(idle(client, s, count, &tag, r).await);
        }
    }
    println!();
    println!("| binary | idle sources | RSS | threads | librdkafka clients | sockets |");
    println!("|---|---|---|---|---|---|");
    for x in &idles {
        println!(
            "| {} | {} | {:.1} MiB | {} | {} | {} |",
            x.binary, x.sources, x.rss_mib, x.threads, x.clients, x.sockets
        );
    }
    for &r in builds {
        let name = binary(r).0;
        let of = |n: usize| idles.iter().find(|x| x.binary == name && x.sources == n);
        if let (Some(one), Some(many)) = (of(1), of(IDLE_SOURCES)) {
            println!(
                "{name}: each idle source adds {:.1} MiB, {:.1} threads, {:.1} sockets",
                (many.rss_mib - one.rss_mib) / (IDLE_SOURCES - 1) as f64,
                (many.threads as f64 - one.threads as f64) / (IDLE_SOURCES - 1) as f64,
                (many.sockets as f64 - one.sockets as f64) / (IDLE_SOURCES - 1) as f64,
            );
        }
    }
    let ifig = |x: &Idle| {
        json!({"binary": x.binary, "sources": x.sources, "rss_mib": x.rss_mib, "threads": x.threads,
               "librdkafka_clients": x.clients, "sockets": x.sockets})
    };
    let fig = |r: &Run| {
        json!({"binary": r.binary, "sources": r.sources, "events": r.events, "seconds": r.secs, "events_per_second": r.rate(),
               "cpu_seconds": r.cpu_s, "cpu_seconds_per_100k_events": r.cpu_per_100k(),
               "peak_rss_mib": r.rss_mib, "rss_mib_per_source": r.rss_mib / r.sources as f64,
               "librdkafka_clients": r.clients, "producers": r.producers})
    };
    let nfig = |x: &Neighbour| {
        json!({"binary": x.binary, "neighbour_backlog": x.backlog, "events": x.events,
               "p50_ms": x.p50_ms, "p99_ms": x.p99_ms, "neighbour_drain_seconds": x.drain_secs})
    };
    json!({"drains": runs.iter().map(fig).collect::<Vec<_>>(), "summary": summary,
           "idle": idles.iter().map(ifig).collect::<Vec<_>>(),
           "neighbour": neighbours.iter().map(nfig).collect::<Vec<_>>()})
}

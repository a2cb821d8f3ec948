//! outboxd benchmark: one command, local throwaway services, outboxd
//! measured beside `pg_recvlogical`, its own polling mode and Debezium.
//!
//! ```sh
//! scripts/bench.sh                      # 200,000 events
//! scripts/bench.sh --events 1000000     # 1M
//! scripts/bench.sh --skip-debezium      # without the Kafka Connect runs
//! ```
//!
//! a. Backlog drain: N outbox rows (~300-byte payloads, 100 rows per
//!    transaction) written while every relay is stopped, each relay with a
//!    slot of its own created at the same point. Each relay is started in
//!    turn; the clock runs from its process's start until its slot's
//!    `confirmed_flush_lsn` passes the last backlog transaction (an LSN
//!    read inside it: Debezium confirms an event's LSN, not its commit's)
//!    and until the broker holds all N events on its topic. Reported: the
//!    later of the two, peak RSS and CPU seconds of the process (Kafka
//!    Connect's JVM for Debezium).
//! b. The same WAL range drained by `pg_recvlogical` (pgoutput, the same
//!    publication, output to /dev/null), stopping at `--endpos`, before and
//!    after the relays: PostgreSQL's decoding limit.
//! c. The same rows drained by outboxd's polling mode.
//! d. Latency: single-row transactions at a steady rate (default 2,000/s
//!    for 30 s, after 10 s of the same load to warm up), through outboxd
//!    and then through Debezium. Commit
//!    (`pg_xact_commit_timestamp`) → arrival at one test consumer, the same
//!    consumer code for both; for outboxd also its commit → ack histogram.
//! e. Start-up: with the slot and topic in place and one event waiting,
//!    from the relay's process start to the event's arrival at the
//!    consumer; the median of `--startup-rounds` restarts.
//! f. The produce ceiling (`ceiling`): the same records through outboxd's
//!    producer with no PostgreSQL, the Kafka side's limit; its unmeasured
//!    twin warms the broker before the first drain.
//! g. With `--scaling`, the cost as work grows (`scaling`).
//! h. With `--sources`, three sources in one process beside one
//!    (`sources`); `--only-sources` runs that table alone.
//! j. `--only-topics`: one backlog over 50 aggregate types drained by
//!    `pg_recvlogical`, outboxd to one topic, outboxd to 50 topics and
//!    Debezium to 50 topics (`topics`).
//! i. `--only-mapping`: the drain of a table read through `[columns]`
//!    (renamed columns, two header placements) beside the default table's,
//!    alternating, on backlogs of the same rows (`mapping`).
//! k. `--only-replicas`: twelve sources drained by one outboxd, then by
//!    two and three replicas of one file with `[coordination]` (`replicas`).
//!
//! Results: markdown tables on stdout and JSON in target/bench/results.json
//! (`vs_debezium` holds the side-by-side figures). All measures run side by
//! side in this one process on the same machine, so the ratios are the
//! figures to trust; absolute numbers move with the machine's load.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_debug_implementations)]

mod ceiling;
#[path = "../../tests/integration/harness/mod.rs"]
#[allow(dead_code)]
mod harness;
mod mapping;
mod measure;
mod relays;
mod replicas;
mod scaling;
mod sources;
mod topics;
mod warm;
mod watch;

use std::collections::HashMap;
use std::process::Command;
use std::time::{Duration, Instant};

use harness::broker::{create_topics_with, dedicated as dedicated_broker};
use harness::postgres::{dedicated, PgServer};
use measure::{
    ack_histogram, broker_log_dirs, commit_histogram, histogram_quantile, median, percentile, scrape,
    started_at, stored_batches, unix_now, usage,
};
use outboxd::Lsn;
use relays::{Kind, Running, Setting};
use serde_json::{json, Value};
use watch::{Arrival, Watcher};

const PARTITIONS: i32 = 3;

struct Args {
    events: usize,
    latency_secs: u64,
    rate: u64,
    startup_rounds: usize,
    warmup_secs: u64,
    debezium: bool,
    exactly_once: bool,
    tracing: bool,
    /// The Avro run (a registered schema, Apicurio).
    avro: bool,
    /// Also the table of cost as work grows (`scaling`).
    scaling: bool,
    /// Also the table of many sources in one process (`sources`); `only`:
    /// nothing else.
    sources: bool,
    only_sources: bool,
    only_replicas: bool,
    /// Only the drain through a column map beside the default one
    /// (`mapping`).
    only_mapping: bool,
    /// Only one backlog over 50 topics beside one topic (`topics`).
    only_topics: bool,
    outboxd_kafka: Vec<String>,
    exactly_once_settings: Vec<String>,
}

fn args() -> Args {
    let mut a = Args {
        events: 200_000,
        latency_secs: 30,
        rate: 2_000,
        startup_rounds: 3,
        warmup_secs: 10,
        debezium: true,
        exactly_once: true,
        tracing: true,
        avro: true,
        scaling: false,
        sources: false,
        only_sources: false,
        only_replicas: false,
        only_mapping: false,
        only_topics: false,
        outboxd_kafka: Vec::new(),
        exactly_once_settings: Vec::new(),
    };
    let argv: Vec<String> = std::env::args().collect();
    let mut i = 1;
    while i < argv.len() {
        let value = || {
            argv.get(i + 1)
                .and_then(|v| v.parse().ok())
                .expect("a number after the flag")
        };
        match argv[i].as_str() {
            "--events" => a.events = value(),
            "--latency-secs" => a.latency_secs = value() as u64,
            "--rate" => a.rate = value() as u64,
            "--startup-rounds" => a.startup_rounds = value().max(1),
            "--warmup-secs" => a.warmup_secs = value() as u64,
            "--skip-debezium" => a.debezium = false,
            "--skip-exactly-once" => a.exactly_once = false,
            "--skip-tracing" => a.tracing = false,
            "--skip-avro" => a.avro = false,
            "--scaling" => a.scaling = true,
            "--sources" => a.sources = true,
            "--only-sources" => a.only_sources = true,
            "--only-replicas" => a.only_replicas = true,
            "--only-mapping" => a.only_mapping = true,
            "--only-topics" => a.only_topics = true,
            "--exactly-once-setting" => {
                a.exactly_once_settings.push(
                    argv.get(i + 1)
                        .expect("a `key = value` line after --exactly-once-setting")
                        .clone(),
                );
                i += 1;
            }
            "--outboxd-kafka" => {
                a.outboxd_kafka.push(
                    argv.get(i + 1)
                        .expect("a `key = value` line after --outboxd-kafka")
                        .clone(),
                );
                i += 1;
            }
            _ => {}
        }
        i += 1;
    }
    a
}

async fn lsn(client: &tokio_postgres::Client, sql: &str) -> Lsn {
    let s: Option<String> = client.query_one(sql, &[]).await.unwrap().get(0);
    s.map(|s| s.parse().unwrap()).unwrap_or(Lsn::ZERO)
}

async fn confirmed(client: &tokio_postgres::Client, slot: &str) -> Lsn {
    let s: Option<String> = client
        .query_one(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0);
    s.map(|s| s.parse().unwrap()).unwrap_or(Lsn::ZERO)
}

async fn create_slot(client: &tokio_postgres::Client, slot: &str) {
    client
        .execute(
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&slot],
        )
        .await
        .unwrap();
}

async fn drop_slot(client: &tokio_postgres::Client, slot: &str) {
    client
        .execute("SELECT pg_drop_replication_slot($1)", &[&slot])
        .await
        .unwrap();
}

/// What the rows of a backlog look like.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shape {
    /// The payload's size in bytes; `None`: the standard ~300-byte order.
    payload: Option<usize>,
    /// Aggregate types `T0`.. (one topic each); 1: every row is an `Order`.
    types: usize,
}

impl Shape {
    const STANDARD: Shape = Shape {
        payload: None,
        types: 1,
    };
}

/// The Avro schema of the backlog's payload (see [`write_rows`]), which the
/// Avro run encodes against.
const BENCH_AVRO_SCHEMA: &str = r#"{"type": "record", "name": "OrderPlaced", "namespace": "bench", "fields": [
  {"name": "orderId", "type": "long"}, {"name": "customerId", "type": "string"},
  {"name": "lines", "type": {"type": "array", "items": {"type": "record", "name": "Line", "fields": [
    {"name": "sku", "type": "string"}, {"name": "qty", "type": "int"}, {"name": "price", "type": "long"}]}}},
  {"name": "note", "type": "string"}]}"#;

/// The Avro schema of the latency load's and the start-up probe's payloads.
const BENCH_AVRO_LATENCY_SCHEMA: &str = r#"{"type": "record", "name": "Tick", "namespace": "bench", "fields": [{"name": "i", "type": ["null", "long"], "default": null}]}"#;

/// Writes `n` rows, 100 per transaction, ~300-byte payloads, each with a
/// sampled W3C `traceparent` header (as the SDK writes it). Returns an
/// LSN read inside the last transaction, after its rows.
async fn write_backlog(client: &mut tokio_postgres::Client, n: usize) -> Lsn {
    write_rows(client, n, Shape::STANDARD).await
}

/// [`write_backlog`] with rows of another shape.
async fn write_rows(client: &mut tokio_postgres::Client, n: usize, shape: Shape) -> Lsn {
    write_rows_into(client, "outbox", n, shape).await
}

/// [`write_rows`] into another outbox table.
async fn write_rows_into(client: &mut tokio_postgres::Client, table: &str, n: usize, shape: Shape) -> Lsn {
    let target = format!("{table} (id, aggregate_type, aggregate_id, type, payload, headers)");
    write_rows_as(client, &target, "", n, shape).await
}

/// [`write_rows`] into `target` (a table and its column list, in the order
/// id, aggregate type, aggregate id, type, payload, headers, then the
/// columns `extra` selects).
async fn write_rows_as(
    client: &mut tokio_postgres::Client,
    target: &str,
    extra: &str,
    n: usize,
    shape: Shape,
) -> Lsn {
    let mut last = Lsn::ZERO;
    let transactions = n.div_ceil(100);
    let aggregate_type = if shape.types > 1 {
        format!("'t' || (g % {})", shape.types)
    } else {
        "'Order'".to_owned()
    };
    let payload = match shape.payload {
        None => "jsonb_build_object('orderId', $1::int * 100 + g, 'customerId', md5(g::text),
                                    'lines', jsonb_build_array(jsonb_build_object('sku', 'SKU-' || g, 'qty', 2, 'price', 1250)),
                                    'note', repeat('n', 150))"
            .to_owned(),
        // {"note": "nn…", "orderId": 1234567}: 32 bytes around the note.
        Some(bytes) => format!(
            "jsonb_build_object('orderId', $1::int * 100 + g, 'note', repeat('n', {}))",
            bytes.saturating_sub(32)
        ),
    };
    for t in 0..transactions {
        let rows = (n - t * 100).min(100) as i32;
        let tx = client.transaction().await.unwrap();
        tx.execute(
            &format!("INSERT INTO {target}
             SELECT gen_random_uuid(), {aggregate_type}, 'order-' || ($1::int * 100 + g) % 5000, 'ordering.order-placed.v1',
                    {payload},
                    jsonb_build_object('correlationId', md5(($1::int * 100 + g)::text),
                                       'traceparent', '00-' || md5(($1::int * 100 + g)::text || 't') || '-'
                                                      || substr(md5(($1::int * 100 + g)::text || 's'), 1, 16) || '-01')
                    {extra}
               FROM generate_series(1, $2::int) g"),
            &[&(t as i32), &rows],
        )
        .await
        .unwrap();
        if t + 1 == transactions {
            let s: String = tx
                .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
                .await
                .unwrap()
                .get(0);
            last = s.parse().unwrap();
        }
        tx.commit().await.unwrap();
    }
    last
}

/// A backlog drained by one relay.
struct Drain {
    confirmed_s: f64,
    in_kafka_s: f64,
    in_kafka: i64,
    rss_mib: f64,
    cpu_s: f64,
    /// The brokers' CPU from the relay's start to the drain's end (what
    /// the relay's requests cost on the Kafka side), and of it their JIT
    /// compiler threads' (`warm`).
    broker: warm::Jit,
    /// The record batches the broker stored for the drain, and their
    /// records (its log segments, from the partitions' ends at the start).
    stored_batches: u64,
    stored_records: u64,
}

impl Drain {
    /// Done: every event in Kafka and the slot confirmed past them.
    fn secs(&self) -> f64 {
        self.confirmed_s.max(self.in_kafka_s)
    }

    fn rate(&self, events: usize) -> f64 {
        events as f64 / self.secs()
    }

    fn cpu_per_100k(&self, events: usize) -> f64 {
        self.cpu_s / (events as f64 / 100_000.0)
    }

    fn broker_cpu_per_100k(&self, events: usize) -> f64 {
        self.broker.total_s / (events as f64 / 100_000.0)
    }

    fn broker_jit_per_100k(&self, events: usize) -> f64 {
        self.broker.compiler_s / (events as f64 / 100_000.0)
    }

    fn json(&self, events: usize) -> Value {
        json!({"seconds": self.secs(), "seconds_to_confirmed": self.confirmed_s, "seconds_to_all_in_kafka": self.in_kafka_s,
               "events_in_kafka": self.in_kafka, "events_per_second": self.rate(events),
               "peak_rss_mib": self.rss_mib, "cpu_seconds": self.cpu_s,
               "cpu_seconds_per_100k_events": self.cpu_per_100k(events),
               "broker_cpu_seconds_per_100k_events": self.broker_cpu_per_100k(events),
               "broker_jit_cpu_seconds_per_100k_events": self.broker_jit_per_100k(events),
               "broker_jit_counted_short": self.broker.short,
               "stored_batches": self.stored_batches, "stored_records": self.stored_records})
    }
}

/// Starts `kind` on a backlog and samples, every 20 ms, its slot's
/// confirmed LSN (and its topic's high watermarks, see [`drain_into`]),
/// until the slot passes `target` and the topic holds `events` more
/// records than at the start.
async fn drain(
    client: &tokio_postgres::Client,
    s: &Setting,
    kind: Kind,
    slot: &str,
    topic: &str,
    target: Lsn,
    events: usize,
) -> Drain {
    drain_into(client, s, kind, slot, topic, &[topic.to_owned()], target, events).await
}

/// [`drain`] with the relay's topic setting (`route`, a template) and the
/// topics it fills.
#[allow(clippy::too_many_arguments)]
async fn drain_into(
    client: &tokio_postgres::Client,
    s: &Setting,
    kind: Kind,
    slot: &str,
    route: &str,
    topics: &[String],
    target: Lsn,
    events: usize,
) -> Drain {
    eprintln!("bench: {} drain", kind.name());
    let wm = watch::client(&s.brokers);
    // Reading the watermarks costs the broker a request per partition (150
    // with 50 topics), which slows the drain being measured; and an earlier
    // round may have filled the topics already. So the events counted are
    // those past the watermarks at the start, and an outboxd (which
    // confirms an LSN only once Kafka acknowledged every event before it)
    // is read once its slot passed the target, Debezium (which confirms
    // late) at each sample on one topic, every half second on more.
    let in_topics = || -> i64 {
        tokio::task::block_in_place(|| {
            topics
                .iter()
                .map(|t| watch::high_watermarks(&wm, t, PARTITIONS).iter().sum::<i64>())
                .sum()
        })
    };
    // Read before the relay starts: its first records may land at once.
    // Where each partition stood also bounds the batches this drain
    // stored.
    let partitions_before: Vec<Vec<i64>> = tokio::task::block_in_place(|| {
        topics
            .iter()
            .map(|t| watch::high_watermarks(&wm, t, PARTITIONS))
            .collect()
    });
    let before: i64 = partitions_before.iter().flatten().sum();
    let broker = warm::Meter::start(&s.broker_pids);
    // Debezium's start returns once its task streams, seconds into the
    // drain: start it beside the sampling.
    let mut starter = Some({
        let (s, slot, route) = (s.clone(), slot.to_owned(), route.to_owned());
        std::thread::spawn(move || kind.start(&s, &slot, &route))
    });
    let mut running: Option<Running> = None;
    let confirms_after_kafka = !matches!(kind, Kind::Debezium);
    let (mut at_confirmed, mut at_kafka, mut in_kafka) = (None, None, 0);
    let deadline = Instant::now() + Duration::from_secs(3600);
    let mut tick = 0u64;
    while at_confirmed.is_none() || at_kafka.is_none() || running.is_none() {
        if starter.as_ref().is_some_and(|t| t.is_finished()) {
            running = Some(starter.take().unwrap().join().expect("the relay started"));
        }
        if at_confirmed.is_none() && confirmed(client, slot).await >= target {
            at_confirmed = Some(unix_now());
        }
        let read_now = if confirms_after_kafka {
            at_confirmed.is_some()
        } else {
            tick.is_multiple_of(if topics.len() > 1 { 25 } else { 1 })
        };
        if at_kafka.is_none() && read_now {
            in_kafka = in_topics() - before;
            if in_kafka >= events as i64 {
                // An outboxd's events were in Kafka when it confirmed.
                at_kafka = if confirms_after_kafka {
                    at_confirmed
                } else {
                    Some(unix_now())
                };
            } else if confirms_after_kafka {
                // Confirmed yet not all in Kafka: would be a lost event,
                // unless the watermarks lag the acknowledgements.
                assert!(
                    unix_now() - at_confirmed.unwrap() < 30.0,
                    "{} confirmed slot {slot} past the backlog with {in_kafka} of {events} events in Kafka ({route})",
                    kind.name()
                );
            }
        }
        tick += 1;
        assert!(
            Instant::now() < deadline,
            "{} did not drain within an hour: slot {slot} confirmed {} (target {target}), {in_kafka} of {events} events in Kafka ({route})",
            kind.name(),
            confirmed(client, slot).await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut running = running.unwrap();
    let pid = running.pid();
    let start = started_at(pid);
    let (rss_mib, cpu_s) = usage(pid);
    let (broker_jit, broker_threads) = broker.stop();
    // The batches the broker stored for this drain (what each of the
    // relay's requests carried per partition).
    let dirs: Vec<_> = s.broker_pids.iter().flat_map(|&p| broker_log_dirs(p)).collect();
    let (batches, batched) = topics
        .iter()
        .zip(&partitions_before)
        .map(|(t, from)| stored_batches(&dirs, t, from))
        .fold((0, 0), |(b, r), (b2, r2)| (b + b2, r + r2));
    eprintln!(
        "bench: {} drain: {batches} stored batches, {:.0} records per batch",
        kind.name(),
        batched as f64 / batches.max(1) as f64
    );
    eprintln!(
        "bench: {} drain, the broker's threads: {}",
        kind.name(),
        broker_threads.summary()
    );
    tokio::task::block_in_place(|| running.stop());
    Drain {
        confirmed_s: at_confirmed.unwrap() - start,
        in_kafka_s: at_kafka.unwrap() - start,
        in_kafka,
        rss_mib,
        cpu_s,
        broker: broker_jit,
        stored_batches: batches,
        stored_records: batched,
    }
}

/// Single-row transactions from 4 writers at `rate` per second for
/// `secs`, each row's `type` set to `tag`. Returns the rate achieved.
async fn steady_load(pg: &PgServer, rate: u64, secs: u64, tag: &str) -> f64 {
    let writers = 4u64;
    let mut tasks = Vec::new();
    for w in 0..writers {
        let c = pg.client("postgres").await;
        let per = rate / writers;
        let tag = tag.to_owned();
        tasks.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / per as f64));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            for i in 0..per * secs {
                tick.tick().await;
                c.execute(
                    "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload, headers)
                     VALUES (gen_random_uuid(), 'Order', $1, $2, jsonb_build_object('i', $3::bigint),
                             jsonb_build_object('traceparent', '00-' || md5($1 || $3::text) || '-'
                                                || substr(md5($3::text || $1), 1, 16) || '-01'))",
                    &[&format!("w{w}-{}", i % 50), &tag, &(i as i64)],
                )
                .await
                .unwrap();
            }
        }));
    }
    let t = Instant::now();
    for task in tasks {
        task.await.unwrap();
    }
    (rate / writers * writers * secs) as f64 / t.elapsed().as_secs_f64()
}

/// One event in the outbox; its id.
async fn insert_one(client: &tokio_postgres::Client, tag: &str) -> String {
    client
        .query_one(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload)
             VALUES (gen_random_uuid(), 'Order', 'probe', $1, '{}') RETURNING id::text",
            &[&tag],
        )
        .await
        .unwrap()
        .get(0)
}

/// Commit → arrival at the consumer, and commit → the broker's append,
/// under a steady load (sorted milliseconds).
struct Latency {
    achieved: f64,
    /// Events per second from the first commit to the last arrival: below
    /// `achieved`, the relay fell behind the load.
    delivered: f64,
    consumed_ms: Vec<f64>,
    appended_ms: Vec<f64>,
    metrics: String,
    /// The relay's CPU per event (µs) over the measured load, and over a
    /// further steady 1,000 events/s for `STEADY_SECS`.
    cpu_us_per_event: f64,
    steady_cpu_us_per_event: f64,
}

/// Most rounds of the broker's warm-up before the first drain.
const WARM_UP_ROUNDS: usize = 8;

/// The steady load whose CPU per event is reported on its own: a rate
/// where a relay mostly waits, so what it spends per event is its
/// wake-ups, not its batching.
const STEADY_RATE: u64 = 1_000;
const STEADY_SECS: u64 = 15;

impl Latency {
    /// Commit → consumed: the figure compared across relays.
    fn p(&self, p: f64) -> f64 {
        percentile(&self.consumed_ms, p)
    }

    fn json(&self) -> Value {
        let summary = |ms: &[f64]| {
            json!({"p50": percentile(ms, 0.5), "p99": percentile(ms, 0.99),
                   "max": ms.last().copied().unwrap_or(f64::NAN), "samples": ms.len()})
        };
        json!({"achieved_events_per_second": self.achieved, "delivered_events_per_second": self.delivered,
               "cpu_us_per_event": self.cpu_us_per_event,
               "steady_1000_per_s_cpu_us_per_event": self.steady_cpu_us_per_event,
               "commit_to_consumed_ms": summary(&self.consumed_ms),
               "commit_to_log_append_ms": summary(&self.appended_ms)})
    }
}

/// Starts `kind` on a new slot, warms it up with one event, runs the
/// steady load and reads every arrival. Returns the relay still running.
async fn latency(
    pg: &PgServer,
    client: &tokio_postgres::Client,
    s: &Setting,
    kind: Kind,
    a: &Args,
) -> (Latency, Running) {
    eprintln!(
        "bench: {} latency, {} events/s for {}s",
        kind.name(),
        a.rate,
        a.latency_secs
    );
    let (slot, topic) = (
        format!("latency_{}", kind.name()),
        format!("latency-{}", kind.name()),
    );
    create_slot(client, &slot).await;
    let watcher = Watcher::from_end(&s.brokers, &topic, PARTITIONS);
    let running = {
        let (s, slot, topic) = (s.clone(), slot.clone(), topic.clone());
        tokio::task::spawn_blocking(move || kind.start(&s, &slot, &topic))
            .await
            .unwrap()
    };
    let warm = insert_one(client, "bench.warm").await;
    tokio::task::block_in_place(|| watcher.wait_for(&warm, Duration::from_secs(120)))
        .unwrap_or_else(|| panic!("{} did not publish the warm-up event within 120 s", kind.name()));
    // The same load first, unmeasured, until every event has arrived: a
    // JVM compiles its hot paths in the first seconds, and the figures
    // are for a relay in its steady state.
    let warmup = steady_load(
        pg,
        a.rate,
        a.warmup_secs,
        &format!("bench.warmup.{}", kind.name()),
    )
    .await;
    let warmed = 1 + (a.rate / 4 * 4 * a.warmup_secs) as usize;
    tokio::task::block_in_place(|| watcher.wait_count(warmed, Duration::from_secs(300)));
    eprintln!(
        "bench: {} warmed up ({warmup:.0} events/s for {} s)",
        kind.name(),
        a.warmup_secs
    );
    let tag = format!("bench.tick.{}", kind.name());
    let cpu_before = usage(running.pid()).1;
    let achieved = steady_load(pg, a.rate, a.latency_secs, &tag).await;
    let commits: HashMap<String, f64> = client
        .query(
            "SELECT id::text, EXTRACT(EPOCH FROM pg_xact_commit_timestamp(xmin))::float8 FROM outbox WHERE type = $1",
            &[&tag],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    tokio::task::block_in_place(|| watcher.wait_count(warmed + commits.len(), Duration::from_secs(300)));
    let cpu_us_per_event = (usage(running.pid()).1 - cpu_before) * 1e6 / commits.len() as f64;
    // The steady 1,000/s, measured the same way.
    let cpu_before = usage(running.pid()).1;
    steady_load(
        pg,
        STEADY_RATE,
        STEADY_SECS,
        &format!("bench.steady.{}", kind.name()),
    )
    .await;
    let steady = (STEADY_RATE / 4 * 4 * STEADY_SECS) as usize;
    tokio::task::block_in_place(|| {
        watcher.wait_count(warmed + commits.len() + steady, Duration::from_secs(300))
    });
    let steady_cpu_us_per_event = (usage(running.pid()).1 - cpu_before) * 1e6 / steady as f64;
    let metrics = match running.http_port() {
        Some(port) => tokio::task::spawn_blocking(move || scrape(port)).await.unwrap(),
        None => String::new(),
    };
    let seen = tokio::task::block_in_place(|| watcher.finish());
    let missing = commits.keys().filter(|id| !seen.contains_key(*id)).count();
    assert_eq!(missing, 0, "{} lost events in the latency run", kind.name());
    let sorted_ms = |at: fn(&Arrival) -> f64| {
        let mut ms: Vec<f64> = commits
            .iter()
            .map(|(id, commit)| (at(&seen[id]) - commit) * 1000.0)
            .collect();
        ms.sort_by(f64::total_cmp);
        ms
    };
    let first_commit = commits.values().copied().fold(f64::INFINITY, f64::min);
    let last_arrival = commits.keys().map(|id| seen[id].consumed).fold(0.0, f64::max);
    let result = Latency {
        achieved,
        delivered: commits.len() as f64 / (last_arrival - first_commit),
        consumed_ms: sorted_ms(|a| a.consumed),
        appended_ms: sorted_ms(|a| a.appended),
        metrics,
        cpu_us_per_event,
        steady_cpu_us_per_event,
    };
    (result, running)
}

/// One start-up: seconds from the process's start to the waiting event's
/// append in Kafka and to its arrival at the consumer, and the CPU seconds
/// spent by then.
#[derive(Clone, Copy)]
struct Startup {
    appended_s: f64,
    consumed_s: f64,
    cpu_s: f64,
}

/// Start-up, `rounds` times: the relay stopped, one event waiting, the
/// slot and topic in place.
async fn startup(
    client: &tokio_postgres::Client,
    s: &Setting,
    running: &mut Running,
    kind: Kind,
    rounds: usize,
) -> Vec<Startup> {
    eprintln!("bench: {} start-up, {rounds} rounds", kind.name());
    let topic = format!("latency-{}", kind.name());
    let mut out = Vec::new();
    for _ in 0..rounds {
        tokio::task::block_in_place(|| running.stop());
        let id = insert_one(client, "bench.startup").await;
        let watcher = Watcher::from_end(&s.brokers, &topic, PARTITIONS);
        tokio::task::block_in_place(|| running.restart());
        let arrived = tokio::task::block_in_place(|| watcher.wait_for(&id, Duration::from_secs(120)))
            .unwrap_or_else(|| {
                panic!(
                    "{} did not publish the waiting event within 120 s of its start",
                    kind.name()
                )
            });
        let pid = running.pid();
        let started = started_at(pid);
        out.push(Startup {
            appended_s: arrived.appended - started,
            consumed_s: arrived.consumed - started,
            cpu_s: usage(pid).1,
        });
    }
    tokio::task::block_in_place(|| running.stop());
    out
}

/// `pg_recvlogical` over the backlog's WAL from `slot`, stopping at `end`.
fn recvlogical(pg: &PgServer, slot: &str, end: Lsn) -> f64 {
    recvlogical_on(pg, slot, end, "bench_pub")
}

/// [`recvlogical`] through `publication`.
fn recvlogical_on(pg: &PgServer, slot: &str, end: Lsn, publication: &str) -> f64 {
    let t = Instant::now();
    let status = Command::new(pg.bin_dir.join("pg_recvlogical"))
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &pg.port.to_string(),
            "-U",
            "postgres",
            "-d",
            "postgres",
        ])
        .args([
            "--slot",
            slot,
            "--start",
            "-o",
            "proto_version=1",
            "-o",
            &format!("publication_names={publication}"),
        ])
        .args(["-E", &end.to_string(), "-f", "/dev/null", "--no-loop"])
        .status()
        .unwrap();
    assert!(status.success(), "pg_recvlogical failed");
    t.elapsed().as_secs_f64()
}

/// Polling mode until no row is left unpublished.
async fn polling(client: &tokio_postgres::Client, s: &Setting) -> f64 {
    eprintln!("bench: polling mode");
    let mut running = Kind::Polling.start(s, "unused", "drain-polling");
    let start = started_at(running.pid());
    loop {
        // EXISTS uses the partial index; count(*) would scan the table.
        let left: bool = client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM outbox WHERE published_at IS NULL)",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if !left {
            break;
        }
        assert!(unix_now() - start < 3600.0, "polling did not finish");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let secs = unix_now() - start;
    tokio::task::block_in_place(|| running.stop());
    secs
}

/// One relay's figures for the side-by-side table.
struct Figures {
    drain: Drain,
    latency: Latency,
    startup: Vec<Startup>,
}

impl Figures {
    fn startup_median(&self, f: fn(&Startup) -> f64) -> f64 {
        median(&self.startup.iter().map(f).collect::<Vec<_>>())
    }

    /// Process start → the waiting event appended in Kafka (median).
    fn startup_s(&self) -> f64 {
        self.startup_median(|r| r.appended_s)
    }

    fn startup_cpu_s(&self) -> f64 {
        self.startup_median(|r| r.cpu_s)
    }

    fn startup_json(&self) -> Value {
        json!({"to_log_append_seconds": self.startup.iter().map(|r| r.appended_s).collect::<Vec<_>>(),
               "to_consumed_seconds": self.startup.iter().map(|r| r.consumed_s).collect::<Vec<_>>(),
               "median_to_log_append_seconds": self.startup_s(),
               "median_to_consumed_seconds": self.startup_median(|r| r.consumed_s),
               "median_cpu_seconds": self.startup_cpu_s()})
    }

    fn json(&self, events: usize) -> Value {
        json!({"drain": self.drain.json(events), "latency": self.latency.json(), "startup": self.startup_json()})
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if let Ok(spec) = std::env::var(ceiling::ENV) {
        ceiling::child(&spec).await;
        return;
    }
    let a = args();
    let n = a.events;
    // OUTBOXD_BENCH_KEEP=1 keeps the relays' configs and logs;
    // OUTBOXD_BENCH_LOG sets outboxd's log level (default info).
    let keep = std::env::var_os("OUTBOXD_BENCH_KEEP").is_some();
    let dir = tempfile::Builder::new()
        .prefix("outboxd-bench-")
        .disable_cleanup(keep)
        .tempdir()
        .unwrap();
    if keep {
        eprintln!("bench: keeping the relays' files in {}", dir.path().display());
    }
    eprintln!("bench: starting PostgreSQL and the broker");
    let pg = dedicated("");
    let broker = dedicated_broker();
    let mut client = pg.client("postgres").await;
    outbox_sdk::migrate::migrate(&mut client).await.unwrap();
    let spans = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let otlp_endpoint = span_receiver(spans.clone()).await;
    let s = Setting {
        otlp_endpoint,
        pg_port: pg.port,
        brokers: broker.brokers.clone(),
        broker_pids: broker.pids(),
        dir: dir.path().to_owned(),
        publication: "bench_pub".into(),
        outboxd_kafka: a.outboxd_kafka.clone(),
        exactly_once_settings: a.exactly_once_settings.clone(),
        registry_url: a.avro.then(|| harness::registry::registry().url.clone()),
    };
    if a.only_topics {
        let out_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench");
        std::fs::create_dir_all(&out_dir).unwrap();
        let results = json!({"topics": topics::run(&mut client, &pg, &s, n, a.debezium).await});
        std::fs::write(
            out_dir.join("topics.json"),
            serde_json::to_string_pretty(&results).unwrap(),
        )
        .unwrap();
        broker.kill();
        return;
    }
    if a.only_mapping {
        let out_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench");
        std::fs::create_dir_all(&out_dir).unwrap();
        let results = json!({"mapping": mapping::run(&mut client, &s, n).await});
        std::fs::write(
            out_dir.join("mapping.json"),
            serde_json::to_string_pretty(&results).unwrap(),
        )
        .unwrap();
        broker.kill();
        return;
    }
    if a.only_replicas {
        let out_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench");
        std::fs::create_dir_all(&out_dir).unwrap();
        let results = json!({"replicas": replicas::run(&mut client, &s, n).await});
        std::fs::write(
            out_dir.join("replicas.json"),
            serde_json::to_string_pretty(&results).unwrap(),
        )
        .unwrap();
        broker.kill();
        return;
    }
    if a.only_sources {
        let out_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench");
        std::fs::create_dir_all(&out_dir).unwrap();
        let results = json!({"sources": sources::run(&mut client, &s, n).await});
        std::fs::write(
            out_dir.join("sources.json"),
            serde_json::to_string_pretty(&results).unwrap(),
        )
        .unwrap();
        broker.kill();
        return;
    }
    let mut kinds = vec![Kind::Outboxd];
    if a.exactly_once {
        kinds.push(Kind::OutboxdExactlyOnce);
    }
    if a.tracing {
        kinds.push(Kind::OutboxdTraced);
    }
    if let Some(url) = &s.registry_url {
        kinds.push(Kind::OutboxdAvro);
        eprintln!("bench: Schema Registry at {url}");
        let registry = harness::registry::registry();
        registry.register("drain-outboxd_avro-value", "AVRO", BENCH_AVRO_SCHEMA);
        // The latency load writes {"i": n}, and the start-up probe {}.
        registry.register("latency-outboxd_avro-value", "AVRO", BENCH_AVRO_LATENCY_SCHEMA);
    }
    if relays::reference_binary().is_some() {
        kinds.push(Kind::Reference);
    }
    if a.debezium {
        kinds.push(Kind::Debezium);
    }
    // Every topic exists beforehand, with 3 partitions, for every relay.
    let mut topics = vec![
        "drain-polling".to_owned(),
        "warm-up".to_owned(),
        "ceiling".to_owned(),
    ];
    for k in &kinds {
        topics.push(format!("drain-{}", k.name()));
        topics.push(format!("latency-{}", k.name()));
    }
    {
        let brokers = s.brokers.clone();
        tokio::task::spawn_blocking(move || {
            create_topics_with(&brokers, &topics, &[("message.timestamp.type", "LogAppendTime")])
        })
        .await
        .unwrap();
    }
    // Every slot at the same point, before the backlog.
    client
        .batch_execute("CREATE PUBLICATION bench_pub FOR TABLE outbox WITH (publish = 'insert')")
        .await
        .unwrap();
    for slot in ["bench_recv", "bench_recv_after"] {
        create_slot(&client, slot).await;
    }
    for k in &kinds {
        create_slot(&client, &format!("drain_{}", k.name())).await;
    }
    let start_lsn = lsn(&client, "SELECT pg_current_wal_lsn()::text").await;
    eprintln!("bench: writing {n} rows, 100 per transaction");
    let t = Instant::now();
    let last_txn = write_backlog(&mut client, n).await;
    let end = lsn(&client, "SELECT pg_current_wal_lsn()::text").await;
    let write_secs = t.elapsed().as_secs_f64();
    let wal_mb = end.bytes_since(start_lsn) as f64 / 1048576.0;
    eprintln!("bench: wrote {wal_mb:.0} MB of WAL in {write_secs:.1}s");

    // The broker's first loads are slower (its JIT, its page cache): the
    // ceiling's producer warms it with the same records before anything
    // is measured, round after round until two rounds in a row agree
    // within 10% (at most WARM_UP_ROUNDS), so that the first drain meets
    // a warm broker. One round was not enough: the drains made minutes
    // later, in the scaling table, ran up to 45% faster on the same rows.
    // (Waiting for the broker's JIT compiler to settle, as the many-topics
    // run does, did not end here: with one topic a round costs the broker
    // 0.2–0.5 s, and the compiler's bursts of 0.1–0.3 s kept coming after
    // 40 rounds. Each drain reports what the compiler took.)
    eprintln!("bench: warming the broker");
    let mut warm_rates = Vec::new();
    let warm = loop {
        let round = ceiling::run(&s.brokers, "warm-up", n.min(200_000), &s.outboxd_kafka);
        eprintln!("bench: warm-up: {:.0} events/s", round.rate());
        let steady = warm_rates
            .last()
            .is_some_and(|last: &f64| (round.rate() - last).abs() <= 0.1 * last);
        warm_rates.push(round.rate());
        if steady || warm_rates.len() >= WARM_UP_ROUNDS {
            break round;
        }
    };
    // b, then a: pg_recvlogical before and after the relays, so neither
    // side gets the warmer cache; the faster run is the decoding limit.
    eprintln!("bench: pg_recvlogical (before)");
    let recv_before = recvlogical(&pg, "bench_recv", end);
    // The first drain meets a broker that has not served a load yet; with
    // OUTBOXD_BENCH_REFERENCE_FIRST the reference binary takes that place
    // (with OUTBOXD_BENCH_AVRO_FIRST, the Avro run).
    let mut order = kinds.clone();
    if std::env::var_os("OUTBOXD_BENCH_REFERENCE_FIRST").is_some() {
        order.sort_by_key(|k| *k != Kind::Reference);
    }
    // OUTBOXD_BENCH_AVRO_FIRST: the Avro run drains first, so that a
    // second run can show the order did not make the ratio.
    if std::env::var_os("OUTBOXD_BENCH_AVRO_FIRST").is_some() {
        order.sort_by_key(|k| *k != Kind::OutboxdAvro);
    }
    let mut drained = HashMap::new();
    for &k in &order {
        let (slot, topic) = (format!("drain_{}", k.name()), format!("drain-{}", k.name()));
        drained.insert(k, drain(&client, &s, k, &slot, &topic, last_txn, n).await);
        drop_slot(&client, &slot).await;
    }
    let drains: Vec<Drain> = kinds.iter().map(|k| drained.remove(k).unwrap()).collect();
    eprintln!("bench: pg_recvlogical (after)");
    let recv_after = recvlogical(&pg, "bench_recv_after", end);
    let recv_secs = recv_before.min(recv_after);
    // The Kafka side's limit: the same records, no PostgreSQL.
    eprintln!("bench: produce ceiling (outboxd's producer, records built in memory)");
    let ceiling = ceiling::run(&s.brokers, "ceiling", n, &s.outboxd_kafka);
    for slot in ["bench_recv", "bench_recv_after"] {
        drop_slot(&client, slot).await;
    }

    // c. polling mode drains the same rows.
    let poll_secs = polling(&client, &s).await;
    client.batch_execute("TRUNCATE outbox").await.unwrap();

    // d and e, for each relay in turn.
    let mut figures = Vec::new();
    for (&k, drain) in kinds.iter().zip(drains) {
        let (latency, mut running) = latency(&pg, &client, &s, k, &a).await;
        let startup = startup(&client, &s, &mut running, k, a.startup_rounds).await;
        drop(running);
        drop_slot(&client, &format!("latency_{}", k.name())).await;
        figures.push(Figures {
            drain,
            latency,
            startup,
        });
    }
    let fig = |k: Kind| kinds.iter().position(|x| *x == k).map(|i| &figures[i]);
    let o = &figures[0];
    let hist = ack_histogram(&o.latency.metrics);
    let ack_p50 = histogram_quantile(&hist, 0.5) * 1000.0;
    let ack_p99 = histogram_quantile(&hist, 0.99) * 1000.0;
    let drain_rate = o.drain.rate(n);
    let recv_rate = n as f64 / recv_secs;
    let poll_rate = n as f64 / poll_secs;
    let mut results = json!({
        "events": n,
        "wal_mb": wal_mb,
        "outboxd_kafka_settings": a.outboxd_kafka,
        "exactly_once_settings": a.exactly_once_settings,
        "drain": o.drain.json(n),
        "pg_recvlogical": {"seconds": recv_secs, "events_per_second": recv_rate,
                           "seconds_before_outboxd": recv_before, "seconds_after_outboxd": recv_after},
        "polling": {"seconds": poll_secs, "events_per_second": poll_rate},
        "ratios": {"outboxd_to_pg_recvlogical": drain_rate / recv_rate, "outboxd_to_polling": drain_rate / poll_rate,
                   "outboxd_to_ceiling": drain_rate / ceiling.rate(),
                   "outboxd_to_slower_limit": drain_rate / ceiling.rate().min(recv_rate)},
        "ceiling": ceiling.json(),
        "warm_up": warm.json(),
        "warm_up_rounds_events_per_second": warm_rates,
        "latency": {"target_events_per_second": a.rate, "achieved_events_per_second": o.latency.achieved, "seconds": a.latency_secs,
                    "commit_to_ack_ms": {"p50": ack_p50, "p99": ack_p99, "samples": hist.last().map_or(0.0, |b| b.1)},
                    "commit_to_consumed_ms": o.latency.json()["commit_to_consumed_ms"],
                    "commit_to_log_append_ms": o.latency.json()["commit_to_log_append_ms"]},
        "startup": o.startup_json(),
    });
    if let Some(e) = fig(Kind::OutboxdExactlyOnce) {
        results["exactly_once"] = e.json(n);
        results["vs_at_least_once"] = json!({
            "events": n,
            "at_least_once_drain_events_per_s": o.drain.rate(n), "exactly_once_drain_events_per_s": e.drain.rate(n),
            "drain_ratio": e.drain.rate(n) / o.drain.rate(n),
            "at_least_once_p99_ms": o.latency.p(0.99), "exactly_once_p99_ms": e.latency.p(0.99),
            "at_least_once_p50_ms": o.latency.p(0.5), "exactly_once_p50_ms": e.latency.p(0.5),
            "exactly_once_kafka_commit_ms": {
                "p50": histogram_quantile(&commit_histogram(&e.latency.metrics), 0.5) * 1000.0,
                "p99": histogram_quantile(&commit_histogram(&e.latency.metrics), 0.99) * 1000.0,
            },
            "at_least_once_peak_rss_mib": o.drain.rss_mib, "exactly_once_peak_rss_mib": e.drain.rss_mib,
            "at_least_once_cpu_s_per_100k": o.drain.cpu_per_100k(n), "exactly_once_cpu_s_per_100k": e.drain.cpu_per_100k(n),
        });
    }
    let spans_received = spans.load(std::sync::atomic::Ordering::Relaxed);
    if let Some(r) = fig(Kind::Reference) {
        results["reference"] = r.json(n);
        results["reference"]["binary"] = json!(relays::reference_binary());
        results["vs_reference"] = json!({
            "events": n,
            "this_drain_events_per_s": o.drain.rate(n), "reference_drain_events_per_s": r.drain.rate(n),
            "drain_ratio": o.drain.rate(n) / r.drain.rate(n),
            "this_peak_rss_mib": o.drain.rss_mib, "reference_peak_rss_mib": r.drain.rss_mib,
            "this_cpu_s_per_100k": o.drain.cpu_per_100k(n), "reference_cpu_s_per_100k": r.drain.cpu_per_100k(n),
            "this_p99_ms": o.latency.p(0.99), "reference_p99_ms": r.latency.p(0.99),
        });
    }
    if let Some(v) = fig(Kind::OutboxdAvro) {
        results["avro"] = v.json(n);
        results["avro_vs_json"] = json!({
            "events": n,
            "json_drain_events_per_s": o.drain.rate(n), "avro_drain_events_per_s": v.drain.rate(n),
            "drain_ratio": v.drain.rate(n) / o.drain.rate(n),
            "json_cpu_s_per_100k": o.drain.cpu_per_100k(n), "avro_cpu_s_per_100k": v.drain.cpu_per_100k(n),
            "json_peak_rss_mib": o.drain.rss_mib, "avro_peak_rss_mib": v.drain.rss_mib,
            "json_p99_ms": o.latency.p(0.99), "avro_p99_ms": v.latency.p(0.99),
        });
    }
    if let Some(t) = fig(Kind::OutboxdTraced) {
        results["tracing"] = t.json(n);
        results["tracing_vs_off"] = json!({
            "events": n, "spans_received": spans_received,
            "off_drain_events_per_s": o.drain.rate(n), "on_drain_events_per_s": t.drain.rate(n),
            "drain_ratio": t.drain.rate(n) / o.drain.rate(n),
            "off_peak_rss_mib": o.drain.rss_mib, "on_peak_rss_mib": t.drain.rss_mib,
            "off_cpu_s_per_100k": o.drain.cpu_per_100k(n), "on_cpu_s_per_100k": t.drain.cpu_per_100k(n),
        });
    }
    if let Some(d) = fig(Kind::Debezium) {
        results["debezium"] = d.json(n);
        results["debezium"]["version"] = json!(harness::debezium::version());
        results["debezium"]["connector_tuning"] = json!(relays::DEBEZIUM_TUNING);
        results["vs_debezium"] = json!({
            "events": n,
            "outboxd_drain_events_per_s": o.drain.rate(n), "debezium_drain_events_per_s": d.drain.rate(n),
            "outboxd_peak_rss_mib": o.drain.rss_mib, "debezium_peak_rss_mib": d.drain.rss_mib,
            "outboxd_cpu_s_per_100k": o.drain.cpu_per_100k(n), "debezium_cpu_s_per_100k": d.drain.cpu_per_100k(n),
            "outboxd_p99_ms": o.latency.p(0.99), "debezium_p99_ms": d.latency.p(0.99),
            "outboxd_p50_ms": o.latency.p(0.5), "debezium_p50_ms": d.latency.p(0.5),
            "outboxd_log_append_p99_ms": percentile(&o.latency.appended_ms, 0.99),
            "debezium_log_append_p99_ms": percentile(&d.latency.appended_ms, 0.99),
            "outboxd_startup_s": o.startup_s(), "debezium_startup_s": d.startup_s(),
            "outboxd_startup_cpu_s": o.startup_cpu_s(), "debezium_startup_cpu_s": d.startup_cpu_s(),
        });
    }
    let out_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench");
    std::fs::create_dir_all(&out_dir).unwrap();
    std::fs::write(
        out_dir.join("results.json"),
        serde_json::to_string_pretty(&results).unwrap(),
    )
    .unwrap();

    println!("| measure | result |");
    println!("|---|---|");
    println!("| backlog | {n} events, {wal_mb:.0} MB of WAL, 100 rows per transaction |");
    println!(
        "| outboxd drain | {:.2} s, {drain_rate:.0} events/s (all {n} events verified in Kafka) |",
        o.drain.secs()
    );
    println!(
        "| pg_recvlogical (decoding limit) | {recv_secs:.2} s, {recv_rate:.0} events/s (runs before/after the relays: {recv_before:.2} s / {recv_after:.2} s) |"
    );
    println!(
        "| produce ceiling (outboxd's producer, records in memory, no PostgreSQL) | {:.2} s, {:.0} events/s, {:.2} core-s per 100k events, {:.1} MiB |",
        ceiling.seconds,
        ceiling.rate(),
        ceiling.cpu_per_100k(),
        ceiling.rss_mib
    );
    println!("| polling mode (defaults: 500 rows per round) | {poll_secs:.2} s, {poll_rate:.0} events/s |");
    println!(
        "| outboxd / pg_recvlogical | {:.2} (target ≥ 1.0) |",
        drain_rate / recv_rate
    );
    println!(
        "| outboxd / slower of pg_recvlogical and the ceiling | {:.2} (target ≥ 0.9) |",
        drain_rate / ceiling.rate().min(recv_rate)
    );
    println!(
        "| outboxd / polling | {:.1} (target ≥ 10) |",
        drain_rate / poll_rate
    );
    println!("| outboxd peak RSS | {:.1} MiB |", o.drain.rss_mib);
    println!(
        "| outboxd CPU | {:.2} s, {:.2} core-s per 100k events (target ≤ 0.8) |",
        o.drain.cpu_s,
        o.drain.cpu_per_100k(n)
    );
    println!(
        "| latency load | {:.0} events/s for {} s (single-row transactions) |",
        o.latency.achieved, a.latency_secs
    );
    println!("| commit → Kafka ack (outboxd histogram) | p50 {ack_p50:.1} ms, p99 {ack_p99:.1} ms (target p99 ≤ 25) |");
    println!(
        "| outboxd CPU per event under load / at a steady {STEADY_RATE}/s | {:.1} µs / {:.1} µs (target at {STEADY_RATE}/s ≤ 50) |",
        o.latency.cpu_us_per_event, o.latency.steady_cpu_us_per_event
    );
    println!(
        "| commit → consumed (per event, upper bound) | p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms |",
        o.latency.p(0.5),
        o.latency.p(0.99),
        o.latency.consumed_ms.last().copied().unwrap_or(f64::NAN),
    );
    println!(
        "| commit → appended in Kafka (broker's LogAppendTime) | p50 {:.1} ms, p99 {:.1} ms |",
        percentile(&o.latency.appended_ms, 0.5),
        percentile(&o.latency.appended_ms, 0.99)
    );
    println!(
        "| start-up: process start → waiting event appended in Kafka / consumed | median {:.0} ms / {:.0} ms of {} (target < 100 ms) |",
        o.startup_s() * 1000.0,
        o.startup_median(|r| r.consumed_s) * 1000.0,
        o.startup.len()
    );
    if let Some(e) = fig(Kind::OutboxdExactlyOnce) {
        exactly_once_beside(n, o, e);
    }
    if let Some(t) = fig(Kind::OutboxdTraced) {
        tracing_beside(n, o, t, spans_received);
    }
    if let Some(v) = fig(Kind::OutboxdAvro) {
        beside(
            n,
            "Avro (registered schema) vs JSON (envelope)",
            ("JSON", o),
            ("Avro", v),
        );
    }
    if let Some(r) = fig(Kind::Reference) {
        reference_beside(n, o, r);
    }
    if let Some(d) = fig(Kind::Debezium) {
        side_by_side(n, o, d);
    }
    if a.sources {
        results["sources"] = sources::run(&mut client, &s, n).await;
        std::fs::write(
            out_dir.join("results.json"),
            serde_json::to_string_pretty(&results).unwrap(),
        )
        .unwrap();
    }
    if a.scaling {
        results["scaling"] = json!(scaling::run(&mut client, &s).await);
        std::fs::write(
            out_dir.join("results.json"),
            serde_json::to_string_pretty(&results).unwrap(),
        )
        .unwrap();
    }
    broker.kill();
}

/// Counts the spans outboxd exports (see `harness::otlp`). Returns the
/// endpoint.
async fn span_receiver(count: std::sync::Arc<std::sync::atomic::AtomicU64>) -> String {
    harness::otlp::receiver(move |_, _| {
        count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    })
    .await
}

/// This outboxd beside the reference binary, both with the plain
/// configuration, on the same backlog and load.
fn reference_beside(n: usize, o: &Figures, r: &Figures) {
    beside(
        n,
        "this build vs the reference binary",
        ("reference", r),
        ("this build", o),
    );
}

/// outboxd with a span per event beside outboxd with tracing off, on the
/// same backlog (every row carries a sampled `traceparent`).
fn tracing_beside(n: usize, o: &Figures, t: &Figures, spans: u64) {
    beside(n, "tracing on vs off", ("off", o), ("on (a span per event)", t));
    println!("| spans received by the OTLP receiver (drain, latency and start-up runs) | | {spans} | |");
}

/// Two outboxd runs side by side: drain rate, peak RSS and CPU of the
/// backlog drain, and the latency p99, with the second's ratio to the first.
fn beside(n: usize, title: &str, (a_name, a): (&str, &Figures), (b_name, b): (&str, &Figures)) {
    println!();
    println!("| outboxd: {title} | {a_name} | {b_name} | ratio |");
    println!("|---|---|---|---|");
    let rows = [
        ("drain of events", a.drain.rate(n), b.drain.rate(n), "events/s"),
        ("peak RSS", a.drain.rss_mib, b.drain.rss_mib, "MiB"),
        (
            "CPU per 100k events",
            a.drain.cpu_per_100k(n),
            b.drain.cpu_per_100k(n),
            "core-s",
        ),
    ];
    for (what, x, y, unit) in rows {
        println!("| {what} | {x:.2} {unit} | {y:.2} {unit} | {:.2}× |", y / x);
    }
    println!(
        "| commit → consumed p99 at {:.0}/s | {:.1} ms | {:.1} ms | |",
        b.latency.achieved,
        a.latency.p(0.99),
        b.latency.p(0.99)
    );
}

/// outboxd's exactly-once delivery beside its at-least-once delivery, on
/// the same backlog and the same load.
fn exactly_once_beside(n: usize, o: &Figures, e: &Figures) {
    println!();
    println!("| outboxd: exactly-once vs at-least-once | at-least-once | exactly-once | ratio | goal |");
    println!("|---|---|---|---|---|");
    let drain = e.drain.rate(n) / o.drain.rate(n);
    println!(
        "| drain of {n} events | {:.0} events/s | {:.0} events/s | {drain:.2}× | ≥ 0.8× {} |",
        o.drain.rate(n),
        e.drain.rate(n),
        if drain >= 0.8 { "✅" } else { "❌" }
    );
    let p99 = e.latency.p(0.99);
    println!(
        "| commit → consumed p99 (read_committed) at {:.0}/s | {:.1} ms | {p99:.1} ms | | ≤ 50 ms {} |",
        e.latency.achieved,
        o.latency.p(0.99),
        if p99 <= 50.0 { "✅" } else { "❌" }
    );
    println!(
        "| commit → consumed p50 | {:.1} ms | {:.1} ms | | |",
        o.latency.p(0.5),
        e.latency.p(0.5)
    );
    let commits = commit_histogram(&e.latency.metrics);
    println!(
        "| Kafka commit (progress record → committed), p50 / p99 | | {:.1} / {:.1} ms | | |",
        histogram_quantile(&commits, 0.5) * 1000.0,
        histogram_quantile(&commits, 0.99) * 1000.0
    );
    println!(
        "| peak RSS (drain) | {:.1} MiB | {:.1} MiB | | |",
        o.drain.rss_mib, e.drain.rss_mib
    );
    println!(
        "| CPU per 100k events (drain) | {:.2} s | {:.2} s | | |",
        o.drain.cpu_per_100k(n),
        e.drain.cpu_per_100k(n)
    );
}

/// The table of outboxd beside Debezium, with the ratios.
fn side_by_side(n: usize, o: &Figures, d: &Figures) {
    println!();
    println!(
        "| outboxd vs Debezium {} | outboxd | Debezium | ratio | goal |",
        harness::debezium::version()
    );
    println!("|---|---|---|---|---|");
    // The ratio is outboxd's advantage: above 1 where outboxd is better.
    let row = |what: &str, o: f64, d: f64, unit: &str, higher_is_better: bool, goal: Option<f64>| {
        let ratio = if higher_is_better { o / d } else { d / o };
        let goal = match goal {
            Some(g) if ratio >= g => format!("≥ {g}× ✅"),
            Some(g) => format!("≥ {g}× ❌"),
            None => String::new(),
        };
        println!("| {what} | {o:.2} {unit} | {d:.2} {unit} | {ratio:.1}× | {goal} |");
    };
    row(
        &format!("drain of {n} events"),
        o.drain.rate(n),
        d.drain.rate(n),
        "events/s",
        true,
        Some(5.0),
    );
    println!(
        "| drain: to the slot confirmed / all in Kafka | {:.2} s / {:.2} s | {:.2} s / {:.2} s | | |",
        o.drain.confirmed_s, o.drain.in_kafka_s, d.drain.confirmed_s, d.drain.in_kafka_s
    );
    row(
        "peak RSS (drain)",
        o.drain.rss_mib,
        d.drain.rss_mib,
        "MiB",
        false,
        Some(20.0),
    );
    row(
        "CPU per 100k events (drain, start-up included)",
        o.drain.cpu_per_100k(n),
        d.drain.cpu_per_100k(n),
        "s",
        false,
        Some(10.0),
    );
    row(
        "commit → consumed p99",
        o.latency.p(0.99),
        d.latency.p(0.99),
        "ms",
        false,
        Some(10.0),
    );
    row(
        "commit → consumed p50",
        o.latency.p(0.5),
        d.latency.p(0.5),
        "ms",
        false,
        None,
    );
    row(
        &format!("delivered under the {:.0}/s load", o.latency.achieved),
        o.latency.delivered,
        d.latency.delivered,
        "events/s",
        true,
        None,
    );
    row(
        "commit → appended in Kafka p99 (LogAppendTime)",
        percentile(&o.latency.appended_ms, 0.99),
        percentile(&d.latency.appended_ms, 0.99),
        "ms",
        false,
        None,
    );
    row(
        "start-up to the first event in Kafka (median)",
        o.startup_s(),
        d.startup_s(),
        "s",
        false,
        Some(10.0),
    );
    row(
        "CPU spent starting (median)",
        o.startup_cpu_s(),
        d.startup_cpu_s(),
        "s",
        false,
        None,
    );
}

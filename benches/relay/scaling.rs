//! Cost as work grows (`--scaling`): outboxd alone drains backlogs of
//! 200k, 1M and 5M standard events (rate and peak RSS should stay flat),
//! 200k events with 100-byte, 1 KB and 10 KB payloads, and 200k standard
//! events over 50 and 200 aggregate types (50 and 200 topics, made
//! beforehand). Each case
//! gets a fresh table, a slot made just before its backlog, and the same
//! drain measure as the main run.

use serde_json::{json, Value};

use super::relays::{Kind, Setting};
use super::{create_slot, drain_into, drop_slot, harness, write_rows, Shape, PARTITIONS};

/// One case of the table.
struct Case {
    events: usize,
    shape: Shape,
}

const fn case(events: usize, payload: Option<usize>, types: usize) -> Case {
    Case {
        events,
        shape: Shape { payload, types },
    }
}

const CASES: &[Case] = &[
    case(200_000, None, 1),
    case(1_000_000, None, 1),
    case(5_000_000, None, 1),
    case(200_000, Some(100), 1),
    case(200_000, Some(1_000), 1),
    case(200_000, Some(10_000), 1),
    case(200_000, None, 50),
    case(200_000, None, 200),
];

/// Runs every case; one JSON object each, and a markdown table on stdout.
pub async fn run(client: &mut tokio_postgres::Client, s: &Setting) -> Vec<Value> {
    let (mut rows, mut out) = (Vec::new(), Vec::new());
    // OUTBOXD_BENCH_SCALING_CASES=0,6 runs only those cases (by index).
    let only: Option<Vec<usize>> = std::env::var("OUTBOXD_BENCH_SCALING_CASES").ok().map(|v| {
        v.split(',')
            .map(|i| match i.trim().parse::<usize>() {
                Ok(i) if i < CASES.len() => i,
                _ => panic!(
                    "OUTBOXD_BENCH_SCALING_CASES={v:?}: each entry is a case index below {}",
                    CASES.len()
                ),
            })
            .collect()
    });
    for (i, c) in CASES.iter().enumerate() {
        if only.as_ref().is_some_and(|o| !o.contains(&i)) {
            continue;
        }
        let (slot, route) = (format!("scale_{i}"), format!("scale{i}-{{aggregate_type}}"));
        let topics: Vec<String> = if c.shape.types > 1 {
            (0..c.shape.types).map(|t| format!("scale{i}-t{t}")).collect()
        } else {
            vec![format!("scale{i}-order")]
        };
        {
            let (brokers, topics) = (s.brokers.clone(), topics.clone());
            tokio::task::spawn_blocking(move || harness::broker::create_topics_with(&brokers, &topics, &[]))
                .await
                .unwrap();
        }
        client.batch_execute("TRUNCATE outbox").await.unwrap();
        create_slot(client, &slot).await;
        eprintln!(
            "bench: scaling: {} events, payload {:?}, {} aggregate types",
            c.events, c.shape.payload, c.shape.types
        );
        let target = write_rows(client, c.events, c.shape).await;
        let d = drain_into(client, s, Kind::Outboxd, &slot, &route, &topics, target, c.events).await;
        drop_slot(client, &slot).await;
        let payload = c.shape.payload.map_or("~300 B".to_owned(), |b| format!("{b} B"));
        rows.push((
            c.events,
            payload.clone(),
            c.shape.types,
            d.rate(c.events),
            d.rss_mib,
            d.cpu_per_100k(c.events),
        ));
        let mut v = d.json(c.events);
        v["events"] = json!(c.events);
        v["payload"] = json!(payload);
        v["aggregate_types"] = json!(c.shape.types);
        v["partitions_per_topic"] = json!(PARTITIONS);
        out.push(v);
    }
    println!("| events | payload | aggregate types (topics) | drain | peak RSS | CPU per 100k events |");
    println!("|---|---|---|---|---|---|");
    for (events, payload, types, rate, rss, cpu) in &rows {
        println!("| {events} | {payload} | {types} | {rate:.0} events/s | {rss:.1} MiB | {cpu:.2} core-s |");
    }
    out
}

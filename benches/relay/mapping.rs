//! A table read through `[columns]` beside outboxd's own (`--only-mapping`):
//! the same rows (the standard ~300-byte orders, 100 per transaction) in
//! `outbox` and in `mapped_outbox`, whose columns are all named otherwise
//! and which has two more columns placed as headers. outboxd drains each,
//! alternating default, mapped, default, mapped, each drain on a slot of
//! its own made before the backlogs; the medians of the two are compared.
//! What the map costs per row: resolving positions once per relation,
//! reading two more columns, two more headers.

use serde_json::{json, Value};

use super::relays::{Kind, Setting};
use super::{create_slot, drain_into, drop_slot, harness, write_rows_as, Shape};
use crate::measure::median;

/// The mapped table.
pub const TABLE: &str = "mapped_outbox";

/// Its publication.
pub const PUBLICATION: &str = "bench_mapped_pub";

/// outboxd's `[columns]` for it.
pub const COLUMNS: &str = r#"
[columns]
id = "event_id"
key = "entity_id"
route = "entity"
type = "event_name"
payload = "body"
headers = "meta"
timestamp = "occurred"
additional = [
  { column = "tenant", placement = "header", name = "tenantId" },
  { column = "region", placement = "header" },
]
"#;

/// Rounds of each (alternating).
const ROUNDS: usize = 2;

pub async fn run(client: &mut tokio_postgres::Client, s: &Setting, n: usize) -> Value {
    client
        .batch_execute(&format!(
            "CREATE TABLE IF NOT EXISTS {TABLE} (
                 event_id uuid PRIMARY KEY,
                 entity text NOT NULL,
                 entity_id text NOT NULL,
                 event_name text NOT NULL,
                 body jsonb NOT NULL,
                 meta jsonb,
                 occurred timestamptz NOT NULL DEFAULT clock_timestamp(),
                 tenant text,
                 region text);
             CREATE PUBLICATION {PUBLICATION} FOR TABLE {TABLE} WITH (publish = 'insert');
             CREATE PUBLICATION bench_pub FOR TABLE outbox WITH (publish = 'insert');"
        ))
        .await
        .unwrap();
    let runs: Vec<(Kind, String)> = (0..ROUNDS)
        .flat_map(|i| {
            [
                (Kind::Outboxd, format!("map_default_{i}")),
                (Kind::OutboxdMapped, format!("map_mapped_{i}")),
            ]
        })
        .collect();
    let topics: Vec<String> = runs.iter().map(|(_, slot)| slot.replace('_', "-")).collect();
    {
        let (brokers, topics) = (s.brokers.clone(), topics.clone());
        tokio::task::spawn_blocking(move || {
            harness::broker::create_topics_with(
                &brokers,
                &topics,
                &[("message.timestamp.type", "LogAppendTime")],
            )
        })
        .await
        .unwrap();
    }
    for (_, slot) in &runs {
        create_slot(client, slot).await;
    }
    eprintln!("bench: writing {n} rows into outbox and {n} into {TABLE}");
    let default_end = super::write_rows(client, n, Shape::STANDARD).await;
    let mapped_end = write_rows_as(
        client,
        &format!("{TABLE} (event_id, entity, entity_id, event_name, body, meta, tenant, region)"),
        ", 'tenant-' || (g % 7), 'eu-west-' || (g % 3)",
        n,
        Shape::STANDARD,
    )
    .await;
    let mut default_rates = Vec::new();
    let mut mapped_rates = Vec::new();
    let mut default_cpu = Vec::new();
    let mut mapped_cpu = Vec::new();
    let mut rounds = Vec::new();
    for ((kind, slot), topic) in runs.iter().zip(&topics) {
        let target = if *kind == Kind::Outboxd {
            default_end
        } else {
            mapped_end
        };
        let d = drain_into(
            client,
            s,
            *kind,
            slot,
            topic,
            std::slice::from_ref(topic),
            target,
            n,
        )
        .await;
        drop_slot(client, slot).await;
        eprintln!("bench: {} {:.0} events/s", kind.name(), d.rate(n));
        let (rates, cpu) = if *kind == Kind::Outboxd {
            (&mut default_rates, &mut default_cpu)
        } else {
            (&mut mapped_rates, &mut mapped_cpu)
        };
        rates.push(d.rate(n));
        cpu.push(d.cpu_per_100k(n));
        rounds.push(json!({"relay": kind.name(), "drain": d.json(n)}));
    }
    let (dr, mr) = (median(&default_rates), median(&mapped_rates));
    println!("| table | drain (median of {ROUNDS}) | each | CPU per 100k events |");
    println!("|---|---|---|---|");
    println!(
        "| outboxd's own (`outbox`) | {dr:.0} events/s | {} | {:.2} core-s |",
        default_rates
            .iter()
            .map(|r| format!("{r:.0}"))
            .collect::<Vec<_>>()
            .join(", "),
        median(&default_cpu)
    );
    println!(
        "| through `[columns]` (renamed, two header placements) | {mr:.0} events/s | {} | {:.2} core-s |",
        mapped_rates
            .iter()
            .map(|r| format!("{r:.0}"))
            .collect::<Vec<_>>()
            .join(", "),
        median(&mapped_cpu)
    );
    println!("| mapped ÷ default | {:.3} | | |", mr / dr);
    json!({"events": n, "rounds": rounds, "default_events_per_s": default_rates, "mapped_events_per_s": mapped_rates,
           "default_median": dr, "mapped_median": mr, "ratio": mr / dr,
           "default_cpu_s_per_100k": default_cpu, "mapped_cpu_s_per_100k": mapped_cpu})
}

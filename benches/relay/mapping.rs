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
const ROUNDS: usize = 3;

/// outboxd's own work per row, both shapes, in this process: a pgoutput
/// tuple read through the resolved columns and built into a record, in
/// alternating chunks so that the machine's noise falls on both alike.
/// Returns nanoseconds per row (default, mapped).
fn per_row_cost(rows: usize) -> (f64, f64) {
    use bytes::Bytes;
    use outboxd::config::routing::{RecordValue, TopicTemplate};
    use outboxd::config::{columns::ColumnMap, columns::ColumnsConfig, ValueFormat};
    use outboxd::kafka::records::build_record;
    use outboxd::postgres::pgoutput::{Relation, RelationColumn, TupleValue};
    use outboxd::source::outbox::OutboxColumns;
    let relation = |cols: &[(&str, u32)]| Relation {
        xid: None,
        id: 1,
        namespace: "public".into(),
        name: "t".into(),
        replica_identity: b'd',
        columns: cols
            .iter()
            .map(|(n, oid)| RelationColumn {
                flags: 0,
                name: (*n).into(),
                type_oid: *oid,
                type_modifier: -1,
            })
            .collect(),
    };
    let text = |s: &str| TupleValue::Text(Bytes::copy_from_slice(s.as_bytes()));
    let payload = format!(
        r#"{{"note": "{}", "lines": [{{"qty": 2, "sku": "SKU-1", "price": 1250}}], "orderId": 1234567, "customerId": "c4ca4238a0b923820dcc509a6f75849b"}}"#,
        "n".repeat(150)
    );
    let headers = r#"{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "correlationId": "c4ca4238a0b923820dcc509a6f75849b"}"#;
    let common = vec![
        text("0190a5a4-8c1e-7000-8000-000000000001"),
        text("Order"),
        text("order-1234"),
        text("ordering.order-placed.v1"),
        text(&payload),
        text(headers),
        text("2026-12-05 10:00:00.123456+00"),
    ];
    let default_rel = relation(&[
        ("id", 2950),
        ("aggregate_type", 25),
        ("aggregate_id", 25),
        ("type", 25),
        ("payload", 3802),
        ("headers", 3802),
        ("created_at", 1184),
    ]);
    let mapped_rel = relation(&[
        ("event_id", 2950),
        ("entity", 25),
        ("entity_id", 25),
        ("event_name", 25),
        ("body", 3802),
        ("meta", 3802),
        ("occurred", 1184),
        ("tenant", 25),
        ("region", 25),
    ]);
    let mut mapped_tuple = common.clone();
    mapped_tuple.push(text("tenant-3"));
    mapped_tuple.push(text("eu-west-1"));
    let shape = |columns: &str, rel: &Relation| {
        let c: ColumnsConfig = toml::from_str(columns).unwrap();
        let mut map = ColumnMap::new(&c).unwrap();
        let topic = TopicTemplate::parse("{aggregate_type}.events", true, &mut map, None).unwrap();
        let mut value = RecordValue::of(ValueFormat::Envelope);
        value.placements = map.placements.clone();
        (
            OutboxColumns::from_relation(rel, &map, &[]).unwrap(),
            topic,
            value,
        )
    };
    let mapped_columns = COLUMNS.trim_start().trim_start_matches("[columns]");
    let default = shape("", &default_rel);
    let mapped = shape(mapped_columns, &mapped_rel);
    let commit = chrono::Utc::now();
    let run = |(cols, topic, value): &(OutboxColumns, TopicTemplate, RecordValue),
               tuple: &Vec<TupleValue>,
               n: usize| {
        let start = std::time::Instant::now();
        for _ in 0..n {
            let row = cols.row(tuple, commit).unwrap();
            let rec = build_record(&row, topic, value, commit.timestamp_millis()).unwrap();
            std::hint::black_box(rec);
        }
        start.elapsed().as_nanos() as f64
    };
    let (mut d, mut m) = (0.0, 0.0);
    let chunk = 10_000;
    for _ in 0..rows / chunk {
        d += run(&default, &common, chunk);
        m += run(&mapped, &mapped_tuple, chunk);
    }
    let done = (rows / chunk * chunk) as f64;
    (d / done, m / done)
}

pub async fn run(client: &mut tokio_postgres::Client, s: &Setting, n: usize) -> Value {
    let (default_ns, mapped_ns) = per_row_cost(2_000_000);
    println!(
        "| per row, in this process (read + build the record) | default {default_ns:.0} ns | mapped {mapped_ns:.0} ns | mapped ÷ default {:.3} |",
        mapped_ns / default_ns
    );
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
        let mut topics = topics.clone();
        topics.push("warm-up-mapping".into());
        let brokers = s.brokers.clone();
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
    // A broker's first loads are slower: warm it as the main run does.
    for _ in 0..3 {
        let round = super::ceiling::run(&s.brokers, "warm-up-mapping", n.min(200_000), &s.outboxd_kafka);
        eprintln!("bench: warm-up: {:.0} events/s", round.rate());
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
    json!({"events": n, "per_row_ns": {"default": default_ns, "mapped": mapped_ns, "ratio": mapped_ns / default_ns},
           "rounds": rounds, "default_events_per_s": default_rates, "mapped_events_per_s": mapped_rates,
           "default_median": dr, "mapped_median": mr, "ratio": mr / dr,
           "default_cpu_s_per_100k": default_cpu, "mapped_cpu_s_per_100k": mapped_cpu})
}

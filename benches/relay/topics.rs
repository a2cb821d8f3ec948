//! Many topics (`--only-topics`, or `--topics` beside the main run): one
//! backlog of `n` rows with ~100-byte payloads over 50 aggregate types,
//! 100 rows per transaction, drained side by side by `pg_recvlogical`
//! (PostgreSQL's decoding limit), by outboxd writing every event to one
//! topic (a fixed `routing.topic`), by outboxd writing each aggregate type
//! to its own topic (50 topics × 3 partitions), and by Debezium on the same
//! 50 topics (its Java producer packs every partition of a broker into one
//! request: the reference for what packing gives). Each relay has a slot
//! of its own made before the backlog. outboxd drains each shape twice,
//! in alternating rounds, after both shapes warmed the broker. Beside
//! them, the produce ceiling of each shape (records built in memory, no
//! PostgreSQL: the Kafka side's own cost of 50 topics). Reported: drain
//! rate, CPU per 100k events and peak RSS of each, and the broker's CPU
//! per 100k events during each drain (what the relay's requests cost on
//! the Kafka side: batches of fewer records cost it more). With
//! `OUTBOXD_BENCH_REFERENCE`, an earlier build drains both shapes too,
//! each right after this build's.

use serde_json::{json, Value};

use super::harness::postgres::PgServer;
use super::relays::{Kind, Setting};
use super::{create_slot, drain_into, drop_slot, harness, recvlogical_on, write_rows, Shape};

/// Aggregate types, each a topic.
pub const TYPES: usize = 50;

/// The most pairs of unmeasured drains (one topic, then 50) that warm the
/// broker before the measured ones.
const WARM_DRAIN_PAIRS: usize = 3;

pub async fn run(
    client: &mut tokio_postgres::Client,
    pg: &PgServer,
    s: &Setting,
    n: usize,
    debezium: bool,
) -> Value {
    client
        .batch_execute("CREATE PUBLICATION bench_pub FOR TABLE outbox WITH (publish = 'insert')")
        .await
        .unwrap();
    let many: Vec<String> = (0..TYPES).map(|t| format!("tp50-t{t}")).collect();
    let theirs: Vec<String> = (0..TYPES).map(|t| format!("tp50dbz-t{t}")).collect();
    let one = vec!["tp1-all".to_owned()];
    let ceiling_topics: Vec<String> = (0..TYPES).map(|t| format!("tpceil-t{t}")).collect();
    {
        let mut topics = many.clone();
        topics.extend(ceiling_topics.clone());
        topics.push("tpceil".into());
        topics.extend(theirs.clone());
        topics.extend(one.clone());
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
    // The first round writes into the relays' own topics (Debezium's
    // too): the first records a partition takes cost the broker more (the
    // first 50-topic drain was 2–4 times slower than the next on the same
    // topics).
    for (topics, prefix) in [(1, "tp1-all"), (TYPES, "tp50"), (TYPES, "tp50dbz")] {
        let round = super::ceiling::run_over(&s.brokers, prefix, n.min(200_000), &s.outboxd_kafka, topics);
        eprintln!("bench: warm-up, {topics} topic(s): {:.0} events/s", round.rate());
    }
    // Then both shapes, round after round, until the broker's JIT compiler
    // has settled (`warm`).
    let (ceiling_rounds, ceiling_settled) = super::warm::until_settled(&s.broker_pids, |_| {
        for topics in [1, TYPES] {
            let round =
                super::ceiling::run_over(&s.brokers, "tpceil", n.min(200_000), &s.outboxd_kafka, topics);
            eprintln!("bench: warm-up, {topics} topic(s): {:.0} events/s", round.rate());
        }
    });
    // The Kafka side alone (records built in memory): one topic, and 50
    // topics × 3 partitions.
    let mut ceilings = Vec::new();
    for topics in [1, TYPES] {
        let c = super::ceiling::run_over(&s.brokers, "tpceil", n, &s.outboxd_kafka, topics);
        eprintln!(
            "bench: produce ceiling, {topics} topic(s): {:.0} events/s, {:.2} core-s per 100k, {:.1} MiB",
            c.rate(),
            c.cpu_per_100k(),
            c.rss_mib
        );
        ceilings.push((topics, c));
    }
    // With OUTBOXD_BENCH_REFERENCE, an earlier build drains the same rows
    // too, each of its runs right after this build's.
    let reference = super::relays::reference_binary().is_some();
    let mut slots = vec![
        "tp_recv",
        "tp_one",
        "tp_many",
        "tp_one_2",
        "tp_many_2",
        "tp_debezium",
    ];
    if reference {
        slots.extend(["tp_ref_one", "tp_ref_many"]);
    }
    let warm_slots: Vec<(String, String)> = (0..WARM_DRAIN_PAIRS)
        .map(|i| (format!("tp_warm_one_{i}"), format!("tp_warm_many_{i}")))
        .collect();
    for slot in slots
        .iter()
        .copied()
        .chain(warm_slots.iter().flat_map(|(a, b)| [a.as_str(), b.as_str()]))
    {
        create_slot(client, slot).await;
    }
    let shape = Shape {
        payload: Some(100),
        types: TYPES,
    };
    eprintln!("bench: writing {n} rows over {TYPES} aggregate types");
    let target = write_rows(client, n, shape).await;
    let end: outboxd::Lsn = {
        let s: String = client
            .query_one("SELECT pg_current_wal_lsn()::text", &[])
            .await
            .unwrap()
            .get(0);
        s.parse().unwrap()
    };
    eprintln!("bench: pg_recvlogical");
    let recv_secs = recvlogical_on(pg, "tp_recv", end, "bench_pub");
    drop_slot(client, "tp_recv").await;
    let recv_rate = n as f64 / recv_secs;
    let mut rows = Vec::new();
    let mut out = json!({"events": n, "types": TYPES, "partitions_each": super::PARTITIONS,
                         "pg_recvlogical": {"seconds": recv_secs, "events_per_second": recv_rate}});
    out["produce_ceilings"] = json!(ceilings
        .iter()
        .map(|(topics, c)| {
            let mut v = c.json();
            v["topics"] = json!(topics);
            v
        })
        .collect::<Vec<_>>());
    // With OUTBOXD_BENCH_REFERENCE_FIRST, the reference drains each shape
    // before this build: the drain after the warm-up, or after another
    // shape, is mostly the slower one, so a fair pairing runs both orders.
    let reference_first = std::env::var_os("OUTBOXD_BENCH_REFERENCE_FIRST").is_some();
    let mut runs: Vec<(&str, Kind, &str, String, Vec<String>)> = Vec::new();
    for (ours, reference_label, ours_slot, reference_slot, route, topics) in [
        (
            "outboxd, 1 topic",
            "reference, 1 topic",
            "tp_one",
            "tp_ref_one",
            "tp1-all",
            &one,
        ),
        (
            "outboxd, 50 topics",
            "reference, 50 topics",
            "tp_many",
            "tp_ref_many",
            "tp50-{aggregate_type}",
            &many,
        ),
    ] {
        let mut pair = vec![(ours, Kind::Outboxd, ours_slot, route.to_owned(), topics.clone())];
        if reference {
            pair.push((
                reference_label,
                Kind::Reference,
                reference_slot,
                route.to_owned(),
                topics.clone(),
            ));
            if reference_first {
                pair.reverse();
            }
        }
        runs.extend(pair);
    }
    // A second round of both shapes, in the same order: which of the two
    // a slower moment of the machine falls on shows in the two rounds.
    runs.push((
        "outboxd, 1 topic, round 2",
        Kind::Outboxd,
        "tp_one_2",
        "tp1-all".to_owned(),
        one.clone(),
    ));
    runs.push((
        "outboxd, 50 topics, round 2",
        Kind::Outboxd,
        "tp_many_2",
        "tp50-{aggregate_type}".to_owned(),
        many.clone(),
    ));
    if debezium {
        runs.push((
            "Debezium, 50 topics",
            Kind::Debezium,
            "tp_debezium",
            "tp50dbz-${routedByValue}".to_owned(),
            theirs.clone(),
        ));
    } else {
        drop_slot(client, "tp_debezium").await;
    }
    // The ceiling's records settle the compiler for the records, not for
    // the relay's sessions: after it settled, each drain still cost the
    // compiler 0.2–0.6 s. So unmeasured drains of both shapes, in the
    // measured drains' alternation, until a pair of them cost the compiler
    // at most `warm::SETTLED_SHARE` of the broker's CPU each, at most
    // WARM_DRAIN_PAIRS pairs. This build drains them, with or without a
    // reference: what they warm is the broker, which both builds' records
    // reach by the same requests.
    let (mut drain_pairs, mut drains_settled) = (0, false);
    let mut warm_slots = warm_slots.into_iter();
    for (one_slot, many_slot) in warm_slots.by_ref() {
        drain_pairs += 1;
        let mut quiet = true;
        for (slot, route, topics) in [
            (&one_slot, "tp1-all", &one),
            (&many_slot, "tp50-{aggregate_type}", &many),
        ] {
            let d = drain_into(client, s, Kind::Outboxd, slot, route, topics, target, n).await;
            drop_slot(client, slot).await;
            let jit = d.broker;
            eprintln!(
                "bench: warm-up drain, {} topic(s): {:.0} events/s, the broker's JIT compiler {}",
                topics.len(),
                d.rate(n),
                jit.describe()
            );
            quiet &= jit.quiet(super::warm::SETTLED_SHARE);
        }
        if quiet {
            drains_settled = true;
            break;
        }
    }
    if !drains_settled {
        eprintln!(
            "bench: the broker's JIT compiler was not quiet in {drain_pairs} pairs of warm-up drains; measuring anyway"
        );
    }
    for (one_slot, many_slot) in warm_slots {
        drop_slot(client, &one_slot).await;
        drop_slot(client, &many_slot).await;
    }
    out["warm_up"] = json!({"ceiling_rounds": ceiling_rounds, "ceiling_rounds_settled": ceiling_settled,
                            "drain_pairs": drain_pairs, "drain_pairs_settled": drains_settled});
    for (label, kind, slot, route, topics) in runs {
        let d = drain_into(client, s, kind, slot, &route, &topics, target, n).await;
        drop_slot(client, slot).await;
        eprintln!("bench: {label}: {:.0} events/s", d.rate(n));
        rows.push((
            label,
            d.rate(n),
            d.cpu_per_100k(n),
            d.broker_cpu_per_100k(n),
            format!(
                "{}{:.2}",
                if d.broker.short { "≥ " } else { "" },
                d.broker_jit_per_100k(n)
            ),
            d.rss_mib,
        ));
        out[label] = d.json(n);
    }
    println!("| {n} events, ~100-byte payloads, {TYPES} aggregate types | drain | ÷ pg_recvlogical | CPU per 100k events | the broker's CPU per 100k events | of it, its JIT compiler | peak RSS |");
    println!("|---|---|---|---|---|---|---|");
    println!("| pg_recvlogical | {recv_rate:.0} events/s | 1 | | | | |");
    for (label, rate, cpu, broker_cpu, broker_jit, rss) in &rows {
        println!(
            "| {label} | {rate:.0} events/s | {:.2} | {cpu:.2} core-s | {broker_cpu:.2} core-s | {broker_jit} core-s | {rss:.1} MiB |",
            rate / recv_rate
        );
    }
    for (topics, c) in &ceilings {
        println!(
            "| produce ceiling, {topics} topic(s) (records in memory, no PostgreSQL) | {:.0} events/s | | {:.2} core-s | | | {:.1} MiB |",
            c.rate(),
            c.cpu_per_100k(),
            c.rss_mib
        );
    }
    if let [(_, one), (_, many)] = &ceilings[..] {
        println!(
            "| produce ceiling, 50 topics ÷ 1 topic | {:.2} | | | | | |",
            many.rate() / one.rate()
        );
        out["ceiling_many_to_one"] = json!(many.rate() / one.rate());
    }
    let rate = |label: &str| rows.iter().find(|r| r.0 == label).map(|r| r.1);
    for (one_label, many_label, key) in [
        ("outboxd, 1 topic", "outboxd, 50 topics", "many_to_one"),
        (
            "outboxd, 1 topic, round 2",
            "outboxd, 50 topics, round 2",
            "many_to_one_round_2",
        ),
        (
            "reference, 1 topic",
            "reference, 50 topics",
            "reference_many_to_one",
        ),
    ] {
        if let (Some(one), Some(many)) = (rate(one_label), rate(many_label)) {
            println!("| {many_label} ÷ {one_label} | {:.2} | | | | | |", many / one);
            out[key] = json!(many / one);
        }
    }
    if let (Some(many), Some(dbz)) = (rate("outboxd, 50 topics"), rate("Debezium, 50 topics")) {
        println!("| outboxd ÷ Debezium, 50 topics | {:.2} | | | | | |", many / dbz);
        out["outboxd_to_debezium_50_topics"] = json!(many / dbz);
    }
    let yes_no = |b: bool| if b { "quiet" } else { "not quiet" };
    println!(
        "| warm-up: the broker's JIT compiler | {ceiling_rounds} ceiling rounds ({}), {drain_pairs} pairs of drains ({}) | | | | | |",
        yes_no(ceiling_settled),
        yes_no(drains_settled)
    );
    out
}

//! Class 1: a partitioned outbox. pgoutput describes a partitioned table's
//! rows as their leaf partitions unless the publication publishes via the
//! root; before, those rows were skipped without a trace and the slot
//! confirmed past them.

use std::collections::HashSet;
use std::time::Duration;

use serde_json::json;
use uuid::Uuid;

use crate::hardening::{daemon_config, exits, log_text, outboxd_async, prefix, wait_ids};
use crate::harness::broker::broker;
use crate::harness::{wait_for, TestDb};
use crate::relay::{confirmed_flush, current_lsn, Daemon};

/// The outbox of migration 0001, range-partitioned by `created_at` as
/// users partition it to drop old rows cheaply.
const PARTITIONED_OUTBOX: &str = "
    CREATE TABLE outbox (
        id uuid NOT NULL, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
        type text NOT NULL, payload jsonb NOT NULL, headers jsonb NOT NULL DEFAULT '{}',
        created_at timestamptz NOT NULL DEFAULT clock_timestamp(), published_at timestamptz,
        PRIMARY KEY (id, created_at)
    ) PARTITION BY RANGE (created_at);
    CREATE TABLE outbox_2020 PARTITION OF outbox FOR VALUES FROM ('2020-01-01') TO ('2021-01-01');
    CREATE TABLE outbox_2021 PARTITION OF outbox FOR VALUES FROM ('2021-01-01') TO ('2022-01-01');
    CREATE TABLE outbox_now PARTITION OF outbox FOR VALUES FROM ('2022-01-01') TO ('2100-01-01');";

/// Inserts `n` events of aggregate `agg` with `created_at` (SQL, `None`:
/// the default), one transaction each; their ids in order.
async fn insert(client: &tokio_postgres::Client, agg: &str, n: usize, created_at: Option<&str>) -> Vec<Uuid> {
    let mut ids = Vec::new();
    for i in 0..n {
        let id = Uuid::now_v7();
        let sql = match created_at {
            Some(at) => format!(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload, created_at)
                 VALUES ($1, 'Order', $2, 'part.v1', $3, '{at}')"
            ),
            None => "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload)
                     VALUES ($1, 'Order', $2, 'part.v1', $3)"
                .to_owned(),
        };
        client
            .execute(&sql, &[&id, &agg, &json!({"i": i})])
            .await
            .unwrap();
        ids.push(id);
    }
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_outbox_is_published_whole_and_retention_drops_what_the_slot_passed() {
    let db = TestDb::empty("hard_part").await;
    let client = db.client().await;
    client.batch_execute(PARTITIONED_OUTBOX).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let brokers = &broker().brokers;
    let p = prefix("part");
    let topic = format!("{p}.order");

    // A publication made without publish_via_partition_root describes rows
    // as their partitions: refused, naming the statement.
    client
        .batch_execute("CREATE PUBLICATION part_leaves FOR TABLE outbox WITH (publish = 'insert')")
        .await
        .unwrap();
    let leaves = daemon_config(
        dir.path(),
        "leaves.toml",
        &db.superuser_url(),
        "part_leaves",
        brokers,
        &p,
        "",
        "",
        "",
    );
    let leaves = leaves.to_str().unwrap();
    let (code, out, _) = outboxd_async(&["check", "--config", leaves]).await;
    assert_ne!(code, Some(0), "{out}");
    assert!(
        out.contains("FAIL publication")
            && out.contains("ALTER PUBLICATION \"part_leaves\" SET (publish_via_partition_root = true);"),
        "{out}"
    );
    let log = dir.path().join("leaves.log");
    let mut refused = Daemon::start(std::path::Path::new(leaves), &log);
    assert_ne!(exits(&mut refused, Duration::from_secs(30), &log).await, Some(0));
    assert!(
        log_text(&log).contains("publish_via_partition_root"),
        "{}",
        log_text(&log)
    );

    // The publication outboxd makes publishes via the root.
    let cfg = daemon_config(
        dir.path(),
        "part.toml",
        &db.superuser_url(),
        "part",
        brokers,
        &p,
        "",
        "",
        "",
    );
    let log = dir.path().join("part.log");
    let daemon = Daemon::start(&cfg, &log);
    wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(&client, "part").await
    })
    .await;
    let mut want = Vec::new();
    want.extend(insert(&client, "old", 10, Some("2020-06-01 00:00:00+00")).await);
    want.extend(insert(&client, "a", 20, None).await);
    // A partition attached while streaming, rows in it, and the partition
    // detached right after: its rows were written while it was attached.
    client
        .batch_execute(
            "CREATE TABLE outbox_next (LIKE outbox INCLUDING DEFAULTS);
             ALTER TABLE outbox ATTACH PARTITION outbox_next FOR VALUES FROM ('2100-01-01') TO ('2200-01-01');",
        )
        .await
        .unwrap();
    want.extend(insert(&client, "next", 5, Some("2150-01-01 00:00:00+00")).await);
    client
        .batch_execute("ALTER TABLE outbox DETACH PARTITION outbox_next")
        .await
        .unwrap();
    want.extend(insert(&client, "a", 5, None).await);
    let all: HashSet<Uuid> = want.iter().copied().collect();
    let recs = wait_ids(brokers, &[&topic], &all).await;
    // Per aggregate, in the order written (one partition per key).
    for agg in ["old", "a", "next"] {
        let got: Vec<Uuid> = recs
            .iter()
            .filter(|r| r.key == agg)
            .filter_map(|r| r.header("id")?.parse().ok())
            .collect();
        let mut seen = HashSet::new();
        let first: Vec<Uuid> = got.into_iter().filter(|id| seen.insert(*id)).collect();
        let written: Vec<Uuid> = want
            .iter()
            .copied()
            .filter(|id| {
                recs.iter()
                    .any(|r| r.key == agg && r.header("id") == Some(&id.to_string()))
            })
            .collect();
        assert_eq!(first, written, "aggregate {agg} in order");
    }

    // Retention drops whole partitions the slot has passed: 2020 and 2021
    // (every row older than a day, and delivered); the current one stays.
    let end = current_lsn(&client).await;
    wait_for("the slot past every row", Duration::from_secs(30), || async {
        confirmed_flush(&client, "part").await.filter(|c| *c >= end)
    })
    .await;
    let c = cfg.to_str().unwrap();
    let (code, out, err) = outboxd_async(&["retention", "--config", c, "--older-than", "1d"]).await;
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(
        out.contains("dropped partition public.outbox_2020")
            && out.contains("dropped partition public.outbox_2021"),
        "{out}"
    );
    assert!(!out.contains("outbox_now"), "{out}");
    let left: Vec<String> = client
        .query(
            "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
              WHERE i.inhparent = 'outbox'::regclass ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(left, vec!["outbox_now".to_owned()]);

    // A partition whose rows the slot has not confirmed yet is kept: the
    // relay is stopped while a row lands in an old partition.
    let _ = daemon.sigterm();
    client
        .batch_execute(
            "CREATE TABLE outbox_2019 PARTITION OF outbox FOR VALUES FROM ('2019-01-01') TO ('2020-01-01')",
        )
        .await
        .unwrap();
    let late = insert(&client, "late", 1, Some("2019-06-01 00:00:00+00")).await;
    let (code, out, err) =
        outboxd_async(&["retention", "--config", c, "--older-than", "1d", "--wait", "1s"]).await;
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(
        out.contains("kept partition public.outbox_2019") && out.contains("not yet past its rows"),
        "{out}"
    );
    let daemon = Daemon::start(&cfg, &log);
    let late: HashSet<Uuid> = late.into_iter().collect();
    wait_ids(brokers, &[&topic], &late).await;
    let end = current_lsn(&client).await;
    wait_for("the slot past the late row", Duration::from_secs(30), || async {
        confirmed_flush(&client, "part").await.filter(|c| *c >= end)
    })
    .await;
    let (code, out, err) = outboxd_async(&["retention", "--config", c, "--older-than", "1d"]).await;
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("dropped partition public.outbox_2019"), "{out}");
    let _ = daemon.sigterm();
}

/// Rows of an unlogged partition, or of an unlogged outbox that a schema
/// publication covers, never reach the WAL: refused at start and by
/// `check`, and a running relay stops naming the relation (not blaming a
/// partition root).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_that_never_reach_the_wal_are_refused_by_name() {
    let db = TestDb::empty("hard_unlogged").await;
    let client = db.client().await;
    client.batch_execute(PARTITIONED_OUTBOX).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let brokers = &broker().brokers;
    let p = prefix("unlog");
    let topic = format!("{p}.order");
    let cfg = daemon_config(
        dir.path(),
        "u.toml",
        &db.superuser_url(),
        "unlogged",
        brokers,
        &p,
        "",
        "",
        "",
    );
    let c = cfg.to_str().unwrap();
    let log = dir.path().join("u.log");
    let mut d = Daemon::start(&cfg, &log);
    wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(&client, "unlogged").await
    })
    .await;
    let logged = insert(&client, "a", 3, None).await;
    wait_ids(brokers, &[&topic], &logged.iter().copied().collect()).await;

    // A partition made unlogged while it streams: the guard stops it.
    client
        .batch_execute(
            "CREATE UNLOGGED TABLE outbox_2030 PARTITION OF outbox FOR VALUES FROM ('2100-01-01') TO ('2200-01-01')",
        )
        .await
        .unwrap();
    assert_eq!(exits(&mut d, Duration::from_secs(30), &log).await, Some(1));
    let text = log_text(&log);
    assert!(
        text.contains("public.outbox_2030 (unlogged)") && text.contains("SET LOGGED"),
        "{text}"
    );
    let (code, out, _) = outboxd_async(&["check", "--config", c]).await;
    assert_ne!(code, Some(0), "{out}");
    assert!(
        out.contains("FAIL publication") && out.contains("outbox_2030 (unlogged)"),
        "{out}"
    );
    let mut again = Daemon::start(&cfg, &log);
    assert_eq!(exits(&mut again, Duration::from_secs(30), &log).await, Some(1));

    // Made logged, it streams on.
    client
        .batch_execute("ALTER TABLE outbox_2030 SET LOGGED")
        .await
        .unwrap();
    let d = Daemon::start(&cfg, &log);
    let later = insert(&client, "a", 2, Some("2150-01-01")).await;
    wait_ids(brokers, &[&topic], &later.iter().copied().collect()).await;
    assert!(d.sigterm().success());
}

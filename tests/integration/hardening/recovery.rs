//! Class 13: closing a gap before the relay resumes. After a lost slot the
//! relay used to start streaming new events while the replay of the gap
//! ran, so an aggregate's newer events reached Kafka before its older ones.
//! `outboxd progress --reset --create-slot` makes the slot first, so the
//! replay runs before the relay and no event is missed in between.

use std::collections::HashMap;
use std::time::Duration;

use uuid::Uuid;

use super::{daemon_config, exits, log_text, outboxd_async, prefix, records, wait_ids};
use crate::harness::broker::broker;
use crate::harness::{wait_for, TestDb};
use crate::relay::{confirmed_flush, write_events, Daemon, Event};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_is_replayed_before_the_relay_resumes_and_each_aggregate_keeps_its_order() {
    let db = TestDb::new("hard_gap").await;
    let client = db.client().await;
    let dir = tempfile::tempdir().unwrap();
    let brokers = &broker().brokers;
    let p = prefix("gap");
    let topic = format!("{p}.order");
    let cfg = daemon_config(
        dir.path(),
        "gap.toml",
        &db.superuser_url(),
        "gap",
        brokers,
        &p,
        "",
        &format!("progress_topic = \"{p}.progress\""),
        "",
    );
    let c = cfg.to_str().unwrap();
    let log = dir.path().join("gap.log");
    let daemon = Daemon::start(&cfg, &log);
    wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(&client, "gap").await
    })
    .await;
    let (a, _) = write_events(&client, 10, 1, 3, &["Order"], 0).await;
    wait_ids(brokers, &[&topic], &a.iter().map(|e| e.id).collect()).await;
    assert!(daemon.sigterm().success());

    // The slot is lost while outboxd is down; events keep being written.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    client
        .batch_execute("SELECT pg_drop_replication_slot('gap')")
        .await
        .unwrap();
    let (b, _) = write_events(&client, 10, 1, 3, &["Order"], 10).await;
    let mut refused = Daemon::start(&cfg, &log);
    assert_eq!(exits(&mut refused, Duration::from_secs(30), &log).await, Some(1));
    let text = log_text(&log);
    let replay = text
        .lines()
        .rev()
        .find_map(|l| {
            let start = l.find("run `outboxd replay ")? + 5;
            let end = l[start..].find('`')? + start;
            Some(l[start..end].to_owned())
        })
        .expect("the replay command in the error");

    // Make the slot first, then replay, then start the relay.
    let (code, out, err) = outboxd_async(&["progress", "--config", c, "--reset", "--create-slot"]).await;
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("created slot gap"), "{out}");
    let (c2, _) = write_events(&client, 10, 1, 3, &["Order"], 20).await;
    let replay = replay.replacen("outboxd", crate::relay::bin(), 1);
    let cwd = dir.path().to_owned();
    let status = tokio::task::spawn_blocking(move || {
        std::process::Command::new("sh")
            .arg("-c")
            .arg(&replay)
            .current_dir(cwd)
            .status()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(status.success());
    let daemon = Daemon::start(&cfg, &log);
    let all: Vec<Event> = a.iter().chain(&b).chain(&c2).cloned().collect();
    wait_ids(brokers, &[&topic], &all.iter().map(|e| e.id).collect()).await;
    // C was replayed too (written before the replay ran); the relay
    // streams past it before it stops.
    let end = crate::relay::current_lsn(&client).await;
    wait_for(
        "the relay past the last event",
        Duration::from_secs(30),
        || async { confirmed_flush(&client, "gap").await.filter(|c| *c >= end) },
    )
    .await;
    assert!(daemon.sigterm().success(), "{}", super::tail(&log));

    // Every aggregate: its events' first copies in the order written.
    let mut seen = std::collections::HashSet::new();
    let mut first: HashMap<String, Vec<Uuid>> = HashMap::new();
    for r in &records(brokers, &[&topic]).await {
        let id: Uuid = r.header("id").unwrap().parse().unwrap();
        if seen.insert(id) {
            first.entry(r.key.clone()).or_default().push(id);
        }
    }
    let mut want: HashMap<String, Vec<Uuid>> = HashMap::new();
    for e in &all {
        want.entry(e.aggregate_id.clone()).or_default().push(e.id);
    }
    assert_eq!(first, want, "the gap before what followed it, per aggregate");
}

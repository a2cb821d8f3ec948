//! Class 5: the slot register read fails closed. Class 12: a restart keeps
//! the register's commit time.

use std::time::Duration;

use outboxd::config::Config;
use outboxd::relay::slot_register;
use rdkafka::mocking::MockCluster;
use rdkafka::types::RDKafkaRespErr;

use super::{daemon_config, exits, log_text, prefix, wait_ids};
use crate::harness::broker::broker;
use crate::harness::{wait_for, TestDb};
use crate::relay::{confirmed_flush, write_events, Daemon};

/// The system identifier of the test server.
async fn system_id(client: &tokio_postgres::Client) -> String {
    client
        .query_one("SELECT system_identifier::text FROM pg_control_system()", &[])
        .await
        .unwrap()
        .get(0)
}

/// Before, a topic-level metadata error of the progress topic read as "no
/// record": a lost slot was then recreated at the current WAL position.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_register_kafka_cannot_serve_is_never_read_as_no_record() {
    let db = TestDb::new("hard_reg").await;
    let client = db.client().await;
    let mock = MockCluster::new(1).unwrap();
    let progress = "reg.progress";
    mock.create_topic(progress, 1, 1).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = daemon_config(
        dir.path(),
        "reg.toml",
        &db.superuser_url(),
        "hard_reg",
        &mock.bootstrap_servers(),
        "reg",
        "",
        &format!("progress_topic = \"{progress}\""),
        "",
    );
    let (config, _) = Config::load(&cfg).unwrap();
    let sys = system_id(&client).await;
    for (error, transient) in [
        (
            RDKafkaRespErr::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED,
            false,
        ),
        (RDKafkaRespErr::RD_KAFKA_RESP_ERR_LEADER_NOT_AVAILABLE, true),
    ] {
        mock.topic_error(progress, error).unwrap();
        let read = slot_register::read(&config.kafka, &sys, "hard_reg", Duration::from_secs(5)).await;
        let e = read.expect_err("an error, never \"no record\"");
        assert_eq!(e.is_transient(), transient, "{e}");
    }

    // The relay with the slot gone and the register denied: it stops with
    // the grant to add, and creates no slot.
    mock.topic_error(
        progress,
        RDKafkaRespErr::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED,
    )
    .unwrap();
    let log = dir.path().join("reg.log");
    let mut daemon = Daemon::start(&cfg, &log);
    assert_eq!(exits(&mut daemon, Duration::from_secs(60), &log).await, Some(1));
    assert!(
        log_text(&log).contains("grant outboxd's principal READ, WRITE and DESCRIBE"),
        "{}",
        log_text(&log)
    );
    assert_eq!(
        confirmed_flush(&client, "hard_reg").await,
        None,
        "no slot was created"
    );
    drop(mock);
}

/// Before, each session start rewrote the record without
/// `confirmedCommitTime`, so a slot lost after a restart had only a
/// placeholder in its recovery command.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_keeps_the_commit_time_a_lost_slot_is_replayed_from() {
    let db = TestDb::new("hard_regtime").await;
    let client = db.client().await;
    let dir = tempfile::tempdir().unwrap();
    let brokers = &broker().brokers;
    let p = prefix("regtime");
    let cfg = daemon_config(
        dir.path(),
        "t.toml",
        &db.superuser_url(),
        "regtime",
        brokers,
        &p,
        "",
        &format!("progress_topic = \"{p}.progress\""),
        "",
    );
    let (config, _) = Config::load(&cfg).unwrap();
    let log = dir.path().join("t.log");
    let daemon = Daemon::start(&cfg, &log);
    wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(&client, "regtime").await
    })
    .await;
    let (events, _) = write_events(&client, 3, 1, 1, &["Order"], 0).await;
    wait_ids(
        brokers,
        &[&format!("{p}.order")],
        &events.iter().map(|e| e.id).collect(),
    )
    .await;
    assert!(daemon.sigterm().success());
    let sys = system_id(&client).await;
    let read = || async {
        slot_register::read(&config.kafka, &sys, "regtime", Duration::from_secs(10))
            .await
            .unwrap()
            .unwrap()
    };
    let stopped = read().await;
    let time = stopped
        .confirmed_commit_time
        .clone()
        .expect("a commit time at the clean stop");
    assert!(stopped.last_commit().is_some(), "{stopped:?}");

    // A new session writes the record at its first status tick, before it
    // has confirmed any transaction of its own.
    let daemon = Daemon::start(&cfg, &log);
    let rewritten = wait_for("the new session's record", Duration::from_secs(30), || async {
        let r = read().await;
        (r.writer != stopped.writer).then_some(r)
    })
    .await;
    assert_eq!(rewritten.confirmed_commit_time.as_deref(), Some(time.as_str()));
    assert_eq!(rewritten.last_commit(), stopped.last_commit());
    assert!(daemon.sigterm().success());
}

/// Two configurations on one slot name, each with its own outbox and
/// publication: before, the second streamed the slot past the first's
/// rows (its publication does not carry them), and the first, restarted,
/// found its own catalog rows old enough to prove nothing changed. The
/// register's fingerprint now says who streamed the slot last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_configuration_on_the_same_slot_is_refused_and_loses_nothing() {
    let db = TestDb::new("hard_twocfg").await;
    let client = db.client().await;
    client
        .batch_execute(
            "CREATE SCHEMA other;
             CREATE TABLE other.outbox (LIKE public.outbox INCLUDING ALL);
             CREATE PUBLICATION other_pub FOR TABLE other.outbox WITH (publish = 'insert')",
        )
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let brokers = &broker().brokers;
    let p = prefix("twocfg");
    let topic = format!("{p}.order");
    let slot = "twocfg";
    let a = daemon_config(
        dir.path(),
        "a.toml",
        &db.superuser_url(),
        slot,
        brokers,
        &p,
        "",
        "",
        "",
    );
    let b = daemon_config(
        dir.path(),
        "b.toml",
        &db.superuser_url(),
        slot,
        brokers,
        &p,
        "",
        "",
        "",
    );
    let text = std::fs::read_to_string(&b).unwrap().replacen(
        "publication = \"twocfg\"\n",
        "publication = \"other_pub\"\ntable = \"other.outbox\"\n",
        1,
    );
    std::fs::write(&b, text).unwrap();
    let log = dir.path().join("two.log");

    let d = Daemon::start(&a, &log);
    wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(&client, slot).await
    })
    .await;
    let (first, _) = write_events(&client, 3, 1, 2, &["Order"], 0).await;
    wait_ids(brokers, &[&topic], &first.iter().map(|e| e.id).collect()).await;
    assert!(d.sigterm().success());

    let (gap, _) = write_events(&client, 4, 1, 2, &["Order"], 3).await;
    let mut other = Daemon::start(&b, &log);
    assert_eq!(exits(&mut other, Duration::from_secs(30), &log).await, Some(1));
    let text = log_text(&log);
    assert!(
        text.contains("last streamed with another publication or outbox table"),
        "{text}"
    );
    let (code, out, _) = super::outboxd_async(&["check", "--config", b.to_str().unwrap()]).await;
    assert_ne!(code, Some(0), "{out}");
    assert!(out.contains("FAIL register"), "{out}");

    // The first configuration, back, publishes what was written meanwhile.
    let d = Daemon::start(&a, &log);
    wait_ids(brokers, &[&topic], &gap.iter().map(|e| e.id).collect()).await;
    assert!(d.sigterm().success());
}

/// A progress topic someone made with delete retention would lose an
/// idle slot's register (and a lost slot would then be recreated
/// silently): refused at start and by `check`, naming the fix.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_progress_topic_that_deletes_old_records_is_refused() {
    let db = TestDb::new("hard_retain").await;
    let dir = tempfile::tempdir().unwrap();
    let brokers = &broker().brokers;
    let p = prefix("retain");
    let progress = format!("{p}.progress");
    let b = brokers.clone();
    let t = progress.clone();
    tokio::task::spawn_blocking(move || {
        crate::harness::broker::create_topics_sized(
            &b,
            &[t],
            1,
            &[("cleanup.policy", "delete"), ("retention.ms", "3600000")],
        )
    })
    .await
    .unwrap();
    let cfg = daemon_config(
        dir.path(),
        "r.toml",
        &db.superuser_url(),
        "retain",
        brokers,
        &p,
        "",
        &format!("progress_topic = \"{progress}\""),
        "",
    );
    let (code, out, _) = super::outboxd_async(&["check", "--config", cfg.to_str().unwrap()]).await;
    assert_ne!(code, Some(0), "{out}");
    assert!(
        out.contains("FAIL retention") && out.contains("cleanup.policy=delete"),
        "{out}"
    );
    let log = dir.path().join("r.log");
    let mut d = Daemon::start(&cfg, &log);
    assert_eq!(exits(&mut d, Duration::from_secs(30), &log).await, Some(1));
    let text = log_text(&log);
    assert!(text.contains("--add-config cleanup.policy=compact"), "{text}");
}

/// A new slot is in the register before it is streamed: lost before the
/// first status tick (a failover, an operator's drop), it is refused, not
/// recreated at the current WAL position with what lay between lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_lost_before_its_first_status_tick_is_refused() {
    let db = TestDb::new("hard_firsttick").await;
    let client = db.client().await;
    let dir = tempfile::tempdir().unwrap();
    let brokers = &broker().brokers;
    let p = prefix("firsttick");
    let cfg = daemon_config(
        dir.path(),
        "t.toml",
        &db.superuser_url(),
        "firsttick",
        brokers,
        &p,
        "",
        &format!("progress_topic = \"{p}.progress\""),
        "[health]\nstatus_max_age = \"60s\"",
    );
    // No status tick before the kill.
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("status_interval = \"100ms\"", "status_interval = \"20s\"");
    std::fs::write(&cfg, text).unwrap();
    let log = dir.path().join("t.log");
    let _log_on_failure = crate::sources::LogOnFailure(log.clone());
    let mut daemon = Daemon::start(&cfg, &log);
    // Streaming, not only active: a slot being created is active before
    // outboxd has it or its register record.
    wait_for("the slot streamed", Duration::from_secs(30), || async {
        crate::sources::streaming_pid(&client, "firsttick")
            .await
            .map(|_| ())
    })
    .await;
    daemon.kill9();
    wait_for("the walsender gone", Duration::from_secs(30), || async {
        client
            .query_opt(
                "SELECT pg_drop_replication_slot('firsttick') WHERE EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = 'firsttick' AND NOT active)",
                &[],
            )
            .await
            .ok()
            .flatten()
            .map(|_| ())
    })
    .await;
    let (lost, _) = write_events(&client, 10, 1, 3, &["Order"], 0).await;
    daemon.restart();
    assert_eq!(exits(&mut daemon, Duration::from_secs(30), &log).await, Some(1));
    let text = log_text(&log);
    assert!(
        text.contains("replication slot firsttick does not exist, but outboxd streamed it"),
        "{text}"
    );
    assert_eq!(confirmed_flush(&client, "firsttick").await, None, "not recreated");
    let (code, out, _) = super::outboxd_async(&["check", "--config", cfg.to_str().unwrap()]).await;
    assert_ne!(code, Some(0), "{out}");
    drop(lost);
}

/// A progress topic made beforehand with several partitions (as Kafka
/// Connect's topics often are) is refused by name, in both delivery modes
/// and by `check`: each start would scan every partition, and a key moved
/// to another partition could bring an older record back after compaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_progress_topic_with_several_partitions_is_refused_by_name() {
    let db = TestDb::new("hard_progparts").await;
    let dir = tempfile::tempdir().unwrap();
    let brokers = &broker().brokers;
    let p = prefix("progparts");
    let progress = format!("{p}.progress");
    let (b, t) = (brokers.clone(), progress.clone());
    tokio::task::spawn_blocking(move || {
        crate::harness::broker::create_topics_sized(&b, &[t], 3, &[("cleanup.policy", "compact")])
    })
    .await
    .unwrap();
    let client = db.client().await;
    for (mode, kafka) in [
        ("at-least-once", format!("progress_topic = \"{progress}\"")),
        (
            "exactly-once",
            format!("progress_topic = \"{progress}\"\ndelivery = \"exactly-once\""),
        ),
    ] {
        let cfg = daemon_config(
            dir.path(),
            &format!("{mode}.toml"),
            &db.superuser_url(),
            "progparts",
            brokers,
            &p,
            "",
            &kafka,
            "",
        );
        let (code, out, _) = super::outboxd_async(&["check", "--config", cfg.to_str().unwrap()]).await;
        assert_ne!(code, Some(0), "{mode}: {out}");
        assert!(
            out.contains("FAIL") && out.contains("has 3 partitions") && out.contains(&progress),
            "{mode}: {out}"
        );
        let log = dir.path().join(format!("{mode}.log"));
        let mut d = Daemon::start(&cfg, &log);
        assert_eq!(
            exits(&mut d, Duration::from_secs(30), &log).await,
            Some(1),
            "{mode}"
        );
        let text = log_text(&log);
        assert!(
            text.contains(&format!("the progress topic \\\"{progress}\\\" has 3 partitions"))
                || text.contains(&format!("the progress topic \"{progress}\" has 3 partitions")),
            "{mode}: {text}"
        );
        assert_eq!(
            confirmed_flush(&client, "progparts").await,
            None,
            "{mode}: no slot made"
        );
    }
}

/// `check` before the first start reads a progress topic that does not
/// exist yet. Reading it must not make the broker create it (with the
/// broker's default delete retention): the daemon would then refuse to
/// start, and a second `check` would fail where the first passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_before_the_first_start_leaves_the_progress_topic_to_the_daemon() {
    let db = TestDb::new("hard_firstcheck").await;
    let dir = tempfile::tempdir().unwrap();
    let brokers = &broker().brokers;
    let p = prefix("firstcheck");
    let progress = format!("{p}.progress");
    let cfg = daemon_config(
        dir.path(),
        "f.toml",
        &db.superuser_url(),
        "firstcheck",
        brokers,
        &p,
        "",
        &format!("progress_topic = \"{progress}\""),
        "",
    );
    for round in ["first", "second"] {
        let (code, out, _) = super::outboxd_async(&["check", "--config", cfg.to_str().unwrap()]).await;
        assert_eq!(code, Some(0), "{round} check:\n{out}");
        assert!(!out.contains("FAIL"), "{round} check:\n{out}");
    }
    let b = brokers.clone();
    let pre = p.clone();
    let made = tokio::task::spawn_blocking(move || crate::harness::broker::topics_with_prefix(&b, &pre))
        .await
        .unwrap();
    assert!(!made.contains(&progress), "check created {progress}: {made:?}");

    let log = dir.path().join("f.log");
    let daemon = Daemon::start(&cfg, &log);
    let client = db.client().await;
    wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(&client, "firstcheck").await
    })
    .await;
    let (events, _) = write_events(&client, 3, 1, 1, &["Order"], 0).await;
    wait_ids(
        brokers,
        &[&format!("{p}.order")],
        &events.iter().map(|e| e.id).collect(),
    )
    .await;
    let (_, out, _) = super::outboxd_async(&["check", "--config", cfg.to_str().unwrap()]).await;
    assert!(out.contains("ok   retention"), "after the start:\n{out}");
    assert!(daemon.sigterm().success());
}

/// A record more than one read window (1,000 offsets) behind the end of
/// its partition: the reader steps back window by window. Before, each
/// step re-assigned the same consumer and asked its position at once,
/// before librdkafka had reset it, so a step could take the last
/// window's end for its own and read nothing: the register read "no
/// record", and a lost slot, a rewound server or a changed publication
/// went unseen. Progress topics are shared by every source and every
/// exactly-once transaction, so a record this far back is ordinary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_far_behind_the_end_of_its_partition_is_found() {
    use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
    let brokers = broker().brokers.clone();
    let p = prefix("regfar");
    let topic = format!("{p}.progress");
    {
        let (b, t) = (brokers.clone(), topic.clone());
        tokio::task::spawn_blocking(move || {
            crate::harness::broker::create_topics_sized(&b, &[t], 1, &[("cleanup.policy", "compact")])
        })
        .await
        .unwrap();
    }
    let text = crate::relay::config_text(
        "postgres://unused@127.0.0.1/unused",
        "regfar",
        &brokers,
        "",
        &format!("progress_topic = \"{topic}\""),
    );
    let (config, _) = Config::from_toml(&text, |_| None).unwrap();
    let record =
        slot_register::SlotRecord::new("regfar", "db", "7000000000000000001", 1, outboxd::Lsn(0x1000));
    slot_register::write(&config.kafka, &record, Duration::from_secs(10))
        .await
        .unwrap();
    // 2,500 records of other keys behind it in the topic's one
    // partition: its window is the second.
    let producer: FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()
        .unwrap();
    let keys: Vec<String> = (0..2500).map(|i| format!("other-{i}")).collect();
    let sends: Vec<_> = keys
        .iter()
        .map(|key| {
            producer
                .send_result(FutureRecord::to(&topic).partition(0).key(key).payload("{}"))
                .unwrap()
        })
        .collect();
    for s in sends {
        s.await.unwrap().unwrap();
    }
    producer.flush(Duration::from_secs(10)).unwrap();
    for attempt in 0..3 {
        let read = slot_register::read(
            &config.kafka,
            "7000000000000000001",
            "regfar",
            Duration::from_secs(10),
        )
        .await
        .unwrap();
        assert_eq!(
            read.as_ref().map(|r| r.confirmed_lsn.as_str()),
            Some("0/1000"),
            "read {attempt}: the record 2,500 offsets back"
        );
    }
}

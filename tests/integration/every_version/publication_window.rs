//! Class 2: the publication changed while no session streamed. The
//! publication guard proves it from a session's start on; WAL between the
//! slot's position and that start was never proven, and rows written there
//! while the table was out of the publication were lost.

use std::collections::HashSet;
use std::time::Duration;

use uuid::Uuid;

use crate::hardening::{daemon_config, exits, ids, log_text, outboxd_async, prefix, records, wait_ids};
use crate::harness::broker::broker;
use crate::harness::{wait_for, TestDb};
use crate::relay::{confirmed_flush, write_events, Daemon};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publication_changed_while_outboxd_was_down_is_refused_until_the_window_is_replayed() {
    let db = TestDb::new("hard_pubwin").await;
    let client = db.client().await;
    let dir = tempfile::tempdir().unwrap();
    let brokers = &broker().brokers;
    let p = prefix("pubwin");
    let topic = format!("{p}.order");
    let slot = "pubwin";
    let cfg = daemon_config(
        dir.path(),
        "pubwin.toml",
        &db.superuser_url(),
        slot,
        brokers,
        &p,
        "",
        "",
        "",
    );
    let c = cfg.to_str().unwrap();
    let log = dir.path().join("pubwin.log");

    let daemon = Daemon::start(&cfg, &log);
    wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(&client, slot).await
    })
    .await;
    let (a, _) = write_events(&client, 5, 1, 3, &["Order"], 0).await;
    wait_ids(brokers, &[&topic], &a.iter().map(|e| e.id).collect()).await;
    assert!(daemon.sigterm().success());

    // A restart over an unchanged publication streams on.
    let daemon = Daemon::start(&cfg, &log);
    let (b, _) = write_events(&client, 5, 1, 3, &["Order"], 5).await;
    wait_ids(brokers, &[&topic], &b.iter().map(|e| e.id).collect()).await;
    assert!(daemon.sigterm().success());

    // While it is stopped: the table leaves the publication, rows are
    // written, and it comes back.
    client
        .batch_execute("ALTER PUBLICATION pubwin DROP TABLE outbox")
        .await
        .unwrap();
    let (gap, _) = write_events(&client, 10, 1, 3, &["Order"], 10).await;
    client
        .batch_execute("ALTER PUBLICATION pubwin ADD TABLE outbox")
        .await
        .unwrap();

    let (code, out, _) = outboxd_async(&["check", "--config", c]).await;
    assert_ne!(code, Some(0), "{out}");
    assert!(
        out.contains("FAIL register") && out.contains("cannot be shown unchanged"),
        "{out}"
    );
    let mut refused = Daemon::start(&cfg, &log);
    assert_eq!(exits(&mut refused, Duration::from_secs(30), &log).await, Some(1));
    let text = log_text(&log);
    assert!(
        text.contains("cannot show that publication pubwin delivered"),
        "{text}"
    );
    let gap_ids: HashSet<Uuid> = gap.iter().map(|e| e.id).collect();
    let in_kafka = ids(&records(brokers, &[&topic]).await);
    assert!(
        gap_ids.is_disjoint(&in_kafka),
        "rows written outside the publication never reached Kafka"
    );

    // The recovery the error prints: the replay of the window, then
    // accepting the publication as it is.
    run_printed_replay(&text, dir.path()).await;
    wait_ids(brokers, &[&topic], &gap_ids).await;
    let (code, out, err) = outboxd_async(&["progress", "--config", c, "--accept-publication"]).await;
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.contains("recorded publication pubwin"), "{out}");

    let daemon = Daemon::start(&cfg, &log);
    let (d, _) = write_events(&client, 5, 1, 3, &["Order"], 20).await;
    wait_ids(brokers, &[&topic], &d.iter().map(|e| e.id).collect()).await;
    assert!(daemon.sigterm().success());
}

/// Runs the last `outboxd replay …` command an error in `log_text` printed,
/// in `dir`.
async fn run_printed_replay(log_text: &str, dir: &std::path::Path) {
    let replay = log_text
        .lines()
        .rev()
        .find_map(|l| {
            let start = l.find("`outboxd replay ")? + 1;
            let end = l[start..].find('`')? + start;
            Some(l[start..end].to_owned())
        })
        .expect("a replay command in the error");
    let replay = replay.replacen("outboxd", crate::relay::bin(), 1);
    let cwd = dir.to_owned();
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
    assert!(status.success(), "the printed replay command");
}

/// A table published through its schema (`FOR TABLES IN SCHEMA`) and
/// moved out of that schema and back has the same name, oid and
/// publication rows, and PostgreSQL decoded none of the rows written while
/// it was away: the move is a change of the publication, found while
/// stopped and while streaming. A routine `ADD COLUMN` is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_moved_out_of_its_schema_publication_and_back_is_refused() {
    let db = TestDb::new("hard_schemapub").await;
    let admin = db.client().await;
    admin
        .batch_execute(
            "CREATE SCHEMA fs; CREATE SCHEMA fs_away;
             CREATE TABLE fs.outbox (LIKE public.outbox INCLUDING ALL);
             CREATE PUBLICATION schemapub FOR TABLES IN SCHEMA fs WITH (publish = 'insert');",
        )
        .await
        .unwrap();
    // The writer finds the outbox wherever it is now.
    let writer = db.client().await;
    let to = |schema: &'static str| {
        let writer = &writer;
        async move {
            writer
                .batch_execute(&format!("SET search_path = {schema}"))
                .await
                .unwrap()
        }
    };
    to("fs").await;
    let dir = tempfile::tempdir().unwrap();
    let brokers = &broker().brokers;
    let p = prefix("schemapub");
    let topic = format!("{p}.order");
    let slot = "schemapub";
    let text = crate::relay::config_text(
        &db.superuser_url(),
        slot,
        brokers,
        &format!("topic = \"{p}.{{aggregate_type}}\""),
        "",
    )
    .replace(
        "publication = \"schemapub\"\n",
        "publication = \"schemapub\"\ntable = \"fs.outbox\"\ncreate_publication = false\n",
    );
    let cfg = crate::relay::write_config(dir.path(), "schemapub.toml", &text);
    let c = cfg.to_str().unwrap();
    let log = dir.path().join("schemapub.log");
    let sent = |events: &[crate::relay::Event]| events.iter().map(|e| e.id).collect::<HashSet<Uuid>>();

    let daemon = Daemon::start(&cfg, &log);
    wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(&admin, slot).await
    })
    .await;
    let (a, _) = write_events(&writer, 5, 1, 3, &["Order"], 0).await;
    wait_ids(brokers, &[&topic], &sent(&a)).await;
    assert!(daemon.sigterm().success());

    // A column added while stopped changes no delivery: the start goes on.
    admin
        .batch_execute("ALTER TABLE fs.outbox ADD COLUMN note text")
        .await
        .unwrap();
    let daemon = Daemon::start(&cfg, &log);
    let (b, _) = write_events(&writer, 5, 1, 3, &["Order"], 5).await;
    wait_ids(brokers, &[&topic], &sent(&b)).await;
    assert!(daemon.sigterm().success());

    // While stopped: out of the schema, rows written, back in.
    admin
        .batch_execute("ALTER TABLE fs.outbox SET SCHEMA fs_away")
        .await
        .unwrap();
    to("fs_away").await;
    let (away, _) = write_events(&writer, 10, 1, 3, &["Order"], 10).await;
    admin
        .batch_execute("ALTER TABLE fs_away.outbox SET SCHEMA fs")
        .await
        .unwrap();
    to("fs").await;

    let (code, out, _) = outboxd_async(&["check", "--config", c]).await;
    assert_ne!(code, Some(0), "{out}");
    assert!(out.contains("FAIL register"), "{out}");
    let mut refused = Daemon::start(&cfg, &log);
    assert_eq!(exits(&mut refused, Duration::from_secs(30), &log).await, Some(1));
    let text = log_text(&log);
    assert!(
        text.contains("cannot show that publication schemapub delivered"),
        "{text}"
    );
    let away_ids = sent(&away);
    assert!(
        away_ids.is_disjoint(&ids(&records(brokers, &[&topic]).await)),
        "rows written while the table was away never reached Kafka"
    );
    run_printed_replay(&text, dir.path()).await;
    wait_ids(brokers, &[&topic], &away_ids).await;
    let (code, out, err) = outboxd_async(&["progress", "--config", c, "--accept-publication"]).await;
    assert_eq!(code, Some(0), "{out}{err}");

    // While streaming: the round trip in one transaction stops the
    // session before it confirms past it.
    let mut daemon = Daemon::start(&cfg, &log);
    let (d, _) = write_events(&writer, 5, 1, 3, &["Order"], 20).await;
    wait_ids(brokers, &[&topic], &sent(&d)).await;
    writer
        .batch_execute("BEGIN; ALTER TABLE fs.outbox SET SCHEMA fs_away; SET LOCAL search_path = fs_away")
        .await
        .unwrap();
    let (moved, _) = write_events(&writer, 10, 1, 3, &["Order"], 30).await;
    writer
        .batch_execute("ALTER TABLE fs_away.outbox SET SCHEMA fs")
        .await
        .unwrap();
    // Its commit record lies past this.
    let before_commit = crate::relay::current_lsn(&writer).await;
    writer.batch_execute("COMMIT").await.unwrap();
    assert_eq!(exits(&mut daemon, Duration::from_secs(60), &log).await, Some(1));
    let text = log_text(&log);
    assert!(
        text.contains("The publication changed while outboxd streamed"),
        "{text}"
    );
    let confirmed = confirmed_flush(&admin, slot).await.unwrap();
    assert!(
        confirmed <= before_commit,
        "the slot was confirmed to {confirmed}, past the round trip's commit (after {before_commit})"
    );
    assert!(sent(&moved).is_disjoint(&ids(&records(brokers, &[&topic]).await)));
}

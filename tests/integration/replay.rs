//! `outboxd replay` against the real PostgreSQL and Kafka: a lost slot
//! closed by the command outboxd prints, beside a streaming relay; and the
//! selection, throttle, interruption, resume, dead letters and summary.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use uuid::Uuid;

use crate::harness::broker::{broker, consume_to_end, topics_with_prefix, Consumed};
use crate::harness::postgres;
use crate::harness::{wait_for, TestDb};
use crate::relay::{
    bin, config_text, confirmed_flush, current_lsn, expected_order, write_config, write_events, Daemon, Event,
};

fn outboxd(args: &[&str], cwd: &Path) -> Output {
    Command::new(bin())
        .args(args)
        .current_dir(cwd)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

fn said(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs a command line outboxd printed, as a user pastes it into a shell.
fn run_printed(command: &str, cwd: &Path) -> Output {
    let dir = Path::new(bin()).parent().unwrap();
    let path = format!("{}:{}", dir.display(), std::env::var("PATH").unwrap_or_default());
    Command::new("sh")
        .args(["-c", command])
        .env("PATH", path)
        .current_dir(cwd)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// The `outboxd replay …` command in a message, up to its closing backquote.
fn replay_command_in(message: &str) -> String {
    let start = message
        .find("`outboxd replay")
        .unwrap_or_else(|| panic!("no replay command in: {message}"));
    let rest = &message[start + 1..];
    rest[..rest.find('`').unwrap()].to_owned()
}

fn read_all(prefix: &str) -> Vec<Consumed> {
    let brokers = broker().brokers.clone();
    let topics = topics_with_prefix(&brokers, prefix);
    let names: Vec<&str> = topics.iter().map(String::as_str).collect();
    consume_to_end(&brokers, &names, Duration::from_secs(120))
}

fn id_of(m: &Consumed) -> Uuid {
    m.header("id").expect("id header").parse().unwrap()
}

/// Per aggregate, the order of the replayed records' ids.
fn replayed_order(records: &[Consumed]) -> HashMap<String, Vec<Uuid>> {
    let mut order: HashMap<String, Vec<Uuid>> = HashMap::new();
    let mut seen = HashSet::new();
    for m in records.iter().filter(|m| m.header("replayed").is_some()) {
        if seen.insert(id_of(m)) {
            order.entry(m.key.clone()).or_default().push(id_of(m));
        }
    }
    order
}

/// A slot dropped while outboxd was stopped: the relay refuses to start
/// and prints the replay command, `check` prints the same one, and that
/// command, run as printed while the recovered relay streams, re-publishes
/// every event of the gap in commit order per aggregate; nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_slot_is_closed_by_the_replay_command_outboxd_prints() {
    let pg = postgres::dedicated("track_commit_timestamp = on");
    let mut c = pg.client("postgres").await;
    outbox_sdk::migrate::migrate(&mut c).await.unwrap();
    let slot = "replay_gap";
    let prefix = format!("rg{}", Uuid::new_v4().simple());
    let text = config_text(
        &pg.url("postgres", None, "postgres"),
        slot,
        &broker().brokers,
        &format!("topic = \"{prefix}.{{aggregate_type}}\""),
        "",
    );
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "outboxd.toml", &text);
    let log = dir.path().join("outboxd.log");

    // Streamed: A.
    let mut daemon = Daemon::start(&cfg, &log);
    wait_for("the slot", Duration::from_secs(30), || async {
        confirmed_flush(&c, slot).await
    })
    .await;
    // A1 commits well before A2, the last transaction outboxd confirms:
    // the replay starts a second before A2, so A1 is not replayed.
    let (a1, _) = write_events(&c, 10, 5, 12, &["Order", "Payment"], 0).await;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let (a2, _) = write_events(&c, 10, 5, 12, &["Order", "Payment"], 10).await;
    let a: Vec<Event> = a1.iter().chain(&a2).cloned().collect();
    let end = current_lsn(&c).await;
    wait_for("A confirmed", Duration::from_secs(60), || async {
        confirmed_flush(&c, slot).await.filter(|l| *l >= end)
    })
    .await;
    assert!(daemon_stops_cleanly(daemon));

    // The slot is lost while outboxd is down; B is written meanwhile.
    c.execute("SELECT pg_drop_replication_slot($1)", &[&slot])
        .await
        .unwrap();
    let (b, _) = write_events(&c, 30, 4, 12, &["Order", "Payment"], 20).await;

    daemon = Daemon::start(&cfg, &log);
    let exited = wait_for("outboxd to refuse the lost slot", Duration::from_secs(60), || {
        let done = daemon.try_wait();
        async move { done }
    })
    .await;
    assert!(!exited.success());
    let logged = std::fs::read_to_string(&log).unwrap();
    let from_relay = replay_command_in(&logged);
    let check = outboxd(&["check", "--config", cfg.to_str().unwrap()], dir.path());
    let from_check = replay_command_in(&said(&check));
    assert_eq!(from_relay, from_check);
    assert!(
        from_relay.starts_with(&format!("outboxd replay --config {} --since 20", cfg.display())),
        "{from_relay}"
    );

    // Recovery as the message says: reset, start (a new slot), replay the
    // gap while the relay streams C.
    let reset = outboxd(
        &["progress", "--reset", "--config", cfg.to_str().unwrap()],
        dir.path(),
    );
    assert!(reset.status.success(), "{}", said(&reset));
    let _daemon = Daemon::start(&cfg, &log);
    wait_for("the new slot", Duration::from_secs(30), || async {
        confirmed_flush(&c, slot).await
    })
    .await;
    let writer = {
        let c = pg.client("postgres").await;
        tokio::spawn(async move { write_events(&c, 40, 3, 12, &["Order", "Payment"], 50).await.0 })
    };
    let replay = tokio::task::spawn_blocking({
        let (cmd, cwd) = (from_relay.clone(), dir.path().to_owned());
        move || run_printed(&cmd, &cwd)
    })
    .await
    .unwrap();
    let out = said(&replay);
    assert!(replay.status.success(), "{out}");
    assert!(
        out.contains("replay finished") && out.contains("commit time"),
        "{out}"
    );
    let c_events = writer.await.unwrap();
    let end = current_lsn(&c).await;
    wait_for("C confirmed", Duration::from_secs(60), || async {
        confirmed_flush(&c, slot).await.filter(|l| *l >= end)
    })
    .await;

    let records = read_all(&prefix);
    let ids: HashSet<Uuid> = records.iter().map(id_of).collect();
    for e in a.iter().chain(&b).chain(&c_events) {
        assert!(ids.contains(&e.id), "event {} ({}) is lost", e.id, e.aggregate_id);
    }
    let replayed: HashSet<Uuid> = records
        .iter()
        .filter(|m| m.header("replayed").is_some())
        .map(id_of)
        .collect();
    assert!(
        b.iter().all(|e| replayed.contains(&e.id)),
        "every event of the gap is replayed"
    );
    assert!(
        a1.iter().all(|e| !replayed.contains(&e.id)),
        "the replay starts at the gap, not at the beginning"
    );
    // Replayed records of one aggregate keep commit order.
    let order = replayed_order(&records);
    let all: Vec<Event> = a.iter().chain(&b).chain(&c_events).cloned().collect();
    for (agg, want) in expected_order(&all) {
        let want: Vec<Uuid> = want.into_iter().filter(|id| replayed.contains(id)).collect();
        assert_eq!(
            order.get(&agg).cloned().unwrap_or_default(),
            want,
            "replay order of {agg}"
        );
    }
    // The replayed copy is the relay's record plus the header.
    let b0 = &b[0];
    let copy = records
        .iter()
        .find(|m| id_of(m) == b0.id && m.header("replayed").is_some())
        .unwrap();
    assert_eq!(copy.key, b0.aggregate_id);
    assert_eq!(copy.header("type"), Some(b0.event_type.as_str()));
    assert_eq!(
        copy.header("correlationId"),
        Some(format!("corr-{}", b0.txn).as_str())
    );
    assert_eq!(
        copy.topic,
        format!("{prefix}.{}", b0.aggregate_type.to_lowercase())
    );
}

fn daemon_stops_cleanly(daemon: Daemon) -> bool {
    daemon.sigterm().success()
}

/// Selection, dry run, throttle, an interruption and its resume, a poison
/// row dead-lettered, and the counts of the summary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_selects_throttles_resumes_and_accounts_for_every_row() {
    let db = TestDb::new("replay_select").await;
    let c = db.client().await;
    let prefix = format!("rs{}", Uuid::new_v4().simple());
    let text = config_text(
        &db.superuser_url(),
        "replay_select_unused",
        &broker().brokers,
        &format!("topic = \"{prefix}.{{aggregate_type}}\"\non_poison = \"dead-letter\"\ndead_letter_topic = \"{prefix}.dlq\""),
        "",
    );
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "outboxd.toml", &text);
    let cfg = cfg.to_str().unwrap();
    let (events, _) = write_events(&c, 30, 4, 10, &["Order", "Payment"], 0).await;
    let poison = Uuid::now_v7();
    c.execute(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload) VALUES ($1, 'Order', '', 'T', '{}')",
        &[&poison],
    )
    .await
    .unwrap();
    let orders: Vec<&Event> = events.iter().filter(|e| e.aggregate_type == "Order").collect();
    let want = orders.len() + 1;

    // Nothing selected: refused, nothing published.
    let none = outboxd(&["replay", "--config", cfg], dir.path());
    assert_eq!(none.status.code(), Some(2), "{}", said(&none));
    assert!(said(&none).contains("--all"), "{}", said(&none));

    let dry = outboxd(
        &[
            "replay",
            "--config",
            cfg,
            "--aggregate-type",
            "Order",
            "--dry-run",
        ],
        dir.path(),
    );
    assert!(dry.status.success(), "{}", said(&dry));
    assert!(
        said(&dry).contains(&format!("dry run: {want} rows would be replayed, ordered by ")),
        "{}",
        said(&dry)
    );
    let one = outboxd(
        &[
            "replay",
            "--config",
            cfg,
            "--id",
            &events[0].id.to_string(),
            "--dry-run",
        ],
        dir.path(),
    );
    assert!(said(&one).contains("dry run: 1 rows"), "{}", said(&one));
    let future = outboxd(
        &[
            "replay",
            "--config",
            cfg,
            "--since",
            "2999-01-01T00:00:00Z",
            "--dry-run",
        ],
        dir.path(),
    );
    assert!(said(&future).contains("dry run: 0 rows"), "{}", said(&future));

    // Throttled to 10/s: the 61 rows take 6 s, and a stall is made up by
    // at most a second, so the interruption lands in the middle.
    let child = Command::new(bin())
        .args([
            "replay",
            "--config",
            cfg,
            "--aggregate-type",
            "Order",
            "--rate",
            "10",
            "--batch",
            "10",
        ])
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let child = crate::harness::Reaped::new(child);
    // Interrupted once the first batches are acknowledged.
    let state_path = dir.path().join("outboxd-replay.json");
    wait_for("the first batch", Duration::from_secs(30), || {
        let published = std::fs::read(&state_path)
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .and_then(|s| s["counts"]["published"].as_u64())
            .filter(|n| *n >= 10);
        async move { published }
    })
    .await;
    Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    let first = tokio::task::spawn_blocking(move || child.into_inner().wait_with_output())
        .await
        .unwrap()
        .unwrap();
    let first_text = said(&first);
    assert_eq!(first.status.code(), Some(130), "{first_text}");
    assert!(first_text.contains("replay interrupted"), "{first_text}");
    let resume = first_text
        .lines()
        .find_map(|l| l.strip_prefix("resume with: "))
        .unwrap_or_else(|| panic!("no resume command: {first_text}"))
        .to_owned();
    let state: serde_json::Value = serde_json::from_slice(&std::fs::read(&state_path).unwrap()).unwrap();
    let done_first = state["counts"]["published"].as_u64().unwrap();
    assert!(
        (1..want as u64).contains(&done_first) && state["finished"] == false,
        "{state}"
    );

    // A new replay does not overwrite the unfinished one.
    let again = outboxd(&["replay", "--config", cfg, "--all"], dir.path());
    assert_eq!(again.status.code(), Some(2));
    assert!(said(&again).contains("--resume"), "{}", said(&again));

    let resumed = run_printed(&resume, dir.path());
    let resumed_text = said(&resumed);
    assert!(resumed.status.success(), "{resumed_text}");
    assert!(resumed_text.contains("replay finished"), "{resumed_text}");
    eprintln!("{first_text}\n{resumed_text}");
    assert!(
        resumed_text.contains(&format!(
            "all runs     {} published, 1 dead-lettered, 0 gone",
            want - 1
        )),
        "{resumed_text}"
    );

    let records = read_all(&prefix);
    let published: Vec<&Consumed> = records.iter().filter(|m| !m.topic.ends_with(".dlq")).collect();
    assert!(published.iter().all(|m| m.topic == format!("{prefix}.order")));
    assert!(published
        .iter()
        .all(|m| m.header("replayed") == state["startedAt"].as_str()));
    let got: HashSet<Uuid> = published.iter().map(|m| id_of(m)).collect();
    assert!(
        orders.iter().all(|e| got.contains(&e.id)),
        "every Order event is replayed"
    );
    assert_eq!(got.len(), orders.len());
    let dead: Vec<&Consumed> = records.iter().filter(|m| m.topic.ends_with(".dlq")).collect();
    assert_eq!(dead.len(), 1);
    assert_eq!(id_of(dead[0]), poison);
    assert_eq!(dead[0].header("dlq.reason"), Some("empty_key"));
    let order = replayed_order(&records);
    for (agg, ids) in expected_order(&events) {
        if agg.is_empty() || !orders.iter().any(|e| e.aggregate_id == agg) {
            continue;
        }
        assert_eq!(order.get(&agg), Some(&ids), "order of {agg}");
    }
}

/// Without `track_commit_timestamp`, rows are ordered and selected by
/// `created_at`, and `--since` reaches back `--slack` for transactions that
/// began before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_commit_timestamps_replay_orders_by_created_at_and_since_reaches_back_by_slack() {
    let pg = postgres::dedicated("track_commit_timestamp = off");
    let mut c = pg.client("postgres").await;
    outbox_sdk::migrate::migrate(&mut c).await.unwrap();
    let prefix = format!("rc{}", Uuid::new_v4().simple());
    let text = config_text(
        &pg.url("postgres", None, "postgres"),
        "replay_created_unused",
        &broker().brokers,
        &format!("topic = \"{prefix}.{{aggregate_type}}\""),
        "",
    );
    let dir = tempfile::tempdir().unwrap();
    let cfg = write_config(dir.path(), "outboxd.toml", &text);
    let cfg = cfg.to_str().unwrap();
    // A row whose transaction began three minutes before it committed
    // (created_at set to then), and ordinary ones after it.
    let early = Uuid::now_v7();
    c.execute(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload, created_at)
         VALUES ($1, 'Order', 'agg-0', 't', '{}', now() - interval '3 minutes')",
        &[&early],
    )
    .await
    .unwrap();
    let (events, _) = write_events(&c, 10, 3, 4, &["Order"], 0).await;

    let since = (chrono::Utc::now() - chrono::Duration::seconds(60)).to_rfc3339();
    let strict = outboxd(
        &[
            "replay",
            "--config",
            cfg,
            "--since",
            &since,
            "--slack",
            "0s",
            "--dry-run",
        ],
        dir.path(),
    );
    assert!(
        said(&strict).contains(&format!(
            "dry run: {} rows would be replayed, ordered by created_at",
            events.len()
        )),
        "{}",
        said(&strict)
    );
    let replay = outboxd(&["replay", "--config", cfg, "--since", &since], dir.path());
    assert!(replay.status.success(), "{}", said(&replay));
    assert!(
        said(&replay).contains("ordered by created_at, then id"),
        "{}",
        said(&replay)
    );
    assert!(
        said(&replay).contains(&format!("published    {}", events.len() + 1)),
        "the default slack reaches the early row: {}",
        said(&replay)
    );
    let records = read_all(&prefix);
    let order = replayed_order(&records);
    let mut want = expected_order(&events);
    want.get_mut("agg-0").unwrap().insert(0, early);
    for (agg, ids) in want {
        assert_eq!(order.get(&agg), Some(&ids), "created_at order of {agg}");
    }
}

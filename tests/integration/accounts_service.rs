//! Seed 004's read side end to end: PostgreSQL, outboxd, Apache Kafka and
//! the accounts service (`examples/accounts_service`) all real. Commands go
//! in over HTTP, the views come out of Kafka, and every view is checked
//! against what the event store implies.

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_sdk::accounts::{Account, AccountState};
use outbox_sdk::event_store::{AggregateKey, EventStore, NewEvent, RecordedEvent};
use outbox_sdk::outbox::Headers;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;
use serde_json::{json, Value};

use crate::harness::broker::{broker, consume};
use crate::harness::{spawn_example_server, wait_for, TestDb};
use crate::relay::{config_text, spawn_relay_with_slot, stop_relay};

/// The service as a child process, and a blocking HTTP client for it.
struct Service {
    child: crate::harness::Reaped,
    base: String,
    http: ureq::Agent,
}

impl Service {
    fn start(db_url: &str, brokers: &str, args: &[&str]) -> Service {
        let common = [
            "--database-url",
            db_url,
            "--brokers",
            brokers,
            "--listen",
            "127.0.0.1:0",
            "--dlq-replication-factor",
            "1",
        ];
        let (child, base) = spawn_example_server("accounts_service", &[&common[..], args].concat());
        let http = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(30)))
            .build()
            .into();
        Service { child, base, http }
    }

    fn answer(r: Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> (u16, Value) {
        let mut r = r.unwrap();
        let status = r.status().as_u16();
        let body = r.body_mut().read_to_string().unwrap();
        let json = serde_json::from_str(&body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"));
        (status, json)
    }

    fn get(&self, path: &str) -> (u16, Value) {
        Self::answer(self.http.get(format!("{}{path}", self.base)).call())
    }

    fn post(&self, path: &str, body: &Value, correlation_id: Option<&str>) -> (u16, Value) {
        let mut req = self
            .http
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json");
        if let Some(id) = correlation_id {
            req = req.header("x-correlation-id", id);
        }
        Self::answer(req.send(body.to_string()))
    }

    fn post_raw(&self, path: &str, body: &str) -> (u16, Value) {
        Self::answer(
            self.http
                .post(format!("{}{path}", self.base))
                .header("content-type", "application/json")
                .send(body),
        )
    }

    /// Waits until each view has handled `versions` (the sum over accounts
    /// of the last version; read from the views' positions) and the service
    /// reports no lag and no rebuild.
    async fn caught_up(self: &Arc<Self>, client: &tokio_postgres::Client, versions: i64) {
        wait_for("the three views to catch up", Duration::from_secs(120), || {
            let svc = self.clone();
            async move {
                let handled: Vec<i64> = client
                    .query(
                        "SELECT coalesce(sum(version), 0)::bigint FROM projection_positions
                          GROUP BY projection ORDER BY projection",
                        &[],
                    )
                    .await
                    .ok()?
                    .iter()
                    .map(|r| r.get(0))
                    .collect();
                if handled != vec![versions; 3] {
                    return None;
                }
                let (status, body) = tokio::task::spawn_blocking(move || svc.get("/projections"))
                    .await
                    .unwrap();
                assert_eq!(status, 200, "{body}");
                let projections = body["projections"].as_array()?;
                assert_eq!(projections.len(), 3, "{body}");
                projections
                    .iter()
                    .all(|p| p["lag"] == json!(0) && p["rebuilding"] == json!(false))
                    .then_some(())
            }
        })
        .await;
    }

    /// Stops this service and starts one that rebuilds all three views.
    fn rebuild_all(self: Arc<Self>, db_url: &str, brokers: &str, args: &[&str]) -> Arc<Service> {
        Arc::try_unwrap(self).ok().unwrap().stop();
        let all = [
            "--rebuild",
            "balance",
            "--rebuild",
            "history",
            "--rebuild",
            "audit",
        ];
        Arc::new(Service::start(db_url, brokers, &[args, &all[..]].concat()))
    }

    fn stop(mut self) {
        let pid = self.child.id().to_string();
        Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        let status = self.child.wait().unwrap();
        assert!(status.success(), "the service exits 0 on SIGTERM: {status}");
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Every row of `table`, as JSON text, in key order.
async fn dump(client: &tokio_postgres::Client, table: &str) -> Vec<String> {
    client
        .query(
            &format!("SELECT row_to_json(t)::text FROM {table} t ORDER BY 1"),
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

async fn dump_views(client: &tokio_postgres::Client) -> Vec<Vec<String>> {
    let mut all = Vec::new();
    for t in [
        "account_balance_view",
        "account_transaction_history",
        "account_audit_log",
    ] {
        all.push(dump(client, t).await);
    }
    all
}

/// The event store's events of `aggregate_type`, per account, in order.
async fn histories(
    client: &tokio_postgres::Client,
    aggregate_type: &str,
) -> BTreeMap<String, Vec<RecordedEvent>> {
    let ids: Vec<String> = client
        .query(
            "SELECT DISTINCT aggregate_id FROM events WHERE aggregate_type = $1",
            &[&aggregate_type],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let store = EventStore::default();
    let mut out = BTreeMap::new();
    for id in ids {
        let events = store
            .read(client, AggregateKey::new(aggregate_type, &id), 0)
            .await
            .unwrap();
        out.insert(id, events);
    }
    out
}

/// Now, in PostgreSQL's precision (microseconds).
fn now_us() -> DateTime<Utc> {
    DateTime::from_timestamp_micros(Utc::now().timestamp_micros()).unwrap()
}

/// A time as the service writes it in JSON (chrono's serde form).
fn ts(t: &DateTime<Utc>) -> Value {
    json!(t)
}

/// A time for a query string: RFC 3339 in UTC (`Z`, so no `+` to escape).
fn at(t: &DateTime<Utc>) -> String {
    t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
}

/// The state `?at=` must answer: the seed's replay of the events up to the
/// account's version at `t` (the versions before the first that occurred
/// after `t`), or nothing before the account existed.
fn expected_state(events: &[RecordedEvent], t: DateTime<Utc>) -> Option<AccountState> {
    let n = events
        .iter()
        .position(|e| e.occurred_at > t)
        .unwrap_or(events.len());
    (n > 0).then(|| {
        Account::from_history(&events[0].aggregate_id, &events[..n])
            .unwrap()
            .state()
            .clone()
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn accounts_service_end_to_end() {
    let db = TestDb::new("accounts_service").await;
    let client = db.client().await;
    let brokers = broker().brokers.clone();
    let topic = "svc-e2e.account.events";
    let slot = "accounts_service";
    let routing = r#"topic = "svc-e2e.{aggregate_type}.events""#;
    let (relay, stop) = spawn_relay_with_slot(
        &client,
        slot,
        &config_text(&db.superuser_url(), slot, &brokers, routing, ""),
    )
    .await;
    let args = [
        "--topic",
        topic,
        "--dlq-topic",
        "svc-e2e.account.events.dlq",
        "--group-prefix",
        "svc-e2e",
        "--snapshot-every",
        "10",
    ];
    let svc = Arc::new(Service::start(&db.superuser_url(), &brokers, &args));

    // Opening accounts; the framework's validation and the domain's rules.
    const ACCOUNTS: usize = 6;
    for a in 0..ACCOUNTS {
        let (status, body) = svc.post(
            "/accounts",
            &json!({"accountId": format!("acc-{a}"), "ownerId": format!("owner-{a}"), "initialBalance": 1_000}),
            Some(&format!("open-{a}")),
        );
        assert_eq!(status, 201, "{body}");
        assert_eq!(body["balance"], 1_000);
        assert_eq!(body["version"], 1);
    }
    let (status, body) = svc.post("/accounts", &json!({"ownerId": "o", "initialBalance": 7}), None);
    assert_eq!(status, 201, "an id is made when none is given: {body}");
    let generated = body["id"].as_str().unwrap().to_owned();
    assert!(generated.starts_with("acc-"), "{body}");
    let (status, body) = svc.post(
        "/accounts",
        &json!({"accountId": "acc-0", "ownerId": "o", "initialBalance": 1}),
        None,
    );
    assert_eq!((status, body["message"].is_string()), (409, true), "{body}");
    let (status, body) = svc.post(
        "/accounts",
        &json!({"accountId": "acc-n", "ownerId": "o", "initialBalance": -1}),
        None,
    );
    assert_eq!(
        (status, &body["rule"]),
        (422, &json!("negativeInitialBalance")),
        "{body}"
    );
    let (status, body) = svc.post(
        "/accounts",
        &json!({"accountId": "acc-m", "initialBalance": 1}),
        None,
    );
    assert_eq!(status, 422, "ownerId is required: {body}");
    assert!(body["message"].as_str().unwrap().contains("ownerId"), "{body}");
    let (status, body) = svc.post_raw("/accounts", "{not json");
    assert_eq!(status, 400, "{body}");
    assert!(body["message"].is_string(), "{body}");
    let (status, body) = svc.post("/accounts/nobody/deposits", &json!({"amount": 5}), None);
    assert_eq!(status, 404, "{body}");
    let (status, body) = svc.post("/accounts/acc-0/deposits", &json!({"amount": 0}), None);
    assert_eq!(
        (status, &body["rule"]),
        (422, &json!("nonPositiveAmount")),
        "{body}"
    );
    let (status, body) = svc.post("/accounts/acc-0/deposits", &json!({"amount": "5"}), None);
    assert_eq!(
        status, 422,
        "a string amount is the framework's to refuse: {body}"
    );

    // Concurrent clients: movements on every account, and a race of
    // withdrawals on one: 1,000 in the account, 12 clients take 100 each
    // at once, so exactly 10 succeed and 2 break the funds rule.
    let mut moments = vec![now_us()];
    let mut clients = Vec::new();
    for c in 0..12usize {
        let svc = svc.clone();
        clients.push(std::thread::spawn(move || {
            let mut outcomes = Vec::new();
            let (status, body) = svc.post(
                "/accounts/acc-0/withdrawals",
                &json!({"amount": 100, "description": format!("race {c}")}),
                Some(&format!("race-{c}")),
            );
            outcomes.push((status, body["rule"].as_str().unwrap_or_default().to_owned()));
            for i in 0..25usize {
                let account = format!("acc-{}", 1 + (c + i) % (ACCOUNTS - 1));
                let (path, amount) = if i % 3 == 2 {
                    (format!("/accounts/{account}/withdrawals"), 60 + i as i64)
                } else {
                    (format!("/accounts/{account}/deposits"), 25 + i as i64)
                };
                let (status, body) = svc.post(
                    &path,
                    &json!({"amount": amount, "description": format!("client {c} #{i}")}),
                    Some(&format!("c{c}-{i}")),
                );
                assert!(status == 200 || status == 422, "{status} {body}");
                outcomes.push((status, body["rule"].as_str().unwrap_or_default().to_owned()));
            }
            outcomes
        }));
        if c % 4 == 3 {
            std::thread::sleep(Duration::from_millis(30));
            moments.push(now_us());
        }
    }
    let mut race = Vec::new();
    for c in clients {
        race.push(c.join().unwrap()[0].clone());
    }
    let won = race.iter().filter(|(s, _)| *s == 200).count();
    let refused = race
        .iter()
        .filter(|(s, rule)| *s == 422 && rule == "insufficientFunds")
        .count();
    assert_eq!((won, refused), (10, 2), "{race:?}");
    moments.push(now_us());

    // What the event store implies.
    let store_events = histories(&client, "Account").await;
    assert_eq!(store_events.len(), ACCOUNTS + 1);
    let versions: i64 = store_events.values().map(|e| e.len() as i64).sum();
    assert!(versions > 200, "{versions} events");
    svc.caught_up(&client, versions).await;

    // 1. Each view equals the event store.
    for (id, events) in &store_events {
        let state = Account::from_history(id, events).unwrap().state().clone();
        let (status, body) = svc.get(&format!("/accounts/{id}"));
        assert_eq!(status, 200, "{body}");
        assert_eq!(
            body,
            json!({
                "accountId": id, "ownerId": state.owner_id, "balance": state.balance,
                "status": "ACTIVE", "projectionVersion": state.version,
                "updatedAt": ts(&events.last().unwrap().occurred_at),
            }),
        );

        // The history view, paged through 7 at a time, newest first.
        let mut balance = 0;
        let mut want = Vec::new();
        for e in events {
            let amount = e.payload.get("amount").and_then(Value::as_i64);
            let (kind, amount) = match e.event_type.as_str() {
                "AccountOpened" => ("OPENING", e.payload["initialBalance"].as_i64().unwrap()),
                "DepositMade" => ("DEPOSIT", amount.unwrap()),
                _ => ("WITHDRAWAL", amount.unwrap()),
            };
            balance += if kind == "WITHDRAWAL" { -amount } else { amount };
            want.push(json!({
                "version": e.version, "eventId": e.event_id, "kind": kind, "amount": amount,
                "balanceAfter": balance,
                "description": e.payload.get("description").and_then(Value::as_str).unwrap_or_default(),
                "occurredAt": ts(&e.occurred_at),
            }));
        }
        want.reverse();
        let mut got = Vec::new();
        let mut query = "limit=7".to_owned();
        loop {
            let (status, page) = svc.get(&format!("/accounts/{id}/transactions?{query}"));
            assert_eq!(status, 200, "{page}");
            got.extend(page["transactions"].as_array().unwrap().iter().cloned());
            match page["nextBefore"].as_i64() {
                Some(v) => query = format!("limit=7&before={v}"),
                None => break,
            }
        }
        assert_eq!(got, want, "transaction history of {id}");

        // The audit view: every event with its metadata.
        let (status, page) = svc.get(&format!("/accounts/{id}/audit?limit=500"));
        assert_eq!(status, 200, "{page}");
        let audit: Vec<Value> = page["events"].as_array().unwrap().iter().rev().cloned().collect();
        assert_eq!(audit.len(), events.len());
        for (a, e) in audit.iter().zip(events) {
            assert_eq!(
                (
                    &a["eventId"],
                    &a["version"],
                    &a["type"],
                    &a["occurredAt"],
                    &a["payload"]
                ),
                (
                    &json!(e.event_id),
                    &json!(e.version),
                    &json!(e.event_type),
                    &ts(&e.occurred_at),
                    &e.payload
                ),
            );
            assert_eq!(a["correlationId"], e.metadata["correlationId"], "{a}");
            assert!(a["correlationId"].is_string(), "{a}");
        }
    }
    let (_, page) = svc.get("/accounts/acc-0/audit?limit=1");
    assert_eq!(
        page["events"][0]["correlationId"]
            .as_str()
            .map(|c| c.starts_with("race-")),
        Some(true)
    );
    let (status, body) = svc.get("/accounts/acc-0/transactions?limit=0");
    assert_eq!(status, 400, "{body}");
    let (status, _) = svc.get("/accounts/nobody");
    assert_eq!(status, 404);

    // 2. Time travel equals a replay up to the moment: at the commands'
    // moments, at each tenth event's own time and just before it.
    for (id, events) in &store_events {
        let mut times = moments.clone();
        for e in events.iter().step_by(10) {
            times.push(e.occurred_at);
            times.push(e.occurred_at - chrono::Duration::microseconds(1));
        }
        for t in times {
            let (status, body) = svc.get(&format!("/accounts/{id}/state?at={}", at(&t)));
            match expected_state(events, t) {
                Some(state) => {
                    assert_eq!(status, 200, "{id} at {t}: {body}");
                    let mut want = serde_json::to_value(&state).unwrap();
                    want["at"] = ts(&t);
                    assert_eq!(body, want, "{id} at {t}");
                }
                None => assert_eq!(status, 404, "{id} did not exist at {t}: {body}"),
            }
        }
    }
    let (status, body) = svc.get("/accounts/acc-0/state?at=yesterday");
    assert_eq!(status, 400, "{body}");

    // 3. Duplicates and replays change nothing: copies of 30 records are
    // published again, as a producer retry or a replay would.
    let before = dump_views(&client).await;
    let records = tokio::task::spawn_blocking({
        let b = brokers.clone();
        move || consume(&b, &[topic], 30, Duration::from_secs(30))
    })
    .await
    .unwrap();
    assert_eq!(records.len(), 30);
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()
        .unwrap();
    for r in &records {
        let mut headers = OwnedHeaders::new();
        for (k, v) in &r.headers {
            headers = headers.insert(Header {
                key: k,
                value: Some(v),
            });
        }
        producer
            .send(
                FutureRecord::to(topic)
                    .key(&r.key)
                    .payload(&r.value)
                    .partition(r.partition)
                    .headers(headers),
                Duration::from_secs(10),
            )
            .await
            .unwrap();
    }
    svc.caught_up(&client, versions).await;
    let (_, body) = svc.get("/projections");
    for p in body["projections"].as_array().unwrap() {
        assert!(p["duplicates"].as_u64().unwrap() >= 30, "{p}");
        assert_eq!(p["deadLetters"], 0, "{p}");
    }
    assert_eq!(dump_views(&client).await, before, "duplicates changed nothing");

    // 4. Rebuilding each view from the start of the topic gives identical rows.
    let svc = svc.rebuild_all(&db.superuser_url(), &brokers, &args);
    svc.caught_up(&client, versions).await;
    let (_, body) = svc.get("/projections");
    for p in body["projections"].as_array().unwrap() {
        assert!(
            p["applied"].as_u64().unwrap() == versions as u64,
            "a full rebuild: {p}"
        );
    }
    assert_eq!(
        dump_views(&client).await,
        before,
        "a rebuild reproduces every view"
    );
    let (status, body) = svc.get("/healthz");
    assert_eq!((status, body), (200, json!({"status": "ok"})));
    Arc::try_unwrap(svc).ok().unwrap().stop();
    stop_relay(relay, stop).await;
}

/// Events the views refuse (a broken rule, a refused opening, a gap) are
/// dead-lettered, each view moves past them, and an account's later events
/// still apply. The audit log keeps every event that is not a gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn views_move_past_refused_events_and_dead_letter_gaps() {
    let db = TestDb::new("accounts_refused").await;
    let mut client = db.client().await;
    let brokers = broker().brokers.clone();
    let slot = "accounts_refused";
    let (relay, stop) = spawn_relay_with_slot(
        &client,
        slot,
        &config_text(&db.superuser_url(), slot, &brokers, "", ""),
    )
    .await;

    // A writer with rules looser than the read side's (another service, an
    // older release): the event store takes whatever it is given.
    let store = EventStore::default();
    let history: [(&str, Vec<(&str, Value)>); 2] = [
        (
            "acc-x",
            vec![
                ("AccountOpened", json!({"ownerId": "o", "initialBalance": 100})),
                ("DepositMade", json!({"amount": -5})),
                ("DepositMade", json!({"amount": 10})),
                ("WithdrawalMade", json!({"amount": 1000})),
                ("WithdrawalMade", json!({"amount": 3})),
                ("AccountOpened", json!({"ownerId": "o", "initialBalance": 1})),
                ("DepositMade", json!({"amount": 1})),
                ("AccountTeleported", json!({})),
            ],
        ),
        (
            "acc-y",
            vec![
                ("AccountOpened", json!({"initialBalance": 5})),
                ("DepositMade", json!({"amount": 5})),
            ],
        ),
    ];
    for (id, events) in &history {
        for (v, (kind, payload)) in events.iter().enumerate() {
            let tx = client.transaction().await.unwrap();
            let event = NewEvent {
                event_type: (*kind).into(),
                payload: payload.clone(),
            };
            store
                .append(
                    &tx,
                    AggregateKey::new("Ledger", id),
                    v as i64,
                    &[event],
                    &Headers::new(),
                )
                .await
                .unwrap();
            tx.commit().await.unwrap();
        }
    }
    // acc-z is written straight to the outbox (no occurredAt header: the
    // envelope's time is used), and its version 2 never reaches the topic.
    client
        .batch_execute(
            r#"INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload, headers) VALUES
                 (gen_random_uuid(), 'Ledger', 'acc-z', 'AccountOpened', '{"ownerId": "o", "initialBalance": 1}', '{"version": "1"}');
               INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload, headers) VALUES
                 (gen_random_uuid(), 'Ledger', 'acc-z', 'DepositMade', '{"amount": 1}', '{"version": "3"}');
               INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload, headers) VALUES
                 (gen_random_uuid(), 'Ledger', 'acc-w', 'AccountOpened', '{"ownerId": "o", "initialBalance": 1}', '{"version": "first"}');"#,
        )
        .await
        .unwrap();
    let args = [
        "--topic",
        "ledger.events",
        "--dlq-topic",
        "ledger.events.dlq",
        "--group-prefix",
        "ledger",
    ];
    let svc = Arc::new(Service::start(&db.superuser_url(), &brokers, &args));
    // Handled: acc-x 8, acc-y 2, acc-z 1 (the gap waits), acc-w none.
    svc.caught_up(&client, 8 + 2 + 1).await;

    let balance: Vec<(String, i64, i64)> = client
        .query(
            "SELECT account_id, balance, projection_version FROM account_balance_view ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(
        balance,
        vec![("acc-x".to_owned(), 108, 7), ("acc-z".to_owned(), 1, 1)],
        "acc-y's opening was refused: no balance"
    );
    let history: Vec<(String, i64, i64)> = client
        .query(
            "SELECT account_id, version, balance_after FROM account_transaction_history ORDER BY 1, 2",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let history: Vec<(&str, i64, i64)> = history.iter().map(|(a, v, b)| (a.as_str(), *v, *b)).collect();
    assert_eq!(
        history,
        vec![
            ("acc-x", 1, 100),
            ("acc-x", 3, 110),
            ("acc-x", 5, 107),
            ("acc-x", 7, 108),
            ("acc-z", 1, 1)
        ]
    );
    let audited: i64 = client
        .query_one("SELECT count(*) FROM account_audit_log", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(audited, 8 + 2 + 1, "the audit keeps every event but the gap");
    let refused: Vec<(String, String, i64)> = client
        .query(
            "SELECT projection, account_id, version FROM projection_rejections ORDER BY 1, 2, 3",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let mut want = Vec::new();
    for p in ["balance", "history"] {
        for (a, v) in [
            ("acc-x", 2),
            ("acc-x", 4),
            ("acc-x", 6),
            ("acc-x", 8),
            ("acc-y", 1),
            ("acc-y", 2),
        ] {
            want.push((p.to_owned(), a.to_owned(), v));
        }
    }
    assert_eq!(refused, want);

    // Dead letters: each view's refusals, each view's gap, and the record
    // no view can read (once per view).
    let dlq = tokio::task::spawn_blocking({
        let b = brokers.clone();
        move || consume(&b, &["ledger.events.dlq"], 18, Duration::from_secs(30))
    })
    .await
    .unwrap();
    let mut dead: Vec<(String, String, String)> = dlq
        .iter()
        .map(|m| {
            (
                format!(
                    "{} {} v{}",
                    m.header("dlq.projection").unwrap(),
                    m.key,
                    m.header("version").unwrap()
                ),
                m.header("dlq.reason").unwrap().to_owned(),
                m.header("dlq.source.topic").unwrap().to_owned(),
            )
        })
        .collect();
    dead.sort();
    let expect = [
        ("audit acc-w vfirst", "not a positive number"),
        (
            "audit acc-z v3",
            "gap: the audit view of account acc-z is at version 1",
        ),
        ("balance acc-w vfirst", "not a positive number"),
        ("balance acc-x v2", "must be positive"),
        ("balance acc-x v4", "exceeds the balance"),
        ("balance acc-x v6", "already open"),
        ("balance acc-x v8", "unknown event type"),
        ("balance acc-y v1", "ownerId"),
        ("balance acc-y v2", "never opened"),
        ("balance acc-z v3", "gap: the balance view"),
        ("history acc-w vfirst", "not a positive number"),
        ("history acc-x v2", "must be positive"),
        ("history acc-x v4", "exceeds the balance"),
        ("history acc-x v6", "already open"),
        ("history acc-x v8", "unknown event type"),
        ("history acc-y v1", "ownerId"),
        ("history acc-y v2", "never opened"),
        ("history acc-z v3", "gap: the history view"),
    ];
    assert_eq!(dead.len(), expect.len(), "{dead:#?}");
    for ((what, reason, source), (w, r)) in dead.iter().zip(expect) {
        assert_eq!(what, w);
        assert!(reason.contains(r), "{what}: {reason}");
        assert_eq!(source, "ledger.events");
    }
    let (_, body) = svc.get("/projections");
    let dead_letters: Vec<u64> = body["projections"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["deadLetters"].as_u64().unwrap())
        .collect();
    assert_eq!(dead_letters, vec![8, 8, 2], "{body}");

    // A rebuild reproduces the views (and repeats the dead letters).
    let before = dump_views(&client).await;
    let svc = svc.rebuild_all(&db.superuser_url(), &brokers, &args);
    svc.caught_up(&client, 8 + 2 + 1).await;
    assert_eq!(dump_views(&client).await, before);
    Arc::try_unwrap(svc).ok().unwrap().stop();
    stop_relay(relay, stop).await;
}

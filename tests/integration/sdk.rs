//! outbox-sdk against the test PostgreSQL.

use std::time::Duration;

use outbox_sdk::accounts::{Account, AccountCommandError, AccountError, AccountStore};
use outbox_sdk::event_store::EventStore;
use outbox_sdk::migrate::migrate;
use outbox_sdk::orders::{Order, OrderLine, OrderRepository, ORDER_PLACED};
use outbox_sdk::outbox::{append, Headers, OutboxEvent};
use outbox_sdk::retention::{delete_older_than, oldest_unpublished_age, Retain};
use outbox_sdk::schema::{TableName, MIGRATIONS};
use outbox_sdk::SdkError;
use serde_json::json;
use uuid::Uuid;

use crate::harness::TestDb;

async fn count(client: &tokio_postgres::Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

#[tokio::test]
async fn an_order_and_its_event_commit_or_roll_back_together() {
    let db = TestDb::new("sdk_order").await;
    let mut client = db.client().await;
    let order = Order::place(
        "customer-7",
        vec![OrderLine::new("A-1", 2, 1250), OrderLine::new("B-2", 1, 300)],
    )
    .unwrap();
    let mut headers = Headers::new();
    headers.set_correlation_id("req-42");

    let tx = client.transaction().await.unwrap();
    OrderRepository::save(&tx, &order, headers.clone()).await.unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(count(&client, "SELECT count(*) FROM orders").await, 0);
    assert_eq!(count(&client, "SELECT count(*) FROM order_lines").await, 0);
    assert_eq!(
        count(&client, "SELECT count(*) FROM outbox").await,
        0,
        "rolled back together"
    );

    let tx = client.transaction().await.unwrap();
    let event_id = OrderRepository::save(&tx, &order, headers).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(count(&client, "SELECT count(*) FROM orders").await, 1);
    assert_eq!(count(&client, "SELECT count(*) FROM order_lines").await, 2);
    let row = client
        .query_one(
            "SELECT id, aggregate_type, aggregate_id, type, payload, headers FROM outbox",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, Uuid>(0), event_id);
    assert_eq!(event_id.get_version_num(), 7, "time-ordered UUIDv7");
    assert_eq!(row.get::<_, String>(1), "Order");
    assert_eq!(row.get::<_, String>(2), order.id.to_string());
    assert_eq!(row.get::<_, String>(3), ORDER_PLACED);
    assert_eq!(row.get::<_, serde_json::Value>(4)["totalMinor"], 2800);
    assert_eq!(
        row.get::<_, serde_json::Value>(5),
        json!({"correlationId": "req-42"})
    );
}

#[tokio::test]
async fn append_writes_a_batch_in_order_with_headers() {
    let db = TestDb::new("sdk_append").await;
    let client = db.client().await;
    let chosen = Uuid::now_v7();
    let mut traced = OutboxEvent::new("Invoice", "inv-1", "billing.invoice-issued.v1", json!({"n": 1}));
    traced
        .headers
        .set_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
        .unwrap()
        .set_correlation_id("c-1");
    let events = vec![
        traced,
        OutboxEvent::new("Invoice", "inv-1", "billing.invoice-paid.v1", json!({"n": 2})).with_id(chosen),
        OutboxEvent::new("Invoice", "inv-2", "billing.invoice-issued.v1", json!([1, 2, 3])),
    ];
    let ids = append(&client, &events).await.unwrap();
    assert_eq!(ids.len(), 3);
    assert_eq!(ids[1], chosen, "a caller's id is kept");
    let rows = client
        .query("SELECT id, headers FROM outbox ORDER BY ctid", &[])
        .await
        .unwrap();
    let stored: Vec<Uuid> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(stored, ids, "inserted in the given order");
    let h: serde_json::Value = rows[0].get(1);
    assert_eq!(
        h["traceparent"],
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    );
    assert_eq!(h["correlationId"], "c-1");
    let bad = OutboxEvent::new("", "x", "t", json!({}));
    assert!(matches!(
        append(&client, &[bad]).await,
        Err(SdkError::InvalidEvent(_))
    ));
    assert!(append(&client, &[]).await.unwrap().is_empty());
}

async fn open_account(db: &TestDb, id: &str, initial: i64) {
    let mut client = db.client().await;
    let tx = client.transaction().await.unwrap();
    let mut account = Account::open(id, "owner-1", initial).unwrap();
    AccountStore::default()
        .save(&tx, &mut account, &Headers::new())
        .await
        .unwrap();
    tx.commit().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_concurrent_deposits_all_land_once() {
    let db = TestDb::new("sdk_concurrent").await;
    open_account(&db, "acc-c", 1_000).await;
    let mut tasks = Vec::new();
    for i in 1..=20i64 {
        let mut client = db.client().await;
        tasks.push(tokio::spawn(async move {
            AccountStore::default()
                .update(&mut client, "acc-c", 100, &Headers::new(), |a| {
                    a.deposit(i * 10, format!("deposit {i}"))
                })
                .await
        }));
    }
    for t in tasks {
        t.await.unwrap().expect("every deposit succeeds after retries");
    }
    let client = db.client().await;
    let account = AccountStore::default()
        .load(&client, "acc-c")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        account.state().balance,
        1_000 + (1..=20).map(|i| i * 10).sum::<i64>()
    );
    assert_eq!(account.version(), 21);
    assert_eq!(
        count(&client, "SELECT count(*) FROM events WHERE type = 'DepositMade'").await,
        20
    );
    assert_eq!(
        count(
            &client,
            "SELECT count(DISTINCT version) FROM events WHERE aggregate_id = 'acc-c'"
        )
        .await,
        21
    );
    assert_eq!(
        count(
            &client,
            "SELECT max(version) FROM events WHERE aggregate_id = 'acc-c'"
        )
        .await,
        21
    );
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM outbox WHERE aggregate_type = 'Account'"
        )
        .await,
        21,
        "one outbox row per event"
    );
    assert_eq!(
        count(&client, "SELECT count(*) FROM outbox o JOIN events e ON e.event_id = o.id AND (o.headers->>'version')::bigint = e.version").await,
        21,
        "outbox rows carry the event id and version"
    );
}

#[tokio::test]
async fn stale_writer_gets_a_typed_conflict_and_overdraft_writes_nothing() {
    let db = TestDb::new("sdk_conflict").await;
    open_account(&db, "acc-o", 500).await;
    let mut client = db.client().await;
    let store = AccountStore::default();

    // Two writers load version 1; the second to save conflicts.
    let mut a = store.load(&client, "acc-o").await.unwrap().unwrap();
    let mut b = store.load(&client, "acc-o").await.unwrap().unwrap();
    a.deposit(1, "a").unwrap();
    b.deposit(2, "b").unwrap();
    let tx = client.transaction().await.unwrap();
    store.save(&tx, &mut a, &Headers::new()).await.unwrap();
    tx.commit().await.unwrap();
    let tx = client.transaction().await.unwrap();
    let err = store.save(&tx, &mut b, &Headers::new()).await.unwrap_err();
    assert!(
        matches!(&err, outbox_sdk::event_store::EventStoreError::ConcurrencyConflict { aggregate_id, expected_version: 1, .. } if aggregate_id == "acc-o"),
        "{err}"
    );
    tx.rollback().await.unwrap();

    let before = count(&client, "SELECT count(*) FROM events").await;
    let outbox_before = count(&client, "SELECT count(*) FROM outbox").await;
    let err = store
        .update(&mut client, "acc-o", 5, &Headers::new(), |acc| {
            acc.withdraw(10_000, "too much")
        })
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            AccountCommandError::Domain(AccountError::InsufficientFunds {
                balance: 501,
                requested: 10_000
            })
        ),
        "{err}"
    );
    assert_eq!(
        count(&client, "SELECT count(*) FROM events").await,
        before,
        "nothing written"
    );
    assert_eq!(count(&client, "SELECT count(*) FROM outbox").await, outbox_before);
    let err = store
        .update(&mut client, "nope", 5, &Headers::new(), |acc| acc.deposit(1, ""))
        .await
        .unwrap_err();
    assert!(matches!(err, AccountCommandError::NotFound(_)));
}

#[tokio::test]
async fn snapshot_plus_tail_equals_full_replay() {
    let db = TestDb::new("sdk_snapshot").await;
    open_account(&db, "acc-s", 0).await;
    let mut client = db.client().await;
    let store = AccountStore::new(EventStore::default());
    for i in 1..250 {
        store
            .update(&mut client, "acc-s", 3, &Headers::new(), |a| {
                if i % 7 == 0 {
                    a.withdraw(3, "w")
                } else {
                    a.deposit(5, "d")
                }
            })
            .await
            .unwrap();
    }
    let (loaded, info) = store.load_with_info(&client, "acc-s").await.unwrap().unwrap();
    assert_eq!(info.snapshot_version, Some(200));
    assert_eq!(info.events_replayed, 50);
    assert_eq!(loaded.version(), 250);
    let snapshots: Vec<i64> = client
        .query(
            "SELECT version FROM snapshots WHERE aggregate_id = 'acc-s' ORDER BY version",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(snapshots, vec![100, 200]);
    let all = EventStore::default()
        .read(&client, outbox_sdk::accounts::key("acc-s"), 0)
        .await
        .unwrap();
    let replayed = Account::from_history("acc-s", &all).unwrap();
    assert_eq!(loaded.state(), replayed.state());
}

#[tokio::test]
async fn time_travel_reads_the_past_in_sql() {
    let db = TestDb::new("sdk_time").await;
    open_account(&db, "acc-t", 3_000).await;
    let mut client = db.client().await;
    let store = AccountStore::default();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let between: chrono::DateTime<chrono::Utc> = client
        .query_one("SELECT clock_timestamp()", &[])
        .await
        .unwrap()
        .get(0);
    tokio::time::sleep(Duration::from_millis(20)).await;
    store
        .update(&mut client, "acc-t", 3, &Headers::new(), |a| {
            a.deposit(2_500, "salary")
        })
        .await
        .unwrap();
    store
        .update(&mut client, "acc-t", 3, &Headers::new(), |a| {
            a.withdraw(500, "rent")
        })
        .await
        .unwrap();
    let now: chrono::DateTime<chrono::Utc> = client
        .query_one("SELECT clock_timestamp()", &[])
        .await
        .unwrap()
        .get(0);

    let past = store.state_at(&client, "acc-t", between).await.unwrap().unwrap();
    assert_eq!((past.balance, past.version), (3_000, 1));
    let present = store.state_at(&client, "acc-t", now).await.unwrap().unwrap();
    assert_eq!((present.balance, present.version), (5_000, 3));
    let before_open = between - chrono::Duration::hours(1);
    assert_eq!(store.state_at(&client, "acc-t", before_open).await.unwrap(), None);
    let window = store
        .events_between(&client, "acc-t", between, now)
        .await
        .unwrap();
    let types: Vec<&str> = window.iter().map(|e| e.event_type.as_str()).collect();
    assert_eq!(types, vec!["DepositMade", "WithdrawalMade"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_runs_once_even_when_two_processes_race() {
    let db = TestDb::empty("sdk_migrate").await;
    let mut a = db.client().await;
    let mut b = db.client().await;
    let (ra, rb) = tokio::join!(migrate(&mut a), migrate(&mut b));
    let (ra, rb) = (ra.unwrap(), rb.unwrap());
    assert_eq!(
        ra.len() + rb.len(),
        MIGRATIONS.len(),
        "each migration applied exactly once: {ra:?} {rb:?}"
    );
    assert_eq!(
        count(&a, "SELECT count(*) FROM outbox_schema_migrations").await,
        MIGRATIONS.len() as i64
    );
    assert!(migrate(&mut a).await.unwrap().is_empty(), "nothing left to apply");
    a.execute(
        "UPDATE outbox_schema_migrations SET checksum = 'x' WHERE version = 2",
        &[],
    )
    .await
    .unwrap();
    let err = migrate(&mut a).await.unwrap_err();
    assert!(
        matches!(
            err,
            SdkError::MigrationChanged {
                name: "0002_event_store.sql",
                ..
            }
        ),
        "{err}"
    );
    // The lock was released after the failure.
    let held: i64 = count(
        &b,
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted
          AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
    )
    .await;
    assert_eq!(held, 0);
}

#[tokio::test]
async fn retention_deletes_in_batches_and_monitoring_reports_age() {
    let db = TestDb::new("sdk_retention").await;
    let client = db.client().await;
    client
        .batch_execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload, created_at, published_at)
             SELECT gen_random_uuid(), 'Order', g::text, 't', '{}', now() - interval '10 days',
                    CASE WHEN g % 2 = 0 THEN now() END
               FROM generate_series(1, 2500) g;
             INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload)
             SELECT gen_random_uuid(), 'Order', g::text, 't', '{}' FROM generate_series(1, 10) g;",
        )
        .await
        .unwrap();
    let age = oldest_unpublished_age(&client, &TableName::outbox())
        .await
        .unwrap()
        .unwrap();
    assert!(
        age > Duration::from_secs(9 * 86_400) && age < Duration::from_secs(11 * 86_400),
        "{age:?}"
    );
    let week = Duration::from_secs(7 * 86_400);
    let deleted = delete_older_than(&client, &TableName::outbox(), week, 400, Retain::PublishedOnly)
        .await
        .unwrap();
    assert_eq!(deleted, 1_250, "only published rows in polling mode");
    let deleted = delete_older_than(&client, &TableName::outbox(), week, 400, Retain::Cdc)
        .await
        .unwrap();
    assert_eq!(deleted, 1_250);
    assert_eq!(
        count(&client, "SELECT count(*) FROM outbox").await,
        10,
        "recent rows stay"
    );
    let age = oldest_unpublished_age(&client, &TableName::outbox())
        .await
        .unwrap()
        .unwrap();
    assert!(age < Duration::from_secs(600));
}

#[tokio::test]
async fn the_same_id_under_two_aggregate_types_is_two_histories() {
    use outbox_sdk::event_store::{AggregateKey, NewEvent};
    let db = TestDb::new("sdk_two_types").await;
    let mut client = db.client().await;
    let store = EventStore::default();
    let event = |t: &str| NewEvent {
        event_type: t.into(),
        payload: json!({}),
    };
    let account = AggregateKey::new("Account", "42");
    let customer = AggregateKey::new("Customer", "42");
    for (key, types) in [
        (account, vec!["AccountOpened", "DepositMade"]),
        (customer, vec!["CustomerRegistered"]),
    ] {
        let tx = client.transaction().await.unwrap();
        let new: Vec<NewEvent> = types.iter().map(|t| event(t)).collect();
        store
            .append(&tx, key, 0, &new, &Headers::new())
            .await
            .unwrap_or_else(|e| panic!("{key} starts at version 0: {e}"));
        tx.commit().await.unwrap();
    }
    let history = |events: Vec<outbox_sdk::event_store::RecordedEvent>| {
        events
            .into_iter()
            .map(|e| (e.aggregate_type, e.version, e.event_type))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        history(store.read(&client, account, 0).await.unwrap()),
        vec![
            ("Account".into(), 1, "AccountOpened".into()),
            ("Account".into(), 2, "DepositMade".into())
        ]
    );
    assert_eq!(
        history(store.read(&client, customer, 0).await.unwrap()),
        vec![("Customer".into(), 1, "CustomerRegistered".into())]
    );
    // A stale writer is still refused, per history.
    let tx = client.transaction().await.unwrap();
    let err = store
        .append(&tx, customer, 0, &[event("CustomerRenamed")], &Headers::new())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, outbox_sdk::event_store::EventStoreError::ConcurrencyConflict { aggregate_type, .. } if aggregate_type == "Customer"),
        "{err}"
    );
}

#[tokio::test]
async fn migration_0004_separates_histories_the_old_key_mixed() {
    let db = TestDb::empty("sdk_migrate_0004").await;
    let mut client = db.client().await;
    outbox_sdk::migrate::migrate_to(&mut client, 3).await.unwrap();
    // What the old key allowed: Account 42 and Customer 42 sharing one run
    // of versions, a snapshot of each, and an unshared account.
    client
        .batch_execute(
            "INSERT INTO events (event_id, aggregate_type, aggregate_id, version, type, payload) VALUES
               (gen_random_uuid(), 'Account',  '42', 1, 'AccountOpened', '{\"ownerId\": \"o\", \"initialBalance\": 10}'),
               (gen_random_uuid(), 'Account',  '42', 2, 'DepositMade', '{\"amount\": 5}'),
               (gen_random_uuid(), 'Customer', '42', 3, 'CustomerRegistered', '{}'),
               (gen_random_uuid(), 'Customer', '42', 4, 'CustomerRenamed', '{}'),
               (gen_random_uuid(), 'Account',  '42', 5, 'DepositMade', '{\"amount\": 7}'),
               (gen_random_uuid(), 'Account',  '7',  1, 'AccountOpened', '{\"ownerId\": \"o\", \"initialBalance\": 1}'),
               (gen_random_uuid(), 'Account',  '7',  2, 'DepositMade', '{\"amount\": 2}'),
               (gen_random_uuid(), 'Account',  '7',  3, 'DepositMade', '{\"amount\": 3}');
             INSERT INTO snapshots (aggregate_id, version, state) VALUES
               ('42', 4, '{}'),
               ('7', 2, '{\"id\": \"7\", \"ownerId\": \"o\", \"balance\": 3, \"status\": \"ACTIVE\", \"version\": 2}'),
               ('9', 1, '{}');",
        )
        .await
        .unwrap();
    let applied = migrate(&mut client).await.unwrap();
    assert_eq!(
        applied,
        vec![
            "0004_event_store_aggregate_type.sql",
            "0005_event_metadata.sql",
            "0006_event_time_index.sql",
            "0007_outbox_emit.sql",
            "0008_outbox_order_and_emit_grants.sql",
            "0009_outboxd_parked.sql",
            "0010_outboxd_parked_handback.sql"
        ]
    );
    let without: i64 = client
        .query_one("SELECT count(*) FROM events WHERE metadata = '{}'::jsonb", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(without, 8, "events stored before 0005 get empty metadata");

    let versions = |rows: Vec<tokio_postgres::Row>| -> Vec<(String, i64, String)> {
        rows.iter().map(|r| (r.get(0), r.get(1), r.get(2))).collect()
    };
    let events = versions(
        client
            .query(
                "SELECT aggregate_type, version, type FROM events WHERE aggregate_id = '42'
                  ORDER BY aggregate_type, version",
                &[],
            )
            .await
            .unwrap(),
    );
    assert_eq!(
        events,
        vec![
            ("Account".into(), 1, "AccountOpened".into()),
            ("Account".into(), 2, "DepositMade".into()),
            ("Account".into(), 3, "DepositMade".into()),
            ("Customer".into(), 1, "CustomerRegistered".into()),
            ("Customer".into(), 2, "CustomerRenamed".into()),
        ],
        "each type's history is renumbered in its old order"
    );
    let renumbered: Vec<(String, i64, i64)> = client
        .query(
            "SELECT aggregate_type, old_version, new_version FROM events_renumbered ORDER BY 1, 2",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(
        renumbered,
        vec![
            ("Account".into(), 5, 3),
            ("Customer".into(), 3, 1),
            ("Customer".into(), 4, 2)
        ]
    );
    let snapshots: Vec<(String, String, i64)> = client
        .query(
            "SELECT aggregate_type, aggregate_id, version FROM snapshots ORDER BY 2",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    assert_eq!(
        snapshots,
        vec![("Account".into(), "7".into(), 2)],
        "the mixed snapshot and the one no event explains are dropped"
    );
    let store = AccountStore::default();
    let a42 = store.load(&client, "42").await.unwrap().unwrap();
    assert_eq!((a42.state().balance, a42.version()), (22, 3));
    let (a7, info) = store.load_with_info(&client, "7").await.unwrap().unwrap();
    assert_eq!((a7.state().balance, a7.version()), (6, 3));
    assert_eq!(info.snapshot_version, Some(2));
    // The account can move on without colliding with the customer.
    let state = store
        .update(&mut client, "42", 1, &Headers::new(), |a| a.deposit(1, "d"))
        .await
        .unwrap();
    assert_eq!(state.version, 4);
}

async fn now(c: &tokio_postgres::Client) -> chrono::DateTime<chrono::Utc> {
    c.query_one("SELECT clock_timestamp()", &[]).await.unwrap().get(0)
}

/// `state_at` on an account whose writers interleave: a writer whose
/// transaction began first appends the version after a quicker one's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_at_is_a_prefix_of_the_history_when_writers_interleave() {
    let db = TestDb::new("sdk_time_interleaved").await;
    open_account(&db, "acc-i", 100).await;
    let mut slow = db.client().await;
    let mut quick = db.client().await;
    let clock = db.client().await;
    let store = AccountStore::default();
    // The slow writer's transaction begins, and then the moment we ask about.
    let tx = slow.transaction().await.unwrap();
    tx.execute("SELECT 1", &[]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(30)).await;
    let moment = now(&clock).await;
    tokio::time::sleep(Duration::from_millis(30)).await;
    store
        .update(&mut quick, "acc-i", 1, &Headers::new(), |a| {
            a.deposit(10, "quick")
        })
        .await
        .unwrap();
    let mut account = store.load(&tx, "acc-i").await.unwrap().unwrap();
    account.deposit(1, "slow").unwrap();
    store.save(&tx, &mut account, &Headers::new()).await.unwrap();
    tx.commit().await.unwrap();

    let at = store.state_at(&clock, "acc-i", moment).await.unwrap().unwrap();
    assert_eq!((at.version, at.balance), (1, 100), "neither deposit had happened");
    let latest = store
        .state_at(&clock, "acc-i", now(&clock).await)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((latest.version, latest.balance), (3, 111));

    // Rows whose times disagree with their versions (written before
    // migration 0004, or by a clock that stepped back) still give a prefix:
    // version 3 now claims to be older than version 2.
    clock
        .execute(
            "UPDATE events SET occurred_at = $1::timestamptz - interval '10 ms'
              WHERE aggregate_type = 'Account' AND aggregate_id = 'acc-i' AND version = 3",
            &[&moment],
        )
        .await
        .unwrap();
    let at = store.state_at(&clock, "acc-i", moment).await.unwrap().unwrap();
    assert_eq!(
        (at.version, at.balance),
        (1, 100),
        "version 2 had not happened, so neither had 3"
    );
    let window = store
        .events_between(&clock, "acc-i", moment, now(&clock).await)
        .await
        .unwrap();
    let versions: Vec<i64> = window.iter().map(|e| e.version).collect();
    assert_eq!(versions, vec![2, 3]);
}

/// Many writers holding their transactions open for random times; every
/// moment sampled meanwhile must give a consistent state, moving forward.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_at_under_random_interleaving_is_consistent_and_monotonic() {
    let db = TestDb::new("sdk_time_random").await;
    open_account(&db, "acc-r", 0).await;
    let store = AccountStore::new(EventStore::with_snapshot_every(4));
    let mut writers = Vec::new();
    for w in 0..4u64 {
        let mut client = db.client().await;
        writers.push(tokio::spawn(async move {
            // xorshift: reproducible pauses without a dependency.
            let mut seed = 0x9e37_79b9_7f4a_7c15u64 ^ (w + 1);
            let mut pause = move || {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                Duration::from_millis(seed % 15)
            };
            let mut done = 0;
            while done < 12 {
                let tx = client.transaction().await.unwrap();
                tx.execute("SELECT 1", &[]).await.unwrap();
                tokio::time::sleep(pause()).await;
                let mut account = store.load(&tx, "acc-r").await.unwrap().unwrap();
                account.deposit(1 + w as i64, "d").unwrap();
                match store.save(&tx, &mut account, &Headers::new()).await {
                    Ok(_) => {
                        tokio::time::sleep(pause()).await;
                        tx.commit().await.unwrap();
                        done += 1;
                    }
                    Err(outbox_sdk::event_store::EventStoreError::ConcurrencyConflict { .. }) => {
                        tx.rollback().await.unwrap()
                    }
                    Err(e) => panic!("{e}"),
                }
            }
        }));
    }
    let sampler = db.client().await;
    let mut moments = Vec::new();
    while writers.iter().any(|w| !w.is_finished()) {
        moments.push(now(&sampler).await);
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    for w in writers {
        w.await.unwrap();
    }
    assert!(moments.len() > 20, "sampled {} moments", moments.len());
    let all = EventStore::default()
        .read(&sampler, outbox_sdk::accounts::key("acc-r"), 0)
        .await
        .unwrap();
    assert_eq!(all.len(), 1 + 4 * 12);
    let mut last = 0;
    for at in moments {
        let state = store
            .state_at(&sampler, "acc-r", at)
            .await
            .unwrap_or_else(|e| panic!("state_at({at}): {e}"))
            .expect("the account was opened before sampling began");
        assert!(state.version >= last, "time travel went backwards at {at}");
        last = state.version;
        let replayed = Account::from_history("acc-r", &all[..state.version as usize]).unwrap();
        assert_eq!(
            &state,
            replayed.state(),
            "snapshot path equals full replay at {at}"
        );
        assert!(
            all[..state.version as usize].iter().all(|e| e.occurred_at <= at),
            "no event recorded after {at} is in its state"
        );
    }
}

#[tokio::test]
async fn an_event_keeps_its_metadata_and_its_outbox_row_its_time() {
    use outbox_sdk::event_store::{AggregateKey, EventStore, NewEvent, OCCURRED_AT_HEADER};
    let db = TestDb::new("sdk_event_metadata").await;
    let mut client = db.client().await;
    let mut headers = Headers::new();
    headers.set_correlation_id("req-7").insert("tenant", "t-1");
    let tx = client.transaction().await.unwrap();
    let recorded = EventStore::default()
        .append(
            &tx,
            AggregateKey::new("Account", "acc-m"),
            0,
            &[
                NewEvent {
                    event_type: "AccountOpened".into(),
                    payload: json!({"ownerId": "o", "initialBalance": 1}),
                },
                NewEvent {
                    event_type: "DepositMade".into(),
                    payload: json!({"amount": 2}),
                },
            ],
            &headers,
        )
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let read = EventStore::default()
        .read(&client, AggregateKey::new("Account", "acc-m"), 0)
        .await
        .unwrap();
    assert_eq!(read, recorded);
    for e in &read {
        assert_eq!(e.metadata, json!({"correlationId": "req-7", "tenant": "t-1"}));
        let h: serde_json::Value = client
            .query_one("SELECT headers FROM outbox WHERE id = $1", &[&e.event_id])
            .await
            .unwrap()
            .get(0);
        assert_eq!(h["version"], e.version.to_string());
        assert_eq!(h["correlationId"], "req-7");
        let t = chrono::DateTime::parse_from_rfc3339(h[OCCURRED_AT_HEADER].as_str().unwrap()).unwrap();
        assert_eq!(
            t, e.occurred_at,
            "the header is the stored time, to the microsecond"
        );
    }
    assert!(read[0].occurred_at <= read[1].occurred_at);
}

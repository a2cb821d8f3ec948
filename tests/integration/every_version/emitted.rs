//! The table-less outbox against the real PostgreSQL and Kafka: events
//! emitted as logical decoding messages (the SDK's `emit`, SQL's
//! `outbox_emit`, a raw `pg_logical_emit_message`) are published like
//! rows, in order with the rows of their transaction; non-transactional
//! messages, other prefixes and rolled-back transactions never reach
//! Kafka; content that is no event is dead-lettered.

use std::time::Duration;

use outbox_sdk::outbox::{append, emit, OutboxEvent};
use serde_json::{json, Value};
use uuid::Uuid;

use crate::harness::broker::{broker, consume_to_end, Consumed};
use crate::harness::{wait_for, TestDb};
use crate::relay::{config_text, confirmed_flush, current_lsn, spawn_relay_with_slot, stop_relay};

fn event(aggregate_id: &str, n: u32) -> OutboxEvent {
    let mut e = OutboxEvent::new(
        "Shipment",
        aggregate_id,
        format!("shipping.step-{n}.v1"),
        json!({"n": n}),
    );
    e.headers.set_correlation_id(format!("corr-{n}"));
    e
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emitted_events_are_published_like_rows_and_only_when_committed() {
    let db = TestDb::new("emitted").await;
    let mut client = db.client().await;
    let slot = "emitted";
    let prefix = format!("em{}", Uuid::new_v4().simple());
    let text = config_text(
        &db.superuser_url(),
        slot,
        &broker().brokers,
        &format!("topic = \"{prefix}.{{aggregate_type}}\"\non_poison = \"dead-letter\"\ndead_letter_topic = \"{prefix}.dlq\""),
        "",
    );
    let (handle, stop) = spawn_relay_with_slot(&client, slot, &text).await;

    // One transaction mixing rows and messages of one aggregate, plus
    // messages that are not outbox events.
    let tx = client.transaction().await.unwrap();
    let mut order = Vec::new();
    order.extend(append(&tx, &[event("s-1", 1)]).await.unwrap());
    order.extend(emit(&tx, &[event("s-1", 2), event("s-1", 3)]).await.unwrap());
    order.extend(append(&tx, &[event("s-1", 4)]).await.unwrap());
    let sql_id: Uuid = tx
        .query_one(
            "SELECT outbox_emit('Shipment', 's-1', 'shipping.step-5.v1', '{\"n\": 5}', '{\"correlationId\": \"corr-5\"}')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    order.push(sql_id);
    tx.batch_execute(
        "SELECT pg_logical_emit_message(false, 'outbox', '{\"v\":1,\"id\":\"00000000-0000-4000-8000-000000000001\",\"aggregateType\":\"Shipment\",\"aggregateId\":\"s-1\",\"type\":\"non-transactional\",\"payload\":{}}');
         SELECT pg_logical_emit_message(true, 'someone-else', 'not ours');",
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();

    // Rolled back: never published.
    let tx = client.transaction().await.unwrap();
    let rolled_back = emit(&tx, &[event("s-2", 9)]).await.unwrap();
    tx.rollback().await.unwrap();

    // A transaction of messages only, and one whose content is no event.
    let tx = client.transaction().await.unwrap();
    let alone = emit(&tx, &[event("s-3", 1)]).await.unwrap();
    tx.batch_execute("SELECT pg_logical_emit_message(true, 'outbox', '{\"v\": 1, \"id\": \"broken\"}')")
        .await
        .unwrap();
    tx.commit().await.unwrap();

    // outbox_emit refuses what could never be published.
    let err = client
        .query_one("SELECT outbox_emit('Shipment', '', 't', '{}')", &[])
        .await
        .unwrap_err();
    let message = |e: &tokio_postgres::Error| {
        e.as_db_error()
            .map(|d| d.message().to_owned())
            .unwrap_or_default()
    };
    assert!(message(&err).contains("must not be empty"), "{err:?}");
    let err = client
        .query_one("SELECT outbox_emit('Shipment', 's', 't', '{}', '[1]')", &[])
        .await
        .unwrap_err();
    assert!(message(&err).contains("headers must be a JSON object"), "{err:?}");

    let end = current_lsn(&client).await;
    wait_for("everything confirmed", Duration::from_secs(60), || async {
        confirmed_flush(&client, slot).await.filter(|l| *l >= end)
    })
    .await;
    assert!(!handle.is_finished(), "the relay keeps going");
    stop_relay(handle, stop).await;

    let brokers = broker().brokers.clone();
    let (topic, dlq) = (format!("{prefix}.shipment"), format!("{prefix}.dlq"));
    let records: Vec<Consumed> = tokio::task::spawn_blocking(move || {
        consume_to_end(&brokers, &[&topic, &dlq], Duration::from_secs(60))
    })
    .await
    .unwrap();
    let published: Vec<&Consumed> = records.iter().filter(|r| !r.topic.ends_with(".dlq")).collect();
    let ids = |key: &str| -> Vec<Uuid> {
        published
            .iter()
            .filter(|r| r.key == key)
            .map(|r| r.header("id").unwrap().parse().unwrap())
            .collect()
    };
    assert_eq!(
        ids("s-1"),
        order,
        "rows and messages of one transaction, in order"
    );
    assert!(
        ids("s-2").is_empty(),
        "a rolled-back emit never reaches Kafka: {rolled_back:?}"
    );
    assert_eq!(ids("s-3"), alone);
    assert_eq!(
        published.len(),
        order.len() + 1,
        "no non-transactional or foreign message"
    );
    // An emitted event's record is a row's: headers and envelope.
    let step2 = published
        .iter()
        .find(|r| r.header("id") == Some(&order[1].to_string()))
        .unwrap();
    assert_eq!(step2.header("type"), Some("shipping.step-2.v1"));
    assert_eq!(step2.header("aggregateType"), Some("Shipment"));
    assert_eq!(step2.header("correlationId"), Some("corr-2"));
    let v: Value = serde_json::from_slice(&step2.value).unwrap();
    assert_eq!(v["eventId"], order[1].to_string());
    assert_eq!(v["data"], json!({"n": 2}));
    assert!(v["occurredAt"].as_str().unwrap().ends_with('Z'));
    let sql = published
        .iter()
        .find(|r| r.header("id") == Some(&sql_id.to_string()))
        .unwrap();
    assert_eq!(sql.header("correlationId"), Some("corr-5"));
    // The broken message is dead-lettered with its content.
    let dead: Vec<&Consumed> = records.iter().filter(|r| r.topic.ends_with(".dlq")).collect();
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].header("dlq.reason"), Some("unreadable"));
    assert!(
        dead[0].header("dlq.error").unwrap().contains("no outbox event"),
        "{:?}",
        dead[0].header("dlq.error")
    );
    let body: Value = serde_json::from_slice(&dead[0].value).unwrap();
    assert!(
        body["columns"]["content"].as_str().unwrap().contains("broken"),
        "{body}"
    );
}

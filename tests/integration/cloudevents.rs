//! CloudEvents records through the real relay and Kafka, checked against
//! the spec's rules here and decoded by the CloudEvents Python SDK
//! (`cloudevents` from PyPI, its Kafka protocol binding), as a consumer
//! would decode them.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};
use uuid::Uuid;

use crate::harness::broker::{base64url, broker, consume_to_end, Consumed};
use crate::harness::{wait_for, TestDb};
use crate::relay::{config_text, confirmed_flush, current_lsn, spawn_relay_with_slot, stop_relay};

/// The SDK's python (scripts/lib/cloudevents-sdk.sh, run by setup.sh).
fn sdk_python() -> String {
    if let Ok(p) = std::env::var("OUTBOXD_CLOUDEVENTS_PYTHON") {
        return p;
    }
    let out = Command::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/scripts/lib/cloudevents-sdk.sh"
    ))
    .output()
    .expect("scripts/lib/cloudevents-sdk.sh runs");
    assert!(
        out.status.success(),
        "the CloudEvents SDK is missing (run scripts/setup.sh): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// Reads records as JSON lines, decodes each with the SDK's Kafka binding
/// (`from_kafka_event` picks binary or structured mode from the headers, as
/// the binding says), and writes each event back as a JSON line.
const DECODE: &str = r#"
import base64, json, sys
from cloudevents.core.bindings.kafka import KafkaMessage, from_kafka_event
def unb64(v):
    return base64.urlsafe_b64decode(v + "=" * (-len(v) % 4))
for line in sys.stdin:
    r = json.loads(line)
    msg = KafkaMessage(
        headers={k: unb64(v) for k, v in r["headers"]},
        key=r["key"].encode(),
        value=unb64(r["value"]),
    )
    event = from_kafka_event(msg)
    attrs = {k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in event.get_attributes().items()}
    print(json.dumps({"attributes": attrs, "data": event.get_data(), "class": type(event).__name__}))
"#;

fn decode_with_sdk(records: &[Consumed]) -> Vec<Value> {
    let mut child = Command::new(sdk_python())
        .args(["-c", DECODE])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = String::new();
    for r in records {
        let headers: Vec<(String, String)> =
            r.headers.iter().map(|(k, v)| (k.clone(), base64url(v))).collect();
        input.push_str(&json!({"headers": headers, "key": r.key, "value": base64url(&r.value)}).to_string());
        input.push('\n');
    }
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the CloudEvents SDK refused a record: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The spec's rules for one event's attributes (CloudEvents 1.0, "Context
/// Attributes"), from the attribute map as the record carries it.
fn check_spec_rules(attrs: &serde_json::Map<String, Value>) {
    for name in ["id", "source", "specversion", "type"] {
        let v = attrs.get(name).and_then(Value::as_str).unwrap_or_default();
        assert!(
            !v.is_empty(),
            "required attribute {name} is missing or empty: {attrs:?}"
        );
    }
    assert_eq!(attrs["specversion"], "1.0");
    for (name, v) in attrs {
        assert!(
            (1..=20).contains(&name.len())
                && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()),
            "attribute names are lowercase letters and digits, at most 20: {name:?}"
        );
        if name != "data" {
            assert!(v.is_string(), "{name} is a string: {v}");
        }
    }
    if let Some(subject) = attrs.get("subject") {
        assert!(
            !subject.as_str().unwrap().is_empty(),
            "subject, when present, is not empty"
        );
    }
    if let Some(time) = attrs.get("time") {
        chrono::DateTime::parse_from_rfc3339(time.as_str().unwrap()).expect("time is RFC 3339");
    }
    let source = attrs["source"].as_str().unwrap();
    assert!(
        source
            .bytes()
            .all(|b| b.is_ascii_graphic() && !b"\"<>\\^`{|}".contains(&b)),
        "source is a URI-reference: {source:?}"
    );
}

struct Row {
    id: Uuid,
    aggregate_id: &'static str,
    event_type: &'static str,
    payload: Value,
    headers: Value,
    time: Option<&'static str>,
}

fn rows() -> Vec<Row> {
    vec![
        Row {
            id: Uuid::now_v7(),
            aggregate_id: "order-1",
            event_type: "ordering.order-placed.v1",
            payload: json!({"total": 12.5, "lines": [{"sku": "a", "qty": 2}]}),
            headers: json!({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tracestate": "vendor=1"}),
            time: Some("2026-11-30T01:02:03.456789+00:00"),
        },
        Row {
            id: Uuid::now_v7(),
            aggregate_id: "주문/2 ü",
            event_type: "ordering.order-cancelled.v1",
            payload: json!({"reason": "\"quoted\" 취소"}),
            // A row cannot forge attributes.
            headers: json!({"ce_type": "forged", "ce_source": "forged", "content-type": "text/plain", "correlationId": "c-2"}),
            time: Some("1969-12-31T23:59:59+00:00"),
        },
        Row {
            id: Uuid::now_v7(),
            aggregate_id: "order-3",
            event_type: "ordering.order-paid.v1",
            payload: json!([1, null, "x"]),
            headers: json!({}),
            // Not a time RFC 3339 can write: `time` is left out.
            time: None,
        },
    ]
}

async fn publish(mode: &str, source: &str) -> (Vec<Row>, Vec<Consumed>) {
    let db = TestDb::new(&format!("ce_{}", mode.replace('-', "_"))).await;
    let client = db.client().await;
    let slot = format!("ce_{}", mode.replace('-', "_"));
    let prefix = format!("ce{}", Uuid::new_v4().simple());
    let text = config_text(
        &db.superuser_url(),
        &slot,
        &broker().brokers,
        &format!(
            "topic = \"{prefix}.{{aggregate_type}}\"\nvalue = \"{mode}\"\ncloudevents_source = \"{source}\""
        ),
        "",
    );
    let (handle, stop) = spawn_relay_with_slot(&client, &slot, &text).await;
    let rows = rows();
    for r in &rows {
        client
            .execute(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload, headers, created_at)
                 VALUES ($1, 'Order', $2, $3, $4, $5, coalesce($6::text::timestamptz, 'infinity'))",
                &[
                    &r.id,
                    &r.aggregate_id,
                    &r.event_type,
                    &r.payload,
                    &r.headers,
                    &r.time,
                ],
            )
            .await
            .unwrap();
    }
    let end = current_lsn(&client).await;
    wait_for("the rows confirmed", Duration::from_secs(60), || async {
        confirmed_flush(&client, &slot).await.filter(|l| *l >= end)
    })
    .await;
    stop_relay(handle, stop).await;
    let brokers = broker().brokers.clone();
    let topic = format!("{prefix}.order");
    let records =
        tokio::task::spawn_blocking(move || consume_to_end(&brokers, &[&topic], Duration::from_secs(60)))
            .await
            .unwrap();
    assert_eq!(records.len(), rows.len(), "one record a row");
    (rows, records)
}

/// Checks the decoded events against the rows, in partition order.
fn check_events(rows: &[Row], records: &[Consumed], events: &[Value], source: impl Fn(&Row) -> String) {
    for (rec, event) in records.iter().zip(events) {
        let id: Uuid = rec.header("id").unwrap().parse().unwrap();
        let row = rows.iter().find(|r| r.id == id).unwrap();
        let a = &event["attributes"];
        assert_eq!(event["class"], "CloudEvent");
        assert_eq!(a["specversion"], "1.0");
        assert_eq!(a["id"], row.id.to_string());
        assert_eq!(a["type"], row.event_type);
        assert_eq!(a["source"], source(row));
        assert_eq!(a["subject"], row.aggregate_id);
        assert_eq!(a["datacontenttype"], "application/json");
        assert_eq!(a["partitionkey"], row.aggregate_id);
        assert_eq!(event["data"], row.payload);
        // Where the row has no time the record has none (each test checks
        // the record itself); the SDK fills in the time it decoded it.
        if let Some(t) = row.time {
            assert_eq!(
                chrono::DateTime::parse_from_rfc3339(a["time"].as_str().unwrap()).unwrap(),
                chrono::DateTime::parse_from_rfc3339(t).unwrap()
            );
        }
        assert_eq!(a.get("traceparent"), row.headers.get("traceparent"));
        assert_eq!(a.get("tracestate"), row.headers.get("tracestate"));
        // The relay's own headers stay, a row's CloudEvents look-alikes do not.
        assert_eq!(rec.header("type"), Some(row.event_type));
        assert!(!rec
            .headers
            .iter()
            .any(|(_, v)| v == b"forged" || v == b"text/plain"));
        if row.headers.get("correlationId").is_some() {
            assert_eq!(rec.header("correlationId"), Some("c-2"));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_cloudevents_follow_the_spec_and_decode_with_the_sdk() {
    let (rows, records) = publish("cloudevents", "/shop/{aggregate_type}").await;
    for rec in &records {
        assert_eq!(
            rec.header("content-type"),
            Some("application/cloudevents+json; charset=UTF-8")
        );
        assert!(
            !rec.headers.iter().any(|(k, _)| k.starts_with("ce_")),
            "no ce_ headers in structured mode"
        );
        let v: Value = serde_json::from_slice(&rec.value).expect("the value is JSON");
        check_spec_rules(v.as_object().unwrap());
        let id: Uuid = rec.header("id").unwrap().parse().unwrap();
        let row = rows.iter().find(|r| r.id == id).unwrap();
        assert_eq!(
            v.get("time").is_some(),
            row.time.is_some(),
            "time only where RFC 3339 writes it: {v}"
        );
    }
    let events = decode_with_sdk(&records);
    check_events(&rows, &records, &events, |_| "/shop/Order".to_owned());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_cloudevents_follow_the_spec_and_decode_with_the_sdk() {
    let (rows, records) = publish("cloudevents-binary", "urn:shop:{aggregate_type}:{aggregate_id}").await;
    for rec in &records {
        // The attributes as the binding carries them: ce_<name> headers,
        // datacontenttype in content-type, the payload as the value.
        let mut attrs = serde_json::Map::new();
        for (k, v) in &rec.headers {
            let v = std::str::from_utf8(v).expect("header values are UTF-8");
            if let Some(name) = k.strip_prefix("ce_") {
                assert!(
                    attrs.insert(name.to_owned(), json!(v)).is_none(),
                    "one header per attribute: {k}"
                );
            } else if k == "content-type" {
                assert_eq!(v, "application/json");
                attrs.insert("datacontenttype".into(), json!(v));
            }
        }
        check_spec_rules(&attrs);
        let payload: Value = serde_json::from_slice(&rec.value).unwrap();
        let id: Uuid = rec.header("id").unwrap().parse().unwrap();
        let row = rows.iter().find(|r| r.id == id).unwrap();
        assert_eq!(payload, row.payload);
        assert_eq!(
            attrs.contains_key("time"),
            row.time.is_some(),
            "time only where RFC 3339 writes it"
        );
    }
    let events = decode_with_sdk(&records);
    check_events(&rows, &records, &events, |r| {
        let id: String =
            percent_encoding::utf8_percent_encode(r.aggregate_id, percent_encoding::NON_ALPHANUMERIC)
                .to_string()
                .replace("%2D", "-");
        format!("urn:shop:Order:{id}")
    });
}

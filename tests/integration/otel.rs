//! OpenTelemetry spans of published events, received by an OTLP/HTTP
//! receiver in the test ([`crate::harness::otlp`]).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::Span;
use outbox_sdk::outbox::{append, OutboxEvent};
use serde_json::json;
use uuid::Uuid;

use crate::harness::broker::broker;
use crate::harness::otlp::{self, attribute};
use crate::harness::{wait_for, TestDb};
use crate::relay::{config_text, confirmed_flush, current_lsn, spawn_relay_with_slot, stop_relay};

/// Spans received, with their resource's `service.name`.
type Received = Arc<Mutex<Vec<(String, Span)>>>;

async fn receiver(received: Received) -> String {
    otlp::receiver(move |service, span| received.lock().unwrap().push((service, span))).await
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_span_per_traced_event_reaches_an_otlp_receiver_as_the_writers_child() {
    let received: Received = Arc::default();
    let endpoint = receiver(received.clone()).await;
    let db = TestDb::new("otel").await;
    let client = db.client().await;
    let slot = "otel";
    let prefix = format!("ot{}", Uuid::new_v4().simple());
    let text = config_text(
        &db.superuser_url(),
        slot,
        &broker().brokers,
        &format!("topic = \"{prefix}.{{aggregate_type}}\""),
        "",
    ) + &format!(
        "\n[opentelemetry]\nenabled = true\nendpoint = \"{endpoint}\"\nservice_name = \"outboxd-test\"\ntimeout = \"5s\"\n"
    );
    let (handle, stop) = spawn_relay_with_slot(&client, slot, &text).await;

    // The writer's spans: two sampled, one not; and an event without one.
    let writers = [
        ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", "01"),
        ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331", "01"),
        ("11111111111111111111111111111111", "2222222222222222", "00"),
    ];
    let mut events = Vec::new();
    for (i, (trace, span, flags)) in writers.iter().enumerate() {
        let mut e = OutboxEvent::new(
            "Order",
            format!("o-{i}"),
            "ordering.order-placed.v1",
            json!({"i": i}),
        );
        e.headers
            .set_traceparent(&format!("00-{trace}-{span}-{flags}"))
            .unwrap();
        events.push(e);
    }
    events.push(OutboxEvent::new(
        "Order",
        "o-untraced",
        "ordering.order-placed.v1",
        json!({}),
    ));
    let ids = append(&client, &events).await.unwrap();
    let end = current_lsn(&client).await;
    wait_for("the events confirmed", Duration::from_secs(60), || async {
        confirmed_flush(&client, slot).await.filter(|l| *l >= end)
    })
    .await;
    // A clean stop exports what is queued.
    stop_relay(handle, stop).await;

    let spans = wait_for("the spans", Duration::from_secs(30), || {
        let spans = received.lock().unwrap().clone();
        async move { (spans.len() >= 2).then_some(spans) }
    })
    .await;
    assert_eq!(spans.len(), 2, "sampled traced events only: {spans:?}");
    for (i, (trace, parent, _)) in writers[..2].iter().enumerate() {
        let (service, span) = spans
            .iter()
            .find(|(_, s)| hex(&s.trace_id) == *trace)
            .unwrap_or_else(|| panic!("no span in trace {trace}: {spans:?}"));
        assert_eq!(service, "outboxd-test");
        assert_eq!(span.name, "outboxd.publish");
        assert_eq!(
            hex(&span.parent_span_id),
            *parent,
            "the writer's span is the parent"
        );
        assert_ne!(hex(&span.span_id), *parent);
        assert_eq!(span.kind, SpanKind::Producer as i32);
        let attr =
            |k: &str| attribute(&span.attributes, k).unwrap_or_else(|| panic!("{k} missing: {span:?}"));
        assert_eq!(attr("messaging.system"), "kafka");
        assert_eq!(attr("messaging.destination.name"), format!("{prefix}.order"));
        assert_eq!(attr("messaging.kafka.message.key"), format!("o-{i}"));
        assert_eq!(attr("messaging.message.id"), ids[i].to_string());
        assert!(attr("messaging.destination.partition.id").parse::<i32>().unwrap() >= 0);
        assert!(attr("messaging.kafka.offset").parse::<i64>().unwrap() >= 0);
        // The span runs from the commit to the acknowledgement.
        let latency_ms: f64 = attr("outboxd.commit_to_ack_ms").parse().unwrap();
        let duration_ms = (span.end_time_unix_nano - span.start_time_unix_nano) as f64 / 1e6;
        assert!(
            (latency_ms - duration_ms).abs() < 1.0,
            "{latency_ms} vs {duration_ms}"
        );
        assert!(latency_ms < 60_000.0);
        let status = span.status.clone().unwrap_or_default();
        assert_ne!(status.code, 2, "not an error: {status:?}");
    }
}

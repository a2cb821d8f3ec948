//! End-to-end tracing: an OpenTelemetry span `outboxd.publish` per
//! published event, the child of the writer's span, exported over OTLP.
//!
//! # The flow
//!
//! The writer's W3C trace context travels in the row's `traceparent` (and
//! `tracestate`) header, which the SDK sets and outboxd passes on as Kafka
//! headers. With `[opentelemetry] enabled = true`, when a record carrying
//! a valid `traceparent` is handed to the producer, [`PublishTracer::pending`]
//! notes its parent, topic, key and id and the transaction's commit time;
//! when Kafka acknowledges it, [`PendingSpan::finish`] records the span:
//! kind `PRODUCER`, from the commit to the acknowledgement (its duration is
//! the commit → ack latency, also in `outboxd.commit_to_ack_ms`), with the
//! partition and offset, or an error status if the delivery failed.
//! Sampling follows the parent's sampled flag; records without a
//! `traceparent` get no span.
//!
//! Spans are batched and exported by the SDK's batch processor on a thread
//! of its own, over OTLP/HTTP (protobuf) through ureq; a slow or absent
//! collector drops spans (the batch queue is bounded), never events.
//!
//! # Cost
//!
//! Off (the default), the relay holds `None` and each record costs one
//! `Option` check: no header is parsed, nothing is allocated.

use std::time::{Duration, SystemTime};

pub use crate::config::OtelConfig;
use crate::kafka::records::{header, KafkaRecord};
use opentelemetry::trace::{
    Span, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId, TraceState, Tracer,
    TracerProvider,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::trace::{Sampler, SdkTracer, SdkTracerProvider};
use opentelemetry_sdk::Resource;

/// The span's name.
pub const SPAN_NAME: &str = "outboxd.publish";

/// The exporter cannot be set up.
#[derive(Debug, thiserror::Error)]
#[error("cannot set up the OpenTelemetry exporter to {endpoint}: {reason}; check [opentelemetry] endpoint")]
pub struct OtelError {
    endpoint: String,
    reason: String,
}

/// Makes `outboxd.publish` spans and owns their exporter.
#[derive(Debug)]
pub struct PublishTracer {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
}

impl PublishTracer {
    /// The tracer, or `None` when tracing is off.
    pub fn new(cfg: &OtelConfig) -> Result<Option<Self>, OtelError> {
        if !cfg.enabled {
            return Ok(None);
        }
        let err = |reason: String| OtelError {
            endpoint: cfg.endpoint.clone(),
            reason,
        };
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(cfg.timeout.0))
            .http_status_as_error(false)
            .build()
            .into();
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(UreqClient(agent))
            .with_endpoint(cfg.endpoint.clone())
            .with_timeout(cfg.timeout.0)
            .with_headers(
                cfg.headers
                    .iter()
                    .map(|(k, v)| (k.clone(), v.0.clone()))
                    .collect(),
            )
            .build()
            .map_err(|e| err(e.to_string()))?;
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::AlwaysOn)))
            .with_resource(
                Resource::builder()
                    .with_service_name(cfg.service_name.clone())
                    .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
                    .build(),
            )
            .build();
        let tracer = provider.tracer("outboxd");
        Ok(Some(PublishTracer { provider, tracer }))
    }

    /// The span to record when `rec` is acknowledged, if it carries a
    /// valid `traceparent`; `commit_ms` is its transaction's commit time.
    pub fn pending(&self, rec: &KafkaRecord, commit_ms: i64) -> Option<Box<PendingSpan>> {
        let find = |name: &str| {
            rec.headers
                .iter()
                .find(|(k, _)| k == name)
                .and_then(|(_, v)| std::str::from_utf8(v).ok())
        };
        let parent = parse_traceparent(find("traceparent")?, find("tracestate"))?;
        Some(Box::new(PendingSpan {
            tracer: self.tracer.clone(),
            parent,
            topic: rec.topic.clone(),
            key: find(header::AGGREGATE_ID).unwrap_or_default().to_owned(),
            id: find(header::ID).unwrap_or_default().to_owned(),
            commit: SystemTime::UNIX_EPOCH + Duration::from_millis(u64::try_from(commit_ms).unwrap_or(0)),
        }))
    }

    /// Exports what is still queued; call once, when the relay stops.
    pub fn shutdown(&self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!(error = %e, "OpenTelemetry spans still queued at shutdown were not exported");
        }
    }
}

/// A span waiting for its record's acknowledgement.
#[derive(Debug)]
pub struct PendingSpan {
    tracer: SdkTracer,
    parent: SpanContext,
    topic: String,
    key: String,
    id: String,
    commit: SystemTime,
}

impl PendingSpan {
    /// Records the span: acknowledged at `(partition, offset)`, or failed.
    pub fn finish(self, delivered: Result<(i32, i64), String>) {
        let now = SystemTime::now();
        let start = self.commit.min(now);
        let latency_ms = now.duration_since(start).unwrap_or_default().as_secs_f64() * 1000.0;
        let mut attributes = vec![
            KeyValue::new("messaging.system", "kafka"),
            KeyValue::new("messaging.operation.type", "send"),
            KeyValue::new("messaging.operation.name", "publish"),
            KeyValue::new("messaging.destination.name", self.topic),
            KeyValue::new("messaging.kafka.message.key", self.key),
            KeyValue::new("messaging.message.id", self.id),
            KeyValue::new("outboxd.commit_to_ack_ms", latency_ms),
        ];
        if let Ok((partition, offset)) = &delivered {
            attributes.push(KeyValue::new(
                "messaging.destination.partition.id",
                partition.to_string(),
            ));
            attributes.push(KeyValue::new("messaging.kafka.offset", *offset));
        }
        let parent = Context::new().with_remote_span_context(self.parent);
        let mut span = self
            .tracer
            .span_builder(SPAN_NAME)
            .with_kind(SpanKind::Producer)
            .with_start_time(start)
            .with_attributes(attributes)
            .start_with_context(&self.tracer, &parent);
        if let Err(e) = delivered {
            span.set_status(Status::error(e));
        }
        span.end_with_timestamp(now);
    }
}

/// A W3C `traceparent` (and `tracestate`) as a remote parent; `None`
/// when it is not valid trace context.
pub fn parse_traceparent(traceparent: &str, tracestate: Option<&str>) -> Option<SpanContext> {
    let mut parts = traceparent.trim().split('-');
    let (version, trace, span, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let lower_hex = |s: &str, n: usize| {
        s.len() == n
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    if !lower_hex(version, 2) || version == "ff" || (version == "00" && parts.next().is_some()) {
        return None;
    }
    if !lower_hex(trace, 32) || !lower_hex(span, 16) || !lower_hex(flags, 2) {
        return None;
    }
    let trace_id = TraceId::from_hex(trace).ok().filter(|t| *t != TraceId::INVALID)?;
    let span_id = SpanId::from_hex(span).ok().filter(|s| *s != SpanId::INVALID)?;
    let flags = u8::from_str_radix(flags, 16).ok()?;
    let state = tracestate
        .and_then(|s| s.parse::<TraceState>().ok())
        .unwrap_or_default();
    Some(SpanContext::new(
        trace_id,
        span_id,
        TraceFlags::new(flags & TraceFlags::SAMPLED.to_u8()),
        true,
        state,
    ))
}

/// OTLP/HTTP through ureq: the batch processor exports from a thread of its
/// own, where a blocking request is fine.
#[derive(Debug)]
struct UreqClient(ureq::Agent);

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for UreqClient {
    async fn send_bytes(
        &self,
        request: http::Request<bytes::Bytes>,
    ) -> Result<http::Response<bytes::Bytes>, opentelemetry_http::HttpError> {
        let (parts, body) = request.into_parts();
        let mut response = self.0.run(http::Request::from_parts(parts, body.to_vec()))?;
        let status = response.status();
        let body = response
            .body_mut()
            .with_config()
            .limit(4 * 1024 * 1024)
            .read_to_vec()?;
        let mut out = http::Response::new(bytes::Bytes::from(body));
        *out.status_mut() = status;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Secret;

    #[test]
    fn only_valid_trace_context_is_a_parent() {
        let p = parse_traceparent(
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            Some("vendor=1,other=2"),
        )
        .unwrap();
        assert_eq!(p.trace_id().to_string(), "0af7651916cd43dd8448eb211c80319c");
        assert_eq!(p.span_id().to_string(), "b7ad6b7169203331");
        assert!(p.is_sampled() && p.is_remote());
        assert_eq!(p.trace_state().get("vendor"), Some("1"));
        let unsampled =
            parse_traceparent("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00", None).unwrap();
        assert!(!unsampled.is_sampled());
        for bad in [
            "",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
        ] {
            assert!(parse_traceparent(bad, None).is_none(), "{bad:?}");
        }
    }

    #[test]
    fn only_http_endpoints_when_enabled() {
        let mut c = OtelConfig::default();
        assert!(c.validate().is_ok(), "off: nothing to check");
        c.enabled = true;
        assert!(c.validate().is_ok());
        c.endpoint = "https://collector:4318/v1/traces".into();
        assert!(c
            .validate()
            .unwrap_err()
            .contains("local OpenTelemetry Collector"));
        c.endpoint = "not a url".into();
        assert!(c.validate().is_err());
        c.headers.insert("x-api-key".into(), Secret("s3cret".into()));
        assert!(!format!("{c:?}").contains("s3cret"), "{c:?}");
    }
}

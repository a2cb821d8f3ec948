//! A minimal OTLP/HTTP trace receiver: `POST /v1/traces` with a protobuf
//! `ExportTraceServiceRequest`, decoded with the OpenTelemetry protocol
//! definitions (`opentelemetry-proto`), as a collector would.

use axum::body::Bytes;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;

/// Starts a receiver that hands each span, with its resource's
/// `service.name`, to `sink`. Returns its traces endpoint.
pub async fn receiver(sink: impl Fn(String, Span) + Clone + Send + Sync + 'static) -> String {
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: Bytes| {
            let sink = sink.clone();
            async move {
                let request = ExportTraceServiceRequest::decode(body).expect("an OTLP protobuf request");
                for rs in request.resource_spans {
                    let service = rs
                        .resource
                        .as_ref()
                        .and_then(|r| attribute(&r.attributes, "service.name"))
                        .unwrap_or_default();
                    for span in rs.scope_spans.into_iter().flat_map(|s| s.spans) {
                        sink(service.clone(), span);
                    }
                }
                // An empty ExportTraceServiceResponse.
                (
                    [(axum::http::header::CONTENT_TYPE, "application/x-protobuf")],
                    Vec::<u8>::new(),
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port for the OTLP receiver");
    let addr = listener.local_addr().expect("its address");
    tokio::spawn(async move { axum::serve(listener, app).await.expect("the OTLP receiver runs") });
    format!("http://{addr}/v1/traces")
}

/// An attribute's value as text.
pub fn attribute(attrs: &[KeyValue], key: &str) -> Option<String> {
    attrs
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref()?.value.as_ref())
        .map(|v| match v {
            AnyValue::StringValue(s) => s.clone(),
            AnyValue::IntValue(i) => i.to_string(),
            AnyValue::DoubleValue(d) => d.to_string(),
            AnyValue::BoolValue(b) => b.to_string(),
            other => format!("{other:?}"),
        })
}

//! Registry-encoded keys (`routing.key_format` = `avro` or `json-schema`):
//! the `aggregate_id` as an Avro `"string"`, or a JSON string checked by
//! `{"type": "string"}` (draft 7), in the Confluent wire format (magic byte 0, the
//! schema id, the body).
//!
//! The key's schema is the string schema itself, under `<topic>-key`
//! (Confluent's `TopicNameStrategy` for keys, which is what Debezium's
//! Avro converter uses for a string key). outboxd looks that exact schema
//! up under the subject and registers it there when it is absent, so the
//! id is the string schema's whatever else the subject holds, and a key's
//! bytes, and with them its partition, stay the same across restarts and
//! new versions of the subject. Ids are cached per topic for good. An
//! unreachable registry is waited for as for values (nothing is sent, the
//! slot does not move); a registry that refuses the schema stops the
//! relay naming the subject.

use std::time::Duration;

use super::client::ClientError;
use super::{outcome_of, Registry, SchemaError, MAGIC};
use crate::config::KeyFormat;
use crate::kafka::records::KafkaRecord;
use crate::source::outbox::OutboxRow;

/// The key subject of `topic`.
pub fn subject(topic: &str) -> String {
    format!("{topic}-key")
}

/// The string schema of a key format, and its registry type.
fn schema(format: KeyFormat) -> Option<(&'static str, &'static str)> {
    match format {
        KeyFormat::String | KeyFormat::ConnectJson => None,
        KeyFormat::Avro => Some((r#""string""#, "AVRO")),
        // `$schema` tells it from the Avro schema of the same text.
        KeyFormat::JsonSchema => Some((
            r#"{"$schema":"http://json-schema.org/draft-07/schema#","type":"string"}"#,
            "JSON",
        )),
    }
}

/// `key` in the wire format under schema `id`.
pub fn encoded(format: KeyFormat, id: u32, key: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(key.len() + 16);
    out.push(MAGIC);
    out.extend_from_slice(&id.to_be_bytes());
    match format {
        KeyFormat::Avro => {
            // A string is its length (a zig-zag varint), then its UTF-8.
            let mut n = (key.len() as u64) << 1;
            while n >= 0x80 {
                out.push((n as u8) | 0x80);
                n >>= 7;
            }
            out.push(n as u8);
            out.extend_from_slice(key.as_bytes());
        }
        KeyFormat::JsonSchema => {
            // Writing a &str to a Vec cannot fail.
            let _ = serde_json::to_writer(&mut out, key);
        }
        KeyFormat::String | KeyFormat::ConnectJson => return key.as_bytes().to_vec(),
    }
    out
}

impl Registry {
    /// Whether the key of a record for `topic` can be written now.
    pub(super) fn key_ready(&self, topic: &str) -> bool {
        schema(self.key_format).is_none() || self.keys.contains_key(topic)
    }

    /// Finds (or registers) the string schema under `topic`'s key subject,
    /// waiting out an unreachable registry.
    pub(super) async fn resolve_key(&mut self, topic: &str) -> Result<(), SchemaError> {
        let Some((text, kind)) = schema(self.key_format) else {
            return Ok(());
        };
        let subject = subject(topic);
        let mut pause = Duration::from_millis(250);
        let id = loop {
            let s = subject.clone();
            let r = self
                .ask(move |c| match c.lookup(&s, text, kind) {
                    Err(ClientError::NotFound { .. }) => c.register(&s, text, kind),
                    other => other,
                })
                .await;
            self.count(r.as_ref().map_or_else(outcome_of, |_| "ok"));
            match r {
                Ok(id) => break id,
                Err(e) if e.is_transient() => {
                    tracing::warn!(error = %e, subject, retry_in = ?pause,
                        "waiting for the Schema Registry: no event goes to Kafka until its key schema is known");
                    self.pause(pause).await?;
                    pause = (pause * 2).min(Duration::from_secs(10));
                }
                Err(e @ ClientError::Unauthorized { .. }) => return Err(SchemaError::Registry(e)),
                Err(source) => return Err(SchemaError::KeySchema { subject, source }),
            }
        };
        tracing::info!(subject, id, topic, "key schema in use");
        self.keys.insert(topic.to_owned(), id);
        Ok(())
    }

    /// For `outboxd check`: the key subject of `topic` and what it holds
    /// (`None` for string keys). Looks up only: nothing is registered.
    pub(super) async fn check_key(&self, topic: &str) -> Result<Option<String>, ClientError> {
        let Some((text, kind)) = schema(self.key_format) else {
            return Ok(None);
        };
        let subject = subject(topic);
        let s = subject.clone();
        Ok(Some(match self.ask(move |c| c.lookup(&s, text, kind)).await {
            Ok(id) => format!("key {subject}: id {id}"),
            Err(ClientError::NotFound { .. }) => {
                format!("key {subject}: the string schema is not registered yet; outboxd registers it on first use")
            }
            Err(e) => return Err(e),
        }))
    }

    /// Replaces the record's key with the `aggregate_id` in the wire
    /// format. Reads the row, not the record, so it may run twice.
    pub(super) fn encode_key(&self, record: &mut KafkaRecord, row: &OutboxRow) -> Result<(), SchemaError> {
        if schema(self.key_format).is_none() {
            return Ok(());
        }
        let Some(id) = self.keys.get(&record.topic) else {
            return Err(SchemaError::Unusable {
                what: subject(&record.topic),
                format: "key",
                reason: "it was not looked up before encoding (a bug: please report it)".into(),
            });
        };
        record.key = encoded(self.key_format, *id, &row.aggregate_id);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_framed_strings() {
        assert_eq!(encoded(KeyFormat::Avro, 7, "ab"), [0, 0, 0, 0, 7, 4, b'a', b'b']);
        assert_eq!(
            encoded(KeyFormat::JsonSchema, 258, "a\"b"),
            b"\0\0\0\x01\x02\"a\\\"b\""
        );
        assert_eq!(encoded(KeyFormat::String, 1, "k"), b"k");
        // Lengths past one varint byte: 64 is zig-zag 128, two bytes.
        let long = "x".repeat(64);
        assert_eq!(&encoded(KeyFormat::Avro, 1, &long)[5..7], [0x80, 0x01]);
        let schema = apache_avro::Schema::parse_str(r#""string""#).unwrap();
        let key = "주문-1".repeat(40);
        let bytes = encoded(KeyFormat::Avro, 1, &key);
        let read = apache_avro::reader::datum::GenericDatumReader::builder(&schema)
            .build()
            .unwrap()
            .read_value(&mut &bytes[5..])
            .unwrap();
        assert_eq!(read, apache_avro::types::Value::String(key));
    }
}

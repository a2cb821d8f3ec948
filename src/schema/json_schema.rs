//! JSON Schema: the payload's JSON, unchanged, after it validates against
//! a registry schema. Remote `$ref`s are not fetched (the validator is
//! built without HTTP or file resolution), so a schema is only what the
//! registry served.

use serde_json::Value;

use super::avro::Misfit;

/// A compiled JSON Schema.
#[derive(Debug)]
pub struct JsonSchemaCodec {
    validator: jsonschema::Validator,
    /// The schema's `title` (the record-name strategies' subject).
    pub name: Option<String>,
}

impl JsonSchemaCodec {
    pub fn parse(text: &str) -> Result<Self, String> {
        let schema: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
        // Without `$schema`, draft-07, as Confluent's serializers read it.
        let validator = if schema.get("$schema").is_some() {
            jsonschema::validator_for(&schema)
        } else {
            jsonschema::options()
                .with_draft(jsonschema::Draft::Draft7)
                .build(&schema)
        }
        .map_err(|e| format!("not a usable JSON Schema: {e}"))?;
        Ok(JsonSchemaCodec {
            validator,
            name: schema.get("title").and_then(Value::as_str).map(str::to_owned),
        })
    }

    /// Checks `value` (the parsed payload); the payload's own bytes are
    /// what is published.
    pub fn check(&self, value: &Value) -> Result<(), Misfit> {
        self.validator.validate(value).map_err(|e| Misfit {
            path: pointer_to_path(e.instance_path().as_str()),
            reason: e.to_string(),
        })
    }

    /// Checks a body that arrived encoded (a `bytea` payload): UTF-8 JSON
    /// that validates.
    pub fn check_body(&self, body: &[u8]) -> Result<(), Misfit> {
        let value: Value = serde_json::from_slice(body).map_err(|e| Misfit {
            path: "$".into(),
            reason: format!("the encoded body is not JSON: {e}"),
        })?;
        self.check(&value)
    }
}

/// `/items/0/sku` as `$.items[0].sku`.
fn pointer_to_path(pointer: &str) -> String {
    let mut out = String::from("$");
    for part in pointer.split('/').skip(1) {
        let part = part.replace("~1", "/").replace("~0", "~");
        if !part.is_empty() && part.chars().all(|c| c.is_ascii_digit()) {
            out.push_str(&format!("[{part}]"));
        } else {
            super::avro::push_key(&mut out, &part);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn validates_and_names_the_path() {
        let c = JsonSchemaCodec::parse(
            r#"{"$schema":"http://json-schema.org/draft-07/schema#","title":"OrderPlaced","type":"object",
                "required":["orderId"],"properties":{"orderId":{"type":"string"},
                "items":{"type":"array","items":{"type":"object","properties":{"qty":{"type":"integer"}}}}}}"#,
        )
        .unwrap();
        assert_eq!(c.name.as_deref(), Some("OrderPlaced"));
        c.check(&json!({"orderId": "o", "items": [{"qty": 1}]})).unwrap();
        let m = c
            .check(&json!({"orderId": "o", "items": [{"qty": 1}, {"qty": "x"}]}))
            .unwrap_err();
        assert_eq!(m.path, "$.items[1].qty", "{m}");
        let m = c.check(&json!({"items": []})).unwrap_err();
        assert_eq!(m.path, "$");
        assert!(m.reason.contains("orderId"), "{m}");
        assert!(JsonSchemaCodec::parse(r#"{"type": 5}"#).is_err());
        // No `$schema`: draft-07, where `dependencies` applies.
        let c = JsonSchemaCodec::parse(r#"{"type":"object","dependencies":{"card":["billing"]}}"#).unwrap();
        assert!(c.check(&json!({"card": 1})).is_err());
        c.check(&json!({"card": 1, "billing": "x"})).unwrap();
    }
}

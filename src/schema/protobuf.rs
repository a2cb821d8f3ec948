//! Protobuf: a payload's JSON (proto3's JSON mapping) encoded as a message
//! of a registry schema.
//!
//! The registry serves `.proto` text; protox compiles it (the well-known
//! `google/protobuf/*.proto` imports resolve, other imports do not), and
//! prost-reflect parses the payload's JSON into a dynamic message and
//! encodes it. Unknown JSON keys are refused, as proto3's JSON mapping
//! does by default: encoding would drop them.

use prost::Message;
use prost_reflect::{
    DescriptorPool, DeserializeOptions, DynamicMessage, FieldDescriptor, Kind, MessageDescriptor,
};
use protox::file::{ChainFileResolver, File, FileResolver, GoogleFileResolver};
use serde_json::Value;

use super::avro::{push_key, zigzag, Misfit};
use super::numbers::{self, Huge};

/// The name the schema text is compiled under.
const FILE: &str = "outboxd-registry-schema.proto";

/// A compiled schema and the message encoded from it.
#[derive(Debug)]
pub struct ProtobufCodec {
    /// The file's top-level messages, which message indexes start from.
    top: Vec<MessageDescriptor>,
    message: MessageDescriptor,
    /// The message indexes of the wire format, already encoded.
    indexes: Vec<u8>,
    /// The message's full name (the record-name strategies' subject).
    pub name: String,
    /// The message reaches a `double` or `float`: payloads are checked
    /// for integers such a field would round (see [`super::numbers`]).
    floating: bool,
    /// The message reaches a 64-bit integer field, which the Protobuf
    /// reader fills with the nearest value from an integer beyond 64 bits
    /// (`2^64` becomes `u64::MAX`): a payload holding one is checked.
    wide: bool,
}

struct OneFile(String);

/// Whether `message` (or a message it holds, well-known types included)
/// has a field of a kind `wanted` picks.
fn reaches(message: &MessageDescriptor, seen: &mut Vec<String>, wanted: &dyn Fn(&Kind) -> bool) -> bool {
    if seen.iter().any(|s| s == message.full_name()) {
        return false;
    }
    seen.push(message.full_name().to_owned());
    message.fields().any(|f| match f.kind() {
        Kind::Message(m) => reaches(&m, seen, wanted),
        k => wanted(&k),
    })
}

/// Refuses a number that a `double` or `float` of `message` would hold
/// as another number: an integer beyond 64 bits (already rounded when
/// read), or one the type cannot hold exactly.
fn check_exact(
    message: &MessageDescriptor,
    v: &Value,
    path: &mut String,
    huge: &mut Huge<'_>,
) -> Result<(), Misfit> {
    match (message.full_name(), v) {
        ("google.protobuf.DoubleValue" | "google.protobuf.Value", Value::Number(n)) => {
            exact(n, 64, path, huge)
        }
        ("google.protobuf.FloatValue", Value::Number(n)) => exact(n, 32, path, huge),
        ("google.protobuf.Value" | "google.protobuf.ListValue", Value::Array(items)) => {
            let value = message.parent_pool().get_message_by_name("google.protobuf.Value");
            for (i, item) in items.iter().enumerate() {
                let len = path.len();
                path.push_str(&format!("[{i}]"));
                if let Some(value) = &value {
                    check_exact(value, item, path, huge)?;
                }
                path.truncate(len);
            }
            Ok(())
        }
        ("google.protobuf.Value" | "google.protobuf.Struct", Value::Object(fields)) => {
            let value = message.parent_pool().get_message_by_name("google.protobuf.Value");
            for (k, item) in fields {
                let len = path.len();
                push_key(path, k);
                if let Some(value) = &value {
                    check_exact(value, item, path, huge)?;
                }
                path.truncate(len);
            }
            Ok(())
        }
        (_, Value::Object(fields)) => {
            for (k, item) in fields {
                let Some(field) = message
                    .get_field_by_json_name(k)
                    .or_else(|| message.get_field_by_name(k))
                else {
                    continue;
                };
                let len = path.len();
                push_key(path, k);
                check_field(&field, item, path, huge)?;
                path.truncate(len);
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

fn check_field(
    field: &FieldDescriptor,
    v: &Value,
    path: &mut String,
    huge: &mut Huge<'_>,
) -> Result<(), Misfit> {
    match v {
        Value::Array(items) if field.is_list() => {
            for (i, item) in items.iter().enumerate() {
                let len = path.len();
                path.push_str(&format!("[{i}]"));
                check_single(&field.kind(), item, path, huge)?;
                path.truncate(len);
            }
            Ok(())
        }
        Value::Object(entries) if field.is_map() => {
            let Kind::Message(entry) = field.kind() else {
                return Ok(());
            };
            let kind = entry.map_entry_value_field().kind();
            for (k, item) in entries {
                let len = path.len();
                push_key(path, k);
                check_single(&kind, item, path, huge)?;
                path.truncate(len);
            }
            Ok(())
        }
        _ => check_single(&field.kind(), v, path, huge),
    }
}

fn check_single(kind: &Kind, v: &Value, path: &mut String, huge: &mut Huge<'_>) -> Result<(), Misfit> {
    match (kind, v) {
        (Kind::Double, Value::Number(n)) => exact(n, 64, path, huge),
        (Kind::Float, Value::Number(n)) => exact(n, 32, path, huge),
        (Kind::Int64 | Kind::Uint64 | Kind::Sint64 | Kind::Fixed64 | Kind::Sfixed64, Value::Number(n))
            if huge.holds_number(n) =>
        {
            Err(Misfit {
                path: path.to_owned(),
                reason: numbers::HUGE_REASON.to_owned(),
            })
        }
        (Kind::Message(m), v) => check_exact(m, v, path, huge),
        _ => Ok(()),
    }
}

fn exact(n: &serde_json::Number, bits: u8, path: &str, huge: &mut Huge<'_>) -> Result<(), Misfit> {
    let reason = if huge.holds_number(n) {
        numbers::HUGE_REASON.to_owned()
    } else if (bits == 64 && !numbers::exact_in_f64(n)) || (bits == 32 && !numbers::exact_in_f32(n)) {
        numbers::inexact_reason(n, bits)
    } else {
        return Ok(());
    };
    Err(Misfit {
        path: path.to_owned(),
        reason,
    })
}

impl FileResolver for OneFile {
    fn open_file(&self, name: &str) -> Result<File, protox::Error> {
        if name == FILE {
            File::from_source(name, &self.0)
        } else {
            Err(protox::Error::file_not_found(name))
        }
    }
}

impl ProtobufCodec {
    /// Compiles `text` and picks `message` (a full name such as
    /// `shop.OrderPlaced`), or the file's first message.
    pub fn parse(text: &str, message: Option<&str>) -> Result<Self, String> {
        let mut resolver = ChainFileResolver::new();
        resolver.add(OneFile(text.to_owned()));
        resolver.add(GoogleFileResolver::new());
        let mut compiler = protox::Compiler::with_file_resolver(resolver);
        compiler.include_imports(true);
        compiler
            .open_file(FILE)
            .map_err(|e| format!("not a valid Protobuf schema: {e}"))?;
        let fds = compiler.file_descriptor_set();
        let pool = DescriptorPool::from_file_descriptor_set(fds)
            .map_err(|e| format!("not a valid Protobuf schema: {e}"))?;
        let file = pool
            .get_file_by_name(FILE)
            .ok_or_else(|| "the compiled schema is missing".to_owned())?;
        let top: Vec<MessageDescriptor> = file.messages().collect();
        let chosen = match message {
            Some(name) => pool
                .get_message_by_name(name)
                .filter(|m| m.parent_file().name() == FILE)
                .ok_or_else(|| format!("the schema defines no message {name:?}"))?,
            None => top
                .first()
                .cloned()
                .ok_or_else(|| "the schema defines no message".to_owned())?,
        };
        let path = index_path(&top, &chosen)
            .ok_or_else(|| format!("message {} is not reachable", chosen.full_name()))?;
        let mut indexes = Vec::new();
        if path == [0] {
            indexes.push(0);
        } else {
            zigzag(path.len() as i64, &mut indexes);
            for i in &path {
                zigzag(*i as i64, &mut indexes);
            }
        }
        Ok(ProtobufCodec {
            top,
            name: chosen.full_name().to_owned(),
            floating: reaches(&chosen, &mut Vec::new(), &|k| {
                matches!(k, Kind::Double | Kind::Float)
            }),
            wide: reaches(&chosen, &mut Vec::new(), &|k| {
                matches!(
                    k,
                    Kind::Int64 | Kind::Uint64 | Kind::Sint64 | Kind::Fixed64 | Kind::Sfixed64
                )
            }),
            message: chosen,
            indexes,
        })
    }

    /// Appends the message indexes and the encoded message to `out`.
    pub fn encode(&self, json: &str, out: &mut Vec<u8>) -> Result<(), Misfit> {
        let mut de = serde_json::Deserializer::from_str(json);
        let mut track = serde_path_to_error::Track::new();
        let options = DeserializeOptions::new();
        let msg = DynamicMessage::deserialize_with_options(
            self.message.clone(),
            serde_path_to_error::Deserializer::new(&mut de, &mut track),
            &options,
        )
        .and_then(|m| de.end().map(|()| m))
        .map_err(|e| Misfit {
            path: dollar(&track.path().to_string()),
            reason: e.to_string(),
        })?;
        if self.floating || (self.wide && !numbers::huge_integers(json).is_empty()) {
            // Read once more as plain JSON, only for messages with a
            // floating-point field, or a 64-bit one and a huge integer in
            // the payload: the message holds the rounded value.
            let value: Value = serde_json::from_str(json).map_err(|e| Misfit {
                path: "$".into(),
                reason: e.to_string(),
            })?;
            let mut path = String::from("$");
            check_exact(&self.message, &value, &mut path, &mut Huge::new(json))?;
        }
        out.extend_from_slice(&self.indexes);
        msg.encode(out).map_err(|e| Misfit {
            path: "$".into(),
            reason: e.to_string(),
        })
    }

    /// Checks a body that arrived encoded (a `bytea` payload): message
    /// indexes naming a message of the schema, then that message. Returns
    /// the message's full name.
    pub fn check_message(&self, body: &[u8]) -> Result<String, Misfit> {
        let misfit = |reason: String| Misfit {
            path: "$".into(),
            reason,
        };
        let mut rest = body;
        let count = read_zigzag(&mut rest).ok_or_else(|| misfit("no message indexes".into()))?;
        let path: Vec<i64> = if count == 0 {
            vec![0]
        } else {
            if !(1..=64).contains(&count) {
                return Err(misfit(format!("{count} message indexes cannot name a message")));
            }
            (0..count)
                .map(|_| read_zigzag(&mut rest))
                .collect::<Option<_>>()
                .ok_or_else(|| misfit("the message indexes are cut short".into()))?
        };
        let mut level = self.top.clone();
        let mut found = None;
        for &i in &path {
            let m = usize::try_from(i)
                .ok()
                .and_then(|i| level.get(i).cloned())
                .ok_or_else(|| misfit(format!("message indexes {path:?} name no message of the schema")))?;
            level = m.child_messages().filter(|c| !c.is_map_entry()).collect();
            found = Some(m);
        }
        let message = found.ok_or_else(|| misfit("no message indexes".into()))?;
        DynamicMessage::decode(message.clone(), rest).map_err(|e| {
            misfit(format!(
                "the encoded body does not decode as {}: {e}",
                message.full_name()
            ))
        })?;
        Ok(message.full_name().to_owned())
    }
}

/// Reads one zig-zag varint, advancing `rest`.
fn read_zigzag(rest: &mut &[u8]) -> Option<i64> {
    let mut v: u64 = 0;
    for shift in (0..64).step_by(7) {
        let (&b, tail) = rest.split_first()?;
        *rest = tail;
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Some((v >> 1) as i64 ^ -((v & 1) as i64));
        }
    }
    None
}

/// `a.b[0]` as `$.a.b[0]`.
fn dollar(p: &str) -> String {
    if p == "." || p.is_empty() {
        "$".into()
    } else {
        format!("$.{p}")
    }
}

/// The indexes from the file's top-level messages down to `target`.
fn index_path(level: &[MessageDescriptor], target: &MessageDescriptor) -> Option<Vec<usize>> {
    for (i, m) in level.iter().enumerate() {
        if m == target {
            return Some(vec![i]);
        }
        let nested: Vec<MessageDescriptor> = m.child_messages().filter(|c| !c.is_map_entry()).collect();
        if let Some(mut rest) = index_path(&nested, target) {
            rest.insert(0, i);
            return Some(rest);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCHEMA: &str = r#"
        syntax = "proto3";
        package shop;
        import "google/protobuf/timestamp.proto";
        message Other { string x = 1; }
        message OrderPlaced {
          string order_id = 1;
          int64 total_cents = 2;
          repeated Item items = 3;
          google.protobuf.Timestamp placed_at = 4;
          Status status = 5;
          message Item { string sku = 1; int32 qty = 2; }
          enum Status { PLACED = 0; PAID = 1; }
        }
    "#;

    #[test]
    fn integers_a_floating_point_field_would_round_are_misfits() {
        let c = ProtobufCodec::parse(
            r#"
            syntax = "proto3";
            import "google/protobuf/struct.proto";
            import "google/protobuf/wrappers.proto";
            message M {
              double d = 1;
              float f = 2;
              int64 i = 3;
              repeated double ds = 4;
              map<string, double> md = 5;
              google.protobuf.Struct s = 6;
              google.protobuf.DoubleValue w = 7;
              N n = 8;
            }
            message N { double d = 1; }
            "#,
            Some("M"),
        )
        .unwrap();
        let misfit = |json: &str| c.encode(json, &mut Vec::new()).map(|_| ()).unwrap_err();
        let e = misfit(r#"{"d": 123456789012345678901234567890}"#);
        assert_eq!(e.path, "$.d");
        assert!(e.reason.contains("beyond 64 bits"), "{e}");
        assert_eq!(misfit(r#"{"d": 9007199254740993}"#).path, "$.d");
        assert_eq!(misfit(r#"{"f": 16777217}"#).path, "$.f");
        assert_eq!(misfit(r#"{"ds": [1, 9007199254740993]}"#).path, "$.ds[1]");
        assert_eq!(misfit(r#"{"md": {"k": 9007199254740993}}"#).path, "$.md.k");
        assert_eq!(
            misfit(r#"{"s": {"a": [1, -99999999999999999999]}}"#).path,
            "$.s.a[1]"
        );
        assert_eq!(misfit(r#"{"w": 18446744073709551615}"#).path, "$.w");
        assert_eq!(misfit(r#"{"n": {"d": 9007199254740993}}"#).path, "$.n.d");
        // Fractions are the nearest double, exact integers and int64 are as
        // written.
        c.encode(
            r#"{"d": 0.1, "f": 16777216, "i": 9007199254740993, "ds": [9007199254740992], "s": {"x": 2.5}}"#,
            &mut Vec::new(),
        )
        .unwrap();
        // 64-bit integer fields: the reader would saturate one beyond 64
        // bits (2^64 as u64::MAX).
        let wide = ProtobufCodec::parse(
            "syntax = \"proto3\";\nmessage W { uint64 u = 1; int64 i = 2; repeated sint64 r = 3; }\n",
            Some("W"),
        )
        .unwrap();
        assert!(wide.wide && !wide.floating);
        for (json, path) in [
            (r#"{"u": 18446744073709551616}"#, "$.u"),
            (r#"{"i": -9223372036854775809}"#, "$.i"),
            (r#"{"r": [1, 99999999999999999999]}"#, "$.r[1]"),
        ] {
            let e = wide.encode(json, &mut Vec::new()).map(|_| ()).unwrap_err();
            assert_eq!(e.path, path, "{json}");
        }
        wide.encode(
            r#"{"u": 18446744073709551615, "i": -9223372036854775808}"#,
            &mut Vec::new(),
        )
        .unwrap();
        let order = ProtobufCodec::parse(SCHEMA, Some("shop.OrderPlaced")).unwrap();
        assert!(!order.floating && order.wide);
    }

    #[test]
    fn encodes_proto3_json_with_the_message_indexes() {
        let c = ProtobufCodec::parse(SCHEMA, Some("shop.OrderPlaced")).unwrap();
        let mut out = Vec::new();
        c.encode(
            r#"{"orderId":"o-1","totalCents":"1250","items":[{"sku":"a","qty":2}],"placedAt":"2026-12-02T10:00:00Z","status":"PAID"}"#,
            &mut out,
        )
        .unwrap();
        assert_eq!(&out[..2], &[2, 2], "one index, 1, zig-zag encoded");
        let msg = DynamicMessage::decode(c.message.clone(), &out[2..]).unwrap();
        assert_eq!(msg.get_field_by_name("total_cents").unwrap().as_i64(), Some(1250));
        let first = ProtobufCodec::parse(SCHEMA, None).unwrap();
        assert_eq!(first.name, "shop.Other");
        assert_eq!(first.indexes, vec![0]);
        let nested = ProtobufCodec::parse(SCHEMA, Some("shop.OrderPlaced.Item")).unwrap();
        assert_eq!(nested.indexes, vec![4, 2, 0], "two indexes: 1, 0");
    }

    #[test]
    fn encoded_bodies_are_checked_against_the_message_their_indexes_name() {
        let c = ProtobufCodec::parse(SCHEMA, Some("shop.OrderPlaced")).unwrap();
        let mut out = Vec::new();
        c.encode(r#"{"orderId":"o-1","totalCents":"5"}"#, &mut out)
            .unwrap();
        assert_eq!(c.check_message(&out).unwrap(), "shop.OrderPlaced");
        let item = ProtobufCodec::parse(SCHEMA, Some("shop.OrderPlaced.Item")).unwrap();
        let mut nested = Vec::new();
        item.encode(r#"{"sku":"a","qty":2}"#, &mut nested).unwrap();
        assert_eq!(c.check_message(&nested).unwrap(), "shop.OrderPlaced.Item");
        // Index 7 names nothing; a cut-off body does not decode.
        assert!(c
            .check_message(&[2, 14])
            .unwrap_err()
            .reason
            .contains("name no message"));
        let cut = &out[..out.len() - 1];
        assert!(c
            .check_message(cut)
            .unwrap_err()
            .reason
            .contains("does not decode"));
        assert!(c.check_message(&[]).is_err());
    }

    #[test]
    fn a_misfit_names_the_field() {
        let c = ProtobufCodec::parse(SCHEMA, Some("shop.OrderPlaced")).unwrap();
        let m = c
            .encode(
                r#"{"orderId":"o","items":[{"sku":"a","qty":"x"}]}"#,
                &mut Vec::new(),
            )
            .unwrap_err();
        assert_eq!(m.path, "$.items[0].qty", "{m}");
        let m = c
            .encode(r#"{"orderId":"o","bogus":1}"#, &mut Vec::new())
            .unwrap_err();
        assert!(m.reason.contains("bogus"), "{m}");
        let m = c.encode(r#"{"status":"SHIPPED"}"#, &mut Vec::new()).unwrap_err();
        assert_eq!(m.path, "$.status", "{m}");
        assert!(ProtobufCodec::parse("syntax = \"proto3\"; message {", None).is_err());
        assert!(ProtobufCodec::parse(SCHEMA, Some("shop.Nope")).is_err());
    }
}

//! Protobuf: a payload's JSON (proto3's JSON mapping) encoded as a message
//! of a registry schema.
//!
//! The registry serves `.proto` text; protox compiles it (the well-known
//! `google/protobuf/*.proto` imports resolve, other imports do not), and
//! prost-reflect parses the payload's JSON into a dynamic message and
//! encodes it. Unknown JSON keys are refused, as proto3's JSON mapping
//! does by default: encoding would drop them.

use prost::Message;
use prost_reflect::{DescriptorPool, DeserializeOptions, DynamicMessage, MessageDescriptor};
use protox::file::{ChainFileResolver, File, FileResolver, GoogleFileResolver};

use super::avro::{zigzag, Misfit};

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
}

struct OneFile(String);

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

//! Inferred Avro schemas (`routing.schema = "inferred"`): a schema derived
//! from each payload's shape, for teams coming from Debezium's outbox
//! router with `expand.json.payload` and an Avro converter.
//!
//! Where the derivation follows Debezium (`SchemaBuilderUtil`, then the
//! converter's Connect-to-Avro mapping):
//! * fields in the payload's own order, each optional: `["null", T]` with
//!   `default: null`;
//! * strings, booleans; integers as `int` when they fit 32 bits, else
//!   `long`; other numbers as `double`;
//! * arrays as `array` of optional items, an empty array as an array of
//!   optional strings; objects inside an array merged into one record
//!   holding every field any element has.
//!
//! Where it differs, so that nothing is dropped or changed silently:
//! * the objects of an array whose fields differ are merged into optional
//!   items, `["null", R]`, as all items are (Debezium makes them `R`): a
//!   payload whose elements all have the same fields derives the same
//!   items, so the subject's versions stay compatible;
//! * a `null` value keeps its field, typed `"null"`, and an empty array
//!   its field, an array of optional strings (Debezium leaves both out);
//! * an array whose elements mix kinds (a string and a number), an
//!   integer beyond 64 bits, a key that is not an Avro name, or a payload
//!   that is not an object is a schema mismatch with its path (Debezium
//!   fails the task, stores a lossy `double`, or publishes the payload as
//!   a string after a warning);
//! * mixed integer and fractional numbers in one array widen to `double`
//!   (Debezium keeps the first element's type and then fails);
//! * records are named: the root after `record` (default: the event type
//!   made an Avro name), nested ones `<root>_<field>_<field>` by path
//!   (Debezium's are unnamed, which the converter calls `ConnectDefault`);
//!   the root is a record, not a union with `null`.

use serde::de::{Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{json, Value};

use super::avro::Misfit;
use super::numbers::Huge;

/// A JSON value that keeps its keys in the order written.
#[derive(Debug, PartialEq)]
enum Ordered {
    Null,
    Bool,
    Int(i64),
    /// An integer beyond `i64`.
    Huge(String),
    /// A number read as a float (as read: a huge integer is rounded).
    Float(f64),
    Str,
    Array(Vec<Ordered>),
    Object(Vec<(String, Ordered)>),
}

impl<'de> Deserialize<'de> for Ordered {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Ordered;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("JSON")
            }
            fn visit_unit<E>(self) -> Result<Ordered, E> {
                Ok(Ordered::Null)
            }
            fn visit_none<E>(self) -> Result<Ordered, E> {
                Ok(Ordered::Null)
            }
            fn visit_bool<E>(self, _: bool) -> Result<Ordered, E> {
                Ok(Ordered::Bool)
            }
            fn visit_i64<E>(self, i: i64) -> Result<Ordered, E> {
                Ok(Ordered::Int(i))
            }
            fn visit_u64<E>(self, u: u64) -> Result<Ordered, E> {
                Ok(i64::try_from(u).map_or_else(|_| Ordered::Huge(u.to_string()), Ordered::Int))
            }
            fn visit_f64<E>(self, x: f64) -> Result<Ordered, E> {
                Ok(Ordered::Float(x))
            }
            fn visit_str<E>(self, _: &str) -> Result<Ordered, E> {
                Ok(Ordered::Str)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Ordered, A::Error> {
                let mut items = Vec::new();
                while let Some(v) = a.next_element()? {
                    items.push(v);
                }
                Ok(Ordered::Array(items))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<Ordered, A::Error> {
                let mut fields: Vec<(String, Ordered)> = Vec::new();
                while let Some((k, v)) = a.next_entry::<String, Ordered>()? {
                    // jsonb keeps the last of duplicate keys; so does this.
                    fields.retain(|(name, _)| *name != k);
                    fields.push((k, v));
                }
                Ok(Ordered::Object(fields))
            }
        }
        d.deserialize_any(V)
    }
}

/// A derived type.
#[derive(Debug, Clone, PartialEq)]
enum Shape {
    Null,
    Bool,
    Int,
    Long,
    Double,
    Str,
    /// Items; `None` for an array with no non-null element.
    Array(Option<Box<Shape>>),
    Record(Vec<(String, Shape)>),
}

fn misfit(path: &str, reason: impl Into<String>) -> Misfit {
    Misfit {
        path: path.to_owned(),
        reason: reason.into(),
    }
}

fn avro_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// `type` as an Avro name: other characters become `_`, and a leading
/// digit gets a `_` before it.
pub fn record_name(event_type: &str) -> String {
    let mut out: String = event_type
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if !out.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_') {
        out.insert(0, '_');
    }
    out
}

fn shape_of(v: &Ordered, path: &str, huge: &mut Huge<'_>) -> Result<Shape, Misfit> {
    Ok(match v {
        Ordered::Null => Shape::Null,
        Ordered::Bool => Shape::Bool,
        Ordered::Int(i) if i32::try_from(*i).is_ok() => Shape::Int,
        Ordered::Int(_) => Shape::Long,
        Ordered::Huge(n) => {
            return Err(misfit(
                path,
                format!("{n} is beyond a 64-bit integer; no inferred Avro type holds it exactly"),
            ))
        }
        Ordered::Float(x) if huge.holds(*x) => return Err(misfit(path, super::numbers::HUGE_REASON)),
        Ordered::Float(_) => Shape::Double,
        Ordered::Str => Shape::Str,
        Ordered::Array(items) => {
            let mut merged: Option<Shape> = None;
            for (i, item) in items.iter().enumerate() {
                let at = format!("{path}[{i}]");
                let s = shape_of(item, &at, huge)?;
                if s == Shape::Null {
                    continue;
                }
                merged = Some(match merged {
                    None => s,
                    Some(m) => merge(m, s, &at)?,
                });
            }
            Shape::Array(merged.map(Box::new))
        }
        Ordered::Object(fields) => {
            let mut out = Vec::with_capacity(fields.len());
            for (k, v) in fields {
                let at = field_path(path, k);
                if !avro_name(k) {
                    return Err(misfit(&at, format!("{k:?} is not an Avro field name (letters, digits and _, not starting with a digit)")));
                }
                out.push((k.clone(), shape_of(v, &at, huge)?));
            }
            Shape::Record(out)
        }
    })
}

fn field_path(path: &str, key: &str) -> String {
    let mut out = path.to_owned();
    super::avro::push_key(&mut out, key);
    out
}

/// One type for two elements of an array.
fn merge(a: Shape, b: Shape, path: &str) -> Result<Shape, Misfit> {
    Ok(match (a, b) {
        (a, b) if a == b => a,
        (Shape::Null, x) | (x, Shape::Null) => x,
        (Shape::Int, Shape::Long) | (Shape::Long, Shape::Int) => Shape::Long,
        (Shape::Int | Shape::Long, Shape::Double) | (Shape::Double, Shape::Int | Shape::Long) => {
            Shape::Double
        }
        (Shape::Array(x), Shape::Array(y)) => Shape::Array(match (x, y) {
            (Some(x), Some(y)) => Some(Box::new(merge(*x, *y, &format!("{path}[]"))?)),
            (x, y) => x.or(y),
        }),
        (Shape::Record(mut x), Shape::Record(y)) => {
            for (k, t) in y {
                match x.iter_mut().find(|(name, _)| *name == k) {
                    Some((_, old)) => {
                        let at = field_path(path, &k);
                        *old = merge(std::mem::replace(old, Shape::Null), t, &at)?;
                    }
                    None => x.push((k, t)),
                }
            }
            Shape::Record(x)
        }
        (a, b) => {
            return Err(misfit(
                path,
                format!(
                    "the array mixes {} and {}; an Avro array holds one type",
                    kind(&a),
                    kind(&b)
                ),
            ))
        }
    })
}

fn kind(s: &Shape) -> &'static str {
    match s {
        Shape::Null => "null",
        Shape::Bool => "booleans",
        Shape::Int | Shape::Long | Shape::Double => "numbers",
        Shape::Str => "strings",
        Shape::Array(_) => "arrays",
        Shape::Record(_) => "objects",
    }
}

fn avro(s: &Shape, name: &str) -> Value {
    match s {
        Shape::Null => json!("null"),
        Shape::Bool => json!("boolean"),
        Shape::Int => json!("int"),
        Shape::Long => json!("long"),
        Shape::Double => json!("double"),
        Shape::Str => json!("string"),
        Shape::Array(items) => json!({"type": "array", "items": match items {
            Some(t) => optional(t, name),
            None => json!(["null", "string"]),
        }}),
        Shape::Record(fields) => json!({
            "type": "record",
            "name": name,
            "fields": fields.iter().map(|(k, t)| json!({
                "name": k,
                "type": optional(t, &format!("{name}_{k}")),
                "default": null,
            })).collect::<Vec<_>>(),
        }),
    }
}

fn optional(s: &Shape, name: &str) -> Value {
    match s {
        Shape::Null => json!("null"),
        other => json!(["null", avro(other, name)]),
    }
}

/// The Avro schema (as compact JSON text) derived from `payload`, with
/// the root record named `name`.
pub fn derive(payload: &str, name: &str) -> Result<String, Misfit> {
    let v: Ordered = serde_json::from_str(payload)
        .map_err(|e| misfit("$", format!("the payload cannot be read as JSON values: {e}")))?;
    if !matches!(v, Ordered::Object(_)) {
        return Err(misfit(
            "$",
            "an inferred schema is a record: the payload must be a JSON object",
        ));
    }
    let shape = shape_of(&v, "$", &mut Huge::new(payload))?;
    Ok(avro(&shape, name).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::avro::AvroCodec;

    #[test]
    fn derives_debeziums_shapes_in_the_payloads_order() {
        let text = derive(
            r#"{"z": "s", "a": 1, "big": 3000000000, "f": 1.5, "ok": true, "none": null,
                "tags": [], "nums": [1, 3000000000, 2.5], "lines": [{"sku": "a"}, {"qty": 2}, null],
                "nested": {"deep": {"x": 1}}}"#,
            "OrderPlaced",
        )
        .unwrap();
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["name"], "OrderPlaced");
        let fields: Vec<(&str, &Value)> = v["fields"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| (f["name"].as_str().unwrap(), &f["type"]))
            .collect();
        let names: Vec<&str> = fields.iter().map(|(n, _)| *n).collect();
        assert_eq!(
            names,
            ["z", "a", "big", "f", "ok", "none", "tags", "nums", "lines", "nested"]
        );
        assert_eq!(*fields[0].1, json!(["null", "string"]));
        assert_eq!(*fields[1].1, json!(["null", "int"]));
        assert_eq!(*fields[2].1, json!(["null", "long"]));
        assert_eq!(*fields[3].1, json!(["null", "double"]));
        assert_eq!(*fields[4].1, json!(["null", "boolean"]));
        assert_eq!(*fields[5].1, json!("null"));
        assert_eq!(
            *fields[6].1,
            json!(["null", {"type": "array", "items": ["null", "string"]}])
        );
        assert_eq!(
            *fields[7].1,
            json!(["null", {"type": "array", "items": ["null", "double"]}])
        );
        let lines = &fields[8].1[1]["items"][1];
        assert_eq!(lines["name"], "OrderPlaced_lines");
        assert_eq!(
            lines["fields"].as_array().unwrap().len(),
            2,
            "merged: sku and qty"
        );
        assert_eq!(
            fields[9].1[1]["fields"][0]["type"][1]["name"],
            "OrderPlaced_nested_deep"
        );
        // Every field has its default, and the schema compiles and encodes.
        assert!(v["fields"]
            .as_array()
            .unwrap()
            .iter()
            .all(|f| f["default"].is_null() && f.get("default").is_some()));
        let codec = AvroCodec::parse(&text).unwrap();
        let payload: Value = serde_json::from_str(
            r#"{"z": "s", "a": 1, "big": 3000000000, "f": 1.5, "ok": true, "none": null, "tags": [],
                "nums": [1, 3000000000, 2.5], "lines": [{"sku": "a"}, {"qty": 2}, null], "nested": {"deep": {"x": 1}}}"#,
        )
        .unwrap();
        codec.encode(&payload, "", &mut Vec::new()).unwrap();
    }

    #[test]
    fn array_items_stay_optional_so_versions_stay_compatible() {
        let items = |payload: &str| {
            let v: Value = serde_json::from_str(&derive(payload, "R").unwrap()).unwrap();
            v["fields"][0]["type"][1]["items"].clone()
        };
        let same = items(r#"{"p": [{"a": 1}, {"a": 2}]}"#);
        let merged = items(r#"{"p": [{"a": 1}, {"b": "x"}]}"#);
        assert_eq!((&same[0], &merged[0]), (&json!("null"), &json!("null")));
        // The merged shape reads what the first wrote (BACKWARD).
        let old = apache_avro::Schema::parse_str(&derive(r#"{"p": [{"a": 1}]}"#, "R").unwrap()).unwrap();
        let new = apache_avro::Schema::parse_str(&derive(r#"{"p": [{"a": 1}, {"b": "x"}]}"#, "R").unwrap())
            .unwrap();
        assert!(apache_avro::schema_compatibility::SchemaCompatibility::can_read(&old, &new).is_ok());
    }

    #[test]
    fn what_no_inferred_type_holds_is_a_misfit_with_its_path() {
        let e = derive(r#"{"a": [1, "x"]}"#, "E").unwrap_err();
        assert_eq!(e.path, "$.a[1]");
        assert!(e.reason.contains("mixes numbers and strings"), "{e}");
        assert_eq!(
            derive(r#"{"n": 18446744073709551615}"#, "E").unwrap_err().path,
            "$.n"
        );
        assert_eq!(
            derive(r#"{"first-name": "x"}"#, "E").unwrap_err().path,
            "$[\"first-name\"]"
        );
        // Beyond 64 bits: read as the nearest double, so no type holds it.
        let e = derive(r#"{"orderId":"o-2","huge":123456789012345678901234567890}"#, "E").unwrap_err();
        assert_eq!(e.path, "$.huge");
        assert!(e.reason.contains("beyond 64 bits"), "{e}");
        assert_eq!(
            derive(r#"{"a": [1.5, -99999999999999999999]}"#, "E")
                .unwrap_err()
                .path,
            "$.a[1]"
        );
        // Written as a float, it is one.
        assert!(derive(r#"{"big": 1.2345678901234568e29, "f": 1e30}"#, "E").is_ok());
        assert_eq!(derive(r#"[1]"#, "E").unwrap_err().path, "$");
        assert_eq!(derive(r#"{"a": 1e400}"#, "E").unwrap_err().path, "$");
        assert_eq!(
            derive(r#"{"a": {"b": [{"c": 1}, {"c": "x"}]}}"#, "E")
                .unwrap_err()
                .path,
            "$.a.b[1].c"
        );
    }

    #[test]
    fn record_names_are_avro_names() {
        assert_eq!(
            record_name("ordering.order-placed.v1"),
            "ordering_order_placed_v1"
        );
        assert_eq!(record_name("1st"), "_1st");
        assert_eq!(record_name("OrderPlaced"), "OrderPlaced");
    }
}

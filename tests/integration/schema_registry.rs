//! Registry-encoded values (`routing.value` = `avro`, `json-schema`,
//! `protobuf`) through the real relay, Apache Kafka and Apicurio Registry,
//! decoded by an independent client: Confluent's Python deserializers,
//! which read the schema id from each record and fetch the schema from
//! the registry, as a consumer does.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use outboxd::Lsn;
use serde_json::{json, Value};
use uuid::Uuid;

use crate::harness::broker::{base64url, broker, consume, topics_with_prefix, Consumed};
use crate::harness::registry::{clients_python, refusing_server, registry, Gate};
use crate::harness::{wait_for, TestDb};
use crate::relay::{
    config_text, confirmed_flush, current_lsn, spawn_relay, spawn_relay_with_slot, stop_relay,
};

/// Reads `{"topic", "value", "message"}` lines, decodes each value with
/// the deserializer of `format`, and writes `{"id", "value"}` lines. For
/// Protobuf, the schema the record names is fetched by id and compiled
/// with protoc into the class the deserializer needs.
const DECODE: &str = r#"
import faulthandler
faulthandler.dump_traceback_later(60, exit=True)
import base64, datetime, decimal, importlib, json, os, sys, tempfile, uuid
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.schema_registry.json_schema import JSONDeserializer
from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf.json_format import MessageToDict
url, fmt = sys.argv[1], sys.argv[2]
sr = SchemaRegistryClient({"url": url})
def unb64(v):
    return base64.urlsafe_b64decode(v + "=" * (-len(v) % 4))
def plain(o):
    if isinstance(o, decimal.Decimal): return str(o)
    if isinstance(o, (datetime.datetime, datetime.date)): return o.isoformat()
    if isinstance(o, bytes): return o.decode("latin-1")
    if isinstance(o, uuid.UUID): return str(o)
    raise TypeError(repr(o))
classes = {}
def proto_class(schema_id, name):
    if (schema_id, name) not in classes:
        from grpc_tools import protoc
        import grpc_tools
        d = tempfile.mkdtemp()
        stem = f"s{schema_id}"
        with open(os.path.join(d, stem + ".proto"), "w") as f:
            f.write(sr.get_schema(schema_id).schema_str)
        inc = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
        assert protoc.main(["protoc", f"-I{d}", f"-I{inc}", f"--python_out={d}", stem + ".proto"]) == 0
        sys.path.insert(0, d)
        mod = importlib.import_module(stem + "_pb2")
        cls = mod
        for part in name[len(mod.DESCRIPTOR.package) + 1:].split("."):
            cls = getattr(cls, part)
        classes[(schema_id, name)] = cls
    return classes[(schema_id, name)]
for line in sys.stdin:
    r = json.loads(line)
    value = unb64(r["value"])
    assert value[0] == 0, "magic byte"
    schema_id = int.from_bytes(value[1:5], "big")
    ctx = SerializationContext(r["topic"], MessageField.VALUE)
    if fmt == "avro":
        out = AvroDeserializer(sr)(value, ctx)
    elif fmt == "json-schema":
        out = JSONDeserializer(None, schema_registry_client=sr)(value, ctx)
    else:
        cls = proto_class(schema_id, r["message"])
        out = MessageToDict(ProtobufDeserializer(cls, {"use.deprecated.format": False})(value, ctx))
    print(json.dumps({"id": schema_id, "value": out}, default=plain))
"#;

/// Each record decoded by Confluent's client: (schema id, value). A
/// client that hangs (seen a few times in many runs, waiting on the
/// registry's answer to `get_associations_by_resource_name`; the stack it
/// dumps is printed) is run again, up to three times in all.
fn decode(format: &str, records: &[&Consumed], message: &str) -> Vec<(u32, Value)> {
    let mut failures = Vec::new();
    for _ in 0..3 {
        match decode_once(format, records, message) {
            Ok(v) => return v,
            Err(e) => {
                eprintln!("Confluent's client failed, running it again: {e}");
                failures.push(e);
            }
        }
    }
    panic!("Confluent's client failed three times: {failures:?}")
}

fn decode_once(format: &str, records: &[&Consumed], message: &str) -> Result<Vec<(u32, Value)>, String> {
    // `timeout`: a client that hangs fails the test instead of the run.
    let mut child = Command::new("timeout")
        .arg("90")
        .arg(clients_python())
        .args(["-c", DECODE, &registry().url, format])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut input = String::new();
    for r in records {
        input.push_str(
            &json!({"topic": r.topic, "value": base64url(&r.value), "message": message}).to_string(),
        );
        input.push('\n');
    }
    child.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    if !out.status.success() {
        return Err(format!(
            "Confluent's deserializer refused a record ({}): {} {}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        ));
    }
    Ok(String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            (v["id"].as_u64().unwrap() as u32, v["value"].clone())
        })
        .collect())
}

const ORDER_AVRO: &str = r#"{
  "type": "record", "name": "OrderPlaced", "namespace": "shop",
  "fields": [
    {"name": "orderId", "type": "string"},
    {"name": "total", "type": {"type": "bytes", "logicalType": "decimal", "precision": 12, "scale": 2}},
    {"name": "count", "type": "int"},
    {"name": "big", "type": "long"},
    {"name": "status", "type": {"type": "enum", "name": "Status", "symbols": ["PLACED", "PAID"]}},
    {"name": "note", "type": ["null", "string"], "default": null},
    {"name": "lines", "type": {"type": "array", "items": {
      "type": "record", "name": "Line",
      "fields": [{"name": "sku", "type": "string"}, {"name": "qty", "type": "int"}]}}},
    {"name": "attrs", "type": {"type": "map", "values": "double"}, "default": {}}
  ]}"#;

/// One relay over a fresh database, publishing `value` with the registry
/// at `registry_url`; `routing` is added to `[routing]`.
struct Setup {
    client: tokio_postgres::Client,
    slot: String,
    prefix: String,
    _db: TestDb,
}

impl Setup {
    async fn new(name: &str) -> Setup {
        let db = TestDb::new(&format!("sr_{name}")).await;
        let client = db.client().await;
        Setup {
            client,
            slot: format!("sr_{name}"),
            prefix: format!("sr{}", Uuid::new_v4().simple()),
            _db: db,
        }
    }

    fn config(&self, db_url: &str, value: &str, registry_url: &str, routing: &str) -> String {
        config_text(
            db_url,
            &self.slot,
            &broker().brokers,
            &format!(
                "topic = \"{p}.{{aggregate_type}}\"\nvalue = \"{value}\"\non_poison = \"dead-letter\"\ndead_letter_topic = \"{p}.dead-letter\"\n{routing}",
                p = self.prefix
            ),
            &format!("\n[schema_registry]\nurl = \"{registry_url}\"\ntimeout = \"2s\"\n"),
        )
    }

    fn topic(&self, aggregate_type: &str) -> String {
        format!("{}.{}", self.prefix, aggregate_type.to_lowercase())
    }

    async fn insert(
        &self,
        aggregate_type: &str,
        aggregate_id: &str,
        event_type: &str,
        payload: &Value,
    ) -> Uuid {
        let id = Uuid::now_v7();
        self.client
            .execute(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload) VALUES ($1, $2, $3, $4, $5)",
                &[&id, &aggregate_type, &aggregate_id, &event_type, payload],
            )
            .await
            .unwrap();
        id
    }

    /// Inserts one row in a transaction of its own; returns an LSN read
    /// inside it, after the row: the slot is confirmed past it only once
    /// the row is in Kafka (other tests' WAL may move it up to the row).
    async fn insert_in_view(
        &mut self,
        aggregate_type: &str,
        aggregate_id: &str,
        event_type: &str,
        payload: &Value,
    ) -> (Uuid, Lsn) {
        let id = Uuid::now_v7();
        let tx = self.client.transaction().await.unwrap();
        tx.execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload) VALUES ($1, $2, $3, $4, $5)",
            &[&id, &aggregate_type, &aggregate_id, &event_type, payload],
        )
        .await
        .unwrap();
        let lsn: String = tx
            .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
            .await
            .unwrap()
            .get(0);
        tx.commit().await.unwrap();
        (id, lsn.parse().unwrap())
    }

    async fn confirmed_past_now(&self) {
        let end = current_lsn(&self.client).await;
        wait_for("the rows confirmed", Duration::from_secs(60), || async {
            confirmed_flush(&self.client, &self.slot)
                .await
                .filter(|l| *l >= end)
        })
        .await;
    }
}

fn orders() -> Vec<Value> {
    vec![
        json!({"orderId": "o-1", "total": "12.50", "count": 3, "big": 9_007_199_254_740_993i64, "status": "PLACED",
               "note": "주문 \"first\"", "lines": [{"sku": "a", "qty": 2}], "attrs": {"w": 1.5}}),
        // Defaults fill what the payload leaves out; the edges of int and long.
        json!({"orderId": "", "total": -0.01, "count": i32::MIN, "big": i64::MAX, "status": "PAID", "lines": []}),
    ]
}

#[tokio::test(flavor = "multi_thread")]
async fn avro_values_decode_with_confluents_deserializer_and_a_misfit_is_dead_lettered_with_its_path() {
    let s = Setup::new("avro").await;
    let topic = s.topic("Order");
    let id = registry().register(&format!("{topic}-value"), "AVRO", ORDER_AVRO);
    let text = s.config(&s._db.superuser_url(), "avro", &registry().url, "");
    let (handle, stop) = spawn_relay_with_slot(&s.client, &s.slot, &text).await;
    let mut ids = Vec::new();
    for (i, o) in orders().iter().enumerate() {
        ids.push(s.insert("Order", &format!("order-{i}"), "OrderPlaced", o).await);
    }
    // A required field missing, then an enum symbol the schema lacks.
    let bad = s
        .insert(
            "Order",
            "order-0",
            "OrderPlaced",
            &json!({"orderId": "o-3", "total": "1", "count": 1, "big": 1, "status": "PLACED"}),
        )
        .await;
    let bad_enum = s
        .insert(
            "Order",
            "order-1",
            "OrderPlaced",
            &json!({"orderId": "o-4", "total": "1", "count": 1, "big": 1, "status": "SHIPPED", "lines": []}),
        )
        .await;
    s.confirmed_past_now().await;
    let dlq = format!("{}.dead-letter", s.prefix);
    let records = consume(&broker().brokers, &[&topic, &dlq], 4, Duration::from_secs(30));
    let events: Vec<&Consumed> = records.iter().filter(|r| r.topic == topic).collect();
    let dead: Vec<&Consumed> = records.iter().filter(|r| r.topic == dlq).collect();
    assert_eq!(events.len(), 2, "{records:?}");
    let decoded = decode("avro", &events, "");
    let expected = [
        json!({"orderId": "o-1", "total": "12.50", "count": 3, "big": 9_007_199_254_740_993i64, "status": "PLACED",
               "note": "주문 \"first\"", "lines": [{"sku": "a", "qty": 2}], "attrs": {"w": 1.5}}),
        json!({"orderId": "", "total": "-0.01", "count": i32::MIN, "big": i64::MAX, "status": "PAID", "note": null,
               "lines": [], "attrs": {}}),
    ];
    for (r, (schema_id, value)) in events.iter().zip(&decoded) {
        let i = ids
            .iter()
            .position(|id| r.header("id") == Some(&id.to_string()))
            .unwrap();
        assert_eq!(*schema_id, id, "the id the topic strategy's subject names");
        assert_eq!(*value, expected[i], "event {i}");
        assert_eq!(r.key, format!("order-{i}"), "the key stays the aggregate id");
    }
    assert_eq!(registry().latest_id(&format!("{topic}-value")), id);
    assert_eq!(dead.len(), 2, "{dead:?}");
    let by_id = |id: Uuid| {
        dead.iter()
            .find(|d| d.header("id") == Some(&id.to_string()))
            .unwrap()
    };
    let missing = by_id(bad);
    assert_eq!(missing.header("dlq.reason"), Some("schema_mismatch"));
    let error = missing.header("dlq.error").unwrap();
    assert!(
        error.contains("$.lines") && error.contains("required field is missing"),
        "{error}"
    );
    assert!(
        error.contains(&format!("{topic}-value")),
        "names the subject: {error}"
    );
    let error = by_id(bad_enum).header("dlq.error").unwrap();
    assert!(error.contains("$.status") && error.contains("SHIPPED"), "{error}");
    stop_relay(handle, stop).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn json_schema_values_are_the_payload_framed_and_checked() {
    let s = Setup::new("json").await;
    let topic = s.topic("Order");
    let schema = r#"{"$schema": "http://json-schema.org/draft-07/schema#", "title": "OrderPlaced", "type": "object",
        "required": ["orderId", "total"], "additionalProperties": false,
        "properties": {"orderId": {"type": "string"}, "total": {"type": "number", "minimum": 0},
                       "lines": {"type": "array", "items": {"type": "object", "properties": {"qty": {"type": "integer"}}}}}}"#;
    let id = registry().register(&format!("{topic}-value"), "JSON", schema);
    let text = s.config(&s._db.superuser_url(), "json-schema", &registry().url, "");
    let (handle, stop) = spawn_relay_with_slot(&s.client, &s.slot, &text).await;
    let good = json!({"orderId": "o-1", "total": 12.5, "lines": [{"qty": 2}]});
    s.insert("Order", "o-1", "OrderPlaced", &good).await;
    let bad = s
        .insert(
            "Order",
            "o-1",
            "OrderPlaced",
            &json!({"orderId": "o-1", "total": 1, "lines": [{"qty": 1.5}]}),
        )
        .await;
    s.confirmed_past_now().await;
    let dlq = format!("{}.dead-letter", s.prefix);
    let records = consume(&broker().brokers, &[&topic, &dlq], 2, Duration::from_secs(30));
    let events: Vec<&Consumed> = records.iter().filter(|r| r.topic == topic).collect();
    assert_eq!(events.len(), 1, "{records:?}");
    let decoded = decode("json-schema", &events, "");
    assert_eq!(decoded, vec![(id, good)]);
    let dead = records.iter().find(|r| r.topic == dlq).unwrap();
    assert_eq!(dead.header("id"), Some(bad.to_string().as_str()));
    assert_schema_mismatch(dead, "$.lines[0].qty");
    stop_relay(handle, stop).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn protobuf_values_carry_the_message_indexes_under_the_record_name_strategy_and_a_pinned_version() {
    let s = Setup::new("proto").await;
    let schema = |extra: &str| {
        format!(
            "syntax = \"proto3\";\npackage shop;\nmessage Header {{ string trace = 1; }}\nmessage OrderPlaced {{\n  string order_id = 1;\n  int64 total_cents = 2;\n  repeated Line lines = 3;\n  message Line {{ string sku = 1; int32 qty = 2; }}\n{extra}}}\n"
        )
    };
    // Version 1, then a version 2 outboxd must not use: the rule pins 1.
    let subject = format!("{}.OrderPlaced", s.prefix);
    let v1 = registry().register(&subject, "PROTOBUF", &schema(""));
    let v2 = registry().register(&subject, "PROTOBUF", &schema("  string coupon = 4;\n"));
    assert_ne!(v1, v2);
    let routing = format!(
        "subject_strategy = \"record\"\n[routing.schemas.\"OrderPlaced\"]\nrecord = \"shop.OrderPlaced\"\nsubject = \"{subject}\"\nversion = 1\n"
    );
    let text = s.config(&s._db.superuser_url(), "protobuf", &registry().url, &routing);
    let (handle, stop) = spawn_relay_with_slot(&s.client, &s.slot, &text).await;
    let good = json!({"orderId": "o-1", "totalCents": "1250", "lines": [{"sku": "a", "qty": 2}, {"sku": "김", "qty": -1}]});
    s.insert("Order", "o-1", "OrderPlaced", &good).await;
    // A field only version 2 has.
    s.insert(
        "Order",
        "o-1",
        "OrderPlaced",
        &json!({"orderId": "o-2", "coupon": "X"}),
    )
    .await;
    s.confirmed_past_now().await;
    let topic = s.topic("Order");
    let dlq = format!("{}.dead-letter", s.prefix);
    let records = consume(&broker().brokers, &[&topic, &dlq], 2, Duration::from_secs(30));
    let events: Vec<&Consumed> = records.iter().filter(|r| r.topic == topic).collect();
    assert_eq!(events.len(), 1, "{records:?}");
    assert_eq!(&events[0].value[5..6], &[2], "one message index");
    assert_eq!(
        &events[0].value[6..7],
        &[2],
        "index 1 (zig-zag): OrderPlaced, the file's second message"
    );
    let decoded = decode("protobuf", &events, "shop.OrderPlaced");
    assert_eq!(decoded, vec![(v1, good)]);
    let dead = records.iter().find(|r| r.topic == dlq).unwrap();
    assert_schema_mismatch(dead, "coupon");
    stop_relay(handle, stop).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_registry_outage_holds_new_schemas_back_and_loses_nothing() {
    let mut s = Setup::new("outage").await;
    let gate = Gate::to(&registry().url);
    let order_topic = s.topic("Order");
    let pay_topic = s.topic("Payment");
    let order_id = registry().register(&format!("{order_topic}-value"), "AVRO", ORDER_AVRO);
    let pay_schema =
        r#"{"type": "record", "name": "PaymentMade", "fields": [{"name": "amount", "type": "long"}]}"#;
    let pay_id = registry().register(&format!("{pay_topic}-value"), "AVRO", pay_schema);
    let text = s.config(&s._db.superuser_url(), "avro", &gate.url(&registry().url), "");
    let (handle, stop) = spawn_relay_with_slot(&s.client, &s.slot, &text).await;
    let order = orders()[0].clone();
    s.insert("Order", "o-1", "OrderPlaced", &order).await;
    s.confirmed_past_now().await;
    gate.close();
    // A schema in the cache keeps working while the registry is away.
    s.insert("Order", "o-1", "OrderPlaced", &order).await;
    s.confirmed_past_now().await;
    // A schema outboxd has not seen waits: nothing after it is confirmed.
    let (_, inside) = s
        .insert_in_view("Payment", "p-1", "PaymentMade", &json!({"amount": 5}))
        .await;
    s.insert("Order", "o-1", "OrderPlaced", &order).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(
        confirmed_flush(&s.client, &s.slot).await.unwrap() <= inside,
        "the slot waits for the schema"
    );
    assert!(!handle.is_finished(), "an outage is waited out, not an error");
    gate.open();
    s.confirmed_past_now().await;
    let dlq = format!("{}.dead-letter", s.prefix);
    let records = consume(
        &broker().brokers,
        &[&order_topic, &pay_topic],
        4,
        Duration::from_secs(30),
    );
    assert_eq!(
        records.iter().filter(|r| r.topic == order_topic).count(),
        3,
        "{records:?}"
    );
    let pay: Vec<&Consumed> = records.iter().filter(|r| r.topic == pay_topic).collect();
    assert_eq!(decode("avro", &pay, ""), vec![(pay_id, json!({"amount": 5}))]);
    assert!(
        !topics_with_prefix(&broker().brokers, &s.prefix).contains(&dlq),
        "nothing dead-lettered"
    );
    let orders: Vec<&Consumed> = records.iter().filter(|r| r.topic == order_topic).collect();
    assert!(decode("avro", &orders, "").iter().all(|(id, _)| *id == order_id));
    // Shutdown while an event waits for the registry: a clean stop, and
    // the slot still holds the event.
    gate.close();
    let (_, inside) = s
        .insert_in_view("Shipment", "s-1", "Shipped", &json!({"carrier": "x"}))
        .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop_relay(handle, stop).await;
    assert!(
        confirmed_flush(&s.client, &s.slot).await.unwrap() <= inside,
        "the waiting event is still in the slot"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn refused_credentials_and_a_missing_subject_stop_with_what_to_fix_and_move_nothing() {
    for (case, url) in [
        (
            "auth",
            refusing_server(401, r#"{"error_code": 40101, "message": "Unauthorized"}"#),
        ),
        ("missing", registry().url.clone()),
    ] {
        let mut s = Setup::new(&format!("stop_{case}")).await;
        let secret = "p@ss:w\"ord}\n#";
        let mut text = s.config(&s._db.superuser_url(), "avro", &url, "");
        text = text.replace(
            "timeout = \"2s\"\n",
            &format!(
                "timeout = \"2s\"\nusername = \"outboxd\"\npassword = {}\n",
                toml_string(secret)
            ),
        );
        let (handle, _stop) = spawn_relay(&text);
        let before = if case == "missing" {
            wait_for("the slot", Duration::from_secs(30), || async {
                confirmed_flush(&s.client, &s.slot).await
            })
            .await;
            let (_, inside) = s
                .insert_in_view("Order", "o-1", "OrderPlaced", &orders()[0])
                .await;
            Some(inside)
        } else {
            // Refused credentials stop the start, before any slot.
            None
        };
        let text = stopped_with(handle, 60, "the relay stops").await;
        assert!(!text.contains("p@ss"), "no secret in {text}");
        match case {
            "auth" => assert!(text.contains("schema_registry.username"), "{text}"),
            _ => assert!(
                text.contains(&format!("{}-value", s.topic("Order")))
                    && text.contains("not in the Schema Registry"),
                "{text}"
            ),
        }
        let confirmed = confirmed_flush(&s.client, &s.slot).await;
        match before {
            Some(inside) => assert!(
                confirmed.unwrap() <= inside,
                "{case}: the row is still in the slot"
            ),
            None => assert!(confirmed.is_none(), "{case}: stopped before making a slot"),
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_configured_subject_that_does_not_exist_stops_the_start() {
    let s = Setup::new("start").await;
    let rule = format!(
        "[routing.schemas.\"OrderPlaced\"]\nsubject = \"{}.missing\"\nversion = 2\n",
        s.prefix
    );
    let text = s.config(&s._db.superuser_url(), "avro", &registry().url, &rule);
    let (handle, _stop) = spawn_relay(&text);
    let text = stopped_with(handle, 30, "the relay stops at start").await;
    assert!(
        text.contains(&format!("{}.missing", s.prefix)) && text.contains("version 2"),
        "{text}"
    );
    assert!(
        confirmed_flush(&s.client, &s.slot).await.is_none(),
        "no slot was made: it stopped before streaming"
    );
}

/// A dead letter of a payload that did not fit, naming `needle` (a path).
fn assert_schema_mismatch(dead: &Consumed, needle: &str) {
    assert_eq!(dead.header("dlq.reason"), Some("schema_mismatch"));
    let error = dead.header("dlq.error").unwrap_or_default();
    assert!(error.contains(needle), "{needle} in {error:?}");
}

/// The error text of a relay that stops by itself within `secs`.
async fn stopped_with(
    handle: tokio::task::JoinHandle<Result<(), outboxd::relay::RelayError>>,
    secs: u64,
    what: &str,
) -> String {
    tokio::time::timeout(Duration::from_secs(secs), handle)
        .await
        .expect(what)
        .unwrap()
        .expect_err("a definite error")
        .to_string()
}

fn toml_string(s: &str) -> String {
    toml::Value::String(s.to_owned()).to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn inferred_schemas_are_registered_per_shape_and_decode_to_the_payload() {
    let s = Setup::new("inferred").await;
    let topic = s.topic("Order");
    let subject = format!("{topic}-value");
    let text = s.config(
        &s._db.superuser_url(),
        "avro",
        &registry().url,
        "schema = \"inferred\"",
    );
    let (handle, stop) = spawn_relay_with_slot(&s.client, &s.slot, &text).await;
    let first =
        json!({"orderId": "o-1", "total": 12.5, "count": 3, "lines": [{"sku": "a", "qty": 2}], "note": null});
    let same_shape =
        json!({"orderId": "o-2", "total": 1.25, "count": 4, "lines": [{"sku": "b", "qty": 1}], "note": null});
    // A new field and a wider number: a new shape, a new version.
    let wider = json!({"orderId": "o-3", "total": 2.0, "count": 3_000_000_000i64, "lines": [], "note": "gift", "coupon": "X"});
    let mixed = json!({"orderId": "o-4", "lines": [1, "x"]});
    for p in [&first, &same_shape, &wider, &mixed] {
        s.insert("Order", "o", "OrderPlaced", p).await;
    }
    s.confirmed_past_now().await;
    let dlq = format!("{}.dead-letter", s.prefix);
    let records = consume(&broker().brokers, &[&topic, &dlq], 4, Duration::from_secs(30));
    let events: Vec<&Consumed> = records.iter().filter(|r| r.topic == topic).collect();
    assert_eq!(events.len(), 3, "{records:?}");
    let decoded = decode("avro", &events, "");
    assert_eq!(decoded[0].0, decoded[1].0, "one shape, one schema");
    assert_ne!(decoded[0].0, decoded[2].0, "a new shape, a new schema");
    assert_eq!(registry().latest_id(&subject), decoded[2].0);
    assert_eq!(decoded[0].1, first);
    assert_eq!(decoded[1].1, same_shape);
    assert_eq!(decoded[2].1, wider);
    let dead = records.iter().find(|r| r.topic == dlq).unwrap();
    assert_schema_mismatch(dead, "$.lines[1]");
    stop_relay(handle, stop).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn check_lists_the_subject_each_event_type_uses_and_whether_it_resolves() {
    let s = Setup::new("check").await;
    let order_topic = s.topic("Order");
    let id = registry().register(&format!("{order_topic}-value"), "AVRO", ORDER_AVRO);
    s.insert("Order", "o-1", "OrderPlaced", &orders()[0]).await;
    s.insert("Payment", "p-1", "PaymentMade", &json!({"amount": 1}))
        .await;
    let pinned = format!(
        "[routing.schemas.\"Pinned\"]\nsubject = \"{}.nowhere\"\n",
        s.prefix
    );
    let text = s.config(&s._db.superuser_url(), "avro", &registry().url, &pinned);
    let (config, validated) = outboxd::config::Config::from_toml(&text, |_| None).unwrap();
    let lines = outboxd::cli::check::run_checks(&config, &validated).await;
    let shown: Vec<String> = lines.iter().map(ToString::to_string).collect();
    let find = |needle: &str| {
        lines
            .iter()
            .find(|l| l.detail.contains(needle))
            .unwrap_or_else(|| panic!("no line with {needle:?} in {shown:#?}"))
    };
    let registry_line = lines.iter().find(|l| l.name == "registry").unwrap();
    assert!(registry_line.ok, "{registry_line}");
    let order = find(&format!("OrderPlaced on {order_topic}"));
    assert!(order.ok && order.detail.contains(&format!("id {id}")), "{order}");
    let payment = find(&format!("PaymentMade on {}", s.topic("Payment")));
    assert!(
        !payment.ok && payment.detail.contains("not in the Schema Registry"),
        "{payment}"
    );
    let rule = find("Pinned");
    assert!(!rule.ok && rule.detail.contains("nowhere"), "{rule}");
}

#[tokio::test(flavor = "multi_thread")]
async fn cloudevents_in_binary_mode_carry_avro_data_with_its_dataschema() {
    let s = Setup::new("ce").await;
    let topic = s.topic("Order");
    let id = registry().register(&format!("{topic}-value"), "AVRO", ORDER_AVRO);
    let text = s.config(
        &s._db.superuser_url(),
        "cloudevents-binary",
        &registry().url,
        "cloudevents_data = \"avro\"",
    );
    let (handle, stop) = spawn_relay_with_slot(&s.client, &s.slot, &text).await;
    let row = s.insert("Order", "o-1", "OrderPlaced", &orders()[0]).await;
    s.confirmed_past_now().await;
    let records = consume(&broker().brokers, &[&topic], 1, Duration::from_secs(30));
    assert_eq!(records.len(), 1);
    let r = &records[0];
    assert_eq!(r.header("ce_id"), Some(row.to_string().as_str()));
    assert_eq!(r.header("ce_type"), Some("OrderPlaced"));
    assert_eq!(r.header("content-type"), Some("application/avro"));
    let dataschema = r.header("ce_dataschema").unwrap();
    assert_eq!(dataschema, format!("{}/schemas/ids/{id}", registry().url));
    let served = ureq::get(dataschema)
        .call()
        .unwrap()
        .body_mut()
        .read_to_string()
        .unwrap();
    assert!(
        served.contains("OrderPlaced"),
        "dataschema resolves to the schema: {served}"
    );
    let decoded = decode("avro", &[r], "");
    assert_eq!(decoded[0].0, id);
    assert_eq!(decoded[0].1["orderId"], "o-1");
    stop_relay(handle, stop).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_payload_that_fits_a_newer_version_than_the_cached_one_is_published_not_dead_lettered() {
    let s = Setup::new("newer").await;
    let topic = s.topic("Payment");
    let subject = format!("{topic}-value");
    let v1 = registry().register(
        &subject,
        "AVRO",
        r#"{"type": "record", "name": "PaymentMade", "fields": [{"name": "amount", "type": "long"}]}"#,
    );
    let text = s.config(&s._db.superuser_url(), "avro", &registry().url, "");
    let (handle, stop) = spawn_relay_with_slot(&s.client, &s.slot, &text).await;
    s.insert("Payment", "p-1", "PaymentMade", &json!({"amount": 1}))
        .await;
    s.confirmed_past_now().await;
    // Version 2 adds a field; the cached version 1 is fresh for minutes.
    let v2 = registry().register(
        &subject,
        "AVRO",
        r#"{"type": "record", "name": "PaymentMade", "fields": [{"name": "amount", "type": "long"},
            {"name": "coupon", "type": ["null", "string"], "default": null}]}"#,
    );
    s.insert(
        "Payment",
        "p-1",
        "PaymentMade",
        &json!({"amount": 2, "coupon": "SAVE10"}),
    )
    .await;
    s.insert("Payment", "p-1", "PaymentMade", &json!({"amount": 3}))
        .await;
    s.confirmed_past_now().await;
    let records = consume(&broker().brokers, &[&topic], 3, Duration::from_secs(30));
    let events: Vec<&Consumed> = records.iter().collect();
    let decoded = decode("avro", &events, "");
    assert_eq!(decoded[0], (v1, json!({"amount": 1})));
    assert_eq!(decoded[1], (v2, json!({"amount": 2, "coupon": "SAVE10"})));
    assert_eq!(decoded[2], (v2, json!({"amount": 3, "coupon": null})));
    assert!(!topics_with_prefix(&broker().brokers, &s.prefix).contains(&format!("{}.dead-letter", s.prefix)));
    stop_relay(handle, stop).await;
}

#[test]
fn schema_settings_that_cannot_work_together_are_refused_at_load() {
    let base = |extra_routing: &str, registry: &str| {
        format!(
            "[postgres]\nurl = \"postgres://u@h/db\"\n[kafka]\nbrokers = \"k:9092\"\n{registry}\n[routing]\nvalue = \"avro\"\n{extra_routing}"
        )
    };
    let registry = "[schema_registry]\nurl = \"http://registry:8081\"";
    let refused = [
        ("", "", "schema_registry.url"),
        (
            "schema = \"inferred\"\n[routing.schemas.\"X\"]\nid = 1",
            registry,
            "routing.schemas.X.schema",
        ),
        (
            "schema = \"inferred\"\n[routing.schemas.\"X\"]\nversion = 2",
            registry,
            "routing.schemas.X.schema",
        ),
        (
            "[routing.schemas.\"X\"]\nid = 1\nversion = 2",
            registry,
            "routing.schemas.X.id",
        ),
        (
            "",
            "[schema_registry]\nurl = \"http://registry:8081/?token=s3cret\"",
            "schema_registry.url",
        ),
        (
            "",
            "[schema_registry]\nurl = \"http://registry:8081\"\nusername = \"u\"",
            "schema_registry.password",
        ),
        (
            "cloudevents_data = \"avro\"",
            registry,
            "routing.cloudevents_data",
        ),
    ];
    for (routing, registry, key) in refused {
        let text = base(routing, registry);
        let err = outboxd::config::Config::from_toml(&text, |_| None)
            .expect_err(&text)
            .to_string();
        assert!(err.contains(key), "{key}: {err}");
        assert!(!err.contains("s3cret"), "{err}");
    }
    let keys_alone = "[postgres]\nurl = \"postgres://u@h/db\"\n[kafka]\nbrokers = \"k:9092\"\n[routing]\nkey_format = \"avro\"";
    let err = outboxd::config::Config::from_toml(keys_alone, |_| None)
        .expect_err("encoded keys without a registry")
        .to_string();
    assert!(
        err.contains("routing.key_format needs a Schema Registry"),
        "{err}"
    );
    let protobuf = keys_alone.replace("\"avro\"", "\"protobuf\"");
    assert!(outboxd::config::Config::from_toml(&protobuf, |_| None).is_err());
}

#[tokio::test(flavor = "multi_thread")]
async fn under_on_poison_stop_a_misfit_stops_the_relay_naming_the_field_and_the_slot_holds_it() {
    let mut s = Setup::new("misfit_stop").await;
    let topic = s.topic("Order");
    registry().register(&format!("{topic}-value"), "AVRO", ORDER_AVRO);
    let text = s
        .config(&s._db.superuser_url(), "avro", &registry().url, "")
        .replace("on_poison = \"dead-letter\"", "on_poison = \"stop\"");
    let (handle, _stop) = spawn_relay_with_slot(&s.client, &s.slot, &text).await;
    s.insert("Order", "o-1", "OrderPlaced", &orders()[0]).await;
    s.confirmed_past_now().await;
    let (bad, inside) = s
        .insert_in_view("Order", "o-1", "OrderPlaced", &json!({"orderId": 7}))
        .await;
    s.insert("Order", "o-1", "OrderPlaced", &orders()[1]).await;
    let text = stopped_with(handle, 60, "the relay stops").await;
    assert!(
        text.contains(&bad.to_string()) && text.contains("$.orderId"),
        "{text}"
    );
    assert!(
        confirmed_flush(&s.client, &s.slot).await.unwrap() <= inside,
        "the slot holds the row and the one after"
    );
    let records = consume(&broker().brokers, &[&topic], 1, Duration::from_secs(10));
    assert_eq!(
        records.len(),
        1,
        "nothing after the misfit was published: {records:?}"
    );
}

/// A value in the wire format: magic byte, schema id, body.
fn wire(id: u32, body: &[u8]) -> Vec<u8> {
    let mut v = vec![0];
    v.extend_from_slice(&id.to_be_bytes());
    v.extend_from_slice(body);
    v
}

/// Makes the outbox's payload column `bytea`, as a table that stores
/// payloads already encoded has it.
async fn payload_as_bytea(client: &tokio_postgres::Client) {
    client
        .batch_execute(
            "ALTER TABLE outbox ALTER COLUMN payload TYPE bytea USING convert_to(payload::text, 'UTF8')",
        )
        .await
        .unwrap();
}

async fn insert_bytes(client: &tokio_postgres::Client, aggregate_id: &str, payload: &[u8]) -> Uuid {
    let id = Uuid::now_v7();
    client
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload) VALUES ($1, 'Ping', $2, 'Pinged', $3)",
            &[&id, &aggregate_id, &payload],
        )
        .await
        .unwrap();
    id
}

#[tokio::test(flavor = "multi_thread")]
async fn encoded_bytea_payloads_are_published_unchanged_once_their_schema_id_checks_out() {
    let s = Setup::new("encoded").await;
    payload_as_bytea(&s.client).await;
    let topic = s.topic("Ping");
    let ping = r#"{"type": "record", "name": "Ping", "fields": [{"name": "n", "type": "long"}, {"name": "s", "type": "string"}]}"#;
    let id = registry().register(&format!("{topic}-value"), "AVRO", ping);
    let pong = r#"{"type": "record", "name": "Pong", "fields": [{"name": "n", "type": "long"}]}"#;
    let elsewhere = registry().register(&format!("{}.other-value", s.prefix), "AVRO", pong);
    assert_ne!(id, elsewhere);
    let text = s.config(&s._db.superuser_url(), "avro", &registry().url, "");
    let (handle, stop) = spawn_relay_with_slot(&s.client, &s.slot, &text).await;
    // {"n": -3, "s": "hé"} and {"n": 2^62, "s": ""} in Avro's binary encoding.
    let goods = [
        wire(id, &[0x05, 0x06, b'h', 0xc3, 0xa9]),
        wire(
            id,
            &[0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x01, 0x00],
        ),
    ];
    let mut good_ids = Vec::new();
    for (i, g) in goods.iter().enumerate() {
        good_ids.push(insert_bytes(&s.client, &format!("p-{i}"), g).await);
    }
    let bads: Vec<(Vec<u8>, &str)> = vec![
        (br#"{"n": 1, "s": "x"}"#.to_vec(), "magic byte"),
        (wire(0x7fff_fff0, &[0x02, 0x00]), "2147483632"),
        (wire(elsewhere, &[0x02]), "is not registered under subject"),
        (wire(id, &[0x02]), "does not decode"),
        (wire(id, &[0x02, 0x00, 0x00]), "left over"),
        (vec![], "magic byte"),
    ];
    let mut bad_ids = Vec::new();
    for (i, (b, _)) in bads.iter().enumerate() {
        bad_ids.push(insert_bytes(&s.client, &format!("bad-{i}"), b).await);
    }
    s.confirmed_past_now().await;
    let dlq = format!("{}.dead-letter", s.prefix);
    let records = consume(&broker().brokers, &[&topic, &dlq], 8, Duration::from_secs(30));
    let events: Vec<&Consumed> = records.iter().filter(|r| r.topic == topic).collect();
    assert_eq!(events.len(), 2, "{records:?}");
    for (i, g) in goods.iter().enumerate() {
        let e = events
            .iter()
            .find(|r| r.header("id") == Some(&good_ids[i].to_string()))
            .unwrap();
        assert_eq!(&e.value, g, "published byte for byte");
        assert_eq!(e.key, format!("p-{i}"));
    }
    let decoded = decode("avro", &events, "");
    let mut values: Vec<Value> = decoded
        .iter()
        .map(|(i, v)| {
            assert_eq!(*i, id);
            v.clone()
        })
        .collect();
    values.sort_by_key(|v| v["n"].as_i64());
    assert_eq!(
        values,
        [json!({"n": -3, "s": "hé"}), json!({"n": 1i64 << 62, "s": ""})]
    );
    let dead: Vec<&Consumed> = records.iter().filter(|r| r.topic == dlq).collect();
    assert_eq!(dead.len(), bads.len(), "{dead:?}");
    for (i, (bytes, needle)) in bads.iter().enumerate() {
        let d = dead
            .iter()
            .find(|r| r.header("id") == Some(&bad_ids[i].to_string()))
            .unwrap();
        assert_schema_mismatch(d, needle);
        let letter: Value = serde_json::from_slice(&d.value).unwrap();
        use base64::Engine as _;
        assert_eq!(
            letter["payloadBase64"]
                .as_str()
                .map(|b| base64::engine::general_purpose::STANDARD.decode(b).unwrap()),
            Some(bytes.clone()),
            "the dead letter keeps the bytes"
        );
    }
    stop_relay(handle, stop).await;
}

/// Outside the registry formats a `bytea` payload is forwarded as its
/// bytes: unchanged as the value, base64 in the envelope, in CDC and in
/// polling mode.
#[tokio::test(flavor = "multi_thread")]
async fn a_bytea_payload_is_its_bytes_as_the_value_and_base64_in_the_envelope() {
    let s = Setup::new("bytea").await;
    payload_as_bytea(&s.client).await;
    let bytes: Vec<u8> = (0..=255u8).rev().collect();
    let routing = |value: &str, topic: &str| {
        format!(
            "topic = \"{p}.{topic}.{{aggregate_type}}\"\nvalue = \"{value}\"",
            p = s.prefix
        )
    };
    let url = s._db.superuser_url();
    let text = config_text(&url, &s.slot, &broker().brokers, &routing("payload", "cdc"), "");
    let (handle, stop) = spawn_relay_with_slot(&s.client, &s.slot, &text).await;
    let id = insert_bytes(&s.client, "p-1", &bytes).await;
    s.confirmed_past_now().await;
    stop_relay(handle, stop).await;
    let cdc = format!("{}.cdc.ping", s.prefix);
    let got = consume(&broker().brokers, &[&cdc], 1, Duration::from_secs(30));
    assert_eq!(
        (got[0].value.clone(), got[0].header("id")),
        (bytes.clone(), Some(id.to_string().as_str()))
    );

    let polling = format!(
        "mode = \"polling\"\n[polling]\ninterval = \"100ms\"\n{}",
        config_text(
            &url,
            "unused",
            &broker().brokers,
            &routing("envelope", "poll"),
            ""
        )
    );
    let (config, validated) = outboxd::config::Config::from_toml(&polling, |_| None).unwrap();
    let metrics = std::sync::Arc::new(outboxd::metrics::Metrics::new().unwrap());
    let health = std::sync::Arc::new(outboxd::ops::health::Health::new(config.health.thresholds()));
    let (stop, rx) = tokio::sync::watch::channel(false);
    let handle = tokio::spawn(async move {
        outboxd::relay::polling::PollingRelay::new(config, validated, metrics, health)
            .unwrap()
            .run(rx)
            .await
    });
    let poll = format!("{}.poll.ping", s.prefix);
    let got = consume(&broker().brokers, &[&poll], 1, Duration::from_secs(30));
    stop.send(true).unwrap();
    handle.await.unwrap().unwrap();
    let envelope: Value = serde_json::from_slice(&got[0].value).unwrap();
    use base64::Engine as _;
    assert_eq!(
        envelope["dataBase64"]
            .as_str()
            .map(|b| base64::engine::general_purpose::STANDARD.decode(b).unwrap()),
        Some(bytes)
    );
    assert_eq!(envelope["eventId"], json!(id.to_string()));
    assert!(envelope.get("data").is_none(), "{envelope}");
}

/// The keys of `records` as records of their own, for [`decode`].
fn keys_as_values(records: &[&Consumed]) -> Vec<Consumed> {
    records
        .iter()
        .map(|r| Consumed {
            value: r.key_bytes.clone(),
            ..(*r).clone()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn encoded_keys_are_the_aggregate_id_under_the_topics_key_subject_and_keep_their_bytes() {
    // Avro keys beside Avro values, as Debezium's Avro converter writes them.
    let s = Setup::new("keys").await;
    let topic = s.topic("Order");
    registry().register(&format!("{topic}-value"), "AVRO", ORDER_AVRO);
    let text = s.config(
        &s._db.superuser_url(),
        "avro",
        &registry().url,
        "key_format = \"avro\"",
    );
    let (handle, stop) = spawn_relay_with_slot(&s.client, &s.slot, &text).await;
    let aggregates = ["order-0", "주문-1"];
    for (o, a) in orders().iter().zip(aggregates) {
        s.insert("Order", a, "OrderPlaced", o).await;
    }
    s.confirmed_past_now().await;
    stop_relay(handle, stop).await;
    let key_subject = format!("{topic}-key");
    let key_id = registry().latest_id(&key_subject);
    let first = consume(&broker().brokers, &[&topic], 2, Duration::from_secs(30));
    let records: Vec<&Consumed> = first.iter().collect();
    let keys = keys_as_values(&records);
    let decoded = decode("avro", &keys.iter().collect::<Vec<_>>(), "");
    let mut got: Vec<(u32, Value)> = decoded;
    got.sort_by_key(|(_, v)| v.to_string());
    assert_eq!(got, [(key_id, json!("order-0")), (key_id, json!("주문-1"))]);
    assert_eq!(decode("avro", &records, "").len(), 2, "the values stay Avro");

    // Another version under the key subject does not change a key's bytes
    // (nor, with them, its partition).
    registry().register(&key_subject, "AVRO", r#"["null", "string"]"#);
    assert_ne!(registry().latest_id(&key_subject), key_id);
    let (handle, stop) = spawn_relay_with_slot(&s.client, &s.slot, &text).await;
    s.insert("Order", "order-0", "OrderPlaced", &orders()[0]).await;
    s.confirmed_past_now().await;
    stop_relay(handle, stop).await;
    let all = consume(&broker().brokers, &[&topic], 3, Duration::from_secs(30));
    let of_0: Vec<&Consumed> = all.iter().filter(|r| r.key_bytes.ends_with(b"order-0")).collect();
    assert_eq!(of_0.len(), 2, "{all:?}");
    assert_eq!(of_0[0].key_bytes, of_0[1].key_bytes);
    assert_eq!(of_0[0].partition, of_0[1].partition);

    // JSON Schema keys beside the JSON envelope: the subject is registered
    // by outboxd, and Confluent's deserializer reads the key back.
    let j = Setup::new("jkeys").await;
    let jtopic = j.topic("Order");
    let text = j.config(
        &j._db.superuser_url(),
        "envelope",
        &registry().url,
        "key_format = \"json-schema\"",
    );
    let (handle, stop) = spawn_relay_with_slot(&j.client, &j.slot, &text).await;
    j.insert("Order", "a \"quoted\" key", "OrderPlaced", &orders()[1])
        .await;
    j.confirmed_past_now().await;
    stop_relay(handle, stop).await;
    let got = consume(&broker().brokers, &[&jtopic], 1, Duration::from_secs(30));
    let envelope: Value = serde_json::from_slice(&got[0].value).unwrap();
    assert_eq!(
        envelope["aggregateId"],
        json!("a \"quoted\" key"),
        "the value is the envelope"
    );
    let keys = keys_as_values(&got.iter().collect::<Vec<_>>());
    let decoded = decode("json-schema", &keys.iter().collect::<Vec<_>>(), "");
    assert_eq!(
        decoded,
        [(
            registry().latest_id(&format!("{jtopic}-key")),
            json!("a \"quoted\" key")
        )]
    );
}

/// An Avro schema reduced to what a reader meets: records as their fields
/// in order, unions, arrays, maps and primitives; names, namespaces, docs
/// and Connect's `connect.*` properties left out.
fn avro_shape(s: &Value) -> Value {
    match s {
        Value::String(primitive) => json!(primitive),
        Value::Array(branches) => Value::Array(branches.iter().map(avro_shape).collect()),
        Value::Object(o) => match o.get("type").and_then(Value::as_str) {
            Some("record") => Value::Array(
                o["fields"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|f| json!([f["name"], avro_shape(&f["type"]), f.get("default")]))
                    .collect(),
            ),
            Some("array") => json!({"array": avro_shape(&o["items"])}),
            Some("map") => json!({"map": avro_shape(&o["values"])}),
            Some(primitive) => json!(primitive),
            None => avro_shape(&o["type"]),
        },
        other => panic!("not an Avro schema: {other}"),
    }
}

/// Beside Debezium with Apicurio's Avro converter and
/// `table.expand.json.payload`: the same rows through both relays, read by
/// Confluent's deserializer, give the same values, and the schemas agree
/// wherever docs/schema-registry.md says they do (the root aside: a union
/// with null in Debezium's).
#[tokio::test(flavor = "multi_thread")]
async fn inferred_avro_decodes_like_debeziums_avro_converter_output() {
    use crate::harness::debezium::{Debezium, Source};
    let s = Setup::new("dbz_avro").await;
    for sql in [
        "CREATE PUBLICATION dbz_avro FOR TABLE outbox WITH (publish = 'insert')",
        "SELECT pg_create_logical_replication_slot('dbz_avro_d', 'pgoutput')",
        "SELECT pg_create_logical_replication_slot('sr_dbz_avro', 'pgoutput')",
    ] {
        s.client.batch_execute(sql).await.unwrap();
    }
    let payloads = [
        (
            "Order",
            json!({"orderId": "o-1", "total": 12.5, "count": 3, "paid": true, "big": 9_007_199_254_740_993i64,
            "lines": [{"sku": "A", "qty": 2}, {"sku": "B", "qty": 1}], "customer": {"name": "김", "vip": false},
            "tags": ["x", "y"]}),
        ),
        (
            "Basket",
            json!({"basketId": "b-1", "items": [], "owner": {"name": "", "age": -1}}),
        ),
        (
            "Payment",
            json!({"amount": 0.1, "currency": "EUR", "attempts": [1, 2, 3],
            "parts": [{"sku": "A"}, {"sku": "B", "qty": 2}]}),
        ),
    ];
    let mut ids = Vec::new();
    for (i, (aggregate_type, p)) in payloads.iter().enumerate() {
        ids.push(s.insert(aggregate_type, &format!("agg-{i}"), "Placed", p).await);
    }
    let dbz_prefix = format!("{}d", s.prefix);
    let v2 = registry().url.replace("/apis/ccompat/v7", "/apis/registry/v2");
    let settings = [
        "value.converter=io.apicurio.registry.utils.converter.AvroConverter".to_owned(),
        format!("value.converter.apicurio.registry.url={v2}"),
        "value.converter.apicurio.registry.auto-register=true".to_owned(),
        "value.converter.apicurio.registry.as-confluent=true".to_owned(),
        "value.converter.apicurio.registry.use-id=contentId".to_owned(),
        "value.converter.apicurio.registry.headers.enabled=false".to_owned(),
        "transforms.outbox.table.expand.json.payload=true".to_owned(),
    ];
    let settings: Vec<&str> = settings.iter().map(String::as_str).collect();
    let source = Source {
        pg_port: crate::harness::postgres::server().port,
        dbname: &s._db.name,
        slot: "dbz_avro_d",
        publication: "dbz_avro",
    };
    let debezium = Debezium::start(
        &broker().brokers,
        &source,
        &format!("{dbz_prefix}.${{routedByValue}}"),
        &settings,
    );
    let text = s
        .config(
            &s._db.superuser_url(),
            "avro",
            &registry().url,
            "schema = \"inferred\"",
        )
        .replace(
            "publication = \"sr_dbz_avro\"",
            "publication = \"dbz_avro\"\ncreate_publication = false",
        );
    let (handle, stop) = spawn_relay_with_slot(&s.client, &s.slot, &text).await;
    s.confirmed_past_now().await;
    stop_relay(handle, stop).await;
    let topics: Vec<String> = payloads
        .iter()
        .flat_map(|(t, _)| [s.topic(t), format!("{dbz_prefix}.{t}")])
        .collect();
    let names: Vec<&str> = topics.iter().map(String::as_str).collect();
    let records = consume(
        &broker().brokers,
        &names,
        2 * payloads.len(),
        Duration::from_secs(60),
    );
    debezium.stop();
    assert_eq!(
        records.len(),
        2 * payloads.len(),
        "{records:?}\n{}",
        debezium.log()
    );
    let all: Vec<&Consumed> = records.iter().collect();
    let decoded = decode("avro", &all, "");
    for (i, (aggregate_type, payload)) in payloads.iter().enumerate() {
        let of = |topic: &str| {
            let at = records
                .iter()
                .position(|r| r.topic == topic)
                .unwrap_or_else(|| panic!("nothing on {topic}"));
            assert_eq!(records[at].header("id"), Some(ids[i].to_string().as_str()));
            decoded[at].clone()
        };
        let (ours, ours_value) = of(&s.topic(aggregate_type));
        let (theirs, theirs_value) = of(&format!("{dbz_prefix}.{aggregate_type}"));
        // An array's records are merged: a field one element lacks reads null.
        let mut read_back = payload.clone();
        if let Some(parts) = read_back.get_mut("parts") {
            parts[0]["qty"] = Value::Null;
        }
        assert_eq!(ours_value, read_back, "outboxd: the payload");
        // Debezium leaves an empty array's field out (a documented
        // difference): outboxd keeps it.
        let empty_arrays: Vec<String> = payload
            .as_object()
            .unwrap()
            .iter()
            .filter(|(_, v)| v.as_array().is_some_and(Vec::is_empty))
            .map(|(k, _)| k.clone())
            .collect();
        let mut expected = ours_value.clone();
        for k in &empty_arrays {
            expected.as_object_mut().unwrap().remove(k);
        }
        assert_eq!(
            theirs_value, expected,
            "{aggregate_type}: the same values as Debezium's"
        );
        let mut theirs_schema = avro_shape(&registry().schema_of(theirs));
        // Debezium's root is ["null", record].
        if let Value::Array(branches) = &theirs_schema {
            if branches.len() == 2 && branches[0] == json!("null") {
                theirs_schema = branches[1].clone();
            }
        }
        let mut ours_schema = avro_shape(&registry().schema_of(ours));
        if let Value::Array(fields) = &mut ours_schema {
            fields.retain(|f| !empty_arrays.iter().any(|k| f[0] == json!(k)));
            // Merged records of an array: Debezium's items are the record,
            // outboxd's stay optional (documented).
            for f in fields.iter_mut().filter(|f| f[0] == "parts") {
                let items = &mut f[1][1]["array"];
                assert_eq!(items[0], "null", "outboxd's items are optional");
                *items = items[1].clone();
            }
        }
        assert_eq!(
            ours_schema, theirs_schema,
            "{aggregate_type}: the schemas' fields, in order, with their types"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_encoded_protobuf_payload_must_be_the_message_its_rule_names() {
    use outboxd::schema::protobuf::ProtobufCodec;
    let s = Setup::new("proto_bytes").await;
    payload_as_bytea(&s.client).await;
    let topic = s.topic("Ping");
    let proto = "syntax = \"proto3\";\npackage shop;\nmessage Header { string trace = 1; }\nmessage OrderPlaced { string order_id = 1; }\n";
    let id = registry().register(&format!("{topic}-value"), "PROTOBUF", proto);
    let routing = "[routing.schemas.\"Pinged\"]\nrecord = \"shop.OrderPlaced\"\n";
    let text = s.config(&s._db.superuser_url(), "protobuf", &registry().url, routing);
    let (handle, stop) = spawn_relay_with_slot(&s.client, &s.slot, &text).await;
    let encoded = |message: &str, json: &str| {
        let mut out = Vec::new();
        ProtobufCodec::parse(proto, Some(message))
            .unwrap()
            .encode(json, &mut out)
            .unwrap();
        wire(id, &out)
    };
    let good = encoded("shop.OrderPlaced", r#"{"orderId": "o-1"}"#);
    let good_id = insert_bytes(&s.client, "p-1", &good).await;
    // The Header message of the same schema id and subject decodes too.
    let other = insert_bytes(&s.client, "p-2", &encoded("shop.Header", r#"{"trace": "t"}"#)).await;
    s.confirmed_past_now().await;
    stop_relay(handle, stop).await;
    let dlq = format!("{}.dead-letter", s.prefix);
    let records = consume(&broker().brokers, &[&topic, &dlq], 2, Duration::from_secs(30));
    let by_id = |id: Uuid| {
        records
            .iter()
            .find(|r| r.header("id") == Some(&id.to_string()))
            .unwrap()
    };
    assert_eq!(
        (by_id(good_id).topic.as_str(), &by_id(good_id).value),
        (topic.as_str(), &good)
    );
    let dead = by_id(other);
    assert_eq!(dead.topic, dlq);
    assert_schema_mismatch(
        dead,
        "shop.Header message, but routing.schemas names shop.OrderPlaced",
    );
}

/// Inserts `payload` as written (jsonb keeps every digit; a `serde_json`
/// value would have rounded it already).
async fn insert_text(s: &Setup, aggregate_id: &str, event_type: &str, payload: &str) -> Uuid {
    let id = Uuid::now_v7();
    s.client
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload) VALUES ($1, 'Order', $2, $3, $4::text::jsonb)",
            &[&id, &aggregate_id, &event_type, &payload],
        )
        .await
        .unwrap();
    id
}

/// An integer beyond 64 bits is read as the nearest double, and an
/// integer a `double` or `float` field cannot hold arrives as another
/// number: both are schema mismatches (dead-lettered here) in inferred
/// Avro, a registered Avro schema and Protobuf, and nothing is
/// registered for them.
#[tokio::test(flavor = "multi_thread")]
async fn numbers_no_schema_type_holds_exactly_are_schema_mismatches() {
    let huge = r#"{"orderId":"o-2","huge":123456789012345678901234567890}"#;
    // Inferred Avro: the first payload registers a version; the huge one
    // registers none.
    let s = Setup::new("huge_inferred").await;
    let subject = format!("{}-value", s.topic("Order"));
    let text = s.config(
        &s._db.superuser_url(),
        "avro",
        &registry().url,
        "schema = \"inferred\"",
    );
    let (handle, stop) = spawn_relay_with_slot(&s.client, &s.slot, &text).await;
    insert_text(&s, "o-1", "OrderPlaced", r#"{"orderId":"o-1","huge":1.5}"#).await;
    insert_text(&s, "o-2", "OrderPlaced", huge).await;
    s.confirmed_past_now().await;
    let (topic, dlq) = (s.topic("Order"), format!("{}.dead-letter", s.prefix));
    let records = consume(&broker().brokers, &[&topic, &dlq], 2, Duration::from_secs(30));
    let dead: Vec<&Consumed> = records.iter().filter(|r| r.topic == dlq).collect();
    assert_eq!(dead.len(), 1, "{records:?}");
    assert_schema_mismatch(dead[0], "$.huge");
    let error = dead[0].header("dlq.error").unwrap_or_default();
    assert!(
        error.contains("beyond 64 bits") && !error.contains("schema id 0"),
        "{error}"
    );
    let event = records.iter().find(|r| r.topic == topic).unwrap();
    assert_eq!(
        registry().latest_id(&subject),
        decode("avro", &[event], "")[0].0,
        "no version for the huge one"
    );
    stop_relay(handle, stop).await;

    // A registered Avro schema: a double, and a union of long and double.
    let s = Setup::new("huge_avro").await;
    let (topic, dlq) = (s.topic("Order"), format!("{}.dead-letter", s.prefix));
    registry().register(
        &format!("{topic}-value"),
        "AVRO",
        r#"{"type":"record","name":"N","fields":[{"name":"orderId","type":"string"},{"name":"huge","type":["long","double"]},{"name":"d","type":"double","default":0}]}"#,
    );
    let text = s.config(&s._db.superuser_url(), "avro", &registry().url, "");
    let (handle, stop) = spawn_relay_with_slot(&s.client, &s.slot, &text).await;
    insert_text(
        &s,
        "o-1",
        "OrderPlaced",
        r#"{"orderId":"o-1","huge":9007199254740993,"d":2.5}"#,
    )
    .await;
    insert_text(&s, "o-2", "OrderPlaced", huge).await;
    insert_text(
        &s,
        "o-3",
        "OrderPlaced",
        r#"{"orderId":"o-3","huge":1,"d":9007199254740993}"#,
    )
    .await;
    s.confirmed_past_now().await;
    let records = consume(&broker().brokers, &[&topic, &dlq], 3, Duration::from_secs(30));
    let events: Vec<&Consumed> = records.iter().filter(|r| r.topic == topic).collect();
    assert_eq!(events.len(), 1, "{records:?}");
    assert_eq!(
        decode("avro", &events, "")[0].1,
        json!({"orderId": "o-1", "huge": 9_007_199_254_740_993i64, "d": 2.5}),
        "the long branch keeps it exactly"
    );
    // By key: the dead-letter topic's partitions are read in no set order.
    let dead = |key: &str| {
        records
            .iter()
            .find(|r| r.topic == dlq && r.key == key)
            .unwrap_or_else(|| panic!("no dead letter for {key}: {records:?}"))
    };
    assert_schema_mismatch(dead("o-2"), "$.huge");
    assert_schema_mismatch(dead("o-3"), "$.d");
    assert!(dead("o-3")
        .header("dlq.error")
        .unwrap_or_default()
        .contains("cannot hold exactly"));
    stop_relay(handle, stop).await;

    // Protobuf: a double field.
    let s = Setup::new("huge_proto").await;
    let (topic, dlq) = (s.topic("Order"), format!("{}.dead-letter", s.prefix));
    registry().register(
        &format!("{topic}-value"),
        "PROTOBUF",
        "syntax = \"proto3\";\nmessage N { string order_id = 1; double huge = 2; }\n",
    );
    let text = s.config(&s._db.superuser_url(), "protobuf", &registry().url, "");
    let (handle, stop) = spawn_relay_with_slot(&s.client, &s.slot, &text).await;
    insert_text(&s, "o-1", "OrderPlaced", r#"{"orderId":"o-1","huge":0.5}"#).await;
    insert_text(&s, "o-2", "OrderPlaced", huge).await;
    s.confirmed_past_now().await;
    let records = consume(&broker().brokers, &[&topic, &dlq], 2, Duration::from_secs(30));
    assert_eq!(
        records.iter().filter(|r| r.topic == topic).count(),
        1,
        "{records:?}"
    );
    let dead = records.iter().find(|r| r.topic == dlq).unwrap();
    assert_schema_mismatch(dead, "$.huge");
    stop_relay(handle, stop).await;
}

use super::*;
use crate::config::{Config, KeyFormat, ValueFormat};

/// Reads an import's TOML as `outboxd run` would.
fn load(toml: &str) -> (Config, crate::config::Validated) {
    Config::from_toml(toml, |v| match v {
        "PGPASSWORD" => Some("secret".into()),
        "KAFKA_BROKERS" => Some("kafka:9092".into()),
        _ => None,
    })
    .unwrap_or_else(|e| panic!("{e}\n{toml}"))
}

/// Debezium's documented outbox connector, as POSTed to Connect's REST
/// API: the Event Router at its defaults.
const DEFAULT_JSON: &str = r#"{
  "name": "outbox-connector",
  "config": {
    "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
    "tasks.max": "1",
    "database.hostname": "db.internal",
    "database.port": 5432,
    "database.user": "debezium",
    "database.password": "hunter2",
    "database.dbname": "shop",
    "topic.prefix": "dbserver1",
    "plugin.name": "pgoutput",
    "table.include.list": "public.outbox",
    "transforms": "outbox",
    "transforms.outbox.type": "io.debezium.transforms.outbox.EventRouter"
  }
}"#;

#[test]
fn debeziums_default_connector_becomes_a_valid_configuration() {
    let (name, connector) = read_config("c.json", DEFAULT_JSON).unwrap();
    assert_eq!(name.as_deref(), Some("outbox-connector"));
    let imported = debezium(name.as_deref(), &connector, None).unwrap();
    assert!(!imported.toml.contains("hunter2"), "{}", imported.toml);
    let (config, v) = load(&imported.toml);
    assert_eq!(config.postgres.slot, "debezium");
    assert_eq!(config.postgres.publication, "dbz_publication");
    assert!(!config.postgres.create_publication);
    assert_eq!(v.table.to_string(), "public.outbox");
    assert_eq!(v.pg.password.as_deref(), Some("secret"));
    assert_eq!(v.pg.dbname, "shop");
    use crate::config::columns::Role;
    assert_eq!(v.columns.column(Role::Key).unwrap().as_str(), "aggregateid");
    assert_eq!(v.columns.column(Role::Route).unwrap().as_str(), "aggregatetype");
    assert!(v.columns.column(Role::Headers).is_none());
    assert!(v.columns.column(Role::Timestamp).is_none());
    assert_eq!(config.routing.topic, "outbox.event.{aggregate_type}");
    assert!(!config.routing.lowercase_aggregate_type && !config.routing.standard_headers);
    // No converter set anywhere: Connect's sample worker's JsonConverter.
    assert_eq!(config.routing.value, ValueFormat::ConnectJson);
    assert_eq!(config.routing.key_format, KeyFormat::ConnectJson);
    assert!(config.routing.connect_schemas && config.routing.connect_key_schemas);
    assert_eq!(config.kafka.options["partitioner"], "murmur2_random");
    let options: Vec<&str> = imported.notes.iter().map(|n| n.option.as_str()).collect();
    for expected in [
        "key.converter, value.converter",
        "extended.headers.enabled",
        "snapshot.mode",
        "tasks.max",
    ] {
        assert!(options.contains(&expected), "{expected}: {options:?}");
    }
}

#[test]
fn a_properties_file_with_every_router_option() {
    let text = r#"
name=orders-outbox
connector.class=io.debezium.connector.postgresql.PostgresConnector
database.hostname=10.0.0.5
database.user=app
database.password=${file:/secrets/db.properties:password}
database.dbname=orders
database.sslmode=require
topic.prefix=orders
plugin.name=pgoutput
slot.name=orders_slot
publication.name=orders_pub
table.include.list=app\\.OutboxEvent
key.converter=org.apache.kafka.connect.storage.StringConverter
value.converter=org.apache.kafka.connect.json.JsonConverter
value.converter.schemas.enable=false
transforms=unwrapFirst,outbox
transforms.unwrapFirst.type=org.apache.kafka.connect.transforms.InsertHeader
transforms.outbox.type=io.debezium.transforms.outbox.EventRouter
transforms.outbox.table.field.event.id=eventId
transforms.outbox.table.field.event.key=aggregateId
transforms.outbox.table.field.event.payload=body
transforms.outbox.table.field.event.timestamp=occurredAt
transforms.outbox.route.by.field=destination
transforms.outbox.route.topic.regex=urn:(?<kind>[a-z]+):(.*)
transforms.outbox.route.topic.replacement=${kind}.$2.events
transforms.outbox.route.tombstone.on.empty.payload=true
transforms.outbox.table.fields.additional.placement=type:header:eventType,tenant:envelope:tenantId,part:partition,id:header
transforms.outbox.table.field.additional.missing=ignore
heartbeat.interval.ms=10000
some.unknown.option=42
"#;
    let worker = properties::parse("bootstrap.servers=k1:9092,k2:9092\n").unwrap();
    let (name, connector) = read_config("c.properties", text).unwrap();
    let imported = debezium(name.as_deref(), &connector, Some(&worker)).unwrap();
    let (config, v) = load(&imported.toml);
    assert_eq!(config.kafka.brokers, "k1:9092,k2:9092");
    assert_eq!(v.table.to_string(), "app.OutboxEvent");
    assert_eq!(config.postgres.slot, "orders_slot");
    assert!(
        config.postgres.url.contains("sslmode=require"),
        "{}",
        config.postgres.url
    );
    assert_eq!(
        config.routing.topic_regex.as_deref(),
        Some("urn:(?<kind>[a-z]+):(.*)")
    );
    assert_eq!(config.routing.topic, "{$kind}.{$2}.events");
    assert!(config.routing.tombstone_on_empty_payload);
    assert_eq!(config.routing.value, ValueFormat::ConnectJson);
    assert!(!config.routing.connect_schemas);
    assert_eq!(config.routing.key_format, KeyFormat::String);
    assert_eq!(config.routing.connect_topic_prefix, "orders");
    use crate::config::columns::{Placement, Role};
    assert_eq!(v.columns.column(Role::Timestamp).unwrap().as_str(), "occurredAt");
    let placements: Vec<(Placement, &str)> = v
        .columns
        .placements
        .iter()
        .map(|p| (p.placement, p.name.as_str()))
        .collect();
    assert_eq!(
        placements,
        [
            (Placement::Header, "eventType"),
            (Placement::Envelope, "tenantId"),
            (Placement::Partition, "part")
        ]
    );
    let notes: BTreeMap<&str, &str> = imported
        .notes
        .iter()
        .map(|n| (n.option.as_str(), n.value.as_str()))
        .collect();
    assert!(notes.contains_key("transforms.unwrapFirst"), "{notes:?}");
    assert!(notes.contains_key("heartbeat.interval.ms"));
    assert_eq!(notes.get("some.unknown.option"), Some(&"42"));
    assert!(
        notes.contains_key("transforms.outbox.table.fields.additional.placement"),
        "id:header is noted"
    );
    assert!(
        imported.toml.contains("config provider"),
        "the password's origin is named, not copied"
    );
}

#[test]
fn a_decoderbufs_slot_is_not_taken_over() {
    let connector = BTreeMap::from([
        (
            "connector.class".to_owned(),
            "io.debezium.connector.postgresql.PostgresConnector".to_owned(),
        ),
        ("database.dbname".to_owned(), "app".to_owned()),
        ("transforms".to_owned(), "o".to_owned()),
        ("transforms.o.type".to_owned(), EVENT_ROUTER.to_owned()),
        (
            "value.converter".to_owned(),
            "org.apache.kafka.connect.storage.StringConverter".to_owned(),
        ),
        (
            "key.converter".to_owned(),
            "org.apache.kafka.connect.storage.StringConverter".to_owned(),
        ),
    ]);
    let imported = debezium(None, &connector, None).unwrap();
    let (config, _) = load(&imported.toml);
    assert_eq!(
        config.postgres.slot, "outboxd",
        "plugin.name defaults to decoderbufs"
    );
    assert!(
        config.postgres.create_publication && config.postgres.publication == "outboxd",
        "a decoderbufs deployment has no publication"
    );
    assert_eq!(config.routing.value, ValueFormat::Payload);
    assert!(imported.notes.iter().any(|n| n.option == "plugin.name"));
    assert!(imported.notes.iter().any(|n| n.option == "table.include.list"));
}

/// Connect configures a converter the connector sets from the
/// connector's keys alone: the worker's `schemas.enable` is not its.
#[test]
fn a_connector_converter_takes_its_settings_from_the_connector() {
    let (_, mut connector) = read_config("c.json", DEFAULT_JSON).unwrap();
    connector.insert(
        "value.converter".into(),
        "org.apache.kafka.connect.json.JsonConverter".into(),
    );
    let worker = properties::parse(
        "value.converter=org.apache.kafka.connect.json.JsonConverter\nvalue.converter.schemas.enable=false\nkey.converter=org.apache.kafka.connect.json.JsonConverter\nkey.converter.schemas.enable=false\n",
    )
    .unwrap();
    let (config, _) = load(&debezium(None, &connector, Some(&worker)).unwrap().toml);
    assert!(
        config.routing.connect_schemas,
        "the connector's converter: schemas on"
    );
    assert!(
        !config.routing.connect_key_schemas,
        "the worker's converter: its setting"
    );
}

#[test]
fn what_cannot_be_imported_is_refused() {
    let mut c = BTreeMap::from([(
        "connector.class".to_owned(),
        "io.debezium.connector.mysql.MySqlConnector".to_owned(),
    )]);
    assert!(matches!(
        debezium(None, &c, None),
        Err(ImportError::NotPostgres(_))
    ));
    c.insert(
        "connector.class".into(),
        "io.debezium.connector.postgresql.PostgresConnector".into(),
    );
    assert!(matches!(
        debezium(None, &c, None),
        Err(ImportError::NoEventRouter)
    ));
    assert!(read_config("x", "{\"config\": [").is_err());
}

#[test]
fn java_replacements_become_templates() {
    // Group 1 of a one-group regex: `$1abc` is group 1 then "abc".
    assert_eq!(replacement_to_template("$1abc", 2).unwrap(), "{$1}abc");
    // With twelve groups, `$12` is group 12; with two, group 1 then "2".
    assert_eq!(replacement_to_template("a$12", 13).unwrap(), "a{$12}");
    assert_eq!(replacement_to_template("a$12", 2).unwrap(), "a{$1}2");
    assert_eq!(
        replacement_to_template("outbox.event.${routedByValue}", 2).unwrap(),
        "outbox.event.{$routedByValue}"
    );
    assert_eq!(replacement_to_template("a\\.b", 1).unwrap(), "a.b");
    assert!(replacement_to_template("a$", 1).is_err());
    assert!(replacement_to_template("a{b}", 1).is_err());
}

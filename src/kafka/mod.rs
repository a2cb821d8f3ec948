//! The Kafka side: the producer, topics and broker checks ([`sink`]),
//! delivery reports in batches, lanes and the producer's poller
//! ([`delivery`]), records handed to librdkafka with kept topic handles
//! ([`native`]), the clients the sources of a process share
//! ([`clients`]),
//! records and dead letters built from outbox rows ([`records`]),
//! CloudEvents values ([`cloudevents`]), Kafka Connect's JSON as Debezium
//! writes it ([`connect`]), and table rows handed to the producer by
//! polling mode and replay ([`enqueue`]).

pub mod clients;
pub mod cloudevents;
pub mod connect;
pub mod delivery;
pub mod enqueue;
pub mod native;
pub mod records;
pub mod sink;

/// A map of what is looked up once or twice per event (tickets, topics):
/// foldhash instead of std's SipHash, which was 3% of a drain's
/// instructions. Keys come from outboxd (tickets) or are few (topics).
pub type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

//! Tests of behaviour that differs between PostgreSQL versions: the
//! replication protocol, slots (their columns, invalidation, WAL
//! retention), failover slots, publications, logical decoding messages
//! and the catalog reads that prove them.
//!
//! `scripts/test.sh` runs the whole suite on PostgreSQL 15 and, on every
//! other supported version (17 and 18), only the tests in this module.
//! The rule for a new test: if what it checks could change with the
//! server's version, it goes here; otherwise next to the feature it tests.

mod emit;
mod emitted;
mod failover;
mod partitioned;
mod publication;
mod publication_window;
mod replication;
mod rewound;
mod slots;

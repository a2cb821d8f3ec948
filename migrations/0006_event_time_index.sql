-- Event store (seed 004): time travel without visiting the table.
--
-- `version_at` takes the lowest version among an aggregate's events that
-- occurred after a moment. With the version in the time index, it reads
-- those events with an index-only scan (see VERSION_AT in
-- sdk/src/event_store.rs). The old time index is replaced.
CREATE INDEX IF NOT EXISTS events_aggregate_time_version_idx
    ON events (aggregate_type, aggregate_id, occurred_at) INCLUDE (version);
DROP INDEX IF EXISTS events_aggregate_time_idx;

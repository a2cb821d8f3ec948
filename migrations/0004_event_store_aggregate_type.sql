-- Event store (seed 004), keyed by (aggregate_type, aggregate_id).
--
-- Until now events and snapshots were keyed by aggregate_id alone, so
-- `Account 42` and `Customer 42` shared one history: false conflicts, and
-- each type's version numbers interleaved with the other's. This migration
-- makes the pair the key and repairs what the old key mixed:
--
-- * Histories that two or more types shared are renumbered 1..n per type,
--   in their original order. Each changed event is listed in
--   `events_renumbered` (old and new version), because the outbox rows
--   already published for them carried the old number in their `version`
--   header; read-side views of those aggregates should be rebuilt.
-- * Snapshots of shared histories mixed two types' state and are dropped
--   (a snapshot is a cache: loading replays the events instead). Other
--   snapshots take the type of the event that made their version.
-- * Time travel gets an index on the new key, and `occurred_at` defaults to
--   the moment of the insert (`clock_timestamp()`) instead of the start of
--   the transaction, so that within one aggregate a later version never
--   carries an earlier time than the version before it (see `state_at`).

CREATE TABLE IF NOT EXISTS events_renumbered (
    event_id       uuid        PRIMARY KEY,
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    old_version    bigint      NOT NULL,
    new_version    bigint      NOT NULL,
    renumbered_at  timestamptz NOT NULL DEFAULT now()
);

ALTER TABLE events DROP CONSTRAINT IF EXISTS events_aggregate_version_key;

WITH shared AS (
    SELECT aggregate_id FROM events GROUP BY aggregate_id HAVING count(DISTINCT aggregate_type) > 1
), renumbered AS (
    SELECT e.id, e.event_id, e.aggregate_type, e.aggregate_id, e.version AS old_version,
           row_number() OVER (PARTITION BY e.aggregate_type, e.aggregate_id ORDER BY e.version) AS new_version
      FROM events e
      JOIN shared USING (aggregate_id)
), logged AS (
    INSERT INTO events_renumbered (event_id, aggregate_type, aggregate_id, old_version, new_version)
    SELECT event_id, aggregate_type, aggregate_id, old_version, new_version
      FROM renumbered WHERE old_version <> new_version
)
UPDATE events e SET version = r.new_version
  FROM renumbered r
 WHERE e.id = r.id AND r.old_version <> r.new_version;

ALTER TABLE events
    ADD CONSTRAINT events_aggregate_version_key UNIQUE (aggregate_type, aggregate_id, version);

ALTER TABLE events ALTER COLUMN occurred_at SET DEFAULT clock_timestamp();

DROP INDEX IF EXISTS events_aggregate_time_idx;
CREATE INDEX IF NOT EXISTS events_aggregate_time_idx ON events (aggregate_type, aggregate_id, occurred_at);

ALTER TABLE snapshots ADD COLUMN IF NOT EXISTS aggregate_type text;
DELETE FROM snapshots
 WHERE aggregate_id IN (SELECT aggregate_id FROM events GROUP BY aggregate_id HAVING count(DISTINCT aggregate_type) > 1);
UPDATE snapshots s SET aggregate_type = e.aggregate_type
  FROM events e
 WHERE s.aggregate_type IS NULL AND e.aggregate_id = s.aggregate_id AND e.version = s.version;
DELETE FROM snapshots WHERE aggregate_type IS NULL;
ALTER TABLE snapshots ALTER COLUMN aggregate_type SET NOT NULL;
ALTER TABLE snapshots DROP CONSTRAINT IF EXISTS snapshots_pkey;
ALTER TABLE snapshots ADD PRIMARY KEY (aggregate_type, aggregate_id, version);

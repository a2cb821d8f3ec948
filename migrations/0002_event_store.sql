-- Event store (seed 004): one row per domain event. UNIQUE (aggregate_id,
-- version) is the optimistic-concurrency guard: two writers that loaded the
-- same version cannot both append the next one.
CREATE TABLE IF NOT EXISTS events (
    id             bigserial   PRIMARY KEY,
    event_id       uuid        NOT NULL UNIQUE,          -- the same id as the event's outbox row
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    version        bigint      NOT NULL CHECK (version > 0),
    type           text        NOT NULL,
    payload        jsonb       NOT NULL,
    occurred_at    timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT events_aggregate_version_key UNIQUE (aggregate_id, version)
);

-- Time travel reads one aggregate's events up to a moment.
CREATE INDEX IF NOT EXISTS events_aggregate_time_idx ON events (aggregate_id, occurred_at);

-- Snapshots of aggregate state every N versions; loading reads the latest
-- snapshot and only the events after it.
CREATE TABLE IF NOT EXISTS snapshots (
    aggregate_id text        NOT NULL,
    version      bigint      NOT NULL CHECK (version > 0),
    state        jsonb       NOT NULL,
    taken_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (aggregate_id, version)
);

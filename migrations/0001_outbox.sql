-- The transactional outbox (seed 000). Applications insert one row per event
-- in the same transaction as their domain change; outboxd streams the INSERTs
-- from the WAL. In CDC mode the table is only an audit trail: rows may be
-- deleted at any time after commit, because the WAL already carries them.
CREATE TABLE IF NOT EXISTS outbox (
    id             uuid        PRIMARY KEY,              -- event id; consumers deduplicate by it
    aggregate_type text        NOT NULL,                 -- 'Order' -> topic order.events
    aggregate_id   text        NOT NULL,                 -- Kafka key: one aggregate, one partition
    type           text        NOT NULL,                 -- 'ordering.order-placed.v1'
    payload        jsonb       NOT NULL,                 -- event body
    headers        jsonb       NOT NULL DEFAULT '{}',    -- correlationId, traceparent, ...
    created_at     timestamptz NOT NULL DEFAULT now(),
    published_at   timestamptz                           -- NULL: not yet published (polling mode)
);

-- Unpublished rows, oldest first: used by polling mode and the monitoring query.
CREATE INDEX IF NOT EXISTS outbox_unpublished_idx ON outbox (created_at) WHERE published_at IS NULL;

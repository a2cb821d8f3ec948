-- Parked events (routing.on_poison = "park"): an event outboxd cannot
-- publish, and every later event of the same sequence (the topic and key
-- it goes to), wait here, in commit order, until an operator fixes the
-- cause and runs `outboxd parked redrive`, or sends the head to the
-- dead-letter topic with `outboxd parked skip`. Other aggregates flow on.
--
-- outboxd writes a parked row before it confirms the slot past its event,
-- and deletes it only after Kafka acknowledged its redrive: every event is
-- in Kafka, here, or still in the slot. Apply in the outbox table's schema.

-- One row per parked sequence: its head (the first event that could not be
-- published) and why. Redrive deletes it last, under a row lock that the
-- relay shares while it parks more events, so that an event arriving
-- meanwhile is either redriven after the others or published after them.
CREATE TABLE IF NOT EXISTS outboxd_parked_sequences (
    slot        text        NOT NULL,
    topic       text        NOT NULL,
    key         text        NOT NULL,
    head_lsn    pg_lsn      NOT NULL,
    head_index  integer     NOT NULL,
    head_id     text        NOT NULL,
    head_reason text        NOT NULL,
    parked_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (slot, topic, key)
);

-- One row per parked event. (slot, commit_lsn, position) is its place in
-- the stream: a replay after a crash parks it again without a duplicate.
-- The outbox row's columns are kept as outboxd read them, so that a
-- redrive builds its record under the configuration of the day; `columns`
-- holds the text of a row that could not be read as an event at all.
CREATE TABLE IF NOT EXISTS outboxd_parked (
    slot           text        NOT NULL,
    commit_lsn     pg_lsn      NOT NULL,
    position       integer     NOT NULL,
    topic          text        NOT NULL,
    key            text        NOT NULL,
    event_id       text        NOT NULL,
    aggregate_type text,
    aggregate_id   text,
    type           text,
    payload        bytea,
    payload_bytea  boolean,
    headers        text,
    created_at     text,
    columns        text,
    reason         text        NOT NULL,
    error          text        NOT NULL,
    bytes          bigint      NOT NULL,
    first_attempt  timestamptz NOT NULL DEFAULT clock_timestamp(),
    last_attempt   timestamptz NOT NULL DEFAULT clock_timestamp(),
    attempts       integer     NOT NULL DEFAULT 1,
    PRIMARY KEY (slot, commit_lsn, position),
    FOREIGN KEY (slot, topic, key) REFERENCES outboxd_parked_sequences (slot, topic, key)
);
CREATE INDEX IF NOT EXISTS outboxd_parked_sequence ON outboxd_parked (slot, topic, key, commit_lsn, position);

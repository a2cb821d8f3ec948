-- Handback of a busy parked sequence (routing.on_poison = "park"): once
-- `outboxd parked redrive` has published every parked event the slot has
-- durably passed, it sets `handback` instead of waiting for the
-- aggregate's writers to pause. The relay then publishes the events left,
-- in order, ahead of the sequence's later events, deletes them once Kafka
-- acknowledged them (exactly-once: once their Kafka transaction committed)
-- and releases the sequence. A head that fails again clears the flag.
-- Apply in the outbox table's schema, after 0009.
ALTER TABLE IF EXISTS outboxd_parked_sequences
    ADD COLUMN IF NOT EXISTS handback boolean NOT NULL DEFAULT false;

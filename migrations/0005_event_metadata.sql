-- Event store (seed 004): each event keeps its metadata.
--
-- The headers an event was appended with (correlation id, trace context,
-- anything the application adds) were written only to its outbox row, and
-- outbox rows are deleted by retention. An audit of the event store needs
-- them next to the event, for as long as the event is kept. Events stored
-- before this migration get an empty object.
ALTER TABLE events ADD COLUMN IF NOT EXISTS metadata jsonb NOT NULL DEFAULT '{}'::jsonb;

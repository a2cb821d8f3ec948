-- The table-less outbox: outbox_emit() writes an event into the WAL as a
-- transactional logical decoding message (pg_logical_emit_message, prefix
-- 'outbox') instead of an outbox row. It commits or rolls back with the
-- caller's transaction, outboxd publishes it exactly like a row (same
-- routing, headers, envelope, dead letters and LSN rules), and nothing is
-- stored: no table bloat, no retention. Needs outboxd with
-- postgres.messages = true (the default) on PostgreSQL 14 or later.
--
-- The content is JSON, format version 1 (outboxd refuses other versions):
--   {"v": 1, "id": uuid, "aggregateType": text, "aggregateId": text,
--    "type": text, "payload": json, "headers": {…}, "createdAt": timestamptz}
--
-- SECURITY DEFINER: pg_logical_emit_message is for superusers unless
-- granted, and this function lets application roles emit outbox events
-- (and nothing else) through it. Its owner is whoever ran the migration,
-- who needs EXECUTE on pg_logical_emit_message(boolean, text, text).
CREATE OR REPLACE FUNCTION outbox_emit(
    aggregate_type text,
    aggregate_id   text,
    type           text,
    payload        jsonb,
    headers        jsonb DEFAULT '{}',
    id             uuid  DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql
VOLATILE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    event_id uuid := coalesce(id, gen_random_uuid());
BEGIN
    IF coalesce(aggregate_type, '') = '' OR coalesce(aggregate_id, '') = '' OR coalesce(type, '') = '' THEN
        RAISE EXCEPTION 'outbox_emit: aggregate_type, aggregate_id and type must not be empty'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF payload IS NULL THEN
        RAISE EXCEPTION 'outbox_emit: payload must not be NULL' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF headers IS NOT NULL AND jsonb_typeof(headers) <> 'object' THEN
        RAISE EXCEPTION 'outbox_emit: headers must be a JSON object, not %', jsonb_typeof(headers)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM pg_logical_emit_message(
        true,
        'outbox',
        jsonb_build_object(
            'v', 1,
            'id', event_id,
            'aggregateType', aggregate_type,
            'aggregateId', aggregate_id,
            'type', type,
            'payload', payload,
            'headers', coalesce(headers, '{}'),
            'createdAt', now()
        )::text
    );
    RETURN event_id;
END
$$;

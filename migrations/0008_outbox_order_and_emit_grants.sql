-- Two corrections of earlier migrations (which stay as they were applied).
--
-- 1. created_at is the time the row was inserted, not the time its
--    transaction began (now()). A writer that must wait for another one
--    (a row lock on the aggregate, a version check) inserts after that one
--    committed, so created_at order then follows the order in which each
--    aggregate's events were written. Polling mode publishes in created_at
--    order, and Kafka timestamps and the envelope's occurredAt carry it.
ALTER TABLE outbox ALTER COLUMN created_at SET DEFAULT clock_timestamp();

-- 2. Who may write a table-less outbox event. pg_logical_emit_message is
--    executable by PUBLIC (not only by superusers, as 0007 assumed), so
--    any role could call it with the prefix 'outbox' and have outboxd
--    publish what it wrote. Only outbox_emit (SECURITY DEFINER) should:
--    PUBLIC loses EXECUTE on every pg_logical_emit_message signature (the
--    flush argument of PostgreSQL 17 and later included), and the owner of
--    outbox_emit gets it. Privileges on pg_catalog functions are changed
--    by superusers only: applied by another role, this step only warns,
--    and outboxd with postgres.messages = true refuses to start, printing
--    the statements for a superuser to run.
--
--    On PostgreSQL 13 and older, pgoutput sends no logical decoding
--    messages, so an event written with outbox_emit could never reach
--    Kafka: the function is dropped there instead.
DO $grants$
DECLARE
    f regprocedure;
    emit_owner name := (
        SELECT r.rolname FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_roles r ON r.oid = p.proowner
         WHERE p.proname = 'outbox_emit' AND p.pronamespace = current_schema()::regnamespace
         LIMIT 1);
BEGIN
    IF current_setting('server_version_num')::int < 140000 THEN
        DROP FUNCTION IF EXISTS outbox_emit(text, text, text, jsonb, jsonb, uuid);
        RAISE NOTICE 'outbox_emit dropped: PostgreSQL before 14 sends no logical decoding messages to outboxd';
        RETURN;
    END IF;
    IF NOT (SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user) THEN
        RAISE WARNING 'pg_logical_emit_message stays executable by PUBLIC: only a superuser may revoke it. Until one does, any role could write an outbox event, and outboxd with postgres.messages = true refuses to start';
        RETURN;
    END IF;
    FOR f IN
        SELECT p.oid::regprocedure FROM pg_catalog.pg_proc p
         WHERE p.proname = 'pg_logical_emit_message' AND p.pronamespace = 'pg_catalog'::regnamespace
    LOOP
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
        IF emit_owner IS NOT NULL AND emit_owner <> current_user THEN
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %I', f, emit_owner);
        END IF;
    END LOOP;
END
$grants$;

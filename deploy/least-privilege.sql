-- A least-privilege setup for outboxd. Run once per database as an
-- administrator who owns the outbox table; then give outboxd the role's
-- password through ${PGPASSWORD} and set postgres.create_publication = false.
--
--   REPLICATION     lets the role create and stream from a logical slot
--   SELECT          on the outbox table, the only table outboxd reads
--   the publication is created here by the owner, not by outboxd
--
-- outboxd needs nothing else: no superuser, no CREATE, and no write access
-- unless routing.on_poison = "park" (below).
CREATE ROLE outboxd WITH LOGIN REPLICATION PASSWORD 'change-me';
GRANT USAGE ON SCHEMA public TO outboxd;
GRANT SELECT ON public.outbox TO outboxd;
-- Via the partition root: a partitioned outbox's rows arrive as the
-- outbox's (outboxd refuses a publication of a partitioned table without it).
CREATE PUBLICATION outboxd FOR TABLE public.outbox WITH (publish = 'insert', publish_via_partition_root = true);
--
-- The table-less outbox (outbox_emit, migrations 0007 and 0008): outboxd
-- reads its messages only while PUBLIC may not call pg_logical_emit_message.
-- Migration 0008 arranges that when a superuser applies it; otherwise run,
-- as a superuser, for every signature of pg_logical_emit_message
-- (PostgreSQL 17 and later have a fourth argument, flush):
--   REVOKE EXECUTE ON FUNCTION pg_logical_emit_message(boolean, text, text) FROM PUBLIC;
--   REVOKE EXECUTE ON FUNCTION pg_logical_emit_message(boolean, text, bytea) FROM PUBLIC;
--   GRANT EXECUTE ON FUNCTION pg_logical_emit_message(boolean, text, text) TO <owner of outbox_emit>;
-- and grant application roles EXECUTE on outbox_emit only.
--
-- routing.on_poison = "park" (migrations 0009 and 0010): outboxd writes the
-- events it parks, and `outboxd parked` redrives and deletes them. It writes
-- nothing else; the outbox stays read-only to it. Its per-sequence locks are
-- advisory locks, and a relay that takes the slot over ends a frozen
-- predecessor's parking connection (same role: no grant needed).
GRANT SELECT, INSERT, UPDATE, DELETE ON public.outboxd_parked, public.outboxd_parked_sequences TO outboxd;

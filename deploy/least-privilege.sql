-- A least-privilege setup for outboxd. Run once per database as an
-- administrator who owns the outbox table; then give outboxd the role's
-- password through ${PGPASSWORD} and set postgres.create_publication = false.
--
--   REPLICATION     lets the role create and stream from a logical slot
--   SELECT          on the outbox table, the only table outboxd reads
--   the publication is created here by the owner, not by outboxd
--
-- outboxd needs nothing else: no superuser, no CREATE, no write access.
CREATE ROLE outboxd WITH LOGIN REPLICATION PASSWORD 'change-me';
GRANT USAGE ON SCHEMA public TO outboxd;
GRANT SELECT ON public.outbox TO outboxd;
CREATE PUBLICATION outboxd FOR TABLE public.outbox WITH (publish = 'insert');

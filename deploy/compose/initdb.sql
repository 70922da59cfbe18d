-- Runs once, when the compose Postgres volume is first created (docker-entrypoint-initdb.d),
-- as the owner `hardcount` (POSTGRES_USER, a superuser in the postgres image).
--
-- Migration 0001 creates hardcount_app when it is missing, but without a password; a role
-- that logs in through PgBouncer with SCRAM needs one. Creating it here first, with the
-- same attributes, lets the migration skip the CREATE and only grant. The password is the
-- demo one from deploy/pgbouncer/userlist.txt.example.
CREATE ROLE hardcount_app LOGIN PASSWORD 'change-me-app'
    NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT;

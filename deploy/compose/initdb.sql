-- Runs once, when the compose Postgres volume is first created (docker-entrypoint-initdb.d),
-- as the owner `hardcount` (POSTGRES_USER, a superuser in the postgres image).
--
-- Migrations 0001 and 0012 create the login roles when they are missing, but without a
-- password; a role that logs in through PgBouncer with SCRAM needs one. Creating them here
-- first, with the same attributes, lets the migrations skip the CREATE and only grant. The
-- passwords are the demo ones from deploy/pgbouncer/userlist.txt.example.
--
--   hardcount_app       the replicas (DATABASE_URL): the role loops
--   hardcount_api       the HTTP API to come: what tenants write (endpoints, sealed secrets)
--   hardcount_operator  people (HARDCOUNT_OPERATOR_DATABASE_URL): `hardcount leader …`
CREATE ROLE hardcount_app LOGIN PASSWORD 'change-me-app'
    NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT;
CREATE ROLE hardcount_api LOGIN PASSWORD 'change-me-api'
    NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT;
CREATE ROLE hardcount_operator LOGIN PASSWORD 'change-me-operator'
    NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT;

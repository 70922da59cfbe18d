//! Integration tests for the access path, migrations and the leadership schema.
//! Run by `scripts/bed test`, once directly and once through PgBouncer (`tls`
//! starts a TLS-only server of its own).

mod access_path;
mod cancel;
mod definers;
mod grants;
mod migrations;
mod roles;
mod schema;
mod tls;

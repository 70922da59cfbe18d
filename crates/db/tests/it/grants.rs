//! Each login role's rights, read from the catalog after every migration and
//! held against the table in docs/security.md (issue 26, point 7;
//! docs/adr/0031), so the page cannot drift from the grants.
//!
//! `HARDCOUNT_WRITE_GRANTS=1 scripts/bed test -p db rights_table` rewrites the
//! table between the marker comments instead of failing.

use db::{Row, sql};
use testbed::TestDb;

const BEGIN: &str = "<!-- grants:begin -->";
const END: &str = "<!-- grants:end -->";

/// (role, object, rights): every right the role holds, granted to it or to
/// PUBLIC, on the database, schema `public`, its tables, views and sequences
/// (a column right only when the table-wide one is not held) and its
/// functions (trigger functions left out: no one can call them).
const RIGHTS: &str = "\
WITH roles(role, ro) AS (VALUES ('hardcount_app', 1), ('hardcount_api', 2), ('hardcount_operator', 3)),
privs(p, po) AS (VALUES ('SELECT', 1), ('INSERT', 2), ('UPDATE', 3), ('DELETE', 4), ('TRUNCATE', 5),
                        ('REFERENCES', 6), ('TRIGGER', 7)),
rel AS (SELECT c.oid, c.relname::text AS name,
               CASE c.relkind WHEN 'v' THEN 'view' WHEN 'm' THEN 'materialized view' ELSE 'table' END AS kind
        FROM pg_class c
        WHERE c.relnamespace = 'public'::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm')),
rights(role, ro, ko, object, po, r) AS (
    SELECT role, ro, 1, 'database', d.o, d.p
    FROM roles, unnest(ARRAY['CONNECT', 'TEMPORARY', 'CREATE']) WITH ORDINALITY AS d(p, o)
    WHERE has_database_privilege(role, current_database(), d.p)
    UNION ALL
    SELECT role, ro, 2, 'schema `public`', s.o, s.p
    FROM roles, unnest(ARRAY['USAGE', 'CREATE']) WITH ORDINALITY AS s(p, o)
    WHERE has_schema_privilege(role, 'public', s.p)
    UNION ALL
    SELECT role, ro, 3, rel.kind || ' `' || rel.name || '`', po, p
    FROM roles, rel, privs
    WHERE has_table_privilege(role, rel.oid, p)
    UNION ALL
    SELECT role, ro, 3, rel.kind || ' `' || rel.name || '`', po + 10,
           p || ' (' || string_agg(a.attname::text, ', ' ORDER BY a.attnum) || ')'
    FROM roles, rel, privs, pg_attribute a
    WHERE a.attrelid = rel.oid AND a.attnum > 0 AND NOT a.attisdropped
      AND p IN ('SELECT', 'INSERT', 'UPDATE', 'REFERENCES')
      AND has_column_privilege(role, rel.oid, a.attnum, p)
      AND NOT has_table_privilege(role, rel.oid, p)
    GROUP BY role, ro, rel.kind, rel.name, po, p
    UNION ALL
    SELECT role, ro, 4, 'sequence `' || c.relname || '`', q.o, q.p
    FROM roles, pg_class c, unnest(ARRAY['USAGE', 'SELECT', 'UPDATE']) WITH ORDINALITY AS q(p, o)
    WHERE c.relkind = 'S' AND c.relnamespace = 'public'::regnamespace
      AND has_sequence_privilege(role, c.oid, q.p)
    UNION ALL
    SELECT role, ro, 5, 'function `' || f.oid::regprocedure::text || '`', 1, 'EXECUTE'
    FROM roles, pg_proc f
    WHERE f.pronamespace = 'public'::regnamespace AND f.prorettype <> 'trigger'::regtype
      AND has_function_privilege(role, f.oid, 'EXECUTE')
)
SELECT role, object, string_agg(r, ', ' ORDER BY po) AS rights
FROM rights GROUP BY role, ro, ko, object ORDER BY ro, ko, object COLLATE \"C\"";

/// The markdown table the catalog gives, with a line for sequences when no
/// role holds a right on one.
async fn rendered(t: &TestDb) -> String {
    let rows = t.db.fetch_all(sql(RIGHTS)).await.unwrap();
    let mut out = String::from("| role | object | rights |\n|---|---|---|\n");
    for r in &rows {
        let (role, object, rights): (String, String, String) =
            (r.get("role"), r.get("object"), r.get("rights"));
        out.push_str(&format!("| `{role}` | {object} | {rights} |\n"));
    }
    if !rows
        .iter()
        .any(|r| r.get::<String, _>("object").starts_with("sequence "))
    {
        out.push_str(
            "\nNo role holds a right on a sequence: identity columns draw their values without one.\n",
        );
    }
    out
}

/// Issue 26, point 7. Fails when a migration changes a role's rights and the
/// table in docs/security.md was not regenerated, printing the new table.
/// Seen failing on the schema of migration 0022 (the table written after
/// 0023 lacks the column rights 0023 revokes) and with the markers present but
/// the block empty.
#[tokio::test]
async fn the_rights_table_in_security_md_is_the_catalogs() {
    let t = TestDb::new().await;
    let table = rendered(&t).await;
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/security.md");
    let page = std::fs::read_to_string(&path).unwrap();
    let (Some(begin), Some(end)) = (page.find(BEGIN), page.find(END)) else {
        panic!(
            "{} has no {BEGIN} … {END} block; add it where the table goes:\n{table}",
            path.display()
        );
    };
    let start = begin + BEGIN.len();
    let written = page[start..end].trim();
    if written == table.trim() {
        return;
    }
    if std::env::var_os("HARDCOUNT_WRITE_GRANTS").is_some_and(|v| v == "1") {
        let new = format!("{}\n{}\n{}", &page[..start], table.trim(), &page[end..]);
        std::fs::write(&path, new).unwrap();
        println!("rewrote the rights table in {}", path.display());
        return;
    }
    panic!(
        "the rights table in {} is not the catalog's; rerun with HARDCOUNT_WRITE_GRANTS=1 \
         or put this between the markers:\n{BEGIN}\n{}\n{END}",
        path.display(),
        table.trim()
    );
}

/// The three roles hold no right that lets them truncate or create anything,
/// and only the app deletes, and only the finished rows its retention prunes
/// (migration 0030), the idempotency keys past their life (migration 0048)
/// and the webhook handoffs whose deliveries are written (migration 0053),
/// whatever the table shows besides.
#[tokio::test]
async fn no_role_truncates_or_creates_and_only_the_app_prunes() {
    let t = TestDb::new().await;
    let table = rendered(&t).await;
    for needle in ["TRUNCATE", "CREATE", "TRIGGER", "REFERENCES"] {
        assert!(!table.contains(needle), "{needle} granted:\n{table}");
    }
    let deletes: Vec<&str> = table.lines().filter(|l| l.contains("DELETE")).collect();
    let prunable = [
        "table `api_idempotency_keys`",
        "table `email_outbox`",
        "table `webhook_deliveries`",
        "table `webhook_delivery_attempts`",
        "table `webhook_events`",
        "table `webhook_handoffs`",
    ];
    assert_eq!(deletes.len(), prunable.len(), "{table}");
    for line in deletes {
        assert!(
            line.contains("hardcount_app") && prunable.iter().any(|p| line.contains(p)),
            "DELETE granted beyond the prunes: {line}"
        );
    }
}

//! Claims that interleave tenants (issue 25, point 4; docs/adr/0048).
//!
//! A queue's claim index leads with `tenant_id`, and a claim statement walks
//! it in three steps, all in the one statement:
//!
//! ```text
//!  tenants  a loose scan of the claim index: the next tenants with work after
//!           the cursor, one index descent each, at most TENANTS_PER_CLAIM
//!  first    each of them takes up to limit / tenants of its due rows, in its
//!           own due order
//!  fill     what is left of the limit is shared between the tenants that took
//!           their whole share, after the last row each took
//! ```
//!
//! So a tenant with one due row waits one statement whatever another tenant
//! has queued, and a lone tenant still gets whole batches. The cursor makes
//! the walk a round robin when more tenants have work than one statement
//! visits: the next statement starts after the last tenant this one visited,
//! and from the first tenant again once a statement saw the end.
//!
//! [`fair_tenants!`](crate::fair_tenants) writes the `tenants` step; each
//! claim writes its own `first` and `fill`, since their order and predicates
//! are the queue's.

use std::sync::{Arc, Mutex};

use sqlx::Row;
use sqlx::postgres::PgRow;

/// At most this many tenants are visited by one claim statement: a loose
/// scan step is one descent of the claim index (a few µs), so 64 cost well
/// under a millisecond, and a tenant behind them waits one more statement.
pub const TENANTS_PER_CLAIM: i64 = 64;

/// The `tenants` and `share` steps of a fair claim, as SQL for a `WITH
/// RECURSIVE` list. `tenants`: the tenants of `$table`'s rows matching
/// `$pending` (the claim index's predicate) with `tenant_id` after the text
/// parameter `$after`, in `tenant_id` order, at most the integer parameter
/// `$max` of them (keep it at most the limit). Each step reads one entry of
/// the index, so the walk costs one descent per tenant whatever their
/// backlogs. `share`, one row: how many were visited (`tenants`), the last
/// (`last_tenant`, for the cursor) and each one's share of the integer
/// parameter `$limit` (`quota`, at least 1).
#[macro_export]
macro_rules! fair_tenants {
    ($table:literal, $pending:literal, $after:literal, $max:literal, $limit:literal) => {
        concat!(
            "tenants(tenant_id, n) AS ( \
               (SELECT tenant_id, 1 FROM ",
            $table,
            " \
                WHERE ",
            $pending,
            " AND tenant_id > ",
            $after,
            " \
                ORDER BY tenant_id LIMIT 1) \
               UNION ALL \
               SELECT nxt.tenant_id, t.n + 1 FROM tenants t, \
                 LATERAL (SELECT q.tenant_id FROM ",
            $table,
            " q \
                          WHERE q.",
            $pending,
            " AND q.tenant_id > t.tenant_id \
                          ORDER BY q.tenant_id LIMIT 1) nxt \
               WHERE t.n < ",
            $max,
            "), \
             share AS (SELECT count(*) AS tenants, max(tenant_id) AS last_tenant, \
                              greatest(1, ",
            $limit,
            " / greatest(1, count(*))) AS quota \
                       FROM tenants), "
        )
    };
}

/// Where the next fair claim of one queue starts among its tenants: after the
/// last tenant the previous claim visited, or at the first when that claim
/// saw the last tenant with work. Kept by the role in memory; a new leader
/// starts at the first tenant. Clones share one cursor.
#[derive(Debug, Clone, Default)]
pub struct TenantCursor(Arc<Mutex<String>>);

impl TenantCursor {
    /// The `tenant_id` the next claim starts after (`""`: the first).
    #[must_use]
    pub fn after(&self) -> String {
        self.0.lock().map(|c| c.clone()).unwrap_or_default()
    }

    /// Record what a claim saw: `visited` tenants of at most `bound`, the last
    /// `last`. A claim that visited fewer than its bound reached the end, so
    /// the next starts at the first again.
    pub fn advance(&self, visited: i64, bound: i64, last: Option<String>) {
        let next = match last {
            Some(last) if visited >= bound => last,
            _ => String::new(),
        };
        if let Ok(mut c) = self.0.lock() {
            *c = next;
        }
    }
}

impl TenantCursor {
    /// The rows of one fair claim statement that hold a claimed row, after
    /// recording what it visited. Such a statement answers at least its
    /// `share` row (`tenants`, `last_tenant`, a NULL `id` when it claimed
    /// nothing), so the cursor moves even when nothing was claimed.
    ///
    /// # Errors
    /// A `tenants` or `last_tenant` column that cannot be read.
    pub fn claimed(&self, mut rows: Vec<PgRow>, bound: i64) -> crate::Result<Vec<PgRow>> {
        if let Some(r) = rows.first() {
            self.advance(r.try_get("tenants")?, bound, r.try_get("last_tenant")?);
        }
        rows.retain(|r| matches!(r.try_get::<Option<i64>, _>("id"), Ok(Some(_))));
        Ok(rows)
    }
}

/// At most this many statements in one claim call's walk ([`Walk`]): with
/// the shipped limits a statement visits 64 tenants, so a call sees 512
/// before it gives up, and the next call goes on from the cursor.
pub const WALK_STATEMENTS: u8 = 8;

/// One claim call's walk over the tenants: it runs statements from the
/// cursor until one claims something (the caller stops asking), the walk has
/// started from the first tenant twice (every tenant was visited, and none
/// had work), or [`WALK_STATEMENTS`] ran. A statement that visits tenants
/// whose rows all wait (retries backing off, rows in flight) therefore does
/// not hide the tenants after them, and a claim with a small limit does not
/// walk every tenant in one call: the cursor keeps its place.
#[derive(Debug, Default)]
pub struct Walk {
    from_first: u8,
    statements: u8,
}

impl Walk {
    /// Where the next statement starts, or `None` when the walk is over.
    pub fn next(&mut self, cursor: &TenantCursor) -> Option<String> {
        if self.statements >= WALK_STATEMENTS {
            return None;
        }
        self.statements += 1;
        let after = cursor.after();
        if after.is_empty() {
            self.from_first += 1;
            if self.from_first > 1 {
                return None;
            }
        }
        Some(after)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cursor_moves_on_only_after_a_full_walk() {
        let c = TenantCursor::default();
        assert_eq!(c.after(), "");
        c.advance(TENANTS_PER_CLAIM, TENANTS_PER_CLAIM, Some("t064".into()));
        assert_eq!(c.after(), "t064");
        c.clone().advance(3, TENANTS_PER_CLAIM, Some("t067".into()));
        assert_eq!(c.after(), "", "a walk that saw the end starts over");
        c.advance(10, 10, Some("t010".into()));
        assert_eq!(c.after(), "t010", "a claim's bound may be its limit");
    }

    #[test]
    fn a_walk_ends_once_it_has_started_from_the_first_tenant_twice() {
        let c = TenantCursor::default();
        c.advance(2, 2, Some("b".into()));
        let mut w = Walk::default();
        assert_eq!(w.next(&c).as_deref(), Some("b"));
        c.advance(1, 2, Some("c".into()));
        assert_eq!(w.next(&c).as_deref(), Some(""));
        c.advance(2, 2, Some("b".into()));
        assert_eq!(w.next(&c).as_deref(), Some("b"));
        c.advance(1, 2, Some("c".into()));
        assert_eq!(w.next(&c), None);
    }

    #[test]
    fn a_walk_runs_at_most_walk_statements() {
        let c = TenantCursor::default();
        let mut w = Walk::default();
        let mut n = 0;
        while w.next(&c).is_some() {
            n += 1;
            c.advance(1, 1, Some(format!("t{n:03}")));
        }
        assert_eq!(n, usize::from(WALK_STATEMENTS));
        assert_eq!(c.after(), "t008", "the next call goes on from here");
    }
}

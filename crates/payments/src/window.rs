//! A tenant's business window as SQL text, one rule for both roles that
//! read it: dunning's funnel lists no run of a tenant whose window is closed
//! (docs/adr/0045), and billing's reconciler sends no never-sent retry of
//! one (docs/adr/0147).

/// Whether the business window of the policy row `w` is open at the local
/// time `l.t` (a `timestamp`: the instant `AT TIME ZONE w.window_time_zone`),
/// migration 0035's rule: open from `window_opens` (inclusive) to
/// `window_closes` (exclusive) on a weekday of `window_weekdays`; a window
/// closing before it opens runs past midnight and belongs to the weekday it
/// opened on (so after midnight the day before is the one that counts).
/// NULL when the row has no window.
#[macro_export]
macro_rules! window_open {
    () => {
        "CASE WHEN w.window_opens < w.window_closes \
              THEN l.t::time >= w.window_opens AND l.t::time < w.window_closes \
                   AND extract(isodow FROM l.t)::integer = ANY (w.window_weekdays) \
              ELSE (l.t::time >= w.window_opens \
                    AND extract(isodow FROM l.t)::integer = ANY (w.window_weekdays)) \
                OR (l.t::time < w.window_closes \
                    AND extract(isodow FROM l.t - interval '1 day')::integer = ANY (w.window_weekdays)) \
         END"
    };
}

/// The tenants whose default policy's business window is closed now: their
/// runs wait (docs/adr/0045), and billing's reconciler sends none of their
/// never-sent retries (docs/adr/0147).
#[macro_export]
macro_rules! window_closed_tenants {
    () => {
        concat!(
            "SELECT w.tenant_id FROM dunning_policies w \
             CROSS JOIN LATERAL (SELECT now() AT TIME ZONE w.window_time_zone AS t) l \
             WHERE w.is_default AND w.window_time_zone IS NOT NULL \
               AND (",
            $crate::window_open!(),
            ") IS NOT TRUE"
        )
    };
}

//! What the lease history must show: no two terms of one role overlap.
//!
//! A term spans its claim (`acquired_at`) to the first of its release and
//! its expiry (`min(released_at, last renewal + TTL)`, which the history
//! keeps as `expires_at`). ACQUIRE takes a row only once the previous term
//! was released or had expired on the same clock, so on a sound history the
//! spans of one role follow one another. [`overlapping_terms`] is the check
//! the failure tests run on what [`crate::store::history`] read back.

use std::collections::BTreeMap;

use crate::store::Term;

/// Two terms of one role whose spans overlap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Overlap {
    pub role: String,
    /// The term that began first, and the one that began while it still held.
    pub earlier_token: i64,
    pub later_token: i64,
    /// How long both held, in microseconds of the database clock.
    pub overlap_us: i64,
}

/// Every pair of terms of one role whose spans overlap: for each term, the
/// earlier term (by `acquired_at`) whose span reaches furthest past its
/// start, if it reaches past it. Empty for a sound history. A span that
/// ends exactly where the next begins is not an overlap.
pub fn overlapping_terms(terms: &[Term]) -> Vec<Overlap> {
    let mut by_role: BTreeMap<&str, Vec<&Term>> = BTreeMap::new();
    for t in terms {
        by_role.entry(&t.role).or_default().push(t);
    }
    let mut found = Vec::new();
    for (role, mut terms) in by_role {
        terms.sort_by_key(|t| (t.acquired_epoch_us, t.token));
        // The earlier term whose span ends last.
        let mut furthest: Option<&Term> = None;
        for t in terms {
            if let Some(prev) = furthest
                && prev.ended_epoch_us > t.acquired_epoch_us
            {
                found.push(Overlap {
                    role: role.to_owned(),
                    earlier_token: prev.token,
                    later_token: t.token,
                    overlap_us: prev.ended_epoch_us.min(t.ended_epoch_us) - t.acquired_epoch_us,
                });
            }
            if furthest.is_none_or(|p| t.ended_epoch_us > p.ended_epoch_us) {
                furthest = Some(t);
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn term(role: &str, token: i64, from: i64, to: i64) -> Term {
        Term {
            role: role.into(),
            token,
            holder_id: format!("h{token}"),
            acquired_at: String::new(),
            last_renewed_at: None,
            expires_at: String::new(),
            released_at: None,
            tick_end: None,
            state: "expired".into(),
            acquired_epoch_us: from,
            ended_epoch_us: to,
        }
    }

    #[test]
    fn terms_that_follow_one_another_do_not_overlap() {
        let terms = [
            term("billing", 1, 0, 10),
            term("billing", 2, 10, 20),
            term("billing", 3, 25, 30),
            // Another role may hold at the same time.
            term("dunning", 1, 5, 15),
        ];
        assert_eq!(overlapping_terms(&terms), []);
    }

    #[test]
    fn a_term_begun_before_the_previous_ended_is_an_overlap() {
        let terms = [
            term("billing", 1, 0, 100),
            term("billing", 2, 10, 20),
            // Still inside the first term, after the second ended.
            term("billing", 3, 50, 150),
            term("billing", 4, 150, 160),
        ];
        let found = overlapping_terms(&terms);
        assert_eq!(
            found,
            [
                Overlap {
                    role: "billing".into(),
                    earlier_token: 1,
                    later_token: 2,
                    overlap_us: 10
                },
                Overlap {
                    role: "billing".into(),
                    earlier_token: 1,
                    later_token: 3,
                    overlap_us: 50
                },
            ]
        );
    }
}

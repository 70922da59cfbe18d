//! All of webhook delivery's SQL, a file per step that runs it:
//!
//! ```text
//! claim.rs      the fenced claim of due deliveries, and the idle probe
//! outcomes.rs   the outcome writes (one statement per group of outcomes, each row a
//!               compare-and-set on the attempt number), handing back unsent claims
//! backlog.rs    the gauges read at the end of a tick
//! prune.rs      the retention prune of finished deliveries and their attempts
//! unwritten.rs  deliveries handed over unwritten: inserted with their first outcome,
//!               and the fan-out's handoffs deleted once written (docs/adr/0124)
//! endpoints.rs  registering an endpoint, rotating and resealing its secrets, and
//!               turning off the endpoints that kept failing
//! ```

mod backlog;
mod claim;
mod endpoints;
mod outcomes;
mod prune;
mod unwritten;

pub(crate) use backlog::backlog;
pub use claim::CLAIM_DUE;
pub(crate) use claim::{ClaimedRow, any_due, claim_due};
pub use endpoints::DISABLE_FAILING;
pub(crate) use endpoints::{
    disable_failing, insert_endpoint, rotate_secret, secrets_census, secrets_to_reseal,
    store_resealed,
};
pub use outcomes::APPLY_OUTCOMES;
pub(crate) use outcomes::{
    Gone, HoldRow, NextState, Observed, OutcomeRow, hold_unsent, record_outcome, record_outcomes,
    release_unsent,
};
pub use prune::PRUNE_FINISHED;
pub(crate) use prune::prune_finished;
pub use unwritten::{INSERT_OUTCOMES, INSERT_OUTCOMES_TOLERANT};
pub(crate) use unwritten::{NewRow, Pair, delete_handoffs};

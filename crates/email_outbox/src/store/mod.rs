//! All of the email outbox's SQL, a file per step that runs it:
//!
//! ```text
//! claim.rs      the fenced claim of due emails
//! results.rs    the result writes (one statement per group, each row a compare-and-set
//!               on its attempt), handing back unsent claims
//! backlog.rs    the gauges
//! columns.rs    what the results write: the `queued` status, the reply text
//! prune.rs      the retention prune of sent and failed emails
//! ```

mod backlog;
mod claim;
mod columns;
mod prune;
mod results;

pub(crate) use backlog::backlog;
pub use claim::CLAIM_DUE;
pub(crate) use claim::claim_due;
pub use prune::PRUNE_FINISHED;
pub(crate) use prune::prune_finished;
pub use results::RECORD_RESULTS;
pub(crate) use results::{ResultRow, hand_back, record_results};

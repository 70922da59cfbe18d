//! Role loops, the panic guard and the leader metrics.
//!
//! One loop per role per replica ([`run_role`]); each polls ACQUIRE, runs the
//! role's work under [`leader::Manager::lead`] when it wins, and sleeps until
//! the row says the role could next be claimed (capped at the max poll). Loops
//! are independent: a slow billing tick never delays email.
//!
//! Panics stop a step, not a tick, and never a loop ([`Panics`],
//! docs/design.md §5): a step or batch item that panics is logged once with
//! its stack, the rest run, and the first panic is raised again at the end of
//! the tick so the lease is released as panicked.
//!
//! Roles that drain a queue in fenced batches share one loop ([`drive`]):
//! each implements [`FencedBatches`] (its claim and how to run a batch) and
//! the driver stops on a short batch, the budget or a cancel and says how the
//! tick ended.
//!
//! Wake-ups ([`Wake`], [`listen`], docs/adr/0014): a role given a listening
//! wake keeps its tick open after a short batch and claims again on a
//! notification from its producers (or its interval); a role that says it is
//! busy ([`FencedBatches::due_again_after_work`]) claims again every
//! [`BUSY_POLL`] while claims find work, and a tick that found work is due
//! again at once. Without a listener, a role that probes
//! ([`FencedBatches::idle_probe`], docs/adr/0019) keeps its drained tick open
//! until its budget too, asking every [`IDLE_PROBE`] with one cheap read
//! whether work is waiting, so an event waits about a probe, not an interval.
//!
//! A role whose tick is several queues lists them as steps on a [`Steps`]:
//! each is driven until the tick's one deadline ([`drive_until`]), their ends
//! merged worst-first, the first panic raised after the last step; a step's
//! rows left out for the rest of the tick are a [`LeftOut`].
//!
//! A hand-over ([`Relay`], docs/adr/0087): a role may claim rows for another
//! role of the same process while that one leads here, proving its fence, and
//! hand them over through that role's [`Wake`].
//!
//! Retention ([`Pruning`], [`Prunes`], docs/adr/0040): a role that prunes
//! holds back a slice of a tick's budget, at most once every [`PRUNE_EVERY`],
//! and deletes what it finished once old, a fenced batch per statement.
//!
//! Backlog reads (docs/adr/0138): a role that ticks every second ends a tick
//! with its backlog gauges' read at most once every [`BACKLOG_READ_EVERY`],
//! as an [`Every`] says, the gate of the other work done at most once per an
//! interval.
//!
//! This crate knows roles and intervals, not invoices.

mod config;
mod driver;
mod every;
mod idle;
mod in_flight;
mod panics;
mod relay;
mod retention;
mod role_loop;
mod source;
mod status;
mod steps;
mod wake;

pub use config::{ConfigError, RoleConfig, default_interval, roles_from_env};
pub use driver::{drive, drive_until, drive_until_kept};
pub use every::{BACKLOG_READ_EVERY, Every};
pub use in_flight::InFlight;
pub use leader::TickEnd;
pub use panics::{Panics, Payload, catch, install_panic_hook, panic_message};
pub use relay::{Offer, Relay};
pub use retention::{
    DEFAULT_RETENTION, LeaseHistory, MAX_SLICE, PRUNE_BATCH, PRUNE_EVERY, Prune, PrunePlan, Pruned,
    Prunes, Pruning, Retention, run_prune_statement,
};
pub use role_loop::{RoleSpec, Work, run_role, run_role_on, work};
pub use source::{BUSY_POLL, Driven, FencedBatches, IDLE_PROBE, PROBE_BACKOFF, Shape, Stop};
pub use status::{export_status, mark_status_unknown, precreate_series};
pub use steps::{LeftOut, Steps, worst};
pub use wake::{Wake, listen, wake_channel};

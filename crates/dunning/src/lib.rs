//! The `dunning` role: retry runs for unpaid invoices and their final actions.
//!
//! Not built yet: its issue comes after billing. This crate holds no code so that
//! nothing here pretends to work.

//! The `billing` role: due billing, trials, pause-collection resumes, auto-charge and
//! the payment reconciler (`../../../shared/DESIGN.md`, "The five roles").
//!
//! Not built yet: its issue comes after the webhook slice. This crate holds no code so
//! that nothing here pretends to work.

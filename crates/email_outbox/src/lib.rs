//! The `email_outbox` role: queued emails sent over SMTP with lettre, marked by CAS.
//!
//! Not built yet: its issue follows the webhook slice. The test bed can already start
//! an SMTP sink (`testbed::SmtpSink`). This crate holds no code so that nothing here
//! pretends to work.

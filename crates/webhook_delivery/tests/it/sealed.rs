//! Webhook signing secrets sealed at rest (issue 12, point 2).

//! Metrics through an explicit recorder rather than a process-global one, so
//! each test (and each in-process replica) reads only its own series.

use std::sync::Arc;

use metrics::{Counter, Gauge, Histogram, Key, Label, Level, Metadata, Recorder};

/// A cheap handle to the recorder every crate of this service reports to.
#[derive(Clone)]
pub struct Telemetry {
    recorder: Arc<dyn Recorder + Send + Sync>,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Telemetry")
    }
}

const METADATA: Metadata<'static> = Metadata::new("hardcount", Level::INFO, None);

impl Telemetry {
    pub fn new(recorder: Arc<dyn Recorder + Send + Sync>) -> Telemetry {
        Telemetry { recorder }
    }

    /// Reports nowhere.
    pub fn noop() -> Telemetry {
        Telemetry::new(Arc::new(metrics::NoopRecorder))
    }

    pub fn counter(&self, name: &'static str, labels: &[(&'static str, &str)]) -> Counter {
        self.recorder
            .register_counter(&key(name, labels), &METADATA)
    }

    pub fn gauge(&self, name: &'static str, labels: &[(&'static str, &str)]) -> Gauge {
        self.recorder.register_gauge(&key(name, labels), &METADATA)
    }

    pub fn histogram(&self, name: &'static str, labels: &[(&'static str, &str)]) -> Histogram {
        self.recorder
            .register_histogram(&key(name, labels), &METADATA)
    }

    /// Record that this replica has just read `role`'s backlog gauges, at
    /// `at` (epoch seconds on the database clock, the read's own `now()`):
    /// `hardcount_backlog_read_timestamp_seconds{role}`. Only the leader of a
    /// tick reads them, so the rules take each gauge from the replica whose
    /// read is the newest rather than the `max()` across replicas, which kept
    /// a stale value of a replica that stopped leading (docs/adr/0137). Call
    /// it after the gauges are set, and only when the read succeeded.
    pub fn backlog_read(&self, role: crate::Role, at: f64) {
        self.gauge(
            "hardcount_backlog_read_timestamp_seconds",
            &[("role", role.as_str())],
        )
        .set(at);
    }

    /// Count a failed read of `role`'s backlog gauges
    /// (`hardcount_backlog_read_errors_total{role}`): the gauges keep their
    /// last values, and `HardcountBacklogUnread` warns when reads fail and
    /// none has succeeded for two hours (docs/adr/0137).
    pub fn backlog_read_failed(&self, role: crate::Role) {
        self.backlog_read_errors(role).increment(1);
    }

    /// `hardcount_backlog_read_errors_total{role}` at 0, created at a start
    /// (`scheduler::precreate_series`): a series born at 1 shows no
    /// `increase()`, so a replica's first failed read would raise nothing.
    pub fn precreate_backlog_read_errors(&self, role: crate::Role) {
        self.backlog_read_errors(role).increment(0);
    }

    fn backlog_read_errors(&self, role: crate::Role) -> Counter {
        self.counter(
            "hardcount_backlog_read_errors_total",
            &[("role", role.as_str())],
        )
    }
}

fn key(name: &'static str, labels: &[(&'static str, &str)]) -> Key {
    let labels: Vec<Label> = labels
        .iter()
        .map(|(k, v)| Label::new(*k, v.to_string()))
        .collect();
    Key::from_parts(name, labels)
}

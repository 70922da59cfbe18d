//! Logs and traces (docs/adr/0039).
//!
//! One subscriber for the process: `RUST_LOG`'s filter, then the log lines on
//! stderr (text, or JSON with `HARDCOUNT_LOG_FORMAT=json`, each line carrying
//! the fields of the spans it is in: the leader crate's `tick` span gives every
//! line of a tick its role, token and tick id), and, only when
//! `OTEL_EXPORTER_OTLP_ENDPOINT` is set, the same spans and their events
//! exported as traces over OTLP/HTTP (protobuf) by a batch processor on a
//! thread of its own.

use anyhow::{Result, bail};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig as _};
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

use crate::Cli;
use crate::secret::Secret;

/// What [`init`] set up that must be flushed before the process exits.
#[must_use = "call shutdown before exiting, or the last spans are lost"]
pub struct Telemetry {
    traces: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Whether spans are exported (an OTLP endpoint was configured).
    pub fn exports_traces(&self) -> bool {
        self.traces.is_some()
    }

    /// Export what is still queued (bounded by the exporter's timeout) and stop
    /// the exporter's thread. Call it outside the async runtime.
    pub fn shutdown(self) {
        if let Some(provider) = self.traces
            && let Err(e) = provider.shutdown()
        {
            eprintln!("OpenTelemetry: the last spans may not have been exported: {e}");
        }
    }
}

/// How long one export may take before it is given up (and its spans dropped).
const EXPORT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// The tracing subscriber for `RUST_LOG` (`info` when unset or invalid), on
/// stderr, plus the OTLP exporter when `OTEL_EXPORTER_OTLP_ENDPOINT` is set.
///
/// # Errors
/// `HARDCOUNT_LOG_FORMAT` is neither `text` nor `json`, or
/// `OTEL_EXPORTER_OTLP_ENDPOINT` is not an `http://` or `https://` URL (each
/// named; nothing is logged yet).
pub fn init(cli: &Cli) -> Result<Telemetry> {
    let common = &cli.common;
    // An empty RUST_LOG is unset (README), not a filter with no rules, which
    // turned every line off (docs/adr/0101).
    let wanted = match common.rust_log.trim() {
        "" => "info",
        set => set,
    };
    let filter = tracing_subscriber::EnvFilter::try_new(wanted).unwrap_or_else(|e| {
        eprintln!("RUST_LOG={:?}: {e}; logging at info", common.rust_log);
        "info".into()
    });
    // Colours only on a terminal: a file, a pipe or a container's log keeps
    // plain text that grep and a log pipeline read as written.
    let lines = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    let lines = match common.log_format.trim() {
        "text" | "" => lines.boxed(),
        // The current span's fields and the list of every span the line is in,
        // so a tick's lines carry role, token and tick whatever logged them.
        "json" => lines
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(true)
            .boxed(),
        other => bail!("HARDCOUNT_LOG_FORMAT is {other:?}; expected text or json"),
    };
    // The OTLP exporter's own debug lines carry the endpoint's URL, and with
    // it any credentials in it (docs/adr/0101): never on stderr.
    let lines = lines.with_filter(tracing_subscriber::filter::filter_fn(|meta| {
        !(meta.target().starts_with("opentelemetry") && *meta.level() > tracing::Level::INFO)
    }));
    let traces = match Secret::set(&common.otlp_endpoint) {
        Some(base) => Some(tracer_provider(&traces_url(base)?)?),
        None => None,
    };
    let export = traces.as_ref().map(|provider| {
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer("hardcount"))
            // Never the exporter's own work (its HTTP client's spans would be
            // exported, and export more), nor the HTTP stacks' internals.
            .with_filter(tracing_subscriber::filter::filter_fn(|meta| {
                !["opentelemetry", "hyper", "reqwest", "h2", "tower", "rustls"]
                    .iter()
                    .any(|t| meta.target().starts_with(t))
            }))
    });
    tracing_subscriber::registry()
        .with(filter)
        .with(lines)
        .with(export)
        .try_init()?;
    if traces.is_some() {
        tracing::info!(
            "exporting traces over OTLP/HTTP to OTEL_EXPORTER_OTLP_ENDPOINT (the tick spans)"
        );
    }
    Ok(Telemetry { traces })
}

/// `<base>/v1/traces`, as the OpenTelemetry specification derives the traces
/// URL from `OTEL_EXPORTER_OTLP_ENDPOINT`.
fn traces_url(base: &str) -> Result<String> {
    let base = base.trim();
    let Some((scheme, rest)) = base.split_once("://") else {
        bail!("OTEL_EXPORTER_OTLP_ENDPOINT is not a URL; expected http://HOST:PORT (OTLP/HTTP)");
    };
    if !matches!(scheme, "http" | "https") || rest.is_empty() || rest.starts_with('/') {
        bail!(
            "OTEL_EXPORTER_OTLP_ENDPOINT has the scheme {scheme:?} or no host; expected \
             http://HOST:PORT or https://HOST:PORT (OTLP/HTTP; gRPC is not built in)"
        );
    }
    Ok(format!("{}/v1/traces", base.trim_end_matches('/')))
}

fn tracer_provider(url: &str) -> Result<SdkTracerProvider> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(url)
        .with_timeout(EXPORT_TIMEOUT)
        .build()
        // The error names the endpoint it was given; that may carry a token.
        .map_err(|_| {
            anyhow::anyhow!("OTEL_EXPORTER_OTLP_ENDPOINT: cannot build the OTLP exporter for it")
        })?;
    let resource = opentelemetry_sdk::Resource::builder_empty()
        .with_service_name("hardcount")
        .with_attribute(opentelemetry::KeyValue::new(
            "service.version",
            env!("CARGO_PKG_VERSION"),
        ))
        .build();
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource)
        .build())
}

#[cfg(test)]
mod tests {
    use super::traces_url;

    #[test]
    fn the_traces_url_is_the_endpoint_and_v1_traces() {
        assert_eq!(
            traces_url("http://127.0.0.1:4318").unwrap(),
            "http://127.0.0.1:4318/v1/traces"
        );
        assert_eq!(
            traces_url(" https://otel.example.com/base/ ").unwrap(),
            "https://otel.example.com/base/v1/traces"
        );
        for bad in ["127.0.0.1:4318", "grpc://x:4317", "http://", "http:///v1"] {
            let e = traces_url(bad).unwrap_err().to_string();
            assert!(e.starts_with("OTEL_EXPORTER_OTLP_ENDPOINT"), "{bad}: {e}");
        }
    }
}

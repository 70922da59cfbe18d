//! The tenant API as `hardcount serve` serves it (issue 24), on its own
//! bound listener, through the current leg: keys made with the real CLI,
//! every answer in the one error shape, idempotent POSTs, cursor pages, the
//! rate limit, the tenant boundary over every route of the OpenAPI document,
//! each answer checked against the schema the document declares for it, and
//! no secret in the log of the run.
//!
//! Here the bed the tests share (a replica serving the API, keys from the
//! CLI, one call helper); the tests, by what they cover, in the modules
//! below.

mod auth;
mod events;
mod refusals;
mod sweep;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::Value;
use testbed::{Leg, TestDb};

use crate::hardcount;
use crate::serve::Serve;

/// A replica serving the tenant API (and the webhook roles) on a fresh
/// database, with its log kept.
pub struct ApiBed {
    pub t: TestDb,
    pub _serve: Serve,
    pub port: u16,
    pub http: reqwest::Client,
    pub log: PathBuf,
}

/// One answer: status, headers, body as text and (when it parses) JSON.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub text: String,
    pub json: Value,
}

impl Answer {
    /// The error's `(code, param)`.
    pub fn error(&self) -> (String, Option<String>) {
        let e = &self.json["error"];
        (
            e["code"].as_str().unwrap_or_default().to_owned(),
            e["param"].as_str().map(str::to_owned),
        )
    }
}

impl ApiBed {
    pub async fn start(extra: &[(&str, &str)]) -> ApiBed {
        ApiBed::start_on(TestDb::new().await, extra).await
    }

    /// [`ApiBed::start`] on a database the caller made (to seed its URLs).
    pub async fn start_on(t: TestDb, extra: &[(&str, &str)]) -> ApiBed {
        let leg = Leg::current();
        let port = testbed::free_port();
        let addr = format!("127.0.0.1:{port}");
        let api_url = t.role_url("hardcount_api", leg);
        let log = std::env::temp_dir().join(format!("{}-serve.log", t.name()));
        let mut env = vec![
            ("HARDCOUNT_API_ADDR", addr.as_str()),
            ("HARDCOUNT_API_DATABASE_URL", api_url.as_str()),
        ];
        if !extra.iter().any(|(k, _)| *k == "HARDCOUNT_ROLES") {
            env.push(("HARDCOUNT_ROLES", "webhook_outbox,webhook_delivery"));
        }
        env.extend_from_slice(extra);
        let serve = Serve::start_logged(&t.app_url(leg), &env, Some(&log)).await;
        let bed = ApiBed {
            t,
            _serve: serve,
            port,
            http: reqwest::Client::new(),
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while bed.http.get(bed.url("/openapi.json")).send().await.is_err() {
            assert!(Instant::now() < deadline, "the tenant API did not listen");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bed
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// `hardcount ARGS` as the operator; its stdout. Panics on failure.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = self.cli_output(args);
        assert!(out.status.success(), "{}", crate::text(&out));
        String::from_utf8(out.stdout).unwrap()
    }

    pub fn cli_output(&self, args: &[&str]) -> std::process::Output {
        self.cli_output_with(args, &[])
    }

    /// [`Self::cli_output`] with `env` set as well.
    pub fn cli_output_with(&self, args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
        hardcount()
            .args(args)
            .envs(env.iter().copied())
            .env(
                "HARDCOUNT_OPERATOR_DATABASE_URL",
                self.t.operator_url(Leg::current()),
            )
            .output()
            .unwrap()
    }

    /// A tenant made with `hardcount tenants create` and its key from
    /// `hardcount keys create`.
    pub fn tenant(&self, id: &str) -> String {
        self.cli(&[
            "tenants",
            "create",
            id,
            "--contact-email",
            "ops@example.org",
        ]);
        let key = self.cli(&["keys", "create", id, "--name", "tests"]);
        key.trim().to_owned()
    }

    pub async fn call(
        &self,
        method: Method,
        path: &str,
        key: Option<&str>,
        body: Option<&str>,
        headers: &[(&str, &str)],
    ) -> Answer {
        let mut r = self.http.request(method, self.url(path));
        if let Some(key) = key {
            r = r.header("authorization", format!("Bearer {key}"));
        }
        if let Some(body) = body {
            r = r
                .header("content-type", "application/json")
                .body(body.to_owned());
        }
        for (k, v) in headers {
            r = r.header(*k, *v);
        }
        let resp = r.send().await.unwrap();
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let text = resp.text().await.unwrap();
        let json = serde_json::from_str(&text).unwrap_or(Value::Null);
        Answer {
            status,
            headers,
            text,
            json,
        }
    }

    pub async fn get(&self, path: &str, key: &str) -> Answer {
        self.call(Method::GET, path, Some(key), None, &[]).await
    }

    pub async fn post(&self, path: &str, key: &str, body: &Value) -> Answer {
        self.call(Method::POST, path, Some(key), Some(&body.to_string()), &[])
            .await
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

//! The tenant API end to end: the real router on a port, called over HTTP,
//! against a fresh database per test (directly and through PgBouncer).

mod billing;
mod dunning;
mod events;
mod hooks;
mod openapi;
mod operator;

use api::{Api, ApiConfig};
use reqwest::StatusCode;
use serde_json::Value;
use testbed::TestDb;

/// The API served on 127.0.0.1:0 over `t`'s API role.
#[derive(Clone)]
pub struct Served {
    pub base: String,
    pub client: reqwest::Client,
}

/// Serve the API with the test bed's secrets key.
pub async fn serve(t: &TestDb) -> Served {
    let keyring = webhook_delivery::Keyring::parse(testbed::SECRETS_KEY).unwrap();
    serve_api(Api::new(t.api(), Some(keyring), config())).await
}

/// The defaults, with loopback allowed for webhooks, as the tests' receivers
/// listen there (the delivery roles of these tests allow it too).
pub fn config() -> ApiConfig {
    ApiConfig {
        webhook_allowlist: webhook_delivery::ssrf::Allowlist::parse("127.0.0.0/8").unwrap(),
        ..ApiConfig::default()
    }
}

pub async fn serve_api(api: Api) -> Served {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, api::router(api)).await.unwrap();
    });
    Served {
        base: format!("http://{addr}"),
        client: reqwest::Client::new(),
    }
}

/// A tenant and one of its API keys.
pub async fn tenant(t: &TestDb, id: &str) -> String {
    let operator = t.operator();
    api::keys::create_tenant(&operator, id, id, None)
        .await
        .unwrap();
    api::keys::create_key(&operator, id, "test")
        .await
        .unwrap()
        .key
}

/// One answer: its status, its body as JSON (Null when empty) and as text,
/// and whether it was replayed from an idempotency key.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub json: Value,
    pub text: String,
    pub replayed: bool,
}

impl Answer {
    /// The `param` of an error answer.
    pub fn param(&self) -> &str {
        self.json["error"]["param"].as_str().unwrap_or("")
    }

    pub fn code(&self) -> &str {
        self.json["error"]["code"].as_str().unwrap_or("")
    }

    /// The refusal's `(code, param)`; no `param`: `None`.
    pub fn refusal(&self) -> (String, Option<String>) {
        let e = &self.json["error"];
        (
            e["code"].as_str().unwrap_or("").to_owned(),
            e["param"].as_str().map(str::to_owned),
        )
    }
}

impl Served {
    /// `method path` with `key`, a JSON `body` (POST) and an idempotency key;
    /// `method` as text (`"GET"`) or a `reqwest::Method`.
    pub async fn call(
        &self,
        method: impl AsRef<str>,
        path: &str,
        key: &str,
        body: Option<&Value>,
        idem: Option<&str>,
    ) -> Answer {
        let method = reqwest::Method::from_bytes(method.as_ref().as_bytes()).unwrap();
        let mut req = self
            .client
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(key);
        if let Some(body) = body {
            req = req
                .header("content-type", "application/json")
                .body(body.to_string());
        }
        if let Some(idem) = idem {
            req = req.header("idempotency-key", idem);
        }
        let response = req.send().await.unwrap();
        let status = response.status();
        let replayed = response.headers().contains_key("idempotent-replayed");
        let text = response.text().await.unwrap();
        let json = serde_json::from_str(&text).unwrap_or(Value::Null);
        Answer {
            status,
            json,
            text,
            replayed,
        }
    }

    pub async fn get(&self, path: &str, key: &str) -> Answer {
        self.call("GET", path, key, None, None).await
    }

    pub async fn post(&self, path: &str, key: &str, body: Value) -> Answer {
        self.call("POST", path, key, Some(&body), None).await
    }
}

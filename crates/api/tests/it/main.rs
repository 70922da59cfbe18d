//! The tenant API end to end: the real router on a port, called over HTTP,
//! against a fresh database per test (directly and through PgBouncer).

mod billing;

/// Serving the API and calling it: shared by every test file.
pub mod support {
    use api::{Api, ApiConfig};
    use reqwest::Method;
    use serde_json::Value;
    use testbed::TestDb;

    /// The API served on 127.0.0.1:0 over `t`'s API-role pool.
    pub struct Served {
        pub base: String,
        pub http: reqwest::Client,
    }

    pub async fn serve(t: &TestDb) -> Served {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = api::router(Api::new(t.api(), None, ApiConfig::default()));
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Served {
            base: format!("http://{addr}"),
            http: reqwest::Client::new(),
        }
    }

    /// A new tenant and a key of it.
    pub async fn tenant(t: &TestDb, id: &str) -> String {
        let op = t.operator();
        api::keys::create_tenant(&op, id, id, None).await.unwrap();
        api::keys::create_key(&op, id, "test").await.unwrap().key
    }

    /// An answer: its status, its JSON body, and whether it was replayed.
    #[derive(Debug)]
    pub struct Answer {
        pub status: u16,
        pub body: Value,
        pub text: String,
        pub replayed: bool,
    }

    impl Answer {
        /// The refusal's `(code, param)`.
        pub fn refusal(&self) -> (String, Option<String>) {
            let e = &self.body["error"];
            (
                e["code"].as_str().unwrap_or("").to_owned(),
                e["param"].as_str().map(str::to_owned),
            )
        }
    }

    impl Served {
        pub async fn call(
            &self,
            key: &str,
            method: Method,
            path: &str,
            body: Option<Value>,
            idem: Option<&str>,
        ) -> Answer {
            let mut req = self
                .http
                .request(method, format!("{}{path}", self.base))
                .bearer_auth(key);
            if let Some(b) = body {
                req = req
                    .header("content-type", "application/json")
                    .body(b.to_string());
            }
            if let Some(k) = idem {
                req = req.header("idempotency-key", k);
            }
            let r = req.send().await.unwrap();
            let status = r.status().as_u16();
            let replayed = r.headers().contains_key("idempotent-replayed");
            let text = r.text().await.unwrap();
            let body = serde_json::from_str(&text).unwrap_or(Value::Null);
            Answer {
                status,
                body,
                text,
                replayed,
            }
        }

        pub async fn get(&self, key: &str, path: &str) -> Answer {
            self.call(key, Method::GET, path, None, None).await
        }

        pub async fn post(&self, key: &str, path: &str, body: Value) -> Answer {
            self.call(key, Method::POST, path, Some(body), None).await
        }
    }
}

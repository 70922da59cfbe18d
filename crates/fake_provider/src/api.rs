//! The `/v1` routes: authentication, the idempotency layer (replay, conflict, mismatch),
//! a customer's behaviour executed into an intent and its answer, retrieve and list.

use super::*;

/// The 401 for a `/v1/*` request without the current secret key, if it is
/// one. The message masks the key presented, as Stripe does.
pub(super) fn unauthorized(shared: &Shared, headers: &HeaderMap) -> Option<Box<Response>> {
    let presented = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or_default();
    let mut l = shared.ledger();
    if !presented.is_empty() && presented == l.secret_key {
        return None;
    }
    l.unauthorized_requests += 1;
    drop(l);
    Some(Box::new(error(
        StatusCode::UNAUTHORIZED,
        "invalid_request_error",
        None,
        None,
        &format!("Invalid API Key provided: {}", masked(presented)),
    )))
}

/// `sk_****` and, for a key long enough that it gives little away, its last
/// four characters: never the key itself.
pub(super) fn masked(key: &str) -> String {
    let chars: Vec<char> = key.chars().collect();
    let tail: String = if chars.len() >= 12 {
        chars[chars.len() - 4..].iter().collect()
    } else {
        String::new()
    };
    format!("sk_****{tail}")
}

/// The `Idempotency-Key` header, if any, or the 400 for a malformed one.
pub(super) fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, Box<Response>> {
    match headers.get("idempotency-key").map(|v| v.to_str()) {
        None => Ok(None),
        Some(Ok(k)) if !k.is_empty() && k.len() <= MAX_IDEMPOTENCY_KEY_LEN => {
            Ok(Some(k.to_owned()))
        }
        Some(_) => Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            "idempotency_error",
            None,
            None,
            "Idempotency-Key must be 1 to 255 visible ASCII characters.",
        ))),
    }
}

/// What executing a request does to its intent.
#[derive(Debug, Clone)]
pub(super) enum Effect {
    /// Succeeded (charged), answered 200 in this shape.
    Charge(Shape),
    /// Declined with this `decline_code`, answered 402.
    Decline(String),
    /// Succeeded (charged), answered 500, with the intent or not.
    StoredError { with_intent: bool },
    /// Succeeded (charged), answered 429 `lock_timeout`.
    StoredLockTimeout,
    /// Processing (not charged yet), answered 200.
    Processing,
    /// Waiting for the customer's action (not charged yet), answered 200.
    RequiresAction,
}

/// The body of a 200 for a charge.
#[derive(Debug, Clone, Copy)]
pub(super) enum Shape {
    Intent,
    NotJson,
    NoId,
    BadId,
}

/// What `behaviour` does with a request for `payment_method`: the answer
/// given before executing (nothing charged or stored), or the execution.
pub(super) fn plan(behaviour: &Behaviour, payment_method: &str) -> Result<Effect, Box<Response>> {
    Ok(match behaviour {
        Behaviour::ServerError(code) => {
            let status = StatusCode::from_u16(*code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            return Err(Box::new(api_error(status)));
        }
        Behaviour::RateLimited { retry_after_secs } => {
            return Err(Box::new(rate_limited(*retry_after_secs)));
        }
        Behaviour::MissingPaymentMethod => {
            return Err(Box::new(missing(
                "payment_method",
                format!("No such PaymentMethod: '{payment_method}'"),
            )));
        }
        Behaviour::Succeed | Behaviour::Hang if payment_method == DECLINED_CARD => {
            Effect::Decline("generic_decline".to_owned())
        }
        Behaviour::Succeed | Behaviour::Hang => Effect::Charge(Shape::Intent),
        Behaviour::Decline(code) => Effect::Decline(code.clone()),
        Behaviour::StoredServerError { with_intent } => Effect::StoredError {
            with_intent: *with_intent,
        },
        Behaviour::StoredRateLimited => Effect::StoredLockTimeout,
        Behaviour::Processing => Effect::Processing,
        Behaviour::RequiresAction => Effect::RequiresAction,
        Behaviour::Malformed(MalformedKind::NotJson) => Effect::Charge(Shape::NotJson),
        Behaviour::Malformed(MalformedKind::NoId) => Effect::Charge(Shape::NoId),
        Behaviour::Malformed(MalformedKind::BadId) => Effect::Charge(Shape::BadId),
        Behaviour::Malformed(MalformedKind::NulCode) => {
            Effect::Decline(NUL_DECLINE_CODE.to_owned())
        }
    })
}

pub(super) fn api_error(status: StatusCode) -> Response {
    error(
        status,
        "api_error",
        None,
        None,
        "An unknown error occurred.",
    )
}

pub(super) fn rate_limited(retry_after_secs: u64) -> Response {
    let mut r = error(
        StatusCode::TOO_MANY_REQUESTS,
        "rate_limit_error",
        None,
        None,
        "Too many requests",
    );
    r.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(retry_after_secs));
    r
}

/// Execute `effect` on `intent` and say what Stripe answers.
pub(super) fn execute(effect: &Effect, intent: &mut Intent) -> Answer {
    match effect {
        Effect::Charge(shape) => {
            intent.status = Status::Succeeded;
            charged(*shape, intent)
        }
        Effect::Decline(decline_code) => {
            intent.decline(decline_code);
            let mut e = card_error(decline_code);
            e["payment_intent"] = intent.json();
            Answer::json(StatusCode::PAYMENT_REQUIRED, &json!({ "error": e }))
        }
        Effect::StoredError { with_intent } => {
            intent.status = Status::Succeeded;
            let mut e = error_json("api_error", None, None, "An unknown error occurred.");
            if *with_intent {
                e["payment_intent"] = intent.json();
            }
            Answer::json(StatusCode::INTERNAL_SERVER_ERROR, &json!({ "error": e }))
        }
        Effect::StoredLockTimeout => {
            intent.status = Status::Succeeded;
            let e = error_json(
                "rate_limit_error",
                Some("lock_timeout"),
                None,
                "This object cannot be accessed right now because another API request or \
                 Stripe process is currently accessing it.",
            );
            Answer::json(StatusCode::TOO_MANY_REQUESTS, &json!({ "error": e }))
        }
        Effect::Processing => {
            intent.status = Status::Processing;
            Answer::json(StatusCode::OK, &intent.json())
        }
        Effect::RequiresAction => {
            intent.status = Status::RequiresAction;
            Answer::json(StatusCode::OK, &intent.json())
        }
    }
}

/// The 200 of a succeeded `intent`, in `shape`.
pub(super) fn charged(shape: Shape, intent: &Intent) -> Answer {
    match shape {
        Shape::Intent => Answer::json(StatusCode::OK, &intent.json()),
        Shape::NotJson => Answer {
            status: StatusCode::OK,
            content_type: "text/html",
            body: "<html>upstream proxy error</html>".to_owned(),
        },
        Shape::NoId => Answer::json(
            StatusCode::OK,
            &json!({ "object": "payment_intent", "status": "succeeded" }),
        ),
        Shape::BadId => {
            let mut body = intent.json();
            body["id"] = json!("pi_bad id/../x");
            Answer::json(StatusCode::OK, &body)
        }
    }
}

/// The stored answer for `key` if it is a replay, the refusal if the key is
/// reused with other parameters or in flight; None for a new request.
pub(super) fn replay_or_refusal(
    l: &Ledger,
    key: &str,
    params: &[(String, String)],
) -> Option<Response> {
    if let Some(stored) = l.by_key.get(key) {
        if stored.params != params {
            return Some(idempotency_mismatch(key));
        }
        return Some(stored.answer.clone().into_response(true));
    }
    if l.in_flight.contains_key(key) {
        return Some(error(
            StatusCode::CONFLICT,
            "idempotency_error",
            None,
            None,
            "There is currently another in-progress request using this Idempotency-Key.",
        ));
    }
    None
}

pub(super) async fn create_payment_intent(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Some(refusal) = unauthorized(&shared, &headers) {
        return *refusal;
    }
    let (enforce_minimums, latency) = {
        let mut l = shared.ledger();
        l.create_requests += 1;
        (!l.ignore_minimums, l.latency)
    };
    if !latency.is_zero() {
        // A network and processing delay: requests then overlap, so a test
        // can read how many a client had open at once.
        {
            let mut l = shared.ledger();
            l.answering += 1;
            l.most_answering = l.most_answering.max(l.answering);
        }
        tokio::time::sleep(latency).await;
        shared.ledger().answering -= 1;
    }
    let key = match idempotency_key(&headers) {
        Ok(k) => k,
        Err(refusal) => return *refusal,
    };
    let params = match validate(&body, enforce_minimums) {
        Ok(p) => p,
        Err(refusal) => return *refusal,
    };
    let customer = value(&params, "customer");
    let (effect, mut intent, hang) = {
        let mut l = shared.ledger();
        let behaviour = l
            .behaviour
            .get(customer)
            .cloned()
            .unwrap_or(Behaviour::Succeed);
        // The plan's refusals come before the replay: Stripe's rate limiter
        // and its checks of most invalid parameters run in front of its
        // idempotency layer (https://docs.stripe.com/error-low-level), so they
        // answer a key that has a stored result as they would a new one.
        let effect = match plan(&behaviour, value(&params, "payment_method")) {
            Ok(e) => e,
            Err(answer) => return *answer,
        };
        if let Some(answer) = key
            .as_deref()
            .and_then(|k| replay_or_refusal(&l, k, &params))
        {
            return answer;
        }
        l.next_intent += 1;
        let id = format!("pi_fake{}_{:08}", l.run, l.next_intent);
        let intent = Intent::new(id, key.clone(), &params, l.now());
        if let Some(k) = &key {
            l.in_flight.insert(k.clone(), params.clone());
        }
        (effect, intent, behaviour == Behaviour::Hang)
    };
    let answer = execute(&effect, &mut intent);
    {
        let mut l = shared.ledger();
        l.record(intent);
        if let Some(k) = &key {
            l.in_flight.remove(k);
            l.by_key.insert(
                k.clone(),
                Stored {
                    params: params.clone(),
                    answer: answer.clone(),
                },
            );
        }
    }
    if hang {
        std::future::pending::<()>().await;
    }
    answer.into_response(false)
}

pub(super) fn idempotency_mismatch(key: &str) -> Response {
    error(
        StatusCode::BAD_REQUEST,
        "idempotency_error",
        None,
        None,
        &format!(
            "Keys for idempotent requests can only be used with the same parameters they were first used with. \
             Try using a key other than '{key}' if you meant to execute a different request."
        ),
    )
}

pub(super) async fn retrieve_payment_intent(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    if let Some(refusal) = unauthorized(&shared, &headers) {
        return *refusal;
    }
    match shared.ledger().intent(&id) {
        Some(intent) => axum::Json(intent.json()).into_response(),
        None => no_such_intent(&id),
    }
}

/// The query of a list request, validated.
#[derive(Debug)]
pub(super) struct ListQuery {
    customer: Option<String>,
    created_gte: Option<i64>,
    limit: usize,
    starting_after: Option<String>,
}

pub(super) fn list_query(raw: Option<&str>) -> Result<ListQuery, Box<Response>> {
    let mut q = ListQuery {
        customer: None,
        created_gte: None,
        limit: LIST_LIMIT_DEFAULT,
        starting_after: None,
    };
    for (k, v) in url::form_urlencoded::parse(raw.unwrap_or_default().as_bytes()) {
        match k.as_ref() {
            "customer" => q.customer = Some(v.into_owned()),
            "starting_after" => q.starting_after = Some(v.into_owned()),
            "created[gte]" => {
                q.created_gte = Some(v.parse().map_err(|_| {
                    refuse(
                        "parameter_invalid_integer",
                        "created[gte]",
                        format!("Invalid integer: {v}"),
                    )
                })?);
            }
            "limit" => {
                q.limit = v
                    .parse()
                    .ok()
                    .filter(|l| (1..=LIST_LIMIT_MAX).contains(l))
                    .ok_or_else(|| {
                        refuse(
                            "parameter_invalid_integer",
                            "limit",
                            format!("Invalid integer: {v} (limit is 1 to {LIST_LIMIT_MAX})"),
                        )
                    })?;
            }
            other => {
                return Err(refuse(
                    "parameter_unknown",
                    other,
                    format!("Received unknown parameter: {other}"),
                ));
            }
        }
    }
    Ok(q)
}

/// Stripe's list object of the intents `q` selects: newest first, from just
/// before `starting_after` (in that order), `limit` of them.
pub(super) fn list(l: &Ledger, q: &ListQuery) -> Result<Value, Box<Response>> {
    if let Some(c) = q
        .customer
        .as_ref()
        .filter(|c| l.deleted_customers.contains(*c))
    {
        return Err(Box::new(missing(
            "customer",
            format!("No such customer: '{c}'"),
        )));
    }
    let before = match &q.starting_after {
        Some(id) => *l.by_id.get(id).ok_or_else(|| {
            Box::new(missing(
                "starting_after",
                format!("No such payment_intent: '{id}'"),
            ))
        })?,
        None => l.intents.len(),
    };
    let mut selected = l.intents[..before].iter().rev().filter(|i| {
        q.customer.as_ref().is_none_or(|c| *c == i.customer)
            && q.created_gte.is_none_or(|gte| i.created >= gte)
    });
    let data: Vec<Value> = selected.by_ref().take(q.limit).map(Intent::json).collect();
    let has_more = selected.next().is_some();
    Ok(json!({
        "object": "list",
        "url": "/v1/payment_intents",
        "has_more": has_more,
        "data": data,
    }))
}

pub(super) async fn list_payment_intents(
    State(shared): State<Arc<Shared>>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
) -> Response {
    if let Some(refusal) = unauthorized(&shared, &headers) {
        return *refusal;
    }
    let q = match list_query(raw.as_deref()) {
        Ok(q) => q,
        Err(refusal) => return *refusal,
    };
    let mut l = shared.ledger();
    l.list_requests += 1;
    if let Some(body) = l.list_body.clone() {
        return (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response();
    }
    match list(&l, &q) {
        Ok(body) => axum::Json(body).into_response(),
        Err(refusal) => *refusal,
    }
}

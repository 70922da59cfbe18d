//! The `/_test` control routes: charge counts, behaviours, settling a processing intent,
//! pruning keys, rolling the secret key.

use super::*;

pub(super) async fn charges(State(shared): State<Arc<Shared>>) -> Response {
    let l = shared.ledger();
    let total: u32 = l.charges.values().sum();
    axum::Json(json!({ "by_key": l.charges, "total": total })).into_response()
}

pub(super) fn form(body: &[u8]) -> HashMap<String, String> {
    url::form_urlencoded::parse(body).into_owned().collect()
}

pub(super) async fn set_behaviour(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let form = form(&body);
    let Some(customer) = form.get("customer").filter(|c| c.starts_with("cus_")) else {
        return invalid(
            "parameter_missing",
            "customer",
            "customer (cus_…) is required".into(),
        );
    };
    let behaviour = match behaviour_from(&form) {
        Ok(b) => b,
        Err(refusal) => return *refusal,
    };
    shared
        .ledger()
        .behaviour
        .insert(customer.clone(), behaviour);
    StatusCode::NO_CONTENT.into_response()
}

/// The [`Behaviour`] a `/_test/behaviour` form names.
pub(super) fn behaviour_from(form: &HashMap<String, String>) -> Result<Behaviour, Box<Response>> {
    let field = |name: &str| form.get(name).map(String::as_str);
    Ok(match field("behaviour") {
        Some("succeed") => Behaviour::Succeed,
        Some("decline") => Behaviour::Decline(
            field("decline_code")
                .unwrap_or("generic_decline")
                .to_owned(),
        ),
        Some("hang") => Behaviour::Hang,
        Some("error") => Behaviour::ServerError(500),
        Some("stored_error") => Behaviour::StoredServerError {
            with_intent: match field("with_intent") {
                None | Some("false") => false,
                Some("true") => true,
                Some(other) => {
                    return Err(refuse(
                        "parameter_invalid_boolean",
                        "with_intent",
                        format!("with_intent is true or false, not {other}"),
                    ));
                }
            },
        },
        Some("processing") => Behaviour::Processing,
        Some("requires_action") => Behaviour::RequiresAction,
        Some("missing_payment_method") => Behaviour::MissingPaymentMethod,
        Some("malformed") => Behaviour::Malformed(match field("kind") {
            Some("not_json") => MalformedKind::NotJson,
            Some("no_id") => MalformedKind::NoId,
            Some("bad_id") => MalformedKind::BadId,
            Some("nul_code") => MalformedKind::NulCode,
            _ => {
                return Err(refuse(
                    "parameter_invalid_string",
                    "kind",
                    "kind is one of not_json, no_id, bad_id, nul_code".into(),
                ));
            }
        }),
        Some("rate_limited") => Behaviour::RateLimited {
            retry_after_secs: field("retry_after").unwrap_or("1").parse().map_err(|_| {
                refuse(
                    "parameter_invalid_integer",
                    "retry_after",
                    "retry_after is a number of seconds".into(),
                )
            })?,
        },
        Some("stored_rate_limited") => Behaviour::StoredRateLimited,
        _ => {
            return Err(refuse(
                "parameter_invalid_string",
                "behaviour",
                "behaviour is one of succeed, decline, hang, error, stored_error, processing, \
                 requires_action, missing_payment_method, malformed, rate_limited, \
                 stored_rate_limited"
                    .into(),
            ));
        }
    })
}

/// Settle the intent `id`, processing or waiting for the customer's action
/// (see [`FakeProvider::settle_processing`]): its JSON now, or the 404 / 400
/// for an unknown or settled one.
pub(super) fn settle(l: &mut Ledger, id: &str, succeeded: bool) -> Result<Value, Box<Response>> {
    let found = l.by_id.get(id).copied();
    let Some(intent) = found.and_then(|i| l.intents.get_mut(i)) else {
        return Err(Box::new(no_such_intent(id)));
    };
    if !matches!(intent.status, Status::Processing | Status::RequiresAction) {
        return Err(refuse(
            "payment_intent_unexpected_state",
            "intent",
            format!(
                "payment_intent {id} is {}, not processing or requires_action",
                intent.status.as_str()
            ),
        ));
    }
    if succeeded {
        intent.status = Status::Succeeded;
    } else {
        intent.status = Status::RequiresPaymentMethod;
        intent.last_payment_error = Some(card_error("insufficient_funds"));
    }
    let (json, charge_key) = (intent.json(), intent.charge_key());
    if succeeded {
        *l.charges.entry(charge_key).or_default() += 1;
    }
    Ok(json)
}

pub(super) async fn settle_intent(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    let succeeded = match form(&body).get("status").map(String::as_str) {
        Some("succeeded") => true,
        Some("failed") => false,
        _ => {
            return invalid(
                "parameter_invalid_string",
                "status",
                "status is succeeded or failed".into(),
            );
        }
    };
    match settle(&mut shared.ledger(), &id, succeeded) {
        Ok(intent) => axum::Json(intent).into_response(),
        Err(refusal) => *refusal,
    }
}

pub(super) async fn prune_keys(State(shared): State<Arc<Shared>>) -> Response {
    shared.ledger().by_key.clear();
    StatusCode::NO_CONTENT.into_response()
}

pub(super) async fn roll_key(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let Some(key) = form(&body).remove("secret_key").filter(|k| !k.is_empty()) else {
        return invalid(
            "parameter_missing",
            "secret_key",
            "secret_key is required".into(),
        );
    };
    shared.ledger().secret_key = key;
    StatusCode::NO_CONTENT.into_response()
}

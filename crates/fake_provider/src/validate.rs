//! A create request's parameters checked as Stripe checks them: known names, required
//! ones, the amount within the currency's minimum and the maximum, metadata's bounds.

use super::*;

pub(super) const KNOWN: [&str; 6] = [
    "amount",
    "currency",
    "customer",
    "payment_method",
    "confirm",
    "off_session",
];

/// A 400 refusal, boxed (a `Response` is large for an `Err`).
pub(super) fn refuse(code: &str, param: &str, message: String) -> Box<Response> {
    Box::new(invalid(code, param, message))
}

/// `NAME` of a `metadata[NAME]` parameter, whatever NAME is.
pub(super) fn metadata_name(param: &str) -> Option<&str> {
    param.strip_prefix("metadata[")?.strip_suffix(']')
}

/// The parameter an error about `param` names: `metadata` for any of its keys.
pub(super) fn param_name(param: &str) -> &str {
    if param.starts_with("metadata") {
        "metadata"
    } else {
        param
    }
}

/// The parameters, validated as Stripe would, sorted (the idempotency
/// fingerprint, `metadata[…]` included), or the refusal.
pub(super) fn validate(
    body: &[u8],
    enforce_minimums: bool,
) -> Result<Vec<(String, String)>, Box<Response>> {
    let mut params: Vec<(String, String)> = url::form_urlencoded::parse(body)
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect();
    for (k, _) in &params {
        if !KNOWN.contains(&k.as_str()) && !k.starts_with("metadata") {
            return Err(refuse(
                "parameter_unknown",
                k,
                format!("Received unknown parameter: {k}"),
            ));
        }
    }
    params.sort();
    for w in params.windows(2) {
        if w[0].0 == w[1].0 {
            return Err(refuse(
                "parameter_invalid_string",
                param_name(&w[0].0),
                format!("Received {} more than once", w[0].0),
            ));
        }
    }
    let get = |name: &str| {
        params
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    for name in KNOWN {
        if get(name).is_none_or(str::is_empty) {
            return Err(refuse(
                "parameter_missing",
                name,
                format!("Missing required param: {name}."),
            ));
        }
    }
    let amount = get("amount").unwrap_or_default();
    if !amount.bytes().all(|b| b.is_ascii_digit()) {
        return Err(refuse(
            "parameter_invalid_integer",
            "amount",
            format!("Invalid integer: {amount} (a non-negative integer of minor units)"),
        ));
    }
    let currency = get("currency").unwrap_or_default();
    if currency.len() != 3 || !currency.bytes().all(|b| b.is_ascii_lowercase()) {
        return Err(refuse(
            "parameter_invalid_string",
            "currency",
            format!("Invalid currency: {currency} (a lowercase ISO 4217 code)"),
        ));
    }
    check_amount(amount, currency, enforce_minimums)?;
    for (name, prefix) in [("customer", "cus_"), ("payment_method", "pm_")] {
        let v = get(name).unwrap_or_default();
        if !v.starts_with(prefix) || v.len() == prefix.len() {
            return Err(refuse(
                "resource_missing",
                name,
                format!("No such {name}: '{v}'"),
            ));
        }
    }
    for name in ["confirm", "off_session"] {
        if get(name) != Some("true") {
            return Err(refuse(
                "parameter_invalid_boolean",
                name,
                format!("{name} must be true for an off-session charge of a saved card"),
            ));
        }
    }
    check_metadata(&params)?;
    Ok(params)
}

/// The three-decimal currencies Stripe takes, lower case as sent.
const THREE_DECIMAL: [&str; 5] = ["bhd", "jod", "kwd", "omr", "tnd"];

/// `amount` (all digits) within `currency`'s minimum (when enforced, else 1)
/// and [`MAX_AMOUNT`]: Stripe's `amount_too_small` / `amount_too_large`.
pub(super) fn check_amount(
    amount: &str,
    currency: &str,
    enforce_minimums: bool,
) -> Result<(), Box<Response>> {
    let minimum = if enforce_minimums {
        minimum_amount(currency)
    } else {
        1
    };
    match amount.parse::<u64>() {
        // ISK stays two-decimal in the API, but only whole krónur are
        // charged (https://support.stripe.com/questions/deprecation-of-fractional-isk-charges-and-refunds).
        Ok(a) if currency == "isk" && a % 100 != 0 => Err(refuse(
            "invalid_charge_amount_no_decimal_compatible",
            "amount",
            format!(
                "Invalid amount: {a}. Currency ISK has become effectively zero-decimal and \
                 charged amounts must be evenly divisible by 100."
            ),
        )),
        // Three-decimal currencies only with a last digit of 0
        // (https://docs.stripe.com/currencies, "Three-decimal currencies").
        Ok(a) if THREE_DECIMAL.contains(&currency) && a % 10 != 0 => Err(refuse(
            "parameter_invalid_integer",
            "amount",
            format!(
                "Invalid amount: {a}. Amounts in {currency} must be rounded to the nearest ten \
                 (the last digit must be 0)."
            ),
        )),
        Ok(a) if a < minimum => Err(refuse(
            "amount_too_small",
            "amount",
            format!("Amount must be at least {minimum} {currency} (in minor units)"),
        )),
        Ok(a) if a <= MAX_AMOUNT => Ok(()),
        _ => Err(refuse(
            "amount_too_large",
            "amount",
            format!("Amount must be no more than {MAX_AMOUNT} {currency} (in minor units)"),
        )),
    }
}

/// Stripe's limits on `metadata[NAME]=VALUE`: NAME 1..40 of `[A-Za-z0-9_]`,
/// VALUE up to 500 characters, at most 50 keys.
pub(super) fn check_metadata(params: &[(String, String)]) -> Result<(), Box<Response>> {
    let refusal = |message: String| refuse("parameter_invalid_string", "metadata", message);
    let mut keys = 0;
    for (k, v) in params.iter().filter(|(k, _)| k.starts_with("metadata")) {
        let name = metadata_name(k).unwrap_or_default();
        if name.is_empty()
            || name.len() > METADATA_MAX_KEY_LEN
            || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        {
            return Err(refusal(format!(
                "Invalid metadata parameter {k}: keys are metadata[NAME], NAME 1 to \
                 {METADATA_MAX_KEY_LEN} characters of A-Z, a-z, 0-9 and _"
            )));
        }
        let len = v.chars().count();
        if len > METADATA_MAX_VALUE_LEN {
            return Err(refusal(format!(
                "Metadata values can have up to {METADATA_MAX_VALUE_LEN} characters, \
                 but you passed in a value that is {len} characters long ({k})"
            )));
        }
        keys += 1;
    }
    if keys > METADATA_MAX_KEYS {
        return Err(refusal(format!(
            "You can have up to {METADATA_MAX_KEYS} metadata keys, but you passed {keys}"
        )));
    }
    Ok(())
}

/// The intent's metadata from validated `params`; an empty value unsets its
/// key, as on Stripe (it stays part of the fingerprint).
pub(super) fn metadata(params: &[(String, String)]) -> BTreeMap<String, String> {
    params
        .iter()
        .filter(|(_, v)| !v.is_empty())
        .filter_map(|(k, v)| Some((metadata_name(k)?.to_owned(), v.clone())))
        .collect()
}

pub(super) fn value<'a>(params: &'a [(String, String)], name: &str) -> &'a str {
    params
        .iter()
        .find(|(k, _)| k == name)
        .map_or("", |(_, v)| v.as_str())
}

//! Emails: queue one (sent by the email_outbox role), read one, list them,
//! and queue a failed one again. Checked exactly as the in-process producers'
//! emails are (`outbox::email`), each refusal naming its field.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use chrono::{DateTime, Utc};
use db::{PgRow, Row as _};
use outbox::email::{EnqueueError, Invalid};
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use crate::auth::Caller;
use crate::error::{ApiError, Code};
use crate::extract::{Id, JsonBody, Query};
use crate::page::{List, Page};
use crate::responses::{ReadErrors, WriteErrors};
use crate::scope::{Idempotency, Scope};
use crate::state::Api;

/// An email to send.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewEmail {
    /// `billing@example.com` or `Example Billing <billing@example.com>`: an
    /// address at the domain of this tenant's `email_from` setting, or, until
    /// it has one, the deployment's sender itself (`HARDCOUNT_EMAIL_FROM`).
    pub from: String,
    /// 1 to 50 mailboxes, in the same forms as `from`.
    #[schema(min_items = 1, max_items = 50)]
    pub to: Vec<String>,
    /// 1 to 998 characters, no line break.
    pub subject: String,
    /// The plain-text body, at most 256 KiB.
    pub text: String,
    /// An HTML alternative, at most 256 KiB.
    pub html: Option<String>,
}

/// A queued email (its bodies are not shown again).
#[derive(Debug, Serialize, ToSchema)]
pub struct Email {
    pub id: i64,
    /// Its `Message-ID` header, the same on every attempt.
    pub message_id: String,
    pub from: String,
    pub to: Vec<String>,
    pub subject: String,
    /// `queued`, `sent` or `failed`.
    pub status: String,
    pub attempts: i32,
    /// When a queued email is next due; null once sent or failed.
    pub next_attempt_at: Option<DateTime<Utc>>,
    pub last_attempt_at: Option<DateTime<Utc>>,
    /// The mail server's last reply code; null when it did not answer.
    pub last_reply_code: Option<i32>,
    pub last_reply_text: Option<String>,
    pub sent_at: Option<DateTime<Utc>>,
    pub created_at: DateTime<Utc>,
}

#[derive(Debug, Deserialize, IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ListEmails {
    /// Page size, 1 to 100 (default 20).
    #[param(minimum = 1, maximum = 100)]
    pub limit: Option<u32>,
    /// The `next_cursor` of the page before.
    pub starting_after: Option<String>,
}

/// The columns every read selects (a macro: statements are `'static`).
macro_rules! columns {
    () => {
        "id, message_id, sender, recipients, subject, status, attempts,
    CASE WHEN status = 'queued' THEN next_attempt_at END AS next_attempt_at,
    last_attempt_at, last_reply_code, last_reply_text, sent_at, created_at"
    };
}

impl Email {
    fn from_row(row: &PgRow) -> Result<Email, db::Error> {
        Ok(Email {
            id: row.try_get("id")?,
            message_id: row.try_get("message_id")?,
            from: row.try_get("sender")?,
            to: row.try_get("recipients")?,
            subject: row.try_get("subject")?,
            status: row.try_get("status")?,
            attempts: row.try_get("attempts")?,
            next_attempt_at: row.try_get("next_attempt_at")?,
            last_attempt_at: row.try_get("last_attempt_at")?,
            last_reply_code: row.try_get("last_reply_code")?,
            last_reply_text: row.try_get("last_reply_text")?,
            sent_at: row.try_get("sent_at")?,
            created_at: row.try_get("created_at")?,
        })
    }
}

/// Queue an email.
#[utoipa::path(
    post, path = "/v1/emails", tag = "emails", operation_id = "create_email",
    params(("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 255, pattern = r"^[\x21-\x7E]+$", nullable = false, description = "Retry safely: the same key and body return the first answer for 24 hours.")),
    request_body = NewEmail,
    responses((status = 201, description = "Queued; the email_outbox role sends it.", body = Email), WriteErrors),
)]
pub async fn create(
    State(api): State<Api>,
    caller: Caller,
    idem: Idempotency,
    body: JsonBody<NewEmail>,
) -> Result<Response, ApiError> {
    let NewEmail {
        from,
        to,
        subject,
        text,
        html,
    } = &body.value;
    let email = outbox::email::Email {
        from: from.clone(),
        to: to.clone(),
        subject: subject.clone(),
        text: text.clone(),
        html: html.clone(),
    };
    email.validate().map_err(|e| invalid(&email, &e))?;
    let mut scope = Scope::begin(&api, &caller).await?;
    if let Some(replay) = scope.idempotent(&idem, &body.raw).await? {
        return Ok(replay);
    }
    own_sender(&mut scope, &api.config().billing.email_from, from).await?;
    let tenant = scope.tenant().to_owned();
    let id = outbox::email::enqueue(scope.tx(), &tenant, &email)
        .await
        .map_err(|e| match e {
            EnqueueError::Invalid(i) => invalid(&email, &i),
            EnqueueError::Db(e) => ApiError::from_db(&e),
        })?;
    let email = read(&mut scope, id).await?.ok_or_else(ApiError::internal)?;
    scope.respond(StatusCode::CREATED, &email).await
}

/// Read an email.
#[utoipa::path(
    get, path = "/v1/emails/{id}", tag = "emails", operation_id = "get_email",
    params(("id" = i64, Path, description = "The email's id.", minimum = 1)),
    responses((status = 200, body = Email), ReadErrors),
)]
pub async fn get(State(api): State<Api>, caller: Caller, Id(id): Id) -> Result<Response, ApiError> {
    let mut scope = Scope::begin(&api, &caller).await?;
    let email = read(&mut scope, id)
        .await?
        .ok_or_else(|| ApiError::missing("email", id))?;
    scope.respond(StatusCode::OK, &email).await
}

/// List emails, newest first.
#[utoipa::path(
    get, path = "/v1/emails", tag = "emails", operation_id = "list_emails",
    params(ListEmails),
    responses((status = 200, body = List<Email>), ReadErrors),
)]
pub async fn list(
    State(api): State<Api>,
    caller: Caller,
    Query(q): Query<ListEmails>,
) -> Result<Response, ApiError> {
    let page = Page::new(q.limit, q.starting_after.as_deref())?;
    let mut scope = Scope::begin(&api, &caller).await?;
    let rows = scope
        .tx()
        .fetch_all(
            db::sql(concat!(
                "SELECT ",
                columns!(),
                " FROM email_outbox
                 WHERE tenant_id = api_tenant() AND ($1::bigint IS NULL OR id < $1)
                 ORDER BY id DESC LIMIT $2"
            ))
            .bind(page.before)
            .bind(page.fetch()),
        )
        .await?;
    let list = page.rows(&rows, Email::from_row, |e| e.id)?;
    scope.respond(StatusCode::OK, &list).await
}

/// Queue a failed email again, due now. A queued or sent one, or one
/// refused when it was queued: 409.
#[utoipa::path(
    post, path = "/v1/emails/{id}/resend", tag = "emails", operation_id = "resend_email",
    params(
        ("id" = i64, Path, description = "The email's id.", minimum = 1),
        ("Idempotency-Key" = Option<String>, Header, min_length = 1, max_length = 255, pattern = r"^[\x21-\x7E]+$", nullable = false, description = "Retry safely: the same key returns the first answer for 24 hours."),
    ),
    responses((status = 200, description = "Queued again.", body = Email), WriteErrors),
)]
pub async fn resend(
    State(api): State<Api>,
    caller: Caller,
    Id(id): Id,
    idem: Idempotency,
) -> Result<Response, ApiError> {
    let mut scope = Scope::begin(&api, &caller).await?;
    if let Some(replay) = scope.idempotent(&idem, b"").await? {
        return Ok(replay);
    }
    // Only a failed row is reset: the sender claims only queued rows and
    // writes a result only by compare-and-set on (id, attempts, queued).
    // `attempts` moves one past every number handed out (migration 0042), so
    // a result still in flight for the last attempt never matches the resent
    // email; the schedule is spent, so a resent email has one more attempt.
    // The claim's ceiling counts from `resent_at_attempt` (migration 0041),
    // so it does not take the resend for an attempt that died. A refused
    // email (`refused`) was never sendable and stays failed.
    let reset = scope
        .tx()
        .execute(
            db::sql(
                "UPDATE email_outbox SET status = 'queued', next_attempt_at = now(),
                        attempts = attempts + 1, resent_at_attempt = attempts + 1
                 WHERE tenant_id = api_tenant() AND id = $1
                   AND status = 'failed' AND refused IS NULL",
            )
            .bind(id),
        )
        .await?;
    let email = read(&mut scope, id)
        .await?
        .ok_or_else(|| ApiError::missing("email", id))?;
    if reset == 0 {
        let why = if email.status == "failed" {
            "was refused when it was queued and cannot be sent".to_owned()
        } else {
            format!("is {}: only a failed email can be resent", email.status)
        };
        return Err(ApiError::conflict(
            Code::InvalidState,
            format!("email {id} {why}"),
        ));
    }
    scope.respond(StatusCode::OK, &email).await
}

async fn read(scope: &mut Scope, id: i64) -> Result<Option<Email>, ApiError> {
    let row = scope
        .tx()
        .fetch_optional(
            db::sql(concat!(
                "SELECT ",
                columns!(),
                " FROM email_outbox WHERE tenant_id = api_tenant() AND id = $1"
            ))
            .bind(id),
        )
        .await?;
    Ok(row.as_ref().map(Email::from_row).transpose()?)
}

/// A sender's domain as two are compared: its IDNA ASCII form, in lower case
/// (`bücher.example` and `XN--BCHER-KVA.example` are one domain, the one the
/// relay sends for; docs/adr/0151); a domain IDNA refuses, in lower case.
pub(crate) fn sender_domain(domain: &str) -> String {
    match url::Host::parse(domain) {
        Ok(url::Host::Domain(ascii)) => ascii,
        _ => domain.to_ascii_lowercase(),
    }
}

/// Refuse a sender this tenant may not use. With its own
/// `tenant_settings.email_from`, any address at that sender's domain; without
/// one, only the deployment's sender itself (`HARDCOUNT_EMAIL_FROM`,
/// `default_from`), whose domain the platform and every other such tenant
/// share. The email leaves through the deployment's mail server, so any
/// other address would be sent in someone else's name (docs/adr/0143).
async fn own_sender(scope: &mut Scope, default_from: &str, from: &str) -> Result<(), ApiError> {
    let tenant = scope.tenant().to_owned();
    let set: Option<String> = scope
        .tx()
        .fetch_optional(
            db::sql("SELECT email_from FROM tenant_settings WHERE tenant_id = $1").bind(tenant),
        )
        .await?
        .map(|r| r.try_get::<Option<String>, _>(0))
        .transpose()
        .map_err(db::Error::from)?
        .flatten();
    // (local part, domain as compared: `sender_domain`).
    let address = |m: &str| {
        outbox::email::mailbox("from", m)
            .ok()
            .map(|mb| (mb.email.user().to_owned(), sender_domain(mb.email.domain())))
    };
    let (Some((own_user, own_domain)), Some((user, domain))) = (
        address(set.as_deref().unwrap_or(default_from)),
        address(from),
    ) else {
        return Err(ApiError::internal());
    };
    let allowed = domain == own_domain && (set.is_some() || user == own_user);
    if allowed {
        return Ok(());
    }
    Err(ApiError::param(
        "from",
        if set.is_some() {
            format!(
                "from must be an address at {own_domain}, this tenant's sender domain \
                 (tenant_settings.email_from)"
            )
        } else {
            format!(
                "from must be {own_user}@{own_domain}, the deployment's sender \
                 (HARDCOUNT_EMAIL_FROM), until this tenant has a sender of its own \
                 (tenant_settings.email_from)"
            )
        },
    ))
}

/// The outbox's refusal as a 400 naming the field; a recipient by its index
/// (`to[2]`). Never echoes a body.
fn invalid(email: &outbox::email::Email, e: &Invalid) -> ApiError {
    let field = match e {
        Invalid::EmptyTenant => return ApiError::internal(),
        Invalid::Address { field, .. }
        | Invalid::HeaderInjection { field }
        | Invalid::Nul { field }
        | Invalid::BodyTooLarge { field, .. } => *field,
        Invalid::NoRecipients | Invalid::TooManyRecipients { .. } => "to",
        Invalid::EmptySubject | Invalid::SubjectTooLong { .. } => "subject",
    };
    let param = match e {
        Invalid::NoRecipients | Invalid::TooManyRecipients { .. } => field.to_owned(),
        _ if field == "to" => email
            .to
            .iter()
            .position(|t| outbox::email::mailbox("to", t).is_err())
            .map_or_else(|| "to".to_owned(), |i| format!("to[{i}]")),
        _ => field.to_owned(),
    };
    let message = match e {
        // The address is the caller's own input; the message says why.
        Invalid::Address { problem, .. } => format!("{param} is not a mailbox: {problem}"),
        other => other.to_string(),
    };
    match e {
        Invalid::TooManyRecipients { .. }
        | Invalid::SubjectTooLong { .. }
        | Invalid::BodyTooLarge { .. } => ApiError::out_of_range(param, message),
        _ => ApiError::param(param, message),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn email() -> outbox::email::Email {
        outbox::email::Email {
            from: "Billing <billing@example.com>".into(),
            to: vec![
                "a@example.org".into(),
                "b@example.org".into(),
                "c@example.org".into(),
            ],
            subject: "Receipt".into(),
            text: "Paid".into(),
            html: None,
        }
    }

    #[test]
    fn each_refusal_names_its_field_and_a_recipient_its_index() {
        type Mutate = fn(&mut outbox::email::Email);
        let cases: Vec<(Mutate, &str)> = vec![
            (|e| e.from = "nobody".into(), "from"),
            (|e| e.to[2] = "c@".into(), "to[2]"),
            (
                |e| e.to[1] = "b@example.org\r\nBcc: x@example.org".into(),
                "to[1]",
            ),
            (|e| e.to[0] = "a\0@example.org".into(), "to[0]"),
            (|e| e.to.clear(), "to"),
            (|e| e.to = vec!["a@example.org".into(); 51], "to"),
            (|e| e.subject = " ".into(), "subject"),
            (|e| e.subject = "a\nb".into(), "subject"),
            (|e| e.subject = "s".repeat(999), "subject"),
            (
                |e| e.text = "x".repeat(outbox::email::MAX_BODY_BYTES + 1),
                "text",
            ),
            (|e| e.html = Some("a\0".into()), "html"),
        ];
        for (mutate, param) in cases {
            let mut e = email();
            mutate(&mut e);
            let refusal = invalid(&e, &e.validate().unwrap_err());
            assert_eq!(refusal.status, StatusCode::BAD_REQUEST);
            assert_eq!(refusal.param.as_deref(), Some(param), "{}", refusal.message);
        }
    }
}

//! A tenant's payment page (`tenant_settings.payment_page_url`,
//! docs/adr/0150): where its customers add or update the payment method the
//! service charges. The emails that ask for one link to it. It is never a
//! place to pay an invoice: nothing tells the service of a payment made
//! there, so the emails never ask for one.

use std::collections::HashMap;

use db::{Row, Tx};

/// Where a template names the invoice: replaced by its id.
pub const INVOICE_PLACEHOLDER: &str = "{invoice}";

/// The page of `invoice_id`: `template` with every `{invoice}` replaced by the
/// id (a template without one is the same page for every invoice).
pub fn payment_page(template: &str, invoice_id: i64) -> String {
    template.replace(INVOICE_PLACEHOLDER, &invoice_id.to_string())
}

/// The line an asking email ends with: the page of `invoice_id`, or nothing
/// when the tenant has no page.
pub fn payment_page_line(template: Option<&str>, invoice_id: i64) -> String {
    match template {
        Some(t) => format!(
            "\nAdd or update your payment method here: {}\n",
            payment_page(t, invoice_id)
        ),
        None => String::new(),
    }
}

/// The payment pages of those of `tenants` that set one, read in the
/// caller's transaction (one statement, only when some email asks).
///
/// # Errors
/// A database error: the caller's transaction is aborted.
pub async fn payment_pages(
    tx: &mut Tx,
    tenants: Vec<String>,
) -> Result<HashMap<String, String>, db::Error> {
    if tenants.is_empty() {
        return Ok(HashMap::new());
    }
    let rows = tx
        .fetch_all(
            db::sql(
                "SELECT tenant_id, payment_page_url FROM tenant_settings \
                 WHERE tenant_id = ANY($1) AND payment_page_url IS NOT NULL",
            )
            .bind(tenants),
        )
        .await?;
    rows.iter()
        .map(|r| Ok((r.try_get("tenant_id")?, r.try_get("payment_page_url")?)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_names_its_invoice_where_the_template_says() {
        assert_eq!(
            payment_page("https://pay.acme.example/i/{invoice}?from=mail", 42),
            "https://pay.acme.example/i/42?from=mail"
        );
        assert_eq!(
            payment_page("https://acme.example/billing", 42),
            "https://acme.example/billing"
        );
        assert_eq!(payment_page_line(None, 42), "");
        assert_eq!(
            payment_page_line(Some("https://acme.example/pay/{invoice}"), 42),
            "\nAdd or update your payment method here: https://acme.example/pay/42\n"
        );
    }
}

//! What an invoice is when it is made (pure; docs/adr/0025).

/// What an invoice is when it is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Disposed {
    pub status: &'static str,
    /// What the invoice asks for: the period's amount and the balance taken in.
    pub amount: i64,
    pub balance_applied: i64,
    /// Under the provider's minimum: not charged, owed on the next invoice.
    pub carried: i64,
}

/// The rules (pure): a paused subscription's invoice follows the pause's
/// behaviour and leaves the balance alone; otherwise the balance is taken
/// in, nothing due is paid at once, an automatic amount under the
/// provider's minimum is paid at once and carried to the balance, and the
/// rest is open. Returns the invoice and the balance left.
pub(crate) fn dispose(
    subtotal: i64,
    pause: Option<&str>,
    balance: i64,
    automatic: bool,
    minimum: Option<i64>,
) -> (Disposed, i64) {
    let paused = |status| {
        (
            Disposed {
                status,
                amount: subtotal,
                balance_applied: 0,
                carried: 0,
            },
            balance,
        )
    };
    match pause {
        Some("keep_as_draft") => return paused("draft"),
        Some("void") => return paused("void"),
        Some(_) => return paused("uncollectible"),
        None => {}
    }
    let due = subtotal.saturating_add(balance);
    if due <= 0 {
        // A credit larger than the period stays a credit.
        let d = Disposed {
            status: "paid",
            amount: 0,
            balance_applied: -subtotal,
            carried: 0,
        };
        return (d, due);
    }
    let d = Disposed {
        status: "open",
        amount: due,
        balance_applied: balance,
        carried: 0,
    };
    if automatic && minimum.is_some_and(|m| due < m) {
        let d = Disposed {
            status: "paid",
            carried: due,
            ..d
        };
        return (d, due);
    }
    (d, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_an_invoice_is_when_it_is_made() {
        let usd_min = Some(50);
        // (subtotal, pause, balance, automatic) → (status, amount, applied, carried), balance left
        let cases = [
            ((1200, None, 0, true), ("open", 1200, 0, 0), 0),
            (
                (1200, Some("keep_as_draft"), 30, true),
                ("draft", 1200, 0, 0),
                30,
            ),
            ((1200, Some("void"), 30, true), ("void", 1200, 0, 0), 30),
            (
                (1200, Some("mark_uncollectible"), 0, true),
                ("uncollectible", 1200, 0, 0),
                0,
            ),
            ((0, None, 0, true), ("paid", 0, 0, 0), 0),
            ((30, None, 0, true), ("paid", 30, 0, 30), 30),
            ((30, None, 0, false), ("open", 30, 0, 0), 0),
            ((1200, None, 30, true), ("open", 1230, 30, 0), 0),
            ((10, None, 30, true), ("paid", 40, 30, 40), 40),
            ((30, None, 30, true), ("open", 60, 30, 0), 0),
            ((100, None, -300, true), ("paid", 0, -100, 0), -200),
        ];
        for ((subtotal, pause, balance, automatic), (status, amount, applied, carried), left) in
            cases
        {
            let got = dispose(subtotal, pause, balance, automatic, usd_min);
            assert_eq!(
                got,
                (
                    Disposed {
                        status,
                        amount,
                        balance_applied: applied,
                        carried
                    },
                    left
                ),
                "{subtotal} {pause:?} {balance} {automatic}"
            );
        }
        // No minimum known for the currency: charged as it is.
        assert_eq!(dispose(1, None, 0, true, None).0.status, "open");
    }
}

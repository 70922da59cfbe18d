//! Amounts as customers read them, and the provider's per-currency minimum.
//! Pure: no SQL, no I/O.
//!
//! Amounts are integers in the currency's minor unit, whose size is the ISO 4217
//! exponent: 1200 JPY is ¥1200 (exponent 0), 1200 EUR is €12.00 (2), 1200 KWD is
//! 1.200 KWD (3). The provider's API mostly agrees; where Stripe departs from
//! ISO 4217 (it takes ISK with two decimals, and MGA with none) the charge path
//! converts (`provider::provider_amount`, docs/adr/0078), not this module.

/// Currencies whose minor unit is the major unit (ISO 4217 exponent 0).
const EXPONENT_0: [&str; 17] = [
    "BIF", "CLP", "DJF", "GNF", "ISK", "JPY", "KMF", "KRW", "PYG", "RWF", "UGX", "UYI", "VND",
    "VUV", "XAF", "XOF", "XPF",
];

/// Currencies with three decimals (ISO 4217 exponent 3).
const EXPONENT_3: [&str; 7] = ["BHD", "IQD", "JOD", "KWD", "LYD", "OMR", "TND"];

/// Currencies with four decimals (ISO 4217 exponent 4): units of account.
const EXPONENT_4: [&str; 2] = ["CLF", "UYW"];

/// The exponent of a code the table does not list: most currencies have two
/// decimals, and showing cents is the least surprising guess.
const DEFAULT_EXPONENT: u32 = 2;

/// The ISO 4217 minor-unit exponent of `currency` (any case): how many decimal
/// digits its minor unit takes. A code the table does not list has 2.
pub fn exponent(currency: &str) -> u32 {
    let listed = |table: &[&str]| table.iter().any(|c| c.eq_ignore_ascii_case(currency));
    if listed(&EXPONENT_0) {
        0
    } else if listed(&EXPONENT_3) {
        3
    } else if listed(&EXPONENT_4) {
        4
    } else {
        DEFAULT_EXPONENT
    }
}

/// `amount` minor units of `currency` as a customer reads it: `12.00 EUR`,
/// `1200 JPY`, `1.234 KWD`, `-0.05 USD`. The code is shown in upper case.
pub fn money(amount: i64, currency: &str) -> String {
    let code = currency.to_ascii_uppercase();
    let sign = if amount < 0 { "-" } else { "" };
    // unsigned_abs: i64::MIN has no positive i64.
    let magnitude = amount.unsigned_abs();
    match exponent(currency) {
        0 => format!("{sign}{magnitude} {code}"),
        e => {
            let scale = 10u64.pow(e);
            let width = e as usize;
            format!(
                "{sign}{}.{:0width$} {code}",
                magnitude / scale,
                magnitude % scale
            )
        }
    }
}

/// The payment provider's smallest charge in `currency` (any case), in minor
/// units, from Stripe's table of minimum charge amounts
/// (<https://docs.stripe.com/currencies#minimum-and-maximum-charge-amounts>):
/// 0.50 USD, 0.30 GBP, ¥50, 175.00 HUF and so on. `None` for a currency the
/// table does not list (Stripe then applies the minimum of the account's
/// settlement currency after conversion, which only the provider knows).
pub fn provider_minimum(currency: &str) -> Option<i64> {
    PROVIDER_MINIMUMS
        .iter()
        .find(|(c, _)| c.eq_ignore_ascii_case(currency))
        .map(|(_, m)| *m)
}

/// Stripe's minimum charge amounts, in minor units (the table cited at
/// [`provider_minimum`]; the fake provider enforces the same table).
const PROVIDER_MINIMUMS: [(&str, i64); 24] = [
    ("USD", 50),
    ("AED", 200),
    ("AUD", 50),
    ("BGN", 100),
    ("BRL", 50),
    ("CAD", 50),
    ("CHF", 50),
    ("CZK", 1500),
    ("DKK", 250),
    ("EUR", 50),
    ("GBP", 30),
    ("HKD", 400),
    ("HUF", 17500),
    ("INR", 50),
    ("JPY", 50),
    ("MXN", 1000),
    ("MYR", 200),
    ("NOK", 300),
    ("NZD", 50),
    ("PLN", 200),
    ("RON", 200),
    ("SEK", 300),
    ("SGD", 50),
    ("THB", 1000),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_currency_shows_its_own_number_of_decimals() {
        for (amount, currency, shown) in [
            (1200, "EUR", "12.00 EUR"),
            (5, "USD", "0.05 USD"),
            (0, "GBP", "0.00 GBP"),
            (1200, "JPY", "1200 JPY"),
            (1200, "KRW", "1200 KRW"),
            (7, "ISK", "7 ISK"),
            (1234, "KWD", "1.234 KWD"),
            (5, "BHD", "0.005 BHD"),
            (1000, "TND", "1.000 TND"),
            (12345, "CLF", "1.2345 CLF"),
            (1, "UYW", "0.0001 UYW"),
            (-5, "USD", "-0.05 USD"),
            (-1200, "EUR", "-12.00 EUR"),
            (-1200, "JPY", "-1200 JPY"),
            (-1, "KWD", "-0.001 KWD"),
            (1200, "eur", "12.00 EUR"),
            (1200, "jpy", "1200 JPY"),
            (1999, "XYZ", "19.99 XYZ"),
            (i64::MAX, "USD", "92233720368547758.07 USD"),
            (i64::MIN, "USD", "-92233720368547758.08 USD"),
            (i64::MIN, "JPY", "-9223372036854775808 JPY"),
        ] {
            assert_eq!(money(amount, currency), shown, "{amount} {currency}");
        }
    }

    #[test]
    fn exponents_follow_iso_4217_and_unknown_codes_take_two() {
        for c in EXPONENT_0 {
            assert_eq!(exponent(c), 0, "{c}");
        }
        for c in EXPONENT_3 {
            assert_eq!(exponent(c), 3, "{c}");
        }
        for c in EXPONENT_4 {
            assert_eq!(exponent(c), 4, "{c}");
        }
        for c in ["USD", "EUR", "GBP", "HUF", "MGA", "TWD", "usd", "", "NOPE"] {
            assert_eq!(exponent(c), 2, "{c:?}");
        }
        assert_eq!(exponent("kwd"), 3);
    }

    #[test]
    fn provider_minimums_are_stripes_table_and_unlisted_currencies_have_none() {
        for (currency, minimum) in [
            ("USD", 50),
            ("EUR", 50),
            ("GBP", 30),
            ("JPY", 50),
            ("HUF", 17500),
            ("MXN", 1000),
            ("CZK", 1500),
            ("thb", 1000),
        ] {
            assert_eq!(provider_minimum(currency), Some(minimum), "{currency}");
        }
        for currency in ["KWD", "ZAR", "XYZ", ""] {
            assert_eq!(provider_minimum(currency), None, "{currency:?}");
        }
        // Each listed once, in upper case, with a positive minimum.
        let mut codes: Vec<&str> = PROVIDER_MINIMUMS.iter().map(|(c, _)| *c).collect();
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), PROVIDER_MINIMUMS.len());
        assert!(
            PROVIDER_MINIMUMS
                .iter()
                .all(|(c, m)| *m > 0 && c.len() == 3 && c.chars().all(|x| x.is_ascii_uppercase()))
        );
    }

    /// The minimums read as Stripe's table prints them: 0.50 USD, ¥50, 175.00 HUF.
    #[test]
    fn provider_minimums_read_as_stripe_prints_them() {
        let shown = |c: &str| money(provider_minimum(c).unwrap(), c);
        assert_eq!(shown("USD"), "0.50 USD");
        assert_eq!(shown("GBP"), "0.30 GBP");
        assert_eq!(shown("JPY"), "50 JPY");
        assert_eq!(shown("HUF"), "175.00 HUF");
        assert_eq!(shown("MXN"), "10.00 MXN");
    }
}

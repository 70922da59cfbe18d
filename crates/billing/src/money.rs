//! Money shown to people, and the provider's smallest charge (placeholder,
//! replaced by the full ISO 4217 table).

/// `12.00 EUR` for 1200 minor units; `1200 JPY` for a zero-decimal currency.
pub fn money(amount: i64, currency: &str) -> String {
    const ZERO_DECIMAL: [&str; 16] = [
        "BIF", "CLP", "DJF", "GNF", "JPY", "KMF", "KRW", "MGA", "PYG", "RWF", "UGX", "VND", "VUV",
        "XAF", "XOF", "XPF",
    ];
    if ZERO_DECIMAL.contains(&currency) {
        format!("{amount} {currency}")
    } else {
        format!("{}.{:02} {currency}", amount / 100, amount % 100)
    }
}

/// The provider's minimum charge in minor units, where known.
pub fn provider_minimum(currency: &str) -> Option<i64> {
    match currency {
        "USD" | "EUR" => Some(50),
        _ => None,
    }
}

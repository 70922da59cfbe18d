//! A plan change or a cancel now in mid-period: the used part invoiced in the
//! request's transaction, another currency refused, and a change that loses
//! the race with billing's closing writes nothing.

use db::{Row as _, sql};
use reqwest::Method;
use serde_json::json;

use super::{bed, begun, events};

#[tokio::test]
async fn a_plan_change_invoices_the_used_part_and_refuses_another_currency() {
    let b = bed().await;
    let eur = b.plan(&b.a, "EUR", 3000).await;
    let eur2 = b.plan(&b.a, "EUR", 6000).await;
    let usd = b.plan(&b.a, "USD", 3000).await;
    let id = begun(&b, eur, 10).await;
    let path = format!("/v1/subscriptions/{id}/change_plan");
    let r = b.s.post(&path, &b.a, json!({"plan": usd})).await;
    assert_eq!(
        (r.status.as_u16(), r.refusal().0.as_str()),
        (409, "currency_mismatch"),
        "{}",
        r.text
    );
    let r = b.s.post(&path, &b.a, json!({"plan": eur})).await;
    assert_eq!(
        (r.status.as_u16(), r.refusal().0.as_str()),
        (409, "invalid_state"),
        "{}",
        r.text
    );
    let r = b.s.post(&path, &b.a, json!({"plan": 999_999})).await;
    assert_eq!(
        (r.status.as_u16(), r.refusal()),
        (404, ("resource_missing".into(), Some("plan".into()))),
        "{}",
        r.text
    );

    let r = b.s.post(&path, &b.a, json!({"plan": eur2})).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.json["plan"].as_i64(), Some(eur2));
    let invoices =
        b.s.get(&format!("/v1/invoices?subscription={id}"), &b.a)
            .await;
    let inv = &invoices.json["data"][0];
    assert_eq!(inv["reason"], "plan_change", "{}", invoices.text);
    // About 10 days of a month's 3000, pro rata: well under the full amount.
    let amount = inv["amount"].as_i64().unwrap();
    assert!((800..=1100).contains(&amount), "{amount}");
    let one = b.s.get(&format!("/v1/invoices/{}", inv["id"]), &b.a).await;
    assert_eq!(one.json["payment_attempts"], json!([]), "{}", one.text);
    b.check_refusals(
        &b.b,
        &[(
            Method::GET,
            format!("/v1/invoices/{}", inv["id"]),
            None,
            404,
            "resource_missing",
            "id",
        )],
    )
    .await;
    assert_eq!(b.s.get("/v1/invoices", &b.b).await.json["data"], json!([]));
}

/// The billing role moves the period while a plan change is between its
/// read and its write: the change's compare-and-set loses, it writes
/// nothing and answers 409 `subscription_period_moved`.
///
/// The test's transaction moves the period as a closing would and holds
/// the row; the request reads the old period (unlocked), then its
/// compare-and-set waits on the row; the move commits; the compare-and-set
/// re-reads the row and matches nothing.
///
/// Catches: a plan change whose compare-and-set does not prove the period
/// it read (the `s.current_period_start = i.period_start AND
/// s.next_billing_at = i.watermark` of billing's `invoice::close_in`), or
/// an API that answers a lost change with 200 or writes its invoice anyway
/// (checked: without the two period predicates the change answers 200).
#[tokio::test]
async fn a_plan_change_that_loses_the_race_with_billing_writes_nothing_and_answers_409() {
    let b = bed().await;
    let eur = b.plan(&b.a, "EUR", 3000).await;
    let eur2 = b.plan(&b.a, "EUR", 6000).await;
    let id = begun(&b, eur, 10).await;
    let mut mover = b.t.db.begin().await.unwrap();
    mover
        .execute(
            sql(
                "UPDATE subscriptions SET current_period_start = current_period_end, \
                        current_period_end = current_period_end + interval '1 month', \
                        next_billing_at = current_period_end + interval '1 month' \
                 WHERE id = $1",
            )
            .bind(id),
        )
        .await
        .unwrap();
    let xid: String = mover
        .fetch_one(sql("SELECT pg_current_xact_id()::text AS x"))
        .await
        .unwrap()
        .get("x");
    let s = b.s.clone();
    let key = b.a.clone();
    let change = tokio::spawn(async move {
        s.post(
            &format!("/v1/subscriptions/{id}/change_plan"),
            &key,
            json!({"plan": eur2}),
        )
        .await
    });
    // Wait for the request's compare-and-set to wait on the mover.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let waiting: i64 =
            b.t.db
                .fetch_one(
                    sql("SELECT count(*) AS n FROM pg_locks \
                     WHERE locktype = 'transactionid' AND NOT granted \
                       AND transactionid::text = $1")
                    .bind(xid.clone()),
                )
                .await
                .unwrap()
                .get("n");
        if waiting > 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the change never waited on the row"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    mover.commit().await.unwrap();
    let r = change.await.unwrap();
    assert_eq!(
        (r.status.as_u16(), r.refusal().0.as_str()),
        (409, "subscription_period_moved"),
        "{}",
        r.text
    );
    let row = b
        .t
        .db
        .fetch_one(sql("SELECT plan_id, (SELECT count(*) FROM invoices) AS n FROM subscriptions WHERE id = $1").bind(id))
        .await
        .unwrap();
    assert_eq!(
        (row.get::<i64, _>("plan_id"), row.get::<i64, _>("n")),
        (eur, 0)
    );
}

#[tokio::test]
async fn a_cancel_now_invoices_the_used_part_in_the_same_transaction() {
    let b = bed().await;
    let eur = b.plan(&b.a, "EUR", 3000).await;
    let id = begun(&b, eur, 10).await;
    let r =
        b.s.post(&format!("/v1/subscriptions/{id}/cancel"), &b.a, json!({}))
            .await;
    assert_eq!(
        (r.status.as_u16(), r.json["status"].as_str()),
        (200, Some("canceled")),
        "{}",
        r.text
    );
    let list = b.s.get("/v1/invoices", &b.a).await;
    assert_eq!(list.json["data"][0]["reason"], "cancel", "{}", list.text);
    let kinds = events(&b.t).await;
    assert!(kinds.contains(&"invoice.finalized".to_owned()), "{kinds:?}");
}

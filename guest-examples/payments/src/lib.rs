//! The `payments` example: debit an account for an order, record the order,
//! and ask the outbox to charge the card, keyed by the order id.
//!
//! Payload: `{"order_id": "o-1", "account": "acct-7", "amount": 250}`.
//! Everything it does lands in one transaction with the ack, or nothing does:
//! a re-run (abort, unknown commit) can never debit twice or charge twice.

use onceq_guest::{Ctx, Error, Handler, Message, Value};
use serde::{Deserialize, Serialize};

/// The order as received, and as the charge intent carries it (the SDK
/// writes its fields in sorted order, as the JavaScript and Python SDKs do).
#[derive(Deserialize, Serialize)]
struct Order {
    order_id: String,
    account: String,
    amount: i64,
}

struct Payments;

impl Handler for Payments {
    fn handle(ctx: &mut Ctx, msg: &Message) -> Result<(), Error> {
        let order: Order = msg.json()?;
        if order.amount <= 0 {
            return Err(Error::reject(format!(
                "order {}: amount must be positive, got {}",
                order.order_id, order.amount
            )));
        }
        let Some(account) = ctx.get("accounts", &[Value::from(order.account.as_str())])? else {
            return Err(Error::reject(format!(
                "order {}: unknown account {}",
                order.order_id, order.account
            )));
        };
        let balance = account.i64("balance")?;
        let now = Value::Timestamp(msg.now);
        let status = if balance >= order.amount { "charged" } else { "declined" };
        ctx.insert(
            "orders",
            [
                ("id", Value::from(order.order_id.as_str())),
                ("account_id", Value::from(order.account.as_str())),
                ("amount", Value::from(order.amount)),
                ("status", Value::from(status)),
                ("created_at", now.clone()),
            ],
        );
        if status == "declined" {
            return Ok(());
        }
        ctx.update(
            "accounts",
            [
                ("id", Value::from(order.account.as_str())),
                ("balance", Value::from(balance - order.amount)),
                ("updated_at", now),
            ],
        );
        ctx.intent("charge", format!("charge-{}", order.order_id), &order);
        Ok(())
    }
}

onceq_guest::export_handler!(Payments);

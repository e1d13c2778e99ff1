//! The `inventory` example: reserve stock for an order with a
//! read-modify-write, reject an order for an unknown item.
//!
//! Payload: `{"order_id": "o-1", "sku": "sku-3", "qty": 2}`.
//! The read of the item row is checked at commit: if another message changed
//! the stock meanwhile, the host re-runs this handler on the new value, so
//! stock is never oversold.

use onceq_guest::{Ctx, Error, Handler, Message, Value};
use serde::Deserialize;

#[derive(Deserialize)]
struct Reserve {
    order_id: String,
    sku: String,
    qty: i64,
}

struct Inventory;

impl Handler for Inventory {
    fn handle(ctx: &mut Ctx, msg: &Message) -> Result<(), Error> {
        let req: Reserve = msg.json()?;
        if req.qty <= 0 {
            return Err(Error::reject(format!(
                "order {}: qty must be positive, got {}",
                req.order_id, req.qty
            )));
        }
        let Some(item) = ctx.get("items", &[Value::from(req.sku.as_str())])? else {
            return Err(Error::reject(format!("order {}: unknown item {}", req.order_id, req.sku)));
        };
        let stock = item.i64("stock")?;
        let status = if stock >= req.qty {
            ctx.update(
                "items",
                [("sku", Value::from(req.sku.as_str())), ("stock", Value::from(stock - req.qty))],
            );
            "reserved"
        } else {
            "backordered"
        };
        ctx.insert(
            "reservations",
            [
                ("order_id", Value::from(req.order_id.as_str())),
                ("sku", Value::from(req.sku.as_str())),
                ("qty", Value::from(req.qty)),
                ("status", Value::from(status)),
            ],
        );
        Ok(())
    }
}

onceq_guest::export_handler!(Inventory);

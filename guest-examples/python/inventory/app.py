"""The `inventory` example in Python, with the same behaviour as the Rust
one: reserve stock for an order with a read-modify-write, reject an order
for an unknown item.

Payload: {"order_id": "o-1", "sku": "sku-3", "qty": 2}.
The read of the item row is checked at commit: if another message changed
the stock meanwhile, the host re-runs this handler on the new value.
"""

from onceq_guest import export, reject


def handle(ctx, msg):
    order_id, sku, qty = msg.fields("order_id", "sku", "qty")
    if not isinstance(qty, int) or qty <= 0:
        reject(f"order {order_id}: qty must be positive, got {qty}")
    item = ctx.get("items", [sku])
    if item is None:
        reject(f"order {order_id}: unknown item {sku}")
    status = "backordered"
    if item["stock"] >= qty:
        ctx.update("items", sku=sku, stock=item["stock"] - qty)
        status = "reserved"
    ctx.insert("reservations", order_id=order_id, sku=sku, qty=qty, status=status)


Handler = export(handle)

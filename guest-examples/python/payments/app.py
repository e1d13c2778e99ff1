"""The `payments` example in Python, with the same behaviour as the Rust
one: debit an account for an order, record the order, and ask the outbox
to charge the card, keyed by the order id.

Payload: {"order_id": "o-1", "account": "acct-7", "amount": 250}.
"""

from onceq_guest import Timestamp, export, reject


def handle(ctx, msg):
    order_id, account, amount = msg.fields("order_id", "account", "amount")
    if not isinstance(amount, int) or amount <= 0:
        reject(f"order {order_id}: amount must be positive, got {amount}")
    row = ctx.get("accounts", [account])
    if row is None:
        reject(f"order {order_id}: unknown account {account}")
    balance = row["balance"]
    now = Timestamp(msg.now)
    status = "charged" if balance >= amount else "declined"
    ctx.insert("orders", id=order_id, account_id=account, amount=amount, status=status, created_at=now)
    if status == "declined":
        return
    ctx.update("accounts", id=account, balance=balance - amount, updated_at=now)
    ctx.intent("charge", f"charge-{order_id}", {"order_id": order_id, "account": account, "amount": amount})


Handler = export(handle)

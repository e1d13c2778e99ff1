// The `inventory` example in JavaScript, with the same behaviour as the
// Rust one: reserve stock for an order with a read-modify-write, reject an
// order for an unknown item.
//
// Payload: {"order_id": "o-1", "sku": "sku-3", "qty": 2}.
// The read of the item row is checked at commit: if another message changed
// the stock meanwhile, the host re-runs this handler on the new value.

import { defineHandler, reject } from '../onceq-guest.js';

export const handler = defineHandler((ctx, msg) => {
  const [orderId, sku, qty] = msg.fields('order_id', 'sku', 'qty');
  if (!Number.isInteger(qty) || qty <= 0) reject(`order ${orderId}: qty must be positive, got ${qty}`);
  const item = ctx.get('items', [sku]);
  if (item === null) reject(`order ${orderId}: unknown item ${sku}`);
  let status = 'backordered';
  if (item.stock >= qty) {
    ctx.update('items', { sku, stock: item.stock - qty });
    status = 'reserved';
  }
  ctx.insert('reservations', { order_id: orderId, sku, qty, status });
});

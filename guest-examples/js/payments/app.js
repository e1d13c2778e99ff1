// The `payments` example in JavaScript, with the same behaviour as the Rust
// one: debit an account for an order, record the order, and ask the outbox
// to charge the card, keyed by the order id.
//
// Payload: {"order_id": "o-1", "account": "acct-7", "amount": 250}.

import { Timestamp, defineHandler, reject } from '../onceq-guest.js';

export const handler = defineHandler((ctx, msg) => {
  const [orderId, account, amount] = msg.fields('order_id', 'account', 'amount');
  if (!Number.isInteger(amount) || amount <= 0) {
    reject(`order ${orderId}: amount must be positive, got ${amount}`);
  }
  const row = ctx.get('accounts', [account]);
  if (row === null) reject(`order ${orderId}: unknown account ${account}`);
  const now = new Timestamp(msg.now);
  const status = row.balance >= amount ? 'charged' : 'declined';
  ctx.insert('orders', { id: orderId, account_id: account, amount, status, created_at: now });
  if (status === 'declined') return;
  ctx.update('accounts', { id: account, balance: row.balance - amount, updated_at: now });
  ctx.intent('charge', `charge-${orderId}`, { order_id: orderId, account, amount });
});

-- unuse.lua — a coupon held for an order that will not be (nothing kept,
-- FAILED, cancelled or closed) is free for the buyer's next order.
--
-- KEYS[1] uses hash (user -> order_no)
-- ARGV[1] user id   ARGV[2] order_no
--
-- Only the hold of this very order goes: a later order's is left alone.
-- Returns 1 when freed now, 0 otherwise.
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  redis.call('HDEL', KEYS[1], ARGV[1])
  return 1
end
return 0

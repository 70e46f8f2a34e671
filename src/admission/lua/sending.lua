-- sending.lua — read a reservation before its event is sent again.
--
-- KEYS[1] reservation hash
-- ARGV[1] now (unix ms)
--
-- Returns {status, acked, user, qty, req, ts, coupon} ('' for what is
-- missing). When the reservation is open and unacknowledged its `sent`
-- time moves to now first, so that the reconciler, which voids only
-- reservations unsent for a publish window, cannot void one whose event
-- may still be on its way.
local r = redis.call('HMGET', KEYS[1], 'status', 'acked', 'user', 'qty', 'req', 'ts', 'coupon')
if r[1] == 'occupied' and not r[2] then
  redis.call('HSET', KEYS[1], 'sent', ARGV[1])
end
for i = 1, 7 do r[i] = r[i] or '' end
return r

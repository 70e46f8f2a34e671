-- published.lua — keep the event the broker acknowledged on its reservation,
-- so reconciliation can publish it again should it never reach the
-- consumers (an acknowledged purchase is never voided).
--
-- KEYS[1] reservation hash   ARGV[1] the event payload
--
-- Only while the reservation is occupied: a committed or released one needs
-- nothing, and a missing one must not be re-created without its TTL.
if redis.call('HGET', KEYS[1], 'status') == 'occupied' then
  redis.call('HSET', KEYS[1], 'event', ARGV[1])
  return 1
end
return 0

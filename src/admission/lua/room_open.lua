-- room_open.lua — create an activity's waiting room, once per epoch.
--
-- KEYS[1] room hash   KEYS[2..6] its users, entrants, states, active and
--                     offers (cleared: a new room starts empty)
-- ARGV[1] epoch   ARGV[2] pre-queue opens (ms)   ARGV[3] sale start (ms)
-- ARGV[4] sale end (ms)   ARGV[5] admit_per_sec   ARGV[6] max_active (0: none)
-- ARGV[7] pass ttl (ms)   ARGV[8] offer time (ms)   ARGV[9] seed (hex)
--
-- Returns {0, epoch} when created now, {1, epoch in Redis} when it exists.
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {1, tonumber(redis.call('HGET', KEYS[1], 'epoch'))}
end
for i = 2, #KEYS do redis.call('DEL', KEYS[i]) end
redis.call('HSET', KEYS[1], 'epoch', ARGV[1], 'open_ms', ARGV[2], 'start_ms', ARGV[3],
  'end_ms', ARGV[4], 'rate', ARGV[5], 'max_active', ARGV[6], 'pass_ms', ARGV[7],
  'offer_ms', ARGV[8], 'seed', ARGV[9], 'seq', 0, 'serving', 0, 'offering', 0, 'closed', 0,
  'entrants', 0, 'commit', '', 'sold', 0, 'tokens_m', 0, 'tokens_at', 0, 'admitted', 0)
return {0, tonumber(ARGV[1])}

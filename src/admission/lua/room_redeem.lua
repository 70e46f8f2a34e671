-- room_redeem.lua — use a pass, once (its signature was checked before).
--
-- KEYS[1] room   KEYS[2] users   KEYS[3] states   KEYS[4] active
-- ARGV[1] ticket   ARGV[2] user   ARGV[3] epoch   ARGV[4] kind (A or O)
-- ARGV[5] the pass's expiry (ms)   ARGV[6] now (ms, sale clock)
--
-- Returns 1 used now; -1 no room; -2 a pass of an earlier queue; -3 not
-- this user's ticket; -4 expired; -5 sold out (an admitted pass no longer
-- buys: its ticket is on the waitlist); -6 used before; -7 not the
-- ticket's pass (it left, or its pass expired).
local r = redis.call('HMGET', KEYS[1], 'epoch', 'sold')
if not r[1] then return -1 end
if r[1] ~= ARGV[3] then return -2 end
-- The user's current ticket: none (not theirs), or another one (they
-- left, and joined again at the back).
local held = redis.call('HGET', KEYS[2], ARGV[2])
if not held then return -3 end
if held ~= ARGV[1] then return -7 end
local st = redis.call('HGET', KEYS[3], ARGV[1])
if st == ARGV[4] .. ':' .. ARGV[5] then
  if tonumber(ARGV[6]) >= tonumber(ARGV[5]) then return -4 end
  if ARGV[4] == 'A' and r[2] == '1' then return -5 end
  local used = 'U:'
  if ARGV[4] == 'O' then used = 'V:' end
  redis.call('HSET', KEYS[3], ARGV[1], used .. ARGV[5])
  redis.call('ZREM', KEYS[4], ARGV[1])
  -- Passes used so far: adaptive admission counts the orders they may
  -- have made that the consumers' lag does not show yet.
  redis.call('HINCRBY', KEYS[1], 'used', 1)
  return 1
end
local was = string.sub(st or '', 1, 2)
if string.sub(st or '', 3) == ARGV[5] and (was == 'U:' or was == 'V:' or was == 'B:' or was == 'D:') then
  return -6
end
return -7

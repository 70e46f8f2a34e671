-- room_join.lua — take a ticket (after close_prequeue, room_close.lua).
--
-- KEYS[1] room   KEYS[2] users   KEYS[3] states
-- KEYS[4] this proof-of-work answer's marker   KEYS[5] this second's joins
-- KEYS[6] the entrants (list of users in ticket order)
-- ARGV[1] user   ARGV[2] now (ms, sale clock)   ARGV[3] ms until the
-- answer's challenge expires
--
-- Returns {code, ticket}: 0 a new ticket, 1 the user's ticket already,
-- -1 no room (never opened, or lost), -2 outside pre-queue-to-end,
-- -3 the answer was accepted before. A user who left gets a new ticket at
-- the back. A pre-queue ticket's user is pushed on the entrants, so the
-- list's i-th user took ticket i (from 1): the instances build the
-- commitment to the draw from it (crate::room::entrants). Only user →
-- ticket is kept otherwise: a pass is signed for its user and ticket, and
-- the user's current ticket is all a redemption needs to check.
local user, now = ARGV[1], tonumber(ARGV[2])
local r = redis.call('HMGET', KEYS[1], 'open_ms', 'end_ms')
if not r[1] then return {-1, 0} end
if now < tonumber(r[1]) or now >= tonumber(r[2]) then return {-2, 0} end
if not redis.call('SET', KEYS[4], '1', 'NX', 'PX', ARGV[3]) then return {-3, 0} end
local closed = close_prequeue(KEYS[1], now)
redis.call('INCR', KEYS[5])
redis.call('PEXPIRE', KEYS[5], 5000)
local t = redis.call('HGET', KEYS[2], user)
if t and redis.call('HGET', KEYS[3], t) ~= 'L' then return {1, tonumber(t)} end
t = redis.call('HINCRBY', KEYS[1], 'seq', 1)
redis.call('HSET', KEYS[2], user, t)
if not closed then redis.call('RPUSH', KEYS[6], user) end
return {0, t}

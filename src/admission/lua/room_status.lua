-- room_status.lua — where a user's ticket stands, read only, O(1).
--
-- KEYS[1] room   KEYS[2] users   KEYS[3] states   ARGV[1] user
--
-- Returns {} when there is no room, else {epoch, closed, entrants, seq,
-- serving, sold, rate, ticket (0: none), state ('' while waiting),
-- commit, seed, offering, passes used, purchases marked bought}. The place
-- is computed by the caller from the draw.
local r = redis.call('HMGET', KEYS[1], 'epoch', 'closed', 'entrants', 'seq', 'serving',
  'sold', 'rate', 'commit', 'seed', 'offering', 'used', 'taken')
if not r[1] then return {} end
local t = redis.call('HGET', KEYS[2], ARGV[1])
local st = ''
if t then st = redis.call('HGET', KEYS[3], t) or '' else t = '0' end
return {r[1], r[2], r[3], r[4], r[5], r[6], r[7], t, st, r[8], r[9], r[10], r[11] or '0',
  r[12] or '0'}

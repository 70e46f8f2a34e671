-- room_seal.lua — fix the commitment to a closed queue's entrants.
--
-- KEYS[1] room   ARGV[1] epoch   ARGV[2] the root an instance built
--
-- The first root written stays: every instance builds its own from the
-- same list of entrants and checks it against what this returns. Returns
-- the room's root, or '' when the room is gone, of another epoch, or not
-- closed.
local r = redis.call('HMGET', KEYS[1], 'epoch', 'closed', 'commit')
if r[1] ~= ARGV[1] or r[2] ~= '1' then return '' end
if r[3] == false or r[3] == '' then
  redis.call('HSET', KEYS[1], 'commit', ARGV[2])
  return ARGV[2]
end
return r[3]

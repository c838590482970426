#!lua name=leasehold
--
-- Leasehold global bucket protocol, version 1: the only code that mutates global state.
--
-- Each function touches exactly one key, KEYS[1], a hash holding one bucket (invariant
-- I7), and uses only the Redis server clock (I5). It is the twin of
-- crates/lease-core/src/model.rs; the differential tests hold them to the same replies
-- and the same hash fields. Numbers are integers below 2^53 (rules are validated so);
-- division goes through divmod() because Lua divides in floating point, and numbers are
-- written with %d because Redis would otherwise format them with 14 digits.
--
-- ARGV: capacity, rate_tokens, rate_period_us, lease_ttl_us, grace_us, max_outstanding
--       (0 = strict), agent (hex), seq, then per function:
--   lh_acquire: held, want, min, demand     lh_release: returned     lh_exact: cost
-- Reply: {granted, ttl_us, remaining, retry_us, now_us}

local MAX = 9007199254740991
local MAX_HELD = 1099511627776
local MAX_UNITS = 4503599627370496

local function fail(msg)
  error({err = msg})
end

local function int(v, what, max)
  local n = tonumber(v)
  if n == nil or n ~= math.floor(n) or n < 0 or n > max then
    fail('LH_ARG invalid argument ' .. what .. ' = ' .. tostring(v))
  end
  return n
end

local function fmt(n)
  return string.format('%d', n)
end

local function divmod(a, b)
  local q = math.floor(a / b)
  local r = a - q * b
  if r < 0 then
    q, r = q - 1, r + b
  elseif r >= b then
    q, r = q + 1, r - b
  end
  return q, r
end

local function ceil_div(a, b)
  local q, r = divmod(a, b)
  if r > 0 then return q + 1 end
  return q
end

local function params(args)
  local p = {
    cap = int(args[1], 'capacity', MAX),
    n = int(args[2], 'rate_tokens', MAX),
    per = int(args[3], 'rate_period_us', MAX),
    ttl = int(args[4], 'lease_ttl_us', MAX),
    grace = int(args[5], 'grace_us', MAX),
    maxout = int(args[6], 'max_outstanding', MAX),
    id = args[7],
    seq = int(args[8], 'seq', MAX),
  }
  if p.cap < 1 or p.n < 1 or p.per < 1 or p.cap * p.per + p.n > MAX_UNITS then
    fail('LH_ARG invalid bucket parameters: capacity ' .. tostring(args[1]) ..
      ', rate ' .. tostring(args[2]) .. '/' .. tostring(args[3]) .. 'us')
  end
  if type(p.id) ~= 'string' or #p.id < 1 or #p.id > 32 or not string.match(p.id, '^%x+$') then
    fail('LH_ARG invalid argument agent = ' .. tostring(p.id))
  end
  return p
end

local function cap_of(p, out)
  if p.maxout == 0 then return math.max(p.cap - out, 0) end
  return p.cap
end

-- Level::refill
local function refill(s, p, cap, dt)
  if s.tok >= cap then
    s.tok, s.car = cap, 0
    return
  end
  local need = (cap - s.tok) * p.per - s.car
  if dt >= ceil_div(need, p.n) then
    s.tok, s.car = cap, 0
    return
  end
  local q, r = divmod(s.car + p.n * dt, p.per)
  s.tok, s.car = s.tok + q, r
end

local function refill_to(s, p, t)
  refill(s, p, cap_of(p, s.out), math.max(t - s.ts, 0))
  s.ts = math.max(s.ts, t)
end

local function clamp(s, p)
  refill(s, p, cap_of(p, s.out), 0)
end

-- Level::time_until
local function time_until(s, k, p)
  if s.tok >= k then return 0 end
  return ceil_div((k - s.tok) * p.per - s.car, p.n)
end

local function decode(reply)
  local out = {}
  for v in string.gmatch(reply, '[^,]+') do
    out[#out + 1] = tonumber(v)
  end
  return out
end

-- Loads the bucket and the agent's record; returns (state, record, now, replay).
local function begin(key, p)
  local t = redis.call('TIME')
  local server_now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local id = p.id
  local f = redis.call('HMGET', key, 'tok', 'car', 'p', 'ts', 'out', 'nexp', 'mx',
    id .. ':h', id .. ':x', id .. ':s', id .. ':r', id .. ':d')
  local s
  if f[1] then
    s = {tok = tonumber(f[1]), car = tonumber(f[2]), p = tonumber(f[3]), ts = tonumber(f[4]),
         out = tonumber(f[5]), nexp = tonumber(f[6]), mx = tonumber(f[7])}
  else
    s = {tok = p.cap, car = 0, p = p.per, ts = server_now, out = 0, nexp = 0, mx = 0}
  end
  local now = math.max(server_now, s.ts)
  local rec = nil
  if f[1] and f[8] then
    rec = {held = tonumber(f[8]), x = tonumber(f[9]), seq = tonumber(f[10]), reply = f[11],
           demand = tonumber(f[12])}
    if rec.x > now then
      if p.seq == rec.seq then
        return s, rec, now, decode(rec.reply)
      end
      if p.seq < rec.seq then
        fail('LH_STALE sequence ' .. fmt(p.seq) .. ' is older than the last one seen (' ..
          fmt(rec.seq) .. ')')
      end
    end
  end
  return s, rec, now, nil
end

-- Refills to now, dropping expired agent records in time order; returns the agent's
-- record if it is still there.
local function advance(key, s, p, now, rec)
  if s.p ~= p.per then
    s.car, s.p = 0, p.per
  end
  if s.nexp ~= 0 and now >= s.nexp then
    local all = redis.call('HGETALL', key)
    local recs = {}
    for i = 1, #all, 2 do
      local aid, field = string.match(all[i], '^(%x+):([hx])$')
      if aid then
        recs[aid] = recs[aid] or {}
        recs[aid][field] = tonumber(all[i + 1])
      end
    end
    local expired, nexp, mx = {}, 0, 0
    for aid, r in pairs(recs) do
      if r.x <= now then
        expired[#expired + 1] = {x = r.x, id = aid, h = r.h}
      else
        if nexp == 0 then nexp = r.x else nexp = math.min(nexp, r.x) end
        mx = math.max(mx, r.x)
      end
    end
    table.sort(expired, function(a, b)
      if a.x ~= b.x then return a.x < b.x end
      return a.id < b.id
    end)
    for _, e in ipairs(expired) do
      refill_to(s, p, e.x)
      s.out = s.out - e.h
      redis.call('HDEL', key, e.id .. ':h', e.id .. ':x', e.id .. ':s', e.id .. ':r', e.id .. ':d')
      if e.id == p.id then rec = nil end
    end
    s.nexp, s.mx = nexp, mx
  end
  refill_to(s, p, now)
  return rec
end

-- Stores the state and the agent's record, and sets the key to expire only once every
-- record is dropped and the bucket would be full again (I6).
local function finish(key, s, p, now, rec, reply)
  local x = rec.x
  if s.nexp == 0 then s.nexp = x else s.nexp = math.min(s.nexp, x) end
  s.mx = math.max(s.mx, x)
  local id = p.id
  local encoded = fmt(reply[1]) .. ',' .. fmt(reply[2]) .. ',' .. fmt(reply[3]) .. ',' ..
    fmt(reply[4]) .. ',' .. fmt(reply[5])
  redis.call('HSET', key, 'tok', fmt(s.tok), 'car', fmt(s.car), 'p', fmt(s.p), 'ts', fmt(s.ts),
    'out', fmt(s.out), 'nexp', fmt(s.nexp), 'mx', fmt(s.mx),
    id .. ':h', fmt(rec.held), id .. ':x', fmt(x), id .. ':s', fmt(p.seq), id .. ':r', encoded,
    id .. ':d', fmt(rec.demand))
  local life = math.max(s.mx - now, 0) + time_until(s, p.cap, p)
  local at_ms = divmod(now + life, 1000) + 1
  redis.call('PEXPIREAT', key, fmt(at_ms))
  return reply
end

local function acquire(keys, args)
  local p = params(args)
  local held = int(args[9], 'held', MAX_HELD)
  local demand = int(args[12], 'demand', MAX)
  local min = int(args[11], 'min', MAX)
  local want = int(args[10], 'want', MAX)
  if min == 0 then fail('LH_ARG invalid argument min = 0') end
  if min > p.cap then
    fail('LH_CAPACITY ' .. fmt(min) .. ' tokens requested, but the bucket holds at most ' .. fmt(p.cap))
  end
  if want < min or want > p.cap then fail('LH_ARG invalid argument want = ' .. fmt(want)) end
  local key = keys[1]
  local s, rec, now, replay = begin(key, p)
  if replay then return replay end
  rec = advance(key, s, p, now, rec)
  local prior_held = rec and rec.held or 0
  -- State-based report: the agent's own count replaces ours; declaring more than we
  -- knew (a grant lost in a failover) lowers the tokens instead of minting any.
  s.out = s.out - prior_held + held
  clamp(s, p)
  local tok = s.tok
  local avail = tok
  if p.maxout ~= 0 then avail = math.min(tok, math.max(p.maxout - s.out, 0)) end
  local g = math.min(want, avail)
  if g < min then g = 0 end
  s.tok, s.out = s.tok - g, s.out + g
  local retry = 0
  if g == 0 then
    local blocked = 0
    if p.maxout ~= 0 and tok >= min then blocked = math.max(s.nexp - now, 0) end
    retry = math.max(time_until(s, min, p), blocked, 1)
  end
  return finish(key, s, p, now,
    {held = held + g, x = now + p.ttl + p.grace, demand = demand},
    {g, p.ttl, s.tok, retry, now})
end

local function release(keys, args)
  local p = params(args)
  local returned = int(args[9], 'returned', MAX_HELD)
  local key = keys[1]
  local s, rec, now, replay = begin(key, p)
  if replay then return replay end
  rec = advance(key, s, p, now, rec)
  local prior_held = rec and rec.held or 0
  -- Credit no more than we know the agent held: returns cannot mint tokens.
  local credit = math.min(returned, prior_held)
  s.out = s.out - prior_held
  s.tok = s.tok + credit
  clamp(s, p)
  return finish(key, s, p, now, {held = 0, x = now + p.grace, demand = 0},
    {credit, 0, s.tok, 0, now})
end

local function exact(keys, args)
  local p = params(args)
  local cost = int(args[9], 'cost', MAX)
  if cost == 0 then fail('LH_ARG invalid argument cost = 0') end
  if cost > p.cap then
    fail('LH_CAPACITY ' .. fmt(cost) .. ' tokens requested, but the bucket holds at most ' .. fmt(p.cap))
  end
  local key = keys[1]
  local s, rec, now, replay = begin(key, p)
  if replay then return replay end
  rec = advance(key, s, p, now, rec)
  local granted, retry = 0, 0
  if s.tok >= cost then
    s.tok, granted = s.tok - cost, cost
  else
    retry = time_until(s, cost, p)
  end
  local x = now + p.grace
  if rec and rec.x > x then x = rec.x end
  return finish(key, s, p, now,
    {held = rec and rec.held or 0, x = x, demand = rec and rec.demand or 0},
    {granted, 0, s.tok, retry, now})
end

redis.register_function('lh_acquire', acquire)
redis.register_function('lh_release', release)
redis.register_function('lh_exact', exact)

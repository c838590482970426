#!lua name=leasehold
--
-- Leasehold global bucket protocol, version 1: the only code that mutates global state.
--
-- Each function touches exactly one key, KEYS[1], holding one bucket (invariant I7), and
-- uses only the Redis server clock (I5); lh_exact_batch, the batch of cold decisions, touches each of its keys as lh_exact would, each only from its own
-- state. A bucket is a hash, or, while it has no lease record, demand or split and only
-- a batch has written it, a compact string (COMPACT below: two commands a decision
-- instead of three, and no field table); any other function turns it into the hash. It is the twin of
-- crates/lease-core/src/model/; the differential tests hold them to the same replies
-- and the same stored values. Numbers are integers below 2^53 (rules are validated so);
-- division goes through divmod() because Lua divides in floating point, and numbers are
-- written with %d because Redis would otherwise format them with 14 digits.
--
-- ARGV: capacity, rate_tokens, rate_period_us, lease_ttl_us, grace_us, max_outstanding
--       (0 = strict), agent (hex), seq, part_gen, part_until, part_tokens,
--       part_outstanding, part_drop (all 0 unless the key is a part of a split bucket; on
--       a region's bucket, lh:{RULE|SUBJECT|region}: floor_tokens, floor_period_us,
--       floor_burst, 0, 0, all 0 for no floor), then per function:
--   lh_acquire: held, want, min, demand     lh_release: returned     lh_exact: cost
--   lh_split: parts, salt, until_us         lh_deposit: tokens, until_us, rate_milli
--   lh_rate: held, want, tokens, demand
--   Agents send every one of these as lh_call (at the end of this file), its numbers
--   packed; the decimal functions are the same operations in a form tests and redis-cli
--   can type.
-- A region's bucket (model/region.rs) starts empty and refills nothing during its term
-- (ru): its broker's deposits feed it, once per seq (rq, the grant's global time); at the
-- term's end what is left is void, and then it refills at its floor only.
-- Reply: {granted, ttl_us, remaining, retry_us, now_us, scale_ppm, moved,
--         split_parts, split_salt, split_gen, split_until, split_tokens,
--         split_outstanding, split_drop, burst (a rate lease's, 0 without a share)}

local MAX = 9007199254740991
local MAX_HELD = 1099511627776
local MAX_UNITS = 4503599627370496
local MAX_PARTS = 64
local RESERVATION = '0000000000000000'
-- A record's demand stops counting this long after the agent's last call (model/mod.rs).
local DEMAND_TTL = 1000000

local function fail(msg)
  error({err = msg})
end

-- An argument as it may appear in an error: at most 64 bytes of it.
local function clip(v)
  local text = tostring(v)
  if #text > 64 then return string.sub(text, 1, 64) .. '... (' .. #text .. ' bytes)' end
  return text
end

-- A plain decimal integer (no sign, exponent, hex, space or fraction), at most max.
local function int(v, what, max)
  local n = nil
  if type(v) == 'string' and #v <= 16 and string.match(v, '^%d+$') then n = tonumber(v) end
  if n == nil or n > max then
    fail('LH_ARG invalid argument ' .. what .. ' = ' .. clip(v))
  end
  return n
end

local function fmt(n)
  return string.format('%d', n)
end

local function divmod(a, b)
  -- Lua's % is a - floor(a / b) * b, in the VM (math.floor is a C call, about as costly
  -- as the rest of a refill); the quotient a - r is an exact multiple of b.
  local r = a % b
  if r < 0 then
    r = r + b
  elseif r >= b then
    r = r - b
  end
  return (a - r) / b, r
end

local function ceil_div(a, b)
  local q, r = divmod(a, b)
  if r > 0 then return q + 1 end
  return q
end

-- The common arguments but the agent, in order, with their names and bounds.
local COMMON = {{'capacity', MAX}, {'rate_tokens', MAX}, {'rate_period_us', MAX},
  {'lease_ttl_us', MAX}, {'grace_us', MAX}, {'max_outstanding', MAX}, {'seq', MAX},
  {'part_gen', MAX}, {'part_until', MAX}, {'part_tokens', MAX},
  {'part_outstanding', MAX_HELD}, {'part_drop', MAX}}

-- Agent ids seen valid, up to AGENTS_KEPT of them (then forgotten all at once): matching
-- the pattern costs a batch of one key a hundredth of its work, and an acquire 1%.
local agents_seen, agents_kept, AGENTS_KEPT = {}, 0, 4096

-- id, if it is an agent's: 1 to 32 hex digits.
local function agent(id)
  if agents_seen[id] then return id end
  if type(id) ~= 'string' or #id < 1 or #id > 32 or not string.find(id, '^%x+$') then
    fail('LH_ARG invalid argument agent = ' .. clip(id))
  end
  if agents_kept >= AGENTS_KEPT then agents_seen, agents_kept = {}, 0 end
  agents_seen[id], agents_kept = true, agents_kept + 1
  return id
end

-- The parameters of a call of agent id from the common numbers v[o + 1 .. o + 12]
-- (COMMON, each already within its bound).
local function params_of(id, v, o)
  local p = {cap = v[o + 1], n = v[o + 2], per = v[o + 3], ttl = v[o + 4], grace = v[o + 5],
    maxout = v[o + 6], id = id, seq = v[o + 7], pgen = v[o + 8], puntil = v[o + 9],
    ptok = v[o + 10], pout = v[o + 11], pdrop = v[o + 12]}
  if p.cap < 1 or p.n < 1 or p.per < 1 or p.cap * p.per + p.n > MAX_UNITS then
    fail('LH_ARG invalid bucket parameters: capacity ' .. fmt(p.cap) ..
      ', rate ' .. fmt(p.n) .. '/' .. fmt(p.per) .. 'us')
  end
  agent(id)
  return p
end

-- The parameters of a call with decimal arguments (ARGV above).
local function params(args)
  local v = {}
  for i = 1, 6 do v[i] = int(args[i], COMMON[i][1], COMMON[i][2]) end
  for i = 7, 12 do v[i] = int(args[i + 1], COMMON[i][1], COMMON[i][2]) end
  return params_of(args[7], v, 0)
end

-- The library functions a batch calls per key, as locals (set by the first call, see
-- entry: a library's loading cannot reach them): each use of `redis.call` or
-- `string.find` is two table lookups, and a batch of 16 keys made about 900 of them
-- (scripts/lua-cost: 37 067 -> 36 100 instructions a decision).
local sfind, rcall, spack, sunpack, ssub = nil, nil, nil, nil, nil

-- Whether key is a bucket key as key.rs builds it, lh:{RULE|SUBJECT}.
local function bucket_key(key)
  return #key <= 512 and sfind(key, '^lh:{[%w%._%-]+|[^{}|]+}$') ~= nil
end

-- Plain bucket keys seen valid, kept as agents_seen are: a hot key's calls match the
-- pattern once (it cost an acquire 2%).
local plain_seen, plain_kept, PLAIN_KEPT = {}, 0, 4096

-- The one key a call may touch (I7): a bucket key as key.rs builds it, lh:{RULE|SUBJECT},
-- a split part's, lh:{RULE|SUBJECT|SALT.PART}, or a region's, lh:{RULE|SUBJECT|region}.
-- Part arguments come with a part key and only with one; a region's key takes its floor
-- there instead. Checked before anything is read or written, so a foreign key (an
-- application's hash, say) is never touched.
local function the_key(keys, p)
  if #keys ~= 1 then fail('LH_ARG exactly one key expected, got ' .. #keys) end
  local key = keys[1]
  -- string.find, not match: it allocates no copy of the key.
  local short = #key <= 512
  local plain = plain_seen[key]
  if not plain then
    plain = short and string.find(key, '^lh:{[%w%._%-]+|[^{}|]+}$') ~= nil
    if plain then
      if plain_kept >= PLAIN_KEPT then plain_seen, plain_kept = {}, 0 end
      plain_seen[key], plain_kept = true, plain_kept + 1
    end
  end
  local part = short and not plain and
    string.find(key, '^lh:{[%w%._%-]+|[^{}|]+|%d+%.%d+}$') ~= nil
  local region = short and not plain and not part and
    string.find(key, '^lh:{[%w%._%-]+|[^{}|]+|region}$') ~= nil
  if not (plain or part or region) then
    fail('LH_ARG not a bucket key: ' .. clip(key))
  end
  if region then
    -- The floor: tokens per period and its burst, or nothing.
    local fn, fper, fb = p.pgen, p.puntil, p.ptok
    local none = fn == 0 and fper == 0 and fb == 0
    if p.pout ~= 0 or p.pdrop ~= 0 or not (none or (fn >= 1 and fper >= 1 and fb >= 1 and
        fb * fper + fn <= MAX_UNITS)) then
      fail('LH_ARG invalid floor of a region\'s bucket: ' .. fmt(fn) .. '/' .. fmt(fper) ..
        'us, burst ' .. fmt(fb))
    end
    p.region = true
    if not none then p.fn, p.fper, p.fb = fn, fper, fb end
    p.pgen, p.puntil, p.ptok = 0, 0, 0
    return key
  end
  local seeded = p.pgen ~= 0 or p.puntil ~= 0 or p.ptok ~= 0 or p.pout ~= 0 or p.pdrop ~= 0
  if part and not seeded then
    fail('LH_ARG a part key needs its split (part_gen) arguments: ' .. clip(key))
  elseif seeded and not part then
    fail('LH_ARG split part arguments on a key that is not a part: ' .. clip(key))
  end
  return key
end

local function capped(c, p, out)
  if p.maxout == 0 then return math.max(c - out, 0) end
  return c
end

local function cap_of(p, out)
  return capped(p.cap, p, out)
end

-- Level::refill on locals: tok and its carry car after dt µs (at least 0) at n tokens per
-- `per` µs, up to cap. (decide_levels has it inline: a call costs a batch's key as much.)
local function refilled(tok, car, dt, cap, n, per)
  if tok >= cap or dt >= ceil_div((cap - tok) * per - car, n) then return cap, 0 end
  local q, r = divmod(car + n * dt, per)
  return tok + q, r
end

-- Level::refill at n tokens per `per` µs.
local function refill_at(s, n, per, cap, dt)
  s.tok, s.car = refilled(s.tok, s.car, dt, cap, n, per)
end

local function refill(s, p, cap, dt)
  refill_at(s, p.n, p.per, cap, dt)
end

-- Level::refill_scaled: at n 1/scale-ths of a token per `per` µs (what rate leases leave
-- of the rate), the carry still in 1/per units, rounded down.
local function refill_scaled(s, n, per, scale, cap, dt)
  if s.tok >= cap then
    s.tok, s.car = cap, 0
    return
  end
  if n == 0 then return end
  local need = ((cap - s.tok) * per - s.car) * scale
  if dt >= ceil_div(need, n) then
    s.tok, s.car = cap, 0
    return
  end
  local q, r = divmod(s.car * scale + n * dt, per * scale)
  s.tok, s.car = s.tok + q, divmod(r, scale)
end

-- state.rs, rate_scale: rate-lease shares are 1/scale-ths of a token per rate period, the
-- finest power of ten up to 10^9 keeping the refill exact; 0 below 10^3.
local function rate_scale(p)
  -- Worked out once per call (a rate lease's call asks for it up to six times).
  if p.scale then return p.scale end
  local x = p.cap * p.per + p.n
  local scale = 1000000000
  while scale >= 1000 and x > divmod(MAX, scale) do scale = scale / 10 end
  if scale < 1000 then scale = 0 end
  p.scale = scale
  return scale
end

-- Whether a region's bucket is within its term (brought up to date).
local function in_term(s)
  return s.ts < s.ru
end

-- A region's bucket refills nothing during its term; at its end what is left is void, and
-- from then it refills at its floor (state.rs, refill_to).
local function refill_to(s, p, t)
  if not p.region then
    local cap, dt = cap_of(p, s.out), math.max(t - s.ts, 0)
    if s.sn > 0 then
      local scale = rate_scale(p)
      if scale ~= 0 then
        refill_scaled(s, math.max(p.n * scale - s.sh, 0), p.per, scale, cap, dt)
      end
    else
      refill(s, p, cap, dt)
    end
    s.ts = math.max(s.ts, t)
    return
  end
  if s.ts < s.ru then
    if t < s.ru then
      s.ts = t
      return
    end
    s.tok, s.car = 0, 0
    s.ts = s.ru
  end
  if p.fn then refill_at(s, p.fn, p.fper, capped(p.fb, p, s.out), math.max(t - s.ts, 0)) end
  s.ts = math.max(s.ts, t)
end

local function clamp(s, p)
  local cap
  if p.region and not in_term(s) then cap = capped(p.fb or 0, p, s.out) else cap = cap_of(p, s.out) end
  if s.tok >= cap then s.tok, s.car = cap, 0 end
end

-- Level::time_until on locals: µs until a level of tok (carry car) holds k, at n tokens
-- per `per` µs (0 when it does).
local function until_holds(tok, car, k, per, n)
  if tok >= k then return 0 end
  return ceil_div((k - tok) * per - car, n)
end

-- Level::time_until
local function time_until(s, k, p)
  return until_holds(s.tok, s.car, k, p.per, p.n)
end

-- What a region's bucket tells a denial to wait when only a deposit can help (µs).
local REGION_WAIT = 10000

-- BucketState::wait_for: a denial's retry time.
local function wait_for(s, p, k)
  if not p.region and s.sn > 0 then
    -- At the rate the leases leave; with none left, from the next record drop on.
    if s.tok >= k then return 0 end
    local scale = rate_scale(p)
    local n = math.max(p.n * scale - s.sh, 0)
    if n == 0 or scale == 0 then return math.max(s.nexp - s.ts, 0) + time_until(s, k, p) end
    return ceil_div(((k - s.tok) * p.per - s.car) * scale, n)
  end
  if not p.region then return time_until(s, k, p) end
  if s.tok >= k then return 0 end
  if p.fn and not in_term(s) and k <= p.fb then
    return math.min(ceil_div((k - s.tok) * p.fper - s.car, p.fn), REGION_WAIT)
  end
  return REGION_WAIT
end

-- BucketState::time_to_rest: until the bucket holds what an absent key does.
local function time_to_rest(s, p)
  if not p.region then return time_until(s, p.cap, p) end
  if not p.fn then return 0 end
  local tok, car = s.tok, s.car
  if in_term(s) then tok, car = 0, 0 end
  if tok >= p.fb then return 0 end
  return ceil_div((p.fb - tok) * p.fper - car, p.fn)
end

-- The period a bucket's carry is counted in.
local function carry_period(p)
  return p.fper or p.per
end

local function no_split()
  return {parts = 0, salt = 0, gen = 0, untl = 0, tok = 0, out = 0, drop = 0}
end
-- No split, shared: a state's split is replaced, never changed in place, while it has no
-- parts.
local NO_SPLIT = no_split()

-- struct formats of n little-endian unsigned 64-bit integers, made once each.
-- The first FORMATS_KEPT are kept; a longer one is made each time (a batch's arguments
-- can number thousands).
local FORMATS, FORMATS_KEPT = {}, 256
-- A 64-bit unsigned integer in struct's formats: its unsigned long where that is 64 bits (a
-- 64-bit Redis), the same bytes as I8 read and written without parsing the 8 each time (a
-- tenth of a key's decision). Set, with the formats made of it, by the first call (a
-- library's loading cannot use struct): see entry.
local U64 = nil
local function format_of(n)
  local f = FORMATS[n]
  if not f then
    f = '<' .. string.rep(U64, n)
    if n <= FORMATS_KEPT then FORMATS[n] = f end
  end
  return f
end

-- A compact bucket: the 42-byte string that an exact batch keeps for a key with no lease
-- record, demand or split: the tag 'L1', then tok, car, ts and p (the fields of those
-- names; every other field is 0) and the key's expiry as last set (ms, its PXAT) as
-- little-endian unsigned 64-bit integers. struct packs and reads it for a tenth of what
-- decimal text costs in Lua (wire.rs, compact_value). A write whose expiry the key's
-- already covers keeps it: SETRANGE rewrites the string in place, its expiry untouched
-- (about 5 000 instructions less than SET ... PXAT on Redis 7.0, 1 300 less than SET ...
-- KEEPTTL, whose GET reply is a string for Lua), and a batch rewrites only the level
-- (LEVEL: tok, car and ts, at offset 2) when the period is the same; one that does not
-- sets it a slack beyond (keep_slack: ten graces, at most 10 s). The 34-byte form before
-- the expiry was kept is read as one whose expiry covers nothing. (Offsets go to Redis
-- as text: a Lua number argument is formatted with %.17g, 1 800 instructions.)
local COMPACT, COMPACT_OLD, LEVEL = nil, nil, nil
local COMPACT_TAG = 'L1'

-- A compact bucket's numbers: tok, car, ts, p, and the expiry it keeps (0: none known).
local function compact_of(key, v)
  local tag, a, b, c, d, e = nil, nil, nil, nil, nil, 0
  if #v == 42 then
    tag, a, b, c, d, e = struct.unpack(COMPACT, v)
  elseif #v == 34 then
    tag, a, b, c, d = struct.unpack(COMPACT_OLD, v)
  end
  if tag ~= COMPACT_TAG then fail('LH_ARG not a bucket: ' .. clip(key) .. ' holds another string') end
  return a, b, c, d, e
end

-- The slack of a compact key's expiry beyond what it must cover: ten of the rule's
-- graces, at most KEEP_SLACK_MAX (10 s at the default grace), ms. A key decided again
-- within it (a tenant's next request, mostly) keeps its expiry and is not made again;
-- Redis expires fewer keys (with half a grace, 1.5 s, long-tail-store's Redis expired a
-- key for every second decision, and its expiry cycle held it up to 25 ms ten times a
-- second). The bound keeps a rule with a long grace from holding idle tenants for hours.
local KEEP_SLACK_MAX = 10000
local function keep_slack(grace)
  return math.min((grace - grace % 100) / 100, KEEP_SLACK_MAX)
end

-- A state at level tok (carry car in period per) at ts, with nothing else: no lease,
-- demand, split or term.
local function level_state(tok, car, per, ts)
  return {tok = tok, car = car, p = per, ts = ts, out = 0, nexp = 0, mx = 0, ds = 0, sg = 0,
          dx = 0, pg = 0, pu = 0, ru = 0, rq = 0, rr = 0, sh = 0, sn = 0, su = 0,
          split = NO_SPLIT}
end

local function fresh(p, now)
  local tok = p.cap
  if p.region then tok = 0 end
  return level_state(tok, 0, carry_period(p), now)
end

-- A bucket's hash: its state in one field, STATE, and each agent's record in the field
-- named by the agent's id, each a string of little-endian unsigned 64-bit integers that
-- struct reads and writes at a fraction of what decimal text costs (an acquire reads
-- and writes two fields instead of 21 and 15). STATE: tok car p ts out nexp mx ds dx sg
-- ru rq rr, the split in force (parts salt until tokens outstanding drop; parts 0: none),
-- the part's (pg pu) and, while rate leases hold part of the rate, sh sn su (their shares,
-- how many records have one, and the unit they are in).
-- A record: held x seq demand credit, q (its rate lease's share) when it has one, then the
-- agent's last reply (7 numbers, or 14 while a split is in force). wire.rs, bucket_fields, reads
-- both as the fields of leasehold_core::schema.
local STATE = 'st'
local STATE_FORMAT = nil
local STATE_LEN = 168
local SHARED_FORMAT = nil
local SHARED_LEN = 192
-- The reply a record holds before any: none.
local NO_REPLY = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}

local function bad_bucket(key)
  fail('LH_ARG not a bucket: ' .. clip(key) .. ' holds a hash of other fields')
end

-- The furthest a bucket's clock (ts) may be ahead of the server's. A failover to a node
-- whose clock is behind explains seconds; a value a day ahead was not written by this
-- library (read as a bucket, it would never refill).
local MAX_AHEAD = 86400000000

local function check_clock(key, ts, server_now)
  if ts > server_now + MAX_AHEAD then
    fail('LH_ARG not a bucket: ' .. clip(key) .. ' holds a clock ' ..
      fmt(divmod(ts - server_now, 1000000)) .. " s ahead of the server's")
  end
end

local function state_of(key, v)
  local tok, car, per, ts, out, nexp, mx, ds, dx, sg, ru, rq, rr, parts, salt, untl, stok,
    sout, drop, pg, pu, sh, sn, su
  if #v == STATE_LEN then
    tok, car, per, ts, out, nexp, mx, ds, dx, sg, ru, rq, rr, parts, salt, untl, stok,
      sout, drop, pg, pu = struct.unpack(STATE_FORMAT, v)
    sh, sn, su = 0, 0, 0
  elseif #v == SHARED_LEN then
    tok, car, per, ts, out, nexp, mx, ds, dx, sg, ru, rq, rr, parts, salt, untl, stok,
      sout, drop, pg, pu, sh, sn, su = struct.unpack(SHARED_FORMAT, v)
  else
    bad_bucket(key)
  end
  local s = {tok = tok, car = car, p = per, ts = ts, out = out, nexp = nexp, mx = mx, ds = ds,
    dx = dx, sg = sg, ru = ru, rq = rq, rr = rr, pg = pg, pu = pu, sh = sh, sn = sn, su = su,
    split = NO_SPLIT}
  if parts ~= 0 then
    s.split = {parts = parts, salt = salt, gen = sg, untl = untl, tok = stok, out = sout,
               drop = drop}
  end
  return s
end

local function pack_state(s)
  local sp = s.split
  if s.sn > 0 then
    return struct.pack(SHARED_FORMAT, s.tok, s.car, s.p, s.ts, s.out, s.nexp, s.mx, s.ds,
      s.dx, s.sg, s.ru, s.rq, s.rr, sp.parts, sp.salt, sp.untl, sp.tok, sp.out, sp.drop, s.pg,
      s.pu, s.sh, s.sn, s.su)
  end
  return struct.pack(STATE_FORMAT, s.tok, s.car, s.p, s.ts, s.out, s.nexp, s.mx, s.ds, s.dx,
    s.sg, s.ru, s.rq, s.rr, sp.parts, sp.salt, sp.untl, sp.tok, sp.out, sp.drop, s.pg, s.pu)
end

-- The first 11 numbers of a record: enough for its time of last call (advance).
local HEAD_FORMAT = nil
-- A plain record: held x seq demand credit and a reply of 7.
local RECORD_FORMAT = nil
-- A state's first nine numbers (tok .. dx).
local HEAD9_FORMAT = nil
-- Eight packed zeros.
local ZEROS8 = nil
-- A dedup record's seq (see BATCH_TAG).
local SEQ_FORMAT = nil

local function record_of(key, v)
  local n = #v / 8
  if n ~= 12 and n ~= 19 and n ~= 13 and n ~= 20 then bad_bucket(key) end
  -- Into locals, the tables made whole at once (a table grown one field at a time is
  -- rehashed at every power of two).
  local held, x, seq, demand, credit, r1, r2, r3, r4, r5, r6, r7, r8, r9, r10, r11, r12, r13,
    r14, r15 = struct.unpack(format_of(n), v)
  local q = 0
  if n == 13 or n == 20 then
    -- A rate lease's record: its share before the reply.
    q, r1, r2, r3, r4, r5, r6, r7, r8, r9, r10, r11, r12, r13, r14 =
      r1, r2, r3, r4, r5, r6, r7, r8, r9, r10, r11, r12, r13, r14, r15
  end
  if n == 12 or n == 13 then r8, r9, r10, r11, r12, r13, r14 = 0, 0, 0, 0, 0, 0, 0 end
  return {held = held, x = x, seq = seq, demand = demand, credit = credit, q = q,
          reply = {r1, r2, r3, r4, r5, r6, r7, r8, r9, r10, r11, r12, r13, r14, 0}}
end

local function pack_record(held, x, seq, demand, credit, q, reply)
  local n = 14
  if reply[8] == 0 then n = 7 end
  if q > 0 then
    return struct.pack(format_of(6 + n), held, x, seq, demand, credit, q, unpack(reply, 1, n))
  end
  return struct.pack(format_of(5 + n), held, x, seq, demand, credit, unpack(reply, 1, n))
end

-- Loads the bucket and the agent's record (none for a deposit, which has no record);
-- returns (state, record, now, replay).
-- The server's time and the key's STATE and agent fields (an error table when the key is
-- not a hash).
local function read_bucket(key, p)
  local t = rcall('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2]), redis.pcall('HMGET', key, STATE, p.id)
end

local function begin(key, p, norecord, server_now, f)
  if not server_now then server_now, f = read_bucket(key, p) end
  local s
  if f.err then
    -- Not a hash: a compact bucket (GET raises WRONGTYPE for anything else). It becomes
    -- a hash when this call writes it.
    local tok, car, ts, per = compact_of(key, redis.call('GET', key))
    s = level_state(tok, car, per, ts)
    s.compact = true
    f = {}
  else
    if not f[1] then
      -- No state: a new key; any other hash is not ours.
      local exists = redis.call('EXISTS', key)
      if exists == 1 then bad_bucket(key) end
    end
    if f[1] then s = state_of(key, f[1]) end
  end
  if s then
    check_clock(key, s.ts, server_now)
  else
    s = fresh(p, server_now)
    s.created = true
  end
  local now = math.max(server_now, s.ts)
  local rec = nil
  if f[2] and not norecord then
    rec = record_of(key, f[2])
    if rec.x > now then
      if p.seq == rec.seq then
        -- The reply's burst is not stored: it is the record's (finish).
        if rec.q > 0 then rec.reply[15] = rec.held end
        return s, rec, now, rec.reply
      end
      if p.seq < rec.seq then
        fail('LH_STALE sequence ' .. fmt(p.seq) .. ' is older than the last one seen (' ..
          fmt(rec.seq) .. ')')
      end
    end
  end
  return s, rec, now, nil
end

-- state.rs, remove_share / add_share: a record's share stops or starts counting.
local function remove_share(s, q)
  if q == 0 then return end
  s.sn = s.sn - 1
  s.sh = math.max(s.sh - q, 0)
  if s.sn == 0 then s.sh, s.su = 0, 0 end
end

local function add_share(s, p, q)
  if q == 0 then return end
  s.sn = s.sn + 1
  s.sh = s.sh + q
  s.su = p.per * rate_scale(p)
end

-- Refills to now, dropping expired agent records in time order; returns the agent's
-- record if it is still there.
local function advance(key, s, p, now, rec)
  -- Shares counted in another unit (the rule changed): they hold the whole rate until
  -- their records drop.
  if s.sn > 0 then
    local scale = rate_scale(p)
    if p.per * scale ~= s.su then
      s.sh, s.su = p.n * scale, p.per * scale
    end
  end
  if s.p ~= carry_period(p) then
    s.car, s.p = 0, carry_period(p)
  end
  -- A split parent refills nothing during the term: its rate belongs to the parts.
  if s.split.parts ~= 0 then
    if now < s.split.untl then
      s.ts = now
    else
      s.ts = math.max(s.ts, s.split.untl)
      s.split = NO_SPLIT
    end
  end
  local stale_due = s.dx ~= 0 and now >= s.dx
  local drop_due = s.nexp ~= 0 and now >= s.nexp
  local expired, dx, nexp, mx = {}, 0, 0, 0
  if stale_due or drop_due then
    -- One pass over the records, each read only as far as its time of last call (a key
    -- held by a thousand agents: a table per record would cost more than the rest).
    local all = redis.call('HGETALL', key)
    for i = 1, #all, 2 do
      local aid = all[i]
      if aid ~= STATE and string.find(aid, '^%x+$') then
        local v = all[i + 1]
        local n = #v / 8
        if n ~= 12 and n ~= 19 and n ~= 13 and n ~= 20 then bad_bucket(key) end
        local held, x, _, demand, _, f6, _, _, _, f10, f11 = struct.unpack(HEAD_FORMAT, v)
        -- A rate lease's record has its share before the reply, whose fifth number is
        -- the time of the call.
        local q, at = 0, f10
        if n == 13 or n == 20 then q, at = f6, f11 end
        -- Demand of agents silent for DEMAND_TTL stops counting in the shares; a rate
        -- lease's demand counts until its record drops.
        if stale_due and demand > 0 and q == 0 then
          if at + DEMAND_TTL <= now then
            s.ds = s.ds - demand
            demand = 0
            local r = record_of(key, v)
            redis.call('HSET', key, aid, pack_record(r.held, r.x, r.seq, 0, r.credit, 0, r.reply))
            if rec and aid == p.id then rec.demand = 0 end
          else
            local t = at + DEMAND_TTL
            if dx == 0 then dx = t else dx = math.min(dx, t) end
          end
        end
        if drop_due then
          if x <= now then
            expired[#expired + 1] = {x = x, id = aid, h = held, d = demand, q = q}
          else
            if nexp == 0 then nexp = x else nexp = math.min(nexp, x) end
            mx = math.max(mx, x)
          end
        end
      end
    end
  end
  if stale_due then s.dx = dx end
  if drop_due then
    table.sort(expired, function(a, b)
      if a.x ~= b.x then return a.x < b.x end
      return a.id < b.id
    end)
    for _, e in ipairs(expired) do
      refill_to(s, p, e.x)
      s.out = s.out - e.h
      s.ds = s.ds - e.d
      remove_share(s, e.q)
      redis.call('HDEL', key, e.id)
      if e.id == p.id then rec = nil end
    end
    -- The next look for records to drop: the earliest one's drop time, but not within a
    -- quarter of the grace of this one: a key held by many agents, whose records drop one
    -- after another, would otherwise read them all on most calls. A record dropped late is
    -- dropped as of its own time, the level having refilled meanwhile as if it still held
    -- its share and its tokens: lateness only under-admits.
    if nexp ~= 0 then nexp = math.max(nexp, now + math.floor(p.grace / 4)) end
    s.nexp, s.mx = nexp, mx
  end
  refill_to(s, p, now)
  return rec
end

-- Stores the state and the agent's record, and sets the key to expire only once every
-- record is dropped, the split's term is over, and the bucket would be full again (I6).
local function finish(key, s, p, now, rec, reply)
  reply[8], reply[9], reply[10], reply[11] = s.split.parts, s.split.salt, s.split.gen, s.split.untl
  reply[12], reply[13], reply[14] = s.split.tok, s.split.out, s.split.drop
  if rec then
    reply[3] = s.tok
    -- A rate lease's burst: the record's, as a replay reads it (record_of).
    if rec.q > 0 then reply[15] = rec.held end
    local x = rec.x
    if s.nexp == 0 then s.nexp = x else s.nexp = math.min(s.nexp, x) end
    s.mx = math.max(s.mx, x)
    if rec.demand > 0 and rec.q == 0 then
      local t = now + DEMAND_TTL
      if s.dx == 0 then s.dx = t else s.dx = math.min(s.dx, t) end
    end
  end
  if s.compact then
    -- A compact bucket becomes the hash.
    redis.call('DEL', key)
  end
  if rec then
    redis.call('HSET', key, STATE, pack_state(s), p.id,
      pack_record(rec.held, rec.x, p.seq, rec.demand, rec.credit, rec.q, reply))
  else
    redis.call('HSET', key, STATE, pack_state(s))
  end
  local sp = s.split
  local busy = math.max(s.mx, sp.untl, s.ru)
  -- A deposit leaves no record; the key stays a grace after it as after any call.
  if not rec then busy = math.max(busy, now + p.grace) end
  local life = math.max(busy - now, 0) + time_to_rest(s, p)
  local at_ms = divmod(now + life, 1000) + 1
  redis.call('PEXPIREAT', key, fmt(at_ms))
  return reply
end

-- A part's first call of a newer split starts it from its seed: its share of the
-- parent's tokens, and a reservation of its share of the parent's outstanding tokens
-- until they drop. Whatever an older split left is void (that split's term is over).
local function seed_part(key, s, p, now, rec)
  if p.pgen == 0 then return s, rec end
  if s.pg < p.pgen then
    redis.call('DEL', key)
    s = fresh(p, now)
    s.pg, s.pu = p.pgen, p.puntil
    if p.pout > 0 and p.pdrop > now then
      s.out, s.nexp, s.mx = p.pout, p.pdrop, p.pdrop
      redis.call('HSET', key, RESERVATION, pack_record(p.pout, p.pdrop, 0, 0, 0, 0, NO_REPLY))
    end
    s.tok = p.ptok
    clamp(s, p)
    return s, nil
  end
  if s.pg == p.pgen then s.pu = math.max(s.pu, p.puntil) end
  return s, rec
end

-- Common start of every operation: returns (state, record, now, moved, ttl) or a replay.
local function open(key, p, norecord, server_now, f)
  local s, rec, now, replay = begin(key, p, norecord, server_now, f)
  if replay then return nil, nil, now, replay end
  s, rec = seed_part(key, s, p, now, rec)
  rec = advance(key, s, p, now, rec)
  return s, rec, now, nil
end

local function where(s, p, now)
  local moved = s.split.parts ~= 0 or (s.pg ~= 0 and now >= s.pu)
  local ttl = p.ttl
  if s.pg ~= 0 then
    ttl = math.min(ttl, math.max(s.pu - (now + p.grace), 0))
  elseif p.region and in_term(s) then
    -- A lease from a region's bucket ends with its term.
    ttl = math.min(ttl, math.max(s.ru - (now + p.grace), 0))
  end
  return moved, ttl
end

-- r / demand_sum in millionths, at most one (proportional share; whole for an agent
-- alone with demand); floating point with the same operations as the model, so both
-- round alike.
local function scale_ppm(p, rr, ds, demand)
  if ds <= demand then return 1000000 end
  local x
  if rr > 0 then x = rr * 1e6 / ds else x = (p.n * 1e15) / (p.per * ds) end
  if x > 1e6 then x = 1e6 end
  return math.floor(x)
end

-- A full allowance: the whole capacity, in thousandths.
local function full_credit(p)
  return p.cap * 1000
end

-- The credit an operation that grants nothing leaves the agent: what it had, or full.
local function kept_credit(rec, p)
  if rec then return rec.credit end
  return full_credit(p)
end

-- Tokens piling up past this level (B/8) mean the agents with credit are not taking
-- them: proportional share stops binding (model/share.rs, plenty_level).
local function plenty_level(p)
  return ceil_div(p.cap, 8)
end

-- Proportional share, enforced (model/share.rs, Allowance): while the key is contended an
-- agent earns r * share tokens a second, banks at most B * share, and grants spend it.
-- credit and at: the agent's record's credit and time of its last call (credit nil: no
-- record). Returns its credit (thousandths of a token) and what it earns a µs, or nil.
local function allowance(p, rr, ds, demand, scale, min, credit, at, now)
  if scale >= 1000000 then return nil, nil end
  -- 1% of the sum for an agent reporting no demand yet (model/share.rs, Allowance::new).
  local share = demand
  if demand == 0 then share = math.ceil(ds / 100) end
  -- Thousandths of a token per us: the rule's rate, or the region's (share.rs).
  local rate_us
  if rr > 0 then rate_us = rr / 1e6 else rate_us = p.n * 1000 / p.per end
  local per_us = rate_us * share / ds
  local cap = math.max(min * 1000, math.floor(p.cap * 1000 * share / ds))
  local banked, elapsed = cap, 0
  if credit then
    banked = credit
    elapsed = math.max(now - at, 0)
  end
  return math.min(banked + math.floor(elapsed * per_us), cap), per_us
end

local function new_reply(now, moved)
  local m = 0
  if moved then m = 1 end
  return {0, 0, 0, 0, now, 0, m, 0, 0, 0, 0, 0, 0, 0, 0}
end

-- acquire's common case, on locals: a plain key (no part, no region) whose hash holds a
-- state no rate lease shares, with no split, part or region term, nothing due to drop
-- or to go stale, and the agent's record a plain one (no share, no split in its reply)
-- or none, the call not a replay. Every step is the general path's (advance, acquire,
-- finish) with what those conditions make zero left out; returns its reply packed, or
-- nil having written nothing, for the general path. (The general path's tables, a
-- state's, a record's and their replies', cost an acquire a fifth of its instructions:
-- 192 900 -> 153 300 replaying a second of zipf-store's acquires, 151 600 calling the
-- helpers below rather than writing them out. differential.rs holds both paths to the
-- model.)
local function acquire_plain(key, p, held, want, min, demand, server_now, f)
  local v = f[1]
  if f.err or not v or #v ~= STATE_LEN then return nil end
  local tok, car, per, ts, out, nexp, mx, ds, dx, _, ru, _, rr, parts, salt, untl, stok, sout,
    drop, pg, pu = sunpack(STATE_FORMAT, v)
  if parts ~= 0 or pg ~= 0 or rr ~= 0 or ru ~= 0 or salt ~= 0 or untl ~= 0 or stok ~= 0 or
      sout ~= 0 or drop ~= 0 then
    return nil
  end
  check_clock(key, ts, server_now)
  local now = server_now
  if ts > now then now = ts end
  if (dx ~= 0 and now >= dx) or (nexp ~= 0 and now >= nexp) then return nil end
  local r, rheld, rdemand, rcredit, rat = f[2], 0, 0, 0, 0
  if r then
    if #r ~= 12 * 8 then return nil end
    local x, seq
    rheld, x, seq, rdemand, rcredit, _, _, _, _, rat = sunpack(RECORD_FORMAT, r)
    if x > now and p.seq <= seq then return nil end
  end
  local n, pper, maxout, ttl = p.n, p.per, p.maxout, p.ttl
  -- advance: a rule with another period restarts the carry; refill_to now.
  if per ~= pper then car, per = 0, pper end
  tok, car = refilled(tok, car, now - ts, cap_of(p, out), n, per)
  ts = now
  -- acquire: the agent's count replaces ours, then clamp.
  out = out - rheld + held
  ds = ds - rdemand + demand
  local cap = cap_of(p, out)
  if tok >= cap then tok, car = cap, 0 end
  local level = tok
  local scale = scale_ppm(p, 0, ds, demand)
  local earned, per_us = allowance(p, 0, ds, demand, scale, min, r and rcredit, rat, now)
  local avail = level
  if ttl == 0 then
    avail = 0
  elseif maxout ~= 0 then
    avail = math.min(level, math.max(maxout - out, 0))
  end
  local plenty = plenty_level(p)
  if earned and level < plenty then avail = math.min(avail, math.floor(earned / 1000)) end
  local g = math.min(want, avail)
  if g < min then g = 0 end
  tok, out = tok - g, out + g
  local credit = full_credit(p)
  if earned then
    earned = math.max(earned - g * 1000, 0)
    credit = earned
  end
  local wait = 0
  if g == 0 then
    if ttl == 0 then
      wait = math.max(pu - now, 1)
    else
      local blocked = 0
      if maxout ~= 0 and level >= min then blocked = math.max(nexp - now, 0) end
      local turn = 0
      if earned then
        local need = min * 1000 - earned
        if need <= 0 then need = min * 1000 end
        turn = math.min(math.ceil(need / per_us), until_holds(tok, car, plenty, per, n))
      end
      wait = math.max(until_holds(tok, car, min, per, n), blocked, turn, 1)
    end
  end
  -- finish
  local x = now + ttl + p.grace
  if nexp == 0 or x < nexp then nexp = x end
  if x > mx then mx = x end
  if demand > 0 then
    local t = now + DEMAND_TTL
    if dx == 0 or t < dx then dx = t end
  end
  -- The state's fields past dx are as read (sg, rq, pu; the rest 0).
  local rec = spack(RECORD_FORMAT, held + g, x, p.seq, demand, credit, g, ttl, tok, wait, now,
    scale, 0)
  rcall('HSET', key, STATE, spack(HEAD9_FORMAT, tok, car, per, ts, out, nexp, mx, ds, dx) ..
    ssub(v, 9 * 8 + 1), p.id, rec)
  local life = math.max(mx - now, 0) + until_holds(tok, car, p.cap, per, n)
  rcall('PEXPIREAT', key, fmt(divmod(now + life, 1000) + 1))
  -- The reply: the record's 7, then 8 zeros (see Reply), packed.
  return ssub(rec, 5 * 8 + 1) .. ZEROS8
end

local function acquire(keys, p, held, want, min, demand)
  if min == 0 then fail('LH_ARG invalid argument min = 0') end
  if min > p.cap then
    fail('LH_CAPACITY ' .. fmt(min) .. ' tokens requested, but the bucket holds at most ' .. fmt(p.cap))
  end
  if want < min or want > p.cap then fail('LH_ARG invalid argument want = ' .. fmt(want)) end
  local key = the_key(keys, p)
  local server_now, f = read_bucket(key, p)
  if not p.region and p.pgen == 0 then
    local reply = acquire_plain(key, p, held, want, min, demand, server_now, f)
    if reply then return reply end
  end
  local s, rec, now, replay = open(key, p, false, server_now, f)
  if replay then return replay end
  local moved, ttl = where(s, p, now)
  local prior_held = rec and rec.held or 0
  local prior_demand = rec and rec.demand or 0
  -- State-based report: the agent's own count replaces ours; declaring more than we
  -- knew (a grant lost in a failover) lowers the tokens instead of minting any.
  -- An agent holding tokens from, or measuring demand on, a bucket that no longer
  -- exists: the bucket was lost (evicted, flushed, or a replica promoted without it). It
  -- restarts empty, not full: what it handed out may all have been spent (model/ops.rs,
  -- acquire).
  if s.created and (held > 0 or demand > 0) then s.tok, s.car = 0, 0 end
  s.out = s.out - prior_held + held
  s.ds = s.ds - prior_demand + demand
  clamp(s, p)
  local tok = s.tok
  local scale = scale_ppm(p, s.rr, s.ds, demand)
  local earned, per_us = allowance(p, s.rr, s.ds, demand, scale, min, rec and rec.credit,
    rec and rec.reply[5], now)
  local avail = tok
  if moved or ttl == 0 then
    avail = 0
  elseif p.maxout ~= 0 then
    avail = math.min(tok, math.max(p.maxout - s.out, 0))
  end
  -- Work conserving: past the plenty level anyone may take tokens.
  local plenty = tok >= plenty_level(p)
  if earned and not plenty then avail = math.min(avail, math.floor(earned / 1000)) end
  local g = math.min(want, avail)
  if g < min then g = 0 end
  s.tok, s.out = s.tok - g, s.out + g
  local credit = full_credit(p)
  if earned then
    earned = math.max(earned - g * 1000, 0)
    credit = earned
  end
  local reply = new_reply(now, moved)
  if g == 0 then
    if moved then
      reply[4] = 1
    elseif ttl == 0 and p.region then
      reply[4] = REGION_WAIT
    elseif ttl == 0 then
      reply[4] = math.max(s.pu - now, 1)
    else
      local blocked = 0
      if p.maxout ~= 0 and tok >= min then blocked = math.max(s.nexp - now, 0) end
      local turn = 0
      if earned then
        -- An agent's turn comes when its share has earned min (model/share.rs, wait_us: with
        -- credit enough and the bucket short, the time its share takes to refill min),
        -- or when tokens pile up to plenty, whichever is first.
        local need = min * 1000 - earned
        if need <= 0 then need = min * 1000 end
        turn = math.min(math.ceil(need / per_us), wait_for(s, p, plenty_level(p)))
      end
      reply[4] = math.max(wait_for(s, p, min), blocked, turn, 1)
    end
  end
  reply[1], reply[2], reply[6] = g, ttl, scale
  -- A rate lease's share counts on until this record drops.
  return finish(key, s, p, now,
    {held = held + g, x = now + ttl + p.grace, demand = demand, credit = credit,
     q = rec and rec.q or 0}, reply)
end

-- A bucket may be leased by rate (ops.rs, validate_rate): strict mode, not a region's
-- bucket or a split's part, and a share scale of 10^3 at least (rate_scale).
local function rate_ok(p)
  if p.maxout ~= 0 then fail('LH_ARG invalid argument max_outstanding = ' .. fmt(p.maxout)) end
  if p.region then fail('LH_ARG invalid argument region = 1') end
  if p.pgen ~= 0 then fail('LH_ARG invalid argument part_gen = ' .. fmt(p.pgen)) end
  if rate_scale(p) == 0 then fail('LH_ARG invalid argument capacity = ' .. fmt(p.cap)) end
end

-- Headroom over an agent's demand in its share, while its proportional part is larger
-- (ops.rs, rate).
local RATE_HEADROOM = 1.25
-- The part of the rate the parts may fill with their headroom (ops.rs, RATE_ROOM).
local RATE_ROOM = 0.95

-- ops.rs, rate_term_us: the term of a rate lease while sn shares are live, twice as long
-- for a steady renewal (ops.rs, steady: it had a share, its demand is within a quarter of
-- the last one, and its share in the same proportion to it within an eighth).
local RATE_MIN_TERM_US = 400000
local RATE_TERM_PER_SHARE_US = 4000
local function rate_term(p, sn, steady)
  local per = RATE_TERM_PER_SHARE_US
  if steady then per = 2 * per end
  return math.min(p.ttl, math.max(RATE_MIN_TERM_US, sn * per))
end

-- lh_rate: a rate lease (ops.rs, rate): the agent declares its burst (held) and the whole
-- tokens in it, asks for a burst of want and a share of the rate sized by its demand, for
-- the rule's lease term. Reply: burst (15) = the burst, granted = tokens taken from the
-- level into it, remaining = the level left, ttl = the term, scale = the
-- share (1/scale-ths of a token per rate period, rate_scale), retry = 1 when other shares
-- hold more than an eighth of the agent's part.
local function rate(keys, p, held, want, tokens, demand)
  rate_ok(p)
  if held > p.cap then fail('LH_ARG invalid argument held = ' .. fmt(held)) end
  if tokens > held then fail('LH_ARG invalid argument tokens = ' .. fmt(tokens)) end
  if want > p.cap then fail('LH_ARG invalid argument want = ' .. fmt(want)) end
  local key = the_key(keys, p)
  local s, rec, now, replay = open(key, p)
  if replay then return replay end
  local moved = where(s, p, now)
  -- While its record lives, the burst counted is at most the record's (ops.rs, rate: a
  -- lost reply may have shrunk it).
  if rec then
    held = math.min(held, rec.held)
    tokens = math.min(tokens, held)
  end
  -- A lost bucket restarts empty, as for an acquire.
  if s.created and held > 0 then s.tok, s.car = 0, 0 end
  s.out = s.out - (rec and rec.held or 0) + held
  s.ds = s.ds - (rec and rec.demand or 0) + demand
  remove_share(s, rec and rec.q or 0)
  clamp(s, p)
  local scale = rate_scale(p)
  local whole = p.n * scale
  local part = 0
  if demand > 0 and not moved then
    local d = demand * p.per * scale / 1e9
    -- The headroom shrinks as the demands near the rate (ops.rs, RATE_ROOM).
    local sum = s.ds * p.per * scale / 1e9
    local headroom = math.min(math.max(RATE_ROOM * whole / sum, 1), RATE_HEADROOM)
    part = math.min(d * headroom, whole * demand / s.ds)
  end
  part = math.floor(part)
  local share = math.min(part, math.max(whole - s.sh, 0))
  -- The burst's fair part of B (ops.rs, rate): its demand's part of the demands, one
  -- token at least; a burst above it shrinks to it, never below the tokens the agent may
  -- still hold (the whole ones it declared and a fraction: its bucket does not refill
  -- while the call is out), and grows no further.
  local fair = p.cap
  if s.ds > 0 then fair = math.max(math.floor(p.cap * demand / s.ds), 1) end
  local cap = math.max(fair, tokens + 1)
  if held > cap then
    s.out = s.out - (held - cap)
    held = cap
  end
  -- The burst grows towards want while the bursts leave room under B, the room gained
  -- starting empty; a share needs a burst of one token at least.
  local grow = 0
  if not moved and share > 0 then
    grow = math.min(math.max(want - held, 0), math.max(p.cap - s.out, 0),
      math.max(cap - held, 0))
  end
  s.out = s.out + grow
  local burst = held + grow
  if burst == 0 then share = 0 end
  -- Tokens from the level fill the burst's empty room; what the level then holds above
  -- B less the bursts is void.
  local paid = 0
  if not moved then paid = math.min(burst - tokens, s.tok) end
  s.tok = s.tok - paid
  clamp(s, p)
  add_share(s, p, share)
  local limited = share < part - divmod(part, 8)
  local prior_q, prior_d = rec and rec.q or 0, rec and rec.demand or 0
  local steady = false
  if not limited and prior_q > 0 and prior_d > 0 and
      math.abs(demand - prior_d) <= divmod(prior_d, 4) then
    local was = prior_q * demand
    steady = math.abs(share * prior_d - was) * 8 <= was
  end
  local term = rate_term(p, s.sn, steady)
  local reply = new_reply(now, moved)
  reply[1], reply[2], reply[6] = paid, term, share
  if limited then reply[4] = 1 end
  return finish(key, s, p, now, {held = burst, x = now + term + p.grace, demand = demand,
    credit = kept_credit(rec, p), q = share}, reply)
end

local function release(keys, p, returned)
  local key = the_key(keys, p)
  local s, rec, now, replay = open(key, p)
  if replay then return replay end
  local moved = where(s, p, now)
  local prior_held = rec and rec.held or 0
  -- Credit no more than we know the agent held: returns cannot mint tokens.
  local credit = math.min(returned, prior_held)
  s.out = s.out - prior_held
  s.ds = s.ds - (rec and rec.demand or 0)
  -- A rate lease's share is given up with it.
  remove_share(s, rec and rec.q or 0)
  s.tok = s.tok + credit
  clamp(s, p)
  local reply = new_reply(now, moved)
  reply[1] = credit
  local credit = kept_credit(rec, p)
  return finish(key, s, p, now, {held = 0, x = now + p.grace, demand = 0, credit = credit, q = 0},
    reply)
end

-- The record of an operation that leaves the agent's holding and demand as they were.
local function kept(rec, p, now)
  local x = now + p.grace
  if rec and rec.x > x then x = rec.x end
  local credit = kept_credit(rec, p)
  return {held = rec and rec.held or 0, x = x, demand = rec and rec.demand or 0, credit = credit,
          q = rec and rec.q or 0}
end

-- cost 0 is a read: the level (remaining) and nothing taken, as a check-only request asks.
local function exact(keys, p, cost)
  if cost > p.cap then
    fail('LH_CAPACITY ' .. fmt(cost) .. ' tokens requested, but the bucket holds at most ' .. fmt(p.cap))
  end
  local key = the_key(keys, p)
  local s, rec, now, replay = open(key, p)
  if replay then return replay end
  local moved = where(s, p, now)
  local reply = new_reply(now, moved)
  if moved then
    reply[4] = 1
  elseif s.tok >= cost then
    s.tok, reply[1] = s.tok - cost, cost
  else
    reply[4] = wait_for(s, p, cost)
  end
  -- Other agents lease this key: say so (model/ops.rs, exact).
  local own = 0
  if rec then own = rec.demand end
  if s.ds > own then reply[6] = math.max(scale_ppm(p, s.rr, s.ds, 0), 1) end
  return finish(key, s, p, now, kept(rec, p, now), reply)
end

local function split(keys, p, parts, salt, untl)
  if parts < 2 or parts > MAX_PARTS or parts > p.cap or p.pgen ~= 0 then
    fail('LH_ARG invalid argument parts = ' .. fmt(parts))
  end
  local key = the_key(keys, p)
  if p.region then fail('LH_ARG invalid argument parts = ' .. fmt(parts)) end
  local s, rec, now, replay = open(key, p)
  if replay then return replay end
  local moved = where(s, p, now)
  -- A bucket leased by rate is not split: its agents call once a term.
  if s.split.parts == 0 and untl > now and s.sn == 0 then
    -- Start: the parent's tokens go to the parts, its refill stops.
    local gen = math.max(now, s.sg + 1)
    s.split = {parts = parts, salt = salt, gen = gen, untl = untl, tok = s.tok, out = s.out,
               drop = s.mx}
    s.sg = gen
    s.tok, s.car = 0, 0
  elseif s.split.parts == parts and s.split.salt == salt then
    s.split.untl = math.max(s.split.untl, untl)
  end
  return finish(key, s, p, now, kept(rec, p, now), new_reply(now, moved))
end

-- lh_deposit: the broker of a region puts the tokens the global bucket granted it into the
-- region's bucket, good until until_us (this server's time), once per seq (the grant's
-- time on the global bucket; seq 0 reads). No agent record (ops.rs, deposit).
-- Reply: {deposited, term left (us), tokens + outstanding, tokens, now_us, demand sum, 0, ...}
local function deposit(keys, p, tokens, untl, rate)
  local key = the_key(keys, p)
  if not p.region then fail('LH_ARG invalid argument region = 0') end
  local s, rec, now = open(key, p, true)
  local reply = new_reply(now, false)
  if p.seq > s.rq then
    s.rq = p.seq
    s.rr = rate
    if untl > now then
      if not in_term(s) then s.tok, s.car = 0, 0 end
      s.ru = math.max(s.ru, untl)
      local before = s.tok
      s.tok = s.tok + tokens
      clamp(s, p)
      reply[1] = math.max(s.tok - before, 0)
    end
  end
  reply[2] = math.max(s.ru - now, 0)
  reply[3] = s.tok + s.out
  reply[4] = s.tok
  reply[6] = s.ds
  return finish(key, s, p, now, nil, reply)
end

-- lh_exact_batch: the exact decisions of one agent on many cold keys in one call (the
-- keys may lie in several slots of this node). Each key is decided as lh_exact would,
-- one cost after another, from its own state alone, but leaves no agent record: the
-- batch's answer is kept once, in its own dedup key, for the grace, and a retry of the
-- batch (same agent, seq and keys) is answered from it (I2). A new key is made compact,
-- and a compact key stays so. A key that is split, or is a part, is answered "moved" and
-- left untouched: its decisions go through lh_exact. Everything is validated, and every
-- key read, before anything is written. A compact key none of whose costs is admitted
-- is not written (its state read back later is the same bucket), and a hash with nothing
-- but a level (its leases, demand and split gone) is made compact again.
--
-- KEYS: the dedup key, KEYS[2] .. ':b:' .. agent .. ':' .. seq (so in KEYS[2]'s slot),
--       then the bucket keys, each once.
-- ARGV: agent, then one string of little-endian unsigned 64-bit integers (each at most
--       2^53 - 1): seq, rules, then per rule: capacity, rate_tokens, rate_period_us,
--       grace_us, max_outstanding; then per key: rule (1-based), count, cost x count.
--       (struct.unpack reads them at a fraction of what tonumber costs per number.)
--       Then, optionally, 'first': no call with this seq was sent before, so there is no
--       dedup key to look for (an agent's retry omits it, and finds its answer there).
-- Reply: one string of little-endian unsigned 64-bit integers: server_now_us, then per
--        key 4 + count: status (0 decided, 1 moved), now_us - server_now_us, remaining,
--        scale_ppm, then per cost its retry_us (0 = admitted). Lua spends as long on each
--        integer of an array reply as on a key's whole decision; a string is one value.
-- Dedup key: BATCH_TAG, seq and the reply (the same integers), expiring after the
--            longest grace.
local MAX_BATCH_COSTS = 4096
-- A dedup record's first byte.
local BATCH_TAG = '\193'


-- Appends a key's answer to out (see Reply): status, time past the server's, remaining,
-- scale, then its count retry times, rt[1 .. count]. The batch's reply packs out once
-- (pack_all): a struct.pack per key cost as much as the key's decision.
local function answer(out, status, dnow, remaining, scale, count, rt)
  local n = #out
  out[n + 1], out[n + 2], out[n + 3], out[n + 4] = status, dnow, remaining, scale
  for i = 1, count do out[n + 4 + i] = rt[i] end
end

-- One key in general (lease records due to drop, stale demand, a new period), from the
-- state exact_one read (s; nil for a hash that holds no bucket), and the shared advance.
-- Its costs are cost[first .. first + count - 1]; returns its answer.
local function exact_full(key, p, cost, first, count, server_now, s, rt, out)
  if not s then s = level_state(p.cap, 0, 0, 0) end
  local now = math.max(server_now, s.ts)
  advance(key, s, p, now, nil)
  -- Agents lease this key: say so, with their proportional scale (at least 1).
  local scale = 0
  if s.ds > 0 then scale = math.max(scale_ppm(p, 0, s.ds, 0), 1) end
  for i = 1, count do
    local c = cost[first + i - 1]
    local retry = 0
    if s.tok >= c then
      s.tok = s.tok - c
    elseif s.sn > 0 then
      retry = wait_for(s, p, c)
    else
      retry = time_until(s, c, p)
    end
    rt[i] = retry
  end
  redis.call('HSET', key, STATE, pack_state(s))
  -- I6: not before every lease record's drop, and full again; and, as lh_exact's record
  -- does, a grace after the call (a key used again soon is not made again).
  local busy = math.max(s.mx, now + p.grace)
  redis.call('PEXPIREAT', key, fmt(divmod(busy + time_until(s, p.cap, p), 1000) + 1))
  answer(out, 0, now - server_now, s.tok, scale, count, rt)
end

-- The text of expiry at (ms), made once per batch (pxat: the batch's texts by value):
-- a batch's new keys expire alike, and a number's formatting cost a tenth of a key's
-- decision.
local function expiry(pxat, at)
  local t = pxat[at]
  if not t then
    t = fmt(at)
    pxat[at] = t
  end
  return t
end

-- Writes compact key `key` at tok, car, ts and per, its expiry kept when that (kept, ms)
-- covers at (ms), else at and slack beyond it. pxat: the batch's expiries as text. (The
-- general path's: a batch of compact and new keys only writes its own in decide_levels,
-- after all are decided.)
local function write_compact(key, tok, car, ts, per, at, kept, slack, pxat)
  if kept >= at then
    redis.call('SETRANGE', key, '0', struct.pack(COMPACT, COMPACT_TAG, tok, car, ts, per, kept))
    return
  end
  at = at + slack
  redis.call('SET', key, struct.pack(COMPACT, COMPACT_TAG, tok, car, ts, per, at), 'PXAT',
    expiry(pxat, at))
end

-- A cold bucket's decisions (no lease record, demand or split): Level::refill from ts to
-- now, then the costs cost[first .. first + count - 1] in order, its answer appended to
-- out. Returns the level, the carry, the time used and the key's expiry in ms (I6: full
-- again, and a grace after the call).
local function decide_cold(p, tok, car, ts, server_now, cost, first, count, out)
  local per, rate, cap = p.per, p.n, p.cap
  local now = server_now
  if ts > now then now = ts end
  tok, car = refilled(tok, car, now - ts, cap, rate, per)
  -- The answer (see answer) written in place: its remaining once the costs are taken.
  local n = #out
  out[n + 1], out[n + 2], out[n + 4] = 0, now - server_now, 0
  for i = 1, count do
    local c = cost[first + i - 1]
    if tok >= c then
      tok = tok - c
      out[n + 4 + i] = 0
    else
      out[n + 4 + i] = until_holds(tok, car, c, per, rate)
    end
  end
  out[n + 3] = tok
  return tok, car, now, divmod(now + p.grace + until_holds(tok, car, cap, per, rate), 1000) + 1
end

-- One hash key. The common case (a live key with no lease record, no demand, no split,
-- the same period) runs on locals; the rest through exact_full. s: its state as the batch
-- read it. Its answer is appended to out.
local function exact_one(key, p, cost, first, count, server_now, s, rt, out, pxat)
  if s.split.parts ~= 0 or s.pg ~= 0 then
    for i = 1, count do rt[i] = 0 end
    return answer(out, 1, 0, 0, 0, count, rt)
  end
  -- nexp 0: no lease record (then out and mx are 0); dx 0: no demand (ds is 0).
  if s.nexp ~= 0 or s.dx ~= 0 or s.p ~= p.per then
    return exact_full(key, p, cost, first, count, server_now, s, rt, out)
  end
  local at
  s.tok, s.car, s.ts, at = decide_cold(p, s.tok, s.car, s.ts, server_now, cost, first, count, out)
  if s.sg == 0 and s.mx == 0 and s.out == 0 and s.ds == 0 and s.sh == 0 and s.sn == 0
      and s.su == 0 and s.ru == 0 and s.rq == 0 and s.rr == 0 then
    -- Nothing but a level left (never split, no record ever to drop, no share, no
    -- term): compact again, in one SET, which replaces the hash.
    write_compact(key, s.tok, s.car, s.ts, p.per, at, 0, p.slack, pxat)
    return
  end
  redis.call('HSET', key, STATE, pack_state(s))
  redis.call('PEXPIREAT', key, expiry(pxat, at))
end

-- One compact key (v: its value), or a new one (v false): decided, then written back with
-- its expiry in one SET. Its answer is appended to out.
local function exact_compact(key, p, cost, first, count, server_now, v, out, pxat)
  local tok, car, ts, same, kept = p.cap, 0, server_now, false, 0
  if v then
    local per
    tok, car, ts, per, kept = compact_of(key, v)
    -- Advance: a rule with another period restarts the carry.
    same = per == p.per
    if not same then car = 0 end
  end
  local now, at
  tok, car, now, at = decide_cold(p, tok, car, ts, server_now, cost, first, count, out)
  -- Nothing admitted on a key that exists, in the same period: nothing to write (its
  -- refill from ts reads the same later).
  if same then
    local n = #out
    for i = n - count + 1, n do
      if out[i] == 0 then same = false break end
    end
    if same then return end
  end
  write_compact(key, tok, car, now, p.per, at, kept, p.slack, pxat)
end

-- The most integers one struct.unpack returns (the Lua stack holds 8 000 values).
local UNPACK_AT = 4000

-- The integers packed in blob (see ARGV, and Reply), in a table.
local function packed(blob)
  local len = 0
  if type(blob) == 'string' then len = #blob end
  if len == 0 or len % 8 ~= 0 then
    fail('LH_ARG invalid argument numbers: ' .. fmt(len) ..
      ' bytes, not a whole number of 8-byte integers')
  end
  local n = len / 8
  if n <= UNPACK_AT then
    -- One table, made at its size (copying into a growing one rehashed it at every power
    -- of two: as costly as an acquire's reads).
    local out = {struct.unpack(format_of(n), blob)}
    out[n + 1] = nil
    return out
  end
  local out, pos = {}, 1
  while n > 0 do
    local k = math.min(n, UNPACK_AT)
    local more = {struct.unpack(format_of(k), blob, pos)}
    local base = #out
    for j = 1, k do out[base + j] = more[j] end
    pos = more[k + 1]
    n = n - k
  end
  return out
end

-- v[1 .. #v] as one string of little-endian unsigned 64-bit integers.
local function pack_all(v)
  local n = #v
  if n <= UNPACK_AT then return struct.pack(format_of(n), unpack(v, 1, n)) end
  local parts, i = {}, 1
  while i <= n do
    local k = math.min(n - i + 1, UNPACK_AT)
    parts[#parts + 1] = struct.pack(format_of(k), unpack(v, i, i + k - 1))
    i = i + k
  end
  return table.concat(parts)
end

-- A batch's number v (nil past the end), at most max.
local function num(v, what, max)
  if v == nil or v > max then fail('LH_ARG invalid argument ' .. what .. ' = ' .. clip(v)) end
  return v
end

-- A kept dedup record's reply (packed), or nil if it is another batch's.
local function kept_reply(kept, seq)
  if string.byte(kept, 1) == 193 and #kept >= 17 and struct.unpack(SEQ_FORMAT, kept, 2) == seq then
    return string.sub(kept, 10)
  end
  return nil
end

-- Zeros to make a table at its size in one step ({unpack(ZEROS, 1, n)}): a table grown
-- one slot at a time is rehashed at every power of two.
local ZEROS = {}
for z = 1, 4 * 128 + MAX_BATCH_COSTS do ZEROS[z] = 0 end

-- Why item k (its rule r and count at args[i], args[i + 1]; total: the costs before it)
-- is not one: fails.
local function bad_item(k, r, count, nrules, total)
  num(r, 'rule', nrules)
  num(count, 'count', MAX_BATCH_COSTS)
  fail('LH_ARG invalid batch item ' .. fmt(k) .. ': rule ' .. fmt(r) .. ', ' .. fmt(count) ..
    ' costs (' .. fmt(total + count) .. ' in the batch, at most ' .. fmt(MAX_BATCH_COSTS) .. ')')
end

-- Why cost v is not one of a bucket of capacity cap: fails.
local function bad_cost(v, cap)
  num(v, 'cost', MAX)
  if v == 0 then fail('LH_ARG invalid argument cost = 0') end
  fail('LH_CAPACITY ' .. fmt(v) .. ' tokens requested, but the bucket holds at most ' .. fmt(cap))
end

-- The items from args[i] (per key: rule, count, costs), each checked; fails at the first
-- that is not one.
local function check_items(keys, args, i, rules)
  local nkeys, seen, total = #keys, {}, 0
  for k = 2, nkeys do
    local key, r, count = keys[k], args[i], args[i + 1]
    local p = rules[r]
    if p == nil or count == nil or count == 0 or total + count > MAX_BATCH_COSTS then
      bad_item(k - 1, r, count, #rules, total)
    end
    local cap = p.cap
    for c = i + 2, i + 1 + count do
      local v = args[c]
      if v == nil or v == 0 or v > cap then bad_cost(v, cap) end
    end
    total = total + count
    i = i + 2 + count
    if seen[key] then fail('LH_ARG a key appears twice in one batch: ' .. clip(key)) end
    seen[key] = true
  end
  if args[i] ~= nil then fail('LH_ARG ' .. fmt(#args - i + 1) .. ' numbers left over') end
end

-- A batch whose keys are all compact or new (found: their values from MGET, false for a
-- new one), its items from args[i]: each key's decisions (Level::refill from its ts, then
-- its costs in order), every item checked and decided before anything is written, then
-- one write per key that changed (SETRANGE when its expiry covers the new one, else SET
-- ... PXAT; see COMPACT). Returns the answers, in one table (see Reply).
-- All of it inline, on locals: a Lua function call costs as much as a key's refill.
local function decide_levels(keys, rules, args, i, server_now, found)
  local n = #found
  local size = 2 * n + #args - i + 1
  local out
  if size <= #ZEROS then
    out = {server_now, unpack(ZEROS, 1, size)}
  else
    out = {server_now}
    for z = 2, size + 1 do out[z] = 0 end
  end
  -- ats[k]: key k's expiry (text): made at its size, the values replaced.
  local ats, pxat, seen, total, pos = {unpack(found, 1, n)}, {}, {}, 0, 1
  for k = 1, n do
    local key, v, r, count = keys[k + 1], found[k], args[i], args[i + 1]
    local p = rules[r]
    if p == nil or count == nil or count == 0 or total + count > MAX_BATCH_COSTS then
      bad_item(k, r, count, #rules, total)
    end
    total = total + count
    if seen[key] then fail('LH_ARG a key appears twice in one batch: ' .. clip(key)) end
    seen[key] = true
    local per, rate, cap = p.per, p.n, p.cap
    local tok, car, ts, write, kept = cap, 0, server_now, true, 0
    if v then
      local tag, vper
      if #v == 42 then tag, tok, car, ts, vper, kept = sunpack(COMPACT, v) end
      if tag ~= COMPACT_TAG then tok, car, ts, vper, kept = compact_of(key, v) end
      if ts > server_now + MAX_AHEAD then check_clock(key, ts, server_now) end
      -- Advance: a rule with another period restarts the carry (and its value is
      -- written whole).
      write = vper ~= per
      if write then car, kept = 0, 0 end
    end
    local now = server_now
    if ts > now then now = ts end
    -- Level::refill: full once the units it lacks have come, else the whole tokens of
    -- the carry and the time since ts (x - rm is a multiple of per: exact).
    if tok >= cap then
      tok, car = cap, 0
    else
      local x = car + rate * (now - ts)
      if x >= (cap - tok) * per then
        tok, car = cap, 0
      else
        local rm = x % per
        if rm < 0 then rm = rm + per elseif rm >= per then rm = rm - per end
        tok, car = tok + (x - rm) / per, rm
      end
    end
    -- Its answer: status 0, the time, remaining, scale 0, then each cost's retry (0: admitted),
    -- in out's zeros.
    if now ~= server_now then out[pos + 2] = now - server_now end
    local last, rt = i + 1 + count, pos + 3 - i
    for c = i + 2, last do
      local cost = args[c]
      if cost == nil or cost == 0 or cost > cap then bad_cost(cost, cap) end
      if tok >= cost then
        tok = tok - cost
        write = true
      else
        -- Its retry: the units it lacks, in whole µs (ceil_div).
        local u = (cost - tok) * per - car
        local rm = u % rate
        if rm < 0 then rm = rm + rate elseif rm >= rate then rm = rm - rate end
        if rm > 0 then rm = rm - rate end
        out[rt + c] = (u - rm) / rate
      end
    end
    out[pos + 3] = tok
    pos = pos + 4 + count
    if write then
      -- I6: full again, and a grace after the call; in whole ms, rounded up.
      local u = 0
      if tok < cap then u = (cap - tok) * per - car end
      local rm = u % rate
      if rm < 0 then rm = rm + rate elseif rm >= rate then rm = rm - rate end
      if rm > 0 then rm = rm - rate end
      local ms = now + p.grace + (u - rm) / rate
      rm = ms % 1000
      if rm < 0 then rm = rm + 1000 elseif rm >= 1000 then rm = rm - 1000 end
      local at = (ms - rm) / 1000 + 1
      -- Its expiry: kept when it covers at (see COMPACT), else at and a slack.
      if kept >= at then
        -- Only the level changes: tok, car and ts, at offset 2 (LEVEL).
        ats[k] = false
        found[k] = spack(LEVEL, tok, car, now)
      else
        kept = at + p.slack
        local text = pxat[kept]
        if not text then
          text = fmt(kept)
          pxat[kept] = text
        end
        ats[k] = text
        found[k] = spack(COMPACT, COMPACT_TAG, tok, car, now, per, kept)
      end
    else
      found[k] = false
    end
    i = last + 1
  end
  if args[i] ~= nil then fail('LH_ARG ' .. fmt(#args - i + 1) .. ' numbers left over') end
  for k = 1, n do
    local v = found[k]
    if v then
      local key = keys[k + 1]
      -- GET: its reply, the value it replaces (none, for a new key), costs Lua less than
      -- SET's status reply, a table. A key whose expiry is kept is a compact string in the
      -- same period: SETRANGE rewrites its level in place, its expiry untouched, and
      -- replies an integer.
      local at = ats[k]
      if at then
        rcall('SET', key, v, 'PXAT', at, 'GET')
      else
        rcall('SETRANGE', key, '2', v)
      end
    end
  end
  return out
end

-- A batch rule's numbers, by name, in order.
local BATCH_RULE = {'capacity', 'rate_tokens', 'rate_period_us', 'grace_us', 'max_outstanding'}

-- The last batch's longest grace, and its dedup key's life (ms, text): most batches have
-- the same.
local dedup_grace, dedup_px = nil, nil

-- The batch of agent id over its numbers (see ARGV); its reply, packed.
local function exact_batch(keys, id, args, first)
  local seq = num(args[1], 'seq', MAX)
  local nkeys = #keys
  local nrules = num(args[2], 'rules', nkeys)
  if nkeys < 2 or nrules == 0 then fail('LH_ARG an exact batch needs keys and rules') end
  local rules, i, grace = {}, 3, 0
  for r = 1, nrules do
    local cap, n, per, g, maxout = args[i], args[i + 1], args[i + 2], args[i + 3], args[i + 4]
    if maxout == nil or cap > MAX or n > MAX or per > MAX or g > MAX or maxout > MAX then
      for j, what in ipairs(BATCH_RULE) do num(args[i + j - 1], what, MAX) end
    end
    if cap < 1 or n < 1 or per < 1 or cap * per + n > MAX_UNITS then
      fail('LH_ARG invalid bucket parameters: capacity ' .. clip(cap) ..
        ', rate ' .. clip(n) .. '/' .. clip(per) .. 'us')
    end
    if g > grace then grace = g end
    -- What a cold decision reads; the general path (exact_one) adds the rest of a call's
    -- parameters.
    rules[r] = {cap = cap, n = n, per = per, grace = g, maxout = maxout, slack = keep_slack(g)}
    i = i + 5
  end
  -- The items are read where they lie, args[items ..]: per key its rule, count and costs
  -- (checked as they are decided, before anything is written).
  local items = i
  for k = 2, nkeys do
    local key = keys[k]
    if not bucket_key(key) then fail('LH_ARG not a bucket key: ' .. clip(key)) end
  end
  local dkey = keys[1]
  if dkey ~= keys[2] .. ':b:' .. id .. ':' .. fmt(seq) then
    fail('LH_ARG not the batch dedup key: ' .. clip(dkey))
  end
  local t = redis.call('TIME')
  local server_now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  if not first then
    local kept = redis.call('GET', dkey)
    if kept then
      local reply = kept_reply(kept, seq)
      if reply then return reply end
    end
  end
  -- Every key read before any is written, in one MGET: a compact value, or false for a
  -- key that does not exist or is not a string. Only when some of the false ones exist
  -- (EXISTS counts them: none, for a batch of new keys) is each looked at: a hash with a
  -- bucket's state has it decoded in states; any other type, or a hash without one, is
  -- refused. (A GET per key cost a Redis call each, a fifth of a key's decision.)
  -- found[k - 1]: keys[k]'s value, or true once its hash is read.
  local found, states, absent = rcall('MGET', unpack(keys, 2, nkeys)), {}, {}
  for k = 2, nkeys do
    local key = keys[k]
    if not found[k - 1] then
      absent[#absent + 1] = key
    end
  end
  if #absent > 0 and rcall('EXISTS', unpack(absent)) > 0 then
    for k = 2, nkeys do
      local key = keys[k]
      if not found[k - 1] then
        local ty = redis.call('TYPE', key)
        ty = ty['ok']
        if ty == 'hash' then
          local st = redis.call('HGET', key, STATE)
          -- A hash without a bucket's state: not ours.
          if not st then bad_bucket(key) end
          states[k] = state_of(key, st)
          check_clock(key, states[k].ts, server_now)
          found[k - 1] = true
        elseif ty ~= 'none' then
          fail('LH_ARG not a bucket: ' .. clip(key) .. ' holds a ' .. ty)
        end
      end
    end
  end
  local out
  if next(states) == nil then
    out = decide_levels(keys, rules, args, items, server_now, found)
  else
    check_items(keys, args, items, rules)
    for k = 2, nkeys do
      local key, v = keys[k], found[k - 1]
      if type(v) == 'string' then
        local _, _, ts = compact_of(key, v)
        check_clock(key, ts, server_now)
      end
    end
    for r = 1, nrules do
      local p = rules[r]
      p.ttl, p.id, p.seq, p.pgen, p.puntil, p.ptok, p.pout, p.pdrop = 0, id, seq, 0, 0, 0, 0, 0
    end
    local rt, pxat = {}, {}
    out = {server_now}
    i = items
    for k = 2, nkeys do
      local p, count, f = rules[args[i]], args[i + 1], found[k - 1]
      if f == true then
        exact_one(keys[k], p, args, i + 2, count, server_now, states[k], rt, out, pxat)
      else
        exact_compact(keys[k], p, args, i + 2, count, server_now, f, out, pxat)
      end
      i = i + 2 + count
    end
  end
  local reply = pack_all(out)
  if grace ~= dedup_grace then
    dedup_grace, dedup_px = grace, fmt(math.max(ceil_div(grace, 1000), 1))
  end
  redis.call('SET', dkey, BATCH_TAG .. struct.pack(SEQ_FORMAT, seq) .. reply, 'PX', dedup_px,
    'GET')
  return reply
end

-- lh_exact_batch: the batch, its numbers packed, its reply packed (what agents send).
local function exact_packed(keys, args)
  local id = agent(args[1])
  local first = args[3] == 'first'
  if (args[3] ~= nil and not first) or args[4] ~= nil then
    fail('LH_ARG ' .. fmt(#args - 2) .. ' arguments left over')
  end
  return exact_batch(keys, id, packed(args[2]), first)
end

-- The operations by their number in lh_call, each with its own arguments' names and bounds.
local OPS = {
  {acquire, {{'held', MAX_HELD}, {'want', MAX}, {'min', MAX}, {'demand', MAX_HELD}}},
  {release, {{'returned', MAX_HELD}}},
  {exact, {{'cost', MAX}}},
  {split, {{'parts', MAX}, {'salt', MAX}, {'until', MAX}}},
  {deposit, {{'tokens', MAX_HELD}, {'until', MAX}, {'rate_milli', MAX_HELD}}},
  {rate, {{'held', MAX_HELD}, {'want', MAX}, {'tokens', MAX_HELD}, {'demand', MAX_HELD}}},
}

-- Refuses any of v[o + 1 ..] above its bound in bounds ({name, bound} each, in order).
local function within(v, o, bounds)
  for i = 1, #bounds do
    local x, b = v[o + i], bounds[i]
    if x > b[2] then num(x, b[1], b[2]) end
  end
end

-- lh_call: any of the operations above, its numbers packed (what agents send). ARGV: the
-- agent, then one string of little-endian unsigned 64-bit integers: the operation (1
-- acquire, 2 release, 3 exact, 4 split, 5 deposit, 6 rate), the common arguments but the agent
-- (capacity .. part_drop), then the operation's own. Reply: the reply's integers, packed
-- the same way. Lua spends about as long on each decimal argument it checks and each
-- integer of an array reply as on the rest of an acquire's arithmetic.
local function call(keys, args)
  local id = args[1]
  if args[3] ~= nil then fail('LH_ARG ' .. fmt(#args - 2) .. ' arguments left over') end
  local v = packed(args[2])
  local op = OPS[v[1]]
  if not op then fail('LH_ARG invalid argument operation = ' .. fmt(v[1])) end
  local own = op[2]
  if #v ~= 13 + #own then
    fail('LH_ARG invalid argument numbers: ' .. fmt(#v) .. ' integers, ' .. fmt(13 + #own) ..
      ' expected')
  end
  -- The common numbers' bounds, compared inline (the loop over COMMON cost an acquire 5%):
  -- MAX each, part_outstanding MAX_HELD.
  if v[2] > MAX or v[3] > MAX or v[4] > MAX or v[5] > MAX or v[6] > MAX or v[7] > MAX or
      v[8] > MAX or v[9] > MAX or v[10] > MAX or v[11] > MAX or v[12] > MAX_HELD or
      v[13] > MAX then
    within(v, 1, COMMON)
  end
  local p = params_of(id, v, 1)
  within(v, 13, own)
  local reply = op[1](keys, p, v[14], v[15], v[16], v[17])
  -- An acquire's common case replies packed already (acquire_plain).
  if type(reply) == 'string' then return reply end
  return struct.pack(format_of(#reply), unpack(reply))
end

-- The decimal form of operation i (ARGV above), for tests and redis-cli: its reply an
-- array.
local function decimal(i)
  local run, own = OPS[i][1], OPS[i][2]
  return function(keys, args)
    local p = params(args)
    local v = {}
    for j = 1, #own do v[j] = int(args[13 + j], own[j][1], own[j][2]) end
    local reply = run(keys, p, v[1], v[2], v[3], v[4])
    if type(reply) == 'string' then
      reply = {struct.unpack(format_of(15), reply)}
      reply[16] = nil
    end
    return reply
  end
end

-- lh_seat: the seats of a rule's local share (model/seats.rs). KEYS[1] = lh:{RULE}:seats,
-- a hash of agent -> the end of its tenure (server µs), and ts, the last server time
-- (I5). ARGV: agent (hex), seats, ttl_us, leave (1: give the seat up). Tenures that
-- ended go first; the agent's live record is extended, a new one made while fewer than
-- `seats` are live, else the claim is refused. Reply: {held, renewed, ttl_us or, when
-- refused, the µs until the soonest tenure ends}.
local MAX_SEATS = 4096
local MAX_SEAT_TTL = 3600000000

local function seat(keys, args)
  local key = keys[1]
  if #keys ~= 1 or type(key) ~= 'string' or #key > 80 or
      string.find(key, '^lh:{[%w%._%-]+}:seats$') == nil then
    fail('LH_ARG not a seats key: ' .. clip(tostring(key)))
  end
  local id = args[1]
  if type(id) ~= 'string' or #id < 1 or #id > 32 or not string.find(id, '^%x+$') then
    fail('LH_ARG invalid argument agent = ' .. clip(tostring(id)))
  end
  local n = int(args[2], 'seats', MAX_SEATS)
  local ttl = int(args[3], 'ttl_us', MAX_SEAT_TTL)
  local leave = int(args[4], 'leave', 1)
  if args[5] ~= nil then fail('LH_ARG ' .. fmt(#args - 4) .. ' arguments left over') end
  if n == 0 or ttl == 0 then fail('LH_ARG invalid argument seats or ttl_us = 0') end
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local v = redis.call('HGETALL', key)
  for i = 1, #v, 2 do
    if v[i] == 'ts' then now = math.max(now, tonumber(v[i + 1])) end
  end
  local live, soonest, latest, mine = 0, nil, now, false
  for i = 1, #v, 2 do
    local f = v[i]
    if f ~= 'ts' then
      local u = tonumber(v[i + 1])
      if u <= now or (leave == 1 and f == id) then
        redis.call('HDEL', key, f)
      else
        live = live + 1
        if soonest == nil or u < soonest then soonest = u end
        if u > latest then latest = u end
        if f == id then mine = true end
      end
    end
  end
  local reply
  if leave == 1 then
    reply = {0, 0, 0}
  elseif mine or live < n then
    redis.call('HSET', key, id, fmt(now + ttl))
    if now + ttl > latest then latest = now + ttl end
    reply = {1, mine and 1 or 0, ttl}
  else
    reply = {0, 0, math.max(soonest - now, 1)}
  end
  redis.call('HSET', key, 'ts', fmt(now))
  -- The key outlives its last tenure by a second (no tenure, no state worth keeping).
  redis.call('PEXPIRE', key, fmt(ceil_div(latest - now, 1000) + 1000))
  return reply
end

-- lh_lead: the coordinators' leader lock, KEYS[1] = lh:coordinator, holding the holder's
-- id. ARGV: id, ttl_ms, give_up (1: release it if held). Taken when free, extended when
-- held by id (the compare and the extension in one step: between a GET and a PEXPIRE
-- the lock could pass to another instance), left alone when another holds it. Reply: 1
-- when id holds it after the call, else 0.
local function lead(keys, args)
  local key = keys[1]
  local id = args[1]
  if #keys ~= 1 or key ~= 'lh:coordinator' then fail('LH_ARG not the leader lock: ' .. clip(tostring(key))) end
  if type(id) ~= 'string' or #id < 1 or #id > 64 then fail('LH_ARG invalid argument id = ' .. clip(tostring(id))) end
  local ttl = int(args[2], 'ttl_ms', 3600000)
  local give_up = int(args[3], 'give_up', 1)
  if ttl == 0 then fail('LH_ARG invalid argument ttl_ms = 0') end
  local holder = redis.call('GET', key)
  if give_up == 1 then
    if holder == id then
      redis.call('DEL', key)
    end
    return 0
  end
  if holder == false then
    redis.call('SET', key, id, 'PX', ttl)
    return 1
  end
  if holder == id then
    redis.call('PEXPIRE', key, ttl)
    return 1
  end
  return 0
end

-- lh_state: a bucket's state field as the hash holds it (see STATE), or nothing for a
-- compact bucket (which has no split) or no bucket. Read-only.
local function state_field(keys, args)
  local key = keys[1]
  if #keys ~= 1 or #key > 512 or string.find(key, '^lh:{[%w%._%-]+|[^{}|]+}$') == nil then
    fail('LH_ARG not a bucket key: ' .. clip(tostring(key)))
  end
  if args[1] ~= nil then fail('LH_ARG ' .. fmt(#args) .. ' arguments left over') end
  local ty = redis.call('TYPE', key)
  if ty['ok'] ~= 'hash' then return false end
  return redis.call('HGET', key, STATE)
end

-- Every function, entered: the formats made once (U64).
local function entry(f)
  return function(keys, args)
    if not U64 then
      sfind, rcall, spack, sunpack = string.find, redis.call, struct.pack, struct.unpack
      ssub, ZEROS8 = string.sub, string.rep('\0', 64)
      U64 = 'I8'
      if #struct.pack('<L', 0) == 8 then U64 = 'L' end
      COMPACT = '<c2' .. string.rep(U64, 5)
      COMPACT_OLD = '<c2' .. string.rep(U64, 4)
      LEVEL = '<' .. string.rep(U64, 3)
      STATE_FORMAT = '<' .. string.rep(U64, 21)
      SHARED_FORMAT = STATE_FORMAT .. string.rep(U64, 3)
      HEAD_FORMAT = '<' .. string.rep(U64, 11)
      RECORD_FORMAT = '<' .. string.rep(U64, 12)
      HEAD9_FORMAT = '<' .. string.rep(U64, 9)
      SEQ_FORMAT = '<' .. U64
    end
    return f(keys, args)
  end
end

redis.register_function('lh_call', entry(call))
redis.register_function('lh_seat', entry(seat))
redis.register_function('lh_lead', entry(lead))
redis.register_function{function_name = 'lh_state', callback = entry(state_field),
  flags = {'no-writes'}}
redis.register_function('lh_acquire', entry(decimal(1)))
redis.register_function('lh_release', entry(decimal(2)))
redis.register_function('lh_exact', entry(decimal(3)))
redis.register_function('lh_split', entry(decimal(4)))
redis.register_function('lh_deposit', entry(decimal(5)))
redis.register_function('lh_rate', entry(decimal(6)))
redis.register_function{function_name = 'lh_exact_batch', callback = entry(exact_packed),
  flags = {'allow-cross-slot-keys'}}
-- Which text of the library is loaded: the agent writes a fingerprint of the text in
-- place of the marker when it loads it, and does not load it again where it finds its
-- own (a fleet of agents starting together would otherwise each have Redis compile it).
redis.register_function{function_name = 'lh_fingerprint',
  callback = function() return 'LEASEHOLD_FINGERPRINT' end, flags = {'no-writes'}}

"""Replays a MONITOR capture's library calls through two texts of lua/leasehold.lua on one
private redis-server and reports every call where they differ: `same.py PORT CAPTURE OLD NEW`.

Each text is loaded under its own library and function names (lh_call -> lhA_call for
OLD, lhB_call for NEW), OLD's keys in database 0 and NEW's in database 1, and both read
the server's time from a key the replay sets to the captured call's time (moved to an
hour ahead, so that no expiry passes between the two texts' calls), so the two see the
same clock. After each call the reply, and every key it names (DUMP, PEXPIRETIME),
must be byte for byte the same; a batch's dedup record is compared by value only (its
expiry is set from Redis's own clock). Exit status 1 if any call differs."""
import re
import socket
import sys
import time

import resp

port, capture, old, new = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]

FAKE_TIME = """local function fake_time()
  local us = tonumber(redis.call('GET', 'lh-same:time'))
  return {string.format('%d', math.floor(us / 1000000)), string.format('%d', us % 1000000)}
end
"""


def renamed(path, tag):
    text = open(path).read()
    first, rest = text.split("\n", 1)
    if not first.startswith("#!lua name="):
        sys.exit(f"{path}: not a library (its first line is not '#!lua name=...')")
    rest, n = re.subn(r"(rcall|redis\.call)\('TIME'\)", "fake_time()", rest)
    if n == 0:
        sys.exit(f"{path}: no redis.call('TIME') to fake: the replay cannot give both texts one clock")
    rest = re.sub(r"'lh_([a-z_]+)'", lambda m: f"'lh{tag}_{m.group(1)}'", rest)
    return f"{first}{tag}\n{FAKE_TIME}{rest}"


def unquote(s):
    """A MONITOR argument's bytes (it escapes as redis-cli does)."""
    out, i = bytearray(), 0
    while i < len(s):
        c = s[i]
        if c == "\\":
            d = s[i + 1]
            if d == "x":
                out.append(int(s[i + 2 : i + 4], 16))
                i += 4
                continue
            out += {"n": b"\n", "r": b"\r", "t": b"\t", "a": b"\a", "b": b"\b", '"': b'"', "\\": b"\\"}[d]
            i += 2
            continue
        out += c.encode("latin1")
        i += 1
    return bytes(out)


class Conn:
    def __init__(self, db):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.replies = self.sock.makefile("rb")
        self.command("SELECT", db)

    def command(self, *args):
        self.sock.sendall(resp.encode(*args))
        return resp.read(self.replies)


a, b = Conn(0), Conn(1)
for path, tag in ((old, "A"), (new, "B")):
    r = a.command("FUNCTION", "LOAD", "REPLACE", renamed(path, tag).encode())
    if isinstance(r, resp.Error):
        sys.exit(f"{path}: FUNCTION LOAD: {r.decode(errors='replace').strip()}")

calls = differ = 0
# The clock both texts read: the captured times moved to an hour past now, so no key's
# expiry (set from that clock) passes on Redis's own clock between the two texts' calls.
shift = None
for line in open(capture, encoding="latin1"):
    if '"FCALL"' not in line or not re.search(r'"lh_(call|exact_batch)"', line):
        continue
    args = [unquote(x) for x in re.findall(r'"((?:[^"\\]|\\.)*)"', line)]
    at = int(float(line.split()[0]) * 1e6)
    if shift is None:
        shift = int(time.time() * 1e6) + 3_600_000_000 - at
    at += shift
    a.command("SET", "lh-same:time", at)
    b.command("SET", "lh-same:time", at)
    name = args[1][3:]
    ra = a.command("FCALL", b"lhA_" + name, *args[2:])
    rb = b.command("FCALL", b"lhB_" + name, *args[2:])
    calls += 1
    keys = args[3 : 3 + int(args[2])]
    seen = []
    if name == b"exact_batch":
        dedup, keys = keys[0], keys[1:]
        seen.append((a.command("GET", dedup), b.command("GET", dedup)))
    for k in keys:
        seen.append((a.command("DUMP", k), b.command("DUMP", k)))
        seen.append((a.command("PEXPIRETIME", k), b.command("PEXPIRETIME", k)))
    if ra != rb or any(x != y for x, y in seen):
        differ += 1
        if differ <= 5:
            print(f"call {calls} differs: FCALL lh_{name.decode()} on {keys[0]!r}")
            print(f"  old: {ra!r:.300}\n  new: {rb!r:.300}")
print(f"{calls} calls replayed, {differ} differ")
if calls == 0:
    sys.exit("the capture holds no lh_call or lh_exact_batch")
sys.exit(1 if differ else 0)

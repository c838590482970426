"""Sends one private redis-server the calls scripts/lua-cost counts: `drive.py PORT N CALLS`
with LIB (the library, or with NAIVE set the naive script, one key a call) and KEYS_FROM (new: a key
never seen before for every decision; zipf: Zipf 0.9 over 100 000 keys). Plain RESP
over a socket, pipelined 50 calls at a time; any error reply stops it."""
import bisect
import itertools
import os
import random
import socket
import struct
import sys

import resp
from resp import encode

port, n, calls = (int(a) for a in sys.argv[1:4])
conn = socket.create_connection(("127.0.0.1", port))
replies = conn.makefile("rb")


def read():
    r = resp.read(replies)
    if isinstance(r, resp.Error):
        sys.exit(f"error reply: {r!r}")
    return r


def command(*args):
    conn.sendall(encode(*args))
    return read()


rng = random.Random(7)
cdf = list(itertools.accumulate(1.0 / k**0.9 for k in range(1, 100_001)))
new_keys = os.environ.get("KEYS_FROM", "zipf") == "new"


def key(prefix):
    if new_keys:
        return "%s{sim|tenant-%d}" % (prefix, rng.randrange(10**12))
    return "%s{sim|tenant-%d}" % (prefix, bisect.bisect_left(cdf, rng.random() * cdf[-1]))


if os.environ.get("NAIVE"):
    sha = command("SCRIPT", "LOAD", open(os.environ["LIB"]).read()).decode()

    def call(seq):
        return encode("EVALSHA", sha, 1, key("naive:"), 100, 1000, 1)
else:
    command("FUNCTION", "LOAD", "REPLACE", open(os.environ["LIB"]).read())
    agent = "ab12cd34ef56ab12"

    def call(seq):
        keys = []
        while len(keys) < n:
            k = key("lh:")
            if k not in keys:
                keys.append(k)
        # seq, one rule (B = 100, 1000 per 1 s, grace 1 s, strict), each key: rule 1, one cost of 1
        numbers = [seq, 1, 100, 1000, 1_000_000, 1_000_000, 0] + [1, 1, 1] * n
        blob = struct.pack("<%dQ" % len(numbers), *numbers)
        dedup = "%s:b:%s:%d" % (keys[0], agent, seq)
        return encode("FCALL", "lh_exact_batch", n + 1, dedup, *keys, agent, blob, "first")

requests = [call(i + 1) for i in range(calls)]
for i in range(0, calls, 50):
    conn.sendall(b"".join(requests[i : i + 50]))
    for _ in requests[i : i + 50]:
        read()

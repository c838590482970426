"""The RESP both scripts here speak to a private redis-server over one socket."""


def encode(*args):
    """A command's bytes (arguments as bytes, or anything `str` formats)."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out += [b"$%d\r\n" % len(a), a, b"\r\n"]
    return b"".join(out)


class Error(bytes):
    """An error reply's line (compared as its bytes)."""


def read(replies):
    """The next reply on `replies` (the socket's file): bulk strings as bytes (None for
    a null), arrays as lists, status and integer replies as their line, error replies
    as their line in an Error."""
    line = replies.readline()
    kind, rest = line[:1], line[1:]
    if kind == b"$":
        size = int(rest)
        return None if size < 0 else replies.read(size + 2)[:-2]
    if kind == b"*":
        return [read(replies) for _ in range(int(rest))]
    if kind == b"-":
        return Error(line)
    return line

//! Store addresses in errors and logs: a password, or anything that might be one, never
//! shows.
//!
//! A well-formed address keeps what an operator needs to recognise it (scheme, hosts,
//! database or service) with its credentials replaced by `***`. A malformed one
//! cannot be taken apart reliably (`redis//:PW@host`, `redis:/:PW@host`, a bare password,
//! `redis+sentinel://PW`), so the part that does not parse is not shown at all: the
//! message says what is wrong with its shape instead.

/// The schemes a store address may start with.
pub const SCHEMES: [&str; 6] = [
    "redis",
    "rediss",
    "cluster",
    "clusters",
    "redis+sentinel",
    "rediss+sentinel",
];

/// `address` for errors and logs: `redis://***@host:6379/0`. The user and password are
/// hidden whole (in a mistyped address a password can stand where a user name goes);
/// hosts that are not `HOST:PORT` (or, for one Redis, `localhost` or an address), a path
/// that is not a database number or service name, and any query are shown as `***`; an
/// address without a known scheme is described, not shown.
pub fn redact(address: &str) -> String {
    // A cluster's nodes each show, with the credentials of any node that has its own
    // hidden: taken as one authority, `cluster://h1:1,:PW@h2:2` showed as
    // `cluster://***@h2:2`, one node short.
    if let Some((scheme @ ("cluster" | "clusters"), rest)) = address.split_once("://")
        && rest.contains(',')
        && !rest.contains(['/', '?', '#'])
    {
        let nodes: Vec<String> = (rest.split(','))
            .map(|n| {
                let (hidden, h) = match n.rsplit_once('@') {
                    Some((_, h)) => ("***@", h),
                    None => ("", n),
                };
                format!("{hidden}{}", if host(h, false) { h } else { "***" })
            })
            .collect();
        return format!("{scheme}://{}", nodes.join(","));
    }
    let Some(parts) = Parts::of(address) else {
        return format!(
            "<not shown: {} characters, not of the form SCHEME://…; SCHEME is one of {}>",
            address.chars().count(),
            SCHEMES.join(", ")
        );
    };
    let mut out = format!("{}://", parts.scheme);
    if parts.userinfo.is_some() {
        out.push_str("***@");
    }
    out.push_str(if parts.hosts_ok { parts.hosts } else { "***" });
    if !parts.path.is_empty() {
        out.push_str(if parts.path_ok { parts.path } else { "/***" });
    }
    if parts.query.is_some() {
        out.push_str("?***");
    }
    out
}

/// What is wrong with the shape of `address` (see [`what_is_wrong`]), or `None` when its
/// scheme, hosts and database or service are well formed: a check made before anything
/// is started, which shows none of the address.
pub fn shape_problem(address: &str) -> Option<String> {
    match Parts::of(address) {
        // One Redis named without a port is port 6379, as redis-rs takes it (shown hidden:
        // a bare word could be a password typed where the host goes).
        Some(p)
            if (p.hosts_ok
                || matches!(p.scheme, "redis" | "rediss")
                    && host_problem(p.hosts, true) == Some(NO_PORT))
                && (p.path.is_empty() || p.path_ok) =>
        {
            query_problem(address, &p)
        }
        _ => Some(what_is_wrong(address)),
    }
}

/// What is wrong with the `?…` or `#…` that ends a well-formed address, or `None`.
/// redis-rs reads only `?protocol=` (resp2 or resp3) there (and `#insecure` on rediss://,
/// which this build cannot honour), and drops anything else without a word: `?db=2`
/// would leave the database at 0, `?password=…` connect with none. Names only the
/// parameters it knows by name (a password can stand anywhere in a mistyped address).
fn query_problem(address: &str, p: &Parts) -> Option<String> {
    let q = p.query?;
    if p.password_cut() {
        return Some(PASSWORD_CUT.into());
    }
    // Parts splits at the first `?` or `#`: which of them it was.
    let (query, fragment) = if address[..address.len() - q.len()].ends_with('#') {
        (None, Some(q))
    } else {
        match q.split_once('#') {
            Some((q, f)) => (Some(q), Some(f)),
            None => (Some(q), None),
        }
    };
    let read = "only `?protocol=resp2` (or `resp3`) is read there";
    for item in query.into_iter().flat_map(|q| q.split('&')) {
        match item.split_once('=').map_or(item, |(name, _)| name) {
            "" | "protocol" => {}
            "db" => {
                return Some(format!(
                    "`?db=` is not read: the database goes in the path, \
                     redis://HOST:PORT/DB ({read})"
                ));
            }
            name @ ("user" | "username" | "pass" | "password") => {
                return Some(format!(
                    "`?{name}=` is not read: credentials go before the host, \
                     redis://USER:PASSWORD@HOST:PORT, a password with `@ : / ? # %` in it \
                     percent-encoded ({read})"
                ));
            }
            _ => {
                return Some(format!(
                    "it ends in a parameter redis-rs would ignore: {read}"
                ));
            }
        }
    }
    match fragment {
        None | Some("") => None,
        // redis-rs would take it on rediss://, then fail at every connection: skipping
        // the certificate check is not built in.
        Some("insecure") => Some(
            "`#insecure` (no check of the server's certificate) is not supported: give the \
             server's CA instead (--redis-ca-file, LEASEHOLD_REDIS_CA_FILE)"
                .into(),
        ),
        Some(_) => Some(format!("it ends in a `#…` redis-rs does not read: {read}")),
    }
}

/// What is wrong with an address that does not parse, in words that show none of it.
pub fn what_is_wrong(address: &str) -> String {
    let Some(p) = Parts::of(address) else {
        return format!(
            "not of the form SCHEME://…; SCHEME is one of {}",
            SCHEMES.join(", ")
        );
    };
    let single = matches!(p.scheme, "redis" | "rediss");
    if !p.hosts_ok {
        let shape = if single {
            "the part after `@` (or after `://`) is not HOST:PORT (PORT 1 to 65535, \
             [ADDRESS]:PORT for IPv6)"
        } else {
            "the part after `@` (or after `://`) is not HOST:PORT[,HOST:PORT...] (PORT 1 to \
             65535, [ADDRESS]:PORT for IPv6)"
        };
        if p.password_cut() {
            return format!("{shape}: {PASSWORD_CUT}");
        }
        // Which node, and what of it: said in words, never shown (a password typed in
        // the wrong place would stand there).
        let nodes: Vec<&str> = p.hosts.split(',').collect();
        if single && nodes.len() > 1 {
            return format!("{shape}: one Redis takes one HOST:PORT (several nodes: cluster://…)");
        }
        let why = nodes
            .iter()
            .enumerate()
            .find_map(|(i, h)| host_problem(h, single).map(|why| (i, why)));
        return match why {
            Some((_, why)) if nodes.len() == 1 => format!("{shape}: {why}"),
            Some((i, why)) => format!("{shape}: node {} of {}: {why}", i + 1, nodes.len()),
            None => shape.into(),
        };
    }
    if !p.path.is_empty() && !p.path_ok {
        return if single {
            "what follows HOST:PORT is not /DB, a database number".into()
        } else {
            "what follows the hosts is not /SERVICE (letters, digits, `-`, `_`, `.`)".into()
        };
    }
    "it does not parse as a URL: a password with `@ : / ? # %` in it must be \
     percent-encoded (`@` is %40)"
        .into()
}

/// `text` with everything [`redact`] hides of `address` replaced by `***`: the password
/// (also percent-decoded), hidden userinfo, hosts, path or query, and for an address that
/// does not parse, every word of it that could be a secret.
pub fn redact_in(text: &str, address: &str) -> String {
    let mut secrets: Vec<String> = Vec::new();
    match Parts::of(address) {
        Some(p) => {
            // The userinfo whole, and each side of its colon long enough to be a
            // password (a typo can put one on either side; a one-letter user is no
            // secret, and replacing it would garble the text).
            if let Some(u) = p.userinfo {
                secrets.push(u.to_owned());
                secrets.extend(
                    u.split(':')
                        .filter(|w| w.len() >= MIN_GUESS)
                        .map(str::to_owned),
                );
            }
            // Hidden parts that might hold a password typed in the wrong place; pieces
            // shorter than a password would garble the text and are left.
            let mut maybe: Vec<&str> = Vec::new();
            if !p.hosts_ok {
                maybe.push(p.hosts);
            }
            if !p.path_ok {
                maybe.push(p.path.trim_start_matches('/'));
            }
            if let Some(q) = p.query {
                // Each parameter's value, or the whole of one without `=` (a password typed
                // there); a name before `=` stays, so that a message can say `?db=`.
                maybe.push(q);
                maybe.extend(
                    q.split(['&', '#'])
                        .map(|i| i.split_once('=').map_or(i, |(_, v)| v)),
                );
            }
            secrets.extend(
                maybe
                    .into_iter()
                    .filter(|w| w.len() >= MIN_GUESS)
                    .map(str::to_owned),
            );
        }
        None => {
            secrets.push(address.to_owned());
            secrets.extend(
                address
                    .split([':', '/', '@', ',', '?', '#', ' '])
                    .filter(|w| w.len() >= MIN_GUESS)
                    .filter(|w| !SCHEMES.contains(w) && !w.chars().all(|c| c.is_ascii_digit()))
                    .filter(|w| w.parse::<std::net::IpAddr>().is_err())
                    .map(str::to_owned),
            );
        }
    }
    let decoded: Vec<String> = secrets.iter().filter_map(|s| percent_decoded(s)).collect();
    secrets.extend(decoded);
    // Longest first, so a secret that contains another is replaced whole.
    secrets.retain(|s| !s.is_empty());
    secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
    let mut out = text.to_owned();
    for s in &secrets {
        out = out.replace(s.as_str(), "***");
    }
    out
}

/// Pieces of a malformed address shorter than this are not taken for secrets (replacing
/// every `h` of a message hides nothing and garbles it).
const MIN_GUESS: usize = 4;

/// An address taken apart: `scheme://[userinfo@]hosts[path][?query]`.
struct Parts<'a> {
    scheme: &'a str,
    userinfo: Option<&'a str>,
    hosts: &'a str,
    hosts_ok: bool,
    path: &'a str,
    path_ok: bool,
    query: Option<&'a str>,
}

/// What [`Parts::password_cut`] finds, said.
const PASSWORD_CUT: &str = "a `?` or `#` in the password ends the address there; \
                            percent-encode them (`?` is %3F, `#` is %23)";

impl<'a> Parts<'a> {
    /// Whether an unencoded `?` or `#` in the password cut the address short: an `@`
    /// past the first of them, the rest read as a query.
    fn password_cut(&self) -> bool {
        self.query.is_some_and(|q| q.contains('@'))
    }

    fn of(address: &'a str) -> Option<Self> {
        let (scheme, rest) = address.split_once("://")?;
        if !SCHEMES.contains(&scheme) {
            return None;
        }
        let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, authority),
        };
        let (path, query) = match tail.find(['?', '#']) {
            Some(i) => (&tail[..i], Some(&tail[i + 1..])),
            None => (tail, None),
        };
        let single = matches!(scheme, "redis" | "rediss");
        Some(Self {
            scheme,
            userinfo,
            hosts,
            hosts_ok: !hosts.is_empty()
                && (!single || !hosts.contains(','))
                && hosts.split(',').all(|h| host(h, single)),
            path,
            // A database number for one Redis, a service name for Sentinels.
            path_ok: path.strip_prefix('/').is_some_and(|p| match scheme {
                "redis" | "rediss" => p.chars().all(|c| c.is_ascii_digit()),
                _ => plain(p),
            }),
            query,
        })
    }
}

/// A user name, database number or service name that may be shown.
fn plain(s: &str) -> bool {
    s.len() <= 64
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

/// `HOST:PORT` (`[v6]:PORT`); for one Redis, `localhost` or an address may leave the
/// port out.
fn host(h: &str, port_optional: bool) -> bool {
    host_problem(h, port_optional).is_none()
}

/// A host without its port.
const NO_PORT: &str = "it has no :PORT";

/// An IPv6 address without its brackets (or with one of them).
const IPV6_BRACKETS: &str = "an IPv6 address goes in brackets, then its port: [ADDRESS]:PORT";

/// What keeps `h` from being `HOST:PORT` (see [`host`]), in words that show none of it.
fn host_problem(h: &str, port_optional: bool) -> Option<&'static str> {
    if h.is_empty() {
        return Some("it is empty");
    }
    let (name, port) = match h.rsplit_once(':') {
        Some((n, p)) if !n.ends_with(':') || n.starts_with('[') => (n, Some(p)),
        _ => (h, None),
    };
    match port {
        Some(p)
            if !(p.parse::<u16>().is_ok_and(|p| p > 0)
                && p.chars().all(|c| c.is_ascii_digit())) =>
        {
            return Some("its PORT is not a number from 1 to 65535");
        }
        Some(_) => {}
        // A bare word could be a password typed where the host goes.
        None if port_optional
            && (name == "localhost" || name.parse::<std::net::IpAddr>().is_ok()) => {}
        None if name.starts_with('[') || name.contains("::") => return Some(IPV6_BRACKETS),
        None => return Some(NO_PORT),
    }
    match name.strip_prefix('[').and_then(|n| n.strip_suffix(']')) {
        Some(v6) if v6.parse::<std::net::Ipv6Addr>().is_err() => {
            Some("what is in brackets is not an IPv6 address")
        }
        Some(_) => None,
        None if name.starts_with('[') || name.contains("::") => Some(IPV6_BRACKETS),
        None if name.contains(':') => {
            Some("it has more than one `:PORT` (an IPv6 address goes in brackets: [ADDRESS]:PORT)")
        }
        None if name.is_empty() => Some("its HOST is empty"),
        None if name.len() > 253 || !plain(name) => {
            Some("its HOST is not a host name or address (letters, digits, `-`, `_`, `.`)")
        }
        None => None,
    }
}

/// Whether `s` has a `%` not followed by two hex digits (not an escape).
pub(crate) fn bad_escape(s: &str) -> bool {
    let b = s.as_bytes();
    (0..b.len()).any(|i| {
        b[i] == b'%'
            && !b
                .get(i + 1..i + 3)
                .is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit))
    })
}

/// `s` percent-decoded, as redis-rs decodes a `redis://` address's user and password
/// (`s` itself when it holds no escape, or does not decode to UTF-8).
pub(crate) fn percent_decode(s: &str) -> String {
    percent_decoded(s).unwrap_or_else(|| s.to_owned())
}

/// `s` with its `%XX` escapes decoded, when it has any and decodes to UTF-8: by the
/// `percent-encoding` crate, redis-rs's own decoder.
fn percent_decoded(s: &str) -> Option<String> {
    if !s.contains('%') {
        return None;
    }
    let decoded = percent_encoding::percent_decode_str(s).decode_utf8().ok()?;
    Some(decoded.into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn well_formed_addresses_keep_all_but_the_password() {
        assert_eq!(
            redact("redis://:s3cret@10.0.0.1:6379/0"),
            "redis://***@10.0.0.1:6379/0"
        );
        assert_eq!(
            redact("rediss://app:p@ss:w@host:6380"),
            "rediss://***@host:6380"
        );
        assert_eq!(redact("redis://host:6379"), "redis://host:6379");
        assert_eq!(redact("redis://localhost"), "redis://localhost");
        assert_eq!(
            redact("redis+sentinel://:pw@a:26379,[::1]:26380/mymaster"),
            "redis+sentinel://***@a:26379,[::1]:26380/mymaster"
        );
        assert_eq!(
            redact("cluster://127.0.0.1:7000,127.0.0.1:7001"),
            "cluster://127.0.0.1:7000,127.0.0.1:7001"
        );
        assert_eq!(
            redact("cluster://:pw@127.0.0.1:7000,127.0.0.1:7001"),
            "cluster://***@127.0.0.1:7000,127.0.0.1:7001"
        );
        assert_eq!(
            redact("clusters://127.0.0.1:7000,:pw@127.0.0.1:7001,h3"),
            "clusters://127.0.0.1:7000,***@127.0.0.1:7001,***"
        );
        assert_eq!(
            redact_in("failed: s3cret rejected", "redis://:s3cret@h"),
            "failed: *** rejected"
        );
        // A short user or host is no secret: the message stays readable.
        let text = "store unavailable: Connection refused (os error 111)";
        assert_eq!(redact_in(text, "redis://u:Secret123@h:1"), text);
        assert_eq!(redact_in(text, "redis:/:Secret123@h:1"), text);
    }

    /// The shapes an operator gets wrong, each of which once printed its password.
    #[test]
    fn malformed_addresses_show_no_secret() {
        let pw = "Pw7leak-check";
        let shapes = [
            format!("redis//:{pw}@127.0.0.1:1"),
            format!("redis:/:{pw}@127.0.0.1:1"),
            format!("redis:{pw}@127.0.0.1:1"),
            pw.to_owned(),
            format!("redis+sentinel://{pw}"),
            format!("redis+sentinel://{pw}/mymaster"),
            format!("redis://{pw}@host:1"),
            format!("redis://:{pw}@host:notaport"),
            format!("redis://host:1/{pw}"),
            format!("redis://host:1/0?password={pw}"),
            format!("cluster://{pw}"),
            format!("http://:{pw}@host:1"),
            format!(" redis://:{pw}@host:1"),
            format!("redis://:{}@host:1", pw.replace('-', "%2D")),
        ];
        for a in &shapes {
            let shown = redact(a);
            assert!(!shown.contains("Pw7"), "{a:?} shown as {shown:?}");
            let text = format!("error parsing {a}: {pw} in {a:?}");
            let hidden = redact_in(&text, a);
            assert!(!hidden.contains("Pw7"), "{a:?}: {hidden:?}");
            let why = what_is_wrong(a);
            assert!(!why.contains("Pw7"), "{a:?}: {why:?}");
        }
    }

    #[test]
    fn shape_problem_passes_good_addresses_and_names_the_bad() {
        for good in [
            "redis://127.0.0.1:6379",
            "redis://localhost",
            "redis://cache.internal",
            "rediss://:pw@cache.internal:6380/2",
            "cluster://:pw@a:1,b:2",
            "redis+sentinel://s1:26379,s2:26379/mymaster",
        ] {
            assert_eq!(shape_problem(good), None, "{good}");
        }
        let why = shape_problem("redis://:hunter2@127.0.0.1:notaport").unwrap_or_default();
        assert!(why.contains("its PORT is not a number"), "{why}");
        assert!(!why.contains("hunter2"), "{why}");
        let why = shape_problem("cluster://a:1,,b:2").unwrap_or_default();
        assert!(why.contains("node 2 of 3: it is empty"), "{why}");
    }

    /// redis-rs drops a query parameter it does not read without a word: refused, by
    /// name when it is one it knows, its value never shown.
    #[test]
    fn a_query_redis_rs_would_ignore_is_refused() {
        for good in [
            "redis://h:1/0?protocol=resp3",
            "redis://h:1?protocol=2",
            "rediss://h:1?protocol=resp3#",
            "redis://h:1/?",
        ] {
            assert_eq!(shape_problem(good), None, "{good}");
        }
        let pw = "Zq9-secret";
        for (bad, says) in [
            (
                "redis://h:1?db=2".to_owned(),
                "`?db=` is not read: the database goes in the path",
            ),
            (
                format!("redis://h:1/0?password={pw}"),
                "`?password=` is not read: credentials go",
            ),
            (
                format!("rediss://h:1?user=app&pass={pw}"),
                "`?user=` is not read",
            ),
            (
                format!("redis://h:1?{pw}"),
                "a parameter redis-rs would ignore",
            ),
            // A password with `?` then `#` in it, the host taken as the user's.
            (
                format!("redis://{pw}?q#z@127.0.0.1:6379"),
                "a `?` or `#` in the password ends the address there",
            ),
            (
                format!("redis://h:1?protocol=resp3&{pw}=1"),
                "a parameter redis-rs would ignore",
            ),
            (
                "redis://h:1#insecure".to_owned(),
                "`#insecure` (no check of the server's",
            ),
            (
                "rediss://h:1/2#insecure".to_owned(),
                "give the server's CA instead",
            ),
            (
                format!("rediss://h:1#{pw}"),
                "a `#…` redis-rs does not read",
            ),
            (
                format!("cluster://a:1,b:2?password={pw}"),
                "`?password=` is not read",
            ),
        ] {
            let why = shape_problem(&bad).unwrap_or_default();
            assert!(why.contains(says), "{bad}: {why}");
            assert!(!why.contains("Zq9"), "{bad}: {why}");
            assert!(!redact(&bad).contains("Zq9"), "{bad}");
        }
    }

    /// A refused address is explained in words, not redis-rs's "InvalidClientConfig".
    #[test]
    fn what_is_wrong_names_the_part() {
        for (address, says) in [
            ("redis://:pw@127.0.0.1:notaport", "is not HOST:PORT"),
            ("redis://127.0.0.1:99999", "PORT 1 to 65535"),
            (
                "redis://:pw@127.0.0.1:notaport",
                "): its PORT is not a number from 1 to 65535",
            ),
            ("redis://:pw@:6379", "): its HOST is empty"),
            (
                "redis://:pa?ss@127.0.0.1:6379",
                ": a `?` or `#` in the password ends",
            ),
            ("redis://user:pa#ss@127.0.0.1:6379", "`#` is %23"),
            ("redis://:pw@", "): it is empty"),
            ("redis://:pw@cache.internal", "): it has no :PORT"),
            ("redis://:pw@[::1", "): an IPv6 address goes in brackets"),
            ("redis://::1:6379", "): an IPv6 address goes in brackets"),
            (
                "redis://[::zz]:6379",
                "): what is in brackets is not an IPv6 address",
            ),
            (
                "redis://ca$he:6379",
                "): its HOST is not a host name or address",
            ),
            ("redis://a:1,b:2", "one Redis takes one HOST:PORT"),
            (
                "redis://127.0.0.1:6379:6380",
                "): it has more than one `:PORT`",
            ),
            (
                "redis://127.0.0.1:0",
                "): its PORT is not a number from 1 to 65535",
            ),
            (
                "redis://127.0.0.1:",
                "): its PORT is not a number from 1 to 65535",
            ),
            (
                "cluster://a:1,b:x,c:3",
                "node 2 of 3: its PORT is not a number",
            ),
            ("redis://h:1/abc", "not /DB, a database number"),
            ("redis+sentinel://h:1/a b", "not /SERVICE"),
            ("cluster://a:1,b:x", "HOST:PORT[,HOST:PORT...]"),
            ("redis:/x", "not of the form SCHEME://"),
        ] {
            let why = what_is_wrong(address);
            assert!(why.contains(says), "{address}: {why}");
        }
    }

    /// A fuzzed set: well-formed addresses of every kind with one separator dropped,
    /// doubled or swapped for another (the typos that break a URL), never show the
    /// password, shown or echoed.
    #[test]
    fn no_address_shape_shows_its_password() {
        let mut state = 0x9E37_79B9_7F4A_7C15_u64;
        let mut below = |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        };
        let templates = [
            "redis://:PW@127.0.0.1:6379/0",
            "redis://app:PW@cache.internal:6379",
            "rediss://default:PW@[::1]:6380/2",
            "redis+sentinel://:PW@10.0.0.1:26379,10.0.0.2:26379/mymaster",
            "rediss+sentinel://u:PW@s1:26379/svc",
            "cluster://:PW@127.0.0.1:7000,127.0.0.1:7001",
        ];
        let separators = [':', '/', '@', ',', '?', '#', '%', ' '];
        for round in 0..20_000 {
            let template = templates[round % templates.len()];
            let password = ["Zq9secret", "Zq9s:e@c/r", "Zq9%41x"][below(3)];
            let mut a: Vec<char> = template.replace("PW", password).chars().collect();
            // Positions of separators outside the password.
            let start = template.find("PW").unwrap_or(0);
            let end = start + password.chars().count();
            let places: Vec<usize> = (0..a.len())
                .filter(|&i| (i < start || i >= end) && separators.contains(&a[i]))
                .collect();
            let at = places[below(places.len())];
            match below(3) {
                0 => {
                    a.remove(at);
                }
                1 => a.insert(at, a[at]),
                _ => a[at] = separators[below(separators.len())],
            }
            let a: String = a.into_iter().collect();
            let shown = redact(&a);
            assert!(!shown.contains("Zq9"), "{a:?} shown as {shown:?}");
            // Errors echo the address, whole or quoted.
            let hidden = redact_in(&format!("bad address {a}: {a:?}"), &a);
            assert!(!hidden.contains("Zq9"), "{a:?}: {hidden:?}");
        }
    }
}

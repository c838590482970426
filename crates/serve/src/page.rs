//! `GET /` on the HTTP listener: a page of what this serve decides with — its health, the
//! rules the configuration produced (for envoyproxy/ratelimit YAML, a rule per descriptor
//! limit, named `DOMAIN.KEY[_VALUE]...`) and how to address each over HTTP. Rendered on
//! the server from the limits in force, no script and no external assets; it reloads
//! itself every 5 s. Per-key state across gateways is the coordinator's page.

use std::fmt::Write as _;

use leasehold_store::rules::RuleSummary;

use crate::config::{Action, Limit};
use crate::decide::Decider;

/// Text made safe inside HTML elements and attribute values (this page's and simulate's
/// report's).
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A JSON request body for `POST /v1/check` that reaches `limit` in `domain` (an entry
/// without a value, or with a wildcard, takes a sample value to replace).
fn check_body(domain: &str, limit: &Limit) -> String {
    let entries: Vec<serde_json::Value> = limit
        .entries
        .iter()
        .map(|(k, v)| {
            let value = match v {
                Some(v) if !v.contains('*') => v.clone(),
                Some(v) => v.replace('*', "VALUE"),
                None => format!("<{k}>"),
            };
            serde_json::json!({ "key": k, "value": value })
        })
        .collect();
    serde_json::json!({ "domain": domain, "descriptors": [{ "entries": entries }] }).to_string()
}

/// The `GET /v1/auth` query for nginx `auth_request` that reaches `limit`.
fn auth_query(domain: &str, limit: &Limit) -> String {
    // Query-safe: letters, digits and `-._~` as they are, the rest as %XX of UTF-8.
    let enc = |s: &str| {
        let mut out = String::new();
        for b in s.bytes() {
            if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
                out.push(b as char);
            } else {
                let _ = write!(out, "%{b:02X}");
            }
        }
        out
    };
    let spec: Vec<String> = limit
        .entries
        .iter()
        .map(|(k, v)| match v {
            Some(v) if !v.contains('*') => format!("{k}={v}"),
            _ => k.clone(),
        })
        .collect();
    format!(
        "/v1/auth?domain={}&descriptor={}",
        enc(domain),
        enc(&spec.join(","))
    )
}

/// The page.
pub fn render(decider: &Decider) -> String {
    let health = decider.limiter().health().line();
    let domains = decider.domains();
    let rules = decider.limiter().rules();
    let mut out = String::from(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta http-equiv=\"refresh\" content=\"5\"><title>leasehold serve</title><style>\
         body{font:13px/1.4 system-ui,sans-serif;margin:0 1.5em 2em;color:#222}\
         h1{font-size:18px}h2{font-size:15px;border-bottom:1px solid #ddd;margin-top:1.4em}\
         table{border-collapse:collapse}th,td{padding:2px 8px;text-align:left;vertical-align:top}\
         th{background:#f3f3f3}code{font-size:12px;word-break:break-all}.ok{color:#17702a}\
         .bad{color:#b00020;font-weight:600}.warn{color:#8a5300}.dim{color:#777}</style></head><body>\
         <h1>leasehold serve</h1>",
    );
    let class = if health == "ready" { "ok" } else { "bad" };
    // As /health and /ready say it: each instance on its own store limits alone.
    let own = crate::http::embedded_note(decider.limiter())
        .map(|note| format!(" <span class=\"warn\" id=\"embedded\">{note}</span>"))
        .unwrap_or_default();
    let _ = write!(
        out,
        "<p>store: <span class=\"{class}\" id=\"health\">{}</span>{own} · <a href=\"/metrics\">/metrics</a> · \
         <a href=\"/ready\">/ready</a> · keys shared by many gateways, their shares and the bound: \
         the coordinator's page</p>",
        escape(&health)
    );
    let limits = domains.limits();
    let summaries = rules.summaries();
    if !limits.is_empty() {
        let _ = write!(
            out,
            "<h2>Descriptors (envoyproxy/ratelimit YAML, domains {})</h2>\
             <p class=\"dim\">Each limit is a rule named <code>DOMAIN.KEY[_VALUE]...</code>; \
             over gRPC Envoy names it by its descriptor. Over HTTP: <code>POST /v1/check</code> \
             with the body shown (200 OK, 429 over the limit, 503 unavailable), or nginx \
             <code>auth_request</code> to the <code>/v1/auth</code> address shown (a key alone \
             takes its value from the header <code>X-Leasehold-Value-KEY</code>).</p>\
             <table id=\"descriptors\"><tr><th>rule</th><th>limit</th><th>POST /v1/check body</th>\
             <th>GET (nginx)</th></tr>",
            escape(&domains.domain_names().join(", "))
        );
        for (key, l) in &limits {
            let domain = key.split('.').next().unwrap_or_default();
            let what = match &l.action {
                Action::Unlimited => "unlimited: always OK, not counted".to_owned(),
                Action::DenyAll => "requests_per_unit 0: always over the limit".to_owned(),
                Action::Rule(r) => format!(
                    "{} per {}{}{}",
                    l.requests_per_unit,
                    l.unit.map_or("?", |u| u.name()),
                    // The bucket behind it: its capacity (B) and how it is leased.
                    (summaries.iter()).find(|s| s.name == r.as_str()).map_or(
                        String::new(),
                        |s| format!(" (B {}, {} leasing)", s.capacity, s.leasing)
                    ),
                    if l.shadow {
                        " (shadow: never enforced)"
                    } else {
                        ""
                    }
                ),
            };
            let rule = match &l.action {
                Action::Rule(r) => r.as_str().to_owned(),
                _ => "-".to_owned(),
            };
            let _ = write!(
                out,
                "<tr><td><code>{}</code></td><td>{}</td><td><code>{}</code></td><td><code>{}</code></td></tr>",
                escape(&rule),
                escape(&what),
                escape(&check_body(domain, l)),
                escape(&auth_query(domain, l))
            );
        }
        out.push_str("</table>");
    }
    let yaml_rule = |name: &str| domains.has_rule(name) || name.starts_with("_limit.");
    let own: Vec<RuleSummary> = summaries
        .into_iter()
        .filter(|s| !yaml_rule(s.name.split(' ').next_back().unwrap_or_default()))
        .collect();
    if !own.is_empty() {
        out.push_str(
            "<h2>Rules</h2><p class=\"dim\">Over HTTP: <code>POST /v1/check</code> with \
             <code>{\"checks\":[{\"rule\":RULE,\"subject\":SUBJECT,\"cost\":1}]}</code> (all or \
             nothing), or <code>GET /v1/auth?rule=RULE&amp;subject=SUBJECT</code> for nginx.</p>\
             <table id=\"rules\"><tr><th>rule / override</th><th>capacity</th><th>rate</th>\
             <th>leasing</th><th>on failure</th><th>POST /v1/check body</th></tr>",
        );
        for s in &own {
            let body = if s.name.starts_with("override ") {
                String::new()
            } else {
                serde_json::json!({ "checks": [{ "rule": s.name, "subject": "SUBJECT" }] })
                    .to_string()
            };
            let _ = write!(
                out,
                "<tr><td><code>{}</code></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td><code>{}</code></td></tr>",
                escape(&s.name),
                s.capacity,
                escape(&s.rate),
                s.leasing,
                escape(&s.on_failure),
                escape(&body)
            );
        }
        out.push_str("</table>");
    }
    out.push_str("</body></html>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::escape;

    #[test]
    fn text_cannot_open_an_element() {
        assert_eq!(
            escape("<script>\"a\"&'b'</script>"),
            "&lt;script&gt;&quot;a&quot;&amp;&#39;b&#39;&lt;/script&gt;"
        );
    }
}

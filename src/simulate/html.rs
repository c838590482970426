//! `simulate --report FILE.html`: one self-contained page to share a run: the command's
//! settings, the summary table with what each column means, the notes under it, the plot
//! (inline SVG) and the scenario as TOML. No script, no external assets.

use super::{COLUMN_HELP, COLUMNS, Options, RunReport, notes, rows};

pub(crate) use leasehold_serve::page::escape;

/// The page for `report` of the run `opts` describes.
pub(crate) fn report(opts: &Options, report: &RunReport) -> String {
    let s = &opts.scenario;
    let scenario = toml::to_string(s).unwrap_or_else(|e| format!("(not shown: {e})"));
    let mut out = format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>leasehold simulate: {name}</title><style>\
         body{{font:13px/1.4 system-ui,sans-serif;margin:1em 2em;color:#222}}\
         h1{{font-size:18px}}h2{{font-size:15px;border-bottom:1px solid #ddd;margin-top:1.4em}}\
         table{{border-collapse:collapse}}th,td{{padding:2px 8px;text-align:right}}\
         th{{background:#f3f3f3}}td:first-child,th:first-child{{text-align:left}}\
         dt{{font-weight:600}}dd{{margin:0 0 .3em 1.5em;color:#444}}\
         pre{{background:#f7f7f7;padding:.6em;overflow:auto}}</style></head><body>\
         <h1>leasehold simulate: scenario {name}</h1>\
         <p>{agents} agents · store {store} · {secs} s measured per system after {warm} s of \
         warm-up · compared with {compare} · seed {seed}</p><h2>Results</h2><table id=\"results\"><tr>",
        name = escape(&s.name),
        agents = s.agents,
        store = escape(opts.store.shown()),
        secs = opts.duration.as_secs_f64(),
        warm = opts.warm_up.as_secs_f64(),
        compare = if opts.compare.is_empty() {
            "nothing".to_owned()
        } else {
            escape(&opts.compare.join(", "))
        },
        seed = opts.seed,
    );
    for (h, _) in COLUMNS {
        out.push_str(&format!("<th>{}</th>", escape(h)));
    }
    out.push_str("</tr>");
    for row in rows(report) {
        out.push_str("<tr>");
        for cell in row {
            out.push_str(&format!("<td>{}</td>", escape(&cell)));
        }
        out.push_str("</tr>");
    }
    out.push_str("</table>");
    for note in notes(report) {
        out.push_str(&format!("<p>{}</p>", escape(note.trim_end())));
    }
    if !report.plot.is_empty() {
        out.push_str("<h2>Admitted rate against the limit</h2>");
        out.push_str(&report.plot);
    }
    out.push_str("<h2>Columns</h2><dl>");
    for ((h, _), help) in COLUMNS.iter().zip(COLUMN_HELP) {
        out.push_str(&format!("<dt>{}</dt><dd>{}</dd>", escape(h), escape(help)));
    }
    out.push_str(&format!(
        "</dl><h2>Scenario</h2><pre id=\"scenario\">{}</pre></body></html>\n",
        escape(&scenario)
    ));
    out
}

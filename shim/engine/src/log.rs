//! planarian's own messages.
//!
//! * Errors: one line on stderr, and, when Podman passed `--log FILE`, a runc-compatible line in
//!   that file (`--log-format json` → `{"level":…,"msg":…,"time":…}`), which Podman reads back and
//!   shows to the user.
//! * Information and warnings from a runtime verb (what Podman and conmon call) never reach
//!   stdout or stderr: crun prints nothing there on success, and scripts read Podman's output.
//!   They go to planarian's own log ([`OWN_LOG`]), and to `--log` as well: warnings always (as
//!   runc does), information when asked (`--debug` or `--log-level debug|info`).
//! * [`Progress`]: the phases of planarian's own long commands (rollback, fork), with their
//!   times, on stderr (stdout is for results and `--json`).

use std::io::Write;
use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// Where a runtime verb's messages go: the `--log` file Podman or conmon passed, in the format
/// they asked for, and whether they asked for information (`--debug`, `--log-level info|debug`).
#[derive(Debug, Clone, Default)]
pub struct Sink {
    pub path: Option<PathBuf>,
    pub format: LogFormat,
    pub debug: bool,
}

impl Sink {
    /// A verb failed: one line on stderr, and the runc-style line in `--log`.
    pub fn error(&self, msg: &str) {
        eprintln!("planarian: {msg}");
        self.write_log("error", msg);
    }

    /// Something a runtime verb did (a statepoint committed, …): planarian's own log, and `--log`
    /// when the caller asked for information.
    pub fn info(&self, msg: &str) {
        own_log("info", msg);
        if self.debug {
            self.write_log("info", msg);
        }
    }

    /// Something the user may want to act on, that did not fail the verb.
    pub fn warn(&self, msg: &str) {
        own_log("warning", msg);
        self.write_log("warning", msg);
    }

    fn write_log(&self, level: &str, msg: &str) {
        let Some(path) = &self.path else { return };
        let line = format_line(self.format, level, msg, SystemTime::now());
        if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
            let _ = f.write_all(line.as_bytes());
        }
    }
}

/// planarian's own log: one line per statepoint event, whoever called.
pub const OWN_LOG: &str = "/var/log/planarian.log";

pub(crate) fn own_log(level: &str, msg: &str) {
    let path = std::env::var_os("PLANARIAN_LOG").map(std::path::PathBuf::from).unwrap_or_else(|| OWN_LOG.into());
    let line = format_line(LogFormat::Text, level, msg, SystemTime::now());
    if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
        let _ = f.write_all(line.as_bytes());
    }
}

/// What a long operation reports as it goes: each phase when it starts, a note when it ends.
/// The binary shows them on stderr; a library caller may show them elsewhere, or not at all.
pub trait Progress {
    /// Ends the current phase (if any) and starts the next one.
    fn phase(&mut self, name: &str);
    /// Ends the current phase with a note beside its time (e.g. the statepoint it made).
    fn done(&mut self, note: &str);
}

/// Reports nothing.
pub struct Silent;

impl Progress for Silent {
    fn phase(&mut self, _: &str) {}
    fn done(&mut self, _: &str) {}
}

/// The phases of a long operation on stderr: each phase's name when it starts, its time when it
/// ends, so a user waiting on a restore knows what is being waited for.
pub struct StderrProgress {
    started: std::time::Instant,
    phase: Option<std::time::Instant>,
}

impl StderrProgress {
    /// Prints the operation's title.
    pub fn start(title: &str) -> StderrProgress {
        eprintln!("planarian: {title}");
        StderrProgress { started: std::time::Instant::now(), phase: None }
    }

    fn end_phase(&mut self) {
        if let Some(t) = self.phase.take() {
            eprintln!("{:>7}", secs(t.elapsed()));
        }
    }

    /// Ends the last phase and prints the total.
    pub fn finish(mut self) {
        self.end_phase();
        eprintln!("  {:<40} {:>7}", "total", secs(self.started.elapsed()));
    }
}

impl Progress for StderrProgress {
    fn phase(&mut self, name: &str) {
        self.end_phase();
        eprint!("  {name:<40} ");
        self.phase = Some(std::time::Instant::now());
    }

    fn done(&mut self, note: &str) {
        if let Some(t) = self.phase.take() {
            eprintln!("{:>7} {note}", secs(t.elapsed()));
        }
    }
}

/// The phases of one of several operations running side by side, on stderr: a whole line per
/// phase as it ends (`  agent-b  processes (podman container restore)   2.1s`), so that
/// the lines of the others never cut into it.
pub struct LineProgress {
    who: String,
    phase: Option<(String, std::time::Instant)>,
}

impl LineProgress {
    pub fn new(who: &str) -> LineProgress {
        LineProgress { who: who.to_string(), phase: None }
    }

    fn end(&mut self, note: &str) {
        if let Some((name, t)) = self.phase.take() {
            eprintln!("  {:<24} {name:<40} {:>7} {note}", self.who, secs(t.elapsed()));
        }
    }
}

impl Progress for LineProgress {
    fn phase(&mut self, name: &str) {
        self.end("");
        self.phase = Some((name.to_string(), std::time::Instant::now()));
    }

    fn done(&mut self, note: &str) {
        self.end(note);
    }
}

impl Drop for LineProgress {
    fn drop(&mut self) {
        self.end("");
    }
}

impl Drop for StderrProgress {
    /// A failed phase: its line is ended so the error that follows stands on a line of its own.
    fn drop(&mut self) {
        if let Some(t) = self.phase.take() {
            eprintln!("{:>7} failed", secs(t.elapsed()));
        }
    }
}

fn secs(d: std::time::Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

fn format_line(format: LogFormat, level: &str, msg: &str, now: SystemTime) -> String {
    let time = rfc3339(now);
    match format {
        LogFormat::Json => {
            let v = serde_json::json!({ "level": level, "msg": msg, "time": time });
            format!("{v}\n")
        }
        LogFormat::Text => format!(
            "time={} level={} msg={}\n",
            serde_json::Value::String(time),
            level,
            serde_json::Value::String(msg.to_string())
        ),
    }
}

/// UTC time as `2006-01-02T15:04:05.000000000Z`, without a date crate.
pub fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, dd) = civil_from_days(days);
    format!("{y:04}-{m:02}-{dd:02}T{:02}:{:02}:{:02}.{:09}Z", rem / 3600, rem % 3600 / 60, rem % 60, d.subsec_nanos())
}

/// Days since 1970-01-01 to (year, month, day) in the proleptic Gregorian calendar
/// (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn time_is_rfc3339_utc() {
        let t = UNIX_EPOCH + Duration::new(1_795_000_000, 5);
        assert_eq!(rfc3339(t), "2026-11-18T11:06:40.000000005Z");
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000000000Z");
        // A leap day.
        let t = UNIX_EPOCH + Duration::from_secs(951_782_400);
        assert_eq!(&rfc3339(t)[..10], "2000-02-29");
    }

    #[test]
    fn json_line_is_what_podman_parses() {
        let line = format_line(LogFormat::Json, "error", "crun \"x\" not found", UNIX_EPOCH);
        assert!(line.ends_with('\n'));
        let v: serde_json::Value = serde_json::from_str(line.trim_end()).unwrap();
        assert_eq!(v["level"], "error");
        assert_eq!(v["msg"], "crun \"x\" not found");
        assert_eq!(v["time"], "1970-01-01T00:00:00.000000000Z");
    }

    #[test]
    fn text_line_quotes_the_message() {
        let line = format_line(LogFormat::Text, "error", "a b", UNIX_EPOCH);
        assert_eq!(line, "time=\"1970-01-01T00:00:00.000000000Z\" level=error msg=\"a b\"\n");
    }
}

/// Where one long operation's time went, to the millisecond, for planarian's own log: the
/// stretches its progress phases do not cover (look-ups, locks, bookkeeping) included.
static MARKS: std::sync::Mutex<Vec<(&'static str, std::time::Instant)>> = std::sync::Mutex::new(Vec::new());

/// What a command did before its operation's timeline started (finding the container, its
/// lock): empty unless the command began one ([`start_prelude`]), so a long-lived caller (the MCP
/// server) keeps nothing.
static PRELUDE: std::sync::Mutex<Vec<(&'static str, std::time::Instant)>> = std::sync::Mutex::new(Vec::new());

/// A one-shot command starts here the timeline of its operation ([`prelude`] marks it until
/// the operation's own [`start_marks`]).
pub fn start_prelude(what: &'static str) {
    if let Ok(mut p) = PRELUDE.lock() {
        *p = vec![(what, std::time::Instant::now())];
    }
}

/// Marks that the command whose prelude was started reached `what`; nothing otherwise.
pub fn prelude(what: &'static str) {
    if let Ok(mut p) = PRELUDE.lock() {
        if !p.is_empty() {
            p.push((what, std::time::Instant::now()));
        }
    }
}

/// Starts a new timeline (what an earlier operation left unlogged, as one that failed, is
/// dropped), after the command's prelude, if it has one.
pub fn start_marks() {
    let prelude = PRELUDE.lock().map(|mut p| std::mem::take(&mut *p)).unwrap_or_default();
    if let Ok(mut m) = MARKS.lock() {
        *m = prelude;
        m.push(("start", std::time::Instant::now()));
    }
}

/// Marks that the operation under way reached `what`.
pub fn mark(what: &'static str) {
    if let Ok(mut m) = MARKS.lock() {
        m.push((what, std::time::Instant::now()));
    }
}

/// Writes the marks since the first as one line of planarian's own log (`TITLE: a 12, b 40,
/// …, total 900 ms`: each the milliseconds since the one before), and forgets them.
pub fn log_marks(title: &str) {
    let marks = match MARKS.lock() {
        Ok(mut m) => std::mem::take(&mut *m),
        Err(_) => return,
    };
    if let Some(line) = marks_line(&marks) {
        own_log("info", &format!("{title}: {line}"));
    }
}

fn marks_line(marks: &[(&str, std::time::Instant)]) -> Option<String> {
    let (first, last) = (marks.first()?.1, marks.last()?.1);
    let parts: Vec<String> =
        marks.windows(2).map(|w| format!("{} {}", w[1].0, w[1].1.duration_since(w[0].1).as_millis())).collect();
    Some(format!("{}, total {} ms", parts.join(", "), last.duration_since(first).as_millis()))
}

#[cfg(test)]
mod marks_tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn each_mark_is_the_time_since_the_one_before() {
        let t = Instant::now();
        let m = [("start", t), ("a", t + Duration::from_millis(12)), ("b", t + Duration::from_millis(40))];
        assert_eq!(marks_line(&m).unwrap(), "a 12, b 28, total 40 ms");
        assert_eq!(marks_line(&[]), None);
    }
}

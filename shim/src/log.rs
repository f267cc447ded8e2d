//! planarian's own messages: one line on stderr, and, when Podman passed `--log FILE`, a
//! runc-compatible line in that file (`--log-format json` → `{"level":…,"msg":…,"time":…}`),
//! which Podman reads back and shows to the user.

use crate::cli::{Invocation, LogFormat};
use std::io::Write;
use std::time::{SystemTime, UNIX_EPOCH};

pub fn error(inv: &Invocation, msg: &str) {
    eprintln!("planarian: {msg}");
    write_log(inv, "error", msg);
}

fn write_log(inv: &Invocation, level: &str, msg: &str) {
    let Some(path) = &inv.log else { return };
    let line = format_line(inv.log_format, level, msg, SystemTime::now());
    if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
        let _ = f.write_all(line.as_bytes());
    }
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
    format!(
        "{y:04}-{m:02}-{dd:02}T{:02}:{:02}:{:02}.{:09}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_nanos()
    )
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
        assert_eq!(
            line,
            "time=\"1970-01-01T00:00:00.000000000Z\" level=error msg=\"a b\"\n"
        );
    }
}

//! `/proc`, read in one place: the mount table of a process and the fields of its `stat`.

use std::path::{Path, PathBuf};

/// One line of `/proc/PID/mountinfo` (proc(5)): mount point (unescaped), per-mount options,
/// filesystem type, source (unescaped) and the filesystem's own (superblock) options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    pub point: String,
    pub options: String,
    pub fstype: String,
    pub source: String,
    pub super_options: String,
}

impl Mount {
    /// Parses one line; `None` for a line that is not one.
    pub fn parse(line: &str) -> Option<Mount> {
        // Optional fields stand between the mount options and the " - " separator.
        let (pre, post) = line.split_once(" - ")?;
        let f: Vec<&str> = pre.split(' ').collect();
        let s: Vec<&str> = post.split(' ').collect();
        Some(Mount {
            point: unescape(f.get(4)?),
            options: f.get(5)?.to_string(),
            fstype: s.first()?.to_string(),
            source: unescape(s.get(1)?),
            super_options: s.get(2)?.to_string(),
        })
    }

    /// A superblock option's value (`upperdir=…` of an overlay).
    pub fn super_option(&self, key: &str) -> Option<&str> {
        self.super_options.split(',').find_map(|o| o.strip_prefix(key)?.strip_prefix('='))
    }
}

/// Every mount of a mountinfo text, in mount order (the last one at a point is on top).
pub fn parse_mountinfo(text: &str) -> Vec<Mount> {
    text.lines().filter_map(Mount::parse).collect()
}

/// The mount table of process `pid`'s mount namespace, as that process sees it.
pub fn mounts(pid: i32) -> std::io::Result<Vec<Mount>> {
    std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).map(|t| parse_mountinfo(&t))
}

/// This process's mount table.
pub fn own_mounts() -> std::io::Result<Vec<Mount>> {
    std::fs::read_to_string("/proc/self/mountinfo").map(|t| parse_mountinfo(&t))
}

/// The upper (writable) directory of the overlay mounted as `/` in `mounts`, if it is one.
pub fn overlay_root_upperdir(mounts: &[Mount]) -> Option<PathBuf> {
    mounts
        .iter()
        .rev()
        .find(|m| m.point == "/" && m.fstype == "overlay")
        .and_then(|m| m.super_option("upperdir"))
        .map(PathBuf::from)
}

/// Whether any overlay in `mounts` uses `upper` as its upper directory.
pub fn upperdir_in_use(mounts: &[Mount], upper: &Path) -> bool {
    mounts.iter().any(|m| m.fstype == "overlay" && m.super_option("upperdir").is_some_and(|u| Path::new(u) == upper))
}

/// mountinfo escapes space, tab, newline and backslash as three octal digits.
pub fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Field `n` (1-based, as numbered in proc(5)) of a `stat` text, for a field after the command
/// name (which may hold spaces and parentheses: the fields follow its last `)`).
pub fn stat_text_field(text: &str, n: usize) -> Option<&str> {
    let after = text.get(text.rfind(')')? + 2..)?;
    after.split(' ').nth(n.checked_sub(3)?)
}

/// Field `n` of `/proc/PID/stat` as a number (see [`stat_text_field`]).
pub fn stat_field(pid: i32, n: usize) -> Option<u64> {
    stat_file_field(Path::new(&format!("/proc/{pid}/stat")), n)?.parse().ok()
}

/// Field `n` of a `stat` file (a process's or a thread's: `/proc/PID/task/TID/stat`).
pub fn stat_file_field(path: &Path, n: usize) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    stat_text_field(&text, n).map(str::to_owned)
}

/// The state letter (field 3) and start time in clock ticks since boot (field 22) of a `stat` file.
pub fn state_and_start(path: &Path) -> Option<(char, u64)> {
    let text = std::fs::read_to_string(path).ok()?;
    let state = stat_text_field(&text, 3)?.chars().next()?;
    Some((state, stat_text_field(&text, 22)?.parse().ok()?))
}

/// Field 22 of /proc/PID/stat: the start time in clock ticks since boot.
pub fn start_time(pid: i32) -> Option<u64> {
    stat_field(pid, 22)
}

/// Field 4 of /proc/PID/stat: the parent's PID.
pub fn parent_pid(pid: i32) -> Option<i32> {
    stat_field(pid, 4).and_then(|p| i32::try_from(p).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_lines() {
        let m = Mount::parse("96 85 0:31 / /proc/acpi ro,relatime - tmpfs tmpfs ro,size=0k,inode64").unwrap();
        assert_eq!((m.point.as_str(), m.options.as_str(), m.fstype.as_str()), ("/proc/acpi", "ro,relatime", "tmpfs"));
        assert_eq!(m.super_options, "ro,size=0k,inode64");
        // Optional fields before the separator, escaped spaces in the point and the source.
        let m = Mount::parse("101 85 0:33 / /a\\040b rw shared:5 master:1 - fuse.zfs pool/my\\040ds rw").unwrap();
        assert_eq!((m.point.as_str(), m.fstype.as_str(), m.source.as_str()), ("/a b", "fuse.zfs", "pool/my ds"));
        assert!(Mount::parse("garbage").is_none());
    }

    #[test]
    fn overlay_upper_directories() {
        let text = "1 0 0:1 / / rw - overlay overlay rw,lowerdir=/l/a:/l/b,upperdir=/u/diff,workdir=/u/work\n\
                    2 1 0:2 / /proc rw - proc proc rw\n";
        let ms = parse_mountinfo(text);
        assert_eq!(overlay_root_upperdir(&ms), Some(PathBuf::from("/u/diff")));
        assert!(upperdir_in_use(&ms, Path::new("/u/diff")));
        assert!(!upperdir_in_use(&ms, Path::new("/u/dif")));
        assert_eq!(ms[0].super_option("lowerdir"), Some("/l/a:/l/b"));
    }

    #[test]
    fn unescapes_octal_and_keeps_utf8() {
        assert_eq!(unescape("/a\\040b\\134c"), "/a b\\c");
        assert_eq!(unescape("/ü\\011x"), "/ü\tx");
        assert_eq!(unescape("/end\\04"), "/end\\04");
    }

    #[test]
    fn stat_fields_by_their_proc5_numbers() {
        let me = std::process::id() as i32;
        assert_eq!(parent_pid(me), Some(std::os::unix::process::parent_id() as i32));
        assert!(start_time(me).is_some());
        assert_eq!(stat_field(me, 2), None);
        assert_eq!(stat_text_field("1 (a) b) S 0 1", 3), Some("S"));
        let (state, start) = state_and_start(Path::new(&format!("/proc/{me}/stat"))).unwrap();
        assert!(state.is_ascii_uppercase() && Some(start) == start_time(me));
    }
}

//! `/proc`, read in one place: a process's or a thread's files ([`Proc`]), its mount table, its
//! memory map, the fields of its `stat` and `status`, and its page map ([`pagemap`]).

pub mod pagemap;

use crate::{Context, IoError};
use std::path::{Path, PathBuf};

/// The size of a page on the machines planarian runs on (x86-64).
pub const PAGE_SIZE: u64 = 4096;

/// A process, or one thread of it, as `/proc` shows it. Every read names the file in its error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Proc {
    pid: i32,
    tid: Option<i32>,
    /// This process, read through `/proc/self` (right whichever PID namespace `/proc` is of).
    own: bool,
}

impl Proc {
    /// Process `pid` (its main thread for per-thread files).
    pub fn of(pid: i32) -> Proc {
        Proc { pid, tid: None, own: false }
    }

    /// This process.
    pub fn own() -> Proc {
        Proc { pid: std::process::id() as i32, tid: None, own: true }
    }

    /// Thread `tid` of this process (`/proc/PID/task/TID`).
    pub fn task(self, tid: i32) -> Proc {
        Proc { pid: self.pid, tid: Some(tid), own: self.own }
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// This process's directory in `/proc`.
    pub fn dir(&self) -> PathBuf {
        let p = if self.own { "self".to_string() } else { self.pid.to_string() };
        match self.tid {
            None => PathBuf::from(format!("/proc/{p}")),
            Some(t) => PathBuf::from(format!("/proc/{p}/task/{t}")),
        }
    }

    /// One of its files: `/proc/PID/NAME` (`NAME` may be a path: `ns/net`, `fdinfo/3`).
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir().join(name)
    }

    /// A file's text.
    pub fn read(&self, name: &str) -> Result<String, IoError> {
        let p = self.path(name);
        std::fs::read_to_string(&p).at("read", p)
    }

    /// A file's bytes (`cmdline`, `environ`: NUL-separated).
    pub fn read_bytes(&self, name: &str) -> Result<Vec<u8>, IoError> {
        let p = self.path(name);
        std::fs::read(&p).at("read", p)
    }

    /// Opens a file to read (`mem`, `pagemap`, `ns/*`).
    pub fn open(&self, name: &str) -> Result<std::fs::File, IoError> {
        let p = self.path(name);
        std::fs::File::open(&p).at("open", p)
    }

    /// Opens `mem` to read and write: writes reach even read-only private mappings.
    pub fn open_mem_rw(&self) -> Result<std::fs::File, IoError> {
        let p = self.path("mem");
        std::fs::OpenOptions::new().read(true).write(true).open(&p).at("open", p)
    }

    /// Writes a control file (`clear_refs`, `oom_score_adj`).
    pub fn write(&self, name: &str, value: &str) -> Result<(), IoError> {
        let p = self.path(name);
        std::fs::write(&p, value).at("write", p)
    }

    /// Where a symbolic link of it points (`fd/N`, `cwd`, `ns/mnt`).
    pub fn link(&self, name: &str) -> Result<PathBuf, IoError> {
        let p = self.path(name);
        std::fs::read_link(&p).at("read the link", p)
    }

    /// The process's view of the file system: `/proc/PID/root`.
    pub fn root(&self) -> PathBuf {
        self.path("root")
    }

    /// The numbered entries of one of its directories (`task`, `fd`), in order.
    pub fn numbered(&self, name: &str) -> Result<Vec<i32>, IoError> {
        numbered_entries(&self.path(name))
    }

    /// Its threads' IDs, in order (`/proc/PID/task`).
    pub fn threads(&self) -> Result<Vec<i32>, IoError> {
        Proc { tid: None, ..*self }.numbered("task")
    }

    /// Its open descriptors, in order (`/proc/PID/fd`).
    pub fn fds(&self) -> Result<Vec<i32>, IoError> {
        self.numbered("fd")
    }

    /// Where descriptor `fd` points (`pipe:[123]`, a path), empty when it cannot be read.
    pub fn fd_target(&self, fd: i32) -> String {
        self.link(&format!("fd/{fd}")).map(|p| p.display().to_string()).unwrap_or_default()
    }

    /// Descriptor `fd`'s `fdinfo` text.
    pub fn fdinfo(&self, fd: i32) -> Result<String, IoError> {
        self.read(&format!("fdinfo/{fd}"))
    }

    /// Its memory map (`/proc/PID/maps`).
    pub fn maps(&self) -> Result<Vec<MapLine>, IoError> {
        self.read("maps").map(|t| parse_maps(&t))
    }

    /// Its `status` file.
    pub fn status(&self) -> Result<Status, IoError> {
        self.read("status").map(Status)
    }

    /// Its `stat` file.
    pub fn stat(&self) -> Result<Stat, IoError> {
        self.read("stat").map(Stat)
    }

    /// Its command line's arguments (`/proc/PID/cmdline`).
    pub fn cmdline(&self) -> Result<Vec<String>, IoError> {
        let b = self.read_bytes("cmdline")?;
        Ok(b.split(|c| *c == 0).filter(|a| !a.is_empty()).map(|a| String::from_utf8_lossy(a).into_owned()).collect())
    }

    /// Its mount table.
    pub fn mounts(&self) -> Result<Vec<Mount>, IoError> {
        self.read("mountinfo").map(|t| parse_mountinfo(&t))
    }

    /// The state letter (field 3 of `stat`) and the start time in clock ticks since boot (field
    /// 22).
    pub fn state_and_start(&self) -> Option<(char, u64)> {
        let stat = self.stat().ok()?;
        Some((stat.state()?, stat.field(22)?.parse().ok()?))
    }

    /// Clears its soft-dirty bits (`clear_refs` 4, as CRIU's `--track-mem` does).
    pub fn clear_soft_dirty(&self) -> Result<(), IoError> {
        self.write("clear_refs", "4")
    }

    /// The Unix sockets of the network namespace it is in (`/proc/PID/net/unix`).
    pub fn unix_sockets(&self) -> Result<Vec<UnixSocket>, IoError> {
        self.read("net/unix").map(|t| parse_unix(&t))
    }

    /// The inodes of the sockets among its descriptors, each with its descriptor.
    pub fn socket_fds(&self) -> Result<Vec<(u64, i32)>, IoError> {
        let target = |fd: i32| self.fd_target(fd).strip_prefix("socket:[")?.strip_suffix(']')?.parse().ok();
        Ok(self.fds()?.into_iter().filter_map(|fd| Some((target(fd)?, fd))).collect())
    }
}

/// A Unix socket, as a line of `/proc/net/unix` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnixSocket {
    pub inode: u64,
    /// `SOCK_STREAM`, `SOCK_DGRAM`, `SOCK_SEQPACKET`.
    pub kind: u32,
    /// Listening (`__SO_ACCEPTCON`).
    pub listening: bool,
    /// Connected (`SS_CONNECTED`): an accepted connection too, which shows its listener's path.
    pub connected: bool,
    /// The path it is bound to (a connection accepted by a bound socket shows that one's).
    pub path: Option<String>,
}

/// `/proc/net/unix`'s lines: `Num RefCount Protocol Flags Type St Inode [Path]`.
pub fn parse_unix(text: &str) -> Vec<UnixSocket> {
    let hex = |v: &str| u32::from_str_radix(v, 16).unwrap_or(0);
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (flags, kind, st, inode) = (f.get(3)?, f.get(4)?, f.get(5)?, f.get(6)?.parse().ok()?);
            Some(UnixSocket {
                inode,
                kind: hex(kind),
                listening: hex(flags) & 0x10000 != 0,
                connected: hex(st) == 3,
                path: f.get(7).map(|p| p.to_string()),
            })
        })
        .collect()
}

/// The processes there are now (the numbered entries of `/proc`), in order.
pub fn processes() -> Result<Vec<i32>, IoError> {
    numbered_entries(Path::new("/proc"))
}

/// The entries of directory `dir` whose names are numbers, in order.
fn numbered_entries(dir: &Path) -> Result<Vec<i32>, IoError> {
    let mut out: Vec<i32> = std::fs::read_dir(dir)
        .at("read", dir)?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    out.sort_unstable();
    Ok(out)
}

/// A file of `/proc` itself, not of a process (`uptime`, `sys/kernel/random/boot_id`,
/// `sysvipc/shm`: the last as the reading thread's IPC namespace sees it).
pub fn system(name: &str) -> Result<String, IoError> {
    let p = Path::new("/proc").join(name);
    std::fs::read_to_string(&p).at("read", p)
}

/// A `status` file's text (proc(5)): `Key:\tvalue` lines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status(pub String);

impl Status {
    /// A key's value; for the `NS*` keys (one value per PID namespace), the innermost one.
    pub fn field(&self, key: &str) -> Option<String> {
        status_field(&self.0, key)
    }

    /// A key's value as a number (see [`Status::field`]).
    pub fn number(&self, key: &str) -> Option<u64> {
        self.field(key)?.parse().ok()
    }

    /// A key's whole value, as written (`Uid:`'s four IDs).
    pub fn raw(&self, key: &str) -> Option<&str> {
        self.0.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix(':')).map(str::trim)
    }

    /// The process's PIDs from the reader's PID namespace inward (`NSpid`): the last its own
    /// namespace's.
    pub fn ns_pids(&self) -> Vec<u32> {
        self.raw("NSpid").unwrap_or("").split_whitespace().filter_map(|v| v.parse().ok()).collect()
    }

    /// The state letter (`State:`), `?` when absent.
    pub fn state(&self) -> char {
        self.raw("State").and_then(|s| s.chars().next()).unwrap_or('?')
    }

    pub fn text(&self) -> &str {
        &self.0
    }
}

/// `Key:\tvalue` of a status text; for the `NS*` keys, the innermost namespace's value.
pub fn status_field(status: &str, key: &str) -> Option<String> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .map(|v| v.split_whitespace().last().unwrap_or("").to_string())
}

/// A `stat` file's text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stat(pub String);

impl Stat {
    /// Field `n`, numbered as in proc(5) (see [`stat_text_field`]).
    pub fn field(&self, n: usize) -> Option<&str> {
        stat_text_field(&self.0, n)
    }

    /// The state letter (field 3).
    pub fn state(&self) -> Option<char> {
        self.field(3)?.chars().next()
    }
}

pub const PROT_READ: u32 = 1;
pub const PROT_WRITE: u32 = 2;
pub const PROT_EXEC: u32 = 4;

/// One line of `/proc/PID/maps`: the range, protection, shared or private, offset, inode and
/// name (a path, `[heap]`, `[stack]`, `[anon:…]`, or empty).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapLine {
    pub start: u64,
    pub end: u64,
    pub prot: u32,
    pub shared: bool,
    pub offset: u64,
    /// The file's device (major, minor).
    pub dev: (u64, u64),
    pub inode: u64,
    pub path: String,
}

impl MapLine {
    /// Its name in `/proc/PID/map_files` (the range, in unpadded hex).
    pub fn range_name(&self) -> String {
        format!("{:x}-{:x}", self.start, self.end)
    }

    /// A kernel-provided mapping: the vDSO, its data, the legacy vsyscall page.
    pub fn is_special(&self) -> bool {
        matches!(self.path.as_str(), "[vdso]" | "[vvar]" | "[vsyscall]" | "[vvar_vclock]")
    }

    /// Private anonymous memory (the heap, the stack, unnamed or named anonymous mappings).
    pub fn is_anon_private(&self) -> bool {
        self.inode == 0
            && !self.shared
            && !self.is_special()
            && (self.path.is_empty()
                || self.path == "[heap]"
                || self.path == "[stack]"
                || self.path.starts_with("[anon:"))
    }
}

/// The lines of a `maps` text that parse.
pub fn parse_maps(text: &str) -> Vec<MapLine> {
    text.lines()
        .filter_map(|l| {
            let mut f = l.splitn(6, ' ');
            let (range, perms, offset, dev, inode) = (f.next()?, f.next()?, f.next()?, f.next()?, f.next()?);
            let path = f.next().unwrap_or("").trim_start().to_string();
            let (s, e) = range.split_once('-')?;
            let (major, minor) = dev.split_once(':')?;
            let p = perms.as_bytes();
            let prot = (if p.first() == Some(&b'r') { PROT_READ } else { 0 })
                | (if p.get(1) == Some(&b'w') { PROT_WRITE } else { 0 })
                | (if p.get(2) == Some(&b'x') { PROT_EXEC } else { 0 });
            Some(MapLine {
                start: u64::from_str_radix(s, 16).ok()?,
                end: u64::from_str_radix(e, 16).ok()?,
                prot,
                shared: p.get(3) == Some(&b's'),
                offset: u64::from_str_radix(offset, 16).ok()?,
                dev: (u64::from_str_radix(major, 16).ok()?, u64::from_str_radix(minor, 16).ok()?),
                inode: inode.parse().ok()?,
                path,
            })
        })
        .collect()
}

/// One line of `/proc/PID/mountinfo` (proc(5)): mount point (unescaped), per-mount options,
/// filesystem type, source (unescaped) and the filesystem's own (superblock) options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// The directory of its filesystem mounted here (`/`, or a bind's subdirectory).
    pub root: String,
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
            root: unescape(f.get(3)?),
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
    Proc::of(pid).stat().ok()?.field(n)?.parse().ok()
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

    /// Lines of a conmon's exec session, read on Podman 5.4: the attach socket listening, a
    /// connection it accepted (the same path), an unbound socket.
    #[test]
    fn unix_socket_lines() {
        let text = "Num       RefCount Protocol Flags    Type St Inode Path\n\
                    00000000fab81c12: 00000002 00000000 00010000 0005 01 12423 /proc/self/fd/13/attach\n\
                    00000000faba466d: 00000003 00000000 00000000 0005 03 12453 /proc/self/fd/13/attach\n\
                    00000000c0c8319b: 00000002 00000000 00000000 0001 03 12404\n";
        let s = parse_unix(text);
        assert_eq!(s.len(), 3);
        assert_eq!((s[0].inode, s[0].kind, s[0].listening, s[0].connected), (12423, 5, true, false));
        assert_eq!(
            (s[1].listening, s[1].connected, s[1].path.as_deref()),
            (false, true, Some("/proc/self/fd/13/attach"))
        );
        assert_eq!((s[2].kind, s[2].path.as_deref()), (1, None));
        // This process's own: a pair's socket found by its descriptor, and in the table, connected.
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&a);
        let ino = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(format!("/proc/self/fd/{fd}")).unwrap());
        let fds = Proc::own().socket_fds().unwrap();
        assert!(fds.contains(&(ino, fd)), "{fds:?}");
        assert!(Proc::own().unix_sockets().unwrap().iter().any(|u| u.inode == ino && u.connected));
    }

    #[test]
    fn unescapes_octal_and_keeps_utf8() {
        assert_eq!(unescape("/a\\040b\\134c"), "/a b\\c");
        assert_eq!(unescape("/ü\\011x"), "/ü\tx");
        assert_eq!(unescape("/end\\04"), "/end\\04");
    }

    #[test]
    fn maps_lines_parse_and_classify() {
        let m = parse_maps(
            "55d0c0a00000-55d0c0a21000 rw-p 00000000 00:00 0                          [heap]\n\
             7f00000000-7f00001000 r-xp 00002000 fd:01 1234                       /usr/lib/libc.so.6\n\
             7ffd0000-7ffd1000 rw-p 00000000 00:00 0 \n\
             7fff0000-7fff2000 r-xp 00000000 00:00 0                          [vdso]\n",
        );
        assert_eq!(m.len(), 4);
        assert!(m[0].is_anon_private() && !m[1].is_anon_private() && m[2].is_anon_private() && !m[3].is_anon_private());
        assert!(m[3].is_special() && !m[0].is_special());
        assert_eq!((m[1].prot, m[1].offset, m[1].path.as_str()), (PROT_READ | PROT_EXEC, 0x2000, "/usr/lib/libc.so.6"));
        assert_eq!((m[1].dev, m[1].inode, m[1].shared), ((0xfd, 1), 1234, false));
        assert_eq!(m[2].range_name(), "7ffd0000-7ffd1000");
        assert_eq!(status_field("NSpid:\t4242\t7\nPPid:\t1\n", "NSpid").as_deref(), Some("7"));
        let st = Status("State:\tS (sleeping)\nNSpid:\t4242\t7\nUid:\t0\t0\t0\t0\n".into());
        assert_eq!((st.state(), st.number("NSpid"), st.raw("Uid")), ('S', Some(7), Some("0\t0\t0\t0")));
        assert_eq!(st.ns_pids(), vec![4242, 7]);
    }

    #[test]
    fn a_process_read_through_its_handle() {
        let me = Proc::of(std::process::id() as i32);
        assert!(me.maps().unwrap().iter().any(|m| m.path == "[stack]"));
        assert_eq!(me.status().unwrap().number("Pid"), Some(u64::from(std::process::id())));
        let tids = me.threads().unwrap();
        assert!(tids.contains(&me.pid()));
        assert_eq!(me.task(me.pid()).status().unwrap().number("Pid"), Some(u64::from(std::process::id())));
        assert!(!me.fds().unwrap().is_empty());
        assert!(me.cmdline().unwrap()[0].contains("sys"));
        let own = Proc::own();
        assert_eq!((own.dir(), own.pid()), (PathBuf::from("/proc/self"), me.pid()));
        assert!(own.threads().unwrap().contains(&me.pid()));
        assert_eq!(own.task(me.pid()).dir(), PathBuf::from(format!("/proc/self/task/{}", me.pid())));
        let e = Proc::of(-1).read("maps").unwrap_err();
        assert!(e.to_string().starts_with("cannot read /proc/-1/maps: "), "{e}");
    }

    #[test]
    fn stat_fields_by_their_proc5_numbers() {
        let me = std::process::id() as i32;
        assert_eq!(parent_pid(me), Some(std::os::unix::process::parent_id() as i32));
        assert!(start_time(me).is_some());
        assert_eq!(stat_field(me, 2), None);
        assert_eq!(stat_text_field("1 (a) b) S 0 1", 3), Some("S"));
        let (state, start) = Proc::of(me).state_and_start().unwrap();
        assert!(state.is_ascii_uppercase() && Some(start) == start_time(me));
    }
}

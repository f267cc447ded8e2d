//! Each process's descriptors against the statepoint's, and how to put their state back from
//! outside the process, through a duplicate of the descriptor (`pidfd_getfd`: the same open
//! file description):
//! * regular files: the same file, access mode and flags; the offset is set back;
//! * pipes: the same pipe, nothing buffered now or at the statepoint;
//! * eventfd: its count is set back (read to zero, the statepoint's count written);
//! * timerfd: the same clock, no expiration left unread at the statepoint; armed again with the
//!   time it had left (which also clears the expirations counted since), at an absolute time on
//!   its clock and with its flags when it was armed so (`TFD_TIMER_ABSTIME`, `CANCEL_ON_SET`);
//! * signalfd: its signal mask set back;
//! * epoll: the same interest list (descriptor, events, data) as at the statepoint;
//! * sockets (Unix, TCP, UDP): the same socket in the same state (listening, connected,
//!   unconnected), nothing queued now or at the statepoint. A listening socket's pending
//!   connections are new clients: they stay.
//!
//! A restore makes every pipe and socket anew (new inodes): after one (the container's stdio
//! pipes to conmon then differ), a pipe or socket is the statepoint's when they correspond one to
//! one, descriptor for descriptor, across the whole tree; without one they must be the same
//! objects. Any other kind refuses.

use super::{io, ptrace, refuse, Error, Result};
use criu_hooks::images;
use nix::libc;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use sys::proc::Proc;

fn fdinfo_field(text: &str, key: &str) -> Option<String> {
    text.lines().find_map(|l| l.strip_prefix(key)?.strip_prefix(':')).map(|v| v.trim().to_string())
}

/// What is put back on one descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Fix {
    Seek {
        fd: u32,
        pos: u64,
    },
    EventCount {
        fd: u32,
        count: u64,
    },
    /// `flags`: the statepoint's `timerfd_settime` flags (`TFD_TIMER_ABSTIME`,
    /// `TFD_TIMER_CANCEL_ON_SET`); `value`: the time it had left.
    Timer {
        fd: u32,
        clock: u32,
        flags: u32,
        value: (u64, u64),
        interval: (u64, u64),
    },
    SignalMask {
        fd: u32,
        mask: u64,
    },
}

/// The pipes and sockets of the tree, then and now (see the module's comment).
pub(super) struct Objects<'a> {
    /// Pipes (by inode) that held data at the statepoint.
    pipe_data: BTreeSet<u64>,
    /// Sockets (by file id) that held data at the statepoint.
    socket_data: BTreeSet<u32>,
    /// The stdio pipes: (then, now), as the caller knows them.
    stdio: &'a [(String, String)],
    /// Whether the container was restored since the statepoint.
    restored: bool,
    /// Then → now, as found so far; and what is matched now.
    seen: BTreeMap<String, String>,
    taken: BTreeSet<String>,
    /// The container's sockets now, by inode: (family, type, state, queued bytes).
    sockets: Option<HashMap<u64, LiveSocket>>,
}

impl<'a> Objects<'a> {
    pub(super) fn new(images: &Path, stdio: &'a [(String, String)]) -> Result<Objects<'a>> {
        Ok(Objects {
            pipe_data: images::pipes_with_data(images)?,
            socket_data: images::sockets_with_data(images)?,
            stdio,
            restored: stdio.iter().any(|(t, n)| t != n),
            seen: BTreeMap::new(),
            taken: BTreeSet::new(),
            sockets: None,
        })
    }

    /// Whether descriptor link `now` can be what link `then` was at the statepoint.
    fn matches(&mut self, then: &str, now: &str) -> bool {
        if let Some(known) = self.seen.get(then) {
            return known == now;
        }
        let stdio_other = self.stdio.iter().any(|(t, n)| (t == then) != (n == now));
        let kind = then.split('[').next().unwrap_or("");
        let same = then == now || (self.restored && now.starts_with(kind));
        if !same || stdio_other || !self.taken.insert(now.to_string()) {
            return false;
        }
        self.seen.insert(then.to_string(), now.to_string());
        true
    }
}

/// A socket as `/proc/PID/net/*` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LiveSocket {
    family: u32,
    kind: u32,
    /// `sk_state`, as CRIU records it.
    state: u32,
    /// An Internet socket's local port.
    port: Option<u32>,
}

const TCP_ESTABLISHED: u32 = 1;
const TCP_CLOSE: u32 = 7;
const TCP_LISTEN: u32 = 10;

/// The sockets of the network namespace process `host` is in (its `/proc/PID/net`).
fn live_sockets(host: i32) -> HashMap<u64, LiveSocket> {
    let mut out = HashMap::new();
    let read = |f: &str| Proc::of(host).read(&format!("net/{f}")).unwrap_or_default();
    for u in Proc::of(host).unix_sockets().unwrap_or_default() {
        // CRIU's sk_state: listening, connected, otherwise closed.
        let state = match (u.listening, u.connected) {
            (true, _) => TCP_LISTEN,
            (false, true) => TCP_ESTABLISHED,
            _ => TCP_CLOSE,
        };
        out.insert(u.inode, LiveSocket { family: libc::AF_UNIX as u32, kind: u.kind, state, port: None });
    }
    // sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode
    for (file, family, kind) in [
        ("tcp", libc::AF_INET, libc::SOCK_STREAM),
        ("tcp6", libc::AF_INET6, libc::SOCK_STREAM),
        ("udp", libc::AF_INET, libc::SOCK_DGRAM),
        ("udp6", libc::AF_INET6, libc::SOCK_DGRAM),
    ] {
        for l in read(file).lines().skip(1) {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (Some(local), Some(st), Some(ino)) = (f.get(1), f.get(3), f.get(9)) else { continue };
            let port = local.rsplit_once(':').and_then(|(_, p)| u32::from_str_radix(p, 16).ok());
            if let (Ok(state), Ok(ino)) = (u32::from_str_radix(st, 16), ino.parse()) {
                out.insert(ino, LiveSocket { family: family as u32, kind: kind as u32, state, port });
            }
        }
    }
    out
}

/// Bytes waiting in a socket or pipe: to be read (`FIONREAD`) and, for a socket, sent but not
/// yet taken (`TIOCOUTQ`). A listening socket answers neither: nothing.
fn queued(fd: &OwnedFd, socket: bool) -> u64 {
    let mut total = 0u64;
    let requests: &[libc::c_ulong] = if socket { &[libc::FIONREAD, libc::TIOCOUTQ] } else { &[libc::FIONREAD] };
    for &req in requests {
        let mut n: libc::c_int = 0;
        // SAFETY: both requests write one int.
        if unsafe { libc::ioctl(fd.as_raw_fd(), req, &mut n) } == 0 && n > 0 {
            total += n as u64;
        }
    }
    total
}

/// Whether a datagram of no bytes waits in datagram socket `fd`: `FIONREAD` answers 0 for it as
/// for none, a peek tells them apart (it takes nothing; like a restore, it clears an error the
/// socket had pending).
fn empty_datagram_waiting(fd: &OwnedFd) -> bool {
    let mut b = [0u8; 1];
    // SAFETY: the kernel writes at most one byte into `b`.
    let r = unsafe { libc::recv(fd.as_raw_fd(), b.as_mut_ptr().cast(), 1, libc::MSG_PEEK | libc::MSG_DONTWAIT) };
    r == 0
}

fn dup(host: i32, vpid: u32, fd: u32) -> Result<OwnedFd> {
    ptrace::dup_fd(host, fd).map_err(io(format!("duplicate descriptor {fd} of process {vpid}")))
}

/// Compares process `vpid`'s descriptors (host PID `host`) with the statepoint's (`files_id` in
/// `images`); what to put back.
pub(super) fn compare(
    images: &Path,
    files_id: u32,
    host: i32,
    vpid: u32,
    files: &HashMap<u32, images::File>,
    objects: &mut Objects,
) -> Result<Vec<Fix>> {
    let then = images::fdinfo(images, files_id)?;
    let me = Proc::of(host);
    let now: Vec<u32> = me.fds()?.into_iter().map(|fd| fd as u32).collect();
    let mut was: Vec<u32> = then.iter().map(|f| f.fd).collect();
    was.sort_unstable();
    if now != was {
        return refuse(format!("process {vpid}: descriptors {now:?} now, {was:?} at the statepoint"));
    }
    let mut fixes = Vec::new();
    for f in &then {
        let link = me.fd_target(f.fd as i32);
        let info = me.fdinfo(f.fd as i32).unwrap_or_default();
        let flags = fdinfo_field(&info, "flags").and_then(|v| u32::from_str_radix(&v, 8).ok()).unwrap_or(0);
        let cloexec_now = flags & libc::O_CLOEXEC as u32 != 0;
        if cloexec_now != (f.flags & libc::FD_CLOEXEC as u32 != 0) {
            return refuse(format!("process {vpid}: close-on-exec of descriptor {} changed", f.fd));
        }
        let d = Desc { vpid, fd: f.fd, link: &link, flags, info: &info, host };
        let Some(file) = files.get(&f.id) else {
            return refuse(format!("process {vpid}: descriptor {} is not in the statepoint's files", f.fd));
        };
        fixes.extend(d.compare(file, images, objects)?);
    }
    Ok(fixes)
}

/// One descriptor being compared.
struct Desc<'a> {
    vpid: u32,
    fd: u32,
    link: &'a str,
    flags: u32,
    /// Its `fdinfo` text.
    info: &'a str,
    /// The process's host PID.
    host: i32,
}

impl Desc<'_> {
    /// This descriptor against the statepoint's `file`: what to put back, if anything.
    fn compare(&self, file: &images::File, images: &Path, objects: &mut Objects) -> Result<Option<Fix>> {
        let (vpid, fd, link, info) = (self.vpid, self.fd, self.link, self.info);
        match file {
            images::File::Regular { flags: then_flags, pos, name } => {
                if !super::shape::same_file(link, name) {
                    return refuse(format!("process {vpid}: descriptor {fd} is {link} now, {name} at the statepoint"));
                }
                self.same_flags(*then_flags, name)?;
                let now_pos = fdinfo_field(info, "pos").and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
                Ok((now_pos != *pos).then_some(Fix::Seek { fd, pos: *pos }))
            }
            images::File::Pipe { inode, flags: then_flags } => self.pipe(*inode, *then_flags, objects).map(|()| None),
            images::File::Socket { id, ino, family, kind, state, flags: then_flags, port } => {
                self.same_socket_object(*ino, *then_flags, objects)?;
                if objects.socket_data.contains(id) || images::tcp_queued(images, *ino)? {
                    return refuse(format!("process {vpid}: socket descriptor {fd} held data at the statepoint"));
                }
                let then = LiveSocket { family: *family, kind: *kind, state: *state, port: *port };
                self.socket(then, objects).map(|()| None)
            }
            images::File::EventFd { flags: then_flags, counter } => self.eventfd(*then_flags, *counter),
            images::File::TimerFd { flags: then_flags, clock, ticks, settime_flags, value, interval } => {
                self.anon("[timerfd]")?;
                self.same_flags(*then_flags, "timerfd")?;
                if fdinfo_field(info, "clockid").and_then(|v| v.parse::<u32>().ok()) != Some(*clock) {
                    return refuse(format!("process {vpid}: timerfd {fd} has another clock now"));
                }
                if *ticks != 0 {
                    return refuse(format!("process {vpid}: timerfd {fd} had {ticks} expirations unread at the statepoint"));
                }
                let (clock, flags, value, interval) = (*clock, *settime_flags, *value, *interval);
                Ok(Some(Fix::Timer { fd, clock, flags, value, interval }))
            }
            images::File::SignalFd { flags: then_flags, mask } => {
                self.anon("[signalfd]")?;
                self.same_flags(*then_flags, "signalfd")?;
                let now = fdinfo_field(info, "sigmask").and_then(|v| u64::from_str_radix(&v, 16).ok());
                Ok((now != Some(*mask)).then_some(Fix::SignalMask { fd, mask: *mask }))
            }
            images::File::EventPoll { flags: then_flags, targets } => {
                self.anon("[eventpoll]")?;
                self.same_flags(*then_flags, "epoll")?;
                let mut now = epoll_targets(info);
                let mut was = targets.clone();
                now.sort_unstable();
                was.sort_unstable();
                if now != was {
                    return refuse(format!(
                        "process {vpid}: epoll {fd}: interest list {now:?} now, {was:?} at the statepoint"
                    ));
                }
                Ok(None)
            }
            images::File::Other(kind) => refuse(format!(
                "process {vpid}: descriptor {fd} ({link}) is of a kind a rollback in place does not restore (CRIU file type {kind})"
            )),
        }
    }

    /// A pipe end: the same pipe (by the statepoint's and the live objects' pairing), empty then
    /// and now.
    fn pipe(&self, inode: u32, then_flags: u32, objects: &mut Objects) -> Result<()> {
        let (vpid, fd, link) = (self.vpid, self.fd, self.link);
        let then = format!("pipe:[{inode}]");
        // (a pipe's two ends have one name: the access mode tells them apart)
        self.same_flags(then_flags, "pipe")?;
        if !objects.matches(&then, link) {
            return refuse(format!("process {vpid}: descriptor {fd} is {link} now, {then} at the statepoint"));
        }
        if objects.pipe_data.contains(&u64::from(inode)) {
            return refuse(format!("process {vpid}: pipe descriptor {fd} held data at the statepoint"));
        }
        if queued(&dup(self.host, vpid, fd)?, false) != 0 {
            return refuse(format!("process {vpid}: pipe descriptor {fd} holds data now"));
        }
        Ok(())
    }

    /// A socket is the statepoint's socket `ino` (by the objects' pairing) with its open flags.
    fn same_socket_object(&self, ino: u32, then_flags: u32, objects: &mut Objects) -> Result<()> {
        let then = format!("socket:[{ino}]");
        if !objects.matches(&then, self.link) {
            return refuse(format!(
                "process {}: descriptor {} is {} now, {then} at the statepoint",
                self.vpid, self.fd, self.link
            ));
        }
        self.same_flags(then_flags, "socket")
    }

    /// A socket as the network namespace shows it (family, type, state, port) is `then`, and
    /// holds no data now.
    fn socket(&self, then: LiveSocket, objects: &mut Objects) -> Result<()> {
        let (vpid, fd) = (self.vpid, self.fd);
        let live_ino: u64 = self.link.trim_start_matches("socket:[").trim_end_matches(']').parse().unwrap_or(0);
        let sockets = objects.sockets.get_or_insert_with(|| live_sockets(self.host));
        match sockets.get(&live_ino) {
            Some(s) if *s == then => {}
            other => {
                return refuse(format!(
                    "process {vpid}: socket descriptor {fd} is {other:?} now, {then:?} at the statepoint"
                ))
            }
        }
        let live = dup(self.host, vpid, fd)?;
        if queued(&live, true) != 0 || (then.kind == libc::SOCK_DGRAM as u32 && empty_datagram_waiting(&live)) {
            return refuse(format!("process {vpid}: socket descriptor {fd} holds data now"));
        }
        Ok(())
    }

    /// An eventfd: its count put back, unless it is a semaphore's too large to read down.
    fn eventfd(&self, then_flags: u32, counter: u64) -> Result<Option<Fix>> {
        let (vpid, fd) = (self.vpid, self.fd);
        self.anon("[eventfd]")?;
        self.same_flags(then_flags, "eventfd")?;
        // (a semaphore's count is read one by one: a large one is refused; kernels
        // before 6.5 do not show the mode, see `apply`)
        let semaphore = fdinfo_field(self.info, "eventfd-semaphore").is_some_and(|v| v == "1");
        let now_count = fdinfo_field(self.info, "eventfd-count").and_then(|v| u64::from_str_radix(&v, 16).ok());
        match now_count {
            Some(n) if n == counter => Ok(None),
            Some(n) if semaphore && n > 1 << 16 => {
                refuse(format!("process {vpid}: semaphore eventfd {fd} counts {n} now"))
            }
            Some(_) => Ok(Some(Fix::EventCount { fd, count: counter })),
            None => refuse(format!("process {vpid}: eventfd {fd}: no count in its fdinfo")),
        }
    }

    fn anon(&self, what: &str) -> Result<()> {
        if self.link != format!("anon_inode:{what}") {
            return refuse(format!(
                "process {}: descriptor {} is {} now, anon_inode:{what} at the statepoint",
                self.vpid, self.fd, self.link
            ));
        }
        Ok(())
    }

    fn same_flags(&self, then: u32, what: &str) -> Result<()> {
        let mask = (libc::O_ACCMODE | libc::O_APPEND | libc::O_NONBLOCK) as u32;
        if self.flags & mask != then & mask {
            return refuse(format!("process {}: descriptor {} ({what}) changed its open flags", self.vpid, self.fd));
        }
        Ok(())
    }
}

/// `tfd: N events: HEX data: HEX ...` lines of an epoll's fdinfo.
fn epoll_targets(info: &str) -> Vec<(u32, u32, u64)> {
    info.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.first() != Some(&"tfd:") {
                return None;
            }
            let at = |k: &str| f.iter().position(|x| *x == k).and_then(|i| f.get(i + 1));
            Some((
                f.get(1)?.parse().ok()?,
                u32::from_str_radix(at("events:")?, 16).ok()?,
                u64::from_str_radix(at("data:")?, 16).ok()?,
            ))
        })
        .collect()
}

/// Puts back what `fixes` says on process `vpid`'s descriptors (host PID `host`). (Long: one
/// arm per kind of fix, each a system call or two on a duplicate of the descriptor.)
pub(super) fn apply(host: i32, vpid: u32, fixes: &[Fix]) -> Result<()> {
    for fix in fixes {
        let fail = |what: &str, fd: u32| io(format!("{what} of descriptor {fd} of process {vpid}"));
        let last = || std::io::Error::last_os_error();
        match *fix {
            Fix::Seek { fd, pos } => {
                let d = dup(host, vpid, fd)?;
                // SAFETY: lseek on a descriptor we own.
                if unsafe { libc::lseek(d.as_raw_fd(), pos as libc::off_t, libc::SEEK_SET) } < 0 {
                    return Err(fail("seek", fd)(last()));
                }
            }
            Fix::EventCount { fd, count } => {
                let d = dup(host, vpid, fd)?;
                let count_now = || {
                    let info = Proc::of(host).fdinfo(fd as i32).unwrap_or_default();
                    fdinfo_field(&info, "eventfd-count").and_then(|v| u64::from_str_radix(&v, 16).ok())
                };
                // A read takes the whole count (a semaphore's: one; CRIU does not record the
                // mode, and kernels before 6.5 do not show it) and does not block while there
                // is one: read until there is none.
                let mut reads = 0;
                while count_now().unwrap_or(0) > 0 {
                    reads += 1;
                    let mut v = 0u64;
                    // SAFETY: an eventfd read writes 8 bytes.
                    if reads > 1 << 16 || unsafe { libc::read(d.as_raw_fd(), (&mut v as *mut u64).cast(), 8) } != 8 {
                        return Err(fail("read the count", fd)(last()));
                    }
                }
                if count > 0 {
                    // SAFETY: an eventfd write reads 8 bytes.
                    if unsafe { libc::write(d.as_raw_fd(), (&count as *const u64).cast(), 8) } != 8 {
                        return Err(fail("write the count", fd)(last()));
                    }
                }
                if count_now() != Some(count) {
                    return Err(Error::Failed(format!("eventfd {fd} of process {vpid}: its count is not {count}")));
                }
            }
            Fix::Timer { fd, clock, flags, value, interval } => {
                let d = dup(host, vpid, fd)?;
                // As CRIU restores it: nothing left but an interval is one interval.
                let mut value = if value == (0, 0) { interval } else { value };
                // Armed at an absolute time (and cancelled when the clock is set, if it was):
                // the time left, from now on its clock, with the same flags.
                if flags & libc::TFD_TIMER_ABSTIME as u32 != 0 && value != (0, 0) {
                    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
                    // SAFETY: the kernel writes one timespec.
                    if unsafe { libc::clock_gettime(clock as libc::clockid_t, &mut now) } != 0 {
                        return Err(fail("read the clock of", fd)(last()));
                    }
                    let nsec = value.1 + now.tv_nsec as u64;
                    value = (value.0 + now.tv_sec as u64 + nsec / 1_000_000_000, nsec % 1_000_000_000);
                }
                let ts = |t: (u64, u64)| libc::timespec { tv_sec: t.0 as libc::time_t, tv_nsec: t.1 as libc::c_long };
                let spec = libc::itimerspec { it_interval: ts(interval), it_value: ts(value) };
                // SAFETY: the kernel reads one itimerspec.
                if unsafe { libc::timerfd_settime(d.as_raw_fd(), flags as i32, &spec, std::ptr::null_mut()) } != 0 {
                    return Err(fail("arm", fd)(last()));
                }
            }
            Fix::SignalMask { fd, mask } => {
                let d = dup(host, vpid, fd)?;
                // SAFETY: signalfd on an existing signalfd changes its mask; the kernel reads
                // 8 bytes of sigset (the size passed).
                let r = unsafe { libc::syscall(libc::SYS_signalfd4, d.as_raw_fd(), &mask as *const u64, 8usize, 0) };
                if r < 0 {
                    return Err(fail("set the mask", fd)(last()));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::FromRawFd;

    fn info(fd: i32, key: &str) -> String {
        let me = std::process::id();
        fdinfo_field(&std::fs::read_to_string(format!("/proc/{me}/fdinfo/{fd}")).unwrap(), key).unwrap()
    }

    /// The real path, on descriptors of this process: an eventfd's count, a timerfd and a
    /// signalfd's mask put back through duplicates.
    #[test]
    fn counts_timers_and_masks_go_back_through_a_duplicate() {
        let me = std::process::id() as i32;
        // SAFETY: plain system calls on descriptors this test owns.
        let (ev, tfd, abs, sfd) = unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGUSR2);
            (
                libc::eventfd(7, libc::EFD_NONBLOCK),
                libc::timerfd_create(libc::CLOCK_MONOTONIC, 0),
                libc::timerfd_create(libc::CLOCK_REALTIME, 0),
                libc::signalfd(-1, &set, 0),
            )
        };
        assert!(ev >= 0 && tfd >= 0 && abs >= 0 && sfd >= 0);
        let abs_flags = (libc::TFD_TIMER_ABSTIME | libc::TFD_TIMER_CANCEL_ON_SET) as u32;
        let fixes = [
            Fix::EventCount { fd: ev as u32, count: 3 },
            Fix::Timer {
                fd: tfd as u32,
                clock: libc::CLOCK_MONOTONIC as u32,
                flags: 0,
                value: (500, 0),
                interval: (0, 0),
            },
            Fix::Timer {
                fd: abs as u32,
                clock: libc::CLOCK_REALTIME as u32,
                flags: abs_flags,
                value: (700, 0),
                interval: (0, 0),
            },
            Fix::SignalMask { fd: sfd as u32, mask: 1 << (libc::SIGUSR1 - 1) },
        ];
        match dup(me, 0, ev as u32) {
            Ok(_) => {}
            // Some sandboxes forbid pidfd_getfd: nothing to test there.
            Err(_) => return,
        }
        apply(me, 0, &fixes).unwrap();
        assert_eq!(info(ev, "eventfd-count"), "3");
        let value = info(tfd, "it_value");
        let secs: u64 = value.trim_start_matches('(').split(',').next().unwrap().trim().parse().unwrap();
        assert!((490..=500).contains(&secs), "{value}");
        // Armed at an absolute time again, 700 s from now, and cancelled if the clock is set.
        assert_eq!(u32::from_str_radix(&info(abs, "settime flags"), 8).unwrap(), abs_flags);
        let value = info(abs, "it_value");
        let secs: u64 = value.trim_start_matches('(').split(',').next().unwrap().trim().parse().unwrap();
        assert!((690..=700).contains(&secs), "{value}");
        assert_eq!(u64::from_str_radix(&info(sfd, "sigmask"), 16).unwrap(), 1 << (libc::SIGUSR1 - 1));
        // SAFETY: ours.
        unsafe {
            libc::close(ev);
            libc::close(tfd);
            libc::close(abs);
            libc::close(sfd);
        }
    }

    #[test]
    fn a_datagram_of_no_bytes_is_data() {
        let mut sv = [0; 2];
        // SAFETY: plain system calls on descriptors this test owns.
        unsafe {
            assert_eq!(libc::socketpair(libc::AF_UNIX, libc::SOCK_DGRAM, 0, sv.as_mut_ptr()), 0);
            let (a, b) = (OwnedFd::from_raw_fd(sv[0]), OwnedFd::from_raw_fd(sv[1]));
            assert!(!empty_datagram_waiting(&b));
            assert_eq!(libc::send(a.as_raw_fd(), std::ptr::null(), 0, 0), 0);
            assert_eq!(queued(&b, true), 0, "FIONREAD cannot tell");
            assert!(empty_datagram_waiting(&b));
            assert!(empty_datagram_waiting(&b), "the peek took nothing");
            let mut buf = [0u8; 1];
            assert_eq!(libc::recv(b.as_raw_fd(), buf.as_mut_ptr().cast(), 1, 0), 0);
            assert!(!empty_datagram_waiting(&b));
        }
    }

    #[test]
    fn epoll_fdinfo_parses() {
        let info = "pos:\t0\nflags:\t02\nmnt_id:\t15\nino:\t1057\n\
                    tfd:        5 events:       19 data:                5  pos:0 ino:2f1a sdev:d\n\
                    tfd:        7 events: 80000019 data:     7f0000000007  pos:0 ino:2f1b sdev:d\n";
        assert_eq!(epoll_targets(info), vec![(5, 0x19, 5), (7, 0x8000_0019, 0x7f00_0000_0007)]);
    }

    #[test]
    fn pipes_and_sockets_correspond_one_to_one_only_after_a_restore() {
        let stdio = vec![("pipe:[1]".to_string(), "pipe:[1]".to_string())];
        let mut o = Objects {
            pipe_data: BTreeSet::new(),
            socket_data: BTreeSet::new(),
            stdio: &stdio,
            restored: false,
            seen: BTreeMap::new(),
            taken: BTreeSet::new(),
            sockets: None,
        };
        assert!(o.matches("pipe:[5]", "pipe:[5]"));
        assert!(!o.matches("pipe:[6]", "pipe:[9]"), "another pipe, no restore since");
        let restored = vec![("pipe:[1]".to_string(), "pipe:[100]".to_string())];
        o = Objects { restored: true, stdio: &restored, seen: BTreeMap::new(), taken: BTreeSet::new(), ..o };
        assert!(o.matches("pipe:[1]", "pipe:[100]"));
        assert!(!o.matches("pipe:[2]", "pipe:[100]"), "two pipes then, one now");
        assert!(o.matches("pipe:[2]", "pipe:[101]"));
        assert!(o.matches("pipe:[2]", "pipe:[101]"), "the same pair again (the other end)");
        assert!(!o.matches("pipe:[2]", "pipe:[102]"));
        assert!(!o.matches("socket:[3]", "pipe:[103]"), "a pipe is not a socket");
        assert!(o.matches("socket:[3]", "socket:[200]"));
    }
}

//! Statepoints of a sandbox whose processes did nothing: no CRIU dump.
//!
//! A dump records, beside its images, a fingerprint of the frozen process tree (`fingerprint`):
//! every process and thread with its start time, state, scheduling, credentials, pending and
//! blocked signals, limits, working and root directories, memory map, and descriptors (each
//! one's target, offset and flags, the times of the file behind it, the bytes a pipe holds); the
//! container's mounts, its SysV IPC objects and its host name; and the metadata of every tmpfs
//! CRIU archives. CRIU clears the
//! soft-dirty bits at the dump, so a page written since is soft-dirty.
//!
//! At the next statepoint, frozen, the tree is fingerprinted again: when the fingerprint is the
//! same and no page of any process is soft-dirty, the processes are exactly as the base dump
//! saw them, and the new statepoint's memory images are the base's (hard links), taken in no
//! time. Its files are captured as always. A process that ran at all writes its stack; a page
//! written and put back as it was (CRIU's own parasite does that at every dump) is compared with
//! the dump byte for byte. Any doubt — a socket, an inotify, a POSIX timer, a page map too large
//! to scan, a kernel without soft-dirty bits — makes a real dump. So does a process sleeping in
//! `nanosleep` with a remaining-time pointer (busybox `sleep`): each freeze writes the time left
//! into its memory, a real change.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt};
use std::path::Path;
use sys::proc::Proc;

/// The file beside a dump's images that holds its fingerprint ([`Record`]).
pub const FILE: &str = "unchanged.json";

/// What [`FILE`] holds: the tree's fingerprint when it was dumped, and its threads' user-mode
/// times once the dump's parasite had run (none when they could not be read: nothing later
/// equals it). Read by a later snapshot, another planarian process.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct Record {
    pub fingerprint: String,
    pub user_time: Option<std::collections::BTreeMap<String, u64>>,
}

/// The most pages scanned for soft-dirty bits (64 GiB of address space); a larger tree dumps.
const MAX_PAGES: u64 = 1 << 24;

/// Why the tree cannot be taken as unchanged, whatever it did.
#[derive(Debug, PartialEq)]
pub struct Unfit(pub String);

impl From<sys::IoError> for Unfit {
    fn from(e: sys::IoError) -> Unfit {
        Unfit(e.to_string())
    }
}

/// The fingerprint of the frozen tree of the container whose processes are `pids` and whose
/// first process is `init`.
pub fn fingerprint(pids: &[i32], init: i32) -> Result<u64, Unfit> {
    let mut h = DefaultHasher::new();
    if pids.is_empty() {
        return Err(Unfit("no process".into()));
    }
    pids.hash(&mut h);
    let mnt = |pid: i32| Proc::of(pid).link("ns/mnt").ok();
    for &pid in pids {
        // (the mounts compared are init's: a process in a mount namespace of its own is a doubt)
        if mnt(pid) != mnt(init) {
            return Err(Unfit(format!("process {pid} has a mount namespace of its own")));
        }
        process(pid, &mut h)?;
    }
    let mounts = Proc::of(init).read("mountinfo")?;
    mounts.hash(&mut h);
    namespaces(init, &mut h)?;
    for m in sys::proc::parse_mountinfo(&mounts) {
        // What CRIU archives of the container's own file systems (planarian keeps /dev).
        if matches!(m.fstype.as_str(), "tmpfs" | "mqueue") && m.point != "/dev" {
            tree(&Proc::of(init).root().join(m.point.trim_start_matches('/')), &mut h)?;
        }
    }
    Ok(h.finish())
}

/// One process and its threads. (Long: one list of what is hashed, in the order it is hashed;
/// cut apart, the pieces would only pass the hasher around.)
fn process(pid: i32, h: &mut DefaultHasher) -> Result<(), Unfit> {
    let proc = Proc::of(pid);
    for tid in proc.threads()? {
        let task = proc.task(tid);
        // State, priority and nice, start time, real-time priority and policy (not the counters).
        let stat = task.read("stat")?;
        let fields: Vec<Option<&str>> =
            [3, 18, 19, 22, 40, 41].into_iter().map(|n| sys::proc::stat_text_field(&stat, n)).collect();
        (tid, fields).hash(h);
        let status = task.read("status")?;
        let kept = [
            "Name:",
            "Umask:",
            "SigPnd",
            "ShdPnd",
            "SigBlk",
            "SigIgn",
            "SigCgt",
            "Cap",
            "NoNewPrivs",
            "Seccomp",
            "Uid",
            "Gid",
            "Groups",
            "Cpus_allowed:",
            "THP_enabled",
        ];
        for l in status.lines().filter(|l| kept.iter().any(|k| l.starts_with(k))) {
            l.hash(h);
        }
        // The system call it waits in, with its arguments, stack and instruction pointers.
        task.read("syscall")?.hash(h);
    }
    if !proc.read("timers").unwrap_or_default().trim().is_empty() {
        return Err(Unfit(format!("process {pid} has POSIX timers")));
    }
    let maps = proc.read("maps")?;
    for l in maps.lines() {
        let perms = l.split_whitespace().nth(1).unwrap_or("");
        // Shared writable memory another process may write (its page tables, not these, would
        // say so), and the kernel's AIO rings.
        // Huge TLB pages, whose soft-dirty bits clear_refs does not reset.
        let hugetlb = l.contains("anon_hugepage") || l.contains("/dev/hugepages");
        if (perms.contains('w') && perms.ends_with('s')) || l.contains("[aio]") || hugetlb {
            return Err(Unfit(format!("process {pid} maps shared memory ({l})")));
        }
    }
    maps.hash(h);
    for f in ["limits", "oom_score_adj", "timerslack_ns"] {
        proc.read(f).ok().hash(h);
    }
    for link in ["cwd", "root", "exe", "ns/ipc", "ns/uts", "ns/pid", "ns/net", "ns/cgroup", "ns/user"] {
        proc.link(link).ok().hash(h);
    }
    for fd in proc.fds()? {
        let path = proc.path(&format!("fd/{fd}"));
        let target = proc.link(&format!("fd/{fd}"))?;
        let t = target.to_string_lossy();
        // What the kernel holds for these is in fdinfo (an eventfd's count, a timerfd's ticks and
        // time left, a signalfd's mask, an epoll's watches); a socket's queues, an inotify's
        // events or a terminal's input are not.
        let known = ["anon_inode:[eventpoll]", "anon_inode:[eventfd]", "anon_inode:[signalfd]", "anon_inode:[timerfd]"];
        let terminal = t.starts_with("/dev/pts/") || t.starts_with("/dev/tty") || t == "/dev/console";
        if t.starts_with("socket:") || terminal || (t.starts_with("anon_inode:") && !known.contains(&t.as_ref())) {
            return Err(Unfit(format!("process {pid} holds {t}")));
        }
        (fd, &t).hash(h);
        // Offset, flags, and for an epoll the descriptors it watches.
        proc.fdinfo(fd)?.hash(h);
        if let Ok(md) = std::fs::metadata(&path) {
            (md.dev(), md.ino(), md.size(), md.mtime(), md.mtime_nsec(), md.ctime(), md.ctime_nsec()).hash(h);
            if md.file_type().is_fifo() {
                // What a pipe holds: a write moves its times, a read only the bytes queued.
                queued(pid, fd as u32)?.hash(h);
            }
        }
    }
    Ok(())
}

/// The bytes queued in the pipe or FIFO that process `pid` holds as `fd`, asked of that very open
/// file (a copy of the descriptor, pidfd_getfd): opening the pipe anew would count as a reader.
fn queued(pid: i32, fd: u32) -> Result<i32, Unfit> {
    use nix::libc;
    use std::os::fd::AsRawFd;
    let fail = |what: &str, e: std::io::Error| Unfit(format!("process {pid} fd {fd}: {what}: {e}"));
    let copy = super::inplace::ptrace::dup_fd(pid, fd).map_err(|e| fail("pidfd_getfd", e))?;
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int through the pointer, which points at `n`.
    if unsafe { libc::ioctl(copy.as_raw_fd(), libc::FIONREAD, &mut n) } < 0 {
        return Err(fail("FIONREAD", std::io::Error::last_os_error()));
    }
    Ok(n)
}

/// The time every process of `pids` spent in user mode (ns, all its threads): a process that
/// ran since, even without writing memory (a loop in registers), has more. It is the kernel's own
/// count, sampled at each tick in user mode, read through the process's CPU clock
/// (`CPUCLOCK_VIRT`). Not `/proc`'s user time: that one is the process's whole run time scaled by
/// the share of user ticks, so a thaw could move it by any share of the kernel's work. (A thaw
/// itself does return to user mode, for the one instruction that restarts the system call the
/// freeze interrupted: see [`ran_since`].)
pub fn user_times(pids: &[i32]) -> Result<std::collections::BTreeMap<String, u64>, Unfit> {
    use nix::libc;
    let mut out = std::collections::BTreeMap::new();
    for &pid in pids {
        // MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_VIRT) of the kernel's posix-timers.h
        let clock = (!pid << 3) | 1;
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: clock_gettime writes one timespec through the pointer, which points at `ts`.
        if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
            return Err(Unfit(format!("the user time of process {pid}: {}", std::io::Error::last_os_error())));
        }
        out.insert(pid.to_string(), ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64);
    }
    Ok(out)
}

/// Which process of `pids` ran in user mode since its threads' user times were `then`, if any.
/// A thaw returns each thread blocked in a system call to user mode for the one instruction
/// that restarts it, and a tick that came while the kernel was returning is counted there: so a
/// process whose time moved by at most one tick for each of its threads waiting in a system call
/// (none for a thread frozen in user mode) ran nothing else that the count can see. A statepoint
/// that takes no dump records the times it saw, so thaws do not add up; what each interval may
/// hide is a run of less than a tick beyond that instruction, where the sampled count sees none
/// of a short run anyway. The fingerprint (the system call each thread waits in, its stack and
/// instruction pointers) and the memory's comparison say the rest.
pub fn ran_since(
    pids: &[i32],
    then: &std::collections::BTreeMap<String, u64>,
    now: &std::collections::BTreeMap<String, u64>,
) -> Option<i32> {
    let tick = tick_ns();
    pids.iter().copied().find(|&pid| {
        let key = pid.to_string();
        match (then.get(&key), now.get(&key)) {
            (Some(&a), Some(&b)) => b < a || b - a > tick.saturating_mul(in_system_calls(pid)),
            _ => true,
        }
    })
}

/// How many threads of process `pid` wait in a system call (`/proc`'s `syscall` names one: not
/// `-1`, in the kernel for another reason, nor `running`).
fn in_system_calls(pid: i32) -> u64 {
    let proc = Proc::of(pid);
    let waiting = |tid: &i32| {
        proc.task(*tid)
            .read("syscall")
            .is_ok_and(|s| s.split_whitespace().next().and_then(|n| n.parse::<i64>().ok()).is_some_and(|n| n >= 0))
    };
    proc.threads().map_or(0, |t| t.iter().filter(|tid| waiting(tid)).count() as u64)
}

/// The kernel's tick (ns): the resolution of its coarse clock, which moves once a tick.
fn tick_ns() -> u64 {
    use nix::libc;
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_getres writes one timespec through the pointer, which points at `ts`.
    if unsafe { libc::clock_getres(libc::CLOCK_MONOTONIC_COARSE, &mut ts) } != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The container's SysV IPC objects and host name, read from inside its namespaces.
fn namespaces(init: i32, h: &mut DefaultHasher) -> Result<(), Unfit> {
    let got = std::thread::scope(|s| {
        s.spawn(|| -> Result<(Vec<String>, String), String> {
            use nix::sched::{setns, CloneFlags};
            for (ns, flag) in [("ipc", CloneFlags::CLONE_NEWIPC), ("uts", CloneFlags::CLONE_NEWUTS)] {
                let f = Proc::of(init).open(&format!("ns/{ns}")).map_err(|e| e.to_string())?;
                setns(f, flag).map_err(|e| format!("setns {ns}: {e}"))?;
            }
            let mut ipc = Vec::new();
            for f in ["shm", "msg", "sem"] {
                ipc.push(sys::proc::system(&format!("sysvipc/{f}")).map_err(|e| e.to_string())?);
            }
            let u = nix::sys::utsname::uname().map_err(|e| e.to_string())?;
            Ok((ipc, format!("{:?} {:?}", u.nodename(), u.domainname())))
        })
        .join()
    });
    match got {
        Ok(Ok((ipc, uts))) => {
            // A semaphore's values and a queue's messages are not in /proc: any such object is a
            // doubt. (Shared memory another process attaches moves its times.)
            if ipc[1..].iter().any(|t| t.lines().count() > 1) {
                return Err(Unfit("the container has System V semaphores or message queues".into()));
            }
            (ipc, uts).hash(h);
            Ok(())
        }
        Ok(Err(e)) => Err(Unfit(e)),
        Err(_) => Err(Unfit("the namespaces' reader panicked".into())),
    }
}

/// The most entries of the tmpfs trees compared; more is a doubt (the sandbox is frozen).
const MAX_ENTRIES: usize = 100_000;

/// The metadata of every entry of a tree (a write changes a file's ctime; a new or removed
/// entry its directory's), not crossing into the file systems mounted inside it (compared on
/// their own when CRIU archives them; volumes are not the statepoint's).
fn tree(root: &Path, h: &mut DefaultHasher) -> Result<(), Unfit> {
    let dev = std::fs::symlink_metadata(root).map_err(|e| Unfit(format!("{}: {e}", root.display())))?.dev();
    let mut todo = vec![root.to_path_buf()];
    let mut seen = 0usize;
    while let Some(p) = todo.pop() {
        seen += 1;
        if seen > MAX_ENTRIES {
            return Err(Unfit(format!("{} holds more than {MAX_ENTRIES} entries", root.display())));
        }
        let md = std::fs::symlink_metadata(&p).map_err(|e| Unfit(format!("{}: {e}", p.display())))?;
        (p.strip_prefix(root).unwrap_or(&p), md.ino(), md.mode(), md.uid(), md.gid(), md.size(), md.rdev()).hash(h);
        (md.mtime(), md.mtime_nsec(), md.ctime(), md.ctime_nsec()).hash(h);
        if md.is_dir() && md.dev() == dev {
            let mut names: Vec<_> = std::fs::read_dir(&p)
                .map_err(|e| Unfit(format!("{}: {e}", p.display())))?
                .flatten()
                .map(|e| e.path())
                .collect();
            names.sort();
            todo.extend(names);
        }
    }
    Ok(())
}

/// The most soft-dirty pages of one process compared with the base's images (64 MiB); more is a
/// change. (khugepaged marks a whole 2 MiB huge page soft-dirty when it collapses one, with the
/// same content.)
const MAX_COMPARED: usize = 16384;

/// Whether the memory of the processes `pids` differs from the dump in `base` (the images the
/// soft-dirty bits were last cleared for). A page not soft-dirty is the dump's; the few a dump
/// itself leaves soft-dirty (CRIU puts back the bytes and the signal frame it used to run its
/// parasite) are compared with the dump's content, byte for byte.
pub fn memory_differs(pids: &[i32], base: &Path) -> Result<Option<String>, Unfit> {
    for &pid in pids {
        let Some(dirty) = soft_dirty_pages(pid)? else {
            return Ok(Some(format!("process {pid}: more soft-dirty pages than are compared")));
        };
        if dirty.is_empty() {
            continue;
        }
        let vpid = virtual_pid(pid)?;
        let runs = criu_hooks::images::memory(base, vpid).map_err(|e| Unfit(e.to_string()))?;
        let cpu_fields = rseq_cpu_fields(base, vpid)?;
        let mem = Proc::of(pid).open("mem")?;
        let (mut now, mut then) = (vec![0u8; PAGE as usize], vec![0u8; PAGE as usize]);
        for (addr, present) in dirty {
            let i = runs.partition_point(|r| r.end() <= addr);
            let run = runs.get(i).filter(|r| r.vaddr <= addr);
            let mapping = || {
                let maps = Proc::of(pid).read("maps").unwrap_or_default();
                maps.lines().find(|l| range(l).is_some_and(|(a, b)| a <= addr && addr < b)).unwrap_or("").to_string()
            };
            match (present, run) {
                (false, None) => continue,
                (false, Some(_)) => return Ok(Some(format!("process {pid}: page {addr:#x} is gone ({})", mapping()))),
                (true, run) => {
                    mem.read_exact_at(&mut now, addr).map_err(|e| Unfit(format!("/proc/{pid}/mem: {e}")))?;
                    match run {
                        Some(r) => std::fs::File::open(&r.file)
                            .and_then(|f| f.read_exact_at(&mut then, r.loc.offset + (addr - r.vaddr)))
                            .map_err(|e| Unfit(format!("{}: {e}", r.file.display())))?,
                        // (no page in the dump: a zero page)
                        None => then.fill(0),
                    }
                    // (what the kernel writes at every return to user space: the CPU it runs on)
                    for &(lo, hi) in cpu_fields.iter().filter(|(lo, hi)| *lo < addr + PAGE && *hi > addr) {
                        let (a, b) = ((lo.max(addr) - addr) as usize, ((hi.min(addr + PAGE)) - addr) as usize);
                        now[a..b].fill(0);
                        then[a..b].fill(0);
                    }
                    if now != then {
                        let was = if run.is_some() { "the dump's" } else { "zeros (not in the dump)" };
                        let at = now.iter().zip(&then).position(|(a, b)| a != b).unwrap_or(0);
                        let hex = |v: &[u8]| {
                            v[at..(at + 16).min(v.len())].iter().map(|b| format!("{b:02x}")).collect::<String>()
                        };
                        return Ok(Some(format!(
                            "process {pid}: page {addr:#x} differs from {was} at +{at:#x}: {} now, {} then ({})",
                            hex(&now),
                            hex(&then),
                            mapping()
                        )));
                    }
                }
            }
        }
    }
    Ok(None)
}

/// The fields of each thread's `struct rseq` (process `vpid` of the dump in `base`) that the
/// kernel rewrites each time the thread returns to user space, on whatever CPU: `cpu_id_start`
/// and `cpu_id` (bytes 0–8), `node_id` and `mm_cid` (24–32). A thread woken on another CPU
/// changed nothing of its own.
fn rseq_cpu_fields(base: &Path, vpid: u32) -> Result<Vec<(u64, u64)>, Unfit> {
    use criu_hooks::images;
    let tree = images::pstree(base).map_err(|e| Unfit(e.to_string()))?;
    let mut out = Vec::new();
    for tid in tree.iter().filter(|p| p.pid == vpid).flat_map(|p| p.threads.iter()) {
        if let Some((at, size)) = images::core(base, *tid).map_err(|e| Unfit(e.to_string()))?.rseq {
            out.push((at, at + 8));
            if size >= 32 {
                out.push((at + 24, at + 32));
            }
        }
    }
    Ok(out)
}

/// Whether a process of the dump in `base` had an interval or POSIX timer armed: its time left
/// has run down since, which no fingerprint shows.
pub fn timers_armed(base: &Path) -> Result<bool, Unfit> {
    use criu_hooks::images;
    for p in images::pstree(base).map_err(|e| Unfit(e.to_string()))? {
        if images::core(base, p.pid).map_err(|e| Unfit(e.to_string()))?.timers {
            return Ok(true);
        }
    }
    Ok(false)
}

const PAGE: u64 = 4096;

/// The soft-dirty pages of process `pid` (address, present or swapped), or `None` when there
/// are more than are compared or its map is larger than is scanned.
fn soft_dirty_pages(pid: i32) -> Result<Option<Vec<(u64, bool)>>, Unfit> {
    use sys::proc::pagemap::{scan, PRESENT, SOFT_DIRTY, SWAPPED};
    let mut budget = MAX_PAGES;
    let mut out = Vec::new();
    let maps = Proc::of(pid).read("maps")?;
    let pagemap = Proc::of(pid).open("pagemap")?;
    use std::ops::ControlFlow;
    use sys::proc::pagemap::category as c;
    for (lo, hi) in maps.lines().filter(|l| !l.ends_with("[vsyscall]")).filter_map(range) {
        let Some(left) = budget.checked_sub((hi - lo) / PAGE) else { return Ok(None) };
        budget = left;
        let mut dirty = |a: u64, present: bool| {
            if out.len() == MAX_COMPARED {
                return ControlFlow::Break(());
            }
            out.push((a, present));
            ControlFlow::Continue(())
        };
        // (the kernel says where the soft-dirty pages are, or each page's entry is read)
        let shown = c::PRESENT | c::SWAPPED | c::SOFT_DIRTY;
        let asked = sys::proc::pagemap::regions(&pagemap, lo, hi, (c::SOFT_DIRTY, 0, shown), |s, e, k| {
            let present = k & (c::PRESENT | c::SWAPPED) != 0;
            (s..e).step_by(PAGE as usize).try_for_each(|a| dirty(a, present))
        })
        .map_err(|e| Unfit(format!("PAGEMAP_SCAN /proc/{pid}/pagemap: {e}")))?;
        let scanned = match asked {
            Some(done) => done,
            None => scan(&pagemap, lo, hi, |a, e| match e & SOFT_DIRTY {
                0 => ControlFlow::Continue(()),
                _ => dirty(a, e & (PRESENT | SWAPPED) != 0),
            })
            .map_err(|e| Unfit(format!("/proc/{pid}/pagemap: {e}")))?,
        };
        if scanned.is_break() {
            return Ok(None);
        }
    }
    Ok(Some(out))
}

/// The address range of a line of `/proc/PID/maps`.
fn range(line: &str) -> Option<(u64, u64)> {
    let (lo, hi) = line.split_whitespace().next()?.split_once('-')?;
    Some((u64::from_str_radix(lo, 16).ok()?, u64::from_str_radix(hi, 16).ok()?))
}

/// Process `pid` as its own PID namespace numbers it (CRIU's images do).
fn virtual_pid(pid: i32) -> Result<u32, Unfit> {
    Proc::of(pid)
        .status()?
        .number("NSpid")
        .and_then(|v| u32::try_from(v).ok())
        .ok_or_else(|| Unfit(format!("process {pid}: no NSpid")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A process that reads lines and does nothing else: no soft-dirty page while it waits,
    /// some once it has read one.
    #[test]
    fn a_waiting_process_is_untouched_and_one_that_ran_is_written() {
        if !sys::proc::pagemap::soft_dirty_kept() {
            eprintln!("SKIPPED: this kernel keeps no soft-dirty bits");
            return;
        }
        let mut child = std::process::Command::new("sh")
            .args(["-c", "while read x; do echo \"$x\" > /dev/null; done"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let pid = child.id() as i32;
        // Until it waits in read(0, …) (syscall 0, first argument 0).
        let waiting = || {
            std::fs::read_to_string(format!("/proc/{pid}/syscall"))
                .is_ok_and(|s| s.split_whitespace().take(2).collect::<Vec<_>>() == ["0", "0x0"])
        };
        let t = std::time::Instant::now();
        while !waiting() && t.elapsed() < std::time::Duration::from_secs(30) {
            std::thread::yield_now();
        }
        std::fs::write(format!("/proc/{pid}/clear_refs"), "4").unwrap();
        assert_eq!(soft_dirty_pages(pid), Ok(Some(vec![])), "nothing ran since the bits were cleared");
        child.stdin.as_mut().unwrap().write_all(b"line\n").unwrap();
        let t = std::time::Instant::now();
        let mut written = false;
        while !written && t.elapsed() < std::time::Duration::from_secs(30) {
            written = soft_dirty_pages(pid).is_ok_and(|d| d.is_none_or(|d| !d.is_empty()));
        }
        assert!(written, "the process ran: its pages are written");
        let _ = child.kill();
        let _ = child.wait();
    }

    /// A process's user time is readable by another, and moves when it runs in user mode.
    #[test]
    fn a_process_that_runs_in_user_mode_has_more_user_time() {
        let busy = crate::pidfd::tests::Child(
            std::process::Command::new("sh").args(["-c", "while :; do :; done"]).spawn().unwrap(),
        );
        let pid = busy.0.id() as i32;
        let at = || user_times(&[pid]).unwrap()[&pid.to_string()];
        let first = at();
        // (above the largest pid_max, 2^22: no such process)
        assert!(user_times(&[(1 << 22) + 1]).is_err(), "no such process: no time");
        let t = std::time::Instant::now();
        while at() == first && t.elapsed() < std::time::Duration::from_secs(60) {
            std::thread::yield_now();
        }
        assert!(at() > first, "a loop in user mode counts");
        let then = user_times(&[pid]).unwrap();
        assert_eq!(ran_since(&[pid], &then, &then), None, "the same times: it ran nothing");
        let plus = |t: &std::collections::BTreeMap<String, u64>, ns: u64| -> std::collections::BTreeMap<String, u64> {
            t.iter().map(|(k, v)| (k.clone(), v + ns)).collect()
        };
        let tick = tick_ns();
        assert!((1_000_000..=10_000_000).contains(&tick), "a tick of 100 to 1000 Hz: {tick} ns");
        // A thread in user mode restarts no system call at a thaw: no tick is a thaw's.
        assert_eq!(ran_since(&[pid], &then, &plus(&then, 1)), Some(pid));
        let back: std::collections::BTreeMap<_, _> = then.iter().map(|(k, v)| (k.clone(), v - 1)).collect();
        assert_eq!(ran_since(&[pid], &then, &back), Some(pid), "a time that went back is another process's");
        drop(busy);

        // One waiting in a system call: one tick may be the thaw's, more is a run.
        let sleeping = crate::pidfd::tests::Child(std::process::Command::new("sleep").arg("600").spawn().unwrap());
        let pid = sleeping.0.id() as i32;
        // (until it sleeps: while it starts, it may be met in another system call, or running)
        let asleep = || {
            let call = Proc::of(pid).read("syscall").unwrap_or_default();
            let n = call.split_whitespace().next().and_then(|n| n.parse::<i64>().ok());
            matches!(n, Some(n) if n == nix::libc::SYS_nanosleep || n == nix::libc::SYS_clock_nanosleep)
        };
        let t = std::time::Instant::now();
        while !asleep() && t.elapsed() < std::time::Duration::from_secs(60) {
            std::thread::yield_now();
        }
        assert_eq!(in_system_calls(pid), 1, "sleep waits in one system call");
        let then = user_times(&[pid]).unwrap();
        assert_eq!(ran_since(&[pid], &then, &plus(&then, tick)), None, "one tick of one waiting thread is a thaw's");
        assert_eq!(ran_since(&[pid], &then, &plus(&then, tick + 1)), Some(pid), "more is a run");
    }

    #[test]
    fn a_tree_fingerprint_moves_with_any_entry() {
        let scratch = tempfile::tempdir().unwrap();
        let d = scratch.path().join("unchanged");
        std::fs::create_dir_all(d.join("a")).unwrap();
        std::fs::write(d.join("a/f"), "x").unwrap();
        let fp = |d: &Path| {
            let mut h = DefaultHasher::new();
            tree(d, &mut h).unwrap();
            h.finish()
        };
        let first = fp(&d);
        assert_eq!(fp(&d), first);
        // (a file's times come from the kernel's coarse clock, which moves once a tick: the
        // write below is made once it has moved past the first one's, as any write is that
        // comes after a freeze, a fingerprint and a thaw)
        let written = std::fs::metadata(d.join("a/f")).unwrap();
        let was = (written.ctime(), written.ctime_nsec());
        let coarse = || {
            let mut ts = nix::libc::timespec { tv_sec: 0, tv_nsec: 0 };
            // SAFETY: clock_gettime writes one timespec through the pointer, which points at `ts`.
            unsafe { nix::libc::clock_gettime(nix::libc::CLOCK_REALTIME_COARSE, &mut ts) };
            (ts.tv_sec, ts.tv_nsec)
        };
        // (bounded: a clock stepped back would otherwise hold the test until it caught up)
        let t = std::time::Instant::now();
        while coarse() <= was && t.elapsed() < std::time::Duration::from_secs(1) {
            std::thread::yield_now();
        }
        std::fs::write(d.join("a/f"), "y").unwrap();
        let second = fp(&d);
        assert_ne!(second, first, "a write of the same size");
        std::fs::write(d.join("a/g"), "").unwrap();
        assert_ne!(fp(&d), second, "a new entry");
    }
}

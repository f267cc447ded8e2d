//! Rollback in place: the container's processes return to a statepoint without being stopped.
//! Podman, conmon, the network namespace and the cgroup never notice.
//!
//! It applies when the frozen process tree has the *shape* it had at the statepoint
//! ([`check`], the rules, every one a refusal that sends the rollback down the stop-and-restore
//! path):
//! * the same processes and threads (PIDs and TIDs in the container's PID namespace), with the
//!   same parents, process groups and sessions, none a zombie, stopped or traced;
//! * 64-bit tasks, none being killed; signals and timers as [`signals`] allows (queued signals,
//!   dispositions, interval and POSIX timers, alternate stacks are put back);
//! * the same file-backed mappings (addresses, protection, offset, file name), the same stack
//!   and vDSO; no shared anonymous memory or System V shm, now or then. Private anonymous
//!   memory may differ: the heap is put back with `brk`, other mappings with `munmap`, `mmap`
//!   and `mprotect`, run inside the process;
//! * the same descriptors, as [`descriptors`] allows: regular files (the offset is set back),
//!   pipes, sockets, eventfd, timerfd, signalfd, epoll; terminals and other kinds refuse;
//! * the same credentials, seccomp mode, personality and scheduling policy; resource limits,
//!   `oom_score_adj`, nice values, umask, working directory and child-subreaper flag are put
//!   back ([`attrs`]).
//!
//! Not compared (not in CRIU's images, or not visible from outside): `set_tid_address`, robust
//! futex lists, rseq, the parent-death signal, a root directory changed by `chroot`, and the
//! `prctl` memory-layout fields; they belong to the same threads and rarely change.
//!
//! [`Shape::plan`] then compares the statepoint's pages with a dump of the current state (the
//! safety statepoint, taken frozen just before): a page is written when its content comes from
//! another image location than the statepoint's, dropped (`MADV_DONTNEED`) when it was not
//! there at the statepoint. [`Plan::apply`] holds every thread with ptrace, writes the pages
//! through `/proc/PID/mem` (transparent huge pages off meanwhile), drops any page the process
//! has that the statepoint has not (`/proc/PID/pagemap`: khugepaged may have filled holes since
//! the dump), puts signals and timers back ([`signals`]), sets registers (`orig_ax = -1`: no
//! system-call restart on top of CRIU's own fix-ups), FPU state, signal masks, names and file
//! offsets, clears the soft-dirty bits (the
//! next dump is incremental on the statepoint's images), and checks that the mappings now are
//! the statepoint's.

mod attrs;
mod descriptors;
pub mod ptrace;
mod signals;

use criu_hooks::images::{self, PageRun, PAGE_SIZE};
use nix::libc;
use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The tree is not in a shape a rollback in place can restore (before anything changed).
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Image(#[from] images::ReadError),
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
    #[error("{0}")]
    Failed(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

fn refuse<T>(why: impl Into<String>) -> Result<T> {
    Err(Error::Refused(why.into()))
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.into();
    move |source| Error::Io { what, source }
}

const PROT_READ: u32 = 1;
const PROT_WRITE: u32 = 2;
const PROT_EXEC: u32 = 4;

/// One line of `/proc/PID/maps`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct MapLine {
    start: u64,
    end: u64,
    prot: u32,
    shared: bool,
    offset: u64,
    inode: u64,
    path: String,
}

fn parse_maps(text: &str) -> Vec<MapLine> {
    text.lines()
        .filter_map(|l| {
            let mut f = l.splitn(6, ' ');
            let (range, perms, offset, _dev, inode) = (f.next()?, f.next()?, f.next()?, f.next()?, f.next()?);
            let path = f.next().unwrap_or("").trim_start().to_string();
            let (s, e) = range.split_once('-')?;
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
                inode: inode.parse().ok()?,
                path,
            })
        })
        .collect()
}

fn is_special(path: &str) -> bool {
    matches!(path, "[vdso]" | "[vvar]" | "[vsyscall]" | "[vvar_vclock]")
}

fn is_anon_private(m: &MapLine) -> bool {
    m.inode == 0
        && !m.shared
        && !is_special(&m.path)
        && (m.path.is_empty() || m.path == "[heap]" || m.path == "[stack]" || m.path.starts_with("[anon:"))
}

fn maps_of(pid: i32) -> Result<Vec<MapLine>> {
    Ok(parse_maps(&std::fs::read_to_string(format!("/proc/{pid}/maps")).map_err(io(format!("read /proc/{pid}/maps")))?))
}

/// `Key:\tvalue` of a status file; for the `NS*` keys, the innermost namespace's value.
fn status_field(status: &str, key: &str) -> Option<String> {
    status
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .map(|v| v.split_whitespace().last().unwrap_or("").to_string())
}

/// A live thread: its PID on the host and in the container.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Thread {
    host: i32,
    vtid: u32,
}

#[derive(Debug)]
struct LiveProcess {
    host: i32,
    vpid: u32,
    host_ppid: i32,
    pgid: u32,
    sid: u32,
    threads: Vec<Thread>,
}

/// The processes of a cgroup and its children (host PIDs).
pub fn cgroup_pids(dir: &Path) -> Vec<i32> {
    let mut out: Vec<i32> = std::fs::read_to_string(dir.join("cgroup.procs"))
        .or_else(|_| std::fs::read_to_string(dir.join("tasks")))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                out.extend(cgroup_pids(&e.path()));
            }
        }
    }
    out.sort_unstable();
    out.dedup();
    out
}

fn read_status(path: &str) -> Result<String> {
    std::fs::read_to_string(path).map_err(io(format!("read {path}")))
}

/// Refuses a thread that is a zombie, stopped, traced or being killed.
fn check_live_thread(status: &str, what: &str) -> Result<()> {
    let state = status
        .lines()
        .find_map(|l| l.strip_prefix("State:"))
        .map(|s| s.trim().chars().next().unwrap_or('?'))
        .unwrap_or('?');
    if matches!(state, 'Z' | 'X' | 'T' | 't') {
        return refuse(format!(
            "{what} is {}",
            match state {
                'Z' | 'X' => "a zombie",
                _ => "stopped or traced",
            }
        ));
    }
    if status_field(status, "TracerPid").is_some_and(|t| t != "0") {
        return refuse(format!("{what} is traced by another process"));
    }
    // A stop, continue, kill or trap signal pending now: rt_sigtimedwait cannot take a stop or
    // a kill, and a step over a system call would be taken for the trap.
    let state_signals = signals::STATE_SIGNALS.iter().fold(0u64, |m, s| m | 1 << (s - 1));
    for key in ["SigPnd", "ShdPnd"] {
        let pending = status_field(status, key).map(|v| u64::from_str_radix(&v, 16).unwrap_or(u64::MAX));
        if let Some(m) = pending.filter(|m| m & state_signals != 0) {
            let why = if m & 1 << (libc::SIGKILL - 1) != 0 {
                "is being killed"
            } else {
                "has a stop, continue or trap signal pending"
            };
            return refuse(format!("{what} {why}"));
        }
    }
    Ok(())
}

fn live_tree(pids: &[i32]) -> Result<Vec<LiveProcess>> {
    let mut out = Vec::new();
    for &pid in pids {
        let st = read_status(&format!("/proc/{pid}/status"))?;
        let num = |k: &str| status_field(&st, k).and_then(|v| v.parse::<u64>().ok());
        let vpid = num("NSpid").ok_or_else(|| Error::Failed(format!("process {pid}: no NSpid")))? as u32;
        check_live_thread(&st, &format!("process {vpid}"))?;
        let mut threads = Vec::new();
        let task_dir = format!("/proc/{pid}/task");
        for e in std::fs::read_dir(&task_dir).map_err(io(format!("read {task_dir}")))?.flatten() {
            let Some(tid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else { continue };
            let ts = read_status(&format!("{task_dir}/{tid}/status"))?;
            let vtid = status_field(&ts, "NSpid")
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| Error::Failed(format!("thread {tid}: no NSpid")))?;
            check_live_thread(&ts, &format!("thread {vtid} of process {vpid}"))?;
            threads.push(Thread { host: tid, vtid });
        }
        threads.sort_by_key(|t| t.vtid);
        out.push(LiveProcess {
            host: pid,
            vpid,
            host_ppid: num("PPid").unwrap_or(0) as i32,
            pgid: num("NSpgid").unwrap_or(0) as u32,
            sid: num("NSsid").unwrap_or(0) as u32,
            threads,
        });
    }
    Ok(out)
}

/// How one process's private anonymous memory is put back to the statepoint's layout.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Layout {
    /// `brk(this)`, when the statepoint or the process has a heap.
    brk: Option<u64>,
    unmap: Vec<(u64, u64)>,
    /// start, end, prot, mmap flags.
    map: Vec<(u64, u64, u32, u32)>,
    protect: Vec<(u64, u64, u32)>,
    /// Ranges that stop existing (unmapped, or the heap's shrunk tail): no page is dropped there.
    gone: Vec<(u64, u64)>,
}

/// Private anonymous coverage as (start, end, prot, flags) segments.
type Segments = Vec<(u64, u64, u32, u32)>;

/// Segments of `a` and `b` cut at every boundary of either: (start, end, in a, in b).
#[allow(clippy::type_complexity)]
fn overlay_segments(a: &Segments, b: &Segments) -> Vec<(u64, u64, Option<(u32, u32)>, Option<(u32, u32)>)> {
    let mut cuts: BTreeSet<u64> = BTreeSet::new();
    for s in a.iter().chain(b) {
        cuts.insert(s.0);
        cuts.insert(s.1);
    }
    let cuts: Vec<u64> = cuts.into_iter().collect();
    let find = |v: &Segments, x: u64| v.iter().find(|s| s.0 <= x && x < s.1).map(|s| (s.2, s.3));
    let mut out: Vec<(u64, u64, Option<(u32, u32)>, Option<(u32, u32)>)> = Vec::new();
    for w in cuts.windows(2) {
        let (x, y) = (w[0], w[1]);
        let (ia, ib) = (find(a, x), find(b, x));
        if ia.is_none() && ib.is_none() {
            continue;
        }
        match out.last_mut() {
            Some(l) if l.1 == x && l.2 == ia && l.3 == ib => l.1 = y,
            _ => out.push((x, y, ia, ib)),
        }
    }
    out
}

/// Coverage by page protection only, adjacent equal ranges merged (VMAs split or merge
/// differently for the same memory).
fn coverage(s: &Segments) -> Vec<(u64, u64, u32)> {
    let mut v: Vec<(u64, u64, u32)> = s.iter().map(|x| (x.0, x.1, x.2)).collect();
    v.sort_unstable();
    let mut out: Vec<(u64, u64, u32)> = Vec::new();
    for x in v {
        match out.last_mut() {
            Some(l) if l.1 == x.0 && l.2 == x.2 => l.1 = x.1,
            _ => out.push(x),
        }
    }
    out
}

fn merge(mut v: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    v.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::new();
    for x in v {
        match out.last_mut() {
            Some(l) if l.1 >= x.0 => l.1 = l.1.max(x.1),
            _ => out.push(x),
        }
    }
    out
}

/// `set` minus `minus`, both merged and sorted; in one pass over each (a heap's pages run in
/// thousands of pieces).
fn subtract(set: &[(u64, u64)], minus: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut j = 0;
    for &(mut s, e) in set {
        // (what ends before this range ends before every later one)
        while j < minus.len() && minus[j].1 <= s {
            j += 1;
        }
        for &(ms, me) in minus[j..].iter().take_while(|m| m.0 < e) {
            if ms > s {
                out.push((s, ms));
            }
            s = s.max(me);
        }
        if s < e {
            out.push((s, e));
        }
    }
    out
}

/// One process of the tree, matched with the statepoint.
#[derive(Debug)]
struct Process {
    host: i32,
    vpid: u32,
    threads: Vec<(Thread, images::Core)>,
    signals: signals::Signals,
    layout: Layout,
    /// The statepoint's private anonymous memory, for the check after.
    target_anon: Segments,
    /// vDSO, vvar, vsyscall: never written.
    special: Vec<(u64, u64)>,
    /// What goes back on its descriptors (offsets, counts, timers, masks).
    fixes: Vec<descriptors::Fix>,
    /// Limits, umask, working directory, nice values…
    attrs: attrs::Attrs,
}

/// A tree whose shape matches the statepoint's.
#[derive(Debug)]
pub struct Shape {
    images: PathBuf,
    procs: Vec<Process>,
    pids: Vec<i32>,
}

/// Compares the frozen tree of cgroup `cgroup` with the statepoint whose CRIU images are in
/// `images`. `Err(Refused)` says why a rollback in place cannot restore it.
pub fn check(images: &Path, cgroup: &Path, stdio: &[(String, String)]) -> Result<Shape> {
    let pids = cgroup_pids(cgroup);
    if pids.is_empty() {
        return refuse("no process in the container's cgroup");
    }
    let live = live_tree(&pids)?;
    let tree = images::pstree(images)?;
    let host_to_v: BTreeMap<i32, u32> = live.iter().map(|p| (p.host, p.vpid)).collect();
    let by_vpid: BTreeMap<u32, &LiveProcess> = live.iter().map(|p| (p.vpid, p)).collect();
    let then: BTreeSet<u32> = tree.iter().map(|p| p.pid).collect();
    if let Some(p) = live.iter().find(|p| !then.contains(&p.vpid)) {
        let comm = std::fs::read_to_string(format!("/proc/{}/comm", p.host)).unwrap_or_default();
        return refuse(format!("process {} ({}) started after the statepoint", p.vpid, comm.trim()));
    }
    let mut objects = descriptors::Objects::new(images, stdio)?;
    let files = images::files(images)?;
    let mut procs = Vec::new();
    for t in &tree {
        let Some(l) = by_vpid.get(&t.pid) else {
            // (a zombie is in no cgroup)
            if images::core(images, t.pid).is_ok_and(|c| c.task_state == Some(images::TASK_DEAD)) {
                return refuse(format!("process {} was a zombie at the statepoint", t.pid));
            }
            return refuse(format!("process {} of the statepoint has ended", t.pid));
        };
        let vppid = host_to_v.get(&l.host_ppid).copied().unwrap_or(0);
        if (vppid, l.pgid, l.sid) != (t.ppid, t.pgid, t.sid) {
            return refuse(format!("process {}: parent, process group or session changed", t.pid));
        }
        let now: Vec<u32> = l.threads.iter().map(|x| x.vtid).collect();
        let mut was = t.threads.clone();
        was.sort_unstable();
        if now != was {
            return refuse(format!("process {}: threads {now:?} now, {was:?} at the statepoint", t.pid));
        }
        let mut threads = Vec::new();
        for th in &l.threads {
            let c = images::core(images, th.vtid)?;
            if !c.native || c.gpregs.len() != 27 {
                return refuse(format!("thread {} is not a 64-bit task", th.vtid));
            }
            if c.task_state.is_some_and(|s| s != images::TASK_ALIVE) {
                return refuse(format!(
                    "process {} was not running at the statepoint (state {:?})",
                    t.pid, c.task_state
                ));
            }
            threads.push((*th, c));
        }
        let signals = signals::check(t.pid, l.host, &threads)?;
        let attrs = attrs::check(images, t.pid, l.host, &threads, &files)?;
        let files_id = Some(images::files_id(images, t.pid)?);
        let (layout, target_anon, special) = compare_memory(images, t.pid, l.host, &files)?;
        let fixes = match files_id {
            Some(id) => descriptors::compare(images, id, l.host, t.pid, &files, &mut objects)?,
            None => return refuse(format!("process {}: no descriptor table in the statepoint", t.pid)),
        };
        procs.push(Process { host: l.host, vpid: t.pid, threads, signals, layout, target_anon, special, fixes, attrs });
    }
    Ok(Shape { images: images.to_path_buf(), procs, pids })
}

/// A file mapping: start, end, prot, shared, file offset, file name.
type FileMap = (u64, u64, u32, bool, u64, String);

/// Adjacent mappings of the same file at consecutive offsets with the same protection, as one.
fn merge_file_maps(v: Vec<FileMap>) -> Vec<FileMap> {
    let mut out: Vec<FileMap> = Vec::new();
    for m in v {
        match out.last_mut() {
            Some(l) if l.1 == m.0 && l.2 == m.2 && l.3 == m.3 && l.5 == m.5 && l.4 + (l.1 - l.0) == m.4 => l.1 = m.1,
            _ => out.push(m),
        }
    }
    out
}

/// Whether live path `live` (as the host sees it) names the container's `name`.
fn same_file(live: &str, name: &str) -> bool {
    !live.ends_with(" (deleted)")
        && !name.is_empty()
        && (live == name || (live.ends_with(name) && name.starts_with('/')))
}

/// The heap as one range: after a restore it may be several mappings (the kernel does not merge
/// what the heap grew by with CRIU's mapping), each named `[heap]`.
fn widen(heap: Option<(u64, u64)>, part: (u64, u64)) -> (u64, u64) {
    heap.map_or(part, |h| (h.0.min(part.0), h.1.max(part.1)))
}

/// A process's memory against the statepoint's: how to put its layout back, the statepoint's
/// private anonymous memory, and its vDSO and vvar ranges.
type MemoryShape = (Layout, Segments, Vec<(u64, u64)>);

fn compare_memory(
    images: &Path,
    vpid: u32,
    host: i32,
    files: &std::collections::HashMap<u32, images::File>,
) -> Result<MemoryShape> {
    let mut mm = images::mm(images, vpid)?;
    let maps = maps_of(host)?;
    // CRIU records a grows-down mapping (the stack) with the guard page the kernel hides from
    // /proc/PID/maps in front of it.
    for v in mm.vmas.iter_mut().filter(|v| v.flags & libc::MAP_GROWSDOWN as u32 != 0) {
        if maps.iter().any(|m| m.start == v.start + PAGE_SIZE && m.end == v.end) {
            v.start += PAGE_SIZE;
        }
    }
    let known = images::VMA_AREA_REGULAR
        | images::VMA_AREA_STACK
        | images::VMA_AREA_VSYSCALL
        | images::VMA_AREA_VDSO
        | images::VMA_AREA_HEAP
        | images::VMA_FILE_PRIVATE
        | images::VMA_FILE_SHARED
        | images::VMA_ANON_PRIVATE
        | images::VMA_AREA_VVAR;
    let mut t_special = Vec::new();
    let mut t_files = Vec::new();
    let mut t_anon: Segments = Vec::new();
    let mut t_heap = None;
    let mut t_stack = None;
    for v in &mm.vmas {
        if v.status & !known != 0 || v.is(images::VMA_ANON_SHARED) {
            return refuse(format!(
                "process {vpid} had shared memory or a special mapping at {:#x} (status {:#x})",
                v.start, v.status
            ));
        }
        if v.is(images::VMA_AREA_VDSO | images::VMA_AREA_VVAR | images::VMA_AREA_VSYSCALL) {
            t_special.push((v.start, v.end));
        } else if v.is(images::VMA_FILE_PRIVATE | images::VMA_FILE_SHARED) {
            let name = match files.get(&(v.shmid as u32)) {
                Some(images::File::Regular { name, .. }) => name.clone(),
                _ => String::new(),
            };
            t_files.push((v.start, v.end, v.prot, v.is(images::VMA_FILE_SHARED), v.pgoff, name));
        } else if v.is(images::VMA_ANON_PRIVATE) {
            if v.is(images::VMA_AREA_HEAP) {
                t_heap = Some(widen(t_heap, (v.start, v.end)));
            } else if v.flags & libc::MAP_GROWSDOWN as u32 != 0 {
                // CRIU marks no stack: the grows-down mapping is "[stack]".
                t_stack = Some((v.start, v.end, v.prot));
            }
            t_anon.push((v.start, v.end, v.prot, v.flags));
        } else {
            return refuse(format!(
                "process {vpid}: mapping at {:#x} of an unknown kind (status {:#x})",
                v.start, v.status
            ));
        }
    }
    let mut l_special = Vec::new();
    let mut l_files = Vec::new();
    let mut l_anon: Segments = Vec::new();
    let mut l_heap = None;
    let mut l_stack = None;
    for m in &maps {
        if is_special(&m.path) {
            if m.path != "[vsyscall]" {
                l_special.push((m.start, m.end));
            }
        } else if is_anon_private(m) {
            match m.path.as_str() {
                "[heap]" => l_heap = Some(widen(l_heap, (m.start, m.end))),
                "[stack]" => l_stack = Some((m.start, m.end, m.prot)),
                _ => {}
            }
            l_anon.push((m.start, m.end, m.prot, 0));
        } else if m.inode != 0
            && !(m.shared
                && (m.path.starts_with("/SYSV") || m.path.starts_with("/dev/zero") || m.path.starts_with("/memfd:")))
        {
            l_files.push(m.clone());
        } else {
            return refuse(format!("process {vpid} has shared memory at {:#x} ({})", m.start, m.path));
        }
    }
    let t_special_cmp: Vec<(u64, u64)> =
        t_special.iter().copied().filter(|&(s, _)| s < 0xffff_ffff_ff00_0000).collect();
    if t_special_cmp != l_special {
        return refuse(format!("process {vpid}: the vDSO moved"));
    }
    // The same memory may be one mapping or several (a restore maps each of CRIU's VMAs,
    // the kernel merges what it can): compared merged.
    let l_files: Vec<FileMap> =
        l_files.iter().map(|l| (l.start, l.end, l.prot, l.shared, l.offset, l.path.clone())).collect();
    let (t_files, l_files) = (merge_file_maps(t_files), merge_file_maps(l_files));
    let differs =
        |t: &FileMap, l: &FileMap| (t.0, t.1, t.2, t.3, t.4) != (l.0, l.1, l.2, l.3, l.4) || !same_file(&l.5, &t.5);
    if t_files.len() != l_files.len() || t_files.iter().zip(&l_files).any(|(t, l)| differs(t, l)) {
        let first = t_files.iter().zip(&l_files).find(|(t, l)| differs(t, l));
        let at = first
            .map(|(t, l)| format!(": {:#x}-{:#x} prot {} shared {} offset {:#x} {} then, {:#x}-{:#x} prot {} shared {} offset {:#x} {} now", t.0, t.1, t.2, t.3, t.4, t.5, l.0, l.1, l.2, l.3, l.4, l.5))
            .unwrap_or_else(|| format!(": {} file mappings then, {} now", t_files.len(), l_files.len()));
        return refuse(format!("process {vpid}: its file mappings changed since the statepoint{at}"));
    }
    if t_stack != l_stack {
        return refuse(format!("process {vpid}: its stack grew or moved ({t_stack:x?} then, {l_stack:x?} now)"));
    }
    // The heap through brk; the rest of private anonymous memory mapping by mapping.
    let mut layout = Layout::default();
    if t_heap.is_some() || l_heap.is_some() {
        layout.brk = Some(mm.brk);
        let t_end = t_heap.map(|h| h.1);
        let l_end = l_heap.map(|h| h.1);
        if let (Some(le), Some(te)) = (l_end, t_end.or(Some(mm.start_brk))) {
            if le > te {
                layout.gone.push((te, le));
            }
        }
    }
    let not_heap_stack = |s: &Segments, heap: Option<(u64, u64)>, stack: Option<(u64, u64, u32)>| -> Segments {
        let in_heap = |x: &(u64, u64, u32, u32)| heap.is_some_and(|h| x.0 >= h.0 && x.1 <= h.1);
        s.iter().copied().filter(|x| !in_heap(x) && Some((x.0, x.1, x.2)) != stack).collect()
    };
    let (ta, la) = (not_heap_stack(&t_anon, t_heap, t_stack), not_heap_stack(&l_anon, l_heap, l_stack));
    let heap_range = |h: Option<(u64, u64)>| h.map(|h| vec![h]).unwrap_or_default();
    for (s, e, then, now) in overlay_segments(&ta, &la) {
        match (then, now) {
            (None, Some(_)) => layout.unmap.push((s, e)),
            // A range that is heap now and not then: brk shrinks it first.
            (Some((prot, flags)), None) if !heap_range(l_heap).iter().any(|h| s >= h.0 && e <= h.1) => {
                layout.map.push((s, e, prot, flags))
            }
            (Some((tp, _)), Some((lp, _))) if tp != lp => layout.protect.push((s, e, tp)),
            _ => {}
        }
    }
    layout.gone.extend(layout.unmap.iter().copied());
    layout.gone = merge(layout.gone);
    Ok((layout, t_anon, t_special))
}

/// What one process gets: pages written from the statepoint's images, pages dropped.
#[derive(Debug)]
struct Pages {
    write: Vec<PageRun>,
    drop: Vec<(u64, u64)>,
    /// Where the statepoint has pages: any other page present after the writes is dropped.
    had: Vec<(u64, u64)>,
}

/// The plan of a rollback in place: the shape, and the pages of each process.
#[derive(Debug)]
pub struct Plan {
    shape: Shape,
    pages: Vec<Pages>,
    pub pages_written: u64,
}

fn pages_of(runs: &[PageRun]) -> u64 {
    runs.iter().map(|r| r.nr_pages).sum()
}

fn cut(r: &PageRun, s: u64, e: u64) -> PageRun {
    PageRun {
        vaddr: s,
        nr_pages: (e - s) / PAGE_SIZE,
        file: r.file.clone(),
        loc: images::Location { offset: r.loc.offset + (s - r.vaddr), ..r.loc },
    }
}

/// The parts of `target`'s runs whose content differs from `now`'s (another image location,
/// or no page now), and the ranges `now` has pages in and `target` does not.
fn differ(target: &[PageRun], now: &[PageRun]) -> (Vec<PageRun>, Vec<(u64, u64)>) {
    let mut write = Vec::new();
    let mut j = 0;
    for t in target {
        while j < now.len() && now[j].end() <= t.vaddr {
            j += 1;
        }
        let mut at = t.vaddr;
        let mut k = j;
        while at < t.end() {
            match now.get(k) {
                Some(n) if n.vaddr < t.end() => {
                    if n.vaddr > at {
                        write.push(cut(t, at, n.vaddr));
                        at = n.vaddr;
                    }
                    let e = n.end().min(t.end());
                    let same = n.loc.dev == t.loc.dev
                        && n.loc.ino == t.loc.ino
                        && n.loc.offset as i128 - n.vaddr as i128 == t.loc.offset as i128 - t.vaddr as i128;
                    if !same {
                        write.push(cut(t, at, e));
                    }
                    at = e;
                    k += 1;
                }
                _ => {
                    write.push(cut(t, at, t.end()));
                    at = t.end();
                }
            }
        }
    }
    let had = merge(target.iter().map(|r| (r.vaddr, r.end())).collect());
    let has = merge(now.iter().map(|r| (r.vaddr, r.end())).collect());
    (write, subtract(&has, &had))
}

impl Shape {
    /// The pages to write and drop, from the statepoint's images and those of a dump of the
    /// tree as it is now (`now_images`, the safety statepoint).
    pub fn plan(self, now_images: &Path) -> Result<Plan> {
        let mut pages = Vec::new();
        let mut written = 0;
        for p in &self.procs {
            let special = merge(p.special.clone());
            let outside = |runs: Vec<PageRun>| -> Vec<PageRun> {
                runs.into_iter().filter(|r| !special.iter().any(|s| r.vaddr < s.1 && r.end() > s.0)).collect()
            };
            let target = outside(images::memory(&self.images, p.vpid)?);
            let now = outside(images::memory(now_images, p.vpid)?);
            let (write, drop) = differ(&target, &now);
            let drop = subtract(&drop, &p.layout.gone);
            written += pages_of(&write);
            let had = merge(target.iter().map(|r| (r.vaddr, r.end())).collect());
            pages.push(Pages { write, drop, had });
        }
        Ok(Plan { shape: self, pages, pages_written: written })
    }
}

/// What a rollback in place did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Applied {
    pub pages_written: u64,
    pub pages_dropped: u64,
    pub system_calls: u64,
}

impl Plan {
    /// The host PIDs the plan was made for.
    pub fn pids(&self) -> &[i32] {
        &self.shape.pids
    }

    /// Applies the plan to the tree of cgroup `freezer`, frozen on entry and on return (on
    /// success and on failure). From the first write on, a failure leaves the tree between the
    /// two states: the caller restores the safety statepoint.
    pub fn apply(&self, freezer: &super::freezer::Freezer) -> Result<Applied> {
        let mut tracees = Vec::new();
        for p in &self.shape.procs {
            for (t, _) in &p.threads {
                tracees.push(
                    ptrace::Tracee::seize(t.host)
                        .map_err(io(format!("hold thread {} of process {}", t.vtid, p.vpid)))?,
                );
            }
        }
        // Held by ptrace, the threads do not run when the cgroup thaws; they must be thawed to
        // step over a system call (CRIU does the same between its seize and its dump).
        freezer.thaw().map_err(|e| Error::Failed(format!("thaw for the system calls: {e}")))?;
        let r = self.apply_held(&tracees);
        let refrozen = freezer.freeze();
        let now = cgroup_pids(freezer.dir());
        drop(tracees);
        let applied = r?;
        refrozen.map_err(|e| Error::Failed(format!("freeze again: {e}")))?;
        if now != self.shape.pids {
            return Err(Error::Failed(format!(
                "the container's processes changed during the rollback ({:?} → {now:?})",
                self.shape.pids
            )));
        }
        Ok(applied)
    }

    fn apply_held(&self, tracees: &[ptrace::Tracee]) -> Result<Applied> {
        let mut applied = Applied::default();
        let mut ti = 0;
        signals::block_all(tracees)?;
        // Each process's main thread and vDSO `syscall`, and whether it had THP turned off.
        let mut held = Vec::new();
        for (p, pages) in self.shape.procs.iter().zip(&self.pages) {
            let main = &tracees[ti];
            crate::fault::point("rollback.in-place.memory").map_err(|e| Error::Failed(e.to_string()))?;
            let insn = ptrace::syscall_instruction(p.host).map_err(io(format!("process {}", p.vpid)))?;
            let mut sys = |name: &str, nr: libc::c_long, args: &[u64]| -> Result<i64> {
                applied.system_calls += 1;
                ptrace::call(main, insn, name, nr, args).map_err(io(format!("process {}", p.vpid)))
            };
            // No transparent huge page while the memory is put back: a page written where the
            // process has none would fault in a whole 2 MiB one, and khugepaged (which ignores
            // the freezer) collapsing a range fills its holes with pages the statepoint does not
            // have. Turned back on once the soft-dirty bits are cleared: a collapse after that
            // marks what it fills as dirty, so the next dump carries it.
            let thp_off = sys("prctl", libc::SYS_prctl, &[libc::PR_GET_THP_DISABLE as u64, 0, 0, 0, 0])? != 0;
            if !thp_off {
                sys("prctl", libc::SYS_prctl, &[libc::PR_SET_THP_DISABLE as u64, 1, 0, 0, 0])?;
            }
            held.push((ti, insn, thp_off));
            let l = &p.layout;
            if let Some(brk) = l.brk {
                let got = sys("brk", libc::SYS_brk, &[brk])?;
                if got as u64 != brk {
                    return Err(Error::Failed(format!("process {}: brk({brk:#x}) gave {got:#x}", p.vpid)));
                }
            }
            for &(s, e) in &l.unmap {
                sys("munmap", libc::SYS_munmap, &[s, e - s])?;
            }
            for &(s, e, prot, flags) in &l.map {
                let keep = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_GROWSDOWN) as u32;
                let fl = (flags & keep) | (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED) as u32;
                let got = sys("mmap", libc::SYS_mmap, &[s, e - s, u64::from(prot), u64::from(fl), u64::MAX, 0])?;
                if got as u64 != s {
                    return Err(Error::Failed(format!("process {}: mmap at {s:#x} gave {got:#x}", p.vpid)));
                }
            }
            for &(s, e, prot) in &l.protect {
                sys("mprotect", libc::SYS_mprotect, &[s, e - s, u64::from(prot)])?;
            }
            for &(s, e) in &pages.drop {
                sys("madvise", libc::SYS_madvise, &[s, e - s, libc::MADV_DONTNEED as u64])?;
            }
            applied.pages_dropped += pages.drop.iter().map(|d| (d.1 - d.0) / PAGE_SIZE).sum::<u64>();
            applied.pages_written += write_pages(p.host, &pages.write)?;
            // Pages present now that neither the statepoint nor the dump of the current state
            // had (a range khugepaged collapsed after that dump, filling its holes): left, they
            // read the same (zeros), but the process holds memory the statepoint did not.
            for (s, e) in strays(p.host, &pages.had)? {
                sys("madvise", libc::SYS_madvise, &[s, e - s, libc::MADV_DONTNEED as u64])?;
                applied.pages_dropped += (e - s) / PAGE_SIZE;
            }
            check_layout(p)?;
            let threads = p.threads.iter().enumerate().map(|(i, (th, _))| (&tracees[ti + i], th.vtid)).collect();
            let mut h = signals::Held { vpid: p.vpid, host: p.host, insn, threads, calls: &mut applied.system_calls };
            p.signals.apply(&mut h)?;
            p.attrs.apply(&mut h)?;
            ti += p.threads.len();
            descriptors::apply(p.host, p.vpid, &p.fixes)?;
        }
        crate::fault::point("rollback.in-place.registers").map_err(|e| Error::Failed(e.to_string()))?;
        for p in &self.shape.procs {
            // The next dump is incremental on the statepoint's images: what runs from here on
            // is what it dumps.
            let f = format!("/proc/{}/clear_refs", p.host);
            std::fs::write(&f, "4").map_err(io(format!("write {f}")))?;
        }
        for (p, &(t, insn, thp_off)) in self.shape.procs.iter().zip(&held) {
            if !thp_off {
                applied.system_calls += 1;
                ptrace::call(
                    &tracees[t],
                    insn,
                    "prctl",
                    libc::SYS_prctl,
                    &[libc::PR_SET_THP_DISABLE as u64, 0, 0, 0, 0],
                )
                .map_err(io(format!("process {}", p.vpid)))?;
            }
        }
        // Registers and masks last: no system call runs in a thread after them (each step
        // raises a SIGTRAP, which a statepoint's mask may block).
        let threads = self.shape.procs.iter().flat_map(|p| p.threads.iter().map(move |(th, core)| (p.vpid, th, core)));
        for (t, (vpid, th, core)) in tracees.iter().zip(threads) {
            set_thread(t, th, core).map_err(io(format!("thread {} of process {vpid}", th.vtid)))?;
        }
        Ok(applied)
    }
}

/// Writes the statepoint's pages into process `pid`; how many.
fn write_pages(pid: i32, runs: &[PageRun]) -> Result<u64> {
    let path = format!("/proc/{pid}/mem");
    let mem = std::fs::OpenOptions::new().read(true).write(true).open(&path).map_err(io(format!("open {path}")))?;
    let mut buf = vec![0u8; 4 << 20];
    let mut open: Option<(PathBuf, std::fs::File)> = None;
    let mut n = 0;
    for r in runs {
        if open.as_ref().is_none_or(|(p, _)| *p != r.file) {
            let f = std::fs::File::open(&r.file).map_err(io(format!("open {}", r.file.display())))?;
            open = Some((r.file.clone(), f));
        }
        let src = &open.as_ref().unwrap().1;
        let total = r.nr_pages * PAGE_SIZE;
        let mut done = 0;
        while done < total {
            let len = (total - done).min(buf.len() as u64) as usize;
            src.read_exact_at(&mut buf[..len], r.loc.offset + done)
                .map_err(io(format!("read {}", r.file.display())))?;
            mem.write_all_at(&buf[..len], r.vaddr + done)
                .map_err(io(format!("write process {pid}'s memory at {:#x}", r.vaddr + done)))?;
            done += len as u64;
        }
        n += r.nr_pages;
    }
    Ok(n)
}

/// The ranges of private anonymous memory of process `pid` where it has pages (present or
/// swapped out, not the zero page) outside `had` (merged, sorted).
fn strays(pid: i32, had: &[(u64, u64)]) -> Result<Vec<(u64, u64)>> {
    let zero = criu_hooks::pagemap::zero_pfn();
    let mut has = Vec::new();
    for m in maps_of(pid)?.iter().filter(|m| is_anon_private(m)) {
        has.extend(
            criu_hooks::pagemap::pages(pid, m.start, m.end, zero).map_err(io(format!("read /proc/{pid}/pagemap")))?,
        );
    }
    Ok(subtract(&merge(has), had))
}

/// After the layout was changed: the process's private anonymous memory is the statepoint's.
fn check_layout(p: &Process) -> Result<()> {
    let now: Segments =
        maps_of(p.host)?.iter().filter(|m| is_anon_private(m)).map(|m| (m.start, m.end, m.prot, 0)).collect();
    let (a, b) = (coverage(&now), coverage(&p.target_anon));
    if a != b {
        let diff: Vec<_> = a
            .iter()
            .filter(|x| !b.contains(x))
            .chain(b.iter().filter(|x| !a.contains(x)))
            .take(4)
            .map(|x| format!("{:#x}-{:#x}", x.0, x.1))
            .collect();
        return Err(Error::Failed(format!(
            "process {}: private memory differs from the statepoint's after the rollback at {}",
            p.vpid,
            diff.join(", ")
        )));
    }
    Ok(())
}

/// Registers (CRIU's, with their system-call restart already worked out: `orig_ax = -1`),
/// FPU and SSE/AVX state, blocked signals and name of one thread.
fn set_thread(t: &ptrace::Tracee, th: &Thread, core: &images::Core) -> std::io::Result<()> {
    let g = &core.gpregs;
    // SAFETY: all-zero is a valid user_regs_struct; every field is set below.
    let mut r: libc::user_regs_struct = unsafe { std::mem::zeroed() };
    let fields: [&mut u64; 27] = [
        &mut r.r15,
        &mut r.r14,
        &mut r.r13,
        &mut r.r12,
        &mut r.rbp,
        &mut r.rbx,
        &mut r.r11,
        &mut r.r10,
        &mut r.r9,
        &mut r.r8,
        &mut r.rax,
        &mut r.rcx,
        &mut r.rdx,
        &mut r.rsi,
        &mut r.rdi,
        &mut r.orig_rax,
        &mut r.rip,
        &mut r.cs,
        &mut r.eflags,
        &mut r.rsp,
        &mut r.ss,
        &mut r.fs_base,
        &mut r.gs_base,
        &mut r.ds,
        &mut r.es,
        &mut r.fs,
        &mut r.gs,
    ];
    for (slot, v) in fields.into_iter().zip(g) {
        *slot = *v;
    }
    r.orig_rax = u64::MAX;
    t.set_regs(&r)?;
    if core.fpregs.fxsave.len() == 512 {
        let mut x = t.xstate()?;
        // FXSAVE: x87, MXCSR, st0-7, xmm0-15 (bytes 416.. are reserved or the kernel's own).
        x[..416].copy_from_slice(&core.fpregs.fxsave[..416]);
        if let Some(bv) = core.fpregs.xstate_bv {
            if x.len() >= 576 + 256 && core.fpregs.ymmh.len() == 256 {
                x[576..832].copy_from_slice(&core.fpregs.ymmh);
            }
            if x.len() >= 520 {
                let live = u64::from_le_bytes(x[512..520].try_into().unwrap());
                let bv = (live & !0x7) | (bv & 0x7);
                x[512..520].copy_from_slice(&bv.to_le_bytes());
            }
        }
        t.set_xstate(&x)?;
    }
    t.set_sigmask(core.blocked)?;
    let comm_path = format!("/proc/{}/comm", th.host);
    if !core.comm.is_empty()
        && std::fs::read_to_string(&comm_path).map(|c| c.trim_end().to_string()).unwrap_or_default() != core.comm
    {
        std::fs::write(&comm_path, &core.comm)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(v: u64, n: u64, ino: u64, off: u64) -> PageRun {
        PageRun {
            vaddr: v,
            nr_pages: n,
            file: PathBuf::from(format!("p{ino}")),
            loc: images::Location { dev: 1, ino, offset: off },
        }
    }

    #[test]
    fn differ_writes_what_moved_and_drops_what_is_new() {
        let p = PAGE_SIZE;
        // Target: 4 pages from image 1; a page from image 2.
        let target = vec![run(0x10000, 4, 1, 0), run(0x20000, 1, 2, 0)];
        // Now: page 2 rewritten (image 3), page 4 gone, an extra page at 0x30000.
        let now = vec![
            run(0x10000, 1, 1, 0),
            run(0x11000, 1, 3, 0),
            run(0x12000, 1, 1, 2 * p),
            run(0x20000, 1, 2, 0),
            run(0x30000, 2, 3, p),
        ];
        let (write, drop) = differ(&target, &now);
        let w: Vec<(u64, u64, u64)> = write.iter().map(|r| (r.vaddr, r.nr_pages, r.loc.offset)).collect();
        assert_eq!(w, vec![(0x11000, 1, p), (0x13000, 1, 3 * p)]);
        assert_eq!(drop, vec![(0x30000, 0x32000)]);
        // Same content at another offset of the same image is a write too.
        let (write, _) = differ(&[run(0x10000, 1, 1, 0)], &[run(0x10000, 1, 1, p)]);
        assert_eq!(write.len(), 1);
    }

    #[test]
    fn ranges_subtract_and_merge() {
        assert_eq!(subtract(&[(0, 100)], &[(10, 20), (50, 60)]), vec![(0, 10), (20, 50), (60, 100)]);
        assert_eq!(subtract(&[(0, 100)], &[(0, 100)]), vec![]);
        // Against the same done page by page, for ranges of every relative position.
        let mut seed = 7u64;
        let mut rnd = |n: u64| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        for _ in 0..500 {
            let mut ranges = |k: u64| {
                merge(
                    (0..rnd(k))
                        .map(|_| {
                            let s = rnd(60);
                            (s, s + 1 + rnd(8))
                        })
                        .collect(),
                )
            };
            let (a, b) = (ranges(8), ranges(8));
            let pages = |v: &[(u64, u64)]| v.iter().flat_map(|r| r.0..r.1).collect::<BTreeSet<u64>>();
            let want: BTreeSet<u64> = pages(&a).difference(&pages(&b)).copied().collect();
            let got = subtract(&a, &b);
            assert_eq!(pages(&got), want, "{a:?} - {b:?} = {got:?}");
            assert!(got.windows(2).all(|w| w[0].1 <= w[1].0) && got.iter().all(|r| r.0 < r.1), "{got:?}");
        }
        assert_eq!(merge(vec![(5, 10), (0, 5), (20, 30)]), vec![(0, 10), (20, 30)]);
    }

    #[test]
    fn segments_tell_what_to_map_unmap_and_protect() {
        let then: Segments = vec![(0x1000, 0x3000, 3, 0x22), (0x5000, 0x6000, 1, 0x22)];
        let now: Segments = vec![(0x1000, 0x2000, 3, 0), (0x2000, 0x4000, 3, 0), (0x5000, 0x6000, 3, 0)];
        let segs = overlay_segments(&then, &now);
        assert_eq!(
            segs,
            vec![
                (0x1000, 0x3000, Some((3, 0x22)), Some((3, 0))),
                (0x3000, 0x4000, None, Some((3, 0))),
                (0x5000, 0x6000, Some((1, 0x22)), Some((3, 0))),
            ]
        );
        assert_eq!(coverage(&now), vec![(0x1000, 0x4000, 3), (0x5000, 0x6000, 3)]);
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
        assert!(is_anon_private(&m[0]) && !is_anon_private(&m[1]) && is_anon_private(&m[2]) && !is_anon_private(&m[3]));
        assert_eq!((m[1].prot, m[1].offset, m[1].path.as_str()), (PROT_READ | PROT_EXEC, 0x2000, "/usr/lib/libc.so.6"));
        assert!(same_file("/var/lib/containers/storage/overlay/x/merged/usr/lib/libc.so.6", "/usr/lib/libc.so.6"));
        assert!(!same_file("/tmp/x (deleted)", "/tmp/x"));
        assert_eq!(status_field("NSpid:\t4242\t7\nPPid:\t1\n", "NSpid").as_deref(), Some("7"));
    }
}

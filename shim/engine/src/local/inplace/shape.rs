//! The shape check: the frozen tree against the statepoint's images (processes and threads,
//! memory layout, descriptors, signals, attributes). Every difference it cannot put back is a
//! refusal, before anything changed.

use super::pages::merge;
use super::{attrs, cgroup_pids, descriptors, refuse, signals, Error, Result, Thread};
use criu_hooks::images::{self, PAGE_SIZE};
use nix::libc;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use sys::proc::{MapLine, Proc, Status};

#[derive(Debug)]
struct LiveProcess {
    host: i32,
    vpid: u32,
    host_ppid: i32,
    pgid: u32,
    sid: u32,
    threads: Vec<Thread>,
}

/// Refuses a thread that is a zombie, stopped, traced or being killed.
fn check_live_thread(status: &Status, what: &str) -> Result<()> {
    let state = status.state();
    if matches!(state, 'Z' | 'X' | 'T' | 't') {
        return refuse(format!(
            "{what} is {}",
            match state {
                'Z' | 'X' => "a zombie",
                _ => "stopped or traced",
            }
        ));
    }
    if status.field("TracerPid").is_some_and(|t| t != "0") {
        return refuse(format!("{what} is traced by another process"));
    }
    // A stop, continue, kill or trap signal pending now: rt_sigtimedwait cannot take a stop or
    // a kill, and a step over a system call would be taken for the trap.
    let state_signals = signals::STATE_SIGNALS.iter().fold(0u64, |m, s| m | 1 << (s - 1));
    for key in ["SigPnd", "ShdPnd"] {
        let pending = status.field(key).map(|v| u64::from_str_radix(&v, 16).unwrap_or(u64::MAX));
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

/// The processes of the cgroup; those of the statepoint (`then`, their PIDs in the container)
/// checked: what it does not have is ended whatever its state. A process's PID is the one in
/// the container's PID namespace (init's, the outermost of the cgroup's), not in one nested in
/// it, where PIDs start again at 1.
fn live_tree(pids: &[i32], then: &BTreeSet<u32>) -> Result<Vec<LiveProcess>> {
    let statuses = pids.iter().map(|&pid| Ok((pid, Proc::of(pid).status()?))).collect::<Result<Vec<_>>>()?;
    let level = statuses.iter().map(|(_, st)| st.ns_pids().len()).min().unwrap_or(0);
    let mut out = Vec::new();
    for (pid, st) in statuses {
        let num = |k: &str| st.number(k);
        let ns = st.ns_pids();
        let vpid = level
            .checked_sub(1)
            .and_then(|l| ns.get(l).copied())
            .ok_or_else(|| Error::Failed(format!("process {pid}: no NSpid")))?;
        if then.contains(&vpid) && ns.len() > level {
            return refuse(format!("process {vpid} is in a PID namespace of its own"));
        }
        if !then.contains(&vpid) {
            // (one traced by another would be that one's to wait for: its tracer's state changes)
            if st.field("TracerPid").is_some_and(|t| t != "0") {
                return refuse(format!("process {vpid}, which the statepoint does not have, is traced"));
            }
            out.push(LiveProcess { host: pid, vpid, host_ppid: 0, pgid: 0, sid: 0, threads: Vec::new() });
            continue;
        }
        check_live_thread(&st, &format!("process {vpid}"))?;
        let mut threads = Vec::new();
        for tid in Proc::of(pid).threads()? {
            let ts = Proc::of(pid).task(tid).status()?;
            let vtid = ts
                .field("NSpid")
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
pub(super) struct Layout {
    /// `brk(this)`, when the statepoint or the process has a heap.
    pub(super) brk: Option<u64>,
    pub(super) unmap: Vec<(u64, u64)>,
    /// start, end, prot, mmap flags.
    pub(super) map: Vec<(u64, u64, u32, u32)>,
    pub(super) protect: Vec<(u64, u64, u32)>,
    /// Ranges that stop existing (unmapped, or the heap's shrunk tail): no page is dropped there.
    pub(super) gone: Vec<(u64, u64)>,
}

/// Private anonymous coverage as (start, end, prot, flags) segments.
pub(super) type Segments = Vec<(u64, u64, u32, u32)>;

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

/// One process of the tree, matched with the statepoint.
#[derive(Debug)]
pub(super) struct Process {
    pub(super) host: i32,
    pub(super) vpid: u32,
    pub(super) threads: Vec<(Thread, images::Core)>,
    pub(super) signals: signals::Signals,
    pub(super) layout: Layout,
    /// The statepoint's private anonymous memory, for the check after.
    pub(super) target_anon: Segments,
    /// vDSO, vvar, vsyscall: never written.
    pub(super) special: Vec<(u64, u64)>,
    /// What goes back on its descriptors (offsets, counts, timers, masks).
    pub(super) fixes: Vec<descriptors::Fix>,
    /// Limits, umask, working directory, nice values…
    pub(super) attrs: attrs::Attrs,
}

/// A process of the container the statepoint does not have — started since, or one it could not
/// hold (an exec's command outside the tree): the rollback ends it ([`super::Plan::apply`]), as a
/// restore of the statepoint would not have it.
#[derive(Debug)]
pub(super) struct Later {
    pub(super) host: i32,
    pub(super) vpid: u32,
    /// Its start time (clock ticks since boot): the same process when it is ended.
    pub(super) start: u64,
    pub(super) comm: String,
}

/// A tree whose shape matches the statepoint's, but for processes the statepoint does not have.
#[derive(Debug)]
pub struct Shape {
    pub(super) images: PathBuf,
    pub(super) procs: Vec<Process>,
    /// The statepoint's processes (host PIDs, in order): the container's after the rollback.
    pub(super) pids: Vec<i32>,
    pub(super) later: Vec<Later>,
}

/// Compares the frozen tree of cgroup `cgroup` with the statepoint whose CRIU images are in
/// `images`. `Err(Refused)` says why a rollback in place cannot restore it.
pub fn check(images: &Path, cgroup: &Path, stdio: &[(String, String)]) -> Result<Shape> {
    let pids = cgroup_pids(cgroup);
    if pids.is_empty() {
        return refuse("no process in the container's cgroup");
    }
    let tree = images::pstree(images)?;
    let then: BTreeSet<u32> = tree.iter().map(|p| p.pid).collect();
    let live = live_tree(&pids, &then)?;
    let host_to_v: BTreeMap<i32, u32> = live.iter().map(|p| (p.host, p.vpid)).collect();
    let by_vpid: BTreeMap<u32, &LiveProcess> = live.iter().map(|p| (p.vpid, p)).collect();
    // (what the statepoint does not have is ended once the rollback goes forward; its parent,
    // one of the statepoint's processes or conmon, finds it ended)
    let mut later = Vec::new();
    for p in live.iter().filter(|p| !then.contains(&p.vpid)) {
        let comm = Proc::of(p.host).read("comm").unwrap_or_default().trim().to_string();
        let start = Proc::of(p.host)
            .state_and_start()
            .ok_or_else(|| Error::Failed(format!("process {} ({comm}): no start time", p.vpid)))?
            .1;
        later.push(Later { host: p.host, vpid: p.vpid, start, comm });
    }
    let pids: Vec<i32> = pids.into_iter().filter(|h| !later.iter().any(|l| l.host == *h)).collect();
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
    Ok(Shape { images: images.to_path_buf(), procs, pids, later })
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
pub(super) fn same_file(live: &str, name: &str) -> bool {
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
    let maps = Proc::of(host).maps()?;
    // CRIU records a grows-down mapping (the stack) with the guard page the kernel hides from
    // /proc/PID/maps in front of it.
    for v in mm.vmas.iter_mut().filter(|v| v.flags & libc::MAP_GROWSDOWN as u32 != 0) {
        if maps.iter().any(|m| m.start == v.start + PAGE_SIZE && m.end == v.end) {
            v.start += PAGE_SIZE;
        }
    }
    let then = Mappings::of_statepoint(&mm, files, vpid)?;
    let now = Mappings::of_live(&maps, vpid)?;
    same_fixed_mappings(&then, &now, vpid)?;
    let layout = Layout::between(&then, &now, &mm);
    Ok((layout, then.anon, then.special))
}

/// A process's mappings by kind: vDSO and friends, files, private anonymous memory (the heap
/// and the stack among it).
#[derive(Default)]
struct Mappings {
    special: Vec<(u64, u64)>,
    files: Vec<FileMap>,
    anon: Segments,
    heap: Option<(u64, u64)>,
    stack: Option<(u64, u64, u32)>,
}

impl Mappings {
    /// The statepoint's, from its `mm` image; shared anonymous memory or an unknown kind refuses.
    fn of_statepoint(mm: &images::Mm, files: &std::collections::HashMap<u32, images::File>, vpid: u32) -> Result<Self> {
        let known = images::VMA_AREA_REGULAR
            | images::VMA_AREA_STACK
            | images::VMA_AREA_VSYSCALL
            | images::VMA_AREA_VDSO
            | images::VMA_AREA_HEAP
            | images::VMA_FILE_PRIVATE
            | images::VMA_FILE_SHARED
            | images::VMA_ANON_PRIVATE
            | images::VMA_AREA_VVAR;
        let mut t = Mappings::default();
        for v in &mm.vmas {
            if v.status & !known != 0 || v.is(images::VMA_ANON_SHARED) {
                return refuse(format!(
                    "process {vpid} had shared memory or a special mapping at {:#x} (status {:#x})",
                    v.start, v.status
                ));
            }
            if v.is(images::VMA_AREA_VDSO | images::VMA_AREA_VVAR | images::VMA_AREA_VSYSCALL) {
                t.special.push((v.start, v.end));
            } else if v.is(images::VMA_FILE_PRIVATE | images::VMA_FILE_SHARED) {
                let name = match files.get(&(v.shmid as u32)) {
                    Some(images::File::Regular { name, .. }) => name.clone(),
                    _ => String::new(),
                };
                t.files.push((v.start, v.end, v.prot, v.is(images::VMA_FILE_SHARED), v.pgoff, name));
            } else if v.is(images::VMA_ANON_PRIVATE) {
                if v.is(images::VMA_AREA_HEAP) {
                    t.heap = Some(widen(t.heap, (v.start, v.end)));
                } else if v.flags & libc::MAP_GROWSDOWN as u32 != 0 {
                    // CRIU marks no stack: the grows-down mapping is "[stack]".
                    t.stack = Some((v.start, v.end, v.prot));
                }
                t.anon.push((v.start, v.end, v.prot, v.flags));
            } else {
                return refuse(format!(
                    "process {vpid}: mapping at {:#x} of an unknown kind (status {:#x})",
                    v.start, v.status
                ));
            }
        }
        t.files = merge_file_maps(t.files);
        Ok(t)
    }

    /// The live process's, from `/proc/PID/maps`; shared memory refuses.
    fn of_live(maps: &[MapLine], vpid: u32) -> Result<Self> {
        let mut l = Mappings::default();
        for m in maps {
            if m.is_special() {
                if m.path != "[vsyscall]" {
                    l.special.push((m.start, m.end));
                }
            } else if m.is_anon_private() {
                match m.path.as_str() {
                    "[heap]" => l.heap = Some(widen(l.heap, (m.start, m.end))),
                    "[stack]" => l.stack = Some((m.start, m.end, m.prot)),
                    _ => {}
                }
                l.anon.push((m.start, m.end, m.prot, 0));
            } else if m.inode != 0
                && !(m.shared
                    && (m.path.starts_with("/SYSV")
                        || m.path.starts_with("/dev/zero")
                        || m.path.starts_with("/memfd:")))
            {
                l.files.push((m.start, m.end, m.prot, m.shared, m.offset, m.path.clone()));
            } else {
                return refuse(format!("process {vpid} has shared memory at {:#x} ({})", m.start, m.path));
            }
        }
        // The same memory may be one mapping or several (a restore maps each of CRIU's VMAs,
        // the kernel merges what it can): compared merged.
        l.files = merge_file_maps(l.files);
        Ok(l)
    }
}

/// What a rollback in place cannot move refuses when it moved: the vDSO, the file mappings, the
/// stack.
fn same_fixed_mappings(then: &Mappings, now: &Mappings, vpid: u32) -> Result<()> {
    let t_special: Vec<(u64, u64)> = then.special.iter().copied().filter(|&(s, _)| s < 0xffff_ffff_ff00_0000).collect();
    if t_special != now.special {
        return refuse(format!("process {vpid}: the vDSO moved"));
    }
    let (t_files, l_files) = (&then.files, &now.files);
    let differs =
        |t: &FileMap, l: &FileMap| (t.0, t.1, t.2, t.3, t.4) != (l.0, l.1, l.2, l.3, l.4) || !same_file(&l.5, &t.5);
    if t_files.len() != l_files.len() || t_files.iter().zip(l_files).any(|(t, l)| differs(t, l)) {
        let first = t_files.iter().zip(l_files).find(|(t, l)| differs(t, l));
        let at = first
            .map(|(t, l)| format!(": {:#x}-{:#x} prot {} shared {} offset {:#x} {} then, {:#x}-{:#x} prot {} shared {} offset {:#x} {} now", t.0, t.1, t.2, t.3, t.4, t.5, l.0, l.1, l.2, l.3, l.4, l.5))
            .unwrap_or_else(|| format!(": {} file mappings then, {} now", t_files.len(), l_files.len()));
        return refuse(format!("process {vpid}: its file mappings changed since the statepoint{at}"));
    }
    if then.stack != now.stack {
        return refuse(format!(
            "process {vpid}: its stack grew or moved ({:x?} then, {:x?} now)",
            then.stack, now.stack
        ));
    }
    Ok(())
}

impl Layout {
    /// How to go from the live private anonymous memory to the statepoint's: the heap through
    /// `brk`, the rest mapping by mapping.
    fn between(then: &Mappings, now: &Mappings, mm: &images::Mm) -> Layout {
        let mut layout = Layout::default();
        if then.heap.is_some() || now.heap.is_some() {
            layout.brk = Some(mm.brk);
            let t_end = then.heap.map(|h| h.1);
            let l_end = now.heap.map(|h| h.1);
            if let (Some(le), Some(te)) = (l_end, t_end.or(Some(mm.start_brk))) {
                if le > te {
                    layout.gone.push((te, le));
                }
            }
        }
        let not_heap_stack = |m: &Mappings| -> Segments {
            let in_heap = |x: &(u64, u64, u32, u32)| m.heap.is_some_and(|h| x.0 >= h.0 && x.1 <= h.1);
            m.anon.iter().copied().filter(|x| !in_heap(x) && Some((x.0, x.1, x.2)) != m.stack).collect()
        };
        let heap_now = now.heap.map(|h| vec![h]).unwrap_or_default();
        for (s, e, then, now) in overlay_segments(&not_heap_stack(then), &not_heap_stack(now)) {
            match (then, now) {
                (None, Some(_)) => layout.unmap.push((s, e)),
                // A range that is heap now and not then: brk shrinks it first.
                (Some((prot, flags)), None) if !heap_now.iter().any(|h| s >= h.0 && e <= h.1) => {
                    layout.map.push((s, e, prot, flags))
                }
                (Some((tp, _)), Some((lp, _))) if tp != lp => layout.protect.push((s, e, tp)),
                _ => {}
            }
        }
        layout.gone.extend(layout.unmap.iter().copied());
        layout.gone = merge(layout.gone);
        layout
    }
}

/// Coverage by page protection only, adjacent equal ranges merged (VMAs split or merge
/// differently for the same memory).
pub(super) fn coverage(s: &Segments) -> Vec<(u64, u64, u32)> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
    fn live_paths_name_the_containers_files() {
        assert!(same_file("/var/lib/containers/storage/overlay/x/merged/usr/lib/libc.so.6", "/usr/lib/libc.so.6"));
        assert!(!same_file("/tmp/x (deleted)", "/tmp/x"));
    }
}

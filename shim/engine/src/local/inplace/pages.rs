//! The pages of a rollback in place: which of the statepoint's pages differ from the current
//! state's, which the process has that the statepoint has not, and writing them
//! (`process_vm_writev`, or `/proc/PID/mem` where that cannot).
//!
//! The current state is read where CRIU's next incremental dump would read it, without a dump:
//! each process's page map. A page it has (present or swapped out, not the zero page, not a
//! file's page a private mapping never copied) is the base dump's — the images that dump would
//! build on ([`crate::chain`]) — unless it is soft-dirty: written since the base's bits were
//! cleared, or in a mapping made since. A process the base does not hold, or one that started
//! after the base was taken (its PID reused), has every page new. So a page is left alone only
//! when the base's image location of it is the statepoint's: the same test CRIU's incremental
//! dump relies on to leave it out.

use super::shape::Shape;
use super::{io, Error, Result};
use crate::local::lazy::server::DumpFiles;
use criu_hooks::images::{self, PageRun, PAGE_SIZE};
use nix::errno::Errno;
use nix::libc;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use sys::proc::pagemap::{PRESENT, SOFT_DIRTY, SWAPPED};
use sys::proc::Proc;

/// A pagemap entry's frame number, and its "file page or shared" bit (a page of a private file
/// mapping not yet copied on write: the file's, which CRIU does not dump).
const PFN: u64 = (1 << 55) - 1;
const FILE_PAGE: u64 = 1 << 61;

pub(super) fn merge(mut v: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
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
pub(super) fn subtract(set: &[(u64, u64)], minus: &[(u64, u64)]) -> Vec<(u64, u64)> {
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

/// What one process gets: pages written from the statepoint's images, pages dropped.
#[derive(Debug)]
pub(super) struct Pages {
    pub(super) write: Vec<PageRun>,
    pub(super) drop: Vec<(u64, u64)>,
    /// Where the statepoint has pages: any other page present after the writes is dropped.
    pub(super) had: Vec<(u64, u64)>,
    /// The pages the process has now whose content lies in the base's images (not written
    /// since its dump): where, by address, in order.
    pub(super) clean: Vec<PageRun>,
}

/// The plan of a rollback in place: the shape, and the pages of each process.
#[derive(Debug)]
pub struct Plan {
    pub(super) shape: Shape,
    pub(super) pages: Vec<Pages>,
    pub pages_written: u64,
    /// Of those, written ahead ([`super::ahead`]): taken out of each process's `write`.
    pub pages_ahead: u64,
}

fn pages_of(runs: &[PageRun]) -> u64 {
    runs.iter().map(|r| r.nr_pages).sum()
}

pub(super) fn cut(r: &PageRun, s: u64, e: u64) -> PageRun {
    PageRun {
        vaddr: s,
        nr_pages: (e - s) / PAGE_SIZE,
        file: r.file.clone(),
        loc: images::Location { offset: r.loc.offset + (s - r.vaddr), ..r.loc },
        lazy: r.lazy,
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
    /// The pages to write and drop, from the statepoint's images and each process's page map
    /// against `base`, the images the next dump would build on (none: every page is new).
    pub fn plan(self, base: Option<&Path>) -> Result<Plan> {
        let uptime = base.and_then(base_uptime);
        let mut pages = Vec::new();
        let mut written = 0;
        for p in &self.procs {
            let special = merge(p.special.clone());
            let outside = |runs: Vec<PageRun>| -> Vec<PageRun> {
                runs.into_iter().filter(|r| !special.iter().any(|s| r.vaddr < s.1 && r.end() > s.0)).collect()
            };
            let target = outside(images::memory(&self.images, p.vpid)?);
            // (a base that cannot be read makes every page new: more written, nothing wrong)
            let from_base = match (base, uptime) {
                (Some(b), Some(up)) if started_before(p.host, up) => images::memory(b, p.vpid).unwrap_or_default(),
                _ => Vec::new(),
            };
            let (clean, dirty) = live_pages(p.host)?;
            let now = outside(now_runs(&clean, &dirty, &from_base));
            let (write, drop) = differ(&target, &now);
            let clean = now.into_iter().filter(|r| r.loc.dev != u64::MAX).collect();
            let drop = subtract(&drop, &p.layout.gone);
            written += pages_of(&write);
            let had = merge(target.iter().map(|r| (r.vaddr, r.end())).collect());
            pages.push(Pages { write, drop, had, clean });
        }
        Ok(Plan { shape: self, pages, pages_written: written, pages_ahead: 0 })
    }
}

/// Address ranges, `[start, end)`, in order.
type Ranges = Vec<(u64, u64)>;

/// When the dump in `base` was taken (`dump_uptime` of its inventory, µs since boot).
fn base_uptime(base: &Path) -> Option<u64> {
    criu_hooks::dump_uptime(&std::fs::read(base.join("inventory.img")).ok()?).ok().flatten()
}

/// Whether process `pid` started before the clock tick a dump taken `uptime` µs after boot
/// fell in: as CRIU tells a PID reused since its parent dump (`detect_pid_reuse`), in ticks.
fn started_before(pid: i32, uptime: u64) -> bool {
    let Some(clk) = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK).ok().flatten().filter(|c| *c > 0) else {
        return false;
    };
    sys::proc::start_time(pid).is_some_and(|start| start < uptime / (1_000_000 / clk as u64).max(1))
}

/// The pages process `pid` has where a dump takes pages (its private mappings, the vDSO and
/// its kin aside): those not written since the soft-dirty bits were cleared, and those written
/// (ranges, in order).
fn live_pages(pid: i32) -> Result<(Ranges, Ranges)> {
    let zero = sys::proc::pagemap::zero_pfn();
    let pagemap =
        std::fs::File::open(format!("/proc/{pid}/pagemap")).map_err(io(format!("open /proc/{pid}/pagemap")))?;
    let (mut clean, mut dirty): (Ranges, Ranges) = (Vec::new(), Vec::new());
    let add = |v: &mut Vec<(u64, u64)>, a: u64| match v.last_mut() {
        Some(l) if l.1 == a => l.1 += PAGE_SIZE,
        _ => v.push((a, a + PAGE_SIZE)),
    };
    // (read page by page, not asked of `PAGEMAP_SCAN`: before a fix of June 2025 that ioctl
    // calls the huge zero page an anonymous page of its own, which here would be taken for the
    // base's content where the statepoint's should be written; the page map calls it a file's)
    for m in Proc::of(pid).maps()?.iter().filter(|m| !m.shared && !m.is_special()) {
        let _ = sys::proc::pagemap::scan(&pagemap, m.start, m.end, |a, e| {
            let has = e & SWAPPED != 0 || (e & PRESENT != 0 && e & FILE_PAGE == 0 && zero != Some(e & PFN));
            if has {
                add(if e & SOFT_DIRTY != 0 { &mut dirty } else { &mut clean }, a);
            }
            std::ops::ControlFlow::Continue(())
        })
        .map_err(io(format!("read /proc/{pid}/pagemap")))?;
    }
    Ok((clean, dirty))
}

/// Where the content of each page a process has lies now: a `clean` page where the base's
/// runs (`base`, sorted) have it, when they do; a `dirty` one, or a clean one the base lacks,
/// nowhere any image is (it differs from every statepoint).
fn now_runs(clean: &[(u64, u64)], dirty: &[(u64, u64)], base: &[PageRun]) -> Vec<PageRun> {
    let new = |s: u64, e: u64| PageRun {
        vaddr: s,
        nr_pages: (e - s) / PAGE_SIZE,
        file: PathBuf::new(),
        loc: images::Location { dev: u64::MAX, ino: u64::MAX, offset: s },
        lazy: false,
    };
    let mut out: Vec<PageRun> = dirty.iter().map(|&(s, e)| new(s, e)).collect();
    let mut j = 0;
    for &(s, e) in clean {
        while j < base.len() && base[j].end() <= s {
            j += 1;
        }
        let mut at = s;
        for b in base[j..].iter().take_while(|b| b.vaddr < e) {
            if b.vaddr > at {
                out.push(new(at, b.vaddr));
            }
            let (from, to) = (b.vaddr.max(at), b.end().min(e));
            if from < to {
                out.push(cut(b, from, to));
                at = to;
            }
        }
        if at < e {
            out.push(new(at, e));
        }
    }
    out.sort_by_key(|r| r.vaddr);
    out
}

/// Writes the statepoint's pages into process `pid`; how many, and how many runs went the slow
/// way. From the images' mappings, up to `UIO_MAXIOV` runs a system call (`process_vm_writev`):
/// through `/proc/PID/mem`, a run at a time read into a buffer first, an agent's scattered pages
/// cost two system calls each, most of a rollback's memory step under emulation. What that call
/// does not write goes through `/proc/PID/mem`: a run in memory the process may not write (the
/// kernel forces a write there), and everything left once the call fails otherwise, or once an
/// image turns out not to read through its mapping.
pub(super) fn write_pages(pid: i32, runs: &[PageRun]) -> Result<Written> {
    let mut files = DumpFiles::default();
    let mut slow = Slow { pid, mem: None, buf: Vec::new(), runs: 0 };
    // (each run with where its content is mapped; those that do not map written at once)
    let mut mapped: Vec<(&PageRun, u64)> = Vec::with_capacity(runs.len());
    for r in runs {
        match files.mapped(std::slice::from_ref(r), r.vaddr, run_len(r)) {
            Ok(Some(src)) => mapped.push((r, src)),
            _ => slow.write(&mut files, r, 0)?,
        }
    }
    // The next byte to write: run `k`, `off` bytes into it.
    let (mut k, mut off) = (0, 0);
    let mut local: Vec<libc::iovec> = Vec::with_capacity(UIO_MAXIOV);
    let mut remote: Vec<libc::iovec> = Vec::with_capacity(UIO_MAXIOV);
    while k < mapped.len() {
        local.clear();
        remote.clear();
        let mut total = 0;
        for (i, &(r, src)) in mapped[k..].iter().enumerate().take(UIO_MAXIOV) {
            let skip = if i == 0 { off } else { 0 };
            let len = (run_len(r) - skip).min(CALL_MAX - total);
            local.push(libc::iovec { iov_base: (src as usize + skip) as *mut libc::c_void, iov_len: len });
            remote.push(libc::iovec { iov_base: (r.vaddr as usize + skip) as *mut libc::c_void, iov_len: len });
            total += len;
            if total == CALL_MAX {
                break;
            }
        }
        // SAFETY: the local ranges lie inside the images' mappings (checked by `mapped`), which
        // live as long as `files`, and are only read; the remote ones are the other process's,
        // which the kernel checks; both arrays hold `local.len()` entries.
        let n = unsafe {
            libc::process_vm_writev(
                pid,
                local.as_ptr(),
                local.len() as libc::c_ulong,
                remote.as_ptr(),
                remote.len() as libc::c_ulong,
                0,
            )
        };
        let written = if n < 0 {
            match Errno::last() {
                Errno::EFAULT => 0,
                Errno::ESRCH => {
                    return Err(Error::Io {
                        what: format!("write process {pid}'s memory"),
                        source: Errno::ESRCH.into(),
                    })
                }
                // (refused, as a filter of system calls may, or short of memory: the rest the old
                // way, below)
                _ => break,
            }
        } else {
            // (whole pages: a page the call wrote in part is written again)
            n as usize / PAGE_SIZE as usize * PAGE_SIZE as usize
        };
        if written == 0 {
            // Nothing written at run `k`: memory the process may not write, or our side.
            let (r, _) = mapped[k];
            let at = r.vaddr + off as u64;
            slow.write(&mut files, r, off)?;
            (k, off) = (k + 1, 0);
            if writable(pid, at) {
                // (the process may write there: the image's mapping did not read, so no other
                // will: the rest the old way, below)
                break;
            }
            continue;
        }
        let mut left = written;
        while left > 0 {
            let rest = run_len(mapped[k].0) - off;
            if left < rest {
                off += left;
                left = 0;
            } else {
                left -= rest;
                (k, off) = (k + 1, 0);
            }
        }
    }
    // What the loop left when it gave up on `process_vm_writev` (nothing once it got through).
    for (i, &(r, _)) in mapped.iter().enumerate().skip(k) {
        slow.write(&mut files, r, if i == k { off } else { 0 })?;
    }
    Ok(Written { pages: runs.iter().map(|r| r.nr_pages).sum(), slow_runs: slow.runs })
}

/// What [`write_pages`] wrote: pages, and the runs written through `/proc/PID/mem`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Written {
    pub pages: u64,
    pub slow_runs: usize,
}

/// The kernel's most iovecs a call (`UIO_MAXIOV`).
const UIO_MAXIOV: usize = 1024;
/// The most bytes one call is given: the kernel cuts a call at `MAX_RW_COUNT` (just under
/// 2 GiB) without a fault. (16 pages in the unit tests, so that their runs are cut too.)
const CALL_MAX: usize = if cfg!(test) { 16 * PAGE_SIZE as usize } else { 1 << 30 };

fn run_len(r: &PageRun) -> usize {
    (r.nr_pages * PAGE_SIZE) as usize
}

/// Whether process `pid` may write at `addr` (a writable mapping holds it).
fn writable(pid: i32, addr: u64) -> bool {
    Proc::of(pid)
        .maps()
        .is_ok_and(|maps| maps.iter().any(|m| m.start <= addr && addr < m.end && m.prot & libc::PROT_WRITE as u32 != 0))
}

/// Runs written through `/proc/PID/mem`, read from the images into a buffer.
struct Slow {
    pid: i32,
    mem: Option<std::fs::File>,
    buf: Vec<u8>,
    runs: usize,
}

impl Slow {
    /// Writes run `r` from `from` bytes into it on.
    fn write(&mut self, files: &mut DumpFiles, r: &PageRun, from: usize) -> Result<()> {
        let pid = self.pid;
        if self.mem.is_none() {
            self.mem = Some(Proc::of(pid).open_mem_rw()?);
        }
        let mem = self.mem.as_ref().expect("opened");
        if self.buf.is_empty() {
            self.buf = vec![0u8; 4 << 20];
        }
        let total = r.nr_pages * PAGE_SIZE;
        let mut done = from as u64;
        while done < total {
            let len = (total - done).min(self.buf.len() as u64) as usize;
            let at = r.vaddr + done;
            let read = files
                .read(std::slice::from_ref(r), at, &mut self.buf[..len])
                .map_err(|e| Error::Failed(e.to_string()))?;
            if !read {
                return Err(Error::Failed(format!("no image holds the page at {at:#x} of process {pid}")));
            }
            mem.write_all_at(&self.buf[..len], at).map_err(io(format!("write process {pid}'s memory at {at:#x}")))?;
            done += len as u64;
        }
        self.runs += 1;
        Ok(())
    }
}

/// The ranges of private anonymous memory of process `pid` where it has pages (present or
/// swapped out, not the zero page) outside `had` (merged, sorted).
pub(super) fn strays(pid: i32, had: &[(u64, u64)]) -> Result<Vec<(u64, u64)>> {
    let zero = sys::proc::pagemap::zero_pfn();
    let mut has = Vec::new();
    for m in Proc::of(pid).maps()?.iter().filter(|m| m.is_anon_private()) {
        has.extend(
            sys::proc::pagemap::pages(pid, m.start, m.end, zero).map_err(io(format!("read /proc/{pid}/pagemap")))?,
        );
    }
    Ok(subtract(&merge(has), had))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn run(v: u64, n: u64, ino: u64, off: u64) -> PageRun {
        PageRun {
            vaddr: v,
            nr_pages: n,
            file: PathBuf::from(format!("p{ino}")),
            loc: images::Location { dev: 1, ino, offset: off },
            lazy: false,
        }
    }

    /// Pages written into this very process: 1,500 one-page runs into writable memory (more
    /// than one call takes), a run of three into read-only memory between them (the call stops
    /// there; `/proc/PID/mem` writes it), a run of 40 (cut across calls), and each page exactly
    /// the image's.
    #[test]
    fn pages_are_written_in_batches_and_where_the_process_may_not_write() {
        let p = PAGE_SIZE as usize;
        let n = 1500;
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("pages-1.img");
        let content: Vec<u8> = (0..(n + 43) * p).map(|i| (i / p * 7 + i % 251) as u8).collect();
        std::fs::write(&image, &content).unwrap();
        let map = |len: usize| {
            // SAFETY: a new anonymous mapping, ours (leaked: the test's process ends).
            let a = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            assert_ne!(a, libc::MAP_FAILED);
            a as u64
        };
        let rw = map(2 * n * p);
        let ro = map(3 * p);
        // (present, then read-only: the kernel writes it only when forced)
        // SAFETY: the mapping just made, 3 pages.
        unsafe {
            std::ptr::write_bytes(ro as *mut u8, 0, 3 * p);
            assert_eq!(libc::mprotect(ro as *mut libc::c_void, 3 * p, libc::PROT_READ), 0);
        }
        let at =
            |v: u64, pages: usize, off: usize| PageRun { file: image.clone(), ..run(v, pages as u64, 1, off as u64) };
        // every other page of `rw`, the read-only run in the middle
        let mut runs: Vec<PageRun> = (0..n).map(|i| at(rw + (2 * i * p) as u64, 1, i * p)).collect();
        runs.insert(700, at(ro, 3, n * p));
        let long = map(40 * p);
        runs.insert(1000, at(long, 40, (n + 3) * p));
        let me = std::process::id() as i32;
        // (the read-only run alone the slow way)
        assert_eq!(write_pages(me, &runs).unwrap(), Written { pages: n as u64 + 43, slow_runs: 1 });
        for r in &runs {
            let len = r.nr_pages as usize * p;
            // SAFETY: inside the mappings above.
            let now = unsafe { std::slice::from_raw_parts(r.vaddr as *const u8, len) };
            let off = r.loc.offset as usize;
            assert!(now == &content[off..off + len], "the page at {:#x}", r.vaddr);
        }
        // SAFETY: the page between the first two runs, which nothing wrote.
        assert_eq!(unsafe { *((rw + PAGE_SIZE) as *const u8) }, 0);
        // An image that is not there: one line naming it.
        let gone = PageRun { file: dir.path().join("pages-9.img"), ..runs[0].clone() };
        let e = write_pages(me, &[gone]).unwrap_err().to_string();
        assert!(e.contains("pages-9.img"), "{e}");
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
    fn a_page_is_the_bases_unless_written_or_not_there() {
        let p = PAGE_SIZE;
        // The base: pages 0x10000..0x14000 in image 1, 0x20000 in image 2.
        let base = vec![run(0x10000, 4, 1, 0), run(0x20000, 1, 2, 8 * p)];
        // Now: 0x10000..0x12000 and 0x13000 untouched, 0x12000 written, 0x20000..0x22000
        // untouched (0x21000 not in the base: a hole the base did not have), 0x30000 written.
        let clean = vec![(0x10000, 0x12000), (0x13000, 0x14000), (0x20000, 0x22000)];
        let dirty = vec![(0x12000, 0x13000), (0x30000, 0x31000)];
        let now = now_runs(&clean, &dirty, &base);
        let got: Vec<(u64, u64, u64, u64)> =
            now.iter().map(|r| (r.vaddr, r.nr_pages, r.loc.ino, r.loc.offset)).collect();
        let new = u64::MAX;
        assert_eq!(
            got,
            vec![
                (0x10000, 2, 1, 0),
                (0x12000, 1, new, 0x12000),
                (0x13000, 1, 1, 3 * p),
                (0x20000, 1, 2, 8 * p),
                (0x21000, 1, new, 0x21000),
                (0x30000, 1, new, 0x30000),
            ]
        );
        // Against a statepoint whose pages are the base's but for the written one: that one is
        // written back, and the pages the statepoint did not have are dropped.
        let target = vec![run(0x10000, 4, 1, 0), run(0x20000, 1, 2, 8 * p)];
        let (write, drop) = differ(&target, &now);
        let w: Vec<(u64, u64)> = write.iter().map(|r| (r.vaddr, r.nr_pages)).collect();
        assert_eq!(w, vec![(0x12000, 1)]);
        assert_eq!(drop, vec![(0x21000, 0x22000), (0x30000, 0x31000)]);
        // No base: every page is new, every page of the statepoint written.
        let (write, _) = differ(&target, &now_runs(&clean, &dirty, &[]));
        assert_eq!(pages_of(&write), 5);
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
}

//! `/proc/PID/pagemap`: which pages of a range a process has, as CRIU counts them — present or
//! swapped out, and not the kernel's shared zero page (what a read of untouched memory maps,
//! which CRIU does not dump).

use std::io;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU8, Ordering};

use super::PAGE_SIZE;
pub const PRESENT: u64 = 1 << 63;
pub const SWAPPED: u64 = 1 << 62;
/// Written since the bits were last cleared (`clear_refs` 4, as CRIU's `--track-mem` does).
pub const SOFT_DIRTY: u64 = 1 << 55;
const PFN: u64 = (1 << 55) - 1;

/// A page of this binary's zeroed writable data (.bss, atomics: never read-only data), never
/// written: reading it maps the zero page.
#[repr(C, align(4096))]
struct Probe([AtomicU8; PAGE_SIZE as usize]);
static PROBE: Probe = Probe([const { AtomicU8::new(0) }; PAGE_SIZE as usize]);

/// The zero page's frame number, when this process may see frame numbers (CAP_SYS_ADMIN).
pub fn zero_pfn() -> Option<u64> {
    let at = PROBE.0.as_ptr();
    let _ = PROBE.0[0].load(Ordering::SeqCst);
    let mut e = [0u8; 8];
    std::fs::File::open("/proc/self/pagemap").ok()?.read_exact_at(&mut e, at as u64 / PAGE_SIZE * 8).ok()?;
    let e = u64::from_le_bytes(e);
    Some(e & PFN).filter(|pfn| e & PRESENT != 0 && *pfn != 0)
}

/// The pages process `pid` has in `[lo, hi)` (page-aligned), as ranges, in order: present or
/// swapped, the zero page aside when `zero` is its frame number.
pub fn pages(pid: i32, lo: u64, hi: u64, zero: Option<u64>) -> io::Result<Vec<(u64, u64)>> {
    use category as c;
    let f = std::fs::File::open(format!("/proc/{pid}/pagemap"))?;
    let mut out: Vec<(u64, u64)> = Vec::new();
    let mut add = |s: u64, e: u64| match out.last_mut() {
        Some(l) if l.1 == s => l.1 = e,
        _ => out.push((s, e)),
    };
    let asked = regions(&f, lo, hi, (0, c::PRESENT | c::SWAPPED, c::SWAPPED | c::PFNZERO), |s, e, k| {
        // (the zero page set aside as the page map's reading does: only where told its frame)
        if k & c::SWAPPED != 0 || k & c::PFNZERO == 0 || zero.is_none() {
            add(s, e);
        }
        std::ops::ControlFlow::Continue(())
    })?;
    if asked.is_none() {
        let _ = scan(&f, lo, hi, |a, e| {
            if e & SWAPPED != 0 || (e & PRESENT != 0 && zero != Some(e & PFN)) {
                add(a, a + PAGE_SIZE);
            }
            std::ops::ControlFlow::Continue(())
        })?;
    }
    Ok(out)
}

/// Calls `visit` with the address and the pagemap entry of each page of `[lo, hi)`
/// (page-aligned) in `pagemap` (a `/proc/PID/pagemap`), in order, until it breaks.
pub fn scan(
    pagemap: &std::fs::File,
    lo: u64,
    hi: u64,
    mut visit: impl FnMut(u64, u64) -> std::ops::ControlFlow<()>,
) -> io::Result<std::ops::ControlFlow<()>> {
    // (in pieces of 256 MiB of address space: a reservation may be huge)
    let mut buf = vec![0u8; ((hi.saturating_sub(lo) / PAGE_SIZE).min(65536) as usize) * 8];
    let mut at = lo;
    while at < hi {
        let n = ((hi - at) / PAGE_SIZE).min(65536) as usize;
        pagemap.read_exact_at(&mut buf[..n * 8], at / PAGE_SIZE * 8)?;
        for (i, e) in buf[..n * 8].chunks_exact(8).enumerate() {
            let e = u64::from_le_bytes(e.try_into().expect("8 bytes"));
            if visit(at + i as u64 * PAGE_SIZE, e).is_break() {
                return Ok(std::ops::ControlFlow::Break(()));
            }
        }
        at += n as u64 * PAGE_SIZE;
    }
    Ok(std::ops::ControlFlow::Continue(()))
}

/// What the kernel's `PAGEMAP_SCAN` says of a page (`PAGE_IS_*` of linux/fs.h).
pub mod category {
    /// Backed by a file, or shared anonymous memory (pagemap's bit 61).
    pub const FILE: u64 = 1 << 2;
    pub const PRESENT: u64 = 1 << 3;
    pub const SWAPPED: u64 = 1 << 4;
    /// The shared zero page (what a read of untouched memory maps).
    pub const PFNZERO: u64 = 1 << 5;
    /// Mapped by a huge page (transparent or hugetlb).
    pub const HUGE: u64 = 1 << 6;
    /// Linux 6.9 and later.
    pub const SOFT_DIRTY: u64 = 1 << 7;
}

/// `struct pm_scan_arg` of linux/fs.h.
#[repr(C)]
#[derive(Default)]
struct ScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

/// `struct page_region` of linux/fs.h.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Region {
    start: u64,
    end: u64,
    categories: u64,
}

/// `_IOWR('f', 16, struct pm_scan_arg)`.
const PAGEMAP_SCAN: u64 = (3 << 30) | ((std::mem::size_of::<ScanArg>() as u64) << 16) | ((b'f' as u64) << 8) | 16;

/// Calls `visit` with each range of `[lo, hi)` (page-aligned) whose pages have every category of
/// `all` and, unless it is 0, one of `any`, and with those pages' categories among `shown`:
/// consecutive pages whose shown categories are the same make one range. In order, until it
/// breaks. The kernel walks the page tables and says only what matches (`PAGEMAP_SCAN`, Linux
/// 6.7), where reading `/proc/PID/pagemap` copies out 8 bytes for every page: `None` when this
/// kernel cannot (no such ioctl, or not these categories; read the page map then).
pub fn regions(
    pagemap: &std::fs::File,
    lo: u64,
    hi: u64,
    (all, any, shown): (u64, u64, u64),
    mut visit: impl FnMut(u64, u64, u64) -> std::ops::ControlFlow<()>,
) -> io::Result<Option<std::ops::ControlFlow<()>>> {
    use std::os::fd::AsRawFd;
    let mut vec = [Region::default(); 512];
    let mut at = lo;
    while at < hi {
        let mut arg = ScanArg {
            size: std::mem::size_of::<ScanArg>() as u64,
            start: at,
            end: hi,
            vec: vec.as_mut_ptr() as u64,
            vec_len: vec.len() as u64,
            category_mask: all,
            category_anyof_mask: any,
            return_mask: shown,
            ..ScanArg::default()
        };
        // SAFETY: PAGEMAP_SCAN reads `arg` and writes `arg.walk_end` and at most `vec_len`
        // regions into `vec`, both ours and alive for the call.
        let n = unsafe { libc::ioctl(pagemap.as_raw_fd(), PAGEMAP_SCAN as _, &mut arg) };
        if n < 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                // (only before any range was visited: a caller then reads the page map whole)
                Some(libc::ENOTTY | libc::EINVAL) if at == lo => Ok(None),
                _ => Err(e),
            };
        }
        for r in &vec[..n as usize] {
            if visit(r.start, r.end, r.categories).is_break() {
                return Ok(Some(std::ops::ControlFlow::Break(())));
            }
        }
        // (where the walk stopped: `hi`, unless `vec` filled up first)
        if arg.walk_end <= at {
            return Err(io::Error::other(format!("PAGEMAP_SCAN stopped at {:#x}, where it began", arg.walk_end)));
        }
        at = arg.walk_end;
    }
    Ok(Some(std::ops::ControlFlow::Continue(())))
}

/// Whether this kernel keeps soft-dirty bits (a page this process just wrote shows one).
pub fn soft_dirty_kept() -> bool {
    let mut v = vec![0u8; 3 * PAGE_SIZE as usize];
    let at = (v.as_ptr() as u64).div_ceil(PAGE_SIZE) * PAGE_SIZE;
    let i = (at - v.as_ptr() as u64) as usize;
    // SAFETY: a byte inside `v`, written through a volatile store so that it is not elided.
    unsafe { std::ptr::write_volatile(v.as_mut_ptr().add(i), 1) };
    let mut e = [0u8; 8];
    let ok =
        std::fs::File::open("/proc/self/pagemap").and_then(|f| f.read_exact_at(&mut e, at / PAGE_SIZE * 8)).is_ok();
    std::hint::black_box(&v);
    ok && u64::from_le_bytes(e) & SOFT_DIRTY != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A page's flags as either way tells them: present, swapped, file, the zero page,
    /// soft-dirty.
    type Flags = (bool, bool, bool, bool, bool);
    /// Pages and their flags, in order.
    type Pages = Vec<(u64, Flags)>;

    /// A child process, killed and reaped however the test ends.
    struct Reaped(std::process::Child);
    impl Drop for Reaped {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    /// Every page of a process (Python, which since its soft-dirty bits were cleared has
    /// written some pages and mapped memory of which it wrote two pages) that is present,
    /// swapped or soft-dirty: the same, read from the page map or asked of `PAGEMAP_SCAN`.
    #[test]
    fn regions_say_what_the_page_map_says() {
        use std::io::{BufRead, Write};
        let script = "import mmap, sys\nkept = []\nfor line in sys.stdin:\n    if line == 'map\\n':\n        m = mmap.mmap(-1, 64 * 4096)\n        m[0] = 1\n        m[8192] = 1\n        kept.append(m)\n    sys.stdout.write(line)\n    sys.stdout.flush()\n";
        let mut py = Reaped(
            std::process::Command::new("python3")
                .args(["-c", script])
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .spawn()
                .unwrap(),
        );
        let (mut to, mut from) = (py.0.stdin.take().unwrap(), std::io::BufReader::new(py.0.stdout.take().unwrap()));
        // (a line sent and read back: it waits for the next one, its memory still)
        let mut echo = |line: &str| {
            to.write_all(line.as_bytes()).unwrap();
            let mut back = String::new();
            from.read_line(&mut back).unwrap();
            assert_eq!(back, line);
        };
        echo("one\n");
        let pid = py.0.id();
        std::fs::write(format!("/proc/{pid}/clear_refs"), "4").unwrap();
        echo("map\n");
        let pagemap = std::fs::File::open(format!("/proc/{pid}/pagemap")).unwrap();
        let zero = zero_pfn();
        // Both ways, mapping by mapping (None: this kernel has no PAGEMAP_SCAN with soft-dirty
        // bits). Not at one instant: khugepaged or a migration may move a page in between, so
        // a difference is looked at again, up to three times.
        let both = || -> Option<(Pages, Pages)> {
            let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
            let (mut read, mut asked, mut huge): (Pages, Pages, Vec<(u64, u64)>) = Default::default();
            for line in maps.lines().filter(|l| !l.ends_with("[vsyscall]")) {
                let (lo, hi) = line.split_whitespace().next().unwrap().split_once('-').unwrap();
                let (lo, hi) = (u64::from_str_radix(lo, 16).unwrap(), u64::from_str_radix(hi, 16).unwrap());
                let _ = scan(&pagemap, lo, hi, |a, e| {
                    let f = (
                        e & PRESENT != 0,
                        e & SWAPPED != 0,
                        e & (1 << 61) != 0,
                        e & PRESENT != 0 && zero == Some(e & PFN),
                        e & SOFT_DIRTY != 0,
                    );
                    if f.0 || f.1 || f.4 {
                        read.push((a, f));
                    }
                    std::ops::ControlFlow::Continue(())
                })
                .unwrap();
                use category as c;
                let shown = c::PRESENT | c::SWAPPED | c::FILE | c::PFNZERO | c::SOFT_DIRTY | c::HUGE;
                let any = c::PRESENT | c::SWAPPED | c::SOFT_DIRTY;
                let _ = regions(&pagemap, lo, hi, (0, any, shown), |s, e, k| {
                    let f = (
                        k & c::PRESENT != 0,
                        k & c::SWAPPED != 0,
                        k & c::FILE != 0,
                        k & c::PFNZERO != 0,
                        k & c::SOFT_DIRTY != 0,
                    );
                    asked.extend((s..e).step_by(PAGE_SIZE as usize).map(|a| (a, f)));
                    if k & c::HUGE != 0 {
                        huge.push((s, e));
                    }
                    std::ops::ControlFlow::Continue(())
                })
                .unwrap()?;
            }
            // (a huge page's file and zero-page bits are told apart differently: the page map
            // calls the huge zero page a file's, PAGEMAP_SCAN before a fix of June 2025 neither)
            for (a, f) in read.iter_mut().chain(asked.iter_mut()) {
                if huge.iter().any(|&(s, e)| s <= *a && *a < e) {
                    (f.2, f.3) = (false, false);
                }
            }
            if zero.is_none() {
                // (frame numbers hidden: the page map cannot tell the zero page)
                asked.iter_mut().for_each(|(_, f)| f.3 = false);
            }
            Some((read, asked))
        };
        let mut got = both();
        for _ in 0..2 {
            if got.as_ref().is_none_or(|(r, a)| r == a) {
                break;
            }
            got = both();
        }
        drop(py);
        let Some((read, asked)) = got else {
            // (only a kernel before 6.9 has none)
            let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
            let v: Vec<u32> = release.split(['.', '-']).take(2).map(|n| n.parse().unwrap_or(0)).collect();
            assert!(v < vec![6, 9], "no PAGEMAP_SCAN with soft-dirty bits on Linux {release}");
            return;
        };
        let dirty = read.iter().filter(|(_, f)| f.4).count();
        // (a kernel without soft-dirty bits shows none: the rest is compared all the same)
        if soft_dirty_kept() {
            assert!(
                dirty > 0 && dirty < read.len(),
                "some pages written since the bits were cleared, not all: {dirty} of {}",
                read.len()
            );
        }
        assert_eq!(read, asked);
    }

    #[test]
    fn a_written_page_counts_and_an_untouched_one_read_does_not() {
        let mut v = vec![0u8; 64 * PAGE_SIZE as usize];
        let lo = (v.as_ptr() as u64).div_ceil(PAGE_SIZE) * PAGE_SIZE;
        let (a, b) = (lo, lo + 8 * PAGE_SIZE);
        let i = (a - v.as_ptr() as u64) as usize;
        v[i] = 1;
        v[i + 2 * PAGE_SIZE as usize] = 1;
        let got = pages(std::process::id() as i32, a, b, None).unwrap();
        let has = |x: u64| got.iter().any(|r| r.0 <= x && x < r.1);
        assert!(has(a) && has(a + 2 * PAGE_SIZE), "the written pages: {got:x?}");
        if let Some(z) = zero_pfn() {
            // Fresh anonymous memory (large: its own mapping), one page read: the zero page. (Not
            // a huge page: where transparent huge pages are always on, as on Debian's kernels, a
            // read of an aligned 2 MiB would map the huge zero page, a frame of its own.)
            let big = vec![0u8; 1 << 24];
            let p = (big.as_ptr() as u64).div_ceil(PAGE_SIZE) * PAGE_SIZE + (1 << 22);
            // SAFETY: advice on pages inside `big`, which changes none of their contents.
            unsafe { libc::madvise(p as *mut libc::c_void, 1 << 21, libc::MADV_NOHUGEPAGE) };
            // SAFETY: a byte inside `big`.
            let _ = unsafe { std::ptr::read_volatile(p as *const u8) };
            assert_eq!(
                pages(std::process::id() as i32, p, p + PAGE_SIZE, None).unwrap(),
                vec![(p, p + PAGE_SIZE)],
                "read: mapped"
            );
            assert_eq!(
                pages(std::process::id() as i32, p, p + PAGE_SIZE, Some(z)).unwrap(),
                vec![],
                "the zero page is not a page of its own"
            );
            std::hint::black_box(&big);
        }
        std::hint::black_box(&v);
    }
}

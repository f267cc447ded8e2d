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
    let f = std::fs::File::open(format!("/proc/{pid}/pagemap"))?;
    let mut out: Vec<(u64, u64)> = Vec::new();
    let _ = scan(&f, lo, hi, |a, e| {
        if e & SWAPPED != 0 || (e & PRESENT != 0 && zero != Some(e & PFN)) {
            match out.last_mut() {
                Some(l) if l.1 == a => l.1 += PAGE_SIZE,
                _ => out.push((a, a + PAGE_SIZE)),
            }
        }
        std::ops::ControlFlow::Continue(())
    })?;
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
            // Fresh anonymous memory (large: its own mapping), one page read: the zero page.
            let big = vec![0u8; 1 << 24];
            let p = (big.as_ptr() as u64).div_ceil(PAGE_SIZE) * PAGE_SIZE + (1 << 22);
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

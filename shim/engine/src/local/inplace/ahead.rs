//! Pages written ahead: while a rollback in place still compares files (on OpenZFS mostly a wait
//! for the frozen state's snapshot and its stream), the plan's pages that can be put back as they
//! were without a system call in the process are written, each range's bytes saved first.
//!
//! Those are the pages the process has now (present or swapped out, not the zero page: writing
//! one allocates nothing) in mappings the layout keeps (nothing unmapped, mapped anew or cut off
//! the heap there). Put back ([`Ahead::undo`]), the process's memory reads as before: a comparison
//! or a compensation that fails after them still changes nothing. The soft-dirty bit of a page
//! written and put back may be set, which only makes the next dump carry it. The saved bytes are
//! in this process's memory, at most [`MAX_PAGES`]; a planarian killed while it holds them
//! leaves the journal saying forward (the next operation restores the target).

use super::pages::{cut, merge, subtract, write_pages, Plan};
use super::{io, Error, Result};
use criu_hooks::images::{PageRun, PAGE_SIZE};
use std::os::unix::fs::FileExt;
use sys::proc::Proc;

/// The most pages written ahead (64 MiB saved in memory); the rest are written with the others.
pub const MAX_PAGES: u64 = 16 << 10;

/// A range of a process's memory (its start), and the bytes it held.
type Saved = (u64, Vec<u8>);

/// Pages written ahead, with the bytes they held before.
#[derive(Debug, Default)]
pub struct Ahead {
    /// Each process (host PID) whose pages were written (or being written): every range.
    saved: Vec<(i32, Vec<Saved>)>,
    pub pages: u64,
}

impl Ahead {
    /// Whether anything was (or may have been) written.
    pub fn is_empty(&self) -> bool {
        self.saved.is_empty()
    }

    /// Puts back what the pages held before they were written ahead.
    pub fn undo(&self) -> Result<()> {
        for (pid, saved) in &self.saved {
            let mem = Proc::of(*pid).open_mem_rw()?;
            for (at, bytes) in saved {
                mem.write_all_at(bytes, *at).map_err(io(format!("put back process {pid}'s memory at {at:#x}")))?;
            }
        }
        Ok(())
    }
}

fn intersect(a: &[(u64, u64)], b: &[(u64, u64)]) -> Vec<(u64, u64)> {
    subtract(a, &subtract(a, b))
}

/// `runs` (sorted, apart) split along `ranges` (merged, sorted): the parts inside, the parts outside.
fn split(runs: &[PageRun], ranges: &[(u64, u64)]) -> (Vec<PageRun>, Vec<PageRun>) {
    let (mut inside, mut outside) = (Vec::new(), Vec::new());
    let mut j = 0;
    for r in runs {
        while j < ranges.len() && ranges[j].1 <= r.vaddr {
            j += 1;
        }
        let mut at = r.vaddr;
        for &(s, e) in ranges[j..].iter().take_while(|x| x.0 < r.end()) {
            let (s, e) = (s.max(at), e.min(r.end()));
            if s >= e {
                continue;
            }
            if s > at {
                outside.push(cut(r, at, s));
            }
            inside.push(cut(r, s, e));
            at = e;
        }
        if at < r.end() {
            outside.push(cut(r, at, r.end()));
        }
    }
    (inside, outside)
}

/// The first `max` pages of `ranges`.
fn first_pages(ranges: Vec<(u64, u64)>, max: u64) -> Vec<(u64, u64)> {
    let mut left = max;
    let mut out = Vec::new();
    for (s, e) in ranges {
        let n = ((e - s) / PAGE_SIZE).min(left);
        if n == 0 {
            break;
        }
        out.push((s, s + n * PAGE_SIZE));
        left -= n;
    }
    out
}

impl Plan {
    /// Writes ahead, process by process, at most `max` of the plan's pages that can be put back
    /// as they were (see the module), each range's bytes saved into `ahead` first; they are taken
    /// out of the writes [`Plan::apply`] makes. On an error, what `ahead` holds may be written:
    /// the caller puts it back ([`Ahead::undo`]) as after any later failure.
    pub fn write_ahead(&mut self, max: u64, ahead: &mut Ahead) -> Result<()> {
        let mut left = max;
        for (p, pages) in self.shape.procs.iter().zip(self.pages.iter_mut()) {
            let l = &p.layout;
            let moved = merge(
                l.gone.iter().copied().chain(l.unmap.iter().copied()).chain(l.map.iter().map(|m| (m.0, m.1))).collect(),
            );
            let writes = merge(pages.write.iter().map(|r| (r.vaddr, r.end())).collect());
            let fit = first_pages(subtract(&intersect(&writes, &pages.has), &moved), left);
            if fit.is_empty() {
                continue;
            }
            let (now, later) = split(&pages.write, &fit);
            let mem = Proc::of(p.host).open_mem_rw()?;
            let mut saved = Vec::with_capacity(fit.len());
            for &(s, e) in &fit {
                let mut bytes = vec![0u8; (e - s) as usize];
                mem.read_exact_at(&mut bytes, s).map_err(io(format!("read process {}'s memory at {s:#x}", p.vpid)))?;
                saved.push((s, bytes));
            }
            ahead.saved.push((p.host, saved));
            let n = write_pages(p.host, &now)?;
            if n != fit.iter().map(|(s, e)| (e - s) / PAGE_SIZE).sum::<u64>() {
                return Err(Error::Failed(format!("process {}: {n} pages written ahead, not the {fit:x?}", p.vpid)));
            }
            pages.write = later;
            ahead.pages += n;
            left -= n;
        }
        self.pages_ahead = ahead.pages;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use criu_hooks::images::Location;
    use std::path::PathBuf;

    fn run(v: u64, n: u64, off: u64) -> PageRun {
        PageRun {
            vaddr: v,
            nr_pages: n,
            file: PathBuf::from("p"),
            loc: Location { dev: 1, ino: 1, offset: off },
            lazy: false,
        }
    }

    fn spans(v: &[PageRun]) -> Vec<(u64, u64, u64)> {
        v.iter().map(|r| (r.vaddr, r.end(), r.loc.offset)).collect()
    }

    #[test]
    fn runs_split_along_ranges_keep_their_image_offsets() {
        let p = PAGE_SIZE;
        let runs = vec![run(0x10000, 4, 0), run(0x20000, 2, 8 * p)];
        // A range across the first run's middle, one covering the second whole, and more.
        let (inside, outside) = split(&runs, &[(0x11000, 0x13000), (0x1f000, 0x30000)]);
        assert_eq!(spans(&inside), vec![(0x11000, 0x13000, p), (0x20000, 0x22000, 8 * p)]);
        assert_eq!(spans(&outside), vec![(0x10000, 0x11000, 0), (0x13000, 0x14000, 3 * p)]);
        // No range: all outside; ranges between runs: nothing inside.
        let (inside, outside) = split(&runs, &[(0x15000, 0x1f000)]);
        assert!(inside.is_empty());
        assert_eq!(spans(&outside), spans(&runs));
        // Every page lands on exactly one side, for ranges of every position.
        let mut seed = 11u64;
        let mut rnd = |n: u64| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        for _ in 0..300 {
            let runs: Vec<PageRun> = {
                let mut at = 0;
                (0..rnd(5))
                    .map(|_| {
                        at += rnd(4) * p;
                        let n = 1 + rnd(6);
                        let r = run(at, n, at * 3);
                        at += n * p;
                        r
                    })
                    .collect()
            };
            let ranges = merge(
                (0..rnd(5))
                    .map(|_| {
                        let s = rnd(40) * p;
                        (s, s + (1 + rnd(6)) * p)
                    })
                    .collect(),
            );
            let (inside, outside) = split(&runs, &ranges);
            let pages = |v: &[PageRun]| -> Vec<(u64, u64)> {
                let mut x: Vec<(u64, u64)> = v
                    .iter()
                    .flat_map(|r| (0..r.nr_pages).map(move |i| (r.vaddr + i * p, r.loc.offset + i * p)))
                    .collect();
                x.sort_unstable();
                x
            };
            let mut both = pages(&inside);
            both.extend(pages(&outside));
            both.sort_unstable();
            assert_eq!(both, pages(&runs), "{ranges:x?}");
            let inr = |a: u64| ranges.iter().any(|r| r.0 <= a && a < r.1);
            assert!(pages(&inside).iter().all(|x| inr(x.0)) && pages(&outside).iter().all(|x| !inr(x.0)));
        }
    }

    #[test]
    fn at_most_max_pages() {
        let p = PAGE_SIZE;
        assert_eq!(first_pages(vec![(0, 4 * p), (10 * p, 20 * p)], 6), vec![(0, 4 * p), (10 * p, 12 * p)]);
        assert_eq!(first_pages(vec![(0, 4 * p)], 0), vec![]);
        assert_eq!(intersect(&[(0, 10), (20, 30)], &[(5, 25)]), vec![(5, 10), (20, 25)]);
    }
}

//! Pages written ahead: while a rollback in place still compares files (on OpenZFS mostly a wait
//! for the frozen state's snapshot and its stream), the plan's pages that can be put back as they
//! were without a system call in the process, and without saving anything, are written.
//!
//! Those are the pages the process has now whose content lies in the base's images — present or
//! swapped out and not written since the dump the next one would build on (their soft-dirty bit
//! clear: the same test that leaves them out of an incremental dump) — in mappings the layout
//! keeps (nothing unmapped, mapped anew or cut off the heap there). Writing one fills no hole
//! (a page swapped out comes back in, one shared copy-on-write is copied), and putting it back
//! ([`Ahead::undo`]) is writing the base's page again: a comparison or a compensation that fails
//! after them still changes nothing. The soft-dirty bit of a page
//! written and put back may be set, which only makes the next dump carry it. The work is the
//! writes the rollback makes anyway, made earlier; a planarian killed meanwhile leaves the journal
//! saying forward (the next operation restores the target).

use super::pages::{cut, merge, subtract, write_pages, Plan};
use super::{Error, Result};
use criu_hooks::images::{PageRun, PAGE_SIZE};

/// Pages written ahead, and where their content was before (the base's images).
#[derive(Debug, Default)]
pub struct Ahead {
    /// Each process (host PID) whose pages were written (or being written): the base's runs
    /// of them.
    before: Vec<(i32, Vec<PageRun>)>,
    pub pages: u64,
}

impl Ahead {
    /// Whether anything was (or may have been) written.
    pub fn is_empty(&self) -> bool {
        self.before.is_empty()
    }

    /// Puts back what the pages held before they were written ahead.
    pub fn undo(&self) -> Result<()> {
        for (pid, runs) in &self.before {
            write_pages(*pid, runs)?;
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

fn pages_in(ranges: &[(u64, u64)]) -> u64 {
    ranges.iter().map(|(s, e)| (e - s) / PAGE_SIZE).sum()
}

impl Plan {
    /// Writes ahead, process by process, the plan's pages that can be put back from the base's
    /// images (see the module), where they lie recorded in `ahead` first; they are taken out of
    /// the writes [`Plan::apply`] makes. On an error, what `ahead` records may be written: the
    /// caller puts it back ([`Ahead::undo`]) as after any later failure.
    pub fn write_ahead(&mut self, ahead: &mut Ahead) -> Result<()> {
        for (p, pages) in self.shape.procs.iter().zip(self.pages.iter_mut()) {
            let l = &p.layout;
            // (`gone` holds what is unmapped, and the heap's tail cut off)
            let moved = merge(l.gone.iter().copied().chain(l.map.iter().map(|m| (m.0, m.1))).collect());
            let writes = merge(pages.write.iter().map(|r| (r.vaddr, r.end())).collect());
            let clean = merge(pages.clean.iter().map(|r| (r.vaddr, r.end())).collect());
            let fit = subtract(&intersect(&writes, &clean), &moved);
            if fit.is_empty() {
                continue;
            }
            let (now, later) = split(&pages.write, &fit);
            let (before, _) = split(&pages.clean, &fit);
            ahead.before.push((p.host, before));
            let n = write_pages(p.host, &now)?.pages;
            if n != pages_in(&fit) {
                return Err(Error::Failed(format!("process {}: {n} pages written ahead, not the {fit:x?}", p.vpid)));
            }
            pages.write = later;
            ahead.pages += n;
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
    fn ranges_intersect() {
        assert_eq!(intersect(&[(0, 10), (20, 30)], &[(5, 25)]), vec![(5, 10), (20, 25)]);
        assert_eq!(intersect(&[(0, 10)], &[(10, 20)]), vec![]);
        assert_eq!(pages_in(&[(0, 3 * PAGE_SIZE), (8 * PAGE_SIZE, 9 * PAGE_SIZE)]), 4);
    }
}

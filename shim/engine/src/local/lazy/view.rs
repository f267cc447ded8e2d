//! The images a lazy restore reads: a directory beside the statepoint's dump that names each of
//! its files, except the page maps, rewritten so that pages left in a parent dump are restored on
//! demand too.
//!
//! CRIU marks a page lazily restorable (`PE_LAZY`) only where it dumps its content; a page an
//! incremental dump leaves in its parent (`PE_PARENT`) carries no such mark, and CRIU's restore
//! copies it before the process runs. In a chain of incremental statepoints that is nearly every
//! page. The view marks a parent page lazy when CRIU marked it so where its content lies and the
//! mapping that holds it now is one CRIU registers for faults (private, anonymous, not locked or
//! huge, not the vDSO): CRIU's restore then skips it, and planarian's page server
//! ([`super::server`]), which reads pages through the chain, serves it. (CRIU's own `lazy-pages`
//! daemon cannot: it never installs a page it read from a parent image.)

use super::Error;
use criu_hooks::images::{self, PageRun, PagemapEntry, Vma, PE_LAZY, PE_PARENT};
use std::path::{Path, PathBuf};
use sys::proc::PAGE_SIZE;

/// `MAP_PRIVATE`, `MAP_ANONYMOUS`, `MAP_LOCKED` and `MAP_HUGETLB` (x86-64).
const MAP_PRIVATE: u32 = 0x02;
const MAP_ANONYMOUS: u32 = 0x20;
const MAP_LOCKED: u32 = 0x2000;
const MAP_HUGETLB: u32 = 0x40000;

/// Whether CRIU's restore registers mapping `v` for page faults in a lazy restore (its
/// `vma_entry_can_be_lazy`).
pub fn can_be_lazy(v: &Vma) -> bool {
    v.flags & MAP_ANONYMOUS != 0
        && v.flags & MAP_PRIVATE != 0
        && v.flags & (MAP_LOCKED | MAP_HUGETLB) == 0
        && !v.is(images::VMA_AREA_VDSO | images::VMA_AREA_VSYSCALL | VMA_AREA_VVAR)
}

const VMA_AREA_VVAR: u32 = 1 << 12;

/// A view made: where, and how many pages its restore leaves to the page server.
#[derive(Debug)]
pub struct View {
    pub dir: PathBuf,
    pub lazy_pages: u64,
}

/// Makes the view of the dump in `images`, beside it (`IMAGES-lazy`; what was there is replaced).
/// It is made in a directory of its own and moved in place whole. Restores of one container
/// take turns (under its lock, once the last one's page server ended), and a fork's chain is its
/// own (linked into its store): no view is read while another replaces it.
///
/// Its entries are relative links (`../IMAGES/FILE`), and its `parent` link is the dump's own:
/// CRIU's restored processes read their pages themselves, once inside the container's root,
/// through a descriptor of this directory, where an absolute path would name the container's
/// files.
pub fn make(images: &Path) -> Result<View, Error> {
    let name = images.file_name().ok_or_else(|| Error::Serve(format!("{} has no name", images.display())))?;
    let name = name.to_string_lossy();
    let into = images.with_file_name(format!("{name}-lazy"));
    let aside = |what: &str| images.with_file_name(format!(".{name}-lazy.{what}.{}", std::process::id()));
    let tmp = aside("new");
    let _ = std::fs::remove_dir_all(&tmp);
    let lazy_pages = match build(images, &tmp) {
        Ok(n) => n,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    let old = aside("old");
    if std::fs::rename(&into, &old).is_ok() {
        let _ = std::fs::remove_dir_all(&old);
    }
    if let Err(e) = std::fs::rename(&tmp, &into) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(Error::io("move in place", &into, e));
    }
    Ok(View { dir: into, lazy_pages })
}

/// How many pages the dump in `images` holds for its processes, its parents' included: the most
/// a view of it can leave to the server.
pub fn pages(images: &Path) -> Result<u64, Error> {
    let mut n = 0;
    for p in images::pstree(images)? {
        n += images::pagemap(images, p.pid)?.1.iter().map(|e| e.nr_pages).sum::<u64>();
    }
    Ok(n)
}

/// The view's entries, made at `into` (which is created): the pages it leaves to the server.
fn build(images: &Path, into: &Path) -> Result<u64, Error> {
    std::fs::create_dir_all(into).map_err(|e| Error::io("create", into, e))?;
    let pids: Vec<u32> = images::pstree(images)?.iter().map(|p| p.pid).collect();
    let mut lazy_pages = 0;
    for e in std::fs::read_dir(images).map_err(|e| Error::io("read", images, e))? {
        let e = e.map_err(|e| Error::io("read", images, e))?;
        let name = e.file_name();
        let to = into.join(&name);
        let pid = name.to_str().and_then(|n| n.strip_prefix("pagemap-")?.strip_suffix(".img")?.parse::<u32>().ok());
        match pid.filter(|p| pids.contains(p)) {
            Some(pid) => lazy_pages += rewrite(images, pid, &to)?,
            None => {
                // (the parent link as it is: the view is at the dump's depth)
                let from = match name.to_str() {
                    Some("parent") => std::fs::read_link(e.path()).map_err(|err| Error::io("read", &e.path(), err))?,
                    _ => Path::new("..").join(images.file_name().unwrap_or_default()).join(&name),
                };
                std::os::unix::fs::symlink(&from, &to).map_err(|err| Error::io("link", &to, err))?;
            }
        }
    }
    Ok(lazy_pages)
}

/// Writes process `pid`'s page map with its lazily restorable parent pages marked, at `to`.
/// The pages the restore leaves to the server.
fn rewrite(images: &Path, pid: u32, to: &Path) -> Result<u64, Error> {
    let (pages_id, entries) = images::pagemap(images, pid)?;
    let vmas = images::mm(images, pid)?.vmas;
    let runs = images::memory(images, pid)?;
    let mut out = Vec::with_capacity(entries.len());
    let mut lazy = 0;
    for e in entries {
        if e.flags != PE_PARENT {
            lazy += if e.flags & PE_LAZY != 0 { e.nr_pages } else { 0 };
            out.push(e);
            continue;
        }
        for (vaddr, nr_pages, is_lazy) in split(&e, &vmas, &runs) {
            lazy += if is_lazy { nr_pages } else { 0 };
            out.push(PagemapEntry { vaddr, nr_pages, flags: if is_lazy { PE_PARENT | PE_LAZY } else { PE_PARENT } });
        }
    }
    images::write_pagemap(to, pages_id, &out).map_err(|e| Error::io("write", to, e))?;
    Ok(lazy)
}

/// Parent entry `e` cut where its pages change between lazily restorable and not: (address,
/// pages, lazy).
fn split(e: &PagemapEntry, vmas: &[Vma], runs: &[PageRun]) -> Vec<(u64, u64, bool)> {
    let mut out: Vec<(u64, u64, bool)> = Vec::new();
    for i in 0..e.nr_pages {
        let a = e.vaddr + i * PAGE_SIZE;
        let in_lazy_vma = vmas.iter().any(|v| v.start <= a && a < v.end && can_be_lazy(v));
        let at = runs.partition_point(|r| r.end() <= a);
        let lazy_where_dumped = runs.get(at).is_some_and(|r| r.vaddr <= a && r.lazy);
        let lazy = in_lazy_vma && lazy_where_dumped;
        match out.last_mut() {
            Some(last) if last.2 == lazy => last.1 += 1,
            _ => out.push((a, 1, lazy)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vma(start: u64, end: u64, flags: u32) -> Vma {
        Vma { start, end, pgoff: 0, shmid: 0, prot: 3, flags, status: images::VMA_AREA_REGULAR }
    }

    fn run(vaddr: u64, nr_pages: u64, lazy: bool) -> PageRun {
        PageRun { vaddr, nr_pages, file: "p".into(), loc: images::Location { dev: 1, ino: 1, offset: 0 }, lazy }
    }

    #[test]
    fn a_parent_page_is_lazy_where_criu_would_fault_it_in_and_marked_it_so() {
        let anon = MAP_PRIVATE | MAP_ANONYMOUS;
        let vmas = [vma(0x10000, 0x13000, anon), vma(0x13000, 0x14000, MAP_PRIVATE), vma(0x14000, 0x16000, anon)];
        // 0x15000: a stack page where it was dumped (not lazy there).
        let runs = [run(0x10000, 5, true), run(0x15000, 1, false)];
        let e = PagemapEntry { vaddr: 0x10000, nr_pages: 6, flags: PE_PARENT };
        assert_eq!(
            split(&e, &vmas, &runs),
            vec![(0x10000, 3, true), (0x13000, 1, false), (0x14000, 1, true), (0x15000, 1, false)]
        );
        let locked = [vma(0x10000, 0x16000, anon | MAP_LOCKED)];
        assert_eq!(split(&e, &locked, &runs), vec![(0x10000, 6, false)]);
    }
}

//! Where the objects an incremental stream carries are in the live tree, without zdb: each
//! file's znode (in the stream) names its directory; a directory the stream carries too is found
//! the same way through its own, and one it does not carry (unchanged: same name, same place)
//! by reading the live tree from its root, breadth first, a bounded number of directories. A
//! name is the live directory's entry with the object's inode number (ZFS's inode numbers are
//! its object numbers). Anything that does not add up — a file not in the directory its znode
//! names, a znode the stream could not read, a directory not found within the bound — gives no
//! answer, and the caller asks zdb.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use zfs::stream::{Changes, Object};

/// Directories read breadth first, at most, to find the unchanged ones that hold changed files.
pub const SEARCH_BOUND: usize = 128;

/// What [`places`] found.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Places {
    /// The places (relative to the live root) of the changed objects the tree holds, each the
    /// only name of its object; the root itself is the empty path.
    pub single: Vec<PathBuf>,
    /// Those of files with more than one name (the name in the directory their znode names).
    pub named: Vec<PathBuf>,
    /// Directories read (listings of the changed objects' directories, and the search).
    pub read: usize,
    /// The places of the directories that hold changed objects: worth keeping for the next
    /// rollback (a file changed once often changes again).
    pub dirs: HashMap<u64, PathBuf>,
}

struct Finder<'a> {
    live: &'a Path,
    mounted: &'a [PathBuf],
    changes: &'a Changes,
    /// Directory object → its place.
    found: HashMap<u64, PathBuf>,
    /// Places earlier rollbacks learned (each checked before it is used).
    known: &'a HashMap<u64, PathBuf>,
    listings: HashMap<PathBuf, std::collections::BTreeMap<std::ffi::OsString, (u64, bool)>>,
}

impl Finder<'_> {
    fn listing(&mut self, rel: &Path) -> &std::collections::BTreeMap<std::ffi::OsString, (u64, bool)> {
        let live = self.live;
        self.listings.entry(rel.to_path_buf()).or_insert_with(|| crate::local::treesync::listing(&live.join(rel)))
    }

    /// The name of object `ino` in the directory at `dir`.
    fn name_in(&mut self, dir: &Path, ino: u64) -> Option<PathBuf> {
        let name = self.listing(dir).iter().find(|(_, (i, _))| *i == ino).map(|(n, _)| n.clone())?;
        Some(dir.join(name))
    }

    /// The place of directory `obj`, through the znodes the stream carries (`depth` bounds the
    /// chain: a loop is no tree), else where an earlier rollback found it, if it is still there.
    fn dir(&mut self, obj: u64, depth: usize) -> Option<PathBuf> {
        if let Some(p) = self.found.get(&obj) {
            return Some(p.clone());
        }
        let chained = match self.changes.objects.get(&obj) {
            Some(Object::File(z)) if !z.is_dir() => return None,
            Some(Object::File(z)) if z.parent == obj => Some(PathBuf::new()),
            Some(Object::File(z)) if depth <= 4096 => {
                let parent = z.parent;
                self.dir(parent, depth + 1).and_then(|p| self.name_in(&p, obj))
            }
            _ => None,
        };
        let place = chained.or_else(|| self.known.get(&obj).filter(|p| is_dir_at(self.live, p, obj)).cloned())?;
        self.found.insert(obj, place.clone());
        Some(place)
    }

    /// Reads the live tree breadth first until every directory in `wanted` is found, or
    /// [`SEARCH_BOUND`] directories were read: below the directories already found (a file
    /// that changed is most often near others that did) and from the root, a directory of each
    /// in turn — a found directory with hundreds below it (a neighbour the stream carried)
    /// does not use up the bound before the root's own are read. A directory is found by its
    /// entry in its own directory, or by holding a changed object whose znode names it (the
    /// root has no entry).
    fn search(&mut self, wanted: &mut HashSet<u64>) {
        let mut near: VecDeque<PathBuf> = self.found.values().filter(|p| !p.as_os_str().is_empty()).cloned().collect();
        let mut far = VecDeque::from([PathBuf::new()]);
        let mut seen = HashSet::new();
        let mut turn_near = true;
        loop {
            let next = match turn_near {
                true => near.pop_front().map(|p| (p, true)).or_else(|| far.pop_front().map(|p| (p, false))),
                false => far.pop_front().map(|p| (p, false)).or_else(|| near.pop_front().map(|p| (p, true))),
            };
            let Some((at, is_near)) = next else { return };
            turn_near = !is_near;
            if wanted.is_empty() || seen.len() == SEARCH_BOUND {
                return;
            }
            if !seen.insert(at.clone()) {
                continue;
            }
            let entries: Vec<_> = self.listing(&at).iter().map(|(n, e)| (n.clone(), *e)).collect();
            for (name, (ino, is_dir)) in entries {
                let rel = at.join(&name);
                if let Some(Object::File(z)) = self.changes.objects.get(&ino) {
                    // Only a directory or a file of one name is in the directory its znode names
                    // (a file that had more keeps the first one's), and that directory is this
                    // one when its inode says so (the root's cannot: FUSE shows it as inode 1).
                    let this = at.as_os_str().is_empty() || is_dir_at(self.live, &at, z.parent);
                    if (z.is_dir() || z.links == 1) && wanted.contains(&z.parent) && this {
                        wanted.remove(&z.parent);
                        self.found.insert(z.parent, at.clone());
                    }
                }
                if is_dir && !self.mounted.contains(&rel) {
                    if wanted.remove(&ino) {
                        self.found.insert(ino, rel.clone());
                    }
                    if is_near {
                        near.push_back(rel)
                    } else {
                        far.push_back(rel)
                    }
                }
            }
        }
    }
}

/// Whether `live/rel` is directory `obj`, reached without following a symbolic link.
fn is_dir_at(live: &Path, rel: &Path, obj: u64) -> bool {
    use std::os::unix::fs::MetadataExt;
    crate::local::treesync::within(live, rel).is_some_and(|m| m.is_dir() && m.ino() == obj)
}

/// The places in `live` (the frozen tree the stream ends at) of the objects `changes` carries;
/// why not, when they cannot all be trusted. `mounted`: the container's mount points (relative),
/// not searched; `known`: directories' places earlier rollbacks learned ([`Places::dirs`]).
pub fn places(
    changes: &Changes,
    live: &Path,
    mounted: &[PathBuf],
    known: &HashMap<u64, PathBuf>,
) -> Result<Places, String> {
    let mut f = Finder { live, mounted, changes, found: HashMap::new(), known, listings: HashMap::new() };
    // (an extended attribute's directory, or a file in one: not in the tree, and whatever
    // changed there changed the file they belong to too)
    let attribute = |z: &zfs::stream::Znode| {
        z.xattr || matches!(changes.objects.get(&z.parent), Some(Object::File(p)) if !p.is_dir() || p.xattr)
    };
    let mut files = Vec::new();
    for (&obj, seen) in &changes.objects {
        match seen {
            Object::System => {}
            Object::Unknown => return Err(format!("object {obj}: no znode in the stream")),
            // Unlinked, still open: no place.
            Object::File(z) if z.links == 0 || attribute(z) => {}
            Object::File(z) => files.push((obj, *z)),
        }
    }
    // The directories that hold changed files, found through the stream where it can; the
    // others searched for, all at once.
    // (a directory's own place; a file's directory)
    let needed: HashSet<u64> = files.iter().map(|(obj, z)| if z.is_dir() { *obj } else { z.parent }).collect();
    let mut wanted: HashSet<u64> = needed.iter().copied().filter(|&p| f.dir(p, 0).is_none()).collect();
    if !wanted.is_empty() {
        f.search(&mut wanted);
        // (a directory the stream carries may hang below one the search found)
        wanted.retain(|&p| f.dir(p, 0).is_none());
        if !wanted.is_empty() {
            let mut w: Vec<_> = wanted.into_iter().collect();
            w.sort_unstable();
            let holds: Vec<u64> =
                files.iter().filter(|(_, z)| w.contains(&z.parent)).map(|(o, _)| *o).take(5).collect();
            return Err(format!("directories {w:?} (holding {holds:?}) not found within {SEARCH_BOUND} directories"));
        }
    }
    let mut out = Places::default();
    for (obj, z) in files {
        let place = if z.is_dir() {
            f.dir(obj, 0).ok_or_else(|| format!("directory {obj} has no place"))?
        } else {
            let parent =
                f.dir(z.parent, 0).ok_or_else(|| format!("object {obj}: its directory {} has no place", z.parent))?;
            f.name_in(&parent, obj)
                .ok_or_else(|| format!("object {obj}: not in /{} (its directory {})", parent.display(), z.parent))?
        };
        if !z.is_dir() && z.links > 1 {
            out.named.push(place);
        } else {
            out.single.push(place);
        }
    }
    out.read = f.listings.len();
    out.dirs = f.found;
    Ok(out)
}

/// Directories' places kept this many at most.
const KNOWN_BOUND: usize = 4096;

/// The directories' places earlier rollbacks kept at `file` (none when it cannot be read).
pub fn load_known(file: &Path) -> HashMap<u64, PathBuf> {
    let Ok(text) = std::fs::read(file) else { return HashMap::new() };
    let map: HashMap<u64, String> = serde_json::from_slice(&text).unwrap_or_default();
    map.into_iter().map(|(o, p)| (o, PathBuf::from(p))).collect()
}

/// Keeps `learned` beside what was `known` (learned first, up to [`KNOWN_BOUND`]) at `file`,
/// when it adds anything; a place that cannot be written as text is left out (and found again).
pub fn save_known(file: &Path, known: &HashMap<u64, PathBuf>, learned: &HashMap<u64, PathBuf>) {
    if learned.iter().all(|(o, p)| known.get(o) == Some(p)) {
        return;
    }
    let mut map: HashMap<u64, String> = HashMap::new();
    for (o, p) in learned.iter().chain(known) {
        if map.len() == KNOWN_BOUND {
            break;
        }
        // (the root: FUSE shows it as inode 1, never its object)
        if let (false, Some(p)) = (map.contains_key(o) || p.as_os_str().is_empty(), p.to_str()) {
            map.insert(*o, p.to_string());
        }
    }
    let tmp = file.with_extension("tmp");
    if serde_json::to_vec(&map).ok().is_some_and(|b| std::fs::write(&tmp, b).is_ok()) {
        let _ = std::fs::rename(&tmp, file);
    }
}

/// The directories of `places` (relative to `live`) and the places' own directories, by their
/// inode numbers (the root left out: FUSE shows it as inode 1, not its object).
pub fn dirs_of(live: &Path, places: &[PathBuf]) -> HashMap<u64, PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let mut dirs: HashSet<&Path> = places.iter().filter_map(|p| p.parent()).collect();
    dirs.extend(places.iter().map(PathBuf::as_path));
    dirs.into_iter()
        .filter(|d| !d.as_os_str().is_empty())
        .filter_map(|d| {
            std::fs::symlink_metadata(live.join(d)).ok().filter(|m| m.is_dir()).map(|m| (m.ino(), d.to_path_buf()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;
    use zfs::stream::Znode;

    /// A scratch directory (removed when the first is dropped) and a directory made in it.
    fn tmp(name: &str) -> (tempfile::TempDir, PathBuf) {
        let scratch = tempfile::tempdir().unwrap();
        let d = scratch.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        (scratch, d)
    }

    fn ino(p: &Path) -> u64 {
        std::fs::symlink_metadata(p).unwrap().ino()
    }

    /// A changed object's znode, as the stream would carry it, from the tree itself.
    fn changed(c: &mut Changes, root: &Path, rel: &str) {
        let p = root.join(rel);
        let md = std::fs::symlink_metadata(&p).unwrap();
        let parent = if rel.is_empty() { md.ino() } else { ino(p.parent().unwrap()) };
        c.objects.insert(
            md.ino(),
            Object::File(Znode { parent, links: md.nlink(), mode: u64::from(md.mode()), xattr: false, ctime: 0 }),
        );
    }

    #[test]
    fn files_are_found_through_their_directories() {
        let (_scratch, d) = tmp("found");
        for dir in ["data", "usr/lib/deep/er", "tmp/new/sub", "etc"] {
            std::fs::create_dir_all(d.join(dir)).unwrap();
        }
        for f in ["data/f1", "usr/lib/deep/er/mod.py", "tmp/new/sub/x", "etc/passwd"] {
            std::fs::write(d.join(f), f).unwrap();
        }
        std::fs::hard_link(d.join("etc/passwd"), d.join("data/two")).unwrap();
        let mut c = Changes::default();
        // A file rewritten in an unchanged directory deep down; a new tree (its directories in
        // the stream); a file with two names; the root; a system object.
        for rel in
            ["data/f1", "usr/lib/deep/er/mod.py", "tmp", "tmp/new", "tmp/new/sub", "tmp/new/sub/x", "etc/passwd", ""]
        {
            changed(&mut c, &d, rel);
        }
        c.objects.insert(1, Object::System);
        // A file's extended attributes (a hidden directory, a file in it): not in the tree.
        let passwd = ino(&d.join("etc/passwd"));
        c.objects.insert(
            900_000_001,
            Object::File(Znode { parent: passwd, links: 2, mode: 0o040755, xattr: true, ctime: 0 }),
        );
        c.objects.insert(
            900_000_002,
            Object::File(Znode { parent: 900_000_001, links: 1, mode: 0o100644, xattr: false, ctime: 0 }),
        );
        let p = places(&c, &d, &[], &HashMap::new()).unwrap();
        let mut single: Vec<_> = p.single.iter().map(|p| p.display().to_string()).collect();
        single.sort();
        assert_eq!(single, ["", "data/f1", "tmp", "tmp/new", "tmp/new/sub", "tmp/new/sub/x", "usr/lib/deep/er/mod.py"]);
        assert_eq!(p.named, [PathBuf::from("etc/passwd")]);
        let _ = std::fs::remove_dir_all(&d);
    }

    /// A directory found once is found again without a search, if it is still there; one that
    /// moved is searched for (first below the directories already found).
    #[test]
    fn known_places_are_checked_then_used() {
        let (_scratch, d) = tmp("known");
        std::fs::create_dir_all(d.join("w/a/b")).unwrap();
        std::fs::write(d.join("w/a/b/f"), "x").unwrap();
        let mut c = Changes::default();
        changed(&mut c, &d, "w/a/b/f");
        let first = places(&c, &d, &[], &HashMap::new()).unwrap();
        let b = ino(&d.join("w/a/b"));
        assert_eq!(first.dirs.get(&b), Some(&PathBuf::from("w/a/b")));
        let file = d.join("known.json");
        save_known(&file, &HashMap::new(), &first.dirs);
        let known = load_known(&file);
        assert_eq!(known, first.dirs);
        // Known: only the file's directory is read.
        let again = places(&c, &d, &[], &known).unwrap();
        assert_eq!((again.single.clone(), again.read), (vec![PathBuf::from("w/a/b/f")], 1));
        // Changed itself (its times put back, say), its own directory unknown: still known.
        let mut c2 = c.clone();
        changed(&mut c2, &d, "w/a/b");
        let mut single = places(&c2, &d, &[], &known).unwrap().single;
        single.sort();
        assert_eq!(single, vec![PathBuf::from("w/a/b"), PathBuf::from("w/a/b/f")]);
        // Moved since: the known place is no longer it, and it is searched for.
        std::fs::rename(d.join("w/a"), d.join("w/z")).unwrap();
        let moved = places(&c, &d, &[], &known).unwrap();
        assert_eq!(moved.single, vec![PathBuf::from("w/z/b/f")]);
        assert_eq!(dirs_of(&d, &moved.single).get(&b), Some(&PathBuf::from("w/z/b")));
        let _ = std::fs::remove_dir_all(&d);
    }

    /// A directory found through the stream with hundreds of directories below it (the
    /// neighbours a stream carries) does not keep the search from the root's own directories.
    #[test]
    fn a_wide_found_directory_does_not_use_up_the_search() {
        let (_scratch, d) = tmp("wide");
        for i in 0..300 {
            std::fs::create_dir_all(d.join(format!("wide/d{i}"))).unwrap();
        }
        std::fs::create_dir_all(d.join("root")).unwrap();
        std::fs::write(d.join("root/.profile"), "x").unwrap();
        let mut c = Changes::default();
        for rel in ["", "wide", "wide/d7", "root/.profile"] {
            changed(&mut c, &d, rel);
        }
        let p = places(&c, &d, &[], &HashMap::new()).unwrap();
        assert!(p.single.contains(&PathBuf::from("root/.profile")), "{:?}", p.single);
        assert!(p.read <= SEARCH_BOUND, "{}", p.read);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn what_does_not_add_up_gives_no_answer() {
        let (_scratch, d) = tmp("doubt");
        std::fs::create_dir_all(d.join("a/b")).unwrap();
        std::fs::write(d.join("a/b/f"), "x").unwrap();
        let mut c = Changes::default();
        changed(&mut c, &d, "a/b/f");
        assert!(places(&c, &d, &[], &HashMap::new()).is_ok());
        // A znode that names a directory that does not hold the file.
        let f = ino(&d.join("a/b/f"));
        c.objects.insert(
            f,
            Object::File(Znode { parent: ino(&d.join("a")), links: 1, mode: 0o100644, xattr: false, ctime: 0 }),
        );
        assert!(places(&c, &d, &[], &HashMap::new()).is_err());
        // An object the stream wrote without its znode.
        let mut c = Changes::default();
        changed(&mut c, &d, "a/b/f");
        c.objects.insert(999_999_999, Object::Unknown);
        assert!(places(&c, &d, &[], &HashMap::new()).is_err());
        // A directory no search reaches: behind a mount point (not searched).
        let mut c = Changes::default();
        changed(&mut c, &d, "a/b/f");
        assert!(places(&c, &d, &[PathBuf::from("a")], &HashMap::new()).is_err());
        let _ = std::fs::remove_dir_all(&d);
    }
}

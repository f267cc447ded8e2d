//! What an incremental `zfs send` stream says changed, read from the stream itself: the objects
//! it carries and, for a file system's files and directories, the part of each one's znode
//! that places it (parent directory, links, type). The stream is read as it comes; file data
//! is skipped, never held.
//!
//! The format is the replay-record stream every ZFS sends (zfs-fuse's and OpenZFS's alike):
//! fixed 312-byte records, an OBJECT record followed by its bonus buffer (rounded up to 8
//! bytes), a WRITE or SPILL record by its data. A file system's bonus is either the legacy
//! `znode_phys_t` (fixed offsets) or a system-attribute buffer whose first attributes are, in
//! every layout a file system writes, mode, size, generation, uid, gid and parent.

use std::collections::HashMap;
use std::io::Read;

const RECORD: usize = 312;
const MAGIC: u64 = 0x2_F5BA_CBAC;

const DRR_BEGIN: u32 = 0;
const DRR_OBJECT: u32 = 1;
const DRR_FREEOBJECTS: u32 = 2;
const DRR_WRITE: u32 = 3;
const DRR_FREE: u32 = 4;
const DRR_END: u32 = 5;
const DRR_WRITE_BYREF: u32 = 6;
const DRR_SPILL: u32 = 7;
/// OpenZFS: embedded data, its payload rounded up to 8 bytes.
const DRR_WRITE_EMBEDDED: u32 = 8;
const DRR_OBJECT_RANGE: u32 = 9;

/// Bonus types: the legacy znode and system attributes.
const DMU_OT_ZNODE: u32 = 17;
/// Object types: a file's contents (regular files, symbolic links, devices) and a directory's.
const DMU_OT_PLAIN_FILE_CONTENTS: u32 = 19;
const DMU_OT_DIRECTORY_CONTENTS: u32 = 20;
const DMU_OT_SA: u32 = 44;
const SA_MAGIC: u32 = 0x2F505A;

const S_IFMT: u64 = 0o170000;
const S_IFDIR: u64 = 0o040000;

/// The part of a file's znode that says where it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Znode {
    /// The directory that holds it (for a file with several names, the one it was made in or
    /// last moved to); a file system's root is its own parent.
    pub parent: u64,
    pub links: u64,
    pub mode: u64,
    /// An extended attribute's directory or file (the hidden namespace a file's attributes
    /// live in, not the tree).
    pub xattr: bool,
    /// When its content or metadata last changed (seconds since the epoch, the host's clock).
    pub ctime: u64,
}

impl Znode {
    pub fn is_dir(&self) -> bool {
        self.mode & S_IFMT == S_IFDIR
    }
}

/// What a stream says of one object it carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Object {
    /// A file or directory, with its znode.
    File(Znode),
    /// An object of the file system's own (master node, unlinked set, ...): no file.
    System,
    /// A file or directory whose znode could not be read, or an object written or freed
    /// without an OBJECT record.
    Unknown,
}

/// The objects a stream carries.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Changes {
    pub objects: HashMap<u64, Object>,
}

#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error("reading the stream: {0}")]
    Io(#[from] std::io::Error),
    #[error("not a send stream this reader knows: {0}")]
    Format(String),
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Reads `n` bytes and throws them away.
fn skip(r: &mut impl Read, n: u64) -> std::io::Result<()> {
    let copied = std::io::copy(&mut r.take(n), &mut std::io::sink())?;
    if copied != n {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

/// A file or directory's placing fields, from its bonus buffer.
fn znode(bonustype: u32, bonus: &[u8]) -> Option<Znode> {
    let z = match bonustype {
        // znode_phys_t: atime, mtime, ctime (at 32), crtime (16 bytes each), gen at 64, mode 72,
        // size 80, parent 88, links 96, xattr 104, rdev 112, flags 120 (ZFS_XATTR is bit 0).
        DMU_OT_ZNODE if bonus.len() >= 128 => Znode {
            mode: u64_at(bonus, 72),
            parent: u64_at(bonus, 88),
            links: u64_at(bonus, 96),
            xattr: u64_at(bonus, 120) & 1 != 0,
            ctime: u64_at(bonus, 32),
        },
        DMU_OT_SA if bonus.len() >= 8 && u32_at(bonus, 0) == SA_MAGIC => {
            // sa_hdr_phys_t: magic, then layout (bits 0-9) and header size in 8-byte units
            // (bits 10-15), then the variable-size attributes' lengths.
            let info = u16::from_le_bytes([bonus[4], bonus[5]]);
            let hdr = usize::from(info >> 10) * 8;
            // mode, size, gen, uid, gid, parent, flags, atime, mtime, ctime, crtime (16 bytes
            // each of the times), links.
            let at = |i: usize| (bonus.len() >= hdr + i + 8).then(|| u64_at(bonus, hdr + i));
            Znode { mode: at(0)?, parent: at(40)?, links: at(120)?, xattr: at(48)? & 1 != 0, ctime: at(88)? }
        }
        _ => return None,
    };
    // A layout other than the one read would show here: a mode with no file type.
    let kind = z.mode & S_IFMT;
    let known = [0o010000, 0o020000, S_IFDIR, 0o060000, 0o100000, 0o120000, 0o140000];
    (known.contains(&kind) && z.parent != 0 && z.mode >> 16 == 0).then_some(z)
}

/// Reads a send stream to its END record.
pub fn read(mut r: impl Read) -> Result<Changes, StreamError> {
    let mut out = Changes::default();
    let mut rec = [0u8; RECORD];
    let mut begun = false;
    loop {
        r.read_exact(&mut rec)?;
        let (kind, payload) = (u32_at(&rec, 0), u32_at(&rec, 4));
        if !begun {
            if kind != DRR_BEGIN || u64_at(&rec, 8) != MAGIC {
                return Err(StreamError::Format("no BEGIN record with the (little-endian) magic".into()));
            }
            // Nested streams (a compound of several) are not read here.
            begun = true;
            skip(&mut r, payload.into())?;
            continue;
        }
        let object = u64_at(&rec, 8);
        match kind {
            DRR_OBJECT => {
                let (ot, bonustype, bonuslen) = (u32_at(&rec, 16), u32_at(&rec, 20), u32_at(&rec, 28) as usize);
                let mut bonus = vec![0u8; bonuslen.div_ceil(8) * 8];
                r.read_exact(&mut bonus)?;
                let seen = match ot {
                    DMU_OT_PLAIN_FILE_CONTENTS | DMU_OT_DIRECTORY_CONTENTS => {
                        znode(bonustype, &bonus[..bonuslen]).map_or(Object::Unknown, Object::File)
                    }
                    _ => Object::System,
                };
                out.objects.insert(object, seen);
            }
            DRR_WRITE => {
                out.objects.entry(object).or_insert(Object::Unknown);
                skip(&mut r, u64_at(&rec, 32))?;
            }
            DRR_SPILL => {
                out.objects.entry(object).or_insert(Object::Unknown);
                skip(&mut r, u64_at(&rec, 16))?;
            }
            DRR_WRITE_EMBEDDED => {
                out.objects.entry(object).or_insert(Object::Unknown);
                // (object, offset, length, toguid, compression and type, pad, lsize, then psize
                // at 52: the payload, rounded up to 8 bytes)
                skip(&mut r, u64::from(u32_at(&rec, 52)).div_ceil(8) * 8)?;
            }
            DRR_FREE | DRR_WRITE_BYREF => {
                out.objects.entry(object).or_insert(Object::Unknown);
            }
            // (OpenZFS's OBJECT_RANGE: no payload, no object of its own)
            DRR_FREEOBJECTS | DRR_OBJECT_RANGE => {}
            DRR_END => return Ok(out),
            DRR_BEGIN => return Err(StreamError::Format("a compound stream".into())),
            other => return Err(StreamError::Format(format!("record type {other}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(kind: u32, payload: u32, fields: &[(usize, u64)]) -> Vec<u8> {
        let mut r = vec![0u8; RECORD];
        r[0..4].copy_from_slice(&kind.to_le_bytes());
        r[4..8].copy_from_slice(&payload.to_le_bytes());
        for &(at, v) in fields {
            r[at..at + 8].copy_from_slice(&v.to_le_bytes());
        }
        r
    }

    fn object(obj: u64, ot: u32, bonustype: u32, bonus: &[u8]) -> Vec<u8> {
        let mut r = record(DRR_OBJECT, 0, &[(8, obj)]);
        r[16..20].copy_from_slice(&ot.to_le_bytes());
        r[20..24].copy_from_slice(&bonustype.to_le_bytes());
        r[28..32].copy_from_slice(&(bonus.len() as u32).to_le_bytes());
        r.extend_from_slice(bonus);
        r.resize(r.len() + bonus.len().div_ceil(8) * 8 - bonus.len(), 0);
        r
    }

    fn legacy(parent: u64, links: u64, mode: u64) -> Vec<u8> {
        let mut b = vec![0u8; 264];
        b[72..80].copy_from_slice(&mode.to_le_bytes());
        b[88..96].copy_from_slice(&parent.to_le_bytes());
        b[96..104].copy_from_slice(&links.to_le_bytes());
        b[120..128].copy_from_slice(&(1u64 << 32).to_le_bytes());
        b[32..40].copy_from_slice(&1_700_000_000u64.to_le_bytes());
        b
    }

    fn sa(parent: u64, links: u64, mode: u64) -> Vec<u8> {
        // An 8-byte header (layout 2), then the attributes; an odd length, as symbolic links have.
        let mut b = vec![0u8; 8 + 168 + 3];
        b[0..4].copy_from_slice(&SA_MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&((1u16 << 10) | 2).to_le_bytes());
        b[8..16].copy_from_slice(&mode.to_le_bytes());
        b[48..56].copy_from_slice(&parent.to_le_bytes());
        b[128..136].copy_from_slice(&links.to_le_bytes());
        b[96..104].copy_from_slice(&1_700_000_001u64.to_le_bytes());
        b
    }

    #[test]
    fn objects_and_their_places() {
        let mut s = record(DRR_BEGIN, 0, &[(8, MAGIC)]);
        s.extend(object(34, 19, DMU_OT_ZNODE, &legacy(4, 1, 0o100644)));
        s.extend(object(35, 20, DMU_OT_SA, &sa(34, 2, 0o040755)));
        // The master node (a ZAP, no bonus) and the same again with one.
        s.extend(object(1, 21, 0, &[]));
        s.extend(object(2, 22, 0, &[7u8; 12]));
        let mut w = record(DRR_WRITE, 0, &[(8, 34), (24, 0), (32, 4096)]);
        w.extend(vec![0xaa; 4096]);
        s.extend(w);
        s.extend(record(DRR_WRITE, 0, &[(8, 36), (24, 0), (32, 0)]));
        s.extend(record(DRR_FREE, 0, &[(8, 37), (16, 512), (24, u64::MAX)]));
        s.extend(record(DRR_FREEOBJECTS, 0, &[(8, 38), (16, 100)]));
        s.extend(record(DRR_END, 0, &[]));
        // (anything after END is not read)
        s.extend([1, 2, 3]);
        let c = read(&s[..]).unwrap();
        let mut got: Vec<_> = c.objects.into_iter().collect();
        got.sort_by_key(|(o, _)| *o);
        assert_eq!(
            got,
            vec![
                (1, Object::System),
                (2, Object::System),
                (34, Object::File(Znode { parent: 4, links: 1, mode: 0o100644, xattr: false, ctime: 1_700_000_000 })),
                (35, Object::File(Znode { parent: 34, links: 2, mode: 0o040755, xattr: false, ctime: 1_700_000_001 })),
                (36, Object::Unknown),
                (37, Object::Unknown),
            ]
        );
        assert!(
            matches!(got[2].1, Object::File(z) if !z.is_dir()) && matches!(got[3].1, Object::File(z) if z.is_dir())
        );
        // An extended attributes' directory: ZFS_XATTR in its flags.
        let mut b = legacy(34, 2, 0o040755);
        b[120..128].copy_from_slice(&1u64.to_le_bytes());
        let mut s = record(DRR_BEGIN, 0, &[(8, MAGIC)]);
        s.extend(object(50, 20, DMU_OT_ZNODE, &b));
        s.extend(record(DRR_END, 0, &[]));
        assert_eq!(
            read(&s[..]).unwrap().objects[&50],
            Object::File(Znode { parent: 34, links: 2, mode: 0o040755, xattr: true, ctime: 1_700_000_000 })
        );
    }

    #[test]
    fn what_it_cannot_read_is_an_error_or_no_znode() {
        // No magic; cut short; a bonus whose mode has no file type (another layout).
        assert!(read(&record(DRR_BEGIN, 0, &[])[..]).is_err());
        let mut s = record(DRR_BEGIN, 0, &[(8, MAGIC)]);
        s.extend(object(34, 19, DMU_OT_ZNODE, &legacy(4, 1, 0o100644)));
        assert!(matches!(read(&s[..]), Err(StreamError::Io(_))));
        s.extend(object(40, 19, DMU_OT_SA, &sa(4, 1, 0o644)));
        s.extend(record(DRR_END, 0, &[]));
        let c = read(&s[..]).unwrap();
        assert_eq!(c.objects[&40], Object::Unknown);
        assert!(matches!(c.objects[&34], Object::File(_)));
    }
}

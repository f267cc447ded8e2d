//! `compensate N`, phase by phase, in one transaction: read the undo entries after N (newest
//! first, locked), undo each — a DDL by its inverse, a row by its before-image, through the
//! relation it lived in — then verify that every row is what the compensation promised, and only
//! then delete the entries and commit. Any conflict or surprise fails the whole of it, changing
//! nothing.

use super::{contents, key_match, key_text, pe};
use crate::error::{Error, Result};
use crate::sql::{quote_ident, quote_literal, UNDO_SCHEMA};
use postgres::Transaction;
use serde_json::Value;
use std::collections::HashMap;

/// One entry of the undo log.
pub(super) struct Entry {
    pos: i64,
    /// The table the statement named.
    tbl: String,
    /// The row before and after the call (None: absent); both None for a branch's mark.
    before: Option<Value>,
    after: Option<Value>,
    /// A DDL's inverse statement.
    inverse: Option<String>,
    /// The relation the row really lived in (a child, a partition), when recorded.
    rel: Option<String>,
    /// What a table created filled held, for `CREATE TABLE … AS`.
    filled: Option<String>,
}

/// What a compensation promises of one row, found by key in the relation it was changed
/// through.
struct Promise {
    /// The position whose undo has the last word on it.
    pos: i64,
    /// `ONLY ` when the relation is the row's own (not a partitioned table routing to it).
    only: &'static str,
    /// The relation the row must live in (None: not recorded, by a proxy before they were).
    home: Option<String>,
    /// The row as it must be; None: no row with that key.
    want: Option<Value>,
    /// An image carrying its key.
    image: Value,
}

/// Where a row is changed: the relation, `ONLY ` or not, and the relation it must live in.
struct Place {
    target: String,
    only: &'static str,
    home: Option<String>,
}

pub(super) struct Compensation<'c> {
    tx: Transaction<'c>,
    position: u64,
    /// Each relation's writable columns and primary key, asked once.
    tables: HashMap<String, (Vec<String>, Vec<String>)>,
    partitioned: HashMap<String, bool>,
    /// What each undone row must be once every entry is applied: the before-image of its
    /// oldest entry (None: absent), by the relation it lived in and its key.
    promised: HashMap<(String, String), Promise>,
}

impl<'c> Compensation<'c> {
    pub(super) fn new(tx: Transaction<'c>, position: u64) -> Self {
        Compensation { tx, position, tables: HashMap::new(), partitioned: HashMap::new(), promised: HashMap::new() }
    }

    /// The entries after the position, newest first, locked.
    pub(super) fn entries(&mut self) -> Result<Vec<Entry>> {
        let rows = self
            .tx
            .query(
                &format!(
                    "SELECT position, seq, tbl, before, after, ddl, rel, content FROM {UNDO_SCHEMA}.undo WHERE position > $1
                     ORDER BY position DESC, stmt DESC, seq DESC FOR UPDATE"
                ),
                &[&(self.position as i64)],
            )
            ?;
        Ok(rows
            .iter()
            .map(|e| Entry {
                pos: e.get(0),
                tbl: e.get(2),
                before: e.get(3),
                after: e.get(4),
                inverse: e.get(5),
                rel: e.get(6),
                filled: e.get(7),
            })
            .collect())
    }

    /// Undoes one entry, and records what it promises of the rows it touched.
    pub(super) fn undo(&mut self, e: &Entry) -> Result<()> {
        if let Some(inverse) = &e.inverse {
            return self.undo_ddl(e, inverse);
        }
        if e.before.is_none() && e.after.is_none() {
            // (a mark: where a copied database branched off)
            return Ok(());
        }
        let place = self.place_of(e)?;
        let (cols, keys) = self.table(&place.target, e.pos)?;
        self.undo_row(e, &place, &cols, &keys)?;
        // Undoing this entry leaves no row under its after-key (an UPDATE of key values moved
        // it away), and the before-image under its before-key; older entries, undone later,
        // have the last word on each key.
        if let Some(after) = &e.after {
            self.promised.insert(
                (place.target.clone(), key_text(&keys, after)),
                Promise { pos: e.pos, only: place.only, home: place.home.clone(), want: None, image: after.clone() },
            );
        }
        if let Some(before) = &e.before {
            self.promised.insert(
                (place.target.clone(), key_text(&keys, before)),
                Promise {
                    pos: e.pos,
                    only: place.only,
                    home: place.home,
                    want: Some(before.clone()),
                    image: before.clone(),
                },
            );
        }
        Ok(())
    }

    /// A DDL undone by its inverse. A table the agent created is dropped only when it holds
    /// nothing the agent's own recorded calls did not put there (those were undone just before):
    /// no rows, or exactly those the creating statement filled it with.
    fn undo_ddl(&mut self, e: &Entry, inverse: &str) -> Result<()> {
        if let Some(table) = inverse.strip_prefix("DROP TABLE IF EXISTS ") {
            let tx = &mut self.tx;
            let exists: bool =
                tx.query_one(&format!("SELECT to_regclass({}) IS NOT NULL", quote_literal(table)), &[])?.get(0);
            let foreign = exists
                && match &e.filled {
                    Some(filled) => tx.query_one(&contents(table), &[])?.get::<_, String>(0) != *filled,
                    None => tx.query_one(&format!("SELECT EXISTS (SELECT 1 FROM {table})"), &[])?.get::<_, bool>(0),
                };
            if foreign {
                return Err(Error::Conflict(format!(
                    "{table}, created by the call at position {}, holds rows no recorded call put there; nothing was undone",
                    e.pos
                )));
            }
        }
        self.tx.batch_execute(inverse).map_err(|err| {
            Error::Conflict(format!("cannot undo {} (position {}): {}; nothing was undone", e.tbl, e.pos, pe(err)))
        })
    }

    /// The relation the row really lived in (an inheritance child, a partition), and only it: a
    /// descendant's row with the same key is another row. A partitioned table's row is changed
    /// through the table, which routes it back to the partition it lived in (an UPDATE of its key
    /// may have moved it). (Records written before the proxy knew where rows live name only the
    /// table the statement named.)
    fn place_of(&mut self, e: &Entry) -> Result<Place> {
        let partitioned = match self.partitioned.get(&e.tbl) {
            Some(p) => *p,
            None => {
                let p: bool = self
                    .tx
                    .query_one(
                        "SELECT coalesce((SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass($1)), false)",
                        &[&e.tbl],
                    )?
                    .get(0);
                self.partitioned.insert(e.tbl.clone(), p);
                p
            }
        };
        Ok(match &e.rel {
            Some(rel) if partitioned => Place { target: e.tbl.clone(), only: "", home: Some(rel.clone()) },
            Some(rel) => Place { target: rel.clone(), only: "ONLY ", home: Some(rel.clone()) },
            // (where it lived is not known: anywhere the named table reaches)
            None => Place { target: e.tbl.clone(), only: "", home: None },
        })
    }

    /// A relation's writable columns and primary key (asked once per compensation).
    fn table(&mut self, target: &str, pos: i64) -> Result<(Vec<String>, Vec<String>)> {
        if let Some(t) = self.tables.get(target) {
            return Ok(t.clone());
        }
        let cols = self.tx.query(
            "SELECT attname::text, attgenerated::text, attidentity::text FROM pg_attribute
                 WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
            &[&target],
        )?;
        if cols.is_empty() {
            return Err(Error::Refused(format!("{target} no longer exists: cannot undo position {pos}")));
        }
        let writable: Vec<String> =
            cols.iter().filter(|r| r.get::<_, String>(1).is_empty()).map(|r| r.get::<_, String>(0)).collect();
        let keys: Vec<String> = self
            .tx
            .query(
                "SELECT a.attname::text FROM pg_index i
                 CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
                 JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
                 WHERE i.indrelid = to_regclass($1) AND i.indisprimary ORDER BY k.ord",
                &[&target],
            )?
            .iter()
            .map(|r| r.get::<_, String>(0))
            .collect();
        if keys.is_empty() {
            return Err(Error::Refused(format!("{target} has lost its primary key: cannot undo position {pos}")));
        }
        self.tables.insert(target.to_string(), (writable.clone(), keys.clone()));
        Ok((writable, keys))
    }

    /// The row put back: an insert deleted, an update reverted, a delete re-inserted — each only
    /// when the row is still exactly as the call left it.
    fn undo_row(&mut self, e: &Entry, place: &Place, cols: &[String], keys: &[String]) -> Result<()> {
        let Place { target, only, .. } = place;
        let qcols: Vec<String> = cols.iter().map(|c| quote_ident(c)).collect();
        let from_image = qcols.iter().map(|c| format!("r.{c}")).collect::<Vec<_>>().join(", ");
        let key_match = |img: &str| key_match(keys, target, img);
        let conflict = |what: &str, img: &Value| {
            Error::Conflict(format!(
                "the row of {target} with {} {what} since the call at position {}; nothing was undone",
                key_text(keys, img),
                e.pos
            ))
        };
        match (&e.before, &e.after) {
            (None, Some(after)) => {
                let sql = format!("DELETE FROM {only}{target} o WHERE {} AND to_jsonb(o.*) = $1", key_match("$1"));
                if self.tx.execute(&sql, &[after])? != 1 {
                    return Err(conflict("was changed or removed", after));
                }
            }
            (Some(before), Some(after)) => {
                let sql = format!(
                    "UPDATE {only}{target} o SET ({}) = (SELECT {from_image} FROM jsonb_populate_record(NULL::{target}, $2) AS r)
                     WHERE {} AND to_jsonb(o.*) = $1",
                    qcols.join(", "),
                    key_match("$1")
                );
                if self.tx.execute(&sql, &[after, before])? != 1 {
                    return Err(conflict("was changed or removed", after));
                }
            }
            (Some(before), None) => {
                let sql = format!(
                    "INSERT INTO {target} ({}) OVERRIDING SYSTEM VALUE SELECT {from_image} FROM jsonb_populate_record(NULL::{target}, $1) AS r",
                    qcols.join(", ")
                );
                match self.tx.execute(&sql, &[before]) {
                    Ok(_) => {}
                    Err(err) if err.code().is_some_and(|c| c.code() == "23505") => {
                        return Err(conflict("was inserted again", before))
                    }
                    Err(err) => return Err(err.into()),
                }
            }
            (None, None) => unreachable!("marks are skipped before"),
        }
        Ok(())
    }

    /// Verifies what was promised: every row back in the relation it lived in, exactly as it
    /// was, and every row the agent added gone. A trigger, rule or anything else that sent a row
    /// elsewhere makes the whole compensation fail, never report success.
    pub(super) fn verify(&mut self) -> Result<()> {
        for ((target, key), p) in &self.promised {
            let (_, keys) = &self.tables[target];
            let row = self
                .tx
                .query_one(
                    &format!(
                        "SELECT count(*), count(*) FILTER (WHERE to_jsonb(o.*) = $2 AND ($3::text IS NULL OR o.tableoid = to_regclass($3))) FROM {}{target} o WHERE {}",
                        p.only,
                        key_match(keys, target, "$1")
                    ),
                    &[&p.image, &p.want, &p.home],
                )
                ?;
            let (found, same): (i64, i64) = (row.get(0), row.get(1));
            let ok = match p.want {
                Some(_) => found == 1 && same == 1,
                None => found == 0,
            };
            if !ok {
                let home = p.home.as_deref().unwrap_or(target);
                let what = match (&p.want, found) {
                    (Some(_), 0) => format!("is not back in {home}"),
                    (Some(_), _) => {
                        format!("is not back in {home} as it was ({found} rows with its key, {same} as they were)")
                    }
                    (None, _) => "is still there".to_string(),
                };
                return Err(Error::Refused(format!(
                    "undoing the calls after position {} did not restore what it promised: the row of {target} with {key} {what} (undoing position {}); nothing was undone",
                    self.position, p.pos
                )));
            }
        }
        Ok(())
    }

    /// The entries undone are gone from the log, with everything else, in one commit.
    pub(super) fn commit(mut self) -> Result<()> {
        self.tx.execute(&format!("DELETE FROM {UNDO_SCHEMA}.undo WHERE position > $1"), &[&(self.position as i64)])?;
        Ok(self.tx.commit()?)
    }
}

//! The proxy's own connection to the database: the undo log's schema, catalog look-ups for the
//! rewrite, and compensation — each compensation in one real transaction.

use crate::error::{Error, Result};
use crate::sql::{quote_ident, Ddl, Descendant, Object, TableInfo, UNDO_SCHEMA};
use postgres::{Client, NoTls};
use std::process::{Command, Stdio};

mod compensation;

pub struct Db {
    client: Client,
    /// table_info's one catalog query, prepared once (a write's lookup is one round trip).
    table_info: Option<postgres::Statement>,
    /// What the catalog said, kept while no DDL has run since (None: not kept, every write
    /// asks; see `watch_catalog`).
    cache: Option<Cache>,
}

/// Catalog answers, all as of one generation of the catalog (`planarian.catalog`, counted up
/// by an event trigger at every DDL).
#[derive(Default)]
struct Cache {
    generation: i64,
    tables: std::collections::HashMap<String, TableInfo>,
}

/// Volatile functions whose only effect is their result: harmless in a recorded change.
const HARMLESS_VOLATILE: &[&str] =
    &["random", "clock_timestamp", "timeofday", "gen_random_uuid", "txid_current", "pg_sleep"];

/// PostgreSQL's own words for an error of the proxy's connection, for a message of the proxy's.
fn pe(e: postgres::Error) -> String {
    match e.as_db_error() {
        Some(d) => d.message().to_string(),
        None => e.to_string(),
    }
}

/// `(o.k1, o.k2) = (the key of the jsonb image $n)`, for a row `o` of `rel`.
fn key_match(keys: &[String], rel: &str, img: &str) -> String {
    let k: Vec<String> = keys.iter().map(|k| quote_ident(k)).collect();
    format!(
        "({}) = (SELECT {} FROM jsonb_populate_record(NULL::{rel}, {img}) AS r)",
        k.iter().map(|c| format!("o.{c}")).collect::<Vec<_>>().join(", "),
        k.iter().map(|c| format!("r.{c}")).collect::<Vec<_>>().join(", ")
    )
}

/// `id=3, region="eu"`: a row's key, as messages name it.
fn key_text(keys: &[String], img: &serde_json::Value) -> String {
    keys.iter()
        .map(|k| format!("{k}={}", img.get(k).map(|v| v.to_string()).unwrap_or_default()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A libpq connection string for `config` (for pg_dump and pg_restore).
pub fn conninfo(config: &postgres::Config) -> String {
    let q = |v: &str| format!("'{}'", v.replace('\\', "\\\\").replace('\'', "\\'"));
    let mut parts = Vec::new();
    if let Some(h) = config.get_hosts().first() {
        parts.push(format!(
            "host={}",
            q(&match h {
                postgres::config::Host::Tcp(h) => h.clone(),
                postgres::config::Host::Unix(p) => p.display().to_string(),
            })
        ));
    }
    if let Some(p) = config.get_ports().first() {
        parts.push(format!("port={p}"));
    }
    if let Some(u) = config.get_user() {
        parts.push(format!("user={}", q(u)));
    }
    if let Some(pw) = config.get_password() {
        parts.push(format!("password={}", q(&String::from_utf8_lossy(pw))));
    }
    if let Some(d) = config.get_dbname() {
        parts.push(format!("dbname={}", q(d)));
    }
    parts.join(" ")
}

/// Copies the database of `from` into the (empty) one of `to`: pg_dump's consistent snapshot,
/// restored in one transaction; any error fails the copy.
pub fn copy_database(from: &postgres::Config, to: &postgres::Config, major: i32) -> Result<()> {
    let tool = |name: &str| {
        let versioned = std::path::PathBuf::from(format!("/usr/lib/postgresql/{major}/bin/{name}"));
        if versioned.exists() {
            versioned
        } else {
            std::path::PathBuf::from(format!("/usr/bin/{name}"))
        }
    };
    let mut dump = Command::new(tool("pg_dump"))
        .args(["--format=custom", "--no-sync", "--dbname"])
        .arg(conninfo(from))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(Error::file("run", tool("pg_dump")))?;
    let restore = Command::new(tool("pg_restore"))
        .args(["--exit-on-error", "--single-transaction", "--dbname"])
        .arg(conninfo(to))
        .stdin(dump.stdout.take().expect("piped"))
        .output()
        .map_err(Error::file("run", tool("pg_restore")))?;
    let dumped = dump.wait_with_output().map_err(Error::file("wait for", tool("pg_dump")))?;
    let last = |b: &[u8]| String::from_utf8_lossy(b).lines().last().unwrap_or("no message").trim().to_string();
    if !dumped.status.success() {
        return Err(Error::Postgres(format!("pg_dump failed: {}", last(&dumped.stderr))));
    }
    if !restore.status.success() {
        return Err(Error::Postgres(format!("pg_restore failed: {}", last(&restore.stderr))));
    }
    Ok(())
}

/// A query for a digest of everything `table` holds, in any order.
fn contents(table: &str) -> String {
    format!("SELECT count(*) || ':' || md5(coalesce(string_agg(to_jsonb(x.*)::text, E'\\n' ORDER BY to_jsonb(x.*)::text), '')) FROM {table} x")
}

/// One row of table_info's list of descendants.
fn descendant(v: &serde_json::Value) -> Descendant {
    let strings = |k: &str| -> Vec<String> {
        v[k].as_array().map(|a| a.iter().filter_map(|x| x.as_str().map(String::from)).collect()).unwrap_or_default()
    };
    let name = v["name"].as_str().unwrap_or_default().to_string();
    let mut problems = Vec::new();
    if !matches!(v["kind"].as_str(), Some("r" | "p")) {
        problems.push(format!("{name} is not a plain table"));
    }
    if v["rules"].as_bool() == Some(true) {
        problems.push(format!("rules rewrite statements on {name}"));
    }
    for t in strings("triggers") {
        problems.push(format!("trigger {t} runs on {name}"));
    }
    for fk in strings("fks") {
        problems.push(format!("{fk} cascades changes to {name}"));
    }
    Descendant {
        oid: v["oid"].as_u64().unwrap_or_default() as u32,
        qualified: name,
        primary_key: strings("key"),
        problems,
    }
}

/// What the proxy needs to know of a table to rewrite a write on it (`$1`: its name; `$2`:
/// whether the catalog's generation is watched): its qualified name, kind, rules, columns,
/// primary key, triggers, the foreign keys that cascade to it, its OID, its descendants (of
/// inheritance or partitioning) with the same facts, and the catalog's generation.
const TABLE_INFO: &str = "WITH RECURSIVE d(oid) AS (
                           SELECT inhrelid FROM pg_inherits WHERE inhparent = to_regclass($1)
                           UNION SELECT i.inhrelid FROM pg_inherits i JOIN d ON i.inhparent = d.oid)
                         SELECT format('%I.%I', n.nspname, c.relname), c.relkind::text, c.relhasrules,
                           ARRAY(SELECT attname::text FROM pg_attribute
                                 WHERE attrelid = c.oid AND attnum > 0 AND NOT attisdropped ORDER BY attnum),
                           ARRAY(SELECT a.attname::text FROM pg_index i
                                 CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
                                 JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
                                 WHERE i.indrelid = c.oid AND i.indisprimary ORDER BY k.ord),
                           ARRAY(SELECT tgname::text FROM pg_trigger WHERE tgrelid = c.oid AND NOT tgisinternal ORDER BY tgname),
                           ARRAY(SELECT format('foreign key %s of %s', conname, conrelid::regclass) FROM pg_constraint
                                 WHERE contype = 'f' AND confrelid = c.oid
                                   AND (confdeltype IN ('c','n','d') OR confupdtype IN ('c','n','d')) ORDER BY conname),
                           c.oid::bigint,
                           (SELECT coalesce(jsonb_agg(jsonb_build_object(
                              'oid', dc.oid::bigint, 'name', format('%I.%I', dn.nspname, dc.relname), 'kind', dc.relkind::text,
                              'rules', dc.relhasrules,
                              'key', ARRAY(SELECT a.attname::text FROM pg_index i
                                           CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, ord)
                                           JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
                                           WHERE i.indrelid = dc.oid AND i.indisprimary ORDER BY k.ord),
                              'triggers', ARRAY(SELECT tgname::text FROM pg_trigger WHERE tgrelid = dc.oid AND NOT tgisinternal ORDER BY tgname),
                              'fks', ARRAY(SELECT format('foreign key %s of %s', conname, conrelid::regclass) FROM pg_constraint
                                           WHERE contype = 'f' AND confrelid = dc.oid
                                             AND (confdeltype IN ('c','n','d') OR confupdtype IN ('c','n','d')) ORDER BY conname))
                              ORDER BY dc.oid), '[]'::jsonb)
                            FROM d JOIN pg_class dc ON dc.oid = d.oid JOIN pg_namespace dn ON dn.oid = dc.relnamespace)
                         , (SELECT max(generation) FROM planarian.catalog WHERE $2)
                         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass($1)";

impl Db {
    pub fn connect(config: &postgres::Config) -> Result<Db> {
        let client =
            config.connect(NoTls).map_err(|e| Error::Postgres(format!("cannot connect to the database: {}", pe(e))))?;
        let mut db = Db { client, table_info: None, cache: None };
        db.client
            .batch_execute(&format!(
                "CREATE SCHEMA IF NOT EXISTS {UNDO_SCHEMA};
                 CREATE TABLE IF NOT EXISTS {UNDO_SCHEMA}.undo (
                     position bigint NOT NULL, stmt int NOT NULL, seq bigint NOT NULL, tbl text NOT NULL,
                     before jsonb, after jsonb, ddl text, PRIMARY KEY (position, stmt, seq));
                 ALTER TABLE {UNDO_SCHEMA}.undo ADD COLUMN IF NOT EXISTS rel text;
                 ALTER TABLE {UNDO_SCHEMA}.undo ADD COLUMN IF NOT EXISTS content text;
                 CREATE TABLE IF NOT EXISTS {UNDO_SCHEMA}.catalog (generation bigint NOT NULL);
                 INSERT INTO {UNDO_SCHEMA}.catalog SELECT 0 WHERE NOT EXISTS (SELECT FROM {UNDO_SCHEMA}.catalog)"
            ))
            .or_else(|e| {
                // Two proxies creating the schema at once: the loser's error is harmless.
                if e.code().is_some_and(|c| c.code() == "23505" || c.code() == "42P06" || c.code() == "42P07") {
                    Ok(())
                } else {
                    Err(Error::Postgres(format!("cannot create the undo log {UNDO_SCHEMA}.undo: {}", pe(e))))
                }
            })?;
        db.watch_catalog();
        Ok(db)
    }

    /// Keeps catalog answers between writes when every DDL in the database is counted: event
    /// triggers (which only a superuser can create) count `planarian.catalog.generation` up at
    /// the end of each DDL command and each drop, in the DDL's own transaction. A write rewritten
    /// from kept answers carries their generation and fails, changing nothing, when the catalog
    /// has moved on since (see `sql::Dml::rewrite`); the proxy then asks again and resends it.
    /// Without the triggers every write asks the catalog, as before.
    fn watch_catalog(&mut self) {
        let installed = (|| -> Result<(), postgres::Error> {
            let exists: bool = self
                .client
                .query_one(
                    "SELECT count(*) = 2 FROM pg_event_trigger
                     WHERE evtname IN ('planarian_catalog', 'planarian_catalog_drop') AND evtenabled <> 'D'",
                    &[],
                )?
                .get(0);
            if !exists {
                self.client.batch_execute(&format!(
                    "BEGIN;
                     CREATE OR REPLACE FUNCTION {UNDO_SCHEMA}.catalog_changed() RETURNS event_trigger LANGUAGE plpgsql
                       AS $$ BEGIN UPDATE {UNDO_SCHEMA}.catalog SET generation = generation + 1; END $$;
                     DROP EVENT TRIGGER IF EXISTS planarian_catalog;
                     DROP EVENT TRIGGER IF EXISTS planarian_catalog_drop;
                     CREATE EVENT TRIGGER planarian_catalog ON ddl_command_end EXECUTE FUNCTION {UNDO_SCHEMA}.catalog_changed();
                     CREATE EVENT TRIGGER planarian_catalog_drop ON sql_drop EXECUTE FUNCTION {UNDO_SCHEMA}.catalog_changed();
                     COMMIT;"
                ))?;
            }
            Ok(())
        })();
        match installed {
            Ok(()) => self.cache = Some(Cache::default()),
            Err(_) => {
                // (not a superuser, or another proxy installing them at this moment)
                let _ = self.client.batch_execute("ROLLBACK");
            }
        }
    }

    /// The database's name and size in bytes, and the server's major version.
    pub fn describe(&mut self) -> Result<(String, i64, i32)> {
        let r = self
            .client
            .query_one("SELECT current_database()::text, pg_database_size(current_database()), current_setting('server_version_num')::int / 10000", &[])
            ?;
        Ok((r.get(0), r.get(1), r.get(2)))
    }

    /// Creates an empty database `name` (owned by this connection's role).
    pub fn create_database(&mut self, name: &str) -> Result<()> {
        self.client.batch_execute(&format!("CREATE DATABASE {} TEMPLATE template0", quote_ident(name))).map_err(|e| {
            match e.code() {
                Some(c) if c.code() == "42P04" => Error::Refused(format!("a database {name} exists already")),
                _ => Error::Postgres(format!("cannot create the database {name}: {}", pe(e))),
            }
        })
    }

    pub fn drop_database(&mut self, name: &str) -> Result<()> {
        self.client
            .batch_execute(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", quote_ident(name)))
            .map_err(Error::from)
    }

    /// Marks the branch point of a database copied from another at `position`: the copy's
    /// positions go on from there (a position that changed nothing left no undo row).
    pub fn mark_branch(&mut self, position: u64) -> Result<()> {
        self.client
            .execute(
                &format!("INSERT INTO {UNDO_SCHEMA}.undo (position, stmt, seq, tbl) VALUES ($1, -1, 0, 'branch') ON CONFLICT DO NOTHING"),
                &[&(position as i64)],
            )
            ?;
        Ok(())
    }

    /// Forgets every catalog answer (after DDL through the proxy itself).
    pub fn catalog_changed(&mut self) {
        if let Some(c) = self.cache.as_mut() {
            *c = Cache::default();
        }
    }

    /// The inverse of a DDL statement about to run, or None when it creates nothing (the object
    /// exists: IF NOT EXISTS makes it a no-op, otherwise the server refuses it).
    pub fn ddl_inverse(&mut self, d: &Ddl) -> Result<Option<String>> {
        let schema = |s: &Option<String>, c: &mut Client| -> Result<String> {
            match s {
                Some(s) => Ok(s.clone()),
                None => Ok(c.query_one("SELECT current_schema()::text", &[])?.get(0)),
            }
        };
        let rel_exists = |c: &mut Client, name: &str| -> Result<bool> {
            Ok(c.query_one("SELECT to_regclass($1) IS NOT NULL", &[&name])?.get(0))
        };
        let q = |s: &str, n: &str| format!("{}.{}", quote_ident(s), quote_ident(n));
        let c = &mut self.client;
        Ok(match &d.object {
            Object::Table { schema: s, name } => {
                let full = q(&schema(s, c)?, name);
                (!rel_exists(c, &full)?).then(|| format!("DROP TABLE IF EXISTS {full}"))
            }
            Object::Index { schema: s, name } => {
                let full = q(&schema(s, c)?, name);
                (!rel_exists(c, &full)?).then(|| format!("DROP INDEX IF EXISTS {full}"))
            }
            Object::View { schema: s, name, replace } => {
                let full = q(&schema(s, c)?, name);
                match (rel_exists(c, &full)?, replace) {
                    (true, true) => {
                        return Err(Error::Refused(format!(
                            "CREATE OR REPLACE VIEW over the existing view {full} cannot be undone: create a new view"
                        )))
                    }
                    (true, false) => None,
                    (false, _) => Some(format!("DROP VIEW IF EXISTS {full}")),
                }
            }
            Object::Schema { name } => {
                let exists: bool =
                    c.query_one("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)", &[name])?.get(0);
                (!exists).then(|| format!("DROP SCHEMA IF EXISTS {}", quote_ident(name)))
            }
            Object::Column { schema: s, table, column } => {
                let full = q(&schema(s, c)?, table);
                let exists: bool = c
                    .query_one(
                        "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = $2 AND NOT attisdropped)",
                        &[&full, column],
                    )
                    ?
                    .get(0);
                (!exists).then(|| format!("ALTER TABLE IF EXISTS {full} DROP COLUMN IF EXISTS {}", quote_ident(column)))
            }
        })
    }

    /// Records a DDL statement's inverse before the statement is sent (its own transaction: DDL
    /// cannot join the agent's). A crash before the statement ran leaves an inverse that does
    /// nothing (IF EXISTS); the object did not exist before, so dropping it is always right.
    pub fn record_ddl(&mut self, position: u64, what: &str, inverse: &str) -> Result<()> {
        self.client.execute(
            &format!("INSERT INTO {UNDO_SCHEMA}.undo (position, stmt, seq, tbl, ddl) VALUES ($1, 0, 0, $2, $3)"),
            &[&(position as i64), &what, &inverse],
        )?;
        Ok(())
    }

    /// Records what a table the call just created and filled holds (`CREATE TABLE … AS`): undo
    /// drops it only while it holds exactly that.
    pub fn record_contents(&mut self, position: u64, inverse: &str) -> Result<()> {
        let Some(table) = inverse.strip_prefix("DROP TABLE IF EXISTS ") else { return Ok(()) };
        self.client.execute(
            &format!("UPDATE {UNDO_SCHEMA}.undo SET content = ({}) WHERE position = $1 AND seq = 0", contents(table)),
            &[&(position as i64)],
        )?;
        Ok(())
    }

    /// Forgets a DDL record whose statement failed.
    pub fn forget(&mut self, position: u64) -> Result<()> {
        self.client.execute(&format!("DELETE FROM {UNDO_SCHEMA}.undo WHERE position = $1"), &[&(position as i64)])?;
        Ok(())
    }

    /// How many calls after position `from`, up to `to`, changed something (those a rollback
    /// undid are gone from the log), and the tables (and, for DDL, `schema change`) they changed.
    pub fn changes_between(&mut self, from: u64, to: u64) -> Result<(u64, Vec<String>)> {
        let calls = self
            .client
            .query_one(
                &format!(
                    "SELECT count(DISTINCT position) FROM {UNDO_SCHEMA}.undo WHERE position > $1 AND position <= $2"
                ),
                &[&(from as i64), &(to as i64)],
            )?
            .get::<_, i64>(0) as u64;
        let rows = self.client.query(
            &format!(
                "SELECT DISTINCT CASE WHEN ddl IS NULL THEN tbl ELSE 'schema change' END FROM {UNDO_SCHEMA}.undo
                     WHERE position > $1 AND position <= $2 ORDER BY 1"
            ),
            &[&(from as i64), &(to as i64)],
        )?;
        // Names as psql shows them: a table of the default schema without it.
        let name = |t: String| t.strip_prefix("public.").map(String::from).unwrap_or(t);
        let mut tables: Vec<String> = rows.iter().map(|r| name(r.get::<_, String>(0))).collect();
        tables.dedup();
        Ok((calls, tables))
    }

    /// The highest position with undo rows (0 when none).
    pub fn max_position(&mut self) -> Result<u64> {
        let row = self.client.query_one(&format!("SELECT coalesce(max(position), 0) FROM {UNDO_SCHEMA}.undo"), &[])?;
        Ok(row.get::<_, i64>(0) as u64)
    }

    /// What a write to `name` needs to know, in one catalog query: its columns and primary key,
    /// and what would make its changes uncompensable (not a plain table, rules, user triggers,
    /// foreign keys of other tables that cascade changes to it).
    pub fn table_info(&mut self, name: &str) -> Result<TableInfo> {
        if let Some(t) = self.cache.as_ref().and_then(|c| c.tables.get(name)) {
            return Ok(t.clone());
        }
        let t = self.ask_table_info(name)?;
        if let (Some(c), Some(g)) = (self.cache.as_mut(), t.catalog_generation) {
            if g != c.generation {
                *c = Cache { generation: g, ..Default::default() };
            }
            c.tables.insert(name.to_string(), t.clone());
        }
        Ok(t)
    }

    fn ask_table_info(&mut self, name: &str) -> Result<TableInfo> {
        let stmt = match &self.table_info {
            Some(s) => s.clone(),
            None => {
                let s = self.client.prepare(TABLE_INFO)?;
                self.table_info = Some(s.clone());
                s
            }
        };
        let watched = self.cache.is_some();
        let rows = self.client.query(&stmt, &[&name, &watched])?;
        let Some(row) = rows.first() else { return Err(Error::Refused(format!("relation {name} does not exist"))) };
        let qualified: String = row.get(0);
        let relkind: String = row.get(1);
        let mut problems = Vec::new();
        if relkind != "r" && relkind != "p" {
            problems.push("it is not a plain table".to_string());
        }
        if row.get::<_, bool>(2) {
            problems.push("rules rewrite statements on it".to_string());
        }
        let columns: Vec<String> = row.get(3);
        let primary_key: Vec<String> = row.get(4);
        for t in row.get::<_, Vec<String>>(5) {
            problems.push(format!("trigger {t} runs on it"));
        }
        for fk in row.get::<_, Vec<String>>(6) {
            problems.push(format!("{fk} cascades changes to it"));
        }
        let oid = row.get::<_, i64>(7) as u32;
        let descendants = row
            .get::<_, serde_json::Value>(8)
            .as_array()
            .map(|a| a.iter().map(descendant).collect())
            .unwrap_or_default();
        let catalog_generation = row.get::<_, Option<i64>>(9);
        Ok(TableInfo {
            oid,
            qualified,
            columns,
            primary_key,
            problems,
            partitioned: relkind == "p",
            descendants,
            catalog_generation,
        })
    }

    /// The functions among `names` that are volatile (may change the database) and not known to
    /// be harmless.
    pub fn unsafe_functions(&mut self, names: &[String]) -> Result<Vec<String>> {
        let bare: Vec<String> = names
            .iter()
            .map(|n| n.rsplit('.').next().unwrap_or(n).to_string())
            .filter(|n| !HARMLESS_VOLATILE.contains(&n.as_str()))
            .collect();
        if bare.is_empty() {
            return Ok(vec![]);
        }
        let rows = self.client.query(
            "SELECT DISTINCT proname::text FROM pg_proc WHERE proname = ANY($1) AND provolatile = 'v' ORDER BY 1",
            &[&bare],
        )?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    /// Undoes every recorded change after `position`, newest first, in one transaction: all of
    /// it, or — on a conflict or error — none of it. Returns how many rows were restored.
    pub fn compensate_to(&mut self, position: u64) -> Result<u64> {
        let tx = self.client.transaction()?;
        let mut c = compensation::Compensation::new(tx, position);
        let entries = c.entries()?;
        for e in &entries {
            c.undo(e)?;
        }
        c.verify()?;
        c.commit()?;
        Ok(entries.len() as u64)
    }
}
